"""Releasing a slice: its instance becomes idle in the record, then the agent's finalizer goes.

Nothing is released while in use: a deleted slice whose ResourceClaim is reserved for a pod or
prepared here (``core.node.lifecycle.claim_hold``) keeps its finalizer, so its binding, its GPU room and
its quota charge stay, and says so (condition Released=False, reason InUse). The pod's end frees the
claim without an event the agent sees, so ``release`` says when to look again (``release_recheck_s``,
doubling up to ``release_recheck_max_s`` while nothing changes) and the agent's work queue runs the
slice's key then, and at once when the kubelet unprepares a claim on it: one GET of its claim each time,
and only for such slices, rather than a cluster-wide watch of ResourceClaims in every agent. Each
slice's release runs from its key on the work queue, one run at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from mig_operator.core.books.slice_claim import claim_path
from mig_operator.core.node.lifecycle import IN_USE, ClaimHold, OwnerEntry, claim_hold
from mig_operator.core.placement.cluster import MODE_MIG, Binding, describe_binding

from ..common import status
from ..common.client import ApiError, slice_path
from ..common.faults import crashpoint
from ..common.finalizers import remove_finalizer
from ..common.names import AGENT_FINALIZER
from .context import AgentContext
from .realise import Realiser

log = logging.getLogger("mig_operator.agent")


class Releaser:
    """Releases this node's deleted slices, holding those whose claim is in use."""

    def __init__(self, context: AgentContext, realiser: Realiser) -> None:
        self.settings = context.settings
        self.realiser = realiser
        self.store = context.store
        self.client = context.client
        self.events = context.events
        self.holding: dict[str, str] = {}  # deleted slices kept while their claim is in use -> message written
        self._interval: dict[str, float] = {}  # held slice uid -> the wait before its last re-check

    async def claim_released(self, slice_uid: str) -> bool:
        """The kubelet unprepared a claim on the slice. True when the slice is deleted but held: it is
        to be looked at again now (an instance is never reused while a claim on it is prepared)."""
        held = slice_uid in self.holding
        if held:
            self._interval.pop(slice_uid, None)  # its next re-checks come soon again
        if slice_uid in self.store.revoked and not self.store.claims_on(slice_uid):
            entry = self.store.record.owners.get(slice_uid)
            if entry is not None:
                self.log_release(entry)
            await asyncio.to_thread(self.store.drop, slice_uid, status.now())
            self.realiser.publisher.schedule()
        return held

    async def deleted(self, body: Mapping) -> None:
        """The slice is gone. Normally its release already ran (the finalizer held it); if the
        finalizer was removed by hand, its instance becomes idle now."""
        uid = body["metadata"]["uid"]
        self.realiser.written.pop(uid, None)
        self.holding.pop(uid, None)
        self._interval.pop(uid, None)
        self.realiser.shown_ready.discard(uid)
        if uid in self.store.record.owners:
            if uid not in self.store.revoked:
                self.log_release(self.store.record.owners[uid])
            await self.realiser.let_go(uid)

    async def release(self, body: Mapping) -> float | None:
        """The slice is being deleted: unless its claim is in use, its instance becomes idle, then the
        finalizer goes (None). While its claim is in use it is kept as it is and says so, and the answer
        is the seconds until it is looked at again."""
        meta = body["metadata"]
        uid = meta["uid"]
        self.realiser.shown_ready.discard(uid)
        if uid in self.store.record.owners:
            hold = await self._claim_hold(body)
            if not hold.free:
                await self._hold(body, hold)
                return self._next_look(uid)
        self.holding.pop(uid, None)
        self._interval.pop(uid, None)
        if uid in self.store.record.owners:
            if not self.store.claims_on(uid):
                self.log_release(self.store.record.owners[uid])
            await self.realiser.let_go(uid)
        crashpoint("agent:during-release")
        await remove_finalizer(self.client, slice_path(meta["namespace"], meta["name"]), body, AGENT_FINALIZER)
        return None

    def _next_look(self, uid: str) -> float:
        """The wait before a held slice's next look: ``release_recheck_s``, doubling while it stays held."""
        last = self._interval.get(uid)
        wait = self.settings.release_recheck_s if last is None else min(last * 2, self.settings.release_recheck_max_s)
        self._interval[uid] = wait
        return wait

    async def _claim_hold(self, body: Mapping) -> ClaimHold:
        """Who holds the slice's claim: its reservations (the API server's claim of the slice's name)
        and the claims prepared here on its device (the record)."""
        meta = body["metadata"]
        try:
            claim = await self.client.get(claim_path(meta["namespace"], meta["name"]))
        except ApiError as exc:
            if not exc.not_found:
                raise
            claim = None
        prepared = [f"{c.namespace}/{c.name}" for c in self.store.claims_on(meta["uid"])]
        return claim_hold(meta["uid"], claim, prepared)

    async def _hold(self, body: Mapping, hold: ClaimHold) -> None:
        """Keep a deleted slice whose claim is in use: the finalizer stays; its status says who holds it."""
        meta = body["metadata"]
        uid = meta["uid"]
        message = hold.message(self.settings.node)
        written = self.holding.setdefault(uid, "")
        shown = status.released_condition(body.get("status"))
        if written != message and not (shown is not None and shown.get("status") == "False"
                                        and shown.get("message") == message):
            await self.realiser.write_status(body, status.held_in_use(body.get("status"), message))
            self.holding[uid] = message
            self.events.post(body, "Normal", IN_USE, message)
            log.info("slice %s/%s is deleted but kept: %s", meta["namespace"], meta["name"], message)
        else:
            log.info("slice %s/%s is deleted and still in use, kept: %s", meta["namespace"], meta["name"], message)

    def log_release(self, entry: OwnerEntry) -> None:
        if entry.mode == MODE_MIG:
            where = Binding(entry.uid, self.settings.node, entry.gpu, MODE_MIG, entry.granted_bytes, entry.profile_id,
                            entry.profile, entry.start, entry.size)
            if entry.device_uuid:
                log.info("slice %s released: %s stays as an idle instance (%s)", entry.slice,
                         describe_binding(where), entry.device_uuid)
            else:
                log.info("slice %s released before its instance %s was made", entry.slice, describe_binding(where))
        else:
            where = Binding(entry.uid, self.settings.node, entry.gpu, entry.mode, entry.granted_bytes,
                            compute=entry.compute)
            log.info("slice %s released: its %s is free", entry.slice, describe_binding(where))
