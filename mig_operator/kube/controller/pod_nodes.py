"""Where a pod may go, read from the Nodes the ledger keeps (``Ledger.nodes``, fed by the controller's
watch on nodes and its full lists): its slice is limited to the GPU nodes the pod allows."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from mig_operator.core.books.ledger import NodeRecord
from mig_operator.core.placement.node_selection import (
    constrains_nodes,
    has_required_terms,
    node_allowed,
    taints_tolerated,
)

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
