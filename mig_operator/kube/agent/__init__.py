"""The node agent: the only part that touches NVML (one per GPU node, a DaemonSet in a cluster)."""
