"""One allocator per GPU: whether NVIDIA's device plugin also hands out the GPUs of a node.

If the device plugin advertises ``nvidia.com/gpu`` (or ``nvidia.com/gpu.shared``, its time-slicing
name, or ``nvidia.com/mig-<profile>``) on a node the agent serves, kube-scheduler gives those GPUs to
pods that ask for them while the operator gives the same GPUs to slices: a whole-GPU pod lands on a
GPU holding fractions, the plugin hands out an instance a slice owns. The agent reads its Node's
capacity and allocatable, decides here whether they conflict, and writes the answer as a GpuNode
condition; the controller places no new slice on a node whose condition is True (``core.placement.cluster``),
until the plugin is gone or an admin labels the node as shared deliberately.

Pure: the inputs are the Node's maps, the output is the condition's fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

# The GpuNode condition and its reasons.
CONDITION_TYPE = "DevicePluginConflict"
REASON_CONFLICT = "DevicePluginResources"  # True: no new slices on the node
REASON_SHARED = "SharedDeliberately"  # False: the plugin's resources are there, an admin accepted them
REASON_NONE = "NoDevicePluginResources"  # False: nothing else hands out the node's GPUs

# The Node label an admin sets to say that the plugin and the operator share the node on purpose
# (e.g. the plugin serves GPUs the operator's slices never use): slices are placed there again.
SHARED_LABEL = "cdmo.io/device-plugin-shared"
SHARED_VALUE = "true"

# The GPU Operator's per-node switch for its device plugin DaemonSet: what resolves the conflict.
GPU_OPERATOR_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"

# Resource names NVIDIA's device plugin advertises: whole GPUs, time-sliced GPUs, and MIG devices
# (mixed strategy: one name per profile, e.g. nvidia.com/mig-1g.10gb, and their .shared forms).
_EXACT = frozenset({"nvidia.com/gpu", "nvidia.com/gpu.shared"})
_PREFIX = "nvidia.com/mig-"

_QUANTITY = re.compile(r"^\s*\+?(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def is_device_plugin_resource(name: str) -> bool:
    """Whether ``name`` is a resource NVIDIA's device plugin hands out (``example.com/gpu`` is not)."""
    return name in _EXACT or (name.startswith(_PREFIX) and len(name) > len(_PREFIX))


def _nonzero(value: object) -> bool:
    """Whether a capacity quantity is above zero. Extended resources are whole numbers (``"8"``);
    a value that does not parse counts as non-zero, so an unexpected spelling blocks rather than lets
    two allocators share GPUs unseen."""
    match = _QUANTITY.match(str(value))
    if match is None:
        return True
    try:
        return Decimal(match.group(1)) != 0
    except InvalidOperation:
        return True


def device_plugin_resources(capacity: Mapping[str, object] | None,
                            allocatable: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """The device plugin's resource names that a Node's capacity or allocatable shows above zero, sorted.

    Both maps count: the kubelet keeps a stopped plugin's resource in capacity (with allocatable 0)
    for a grace period, and the pods it already placed still hold their GPUs then.
    """
    names = {
        name
        for source in (capacity or {}, allocatable or {})
        for name, value in source.items()
        if is_device_plugin_resource(name) and _nonzero(value)
    }
    return tuple(sorted(names))


def shared_deliberately(labels: Mapping[str, str] | None) -> bool:
    """Whether an admin labelled the Node ``cdmo.io/device-plugin-shared=true``."""
    return str((labels or {}).get(SHARED_LABEL, "")).strip().lower() == SHARED_VALUE


@dataclass(frozen=True)
class DevicePluginCheck:
    """What the agent writes to its GpuNode about the device plugin."""

    node: str
    resources: tuple[str, ...] = ()  # the device plugin's resources the Node advertises (non-zero)
    shared: bool = False  # the Node carries cdmo.io/device-plugin-shared=true

    @property
    def conflict(self) -> bool:
        """True when the operator must place no new slice on the node."""
        return bool(self.resources) and not self.shared

    @property
    def reason(self) -> str:
        if not self.resources:
            return REASON_NONE
        return REASON_SHARED if self.shared else REASON_CONFLICT

    @property
    def message(self) -> str:
        names = ", ".join(self.resources)
        if not self.resources:
            return f"no device plugin advertises NVIDIA GPUs on node {self.node}: the operator is its only allocator"
        if self.shared:
            return (
                f"node {self.node} advertises {names} from a device plugin as well, and is labelled "
                f"{SHARED_LABEL}={SHARED_VALUE}: new slices are placed here, and the admin keeps the two "
                "allocators off each other's GPUs"
            )
        return conflict_message(self.node, self.resources)

    def condition(self, last_transition_time: str) -> dict[str, str]:
        """The GpuNode condition (Kubernetes' condition shape)."""
        return {
            "type": CONDITION_TYPE, "status": "True" if self.conflict else "False", "reason": self.reason,
            "message": self.message, "lastTransitionTime": last_transition_time,
        }


def conflict_message(node: str, resources: tuple[str, ...]) -> str:
    """Why a node takes no new slices, and the two ways out, for the GpuNode condition, its Event and
    the reason of a slice that can only go there."""
    names = ", ".join(resources) or "nvidia.com/gpu"
    return (
        f"node {node} advertises {names}: NVIDIA's device plugin hands out its GPUs too, so two allocators "
        f"would give the same GPUs away; no new slice is placed there (slices already there are kept). "
        f"Turn the plugin off on this node (GPU Operator: kubectl label node {node} "
        f"{GPU_OPERATOR_PLUGIN_LABEL}=false), or, to share the node deliberately, "
        f"kubectl label node {node} {SHARED_LABEL}={SHARED_VALUE}"
    )


def check_node(node: str, body: Mapping | None) -> DevicePluginCheck:
    """The check of one Node object (as the API returns it); no Node: no conflict."""
    body = body or {}
    node_status = body.get("status") or {}
    labels = (body.get("metadata") or {}).get("labels") or {}
    return DevicePluginCheck(
        node,
        device_plugin_resources(node_status.get("capacity"), node_status.get("allocatable")),
        shared_deliberately(labels),
    )


def conflict_from_conditions(conditions: object, resources: object) -> tuple[str, ...]:
    """The resources that stop placement on a node, read back from its GpuNode status: empty unless
    the ``DevicePluginConflict`` condition is True. A True condition always blocks, even when the
    resource list is missing or malformed (then it names ``nvidia.com/gpu``)."""
    if not isinstance(conditions, list):
        return ()
    for cond in conditions:
        if isinstance(cond, Mapping) and cond.get("type") == CONDITION_TYPE:
            if str(cond.get("status")) != "True":
                return ()
            names = tuple(sorted({str(r) for r in resources} if isinstance(resources, list) else ()))
            return names or ("nvidia.com/gpu",)
    return ()
