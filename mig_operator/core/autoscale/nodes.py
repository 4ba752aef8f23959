"""Nodes a node autoscaler removes, and nodes it must leave alone.

A node tainted for removal (Karpenter's ``karpenter.sh/disrupted``, Cluster Autoscaler's
``ToBeDeletedByClusterAutoscaler``) takes no new slice. A node where a slice is bound and its pod is
not running yet (or a GpuSlice made directly, whose device is held for whoever names its claim) is
kept: the operator annotates it so that neither autoscaler removes it, and takes its annotations off
when no such slice is left. It only ever removes the annotations it added itself (its mark lists
them), so an admin's own ``karpenter.sh/do-not-disrupt`` stays, whatever its value.

Idle instances hold no node: they are neither pods nor allocated claims, so a node with only idle
instances looks empty to the autoscaler and is removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..placement.node_selection import node_allowed, taints_tolerated
from .pools import NodePool

LEAVING_TAINTS = ("karpenter.sh/disrupted", "ToBeDeletedByClusterAutoscaler")
KEEP_ANNOTATIONS = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/scale-down-disabled": "true",
}
# On a node the operator keeps: which of KEEP_ANNOTATIONS it set (comma-separated), so that it takes
# off only those.
KEPT_MARK = "cdmo.io/kept-for-slices"
WATCHED_ANNOTATIONS = (*KEEP_ANNOTATIONS, KEPT_MARK)


def leaving(taints: Sequence[Mapping[str, Any]]) -> str | None:
    """The removal taint a node carries (it takes no new slice), or None."""
    for taint in taints:
        if isinstance(taint, Mapping) and taint.get("key") in LEAVING_TAINTS:
            return str(taint["key"])
    return None


def keep_patch(keep: bool, annotations: Mapping[str, str]) -> dict[str, str | None] | None:
    """The merge patch of a node's annotations that keeps it (``keep``) or lets it go, or None when they
    already say so. Keeping adds the annotations not already there, and the mark naming them; letting go
    removes what the mark names, and the mark."""
    marked = annotations.get(KEPT_MARK)
    if keep:
        if marked is not None:
            return None
        added = [k for k in KEEP_ANNOTATIONS if k not in annotations]  # one already there is an admin's
        return {**{k: KEEP_ANNOTATIONS[k] for k in added}, KEPT_MARK: ",".join(added) or "-"}
    if marked is None:
        return None
    ours = [k for k in marked.split(",") if k in KEEP_ANNOTATIONS]
    return {**{k: None for k in ours}, KEPT_MARK: None}


def pool_allows(pool: NodePool, spec: Mapping[str, Any] | None) -> bool:
    """Whether a pod with this spec (None: a GpuSlice made directly, no pod) may run on a new node of
    ``pool``: its node selector and required affinity against the pool's labels, its tolerations
    against the pool's taints."""
    if spec is None:
        return True
    return node_allowed(spec, "", pool.labels) and taints_tolerated(spec, pool.taints)


def of_pool(pool: NodePool, labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` is one of ``pool``'s (it carries every label of the pool)."""
    return all(labels.get(k) == v for k, v in pool.labels.items())
