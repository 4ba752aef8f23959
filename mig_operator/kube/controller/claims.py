"""Each Ready GpuSlice's ResourceClaim: how a device reaches a container (docs/architecture.md, section 8).

When a slice is Ready and its device is on its node's GpuNode (core/books/device_check), the controller
writes a ResourceClaim of the slice's name in its namespace, owned by the slice (deleting the slice
deletes the claim), asking for one device of class ``gpuslice.cdmo.io`` whose ``slice`` attribute is
the slice's UID, and then allocates it itself: the slice's device in the bound node's pool, usable on
that node only (core/books/slice_claim, which says why). kube-scheduler only reserves the claim for a pod
that names it, on that node, and the kubelet asks the agent to prepare it. A device that another
node's agent publishes under the slice's UID is never allocated to the claim.

A pod's slice's claim is reserved for that pod in the write that allocates it, so kube-scheduler
writes nothing to it; only for the gated pod the controller made the slice for (``consumer``, read
from the pods the ledger keeps), never for whatever pod a slice's owner reference names: a tenant writes those. The
reservation holds the slice while the pod lives (the agent releases no slice whose claim is
reserved), so before a slice of a pod still gated goes (a group's part given back, a slice or its
pod deleted) the controller takes it away (``unreserve``).

A pod's slice gets its claim as soon as the slice exists, not when it is Ready, and the claim is
allocated as soon as the slice's binding is decided, while the binding is written: the pod names the
claim and stays gated until its slice's binding is written and its device checked (pods.py), so
allocating early hands nothing on, and takes the claim's two writes off the pod's path (a binding whose
write fails leaves the claim counted as written only, ``Ledger.rollback``, and the next binding's
allocation is checked against what it holds).
kube-scheduler must know the claim before it sees the pod ungated (a pod it schedules before the
claim reaches its cache is unschedulable until the claim's event requeues it, after a back-off of a
second or more). A directly made slice's claim is written and allocated once the slice is Ready and
its device checked: any pod of the namespace may name that claim, and none is gated.

A claim of that name left from an earlier slice of the same name (a pod's next try, a slice made
again) is deleted and written anew; a claim of that name the operator did not write is never
touched: the slice's status says so. A claim of the slice's that is allocated otherwise (another
pool or device) is deleted, with a Warning Event, and written anew.

A claim allocated under a release whose API server dropped ``allocationTimestamp`` (before 1.36) is
written again, to the same device, once the API server keeps the field (core/books/slice_claim's
``restamp`` says why): found when its key is looked at (at the start-up read of each claim, a slice's
event, a resync), while no pod reserves it; one a pod reserves is looked at again every
``RESTAMP_RECHECK_S`` until its reservation is gone. The API server's release is read from
``/version``, again after ``SERVER_VERSION_TTL_S`` (an upgrade restarts it with another one, and no
watch tells): while claims without a stamp stand on a release that drops it, a key of its own reads
it again then, and has those claims looked at once the release keeps the stamp.

Every write to a slice's claim is made under the slice's key on the controller's work queue,
``("slice", namespace, name)`` (slice_key.py), so a claim has one writer at a time: a slice's event, its
GpuNode's change, its pod's and a resync add the key, a failed write brings it back after its back-off,
and an earlier slice's claim still going (kept by its pods) has the key looked at again later
(``STALE_CLAIM_RECHECK_S``), never waited for while the key runs. A pod's key asks for its slices'
claims to be let go (``ask_let_go``); the slice's key does it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from mig_operator.core.books.device_check import ACCEPT
from mig_operator.core.books.ledger import CLAIM_ALLOCATED, CLAIM_NONE, CLAIM_WRITTEN, Ledger, SliceRecord
from mig_operator.core.books.slice_claim import (
    DELETE_PROTECTION,
    ELSEWHERE,
    PINNED,
    STAMP_LATER,
    STAMP_OK,
    UNALLOCATED,
    allocation_patch,
    allocation_state,
    claim_path,
    claim_user,
    deallocation_patch,
    restamp,
    serves_stamp,
    stamped,
    unreserve_patch,
)
from mig_operator.core.books.slice_claim import claim_body as slice_claim_body
from mig_operator.core.node.lifecycle import READY
from mig_operator.core.placement.cluster import Binding

from ..common.client import ApiError, KubeClient, slice_path
from ..common.events import EventPoster
from ..common.names import API_VERSION, SLICE_KIND
from ..common.status import seconds_now
from ..common.workqueue import WorkQueue
from .observe import gated, group_of, owned_by

log = logging.getLogger("mig_operator.controller.claims")
CLAIM_TAKEN = "ClaimNameTaken"
ALLOCATED_ELSEWHERE = "ClaimAllocatedElsewhere"
NOT_ALLOCATED = "ClaimNotAllocated"
# When an earlier slice's claim, deleted, is looked at again: a fifth of how long it has been going,
# within these bounds (it goes once its pods let it go, which may take a pod's lifetime).
STALE_CLAIM_RECHECK_S = (0.2, 5.0)
# How long the API server's release, read from /version, is taken as known.
SERVER_VERSION_TTL_S = 30.0
# How often a claim to be written again with allocationTimestamp, which a pod reserves, is read again.
RESTAMP_RECHECK_S = 30.0
# The work queue's key that reads the API server's release again while claims wait for a stamp.
RELEASE_KEY = ("claims", "release")
# How a pod lets its slice's claim go (``SliceClaims.ask_let_go``).
UNRESERVE = "unreserve"
DELETE = "delete"


def claim_body(namespace: str, name: str, slice_uid: str) -> dict[str, Any]:
    """The ResourceClaim of slice ``namespace/name`` (UID ``slice_uid``)."""
    return slice_claim_body(namespace, name, {"apiVersion": API_VERSION, "kind": SLICE_KIND, "name": name,
                                              "uid": slice_uid, "controller": True})


def slice_owner(claim: Mapping[str, Any]) -> str | None:
    """The UID of the GpuSlice that owns ``claim``; None when no GpuSlice does (not the operator's)."""
    for ref in (claim.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == SLICE_KIND and str(ref.get("apiVersion", "")).startswith(API_VERSION.split("/")[0] + "/"):
            return str(ref.get("uid") or "")
    return None


def _seconds_since(timestamp: str | None) -> float:
    """Seconds since an RFC 3339 time (0 when absent or not one)."""
    try:
        return max(0.0, time.time() - datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0.0


def early(info: SliceRecord) -> bool:
    """Whether the slice's claim is written before it is Ready: a pod's slice (see the module's doc)."""
    return not info.deleting and info.pod_owner is not None


class SliceClaims:
    """Writes and allocates the ResourceClaim of every Ready slice whose device its node's GpuNode lists."""

    def __init__(self, client: KubeClient, events: EventPoster, state: Ledger, queue: WorkQueue) -> None:
        self.client = client
        self.events = events
        self.state = state
        self.queue = queue
        # Slice UID -> how its claim is to be let go for its pod (UNRESERVE, DELETE): asked for by the pod's
        # key, done by the slice's (``let_go``), so the claim has one writer; and the slices it was done for.
        self._letting_go: dict[str, str] = {}
        self._let_go: dict[str, str] = {}
        # Slices whose claim was last seen allocated without allocationTimestamp, and whether the API
        # server keeps that field, as read when (monotonic clock).
        self._unstamped: set[str] = set()
        self._serves: tuple[float, bool] | None = None

    def consumer(self, info: SliceRecord) -> Mapping[str, str] | None:
        """Whom the claim of slice ``info`` is reserved for as it is allocated: the gated pod the ledger
        keeps that owns the slice and names its claim, so a pod the controller made it for; None for
        any other (an owner reference alone is the tenant's to write)."""
        record = self.state.pod(info.namespace, group_of(info))
        if record is None or not gated(record.body) or not owned_by(info.body, record.body):
            return None
        return claim_user(record.body, info.name)

    def forget_gone(self) -> None:
        """Forget what is kept of the claims of slices the books no longer hold (each pass of every key)."""
        held = set(self.state.slices)
        self._unstamped &= held
        self._let_go = {uid: how for uid, how in self._let_go.items() if uid in held}
        self._letting_go = {uid: how for uid, how in self._letting_go.items() if uid in held}

    def ask_let_go(self, info: SliceRecord, how: str) -> bool:
        """The slice's pod lets its claim go (``UNRESERVE``: its reservation for the pod taken off;
        ``DELETE``: the claim deleted): asked of the slice's key (``let_go``), which is added. True once
        done. A deletion asked for is never made a mere unreserve."""
        if info.uid in self._let_go:
            return True
        if self._letting_go.get(info.uid) != DELETE:
            self._letting_go[info.uid] = how
        self.queue.enqueue(("slice", info.namespace, info.name))
        return False

    def deleted_for_pod(self, info: SliceRecord) -> bool:
        """Whether the slice's pod had its claim deleted, or asked for that: it is never written again."""
        return DELETE in (self._let_go.get(info.uid), self._letting_go.get(info.uid))

    async def let_go(self, info: SliceRecord) -> None:
        """Let the slice's claim go as its pod asked (``ask_let_go``); a failed write raises and is tried
        again. A claim deleted has its pod's key look again (it deletes the slice next)."""
        how = self._letting_go.get(info.uid)
        if how is None:
            return
        if how == DELETE:
            await self.delete_finished(info)
        else:
            await self.unreserve(info)
        self._letting_go.pop(info.uid, None)
        self._let_go[info.uid] = how
        if how == DELETE:
            self.queue.enqueue(("pod", info.namespace, group_of(info)))

    async def slice_going(self, info: SliceRecord) -> None:
        """A pod's slice is being deleted, or the binder is about to delete it (a group's part given
        back). While the pod is still gated nothing ran on the device, so the reservation for the pod
        that the claim got with its allocation goes first: the agent then releases the slice at once
        rather than hold it as in use until the pod goes. (A Failed slice holds no instance, so its
        agent releases it whatever its claim says.)"""
        group = group_of(info)
        record = self.state.pod(info.namespace, group)
        if (record is None or self.state.ungating(info.namespace, group) or not gated(record.body)
                or not owned_by(info.body, record.body)):
            return
        await self.unreserve(info)

    def look(self, namespace: str, name: str, after_s: float = 0.0) -> None:
        """Look at slice ``namespace/name``'s claim again: its key (``slice_key``), after ``after_s``."""
        self.queue.enqueue(("slice", namespace, name), after_s)

    def ready(self, info: SliceRecord) -> bool:
        """Whether the slice's device may be handed on now (``Ledger.check_device``: not being deleted,
        Ready with its device checked against its GpuNode, or, a pod's slice, bound onto a device its
        agent takes without an NVML call, so its pod need not wait for the Ready write). A slice not
        ready is looked at again when its node's GpuNode changes."""
        return self.state.check_device(info.uid, time.monotonic())[0].action == ACCEPT

    def handed(self, info: SliceRecord) -> bool:
        """Whether the slice's claim is allocated and its device may be handed on (what ``ensure`` last
        got to, under the slice's own key), with nothing written."""
        return self.state.claim_state(info.uid) == CLAIM_ALLOCATED and self.ready(info) and (
            info.uid not in self._unstamped or self._known_serves() is False)

    async def ensure(self, info: SliceRecord) -> bool:
        """Write the claim of a ready slice (``ready``), or of a pod's slice (``early``), when it is not
        there yet, and allocate it once the slice is ready; True when the slice's claim is allocated
        and the slice is ready."""
        if self.state.claim_state(info.uid) == CLAIM_ALLOCATED and (
                info.uid not in self._unstamped or self._known_serves() is False):
            return self.ready(info)
        ready = self.ready(info)
        claim: Mapping[str, Any] | None = None
        if self.state.claim_state(info.uid) == CLAIM_ALLOCATED:
            if info.uid not in self._unstamped:
                return ready
            claim = await self._restamp(info, None)
            if claim is None:
                return ready
        if self.state.claim_state(info.uid) == CLAIM_NONE:
            if not ready and not early(info):
                return False
            claim = await self._create(info)
            if claim is None:
                return False
            self.state.set_claim_state(info.uid, CLAIM_WRITTEN)
            # Debug: every pod's slice has one, and the binding's info line says where the slice went.
            log.debug("slice %s: ResourceClaim %s written", info.ref, info.name)
        # A pod's slice's claim is allocated once its binding is decided, beside the binding's write
        # (``Ledger.reserved``): nothing is handed on until that write is done (the pod's ungate waits for
        # it), and a binding whose write fails takes the claim back to written (``Ledger.rollback``).
        binding = self._binding(info.uid)
        if binding is None or not (ready or early(info)):
            return False
        allocated = await self._allocate(info, claim, binding.node)
        if allocated is None:
            return False
        now = self._binding(info.uid)
        if now is None or now.node != binding.node:
            return False  # its binding's write failed meanwhile: the next binding's allocation is checked anew
        # A claim kube-scheduler allocated (an earlier version) keeps its finalizer, and
        # kube-controller-manager clears its allocation once no pod uses it: allocated again at a resync.
        if DELETE_PROTECTION not in ((allocated.get("metadata") or {}).get("finalizers") or []):
            self.state.set_claim_state(info.uid, CLAIM_ALLOCATED)
        if not ready:
            return False
        if (info.body.get("status") or {}).get("phase") == READY:
            await self._record(info)  # an early claim: the agent names it in its Ready write
        return True

    def _binding(self, uid: str) -> Binding | None:
        """The slice's binding: written, or decided and being written (``Ledger.reserved``)."""
        info = self.state.slices.get(uid)
        return None if info is None else info.binding or self.state.reserved(uid)

    async def _create(self, info: SliceRecord) -> Mapping[str, Any] | None:
        """The slice's claim, created now or found (``_take_over``); None when it cannot be had yet."""
        try:
            return await self.client.create(claim_path(info.namespace),
                                            claim_body(info.namespace, info.name, info.uid))
        except ApiError as exc:
            if not exc.conflict:
                raise
        return await self._take_over(info)

    async def _allocate(self, info: SliceRecord, claim: Mapping[str, Any] | None,
                        node: str) -> Mapping[str, Any] | None:
        """Allocate the slice's claim to its device in ``node``'s pool, the node it is bound (or being
        bound) to (``claim``: as last read, None when unknown); the claim once it is so allocated, else None."""
        path = claim_path(info.namespace, info.name)
        if claim is not None:
            state = allocation_state(claim, node, info.uid)
            if state == PINNED:
                unallocated = await self._restamp(info, claim)
                if unallocated is None:
                    return claim
            elif state == ELSEWHERE:
                return await self._allocated_elsewhere(info, claim, node)
        reserved_for = self.consumer(info) if early(info) else None
        try:
            allocated = await self.client.merge_patch(f"{path}/status",
                                                      allocation_patch(node, info.uid, seconds_now(), reserved_for))
        except ApiError as exc:
            if exc.not_found:  # deleted meanwhile: written anew at the slice's next event
                self.state.set_claim_state(info.uid, CLAIM_NONE)
                return None
            if exc.status != 422:
                raise
            # Refused: allocated by someone else first (an allocation cannot change), or refused for
            # another reason (a missing permission, a policy), which is reported as it is.
            claim = await self.client.get(path)
            state = allocation_state(claim, node, info.uid)
            if state == PINNED:
                self._seen_allocated(info.uid, claim)
                return claim
            if state == UNALLOCATED:
                self.events.post(info.body, "Warning", NOT_ALLOCATED,
                                 f"ResourceClaim {info.namespace}/{info.name} could not be allocated: {exc}")
                raise
            return await self._allocated_elsewhere(info, claim, node)
        log.debug("slice %s: ResourceClaim %s allocated on node %s", info.ref, info.name, node)
        self._seen_allocated(info.uid, allocated)
        return allocated

    def _seen_allocated(self, uid: str, claim: Mapping[str, Any]) -> None:
        if stamped(claim):
            self._unstamped.discard(uid)
        else:
            self._unstamped.add(uid)

    def _known_serves(self) -> bool | None:
        """Whether the API server keeps allocationTimestamp, as last read; None when not read lately."""
        if self._serves is None or time.monotonic() - self._serves[0] > SERVER_VERSION_TTL_S:
            return None
        return self._serves[1]

    async def _serves_stamp(self) -> bool:
        known = self._known_serves()
        if known is None:
            known = serves_stamp(await self.client.get("/version"))
            self._serves = (time.monotonic(), known)
            if not known and self._unstamped:
                self.queue.add(RELEASE_KEY, self._release_changed, SERVER_VERSION_TTL_S)
        return known

    async def _release_changed(self) -> None:
        """While claims without a stamp stand on an API server that drops it: its release read again
        (no watch tells of an upgrade), and once it keeps the stamp, each such claim looked at."""
        self._unstamped &= set(self.state.slices)
        if not self._unstamped:
            return
        self._serves = None
        if await self._serves_stamp():
            for uid in list(self._unstamped):
                info = self.state.slices.get(uid)
                if info is not None:
                    self.look(info.namespace, info.name)

    async def _restamp(self, info: SliceRecord, claim: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The slice's allocated claim (``claim``: as last read, None to read it) as the API server that
        runs now expects it (core/books/slice_claim's ``restamp``). None when it is so, or left so for
        the pod that reserves it (looked at again later); else the claim as it is now, to be allocated
        anew: its allocation taken away (claim state written), or gone (claim state none)."""
        if claim is not None:
            self._seen_allocated(info.uid, claim)
        if info.uid not in self._unstamped or not await self._serves_stamp():
            return None
        path = claim_path(info.namespace, info.name)
        if claim is None:
            try:
                claim = await self.client.get(path)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                self._unstamped.discard(info.uid)
                self.state.set_claim_state(info.uid, CLAIM_NONE)
                return {}
            if not (claim.get("status") or {}).get("allocation"):  # taken away, its answer lost: allocated next
                self._unstamped.discard(info.uid)
                self.state.set_claim_state(info.uid, CLAIM_WRITTEN)
                return claim
            self._seen_allocated(info.uid, claim)
        action = restamp(claim, True)
        if action == STAMP_OK:
            self._unstamped.discard(info.uid)
            return None
        if action == STAMP_LATER:
            self.look(info.namespace, info.name, RESTAMP_RECHECK_S)
            return None
        # A 409 (a pod reserved it since it was read) raises: the key is looked at again after its back-off.
        claim = await self.client.merge_patch(f"{path}/status",
                                              deallocation_patch(str(claim["metadata"]["resourceVersion"])))
        self._unstamped.discard(info.uid)
        self.state.set_claim_state(info.uid, CLAIM_WRITTEN)
        log.info("slice %s: ResourceClaim %s was allocated without allocationTimestamp, which this "
                 "kube-apiserver keeps; it is allocated again to the same device", info.ref, info.name)
        return claim

    async def delete_finished(self, info: SliceRecord) -> None:
        """Delete the claim of a finished pod's slice. kube-controller-manager takes a finished pod's
        reservation off a claim, but reserves an allocated claim again for any pod bound to a node,
        finished or not; it stops only for a claim it deallocates, and it deallocates only claims
        kube-scheduler allocated. Left, the claim would hold the slice (``claim_hold``) on and off
        until the pod object goes. The kubelet unprepares a deleted claim from its own checkpoint."""
        try:
            await self.client.delete(claim_path(info.namespace, info.name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    async def unreserve(self, info: SliceRecord) -> None:
        """Take the reservation for the slice's pod off its claim (written with the allocation), once:
        the caller knows the pod is still gated, so nothing ran on the device, and the slice goes.
        Left on, it would hold the slice (``core.node.lifecycle.claim_hold``) until the pod goes."""
        pod = info.pod_owner
        if pod is None or info.binding is None or not self.state.unreserving(info.uid):
            return  # an unbound slice's claim is not allocated, so not reserved either
        try:
            await self.client.strategic_patch(f"{claim_path(info.namespace, info.name)}/status",
                                              unreserve_patch(pod))
        except ApiError as exc:
            if not exc.not_found:
                self.state.unreserve_failed(info.uid)
                raise
        log.debug("slice %s: its ResourceClaim is no longer reserved for its gated pod", info.ref)

    async def _allocated_elsewhere(self, info: SliceRecord, claim: Mapping[str, Any], node: str) -> None:
        """The slice's claim is allocated to another device or pool than the slice's device on ``node``:
        deleted (written anew at the slice's next event), with a Warning Event that names the allocation."""
        results = [f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" for r in
                   ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or [])]
        message = (f"ResourceClaim {info.namespace}/{info.name} was allocated {', '.join(results) or 'otherwise'}, "
                   f"not this slice's device in node {node}'s pool; it is deleted and written anew")
        self.events.post(info.body, "Warning", ALLOCATED_ELSEWHERE, message)
        log.warning("slice %s: %s", info.ref, message)
        self.state.set_claim_state(info.uid, CLAIM_NONE)
        try:
            await self.client.delete(claim_path(info.namespace, info.name))
        except ApiError as exc:
            if not exc.not_found:
                raise
        return None

    async def _take_over(self, info: SliceRecord) -> Mapping[str, Any] | None:
        """A claim of the slice's name exists: this slice's is returned; an earlier slice's is deleted
        and this one's written once it is gone (its key is looked at again); a claim not the operator's
        is left alone. None when it is not this slice's (yet)."""
        try:
            existing = await self.client.get(claim_path(info.namespace, info.name))
        except ApiError as exc:
            if not exc.not_found:
                raise
            self.look(info.namespace, info.name)  # gone since the create was refused: written at the next look
            return None
        owner = slice_owner(existing)
        if owner == info.uid:
            return existing
        if owner is None:
            message = (f"ResourceClaim {info.namespace}/{info.name} exists and was not written by mig-operator; "
                       "rename or delete it, or give the GpuSlice another name")
            self.events.post(info.body, "Warning", CLAIM_TAKEN, message)
            log.info("slice %s: %s", info.ref, message)
            return None
        going = (existing.get("metadata") or {}).get("deletionTimestamp")
        if not going:
            try:
                await self.client.delete(claim_path(info.namespace, info.name))
            except ApiError as exc:
                if not exc.not_found:
                    raise
        # Gone once its pods let it go (kube-scheduler's finalizer on a claim it allocated): then this
        # slice's is written, at a later look of its key.
        low, high = STALE_CLAIM_RECHECK_S
        self.look(info.namespace, info.name, min(high, max(low, _seconds_since(going) / 5)))
        log.debug("slice %s: the ResourceClaim of an earlier slice of its name is still going", info.ref)
        return None

    async def _record(self, info: SliceRecord) -> None:
        """The claim's name in the slice's status (``kubectl get gs`` shows it)."""
        if (info.body.get("status") or {}).get("claim") == info.name:
            return
        try:
            await self.client.merge_patch(f"{slice_path(info.namespace, info.name)}/status",
                                          {"status": {"claim": info.name}})
        except ApiError as exc:
            if not exc.not_found:
                raise
