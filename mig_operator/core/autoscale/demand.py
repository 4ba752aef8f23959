"""What the waiting line asks of a node autoscaler, from the controller's books.

``plan_scale_up`` runs ``ScaleUp`` over the slices waiting for room, oldest first (a pod's group at
once). ``waiting_for_node`` is the refusal a slice placed by that plan shows instead of its own:
status reason ``WaitingForNode``, naming the pool. ``placeholders_wanted`` is how many placeholder pods
a pool needs: nodes already registered for it whose agent has not published their GPUs yet count as
coming, so a placeholder that brought a node is not made again once it is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..books.ledger import Ledger, SliceRecord
from ..books.quota import NO_QUOTA, QUOTA_EXCEEDED, admit
from ..placement.cluster import NO_SUCH_NODE, Binding, NodeInventory, Refusal, clip_message
from .nodes import of_pool, pool_allows
from .pools import NodePool
from .scale_up import ScaleUp, Waiting

WAITING_FOR_NODE = "WaitingForNode"
# Refusals no new node can end: a quota, or a slice pinned to a named node.
_NOT_FOR_NODES = (QUOTA_EXCEEDED, NO_QUOTA, NO_SUCH_NODE)


def scalable(code: str) -> bool:
    """Whether a slice refused with ``code`` could be placed on a new node."""
    return code not in _NOT_FOR_NODES and code != WAITING_FOR_NODE


def waiting_of(ledger: Ledger, info: SliceRecord) -> Waiting | None:
    """``info`` (with its group) as the scale-up plan takes it; None when no new node could be its
    place: pinned to a node, its group incomplete or partly bound, its pod not known, or past its
    namespace's quota whatever node it gets (a cluster with no GPU yet refuses it NoGpu, not
    QuotaExceeded)."""
    if info.pinned is not None or info.request is None:
        return None
    members = ledger.group_members(info)
    if info.group is not None and len(members) != info.group_size:
        return None
    if any(m.binding is not None or ledger.reserved(m.uid) is not None or m.request is None for m in members):
        return None
    quota, used = ledger.quotas.get(info.namespace), ledger.used(info.namespace)
    least = sum(m.request.memory_bytes or 0 for m in members if m.request is not None)
    if not admit(quota, used, least, at_least=True, slices=len(members)).allowed:
        return None
    spec = None
    if info.pod_owner is not None:
        pod = ledger.pod(info.namespace, info.group or info.name)
        if pod is None:
            return None
        spec = pod.body.get("spec") or {}
    requests = [(m.uid, m.request) for m in members if m.request is not None]
    def admits(bindings: Sequence[Binding]) -> bool:
        """What the slices would be granted on the new node against the quota (a fraction's grant, not
        the whole GPU a namespace holding it alone is charged: the binding's own check refines it)."""
        granted = sum(b.granted_bytes for b in bindings)
        return admit(quota, used, granted, slices=len(bindings)).allowed

    return Waiting(members[0].uid, info.namespace, requests, lambda pool: pool_allows(pool, spec), admits)


def plan_scale_up(ledger: Ledger, pools: Sequence[NodePool]) -> ScaleUp:
    """The new nodes the slices now waiting for room need, each pool's count and each slice's pool."""
    plan = ScaleUp(pools, ledger.settings)
    for info in ledger.pending():
        entry = ledger.waiting.get(info.uid)
        if entry is None or not scalable(entry[1]) or plan.pool_of(info.uid) is not None:
            continue
        waiting = waiting_of(ledger, info)
        if waiting is not None:
            plan.place(waiting)
    return plan


def waiting_for_node(refusal: Refusal, pool: str, asked: str) -> Refusal:
    """The refusal a slice shows while a new node of ``pool`` is asked for (``asked``: how, in words)."""
    return Refusal(WAITING_FOR_NODE, clip_message(
        f"waits for a new node of pool {pool}, asked of the node autoscaler ({asked}); no node has room now: "
        f"{refusal.message}"))


def coming_nodes(pool: NodePool, nodes: Mapping[str, Mapping[str, str]],
                 inventories: Mapping[str, NodeInventory]) -> int:
    """Nodes of ``pool`` (by their labels) registered but without a published inventory yet."""
    return sum(1 for name, labels in nodes.items() if of_pool(pool, labels) and name not in inventories)


def placeholders_wanted(needed: int, coming: int) -> int:
    return max(0, needed - coming)
