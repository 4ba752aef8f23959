"""Names the controller, the agents and the webhook share: the API, labels, finalizers, annotations."""

from __future__ import annotations

from mig_operator.core.books.slice_claim import DEVICE_CLASS as DEVICE_CLASS  # re-exported: the claim's class
from mig_operator.core.books.slice_claim import DRA_API as DRA_API
from mig_operator.core.node.cdi import DRIVER

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

# The field the agents select their slices by (the CRD's selectableFields): written by the controller
# when it binds a slice, write-once (a CEL transition rule on the CRD), so a slice never moves between
# agents silently.
SLICE_NODE_FIELD = "status.node"


def slices_of_node(node: str) -> str:
    """The field selector of the GpuSlices bound to ``node``."""
    return f"{SLICE_NODE_FIELD}={node}"


# The agent holds each slice it realises with this finalizer (removed when its instance is idle). A
# pod's slice carries it from creation; the controller adds it to a slice made by hand when it binds
# it, and removes it from a slice deleted before it was bound (no agent ever sees that one).
# Each part also has its own kopf storage prefix; kopf's own finalizer is named after it (kopf
# removes its finalizer from objects no handler of its needs, so it must not be the agent's).
AGENT_FINALIZER = "cdmo.io/agent"
CONTROLLER_PREFIX = "controller.cdmo.io"
WEBHOOK_PREFIX = "webhook.cdmo.io"  # kopf's own annotations and finalizer: the webhook process writes none
AGENT_PREFIX = "agent.cdmo.io"

# kopf's peering objects: the controller's replicas elect one active through this one.
PEERING_NAME = "mig-operator"

# Pods: the webhook marks an annotated pod with these, the controller finds it by the label.
POD_SLICE_LABEL = "cdmo.io/gpu-slice"  # value: the name of the pod's GpuSlice and ResourceClaim
# The labelled pods the controller watches and lists: a Running pod needs nothing of it (a gated pod is
# Pending; a finished one comes back as Succeeded or Failed), and its status changes (probes, restarts)
# would each be an event. A pod that starts Running leaves the watch as a DELETED event.
POD_WATCH_FIELDS = "status.phase!=Running"
SCHEDULING_GATE = "cdmo.io/gpu-slice"
# The claim entry the webhook adds to an annotated pod (spec.resourceClaims[].name and each
# container's resources.claims[].name).
POD_CLAIM_ENTRY = "gpu-slice"

# Dynamic Resource Allocation: the agents publish devices of this driver; each GpuSlice's
# ResourceClaim (same name) asks for one device of this class.
DRA_DRIVER = DRIVER  # core/node/cdi.py's: the CDI kind is named after it
# DRA_API and DEVICE_CLASS come from core/books/slice_claim.py, where the claim body is built.
# The node's directory the agent installs the shim into; the CDI spec of a fraction mounts it, read-only.
SHIM_HOST_DIR = "/var/lib/mig-operator/shim"
# On a pod's GpuSlice: the GPU nodes (comma-separated) the pod's nodeSelector and required node
# affinity allow, when they allow more than one (one: spec.nodeName); the binder chooses among them only.
ELIGIBLE_NODES_ANNOTATION = "cdmo.io/eligible-nodes"
# On each GpuSlice of a pod with several devices: the pod's group (its cdmo.io/gpu-slice label) and how
# many slices it has; the binder places a group's slices on one node together or not at all.
GROUP_ANNOTATION = "cdmo.io/group"
GROUP_SIZE_ANNOTATION = "cdmo.io/group-size"
# On a pod's GpuSlice: how many slices the pod has had, this one included (absent: the first).
SLICE_TRY_ANNOTATION = "cdmo.io/slice-try"
WEBHOOK_NAME = "mig-operator"
# On a Node, set by an admin to the time now once its GPUs' errors are dealt with (reset): the agent
# forgets each critical Xid it saw at or before that time (core/node/health.py, xids_to_clear).
HEALTH_CLEARED_ANNOTATION = "cdmo.io/gpu-health-cleared"
