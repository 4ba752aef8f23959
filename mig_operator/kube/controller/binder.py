"""The controller's binder: the reconciler that binds each GpuSlice to a node, GPU, mode, profile and
placement.

It observes (watch events and periodic full lists go into the ledger, ``core.books.ledger``), decides (the
ledger plans a slice's group, admits it against its quota and reserves the bindings, or refuses it),
acts (writes the binding or the refusal) and records (commits or rolls back in the ledger). The
ledger is pure and synchronous, so a decision and its reservation happen with no await between them
and two slices bound in the same second never get one placement.

A binding is one write: ``status`` (phase Bound and the decision, with the resourceVersion planned
from as a precondition). The agents select their slices by ``status.node`` (a field selector), so
that write is what hands a slice to its agent. A pod's slice carries the agent's finalizer from
creation; a slice made by hand gets it in a second write (the status subresource takes no metadata),
and its agent waits for it (``core.node.lifecycle.agent_step``); a controller that dies between the two
writes adds it on its next pass (``mark``). A slice deleted before it was bound never reaches an
agent: the controller takes the finalizer off it (``let_go_unbound``).

Every write runs as a key on the controller's work queue (``kube.common.workqueue``): a slice's own
key ``("slice", namespace, name)`` (``slice_key.SliceKey`` runs the binder's steps for it: ``let_go_unbound``,
``fail_invalid``, ``bind_now``, ``mark``), the line's pass ``"replan"``; a watch event only observes and adds
keys. A write that fails, refused as a conflict included, raises, and its key comes back after its back-off;
the pass serves the rest of the line first.

Quotas and the fair order (``core.books.quota``): a binding that would take its namespace past its
GpuQuota is not made (the slice stays Pending, reason QuotaExceeded). While slices wait, a new slice
joins the line instead of being bound at once, and each pass serves the line in fair order: the
namespace holding the smallest share of its quota first, then its oldest slice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from mig_operator.core.autoscale.pools import AutoscalingOptions
from mig_operator.core.books.ledger import Decision, Ledger, SliceRecord
from mig_operator.core.books.quota import DEFAULT_HOLD_S, FairQueue, held_behind, holds_back
from mig_operator.core.placement.cluster import (
    MODE_MIG,
    Binding,
    GpuState,
    Refusal,
    binding_from_status,
    binding_mig_compute,
    describe_binding,
)
from mig_operator.core.placement.planner import PlannerSettings

from ..common import metrics, status
from ..common.client import ApiError, KubeClient, gpunodes_path, resource_version, slice_path, slices_path
from ..common.events import EventPoster
from ..common.faults import crashpoint
from ..common.finalizers import remove_finalizer
from ..common.names import AGENT_FINALIZER
from ..common.trim import node_body, owned_body, slice_body
from ..common.workqueue import WorkQueue
from .capacity import Autoscaling
from .claims import SliceClaims
from .observe import inventory, inventory_node, node_record, slice_record
from .pods import PodSlices
from .quotas import QuotaStatus
from .slice_key import SliceKey

log = logging.getLogger("mig_operator.controller")
QUOTAS_PATH = "/apis/cdmo.io/v1alpha1/gpuquotas"


@dataclass(frozen=True)
class BindOutcome:
    """What one attempt to bind a slice came to: bound, or the refusal's code and whether the room it
    waits for can free (``could_fit``: False when its quota cannot hold it even alone)."""

    bound: bool
    code: str = ""
    could_fit: bool = True


# Listing events (type None) that follow each other closer than this belong to one listing of a watch.
LISTING_GAP_S = 2.0


def _created_s(created: str) -> float | None:
    """A creationTimestamp (RFC 3339) as seconds since the epoch; None when absent or not one."""
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class Binder:
    """Binds slices; the controller's other parts are its own (``assemble``): every slice's and pod's key
    is looked at again after a full read and at each periodic pass, and the GpuQuota status follows the
    namespaces whose use or waiting slices changed."""

    def __init__(self, client: KubeClient, events: EventPoster, ledger: Ledger, queue: WorkQueue,
                 claims: SliceClaims, pods: PodSlices, quotas: QuotaStatus, resync_s: float = 30.0,
                 hold_s: float = DEFAULT_HOLD_S) -> None:
        self.client = client
        self.queue = queue  # shared with the controller's other parts
        self.events = events
        self.ledger = ledger
        self.claims = claims
        self.pods = pods
        self.quotas = quotas
        self.resync_s = resync_s
        self.hold_s = hold_s
        self._lock = asyncio.Lock()  # one full list at a time
        self._last_resync = 0.0
        self._counted = 0.0
        # False from the start of a watch's listing until a full read after it: nothing is bound meanwhile.
        self.synced = True
        self._listing_seen = 0.0
        self.autoscaling: Autoscaling | None = None  # new nodes from a node autoscaler, when configured

    # ---- full lists ----------------------------------------------------------------------------

    async def resync(self) -> None:
        """The full read, at start and when a watch lists again (``listing_event``): slices, inventories,
        nodes and quotas read afresh, gated pods too, then every key the books hold looked at again."""
        async with self._lock:
            (slices, listed_at), (gpunodes, gpunodes_at), quotas, listed_nodes = await asyncio.gather(
                self.client.list_at(slices_path(), keep=self._listed_slice),
                self.client.list_at(gpunodes_path(), keep=owned_body),
                self._list_quotas(), self.client.list("/api/v1/nodes", keep=node_body),
            )
            nodes = {n["metadata"]["name"]: node_record(n) for n in listed_nodes}
            inventories = [inventory(b) for b in gpunodes]
            versions = {i.node: resource_version(b["metadata"]) for i, b in zip(inventories, gpunodes, strict=True)}
            self.ledger.replace_all((slice_record(b) for b in slices), inventories, nodes, listed_at or None,
                                    (versions, gpunodes_at) if gpunodes_at else None)
            self.ledger.replace_quotas(quotas)
            self.synced = True
        await self._revisit(list_pods=True)

    async def revisit(self) -> None:
        """The periodic pass (every ``resync_s``): every key the books hold is looked at again, as the
        watches left them; nothing is listed (the watches are the books' one feed)."""
        await self._revisit(list_pods=False)

    async def _revisit(self, list_pods: bool) -> None:
        self._last_resync = time.monotonic()
        self._announce()
        for namespace in {s.namespace for s in self.ledger.slices.values()} | set(self.ledger.quotas):
            self._namespace_changed(namespace)
        self.claims.forget_gone()
        for info in list(self.ledger.slices.values()):
            self.queue.enqueue(("slice", info.namespace, info.name))
        await self.quotas.resync()
        self.request_replan()
        if self.autoscaling is not None:
            self.autoscaling.changed()
        if list_pods:
            await self.pods.resync()  # raises after looking at every pod: the resync's key comes back
        else:
            self.pods.revisit()

    def _listed_slice(self, body: dict) -> dict:
        """A listed slice as kept: the ledger's own body when it has this version already, so a full
        list of slices the watch has just brought (every one, at a start) holds one copy of each, not two."""
        meta = body.get("metadata") or {}
        known = self.ledger.slices.get(meta.get("uid") or "")
        if known is not None and known.version == resource_version(meta):
            return known.body
        return slice_body(body)

    async def _list_quotas(self) -> list[dict]:
        """Every GpuQuota; none when the CRD is not installed (an upgrade that skipped
        ``kubectl apply -f crds/``): then no namespace has a limit, as before quotas existed."""
        try:
            return await self.client.list(QUOTAS_PATH, keep=owned_body)
        except ApiError as exc:
            if not exc.not_found:
                raise
            log.warning("GpuQuotas cannot be listed (is crds/gpuquota.yaml applied?): no namespace is limited")
            return []

    def listing_event(self) -> None:
        """An object of any kind seen in a watch's listing: at start, when a standby replica becomes the
        active one, or after a watch was lost. What another replica wrote meanwhile reaches the books one object at a
        time, in no order, so a slice planned now could be placed on an instance whose binding is still
        on its way. The first event of a listing stops binding until the books are read afresh."""
        now = time.monotonic()
        first = now - self._listing_seen > LISTING_GAP_S
        self._listing_seen = now
        if first:
            self.synced = False
            self.queue.add("resync", self.resync)

    def maybe_resync(self) -> None:
        """The periodic pass (``revisit``) when the last pass is older than ``resync_s``; driven by events,
        so a paused (standby) replica, which gets none, does nothing."""
        if time.monotonic() - self._last_resync > self.resync_s:
            self._last_resync = time.monotonic()
            self.queue.add("revisit", self.revisit)

    # ---- observing -----------------------------------------------------------------------------

    async def slice_event(self, body: dict, deleted: bool) -> SliceRecord | None:
        """Take a slice's watch event into the ledger and add its key; the slice as the ledger now has it
        (None when it is gone or the event is older than what the ledger holds)."""
        if deleted:
            uid = body["metadata"]["uid"]
            waited = uid in self.ledger.waiting
            gone = self.ledger.remove_slice(uid, resource_version(body["metadata"]))
            self.events.forget(uid)
            self._announce()
            self._namespace_changed(body["metadata"]["namespace"])
            if gone is not None and (gone.binding is not None or waited):
                # Its room and its quota charge are free (or idle) now; or it waited, and younger slices
                # of its namespace may wait behind it: either way the line is served again at once.
                self.request_replan()
            return None
        info = self.ledger.put_slice(slice_record(body))
        if info is None:
            return None
        self._namespace_changed(info.namespace)
        self._announce()
        self.queue.enqueue(("slice", info.namespace, info.name))
        self.maybe_resync()
        return info

    # ---- a slice's steps (its key's reconcile, ``slice_key.SliceKey``, runs them in order) ---------

    async def let_go_unbound(self, info: SliceRecord) -> None:
        """Take the agent's finalizer off a slice deleted before it was bound: no agent selects it. The
        removal holds only for the version seen unbound; a binding written meanwhile (an earlier
        in-flight bind) makes it fail, and the slice is then its agent's to release."""
        if info.binding is not None or AGENT_FINALIZER not in (info.body["metadata"].get("finalizers") or ()):
            return
        await remove_finalizer(self.client, slice_path(info.namespace, info.name), info.body, AGENT_FINALIZER,
                               unless=lambda fresh: binding_from_status(info.uid, fresh.get("status")) is not None)

    async def let_go_gone_node(self, info: SliceRecord) -> None:
        """Take the agent's finalizer off a bound slice being deleted whose node is gone: no agent will
        release it, and its device went with the node."""
        if (info.binding is None or not self.ledger.node_gone(info.binding.node)
                or AGENT_FINALIZER not in (info.body["metadata"].get("finalizers") or ())):
            return
        node = info.binding.node
        await remove_finalizer(self.client, slice_path(info.namespace, info.name), info.body, AGENT_FINALIZER,
                               unless=lambda _fresh: not self.ledger.node_gone(node))
        log.info("slice %s released: its node %s is gone", info.ref, node)

    async def fail_gone_node(self, info: SliceRecord) -> bool:
        """A live slice bound to a node that is gone: phase Failed, reason NodeGone, and an Event (its
        device went with the node; a new slice is placed anew). True when its node is gone."""
        if info.binding is None or not self.ledger.node_gone(info.binding.node):
            return False
        if info.phase != "Failed":
            message = (f"node {info.binding.node} is gone (a node autoscaler or an admin removed it) and the "
                       "slice's device with it; delete this GpuSlice and create it again to be placed anew")
            await self._write(info, status.failed(info.body.get("status"), "NodeGone", message))
            self.events.post(info.body, "Warning", "NodeGone", message)
        return True

    async def fail_invalid(self, info: SliceRecord) -> None:
        """A slice whose spec cannot be served (an API server without CEL let it in): phase Failed, reason
        InvalidSpec, and an Event."""
        if not info.invalid or info.phase == "Failed" or info.deleting:
            return
        await self._write(info, status.failed(info.body.get("status"), "InvalidSpec", info.invalid))
        self.events.post(info.body, "Warning", "InvalidSpec", info.invalid)

    async def bind_now(self, info: SliceRecord) -> None:
        """Bind an unbound Pending slice unless its namespace has slices in line (the line's next pass
        serves it then). A bound slice of a group binds the rest of its group: the write that failed may
        have been another member's. A failed write raises."""
        if info.binding is not None and info.group is not None:
            found = next((m for m in self.ledger.group_members(info) if m.binding is None), None)
            if found is None:
                return
            info = found
        if info.binding is not None or info.deleting or info.invalid or info.phase not in (None, "Pending"):
            return
        if self.ledger.line.in_line(info.namespace):
            self.request_replan()  # slices wait: a new one joins the line rather than jump it
            return
        await self.bind(info.uid)

    def inventory_event(self, body: dict, deleted: bool) -> None:
        ledger = self.ledger
        changed = ledger.remove_inventory(inventory_node(body)) if deleted else ledger.put_inventory(
            inventory(body), resource_version(body.get("metadata") or {}))
        for namespace in changed:  # a device its agent holds for a slice that is gone
            self._namespace_changed(namespace)
        if deleted:
            self._look_at_bound(inventory_node(body))
        # A device a slice names may have just been published: its key looks at its claim and pod again.
        for namespace, name in self.ledger.take_device_waits(inventory_node(body)):
            self.queue.enqueue(("slice", namespace, name))
        self.request_replan()
        self.maybe_resync()

    def node_event(self, name: str, body: Mapping | None) -> None:
        """A Node changed (None: it is gone): its labels and taints; planning reads the MIG label,
        fraction sharing and runtime trust."""
        record = node_record(body) if body is not None else None
        if body is None:
            self._look_at_bound(name)
        if record != self.ledger.nodes.get(name):
            self.pods.look_waiting()  # where a pod may go changed: its waiting slice may be limited otherwise
        changed = self.ledger.put_node(name, record)
        if changed is not None:
            for namespace in changed:  # fraction sharing changes what its fractions are charged
                self._namespace_changed(namespace)
            self.request_replan()

    def _look_at_bound(self, node: str) -> None:
        """A Node or GpuNode went: the slices bound there are looked at again (is their node gone?)."""
        for info in self.ledger.bound_on(node):
            self.queue.enqueue(("slice", info.namespace, info.name))

    def quota_event(self, body: dict, deleted: bool) -> None:
        """A GpuQuota changed: raised, lowered, made or removed; the waiting slices are planned again."""
        namespace = body["metadata"]["namespace"]
        if deleted:
            self.ledger.remove_quota(body)
        elif not self.ledger.put_quota(body) and namespace in self.ledger.quota_errors:
            log.warning("GpuQuota %s/%s is ignored: %s", namespace, body["metadata"]["name"],
                        self.ledger.quota_errors[namespace])
        self._namespace_changed(namespace)
        self.request_replan()
        self.maybe_resync()

    def _announce(self) -> None:
        """Tell the namespaces whose waiting slices changed in the ledger."""
        for namespace in sorted(self.ledger.touched_namespaces()):
            self._namespace_changed(namespace)

    def _namespace_changed(self, namespace: str) -> None:
        self.quotas.changed(namespace)

    # ---- deciding and acting -------------------------------------------------------------------

    async def bind(self, uid: str, refused: dict | None = None) -> BindOutcome | None:
        """Decide for slice ``uid`` (with its group) and write the bindings, or the refusal (Pending
        with a reason and an Event) and give back the group's bound part (its slices are deleted;
        the pod's controller makes them again, Pending), so no group holds part of what it needs.

        A group's bindings are written one by one: a controller that dies between two writes leaves part
        of a group bound, and the next pass completes it on that node or gives it back. ``refused`` (one
        pass of the line): see ``Ledger.decide``. None when there was nothing to plan (the slice is
        gone, bound or being written) or a single slice's write failed."""
        if not self.synced:
            return None  # the resync under way plans every waiting slice once the books are whole
        started = time.perf_counter()
        decision = self.ledger.decide(uid, refused)
        self._announce()
        if decision.kind == "skip":
            return None
        if decision.kind == "refuse":
            assert decision.refusal is not None
            for member in decision.todo:
                await self._refuse(member, decision.refusal)
            for member in decision.give_back:
                # Its deletion's key takes its claim's reservation off (``SliceClaims.slice_going``).
                log.info("slice %s given back: the rest of its group cannot be placed beside it", member.ref)
                await self._delete(member)
            return BindOutcome(False, decision.refusal.code, decision.could_fit)
        return await self._act(decision, started)

    async def _act(self, decision: Decision, started: float) -> BindOutcome | None:
        """Write the decided bindings one by one. A write that fails takes its member back to the line
        (a conflict reads the slice again first) and raises once the rest are written, so the key comes
        back after its back-off and completes the group, or gives it back; a slice deleted meanwhile is done."""
        alone = len(decision.todo) == 1 and decision.todo[0].group is None
        namespace = decision.todo[0].namespace
        self._namespace_changed(namespace)
        failed: ApiError | None = None
        for member, binding in zip(decision.todo, decision.bindings, strict=True):
            try:
                await self._write_binding(member, binding, decision.uuids[binding.uid])
            except ApiError as exc:
                self.ledger.rollback(member.uid)
                self._announce()
                self._namespace_changed(namespace)
                if exc.not_found:
                    if alone:
                        return None
                    self.request_replan()  # the group's rest is given back next pass
                    continue
                if exc.conflict:
                    await self._reread(member)
                failed = failed or exc
                continue
            self.ledger.commit(member.uid)
            metrics.BINDS.labels(binding.mode).inc()
        if failed is not None:
            raise failed
        if not alone:
            self._namespace_changed(namespace)
        metrics.BIND_SECONDS.observe(time.perf_counter() - started)
        return BindOutcome(True)

    async def _reread(self, info: SliceRecord) -> None:
        """After a conflict: the slice as the API server has it now into the books, so the next try plans
        from it rather than from the version its write was refused for."""
        try:
            fresh = await self.client.get(slice_path(info.namespace, info.name))
        except ApiError as exc:
            if exc.not_found:
                return  # deleted: its watch event takes it out of the books
            raise
        self.ledger.put_slice(slice_record(fresh))

    async def _delete(self, info: SliceRecord) -> None:
        try:
            await self.client.delete(slice_path(info.namespace, info.name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    def _gpu(self, binding: Binding) -> GpuState | None:
        inventory = self.ledger.inventories.get(binding.node)
        return next((g for g in inventory.gpus if g.index == binding.gpu), None) if inventory else None

    def _reclaim(self, binding: Binding) -> list[dict]:
        """Idle instances the placement overlaps: the agent destroys them first (shown in status)."""
        gpu = self._gpu(binding)
        if gpu is None or binding.mode != MODE_MIG:
            return []
        return [
            {"gpu": binding.gpu, "profile": i.profile, "start": i.start}
            for i in gpu.instances
            if i.mask & binding.mask and not (
                i.start == binding.start and i.profile_id == binding.profile_id)
        ]

    async def _write_binding(self, info: SliceRecord, binding: Binding, gpu_uuid: str) -> None:
        assert info.request is not None
        message = f"bound to {describe_binding(binding)}"
        reclaim = self._reclaim(binding)
        body = {
            "metadata": {"resourceVersion": str(info.version)},
            "status": status.bound(info.body.get("status"), info.request, binding, gpu_uuid, reclaim, message,
                                   binding_mig_compute(self._gpu(binding), binding)),
        }
        answer = await self.client.merge_patch(slice_path(info.namespace, info.name, status=True), body)
        updated = self.ledger.put_slice(slice_record(answer)) or self.ledger.slices[info.uid]
        crashpoint("controller:after-bind")
        log.info("slice %s (%s) %s%s", info.ref, info.request.describe(), message,
                 f", reclaiming {len(reclaim)} idle instance(s)" if reclaim else "")
        # Observed as its watch event will be: its key takes it on (finalizer, claim, pod) now.
        self.publish_counts()
        self.queue.enqueue(("slice", updated.namespace, updated.name))

    async def mark(self, info: SliceRecord) -> None:
        """Add the agent's finalizer to a bound slice made by hand (a pod's slice has it from creation)."""
        if info.binding is None or info.marked or info.deleting or self.ledger.writing(info.uid):
            return  # (a binding being written has its key look again once written)
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
                known = self.ledger.put_slice(slice_record(fresh)) or self.ledger.slices.get(info.uid)
                if known is None or known.deleting or known.marked:
                    return
                patch["metadata"]["resourceVersion"] = str(known.version)
                patch["metadata"]["finalizers"] = list(dict.fromkeys(
                    [*(fresh["metadata"].get("finalizers") or ()), AGENT_FINALIZER]))
                continue
            self.ledger.put_slice(slice_record(answer))
            return

    async def _refuse(self, info: SliceRecord, refusal: Refusal) -> None:
        self.ledger.wait_in_line(info.uid, refusal.code)
        self._announce()
        pool = None
        if self.autoscaling is not None:
            # WaitingForNode and the pool, when a new node would take it
            refusal, pool = self.autoscaling.shown(info, refusal)
        current = info.body.get("status") or {}
        if current.get("phase") != "Pending" or current.get("reason") != refusal.code or (
                current.get("message") != refusal.message) or current.get("pool") != pool:
            assert info.request is not None
            await self._write(info, status.pending(current, info.request, refusal.code, refusal.message, pool))
            log.info("slice %s waits (%s): %s", info.ref, refusal.code, refusal.message)
            # The Event goes with the status write that tells the same: a status that already says it
            # needs no Event (a restart plans every waiting slice again and has nothing new to tell).
            self.events.post(info.body, "Warning", refusal.code, refusal.message)

    async def _write(self, info: SliceRecord, new_status: dict) -> None:
        try:
            answer = await self.client.merge_patch(slice_path(info.namespace, info.name, status=True),
                                                   {"status": new_status})
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        self.ledger.put_slice(slice_record(answer))

    # ---- planning again --------------------------------------------------------------------------

    def request_replan(self) -> None:
        """Plan every Pending slice again soon (a burst of inventory updates lands first), in fair order;
        requests while a pass runs make one more."""
        self.queue.add("replan", self._serve_line, 0.05)

    async def _serve_line(self) -> None:
        """One pass over the waiting slices in fair order (``core.books.quota.FairQueue``): the namespace with
        the smallest share of its quota first, then its oldest slice. A slice refused for room that
        can free holds its namespace's younger slices back for its first ``hold_s`` seconds of waiting.
        Planning costs what ``ClusterPlanner`` costs (independent of the cluster's size) per distinct
        request, plus O(log namespaces) per slice in line."""
        pending = self.ledger.pending()
        shares = {ns: self.ledger.share(ns) for ns in {s.namespace for s in pending}}
        line: FairQueue[str] = FairQueue(((s.namespace, s.order, s.uid) for s in pending), shares)
        refused: dict = {}
        now = time.time()
        failed: ApiError | None = None
        while (step := line.next()) is not None:
            namespace, uid = step
            try:
                outcome = await self.bind(uid, refused)
            except ApiError as exc:
                metrics.RECONCILE_ERRORS.labels("controller", "api").inc()
                log.debug("slice %s: planning failed, the pass comes back after its back-off: %s", uid, exc)
                failed, outcome = exc, None
            head = self.ledger.slices.get(uid)
            created = _created_s(head.created) if head is not None else None
            hold = (outcome is not None and not outcome.bound and head is not None and created is not None
                    and holds_back(outcome.code, outcome.could_fit, now - created, self.hold_s))
            held = line.settle(namespace, self.ledger.share(namespace), hold)
            if held:
                assert head is not None and outcome is not None and created is not None
                self._replan_when_hold_ends(created + self.hold_s)
            for other in held:
                assert head is not None and outcome is not None and created is not None
                try:
                    await self._hold(other, head, outcome.code, created + self.hold_s)
                except ApiError as exc:
                    failed = exc
        if failed is not None:
            raise failed  # the rest of the line was served; the pass comes back after its back-off

    def _replan_when_hold_ends(self, until_s: float) -> None:
        """Nothing else may happen when a hold ends (no release, no new slice): plan again then."""
        self.queue.add(("hold-ends", round(until_s, 1)), self.request_replan, until_s - time.time() + 0.1)

    async def _hold(self, uid: str, head: SliceRecord, code: str, until_s: float) -> None:
        """Keep ``uid`` waiting behind ``head``, the older slice of its namespace that waits for room."""
        info = self.ledger.slices.get(uid)
        if info is None or info.binding is not None or self.ledger.reserved(uid) is not None or info.request is None:
            return
        if info.group is not None and (info.group, info.namespace) == (head.group, head.namespace):
            return  # the head's own group: refused with it, for the same reason
        own = self.ledger.probe(uid)
        if own is not None and not held_behind(own.code):
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
        self.queue.add("slice-counts", self._publish_counts_now, wait)

    def _publish_counts_now(self) -> None:
        self._counted = time.monotonic()
        metrics.SLICES.clear()
        for (phase, mode), count in self.ledger.counts().items():
            metrics.SLICES.labels(phase, mode).set(count)
        metrics.PENDING_SLICES.clear()
        for reason, count in self.ledger.line.by_reason().items():
            metrics.PENDING_SLICES.labels(reason).set(count)


def assemble(client: KubeClient, events: EventPoster, planner: PlannerSettings | None = None,
             quota_required: bool = False, resync_s: float = 30.0, hold_s: float = DEFAULT_HOLD_S,
             queue: WorkQueue | None = None, ledger: Ledger | None = None,
             autoscaling: AutoscalingOptions | None = None) -> Binder:
    """The controller's parts on one ledger and one work queue: the binder, with the slices' claims,
    the annotated pods and the GpuQuota status as its own; each slice's key (``slice_key``) and each
    pod's key (``PodSlices.reconcile``) registered on the queue."""
    ledger = ledger or Ledger(planner, quota_required)
    queue = queue or WorkQueue()
    claims = SliceClaims(client, events, ledger, queue)
    pods = PodSlices(client, events, ledger, claims, queue)
    quotas = QuotaStatus(client, ledger, queue)
    binder = Binder(client, events, ledger, queue, claims, pods, quotas, resync_s=resync_s, hold_s=hold_s)
    SliceKey(ledger, queue, binder, claims, pods)  # registered on the queue: kind "slice"
    if autoscaling is not None:
        binder.autoscaling = Autoscaling(client, ledger, queue, autoscaling, binder.request_replan)
    return binder
