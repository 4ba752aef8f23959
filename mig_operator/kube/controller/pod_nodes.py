"""The cluster's Nodes as a pod's placement reads them: labels and taints, listed at most every
``NODE_LABELS_TTL_S`` and kept current between lists by the controller's watch on nodes, so a burst
of pods costs no list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from typing import Any

from mig_operator.core.placement.node_selection import (
    constrains_nodes,
    has_required_terms,
    node_allowed,
    taints_tolerated,
)

from ..common.client import KubeClient
from ..common.trim import node_body

HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_LABELS_TTL_S = 30.0


class NodeView:
    """Every Node's labels and taints, for the nodes a pod may go to and its hostname label."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self._labels: dict[str, dict[str, str]] = {}
        self._taints: dict[str, list[dict[str, Any]]] = {}
        self._listed_at = -float("inf")
        self._lock = asyncio.Lock()

    def changed(self, name: str, node: Mapping[str, Any] | None) -> None:
        """A Node's watch event (None: it is gone): its labels and taints as they are now."""
        if node is None:
            self._labels.pop(name, None)
            self._taints.pop(name, None)
            return
        self._labels[name] = dict((node.get("metadata") or {}).get("labels") or {})
        self._taints[name] = list((node.get("spec") or {}).get("taints") or [])

    async def labels(self) -> dict[str, dict[str, str]]:
        """Every node's labels (and taints): listed at most every NODE_LABELS_TTL_S, kept current by
        ``changed`` in between."""
        async with self._lock:
            if time.monotonic() - self._listed_at > NODE_LABELS_TTL_S:
                nodes = await self.client.list("/api/v1/nodes", keep=node_body)
                self._labels = {n["metadata"]["name"]: dict(n["metadata"].get("labels") or {}) for n in nodes}
                self._taints = {n["metadata"]["name"]: list((n.get("spec") or {}).get("taints") or []) for n in nodes}
                self._listed_at = time.monotonic()
            return self._labels

    async def eligible(self, pod: Mapping[str, Any], gpu_nodes: Collection[str]) -> list[str] | None:
        """Of ``gpu_nodes``, those the pod's nodeSelector, required node affinity and tolerations allow;
        None when it may go to every one, so its slice may go anywhere. (All of today's GPU nodes still
        restricts a pod with a selector: a GPU node that joins later may not match.)"""
        spec = pod.get("spec") or {}
        labels = await self.labels()
        constrained = constrains_nodes(spec)
        allowed = [n for n in sorted(gpu_nodes)
                   if (n in labels or not constrained) and (not constrained or node_allowed(spec, n, labels[n]))
                   and taints_tolerated(spec, self._taints.get(n, []))]
        if not constrained and len(allowed) == len(gpu_nodes):
            return None
        return allowed

    async def hostname(self, pod: Mapping[str, Any], node: str) -> str | None:
        """The node's kubernetes.io/hostname label, needed only to add to the pod's own required terms."""
        if not has_required_terms(pod.get("spec") or {}):
            return None
        return (await self.labels()).get(node, {}).get(HOSTNAME_LABEL)
