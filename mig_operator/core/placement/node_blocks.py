"""Nodes that take no new slice, and what a slice that waits for them says.

A node is blocked when its GpuNode says another allocator hands its GPUs out too (the
``DevicePluginConflict`` condition, ``core.node.device_plugin``), or that its container runtime is not
trusted (``RuntimeTrusted`` False, ``core.node.runtime_trust``) and no admin labelled it
``cdmo.io/runtime-trust=accepted``, or when a node autoscaler is removing it (a removal taint,
``core.autoscale.nodes``). A blocked node's GPUs are offered to no new slice; the slices
bound there stay, and count. This is the one place these rules are applied (``ClusterPlanner``).

Pure: the inputs are what the GpuNode's status and the Node's labels say.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ..node.device_plugin import conflict_message
from ..node.runtime_trust import untrusted_message
from ..requests.request import SliceRequest

# Refusal codes, for status.reason of a slice that can only go to blocked nodes.
# NVIDIA's device plugin advertises the node's GPUs too: two allocators would give them away twice.
DEVICE_PLUGIN_CONFLICT = "DevicePluginConflict"
# The node's GpuNode has RuntimeTrusted=False and the Node is not labelled cdmo.io/runtime-trust=accepted.
RUNTIME_UNTRUSTED = "RuntimeUntrusted"
# A node autoscaler is removing the node (Karpenter's karpenter.sh/disrupted, Cluster Autoscaler's
# ToBeDeletedByClusterAutoscaler taint).
NODE_LEAVING = "NodeLeaving"

_SHOWN = 5


@dataclass(frozen=True)
class NodeBlock:
    """Why one node takes no new slice: ``code`` for a slice's reason, ``message`` (the full text and
    the ways out) when it is the only node in reach, ``short`` when several are listed."""

    code: str
    message: str
    short: str


def node_block(node: str, device_plugin_conflict: tuple[str, ...], runtime_untrusted: str | None,
               runtime_accepted: bool, leaving: str | None = None) -> NodeBlock | None:
    """Whether ``node`` takes no new slice. A node being removed comes first (nothing makes it stay),
    then a device plugin conflict: no label of ours makes two allocators of one GPU safe (the agent's
    own label, ``cdmo.io/device-plugin-shared``, clears the condition itself)."""
    if leaving is not None:
        return NodeBlock(NODE_LEAVING, f"node {node} is being removed by the node autoscaler (taint {leaving}); "
                         "slices go to other nodes", f"taint {leaving}")
    if device_plugin_conflict:
        return NodeBlock(DEVICE_PLUGIN_CONFLICT, conflict_message(node, device_plugin_conflict),
                         ", ".join(device_plugin_conflict))
    if runtime_untrusted is not None and not runtime_accepted:
        return NodeBlock(RUNTIME_UNTRUSTED, untrusted_message(node, runtime_untrusted), "RuntimeTrusted=False")
    return None


def blocked_code(blocked: Mapping[str, NodeBlock]) -> str:
    """The code of a slice every node in whose reach is blocked: the most common block's (a tie goes
    to the code that sorts first, so the reason never depends on the order nodes arrive in)."""
    counts = Counter(b.code for b in blocked.values())
    return min(counts, key=lambda code: (-counts[code], code))


def blocked_text(request: SliceRequest, blocked: Mapping[str, NodeBlock]) -> str:
    """Why a slice waits when every node it may use is blocked: one node, its full message (the cause
    and the ways out); several, a count and the first few."""
    if len(blocked) == 1:
        ((_, block),) = blocked.items()
        return f"{request.describe()} waits: {block.message}"
    return f"{request.describe()} waits: {blocked_note(blocked)}"


def blocked_note(blocked: Mapping[str, NodeBlock]) -> str:
    """The blocked nodes in reach, for a refusal that lists them beside other reasons."""
    shown = sorted(blocked)[:_SHOWN]
    named = ", ".join(f"{n} ({blocked[n].short})" for n in shown) + (" ..." if len(blocked) > _SHOWN else "")
    kinds = sorted({b.code for b in blocked.values()})
    why = []
    if NODE_LEAVING in kinds:
        why.append("a node autoscaler removes them")
    if DEVICE_PLUGIN_CONFLICT in kinds:
        why.append("NVIDIA's device plugin also advertises their GPUs (GpuNode condition DevicePluginConflict)")
    if RUNTIME_UNTRUSTED in kinds:
        why.append("their container runtime is not trusted (GpuNode condition RuntimeTrusted=False; the Node label "
                   "cdmo.io/runtime-trust=accepted accepts it)")
    return f"{len(blocked)} node(s) take no new slice while {' or '.join(why)}: {named}"
