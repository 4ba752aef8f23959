"""The MPS control daemons of this node's GPUs: one runs on each GPU that holds a compute share.

A GPU's daemon is started when the first fraction with a compute share is realised there (before
that slice says Ready), and stopped when the record names no such slice on it any more (a slice held
by a prepared claim after its deletion still counts). ``settle`` makes the daemons match the record:
it runs with every publish (after each change, and at each heartbeat), so a daemon that died is
started again and one no slice needs goes within a publish delay. A restarted agent adopts the
daemon it left: one that answers is never restarted (``MpsControl.start``). The daemon holds, for
each GPU, the largest share and memory of its slices (``MpsControl.hold``): no client of the GPU gets
more than that, whatever its own environment says; each client's own share and limit come from its
CDI spec (``core.node.environment.mps_environment``).

What the cluster sees: the GpuNode condition ``MPSReady`` (True while every GPU that needs a daemon
has one answering; False, reason ``MPSDaemonFailed``, naming the GPU and the cause), and a slice
whose daemon cannot be started fails with reason ``MPSUnavailable`` (``realise.py``); the kubelet
plugin prepares no claim of a slice whose GPU's daemon does not answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mig_operator.core.node.environment import mps_ceilings
from mig_operator.core.placement.cluster import MODE_FRACTION
from mig_operator.gpu.mps import MpsControl, MpsDirs, MpsError

from .gpus import Gpus
from .record import RecordStore

log = logging.getLogger("mig_operator.agent")

CONDITION_TYPE = "MPSReady"
REASON_RUNNING = "MPSDaemonsRunning"
REASON_NONE = "NoComputeShares"
REASON_FAILED = "MPSDaemonFailed"
SLICE_REASON = "MPSUnavailable"  # a slice's Ready=False / Failed reason


class MpsKeeper:
    """Starts, adopts, holds and stops the node's MPS control daemons; says how they are."""

    def __init__(self, gpus: Gpus, store: RecordStore, control: MpsControl | None,
                 now: Callable[[], str]) -> None:
        self.gpus = gpus
        self.store = store
        self.control = control  # None: this agent serves no compute shares (no MPS here)
        self.now = now
        self.failed: dict[str, str] = {}  # GPU UUID -> why its daemon does not run
        self.held: dict[str, tuple[int, int]] = {}  # GPU UUID -> (thread percentage, bytes) held
        self.running: set[str] = set()
        self._seen = False  # a compute share was served here: the condition is published from then on
        self._since = ""
        self._status = ""
        self._lock = asyncio.Lock()
        # Told when a GPU's daemon stops answering (False) or answers again (True), with why: the
        # Ready compute shares on it say so (Realiser.mps_changed).
        self.on_change: Callable[[str, bool, str], Awaitable[None]] | None = None
        self._told: dict[str, bool] = {}  # GPU UUID -> whether on_change last said it answers

    def dirs(self, gpu_uuid: str) -> MpsDirs | None:
        return self.control.dirs(gpu_uuid) if self.control is not None else None

    def needed(self) -> dict[str, tuple[int, int]]:
        """GPU UUID -> (the largest thread percentage, the largest granted bytes) of its compute shares."""
        return mps_ceilings((e.device_uuid, e.compute, e.granted_bytes) for e in self.store.record.owners.values()
                            if e.mode == MODE_FRACTION and e.compute is not None and e.device_uuid)

    def ready(self, gpu_uuid: str) -> bool:
        return gpu_uuid in self.running

    async def ensure(self, gpu_uuid: str, ceiling: tuple[int, int]) -> None:
        """The GPU's daemon runs (started or adopted) and holds at least ``ceiling``; MpsError if not."""
        if self.control is None:
            raise MpsError(f"this agent runs no MPS control daemons, so GPU {gpu_uuid} takes no compute share")
        async with self._lock:
            await self._ensure(gpu_uuid, ceiling)

    async def _ensure(self, gpu_uuid: str, ceiling: tuple[int, int]) -> None:
        assert self.control is not None
        self._seen = True
        try:
            if not await asyncio.to_thread(self.control.running, gpu_uuid):
                self.held.pop(gpu_uuid, None)
                await asyncio.to_thread(self.control.start, gpu_uuid)
                log.info("MPS control daemon of %s %sstarted (%s)", gpu_uuid,
                         "re" if gpu_uuid in self.running else "", self.control.dirs(gpu_uuid).pipe)
            elif gpu_uuid not in self.running:
                log.info("MPS control daemon of %s adopted: it answers (%s)", gpu_uuid,
                         self.control.dirs(gpu_uuid).pipe)
            self.running.add(gpu_uuid)
            # Raised when a larger share comes, lowered when it goes: never looser than the GPU's largest.
            if self.held.get(gpu_uuid) != ceiling:
                await asyncio.to_thread(self.control.hold, gpu_uuid, *ceiling)
                self.held[gpu_uuid] = ceiling
        except MpsError as exc:
            self.running.discard(gpu_uuid)
            if self.failed.get(gpu_uuid) != str(exc):
                log.error("%s", exc)
            self.failed[gpu_uuid] = str(exc)
            raise
        self.failed.pop(gpu_uuid, None)

    async def settle(self) -> None:
        """Make the daemons match the record: one answering, holding its slices' ceiling, on each GPU
        that needs one; none on the others (left by a slice gone or an agent before this one)."""
        if self.control is None:
            return
        async with self._lock:
            needed = self.needed()
            for uuid, ceiling in needed.items():
                try:
                    await self._ensure(uuid, ceiling)
                except MpsError:
                    pass  # kept in self.failed: the condition says it, the next publish tries again
                why = self.failed.get(uuid)
                if self.on_change is not None and self._told.get(uuid, True) != (why is None):
                    await self.on_change(uuid, why is None, why or f"the MPS control daemon of {uuid} answers again")
                self._told[uuid] = why is None
            unneeded = [gpu for gpu in self.gpus.all if gpu.uuid not in needed]
            for gpu in unneeded:
                self.failed.pop(gpu.uuid, None)
                self.held.pop(gpu.uuid, None)
                self._told.pop(gpu.uuid, None)
            # Each publish asks: one thread hop for all the GPUs, most of which never had a daemon.
            unknown = [gpu.uuid for gpu in unneeded if gpu.uuid not in self.running]
            answering = await asyncio.to_thread(self._answering, unknown) if unknown else set()
            for gpu in unneeded:
                if gpu.uuid not in self.running and gpu.uuid not in answering:
                    continue
                try:
                    await asyncio.to_thread(self.control.stop, gpu.uuid)
                    log.info("MPS control daemon of %s stopped: no compute share left on GPU %s",
                             gpu.uuid, gpu.index)
                    self.running.discard(gpu.uuid)
                except MpsError as exc:
                    log.warning("%s", exc)

    def _answering(self, uuids: list[str]) -> set[str]:
        """The GPUs among ``uuids`` whose daemon answers (one left by an agent before this one)."""
        assert self.control is not None
        found = set()
        for uuid in uuids:
            try:
                if self.control.running(uuid):
                    found.add(uuid)
            except MpsError as exc:
                log.warning("%s", exc)
        return found

    def condition(self) -> dict[str, str] | None:
        """The GpuNode's ``MPSReady`` condition, once this agent has served a compute share."""
        if not self._seen:
            return None
        index = {g.uuid: g.index for g in self.gpus.all}
        if self.failed:
            status, reason = "False", REASON_FAILED
            message = "; ".join(f"GPU {index.get(u, '?')} ({u}): {why}" for u, why in sorted(self.failed.items()))
        elif self.running:
            status, reason = "True", REASON_RUNNING
            message = "MPS control daemon answering on " + ", ".join(
                f"GPU {index.get(u, '?')} ({u})" for u in sorted(self.running))
        else:
            status, reason, message = "True", REASON_NONE, "no GPU of this node holds a compute share"
        if status != self._status:
            self._status, self._since = status, self.now()
        return {"type": CONDITION_TYPE, "status": status, "reason": reason, "message": message[:1000],
                "lastTransitionTime": self._since}
