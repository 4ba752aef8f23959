"""Names the controller, the agents and the webhook share: the API, labels, finalizers, annotations."""

from __future__ import annotations

GROUP = "cdmo.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SLICES = "gpuslices"
NODES = "gpunodes"
SLICE_KIND = "GpuSlice"
NODE_KIND = "GpuNode"

# The label admins put on nodes whose MIG-enabled GPUs the operator may partition (ClearML's key).
MIG_NODE_LABEL = "cdmo.clear.ml/gpu-partitioning"
MIG_NODE_VALUE = "mig"

# Written by the controller when it binds a slice; the agents watch with a server-side selector on
# it. Write-once (a CEL transition rule on the CRD): a slice never moves between agents silently.
SLICE_NODE_LABEL = "cdmo.io/node"

# The agent holds each slice it realises with this finalizer (removed when its instance is idle).
# Each part also has its own kopf storage prefix; kopf's own finalizer is named after it (kopf-notes).
AGENT_FINALIZER = "cdmo.io/agent"
CONTROLLER_PREFIX = "controller.cdmo.io"
AGENT_PREFIX = "agent.cdmo.io"

# kopf's peering objects: the controller's replicas elect one active through this one.
PEERING_NAME = "mig-operator"

# Pods: the webhook marks an annotated pod with these, the controller finds it by the label.
POD_SLICE_LABEL = "cdmo.io/gpu-slice"  # value: the name of the pod's GpuSlice and ConfigMap
SCHEDULING_GATE = "cdmo.io/gpu-slice"
# On a pod's GpuSlice: the GPU nodes (comma-separated) the pod's nodeSelector and required node
# affinity allow, when they allow more than one (one: spec.nodeName); the binder chooses among them only.
ELIGIBLE_NODES_ANNOTATION = "cdmo.io/eligible-nodes"
SHIM_VOLUME = "cdmo-shim"
SHIM_HOST_DIR = "/var/lib/mig-operator/shim"
SHIM_MOUNT_DIR = "/usr/local/lib/cdmo"
SHIM_LIBRARY = "libgpuslice.so"
WEBHOOK_NAME = "mig-operator"
