"""What the controller, the agents and the webhook share: API names, the client, status bodies,
Events, metrics, logging and how a kopf operator is started."""
