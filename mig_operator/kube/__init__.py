"""Kubernetes I/O: kopf handlers for the controller, the node agent, pods and inventory."""
