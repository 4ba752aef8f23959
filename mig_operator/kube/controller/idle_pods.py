"""Idle pods evicted by their namespace's GpuQuota (``spec.idlePodTimeout``), and what the slices use, per
namespace, for the metrics.

Each node's agent writes its slices' ``status.usage`` and their condition ``Active`` (False, reason NoProcess,
``lastTransitionTime`` the moment the idle time began). A namespace whose GpuQuota sets ``idlePodTimeout`` has
a pod whose every slice has been Active=False that long evicted through the Eviction API (policy/v1), so its
PodDisruptionBudgets hold; Events named IdleEvicted on the pod and on each slice say why. A namespace
without a GpuQuota, or one without the field, evicts nothing.

A pod's slices are the ones made for it (their Pod owner reference, kept by the slices' watch: the
controller does not watch Running pods), together with any other GpuSlice whose claim the pod names.
Each pod is a key on the controller's work queue, ``("idle", namespace, pod)``: a slice's Active condition
that changes and a quota's ``idlePodTimeout`` that changes add it; its reconcile evicts the pod, or asks to
run again when the timeout will have passed (``Requeue``), or is done (a slice in use: its next change adds
the key again). A PodDisruptionBudget's refusal (429) posts one Warning Event and raises: the key comes
back after its back-off, as any failed write. The pod's own ``uid`` is the eviction's precondition, so a
pod made again under the same name is never evicted for its predecessor's idleness.

The gauges (``mig_operator_idle_slices``, ``mig_operator_idle_memory_bytes``,
``mig_operator_used_memory_bytes``) are computed from the slices the ledger holds, at most once a second
(key ``usage-metrics``), one series per namespace that has slices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from mig_operator.core.books.ledger import Ledger, SliceRecord
from mig_operator.core.requests.durations import parse_spec_duration
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.usage.figures import parse_usage
from mig_operator.core.usage.idle import (
    PodSlices,
    active_of,
    idle_deadline,
    inactive_since,
    pods_to_evict,
    short_duration,
)

from ..common import metrics
from ..common.client import ApiError, KubeClient, core_path
from ..common.events import EventPoster
from ..common.names import API_VERSION, SLICE_KIND
from ..common.workqueue import Requeue, WorkQueue

log = logging.getLogger("mig_operator.controller")

KIND = "idle"
METRICS_KEY = "usage-metrics"
IDLE_EVICTED = "IdleEvicted"
EVICTION_REFUSED = "IdleEvictionRefused"
# A pod's key comes back this much after its timeout passes, so that its run finds it passed.
SETTLE_S = 0.05


def idle_pod_timeout(spec: object) -> tuple[float | None, str]:
    """A GpuQuota spec's ``idlePodTimeout`` in seconds (None: absent, no idle pod is evicted), and why it
    is ignored when it cannot be read (the CRD's pattern refuses such a value; an API server that did not
    check it must not make the controller evict on a guess)."""
    if not isinstance(spec, Mapping) or spec.get("idlePodTimeout") is None:
        return None, ""
    try:
        return parse_spec_duration(spec["idlePodTimeout"]), ""
    except QuantityError as exc:
        return None, f"idlePodTimeout: {exc}"


def owner_pod(info: SliceRecord) -> tuple[str, str] | None:
    """The (name, uid) of the pod a slice was made for: its v1 Pod owner reference; None for a slice made directly."""
    for ref in info.body["metadata"].get("ownerReferences") or ():
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("name") and ref.get("uid"):
            return str(ref["name"]), str(ref["uid"])
    return None


def active_condition_of(info: SliceRecord) -> Mapping | None:
    return active_of((info.body.get("status") or {}).get("conditions"))


def eviction_body(namespace: str, name: str, uid: str) -> dict:
    """A policy/v1 Eviction of that pod, only while it is the pod of that ``uid``."""
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}}}


class IdlePods:
    """The ``idle`` keys (registered on the controller's queue) and the usage gauges per namespace."""

    def __init__(self, client: KubeClient, events: EventPoster, ledger: Ledger, queue: WorkQueue,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.client = client
        self.events = events
        self.ledger = ledger
        self.queue = queue
        self.clock = clock
        self.timeouts: dict[str, float] = {}  # namespace -> its GpuQuota's idlePodTimeout, seconds
        self._pods: dict[tuple[str, str], set[str]] = {}  # (namespace, pod name) -> its slices' uids
        self._conditions: dict[str, tuple[Any, ...]] = {}  # slice uid -> (its pod, its Active condition)
        # (namespace, slice name) -> the pods that name its claim besides their own slices' (a slice made directly).
        self._named_by: dict[tuple[str, str], set[str]] = {}
        self._refused: set[tuple[str, str]] = set()  # pods whose eviction a PodDisruptionBudget refused
        self._shown: set[str] = set()  # namespaces with usage gauges set
        self._published = 0.0
        queue.register(KIND, self.reconcile)

    # ---- observing -------------------------------------------------------------------------------

    def slice_event(self, info: SliceRecord | None, body: Mapping, deleted: bool) -> None:
        """A slice's watch event (``info``: as the ledger now holds it; None when deleted or older): its pod's
        key is added when its Active condition changed, and the gauges are computed again."""
        self._publish_soon()
        meta = body["metadata"]
        uid = str(meta.get("uid") or "")
        known = self._conditions.get(uid)
        if deleted or info is None:
            if deleted and known is not None:
                self._conditions.pop(uid, None)
                self._forget(known[0], uid)
                self._named_by.pop((str(meta.get("namespace")), str(meta.get("name"))), None)
            return
        pod = owner_pod(info)
        key = (info.namespace, pod[0]) if pod is not None else None
        seen = (key, dict(active_condition_of(info) or {}), info.deleting)
        if known == seen:
            return
        if known is not None and known[0] != key:
            self._forget(known[0], uid)
        self._conditions[uid] = seen
        if key is not None:
            self._pods.setdefault(key, set()).add(uid)
            self.queue.enqueue((KIND, *key))
        for other in self._named_by.get((info.namespace, info.name), ()):
            self.queue.enqueue((KIND, info.namespace, other))

    def _forget(self, key: tuple[str, str] | None, uid: str) -> None:
        if key is None:
            return
        uids = self._pods.get(key)
        if uids is not None:
            uids.discard(uid)
            if not uids:
                del self._pods[key]

    def quota_event(self, body: Mapping, deleted: bool) -> None:
        """A GpuQuota made, changed or removed: its namespace's pods are looked at again when its
        ``idlePodTimeout`` changed."""
        meta = body.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        timeout, error = (None, "") if deleted else idle_pod_timeout(body.get("spec"))
        if error:
            log.warning("GpuQuota %s/%s: %s; no pod of the namespace is evicted for being idle", namespace,
                        meta.get("name"), error)
        if self.timeouts.get(namespace) == timeout:
            return
        if timeout is None:
            self.timeouts.pop(namespace, None)
        else:
            self.timeouts[namespace] = timeout
        for pod_namespace, pod in list(self._pods):
            if pod_namespace == namespace:
                self.queue.enqueue((KIND, namespace, pod))

    # ---- a pod's key -------------------------------------------------------------------------------

    def timeout(self, namespace: str) -> float | None:
        """The namespace's idlePodTimeout while its GpuQuota exists (the books' full reads say so too)."""
        if self.ledger.quota_generation(namespace) is None:
            return None
        return self.timeouts.get(namespace)

    def _owned(self, namespace: str, pod: str) -> dict[str, list[SliceRecord]]:
        """The slices made for the pod named ``pod``, by the pod's uid (a pod made again under the name has
        its own), none being deleted among them."""
        by_uid: dict[str, list[SliceRecord]] = {}
        for uid in sorted(self._pods.get((namespace, pod), ())):
            info = self.ledger.slices.get(uid)
            owner = owner_pod(info) if info is not None else None
            if info is None or owner is None or owner[0] != pod:
                continue
            by_uid.setdefault(owner[1], []).append(info)
        return by_uid

    async def reconcile(self, namespace: str, pod: str) -> Requeue | None:
        timeout = self.timeout(namespace)
        later: float | None = None
        if timeout is not None:
            for pod_uid, owned in self._owned(namespace, pod).items():
                if any(s.deleting for s in owned) or len(owned) < max(s.group_size for s in owned):
                    continue  # its slices go (the pod finished), or not all of its group's are known yet
                wait = await self._one(namespace, pod, pod_uid, owned, timeout)
                if wait is not None:
                    later = wait if later is None else min(later, wait)
        # Not refused this time (a refusal raises): a later refusal is told again.
        self._refused.discard((namespace, pod))
        if (namespace, pod) not in self._pods:  # no slice of its own left: the pod is gone
            for (slice_namespace, _), pods in list(self._named_by.items()):
                if slice_namespace == namespace:
                    pods.discard(pod)
        return Requeue(later + SETTLE_S) if later is not None else None

    async def _one(self, namespace: str, pod: str, pod_uid: str, owned: list[SliceRecord],
                   timeout: float) -> float | None:
        """Evict the pod when its every slice has been idle ``timeout`` seconds: None when done (evicted,
        gone, or a slice in use), else the seconds until it will have been."""
        now = self.clock()
        left = _left_s(namespace, pod, owned, timeout, now)
        if left != 0.0:
            return left  # None: a slice in use (or not Ready), whose condition's change adds the key again
        # The pod may name other GpuSlices' claims (a slice made directly): each must be idle as long.
        try:
            body = await self.client.get(core_path("pods", namespace, pod))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        meta = body.get("metadata") or {}
        if meta.get("uid") != pod_uid or meta.get("deletionTimestamp") or \
                (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None  # another pod of the name, or one already going or finished
        slices = list(owned)
        for claim in (body.get("spec") or {}).get("resourceClaims") or ():
            name = claim.get("resourceClaimName") if isinstance(claim, Mapping) else None
            info = self.ledger.slice_named(namespace, name) if isinstance(name, str) else None
            if info is not None and all(info.uid != s.uid for s in slices):
                slices.append(info)
                self._named_by.setdefault((namespace, info.name), set()).add(pod)  # its changes add this key
        if len(slices) > len(owned):
            left = _left_s(namespace, pod, slices, timeout, now)
            if left != 0.0:
                return left
        await self._evict(namespace, pod, pod_uid, slices, timeout, now)
        return None

    async def _evict(self, namespace: str, pod: str, pod_uid: str, slices: list[SliceRecord], timeout: float,
                     now: datetime) -> None:
        since = max(inactive_since(active_condition_of(s)) or now for s in slices)
        idle_s = max(0.0, (now - since).total_seconds())
        names = ", ".join(s.name for s in slices)
        why = (f"every GPU slice of the pod ({names}) has had no process for {short_duration(idle_s)}, at least "
               f"its namespace's GpuQuota idlePodTimeout ({short_duration(timeout)})")
        message = f"{why}: evicted to give its GPU memory back"
        pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": namespace, "uid": pod_uid}}
        try:
            await self.client.request("POST", core_path("pods", namespace, pod) + "/eviction",
                                      body=eviction_body(namespace, pod, pod_uid), retry=False)
        except ApiError as exc:
            if exc.not_found or exc.conflict:
                return  # gone, or another pod under the name (the uid precondition)
            if exc.status == 429:
                # A PodDisruptionBudget holds it (or the API server asks to slow down): said once, tried again
                # after the key's back-off.
                if (namespace, pod) not in self._refused:
                    self._refused.add((namespace, pod))
                    metrics.IDLE_EVICTIONS.labels("refused").inc()
                    self.events.post(pod_ref, "Warning", EVICTION_REFUSED,
                                     f"not evicted although {why}: {exc.message}")
                    log.info("pod %s/%s idle, not evicted: %s", namespace, pod, exc.message)
            raise
        metrics.IDLE_EVICTIONS.labels("evicted").inc()
        log.info("pod %s/%s evicted: %s", namespace, pod, message)
        self.events.post(pod_ref, "Normal", IDLE_EVICTED, message)
        for info in slices:
            self.events.post(_slice_ref(info), "Normal", IDLE_EVICTED, f"pod {pod} evicted: {message}")

    # ---- the gauges ----------------------------------------------------------------------------------

    def _publish_soon(self) -> None:
        wait = 1.0 - (time.monotonic() - self._published)
        self.queue.add(METRICS_KEY, self.publish, wait)

    def publish(self) -> None:
        """Per namespace that has slices: how many are idle (Active=False), the memory granted to those,
        and the memory its slices use as their agents measured it."""
        self._published = time.monotonic()
        figures: dict[str, list[int]] = {}
        for info in self.ledger.slices.values():
            idle, idle_bytes, used = figures.setdefault(info.namespace, [0, 0, 0])
            status = info.body.get("status") or {}
            if inactive_since(active_condition_of(info)) is not None and not info.deleting:
                idle += 1
                idle_bytes += info.binding.granted_bytes if info.binding is not None else 0
            usage = parse_usage(status)
            used += usage.memory_used if usage is not None else 0
            figures[info.namespace] = [idle, idle_bytes, used]
        for namespace in self._shown - figures.keys():
            for gauge in (metrics.IDLE_SLICES, metrics.IDLE_MEMORY_BYTES, metrics.USED_MEMORY_BYTES):
                try:
                    gauge.remove(namespace)
                except KeyError:
                    pass
        for namespace, (idle, idle_bytes, used) in figures.items():
            metrics.IDLE_SLICES.labels(namespace).set(idle)
            metrics.IDLE_MEMORY_BYTES.labels(namespace).set(idle_bytes)
            metrics.USED_MEMORY_BYTES.labels(namespace).set(used)
        self._shown = set(figures)
        for uid in [u for u in self._conditions if u not in self.ledger.slices]:  # gone while a watch was away
            self._forget(self._conditions.pop(uid)[0], uid)


def _left_s(namespace: str, pod: str, slices: list[SliceRecord], timeout: float, now: datetime) -> float | None:
    """0 when the pod is to be evicted now (``pods_to_evict``); None when one of its slices is not idle;
    else the seconds until its every slice will have been idle ``timeout``."""
    candidate = PodSlices(namespace, pod, tuple(s.name for s in slices))
    conditions = {(namespace, s.name): active_condition_of(s) for s in slices}
    if pods_to_evict([candidate], conditions, {namespace: timeout}, now):
        return 0.0
    deadline = idle_deadline(candidate, conditions, timeout)
    return None if deadline is None else max(SETTLE_S, (deadline - now).total_seconds())


def _slice_ref(info: SliceRecord) -> dict:
    meta = info.body["metadata"]
    return {"apiVersion": API_VERSION, "kind": SLICE_KIND,
            "metadata": {"name": info.name, "namespace": info.namespace, "uid": info.uid,
                         "resourceVersion": str(meta.get("resourceVersion") or "")}}
