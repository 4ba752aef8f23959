"""Where a pod may go, read from the Nodes the ledger keeps (``Ledger.nodes``, fed by the controller's
watch on nodes and its full lists): its slice is limited to the GPU nodes the pod allows, and of those
to the ones its requests fit (``fitting``).

What pods bound to a node ask is read when a pod's slice is placed, by one list per candidate node
(field selector ``spec.nodeName``, which the API server answers from its watch cache by an index), not
by a watch of every pod: such a watch would hold and handle every pod of the cluster to serve the few
on GPU nodes. A node whose allocatable alone cannot hold the pod is dropped without a list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from mig_operator.core.books.ledger import NodeRecord
from mig_operator.core.placement.node_selection import (
    constrains_nodes,
    has_required_terms,
    node_allowed,
    taints_tolerated,
)
from mig_operator.core.placement.pod_fit import NodeUse, Shortfall, node_use, pod_requests, shortfalls
from mig_operator.core.requests.quantities import QuantityError

from ..common.client import KubeClient
from ..common.trim import bound_pod_body

HOSTNAME_LABEL = "kubernetes.io/hostname"


def eligible(pod: Mapping[str, Any], gpu_nodes: Collection[str], nodes: Mapping[str, NodeRecord]) -> list[str] | None:
    """Of ``gpu_nodes``, those the pod's nodeSelector, required node affinity and tolerations allow
    (``nodes``: every Node's labels and taints); None when it may go to every one, so its slice may go
    anywhere. (All of today's GPU nodes still restricts a pod with a selector: a GPU node that joins
    later may not match.)"""
    spec = pod.get("spec") or {}
    constrained = constrains_nodes(spec)
    allowed = []
    for name in sorted(gpu_nodes):
        node = nodes.get(name)
        if constrained and (node is None or not node_allowed(spec, name, node.labels)):
            continue
        if taints_tolerated(spec, node.taints if node is not None else ()):
            allowed.append(name)
    if not constrained and len(allowed) == len(gpu_nodes):
        return None
    return allowed


def hostname(pod: Mapping[str, Any], node: str, nodes: Mapping[str, NodeRecord]) -> str | None:
    """The node's kubernetes.io/hostname label, needed only to add to the pod's own required terms."""
    if not has_required_terms(pod.get("spec") or {}):
        return None
    record = nodes.get(node)
    return record.labels.get(HOSTNAME_LABEL) if record is not None else None


# The pods a node's resources are taken by: those bound to it and not finished.
BOUND_PODS_FIELDS = "spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
NO_USE = NodeUse({}, 0)


async def node_uses(client: KubeClient, names: Iterable[str]) -> dict[str, NodeUse]:
    """What the pods bound to each node of ``names`` ask together, one list per node, read at once."""
    names = list(names)
    listed = await asyncio.gather(*(client.list("/api/v1/pods", field_selector=BOUND_PODS_FIELDS.format(node=name),
                                                keep=bound_pod_body) for name in names))
    return {name: node_use(pods) for name, pods in zip(names, listed, strict=True)}


def _shortfalls(asks: Mapping[str, int], record: NodeRecord | None, use: NodeUse) -> tuple[Shortfall, ...]:
    """Why the pod does not fit the node; nothing for a node whose allocatable is not known or cannot
    be read (kube-scheduler then judges alone)."""
    if record is None or not record.allocatable:
        return ()
    try:
        return shortfalls(asks, record.allocatable, use)
    except QuantityError:
        return ()


async def fitting(client: KubeClient, pod: Mapping[str, Any], candidates: Collection[str],
                  nodes: Mapping[str, NodeRecord]) -> tuple[list[str], dict[str, tuple[Shortfall, ...]]]:
    """Of ``candidates``, the nodes the pod's requests fit (in order), and why each other one does not."""
    try:
        asks = pod_requests(pod.get("spec") or {})
    except QuantityError:
        return list(candidates), {}  # the API server validated them: not reached
    # The allocatable alone first: a node too small for the pod needs no list.
    misfits = {name: found for name in candidates if (found := _shortfalls(asks, nodes.get(name), NO_USE))}
    if not asks:
        # A pod that asks for nothing but its place among the node's pods reads no list (the hot path of
        # most GPU pods): a node whose pod count is full is rare, and one is caught by kube-scheduler's
        # Unschedulable, after which the slice is given back.
        return [name for name in candidates if name not in misfits], misfits
    open_nodes = [name for name in candidates if name not in misfits and nodes.get(name) is not None
                  and nodes[name].allocatable]
    uses = await node_uses(client, open_nodes) if open_nodes else {}
    for name, use in uses.items():
        found = _shortfalls(asks, nodes.get(name), use)
        if found:
            misfits[name] = found
    return [name for name in candidates if name not in misfits], misfits
