"""A slice's life on its node: the agent's lifecycle decisions, the CDI spec and the container's environment, the
node's other allocators and its container toolkit."""
