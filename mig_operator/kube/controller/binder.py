"""The controller's one job for GpuSlices: bind each to a node, GPU, mode, profile and placement.

Decisions are ``core.cluster.plan_binding`` on a view built from the GpuNode inventories and every
binding already made, including those whose status write is still in flight; the plan and its
reservation happen under one lock, the writes outside it, so binding throughput is the planner's
and two slices bound in the same second never get one placement.

A binding is one write: ``status`` (phase Bound and the decision, with the resourceVersion planned
from as a precondition). The agents select their slices by ``status.node`` (a field selector), so
that write is what hands a slice to its agent. A pod's slice carries the agent's finalizer from
creation; a slice made by hand gets it in a second write (the status subresource takes no metadata),
and its agent waits for it (``core.lifecycle.agent_step``); a controller that dies between the two
writes adds it on its next pass (``mark``). A slice deleted before it was bound never reaches an
agent: the controller takes the finalizer off it (``_let_go_unbound``).

Quotas and the fair order (``core.quota``): a binding that would take its namespace past its
GpuQuota is not made (the slice stays Pending, reason QuotaExceeded). While slices wait, a new slice
joins the line instead of being bound at once, and each pass serves the line in fair order: the
namespace holding the smallest share of its quota first, then its oldest slice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from mig_operator.core.cluster import MODE_MIG, NO_CAPACITY, Binding, Refusal, binding_from_status, describe_binding
from mig_operator.core.planner import PlannerSettings
from mig_operator.core.quota import (
    DEFAULT_HOLD_S,
    NO_QUOTA,
    QUOTA_EXCEEDED,
    FairQueue,
    admit,
    held_behind,
    holds_back,
    quota_missing,
)

from ..common import metrics, status
from ..common.client import ApiError, KubeClient, gpunodes_path, slice_path, slices_path
from ..common.events import EventPoster
from ..common.faults import crashpoint
from ..common.finalizers import remove_finalizer
from ..common.names import AGENT_FINALIZER
from .state import PLACEMENT_LABELS, ClusterState, SliceInfo

log = logging.getLogger("mig_operator.controller")
QUOTAS_PATH = "/apis/cdmo.io/v1alpha1/gpuquotas"


@dataclass(frozen=True)
class BindOutcome:
    """What one attempt to bind a slice came to: bound, or the refusal's code and whether the room it
    waits for can free (``could_fit``: False when its quota cannot hold it even alone)."""

    bound: bool
    code: str = ""
    could_fit: bool = True


def _created_s(created: str) -> float | None:
    """A creationTimestamp (RFC 3339) as seconds since the epoch; None when absent or not one."""
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class Binder:
    def __init__(self, client: KubeClient, events: EventPoster, planner: PlannerSettings | None = None,
                 resync_s: float = 30.0, hold_s: float = DEFAULT_HOLD_S, quota_required: bool = False) -> None:
        self.client = client
        self.quota_required = quota_required  # a namespace without a GpuQuota gets nothing (NoQuota)
        self.events = events
        self.planner = planner or PlannerSettings()
        self.state = ClusterState()
        self.resync_s = resync_s
        self.hold_s = hold_s
        # Slices refused and waiting: uid -> (namespace, reason), for the line, the metrics and the quotas.
        self.waiting: dict[str, tuple[str, str]] = {}
        self._waiting_by_namespace: dict[str, int] = {}
        self._waiting_for_room = 0  # how many of them wait for GPU room (NoCapacity)
        self._hold_ends: set[float] = set()  # when holds end (epoch seconds): a pass is due then
        self._lock = asyncio.Lock()
        # Slices whose binding this replica is writing: its own status write's watch event may arrive
        # before the write returns, and must not start a second finalizer write beside the writer's.
        self._writing: set[str] = set()
        self._replan_task: asyncio.Task | None = None
        self._replan_again = False
        self._last_resync = 0.0
        self._counted = 0.0
        self._count_later: asyncio.TimerHandle | None = None
        self.on_resync: list[Callable[[], Awaitable[None]]] = []
        self.on_slice_changed: list[Callable[[SliceInfo], Awaitable[None]]] = []
        # Told the namespace whose quota use or waiting slices may have changed (the GpuQuota status).
        self.on_namespace_changed: list[Callable[[str], None]] = []

    # ---- full lists ----------------------------------------------------------------------------

    async def resync(self) -> None:
        """Read slices, inventories and labelled nodes afresh, then finish what is unfinished
        (and whatever else registered in ``on_resync``, e.g. the pods)."""
        async with self._lock:
            slices, inventories, quotas, *labelled = await asyncio.gather(
                self.client.list(slices_path()), self.client.list(gpunodes_path()), self._list_quotas(),
                *(self.client.list("/api/v1/nodes", label_selector=f"{k}={v}") for k, v in PLACEMENT_LABELS),
            )
            nodes = {n["metadata"]["name"]: n for listed in labelled for n in listed}
            self.state.replace_all(slices, inventories, nodes.values())
            self.state.replace_quotas(quotas)
            self._last_resync = time.monotonic()
            for uid in [uid for uid in self.waiting if uid not in self.state.slices]:
                self._set_waiting(uid, None)
        for namespace in {s.namespace for s in self.state.slices.values()} | set(self.state.quotas):
            self._namespace_changed(namespace)
        for info in list(self.state.slices.values()):
            if info.binding is not None and not info.marked and not info.deleting and info.uid not in self._writing:
                await self._guard(self.mark(info))
        for extra in self.on_resync:
            await self._guard(extra())
        self.request_replan()

    async def _list_quotas(self) -> list[dict]:
        """Every GpuQuota; none when the CRD is not installed (an upgrade that skipped
        ``kubectl apply -f crds/``): then no namespace has a limit, as before quotas existed."""
        try:
            return await self.client.list(QUOTAS_PATH)
        except ApiError as exc:
            if not exc.not_found:
                raise
            log.warning("GpuQuotas cannot be listed (is crds/gpuquota.yaml applied?): no namespace is limited")
            return []

    def maybe_resync(self) -> None:
        """Resync when the last one is older than ``resync_s``; driven by events, so a paused
        (standby) replica, which gets none, does nothing."""
        if time.monotonic() - self._last_resync > self.resync_s:
            self._last_resync = time.monotonic()
            asyncio.get_running_loop().create_task(self._guard(self.resync()))

    async def _guard(self, work: object) -> None:
        try:
            await work  # type: ignore[misc]
        except ApiError as exc:
            metrics.RECONCILE_ERRORS.labels("controller", "api").inc()
            log.warning("controller pass failed, the next event retries: %s", exc)

    # ---- events --------------------------------------------------------------------------------

    async def slice_event(self, body: dict, deleted: bool) -> None:
        if deleted:
            gone = self.state.remove_slice(body["metadata"]["uid"])
            self.events.forget(body["metadata"]["uid"])
            self._set_waiting(body["metadata"]["uid"], None)
            self._namespace_changed(body["metadata"]["namespace"])
            if gone is not None and gone.binding is not None:
                self.request_replan()  # its room and its quota charge are free (or idle) now
            return
        info = self.state.put_slice(body)
        if info is None:
            return
        self._namespace_changed(info.namespace)
        if info.binding is not None or info.deleting or info.phase not in (None, "Pending"):
            self._set_waiting(info.uid, None)
        if info.deleting:
            # A bound slice keeps its room and its quota charge until it is gone: its agent releases
            # it, at once or once its claim is no longer in use.
            if info.binding is None and AGENT_FINALIZER in (info.body["metadata"].get("finalizers") or ()):
                await self._let_go_unbound(info)
            return
        if info.invalid and info.phase != "Failed":
            await self._write(info, status.failed(info.body.get("status"), "InvalidSpec", info.invalid))
            self.events.post(info.body, "Warning", "InvalidSpec", info.invalid)
        elif info.binding is None and info.phase in (None, "Pending"):
            if not self._in_line(info.namespace):
                await self.bind(info.uid)
            elif info.phase is None:
                self.request_replan()  # slices wait: a new one joins the line rather than jump it
        elif info.binding is not None and not info.marked and info.uid not in self._writing:
            await self.mark(info)
        for callback in self.on_slice_changed:
            await callback(self.state.slices.get(info.uid, info))
        self.maybe_resync()

    def inventory_event(self, body: dict, deleted: bool) -> None:
        changed = self.state.remove_inventory(body) if deleted else self.state.put_inventory(body)
        for namespace in changed:  # a device its agent holds for a slice that is gone
            self._namespace_changed(namespace)
        self.request_replan()
        self.maybe_resync()

    def node_event(self, name: str, labels: Mapping[str, str] | None) -> None:
        """A Node's labels changed (None: it is gone): the MIG label, fraction sharing, runtime trust."""
        if self.state.set_node_labels(name, labels):
            self.request_replan()

    def quota_event(self, body: dict, deleted: bool) -> None:
        """A GpuQuota changed: raised, lowered, made or removed; the waiting slices are planned again."""
        if deleted:
            self.state.remove_quota(body)
        elif not self.state.put_quota(body) and body["metadata"]["namespace"] in self.state.quota_errors:
            log.warning("GpuQuota %s/%s is ignored: %s", body["metadata"]["namespace"], body["metadata"]["name"],
                        self.state.quota_errors[body["metadata"]["namespace"]])
        self._namespace_changed(body["metadata"]["namespace"])
        self.request_replan()
        self.maybe_resync()

    # ---- the line of waiting slices --------------------------------------------------------------

    def _set_waiting(self, uid: str, entry: tuple[str, str] | None) -> None:
        old = self.waiting.pop(uid, None)
        if old is not None:
            self._waiting_by_namespace[old[0]] -= 1
            if not self._waiting_by_namespace[old[0]]:
                del self._waiting_by_namespace[old[0]]
            self._waiting_for_room -= old[1] == NO_CAPACITY
        if entry is not None:
            self.waiting[uid] = entry
            self._waiting_by_namespace[entry[0]] = self._waiting_by_namespace.get(entry[0], 0) + 1
            self._waiting_for_room += entry[1] == NO_CAPACITY
        if old != entry:
            for namespace in {e[0] for e in (old, entry) if e is not None}:
                self._namespace_changed(namespace)

    def _in_line(self, namespace: str) -> bool:
        """Whether a new slice of ``namespace`` must queue: slices wait for GPU room, or older slices
        of its own namespace wait (for room or for its quota)."""
        return self._waiting_for_room > 0 or namespace in self._waiting_by_namespace

    def _namespace_changed(self, namespace: str) -> None:
        for callback in self.on_namespace_changed:
            callback(namespace)

    def quota_waiting(self, namespace: str) -> int:
        """Pending slices of ``namespace`` held back by its quota (status.waiting of its GpuQuota)."""
        return sum(1 for ns, reason in self.waiting.values() if ns == namespace and reason == QUOTA_EXCEEDED)

    def pending_by_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _ns, reason in self.waiting.values():
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    # ---- binding -------------------------------------------------------------------------------

    async def bind(self, uid: str, refused: dict | None = None) -> BindOutcome | None:
        """Plan and write one slice's binding, or its refusal (Pending with a reason and an Event).

        ``refused`` (one pass of the line) remembers the requests no GPU could take: within a pass
        room only shrinks, so an equal request is refused without planning again. None when there
        was nothing to plan (the slice is gone, bound or in flight) or a write failed.
        """
        known = self.state.slices.get(uid)
        if known is not None and known.group is not None:
            # One pass plans a group once: its other members were refused with it.
            key = ("group", known.namespace, known.group)
            if refused is not None and key in refused:
                return refused[key]
            outcome = await self._bind_group(uid)
            if refused is not None and outcome is not None and not outcome.bound:
                refused[key] = outcome
            return outcome
        started = time.perf_counter()
        async with self._lock:
            info = self.state.slices.get(uid)
            if info is None or info.binding is not None or uid in self.state.in_flight or info.request is None:
                return None
            quota = self.state.quotas.get(info.namespace)
            used = self.state.used(info.namespace)
            shape = (info.request, info.pinned, info.eligible)
            could_fit = True
            try:
                self._require_quota(info.namespace)
                if refused is not None and shape in refused:
                    raise refused[shape]
                binding = self.state.planner.plan(info.request, info.pinned, self.planner, nodes=info.eligible,
                                                  namespace=info.namespace)
            except Refusal as refusal:
                decision: Binding | Refusal = refusal
                if refusal.code == NO_CAPACITY:
                    if refused is not None:
                        refused[shape] = refusal
                    # No placement, so no grant: the request's bytes are the least it would add.
                    verdict = admit(quota, used, info.request.memory_bytes or 0, at_least=True)
                    if not verdict.allowed:
                        decision, could_fit = Refusal(QUOTA_EXCEEDED, verdict.message), verdict.could_fit
            else:
                verdict = admit(quota, used, binding.granted_bytes)
                if not verdict.allowed:
                    decision, could_fit = Refusal(QUOTA_EXCEEDED, verdict.message), verdict.could_fit
                else:
                    binding = replace(binding, uid=uid)
                    self.state.reserve(binding)
                    decision = binding
            gpu_uuid = "" if isinstance(decision, Refusal) else self.state.planner.uuids.get(
                (decision.node, decision.gpu), "")
        if isinstance(decision, Refusal):
            await self._refuse(info, decision)
            return BindOutcome(False, decision.code, could_fit)
        self._set_waiting(uid, None)
        self._namespace_changed(info.namespace)
        try:
            await self._write_binding(info, decision, gpu_uuid)
        except ApiError as exc:
            self.state.unreserve(uid)
            self._namespace_changed(info.namespace)
            if exc.conflict:
                # The slice changed since it was read; its newer event plans it again.
                return None
            if not exc.not_found:
                metrics.RECONCILE_ERRORS.labels("controller", "api").inc()
                log.warning("binding %s failed: %s", info.ref, exc)
                self.request_replan()
            return None
        metrics.BIND_SECONDS.observe(time.perf_counter() - started)
        metrics.BINDS.labels(decision.mode).inc()
        return BindOutcome(True)

    async def _bind_group(self, uid: str) -> BindOutcome | None:
        """Plan and write the bindings of every slice of ``uid``'s group (a pod's devices) on one node,
        or refuse them all (``ClusterPlanner.plan_group``): a waiting group holds nothing.

        Atomic across a crash: the bindings are written one by one, so a controller that dies between
        two writes leaves part of a group bound. The next pass completes it on that node; when that
        node has no room left for the rest, the bound part is given back (its slices are deleted; the
        pod's controller makes them again, Pending), so no group ever holds part of what it needs."""
        started = time.perf_counter()
        give_back: list[SliceInfo] = []
        async with self._lock:
            info = self.state.slices.get(uid)
            if info is None or info.binding is not None or uid in self.state.in_flight or info.request is None:
                return None
            members = self.state.group_members(info)
            if len(members) != info.group_size:
                return None  # the pod's controller is still making the others (or one is being replaced)
            held = [m for m in members if m.binding is not None or m.uid in self.state.in_flight]
            todo = [m for m in members if m not in held]
            if not todo or any(m.request is None or m.phase not in (None, "Pending") for m in todo):
                return None
            held_nodes = {(m.binding or self.state.in_flight[m.uid]).node for m in held}
            node = next(iter(held_nodes)) if len(held_nodes) == 1 else info.pinned
            quota = self.state.quotas.get(info.namespace)
            used = self.state.used(info.namespace)
            could_fit = True
            what = f"the group {info.group} of namespace {info.namespace}"
            try:
                self._require_quota(info.namespace)
                if len(held_nodes) > 1:
                    raise Refusal(NO_CAPACITY, f"{what} is bound on several nodes ({', '.join(sorted(held_nodes))})")
                requests = [(m.uid, m.request) for m in todo if m.request is not None]
                bindings = self.state.planner.plan_group(requests, node, self.planner, nodes=info.eligible, what=what,
                                                         namespace=info.namespace)
            except Refusal as refusal:
                decision: list[Binding] | Refusal = refusal
                give_back = held
                if refusal.code == NO_CAPACITY:
                    least = sum(m.request.memory_bytes or 0 for m in todo if m.request is not None)
                    verdict = admit(quota, used, least, at_least=True, slices=len(todo))
                    if not verdict.allowed:
                        decision, could_fit = Refusal(QUOTA_EXCEEDED, verdict.message), verdict.could_fit
            else:
                verdict = admit(quota, used, sum(b.granted_bytes for b in bindings), slices=len(bindings))
                if not verdict.allowed:
                    for b in bindings:
                        self.state.planner.drop_binding(b.uid)
                    decision, could_fit = Refusal(QUOTA_EXCEEDED, verdict.message), verdict.could_fit
                else:
                    for b in bindings:
                        self.state.reserve(b)
                    decision = bindings
            uuids = {} if isinstance(decision, Refusal) else {
                b.uid: self.state.planner.uuids.get((b.node, b.gpu), "") for b in decision}
        if isinstance(decision, Refusal):
            for member in todo:
                await self._refuse(member, decision)
            for member in give_back:
                log.info("slice %s given back: the rest of its group cannot be placed beside it", member.ref)
                await self._delete(member)
            return BindOutcome(False, decision.code, could_fit)
        for member, binding in zip(todo, decision, strict=True):
            self._set_waiting(member.uid, None)
            try:
                await self._write_binding(member, binding, uuids[binding.uid])
            except ApiError as exc:
                self.state.unreserve(member.uid)
                if not (exc.conflict or exc.not_found):
                    metrics.RECONCILE_ERRORS.labels("controller", "api").inc()
                    log.warning("binding %s failed: %s", member.ref, exc)
                self.request_replan()  # the rest of the group is completed (or given back) next pass
                continue
            metrics.BINDS.labels(binding.mode).inc()
        self._namespace_changed(info.namespace)
        metrics.BIND_SECONDS.observe(time.perf_counter() - started)
        return BindOutcome(True)

    def _require_quota(self, namespace: str) -> None:
        """Refuse (NoQuota) when GpuQuotas are required and ``namespace`` has none (core.quota)."""
        missing = quota_missing(namespace, self.state.quotas.get(namespace), self.quota_required,
                                self.state.quota_errors.get(namespace))
        if missing is not None:
            raise Refusal(NO_QUOTA, missing)

    async def _delete(self, info: SliceInfo) -> None:
        try:
            await self.client.delete(slice_path(info.namespace, info.name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    def _reclaim(self, binding: Binding) -> list[dict]:
        """Idle instances the placement overlaps: the agent destroys them first (shown in status)."""
        inventory = self.state.inventories.get(binding.node)
        gpu = next((g for g in inventory.gpus if g.index == binding.gpu), None) if inventory else None
        if gpu is None or binding.mode != MODE_MIG:
            return []
        return [
            {"gpu": binding.gpu, "profile": i.profile, "start": i.start}
            for i in gpu.instances
            if (((1 << i.size) - 1) << i.start) & binding.mask and not (
                i.start == binding.start and i.profile_id == binding.profile_id)
        ]

    async def _write_binding(self, info: SliceInfo, binding: Binding, gpu_uuid: str) -> None:
        assert info.request is not None
        message = f"bound to {describe_binding(binding)}"
        reclaim = self._reclaim(binding)
        body = {
            "metadata": {"resourceVersion": str(info.version)},
            "status": status.bound(info.body.get("status"), info.request, binding, gpu_uuid, reclaim, message),
        }
        self._writing.add(info.uid)
        try:
            answer = await self.client.merge_patch(slice_path(info.namespace, info.name, status=True), body)
            updated = self.state.put_slice(answer) or self.state.slices[info.uid]
            crashpoint("controller:after-bind")
            log.info("slice %s (%s) %s%s", info.ref, info.request.describe(), message,
                     f", reclaiming {len(reclaim)} idle instance(s)" if reclaim else "")
            if not updated.marked:
                await self.mark(updated)
        finally:
            self._writing.discard(info.uid)

    async def mark(self, info: SliceInfo) -> None:
        """Add the agent's finalizer to a bound slice made by hand (a pod's slice has it from creation)."""
        assert info.binding is not None
        meta = info.body["metadata"]
        finalizers = list(meta.get("finalizers") or ())
        if AGENT_FINALIZER not in finalizers:
            finalizers.append(AGENT_FINALIZER)
        patch = {"metadata": {"resourceVersion": str(info.version), "finalizers": finalizers}}
        path = slice_path(info.namespace, info.name)
        for _ in range(5):
            try:
                answer = await self.client.merge_patch(path, patch)
            except ApiError as exc:
                if exc.not_found:
                    return
                if not exc.conflict:
                    raise
                fresh = await self.client.get(path)
                known = self.state.put_slice(fresh) or self.state.slices.get(info.uid)
                if known is None or known.deleting or known.marked:
                    return
                patch["metadata"]["resourceVersion"] = str(known.version)
                patch["metadata"]["finalizers"] = list(dict.fromkeys(
                    [*(fresh["metadata"].get("finalizers") or ()), AGENT_FINALIZER]))
                continue
            self.state.put_slice(answer)
            return

    async def _let_go_unbound(self, info: SliceInfo) -> None:
        """Take the agent's finalizer off a slice deleted before it was bound: no agent selects it. The
        removal holds only for the version seen unbound; a binding written meanwhile (an earlier
        in-flight bind) makes it fail, and the slice is then its agent's to release."""
        await remove_finalizer(self.client, slice_path(info.namespace, info.name), info.body, AGENT_FINALIZER,
                               unless=lambda fresh: binding_from_status(info.uid, fresh.get("status")) is not None)

    async def _refuse(self, info: SliceInfo, refusal: Refusal) -> None:
        self._set_waiting(info.uid, (info.namespace, refusal.code))
        current = info.body.get("status") or {}
        if current.get("phase") != "Pending" or current.get("reason") != refusal.code or (
                current.get("message") != refusal.message):
            assert info.request is not None
            await self._write(info, status.pending(current, info.request, refusal.code, refusal.message))
            log.info("slice %s waits (%s): %s", info.ref, refusal.code, refusal.message)
        self.events.post(info.body, "Warning", refusal.code, refusal.message)

    async def _write(self, info: SliceInfo, new_status: dict) -> None:
        try:
            answer = await self.client.merge_patch(slice_path(info.namespace, info.name, status=True),
                                                   {"status": new_status})
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        self.state.put_slice(answer)

    # ---- planning again --------------------------------------------------------------------------

    def request_replan(self) -> None:
        """Plan every Pending slice again soon, in fair order; requests while one runs make one more."""
        if self._replan_task is not None and not self._replan_task.done():
            self._replan_again = True
            return
        self._replan_task = asyncio.get_running_loop().create_task(self._replan())

    async def _replan(self) -> None:
        while True:
            self._replan_again = False
            await asyncio.sleep(0.05)  # let a burst of inventory updates land first
            await self._serve_line()
            if not self._replan_again:
                return

    async def _serve_line(self) -> None:
        """One pass over the waiting slices in fair order (``core.quota.FairQueue``): the namespace with
        the smallest share of its quota first, then its oldest slice. A slice refused for room that
        can free holds its namespace's younger slices back for its first ``hold_s`` seconds of waiting.
        Planning costs what ``ClusterPlanner`` costs (independent of the cluster's size) per distinct
        request, plus O(log namespaces) per slice in line."""
        pending = self.state.pending()
        shares = {ns: self.state.share(ns) for ns in {s.namespace for s in pending}}
        line: FairQueue[str] = FairQueue(((s.namespace, s.order, s.uid) for s in pending), shares)
        refused: dict = {}
        now = time.time()
        while (step := line.next()) is not None:
            namespace, uid = step
            try:
                outcome = await self.bind(uid, refused)
            except ApiError as exc:
                metrics.RECONCILE_ERRORS.labels("controller", "api").inc()
                log.warning("controller pass failed, the next event retries: %s", exc)
                outcome = None
            head = self.state.slices.get(uid)
            created = _created_s(head.created) if head is not None else None
            hold = (outcome is not None and not outcome.bound and head is not None and created is not None
                    and holds_back(outcome.code, outcome.could_fit, now - created, self.hold_s))
            held = line.settle(namespace, self.state.share(namespace), hold)
            if held:
                assert head is not None and outcome is not None and created is not None
                self._replan_when_hold_ends(created + self.hold_s)
            for other in held:
                assert head is not None and outcome is not None and created is not None
                await self._guard(self._hold(other, head, outcome.code, created + self.hold_s))

    def _replan_when_hold_ends(self, until_s: float) -> None:
        """Nothing else may happen when a hold ends (no release, no new slice): plan again then."""
        when = round(until_s, 1)
        if when in self._hold_ends:
            return
        self._hold_ends.add(when)

        def fire() -> None:
            self._hold_ends.discard(when)
            self.request_replan()

        asyncio.get_running_loop().call_later(max(0.0, until_s - time.time()) + 0.1, fire)

    async def _hold(self, uid: str, head: SliceInfo, code: str, until_s: float) -> None:
        """Keep ``uid`` waiting behind ``head``, the older slice of its namespace that waits for room."""
        info = self.state.slices.get(uid)
        if info is None or info.binding is not None or uid in self.state.in_flight or info.request is None:
            return
        if info.group is not None and (info.group, info.namespace) == (head.group, head.namespace):
            return  # the head's own group: refused with it, for the same reason
        try:
            self.state.planner.plan(info.request, info.pinned, self.planner, nodes=info.eligible,
                                    namespace=info.namespace)
        except Refusal as own:
            if not held_behind(own.code):
                await self._refuse(info, own)
                return
        until = datetime.fromtimestamp(until_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self._refuse(info, Refusal(code, (
            f"waits behind {head.ref}, the older slice of its namespace, which waits for room ({code}) and "
            f"has the first call on the room its namespace gets until {until}; then slices are served around it")))

    def publish_counts(self) -> None:
        """Slices by phase and mode, for the metrics: at most once a second (it visits every slice),
        and once more a second after the last change, so the gauge ends current."""
        wait = 1.0 - (time.monotonic() - self._counted)
        if wait > 0:
            if self._count_later is None:
                self._count_later = asyncio.get_running_loop().call_later(wait, self._publish_counts_now)
            return
        self._publish_counts_now()

    def _publish_counts_now(self) -> None:
        self._count_later = None
        self._counted = time.monotonic()
        metrics.SLICES.clear()
        for (phase, mode), count in self.state.counts().items():
            metrics.SLICES.labels(phase, mode).set(count)
        metrics.PENDING_SLICES.clear()
        for reason, count in self.pending_by_reason().items():
            metrics.PENDING_SLICES.labels(reason).set(count)
