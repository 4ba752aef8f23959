"""Realising a slice bound to this node, and letting its instance go when it fails or is gone.

Decisions come from ``core.node.lifecycle`` (what to do with a slice event, which instance to use); this
module carries them out in this order, so that a crash anywhere leaves an intent to finish or an
idle instance, never a leak or a device serving two slices:

1. record the intent (owner record ``started``), and write ``phase: Creating`` before any NVML call;
2. destroy the reclaim set (each only if the record gives it to no slice and NVML reports no process),
   then reuse, complete or create the instance;
3. record the device (``completed``), then write ``phase: Ready``.

A slice that fails, or is gone (``release.py`` releases a deleted one), lets its instance go: idle
in the record, or held while a claim prepared on it is (``let_go``). A reuse makes no NVML change
and is handed over at once, never waiting behind a create on the GPU's lock; an instance claimed by
one slice's step (a reuse, or a create's reclaim) is never taken by another's until it is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from mig_operator.core.node.lifecycle import (
    COMPLETED,
    CREATING,
    STARTED,
    Blocked,
    MigSteps,
    OwnerEntry,
    OwnerRecord,
    offered,
    offered_entries,
    plan_mig,
)
from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    Binding,
    InstanceState,
    binding_from_status,
    describe_binding,
)
from mig_operator.core.placement.compute import gpu_compute
from mig_operator.core.requests.quantities import format_bytes
from mig_operator.gpu.mps import MpsError
from mig_operator.gpu.protocol import GpuError, GpuInfo, MigInstance

from ..common import metrics, status
from ..common.client import ApiError, resource_version, slice_path
from ..common.faults import crashpoint
from .context import AgentContext
from .gpus import describe_instance
from .inventory import instance_state
from .mps_keeper import SLICE_REASON
from .publish import Publisher

log = logging.getLogger("mig_operator.agent")
T = TypeVar("T")


def _gpu_error_reason(error: GpuError) -> str:
    # NVML's name in CamelCase for status.reason (IN_USE -> NvmlInUse); the message keeps NVML_ERROR_IN_USE.
    return "Nvml" + "".join(part.capitalize() for part in error.name.split("_"))


def _is_transient(exc: BaseException) -> bool:
    return (isinstance(exc, GpuError) and exc.transient) or (isinstance(exc, Blocked) and exc.transient)


def _as_mig(gpu: int, inst: InstanceState) -> MigInstance:
    return MigInstance(gpu, inst.gi_id, inst.ci_id, inst.profile_id, inst.profile, inst.start, inst.size,
                       inst.device_uuid, inst.in_use)


class Realiser:
    """Realises and releases this node's slices; knows which slices say Ready (their devices' offers)."""

    def __init__(self, context: AgentContext, publisher: Publisher) -> None:
        self.settings = context.settings
        self.gpus = context.gpus
        self.store = context.store
        self.client = context.client
        self.events = context.events
        self.publisher = publisher
        self.mps = context.mps
        # Slices whose status says Ready and that are not being deleted, as last seen or written here.
        self.shown_ready: set[str] = set()
        # Slices realised whose Ready write is under way: their device is published first, and their
        # own older events (still Creating) must not take it out again.
        self.announcing: set[str] = set()
        self.written: dict[str, int] = {}  # slice UID -> resourceVersion of the agent's last write
        # (GPU, GI id) -> the slice whose step holds the instance until that step is recorded: a
        # reuse and a create's reclaim on one GPU never take the same instance.
        self._claims: dict[tuple[int, int], str] = {}
        # Slices being realised here, and what waits for each to be offered (``until_offered``): a pod
        # whose device needs no NVML call is let go before its slice's Ready, so the kubelet may ask
        # to prepare its claim while the slice is still being realised.
        self.realising: set[str] = set()
        self._offered: dict[str, asyncio.Event] = {}

    # ---- what is offered ---------------------------------------------------------------------------

    def offers(self, uid: str) -> bool:
        return offered(self.store.record.owners.get(uid), uid in self.store.revoked,
                       uid in self.shown_ready or uid in self.announcing)

    def offered_entries(self) -> list[OwnerEntry]:
        return offered_entries(self.store.record, self.store.revoked, self.shown_ready | self.announcing)

    async def until_offered(self, uid: str, timeout_s: float) -> bool:
        """Whether slice ``uid`` is offered, waiting up to ``timeout_s`` while it is being realised here."""
        if self.offers(uid) or uid not in self.realising:
            return self.offers(uid)
        event = self._offered.setdefault(uid, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        if not event.is_set() and self._offered.get(uid) is event:
            del self._offered[uid]
        return self.offers(uid)

    def _realised(self, uid: str) -> None:
        """The slice's realisation ended, offered or not: whoever waits for it looks again."""
        self.realising.discard(uid)
        event = self._offered.pop(uid, None)
        if event is not None:
            event.set()

    def saw(self, uid: str, phase_ready: bool) -> None:
        """A slice event says Ready (and not deleting) or not; a slice being announced keeps its offer."""
        if phase_ready:
            self.shown_ready.add(uid)
        elif uid not in self.announcing:
            self.shown_ready.discard(uid)

    # ---- realise -----------------------------------------------------------------------------------

    async def _retrying(self, what: Callable[[], Awaitable[T]]) -> T:
        """``what`` again while it fails transiently (NVML IN_USE, TIMEOUT, a process still on an instance)."""
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.settings.nvml_attempts),
            wait=wait_exponential(multiplier=self.settings.nvml_first_wait_s, max=5.0),
            retry=retry_if_exception(_is_transient),
            reraise=True,
        ):
            with attempt:
                return await what()
        raise AssertionError("unreachable: tenacity reraises")

    async def realise(self, body: Mapping) -> None:
        meta, current = body["metadata"], body.get("status") or {}
        uid, ref = meta["uid"], f"{meta['namespace']}/{meta['name']}"
        binding = binding_from_status(uid, current)
        if binding is None or binding.node != self.settings.node:
            return
        started = time.perf_counter()
        gpu = self.gpus.get(binding.gpu)
        self.realising.add(uid)
        try:
            await self._realise(body, uid, ref, binding, gpu, started)
        finally:
            self._realised(uid)

    async def _realise(self, body: Mapping, uid: str, ref: str, binding: Binding, gpu: GpuInfo | None,
                       started: float) -> None:
        try:
            if gpu is None:
                raise Blocked(f"node {self.settings.node} has no GPU {binding.gpu}", transient=False)
            if binding.mode == MODE_FRACTION:
                action, ready = await self._realise_fraction(uid, ref, binding, gpu)
            else:
                action, ready = await self._realise_mig(uid, ref, binding, body)
        except GpuError as exc:
            await self._fail(body, _gpu_error_reason(exc), f"{describe_binding(binding)}: {exc}")
            return
        except Blocked as exc:
            await self._fail(body, "InUse" if exc.transient else "Conflict", exc.message)
            return
        except MpsError as exc:
            await self._fail(body, SLICE_REASON, f"{describe_binding(binding)}: {exc}")
            return
        # The device goes into the ResourceSlice as the slice says Ready, both writes at once: the
        # controller allocates the claim itself (kube-scheduler never looks for the device), and the
        # kubelet's prepare asks this agent, so neither waits for the other (one write less on every
        # pod's path: bench/results/benchmark-history.md).
        self.announcing.add(uid)
        self._realised(uid)  # offered from here: a prepare that waits for it goes on
        if action == "create":
            # The controller hands a device on once the GpuNode lists it: a new instance's GpuNode write
            # starts beside its Ready, not after it (the record names the instance's slice already; a
            # publish awaited before Ready cost a new instance more than the controller's wait for it).
            self.publisher.schedule(at_once=True)
        try:
            await asyncio.gather(self.publisher.devices(), self.write_status(body, ready))
            self.shown_ready.add(uid)
        except BaseException:
            self.shown_ready.discard(uid)
            self.publisher.schedule()
            raise
        finally:
            self.announcing.discard(uid)
        log.info("slice %s ready: %s", ref, ready["message"])
        metrics.REALISE_SECONDS.labels(action).observe(time.perf_counter() - started)
        # A reused instance (listed idle) and a fraction's GPU are listed already, so their change joins
        # the next coalesced publish (a GpuNode write costs kube-apiserver about ten times a slice's
        # status write: bench/results/benchmark-history.md).
        if action != "create":
            self.publisher.schedule()

    async def _realise_fraction(self, uid: str, ref: str, binding: Binding, gpu: GpuInfo) -> tuple[str, dict]:
        if gpu.mig_enabled:
            raise Blocked(f"GPU {gpu.index} of {self.settings.node} is in MIG mode; it takes no fractions",
                          transient=False)
        neighbours = [e for e in self.store.record.owners.values()
                      if e.mode == MODE_FRACTION and e.gpu == gpu.index and e.uid != uid]
        others = sum(e.granted_bytes for e in neighbours)
        if others + binding.granted_bytes > gpu.memory_mib * 2**20:
            raise Blocked(
                f"GPU {gpu.index} of {self.settings.node} has {format_bytes(gpu.memory_mib * 2**20 - others)} "
                f"left for fractions, not {format_bytes(binding.granted_bytes)}", transient=False,
            )
        # Compute as the controller planned it (core.placement.compute): the shares fit, and shares (MPS) and
        # shared fractions do not meet on one GPU.
        compute = gpu_compute(e.compute for e in neighbours)
        if not compute.takes(binding.compute):
            raise Blocked(f"GPU {gpu.index} of {self.settings.node} {compute.why_not(binding.compute)}",
                          transient=False)
        entry = OwnerEntry(uid, ref, MODE_FRACTION, gpu.index, COMPLETED, binding.granted_bytes,
                           device_uuid=gpu.uuid, compute=binding.compute)
        await asyncio.to_thread(self.store.put, entry)
        message = f"{describe_binding(binding)} ({gpu.uuid}), enforced by libgpuslice"
        if binding.compute is not None:  # its share is served by the GPU's MPS daemon, running before Ready
            await self.mps.ensure(gpu.uuid, self.mps.needed()[gpu.uuid])
            message += " and its compute share by MPS"
        return "fraction", status.ready(None, gpu.uuid, binding.granted_bytes, False, message,
                                        claim=ref.rpartition("/")[2])

    async def _realise_mig(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict]:
        """A reuse (or a resume after a crash) is handed over at once: it makes no NVML call, so it must
        not wait behind a create of seconds on the same GPU. Anything else runs under the GPU's lock,
        retried while it fails transiently."""
        handed = await self._hand_over(uid, ref, binding, body)
        if handed is not None:
            return handed
        async with self.gpus.lock(binding.gpu):
            return await self._retrying(lambda: self._realise_mig_locked(uid, ref, binding, body))

    def _claim(self, uid: str, gpu: int, instances: list[InstanceState]) -> list[tuple[int, int]] | None:
        """Claim instances for slice ``uid`` until its step is recorded; None if another slice's step
        holds one of them. Synchronous, so the check and the claim happen with no await between."""
        keys = [(gpu, inst.gi_id) for inst in instances]
        if any(self._claims.get(key, uid) != uid for key in keys):
            return None
        for key in keys:
            self._claims[key] = uid
        return keys

    def _unclaim(self, uid: str, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            if self._claims.get(key) == uid:
                del self._claims[key]

    async def _hand_over(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict] | None:
        instances = [instance_state(i) for i in await self.gpus.on(binding.gpu)]
        try:
            steps = plan_mig(uid, binding, instances, self.store.record)
        except Blocked:
            return None  # the locked path decides (and retries) with the same rules
        if steps.action not in ("reuse", "resume") or steps.destroy:
            return None
        assert steps.instance is not None
        keys = self._claim(uid, binding.gpu, [steps.instance])
        if keys is None:
            return None
        try:
            entry = self.store.record.owners.get(uid)
            reused = entry.reused if entry is not None and entry.state == STARTED else steps.action == "reuse"
            return await self._finish(uid, ref, binding, body, _as_mig(binding.gpu, steps.instance), reused)
        finally:
            self._unclaim(uid, keys)

    async def _realise_mig_locked(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict]:
        instances = [instance_state(i) for i in await self.gpus.on(binding.gpu)]
        record = self.store.record
        steps = plan_mig(uid, binding, instances, record)
        keys = self._claim(uid, binding.gpu, [*steps.destroy, *([steps.instance] if steps.instance else [])])
        if keys is None:
            raise Blocked(f"an instance at {describe_binding(binding)} is being handed to another slice",
                          transient=True)
        try:
            return await self._carry_out(uid, ref, binding, body, steps, record)
        finally:
            self._unclaim(uid, keys)

    async def _carry_out(self, uid: str, ref: str, binding: Binding, body: Mapping, steps: MigSteps,
                         record: OwnerRecord) -> tuple[str, dict]:
        gpu, backend = binding.gpu, self.gpus.backend
        entry = record.owners.get(uid)
        reused = entry.reused if entry is not None and entry.state == STARTED else steps.action == "reuse"
        base = OwnerEntry(uid, ref, MODE_MIG, gpu, STARTED, binding.granted_bytes, binding.profile_id,
                          binding.profile, binding.start, binding.size, reused=reused)
        if steps.needs_nvml:
            if entry is None or entry.state != STARTED:
                await asyncio.to_thread(self.store.put, base)
            if (body.get("status") or {}).get("phase") != CREATING:
                what = "creating" if steps.action == "create" else "completing"
                reclaim = f" after reclaiming {len(steps.destroy)} idle instance(s)" if steps.destroy else ""
                await self.write_status(body, status.creating(body.get("status"),
                                                              f"{what} {describe_binding(binding)}{reclaim}"))
                log.info("slice %s: %s %s%s", ref, what, describe_binding(binding), reclaim)
            crashpoint("agent:after-intent")
        for n, victim in enumerate(steps.destroy):
            await self.gpus.call("destroy_instance", backend.destroy_instance, gpu, victim.gi_id)
            log.info("slice %s: reclaimed idle %s (%s) to make room", ref,
                     describe_instance(self.settings.node, gpu, victim), victim.device_uuid or "no device")
            if victim.device_uuid:
                await asyncio.to_thread(self.store.update, lambda r, u=victim.device_uuid: replace(
                    r, idle_since={k: v for k, v in r.idle_since.items() if k != u}))
            if n == 0:
                crashpoint("agent:during-reclaim")
        if steps.action == "create":
            try:
                made = await self.gpus.call("create_instance", backend.create_instance, gpu, binding.profile_id,
                                            binding.start)
            except GpuError:
                await self._clear_half_made(gpu, binding)
                raise
            crashpoint("agent:after-create")
        elif steps.action == "complete":
            assert steps.instance is not None
            made = await self.gpus.call("create_compute_instance", backend.create_compute_instance, gpu,
                                        steps.instance.gi_id)
        else:
            assert steps.instance is not None
            made = _as_mig(gpu, steps.instance)
        return await self._finish(uid, ref, binding, body, made, reused)

    async def _finish(self, uid: str, ref: str, binding: Binding, body: Mapping, made: MigInstance,
                      reused: bool) -> tuple[str, dict]:
        """Record the device as the slice's (the record is the authority from here on), then say Ready."""
        done = OwnerEntry(uid, ref, MODE_MIG, binding.gpu, COMPLETED, binding.granted_bytes, binding.profile_id,
                          binding.profile, binding.start, binding.size, made.gi_id, made.ci_id, made.device_uuid,
                          reused)
        await asyncio.to_thread(self.store.put, done)
        verb = "reused idle" if reused else "created"
        message = f"{verb} {describe_binding(binding)}: {made.device_uuid}"
        ready = status.ready(body.get("status"), made.device_uuid, binding.granted_bytes, reused, message,
                             gi_id=made.gi_id, ci_id=made.ci_id, claim=ref.rpartition("/")[2])
        return ("reuse" if reused else "create"), ready

    async def _clear_half_made(self, gpu: int, binding: Binding) -> None:
        """After a failed create, destroy what it left at the placement (a GI without its CI), if anything."""
        try:
            for inst in await self.gpus.on(gpu):
                if inst.start == binding.start and inst.profile_id == binding.profile_id and inst.ci_id < 0:
                    await self.gpus.call("destroy_instance", self.gpus.backend.destroy_instance, gpu, inst.gi_id)
        except GpuError as exc:
            log.warning("half-made instance at %s on GPU %s stays until the next attempt: %s",
                        binding.start, gpu, exc)

    async def _fail(self, body: Mapping, reason: str, message: str) -> None:
        meta = body["metadata"]
        log.warning("slice %s/%s failed: %s", meta["namespace"], meta["name"], message)
        metrics.RECONCILE_ERRORS.labels("agent", reason).inc()
        await self.let_go(meta["uid"])
        await self.write_status(body, status.failed(body.get("status"), reason, message))
        self.events.post(body, "Warning", reason, message)
        self.publisher.schedule()

    async def mps_changed(self, gpu_uuid: str, ok: bool, message: str) -> None:
        """The GPU's MPS daemon stopped answering (``ok`` False) or answers again: each Ready compute
        share on it says so in its Ready condition (reason ``MPSUnavailable``); its phase stays."""
        for entry in list(self.store.record.owners.values()):
            if entry.device_uuid != gpu_uuid or entry.compute is None or entry.uid not in self.shown_ready:
                continue
            namespace, _, name = entry.slice.partition("/")
            try:
                body = await self.client.get(slice_path(namespace, name))
                if body["metadata"]["uid"] != entry.uid:
                    continue
                reason = "MPSDaemonRunning" if ok else SLICE_REASON
                await self.write_status(body, status.serving(body.get("status"), ok, reason, message))
            except ApiError as exc:
                log.warning("cannot say on slice %s that its MPS daemon %s: %s", entry.slice,
                            "answers again" if ok else "is down", exc)

    async def write_status(self, body: Mapping, new_status: dict) -> None:
        meta = body["metadata"]
        answer = await self.client.merge_patch(slice_path(meta["namespace"], meta["name"], status=True),
                                               {"status": new_status})
        self.written[meta["uid"]] = resource_version(answer.get("metadata") or {})

    async def let_go(self, uid: str) -> None:
        """The slice is gone or failed: its instance becomes idle, unless a prepared claim holds it
        (then it stays the slice's, held and offered to nobody, until the kubelet unprepares it)."""
        self.shown_ready.discard(uid)
        if self.store.claims_on(uid):
            if uid not in self.store.revoked:
                entry = self.store.record.owners.get(uid)
                log.info("slice %s is gone while its claim is prepared: %s stays held until the kubelet "
                         "unprepares it", entry.slice if entry else uid, entry.device_uuid if entry else "")
                await asyncio.to_thread(self.store.revoke, uid)
        else:
            await asyncio.to_thread(self.store.drop, uid, status.now())
        self.publisher.schedule()
