"""GPU nodes from a node autoscaler (chart value ``autoscaling``): what the controller asks for and
which nodes it keeps.

Node autoscalers provision only for pods the scheduler found Unschedulable, and an annotated pod waits
behind a scheduling gate, so the controller asks for nodes itself. Its ``capacity`` key plans the
waiting line against empty nodes of each configured pool (``core.autoscale.demand``) and keeps, per
pool, one CapacityBuffer (``autoscaling.x-k8s.io/v1beta1``, with a PodTemplate of the pool's node
shape) at that many replicas; where that API is not served, the same number of placeholder pods of a
low, non-preempting PriorityClass, each deleted once the scheduler has put it on a node (the node it
brought is there). A slice the plan places says so: Pending, reason ``WaitingForNode``, naming the pool.

Its ``node-keep`` key annotates the nodes a slice still needs (``Ledger.nodes_to_keep``) so neither
autoscaler removes them, and takes its own annotations off the others (``core.autoscale.nodes``).
Both keys are single, debounced, level-triggered: each run compares what is wanted with what the
books and the API server hold, and a failed write raises (the queue runs it again after its back-off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mig_operator.core.autoscale.demand import (
    coming_nodes,
    placeholders_wanted,
    plan_scale_up,
    scalable,
    waiting_for_node,
    waiting_of,
)
from mig_operator.core.autoscale.nodes import keep_patch
from mig_operator.core.autoscale.pools import AutoscalingOptions, NodePool, chunk_pod_spec
from mig_operator.core.autoscale.scale_up import ScaleUp
from mig_operator.core.books.ledger import Ledger, SliceRecord
from mig_operator.core.placement.cluster import Refusal

from ..common import metrics
from ..common.client import ApiError, KubeClient, core_path
from ..common.workqueue import WorkQueue
from .observe import node_record

log = logging.getLogger("mig_operator.controller")

BUFFERS_API = "/apis/autoscaling.x-k8s.io/v1beta1"
POOL_LABEL = "cdmo.io/autoscaling-pool"
ACTIVE_CAPACITY = "buffer.x-k8s.io/active-capacity"
DEBOUNCE_S = 0.5
DETECT_EVERY_S = 60.0


def object_name(pool: NodePool) -> str:
    """The CapacityBuffer's and its PodTemplate's name for ``pool``."""
    return f"mig-operator-{pool.name}"


class Autoscaling:
    def __init__(self, client: KubeClient, ledger: Ledger, queue: WorkQueue, options: AutoscalingOptions,
                 replan: Callable[[], None]) -> None:
        self.client = client
        self.ledger = ledger
        self.queue = queue
        self.options = options
        self.replan = replan
        self.plan = ScaleUp(options.pools, ledger.settings)
        self._placed: dict[str, str] = {}  # waiting slice uid -> pool, as the statuses were last told
        self._buffers: bool | None = None  # whether the CapacityBuffer API is served (auto), when last asked
        self._asked_at = 0.0

    # ---- asking ---------------------------------------------------------------------------------

    def changed(self) -> None:
        """Something the plan or the kept nodes read changed: both keys run soon (once for a burst)."""
        self.queue.add("capacity", self.reconcile, DEBOUNCE_S)
        self.queue.add("node-keep", self.keep_nodes, DEBOUNCE_S)

    def shown(self, info: SliceRecord, refusal: Refusal) -> tuple[Refusal, str | None]:
        """The refusal a waiting slice shows and the pool it names: ``WaitingForNode`` and the pool when a
        new node of a pool would take it (placed on the current plan, which a new slice joins at once),
        else its own refusal and None."""
        if not scalable(refusal.code):
            return refusal, None
        pool = self.plan.pool_of(info.uid)
        if pool is None:
            waiting = waiting_of(self.ledger, info)
            pool = self.plan.place(waiting) if waiting is not None else None
            self.changed()
        if pool is None:
            return refusal, None
        return waiting_for_node(refusal, pool, self._asked_how()), pool

    def _asked_how(self) -> str:
        namespace = self.options.namespace
        if self._uses_buffers():
            return f"CapacityBuffers in namespace {namespace}"
        return f"placeholder pods in namespace {namespace}"

    def _uses_buffers(self) -> bool:
        if self.options.backend != "auto":
            return self.options.backend == "capacitybuffer"
        return bool(self._buffers)

    # ---- the capacity key -------------------------------------------------------------------------

    async def reconcile(self) -> None:
        self.plan = plan_scale_up(self.ledger, self.options.pools)
        placed = {uid: pool for uid in self.ledger.waiting if (pool := self.plan.pool_of(uid)) is not None}
        if placed != self._placed:
            self._placed = placed
            self.replan()  # the waiting slices' statuses follow the plan
        await self._detect()
        nodes = {name: record.labels for name, record in self.ledger.nodes.items()}
        for pool in self.options.pools:
            needed = self.plan.nodes[pool.name]
            metrics.NODES_WANTED.labels(pool.name).set(needed)
            if self._uses_buffers():
                await self._buffer(pool, needed)
            else:
                await self._placeholders(pool, placeholders_wanted(
                    needed, coming_nodes(pool, nodes, self.ledger.inventories)))

    async def _detect(self) -> None:
        if self.options.backend != "auto" or time.monotonic() - self._asked_at < DETECT_EVERY_S:
            return
        try:
            await self.client.get(BUFFERS_API)
            served = True
        except ApiError as exc:
            if not exc.not_found:
                raise
            served = False
        self._asked_at = time.monotonic()
        if served != self._buffers:
            log.info("autoscaling: %s", "CapacityBuffers (autoscaling.x-k8s.io/v1beta1) are served: new nodes are "
                     "asked for through them" if served else "CapacityBuffers are not served: new nodes are asked "
                     "for with placeholder pods")
            self._buffers = served
            self._placed = {}  # the words a waiting slice shows name the way

    async def _buffer(self, pool: NodePool, replicas: int) -> None:
        """The pool's PodTemplate as its node shape, and its CapacityBuffer at ``replicas``."""
        name, namespace = object_name(pool), self.options.namespace
        template = {"metadata": {"labels": {POOL_LABEL: pool.name}},
                    "spec": chunk_pod_spec(pool, self.options.image)}
        path = core_path("podtemplates", namespace, name)
        try:
            have = await self.client.get(path)
        except ApiError as exc:
            if not exc.not_found:
                raise
            await self.client.create(core_path("podtemplates", namespace), {
                "apiVersion": "v1", "kind": "PodTemplate",
                "metadata": {"name": name, "labels": {POOL_LABEL: pool.name}}, "template": template})
        else:
            if have.get("template") != template:
                await self.client.json_patch(path, [{"op": "replace", "path": "/template", "value": template}])
        path = f"{BUFFERS_API}/namespaces/{namespace}/capacitybuffers/{name}"
        try:
            buffer = await self.client.get(path)
        except ApiError as exc:
            if not exc.not_found:
                raise
            await self.client.create(f"{BUFFERS_API}/namespaces/{namespace}/capacitybuffers", {
                "apiVersion": "autoscaling.x-k8s.io/v1beta1", "kind": "CapacityBuffer",
                "metadata": {"name": name, "labels": {POOL_LABEL: pool.name}},
                "spec": {"podTemplateRef": {"name": name}, "replicas": replicas,
                         "provisioningStrategy": ACTIVE_CAPACITY}})
            log.info("autoscaling: pool %s asks for %d new node(s) (CapacityBuffer %s/%s made)", pool.name, replicas,
                     namespace, name)
            return
        if (buffer.get("spec") or {}).get("replicas") != replicas:
            await self.client.merge_patch(path, {"spec": {"replicas": replicas}})
            log.info("autoscaling: pool %s asks for %d new node(s) (CapacityBuffer %s/%s)", pool.name, replicas,
                     namespace, name)

    async def _placeholders(self, pool: NodePool, wanted: int) -> None:
        """The pool's placeholder pods: each one the scheduler placed is deleted (its node is there), and
        as many wait unscheduled as ``wanted``."""
        namespace = self.options.namespace
        pods = await self.client.list(core_path("pods", namespace), label_selector=f"{POOL_LABEL}={pool.name}")
        waiting = []
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            if (pod.get("spec") or {}).get("nodeName"):
                await self._delete_pod(namespace, meta["name"])
                log.info("autoscaling: placeholder %s/%s brought node %s: deleted", namespace, meta["name"],
                         pod["spec"]["nodeName"])
            else:
                waiting.append(pod)
        for _ in range(wanted - len(waiting)):
            spec = chunk_pod_spec(pool, self.options.image)
            spec["priorityClassName"] = self.options.priority_class
            await self.client.create(core_path("pods", namespace), {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": f"mig-operator-placeholder-{pool.name}-",
                             "labels": {POOL_LABEL: pool.name}},
                "spec": spec})
        if wanted > len(waiting):
            log.info("autoscaling: pool %s asks for %d new node(s) (placeholder pods)", pool.name, wanted)
        surplus = sorted(waiting, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)
        for pod in surplus[:max(0, len(waiting) - wanted)]:
            await self._delete_pod(namespace, pod["metadata"]["name"])

    async def _delete_pod(self, namespace: str, name: str) -> None:
        try:
            await self.client.delete(core_path("pods", namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    # ---- the node-keep key ------------------------------------------------------------------------

    async def keep_nodes(self) -> None:
        """Annotate the nodes a slice still needs so no autoscaler removes them; let the others go."""
        keep = self.ledger.nodes_to_keep()
        failed: ApiError | None = None
        for name, record in list(self.ledger.nodes.items()):
            patch = keep_patch(name in keep, record.annotations)
            if patch is None:
                continue
            try:
                answer = await self.client.merge_patch(core_path("nodes", None, name),
                                                       {"metadata": {"annotations": patch}})
            except ApiError as exc:
                if not exc.not_found:
                    failed = failed or exc
                continue
            self.ledger.put_node(name, node_record(answer))
            log.info("node %s %s", name, "kept from the node autoscaler: a slice there is not in use yet"
                     if name in keep else "left to the node autoscaler again")
        if failed is not None:
            raise failed

