"""What each Ready slice on the node uses (``--usage-interval``), shown in its status, its metrics, and
whether it is idle (``--idle-after``).

Every interval each slice the agent shows Ready is read off the event loop: a MIG slice from NVML's
figures of its MIG device; a fraction from the shim's ledger of the slice (memory in use, its peak,
processes, refusals: the ledger already sums every process of every pod of the claim) and NVML's figures
of its GPU for the share of time with work (a fraction of the whole GPU has no shim: NVML's figures of
the GPU). Each reading is folded into the slice's usage (``core.usage.next_usage``; the peak starts
from the status a restarted agent finds) and sets the slice's metrics. A slice's first reading falls at
a random point of the first interval, so that an agent started beside many Ready slices does not
write them all in one tick.

Writing is level-triggered: a reading records the usage and enqueues the key ``("usage", namespace,
uid)`` when what the slice shows (its status as last seen, or this agent's own newer write) is behind
by what ``worth_writing`` counts, or its ``Active`` condition's status would change; ``reconcile``
compares the same again and writes ``status.usage`` and the condition in one merge patch against the
resourceVersion it read (the conditions list is written whole), so a conflict raises and the work
queue tries again on the slice read anew. ``Active`` turning False posts a Normal Event ``Idle``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from mig_operator.core.books.slice_claim import claim_path
from mig_operator.core.node.cdi import ledger_dir
from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG
from mig_operator.core.placement.profiles import GpuModel
from mig_operator.core.times import read_time
from mig_operator.core.usage.advice import Advice, advise_fraction, advise_mig
from mig_operator.core.usage.figures import (
    SliceUsage,
    UsageSample,
    next_usage,
    parse_usage,
    usage_status,
    worth_writing,
)
from mig_operator.core.usage.idle import ACTIVE_CONDITION, active_condition, active_of
from mig_operator.gpu.ledger import ledger_path, read_ledger
from mig_operator.gpu.protocol import DeviceUsage, GpuError

from ..common import metrics
from ..common.client import ApiError, resource_version, slice_path
from ..common.names import GROUP, VERSION
from ..common.trim import slice_body
from ..common.workqueue import WorkQueue
from .context import AgentContext
from .realise import Realiser
from .seen import SeenSlices

log = logging.getLogger("mig_operator.agent")

IDLE_EVENT = "Idle"
USAGE_KEY = "usage"
# The loop wakes at least this often: a slice that went loses its metric series within it.
MAX_TICK_S = 1.0
# Readings due within this share of the interval are taken in the same tick.
TICK_SHARE = 0.05

UsageKey = tuple[str, str, str]  # ("usage", namespace, uid)


@dataclass
class SliceWatch:
    """One Ready slice as the usage loop follows it."""

    namespace: str
    name: str
    ready_at: datetime  # when it became Ready (status.phaseTimes.Ready): the idle time's start if never used
    due: float  # monotonic time of its next reading
    usage: SliceUsage | None = None  # the latest reading folded in (from its status until the first)
    advice: Advice | None = None
    written: SliceUsage | None = None  # this agent's last write of it, and that write's resourceVersion
    written_active: Mapping | None = None
    written_version: int = 0
    stale: bool = False  # a write met a conflict: the slice is read again before the next
    pod: str = ""
    claims: frozenset[str] | None = None  # the prepared claims the pod label was read for (None: not read)
    labels: tuple[str, str, str] | None = None  # of its metric series

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Wanted:
    """What a slice's status should show now, and whether it shows it already."""

    usage: SliceUsage
    active: dict
    write: bool
    turns_idle: bool  # Active goes from not False to False


class UsageWatch:
    """The usage loop of one node's agent."""

    def __init__(self, context: AgentContext, realiser: Realiser, slices: SeenSlices, queue: WorkQueue,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 jitter: Callable[[float], float] = lambda interval: random.uniform(0.0, interval)) -> None:
        self.settings = context.settings
        self.gpus = context.gpus
        self.store = context.store
        self.client = context.client
        self.events = context.events
        self.realiser = realiser
        self.slices = slices
        self.queue = queue
        self.clock = clock
        self.jitter = jitter
        self.interval_s = context.settings.usage_interval_s
        self.watched: dict[str, SliceWatch] = {}  # slice UID -> its state
        self._models: dict[int, GpuModel | None] = {}

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.next_wait())
            await self.read_once()

    def next_wait(self) -> float:
        """Seconds until the next slice is due (at least a twentieth of the interval, at most a second)."""
        now = time.monotonic()
        soonest = min((w.due for w in self.watched.values()), default=now + self.interval_s)
        return min(MAX_TICK_S, max(self.interval_s * TICK_SHARE, soonest - now))

    def ready_entry(self, uid: str) -> OwnerEntry | None:
        """The slice's owner entry if it is to be read: shown Ready here, its device recorded, its latest
        event not a deletion."""
        entry = self.store.record.owners.get(uid)
        seen = self.slices.get(uid)
        if uid in self.realiser.shown_ready and entry is not None and entry.state == COMPLETED \
                and entry.device_uuid and seen is not None and not seen.gone:
            return entry
        return None

    def ready_entries(self) -> dict[str, OwnerEntry]:
        return {uid: entry for uid in self.realiser.shown_ready if (entry := self.ready_entry(uid)) is not None}

    async def read_once(self) -> None:
        """Read every slice that is due; one that went is forgotten (its metric series with it)."""
        ready = self.ready_entries()
        for uid in [u for u in self.watched if u not in ready]:
            self.forget(uid)
        now = time.monotonic()
        for uid, entry in ready.items():
            watch = self.watched.get(uid) or self._start(uid, entry, now)
            if watch.due > now + self.interval_s * TICK_SHARE:
                continue
            watch.due = max(watch.due + self.interval_s, now)
            try:
                sample = await self.sample(entry)
            except (GpuError, OSError, ValueError) as exc:
                # That slice's reading only: tried again at its next interval, the others go on.
                log.warning("cannot read the usage of slice %s: %s", watch.ref, exc)
                continue
            if uid not in self.watched:
                continue  # forgotten while it was read
            watch.usage = next_usage(watch.usage, sample, self.clock())
            watch.advice = await self._advice(entry, watch.usage)
            await self._label(uid, watch)
            self._show(watch)
            if self.wanted(uid, watch).write:
                self.queue.add(self.key(uid, watch), lambda u=uid: self.reconcile(u))

    def _start(self, uid: str, entry: OwnerEntry, now: float) -> SliceWatch:
        namespace, _, name = entry.slice.partition("/")
        seen = self.slices.get(uid)
        current = (seen.body.get("status") if seen is not None else None) or {}
        phase_times = current.get("phaseTimes")
        ready_at = (read_time(phase_times.get("Ready")) if isinstance(phase_times, Mapping) else None) or self.clock()
        watch = SliceWatch(namespace, name, ready_at, now + self.jitter(self.interval_s),
                           usage=parse_usage(current))
        self.watched[uid] = watch
        return watch

    def forget(self, uid: str) -> None:
        """The slice is gone (or no longer Ready here): its state and its metric series go."""
        watch = self.watched.pop(uid, None)
        if watch is not None:
            self._unshow(watch)

    @staticmethod
    def key(uid: str, watch: SliceWatch) -> UsageKey:
        return (USAGE_KEY, watch.namespace, uid)

    # ---- one reading -------------------------------------------------------------------------------

    async def sample(self, entry: OwnerEntry) -> UsageSample:
        backend = self.gpus.backend
        if entry.mode == MODE_MIG:
            device: DeviceUsage = await self.gpus.call("device_usage", backend.device_usage, entry.device_uuid)
            return UsageSample(device.memory_used, len(device.processes), device.active_percent)
        gpu = await self.gpus.call("device_usage", backend.device_usage, entry.device_uuid)
        memory = self.gpus.memory_bytes(entry.gpu)
        if memory is not None and entry.granted_bytes >= memory:
            # A whole GPU runs no shim, so keeps no ledger: the GPU's own figures are the slice's.
            return UsageSample(gpu.memory_used, len(gpu.processes), gpu.active_percent)
        figures = None
        if self.settings.ledger_host_dir:
            path = ledger_path(ledger_dir(self.settings.ledger_host_dir, entry.uid), entry.device_uuid)
            figures = await asyncio.to_thread(read_ledger, path)
        if figures is None:  # no process of the claim has started yet
            return UsageSample(0, 0, gpu.active_percent)
        return UsageSample(figures.used, figures.processes, gpu.active_percent, figures.refusals, figures.peak)

    async def _advice(self, entry: OwnerEntry, usage: SliceUsage) -> Advice | None:
        if entry.mode == MODE_FRACTION:
            return advise_fraction(entry.granted_bytes, usage.memory_peak, usage.refusals)
        if entry.gpu not in self._models:
            try:
                self._models[entry.gpu] = await self.gpus.call("model", self.gpus.backend.model, entry.gpu)
            except GpuError as exc:
                log.warning("cannot read the model of GPU %s for advice: %s", entry.gpu, exc)
                return None
        model = self._models[entry.gpu]
        return advise_mig(model, entry.profile, usage.memory_peak) if model is not None else None

    async def _label(self, uid: str, watch: SliceWatch) -> None:
        """The pod label: the pod the slice's claim is reserved for, read again when the claims the
        kubelet prepared on the slice change."""
        claims = frozenset(c.claim_uid for c in self.store.claims_on(uid))
        if claims == watch.claims:
            return
        pod = ""
        if claims:
            try:
                claim = await self.client.get(claim_path(watch.namespace, watch.name))
            except ApiError as exc:
                if not exc.not_found:
                    log.warning("cannot read the ResourceClaim of slice %s for its pod: %s", watch.ref, exc)
                    return  # read again at the next reading
                claim = {}
            pod = next((c.get("name", "") for c in (claim.get("status") or {}).get("reservedFor") or ()
                        if isinstance(c, Mapping) and c.get("resource") == "pods"), "")
        watch.claims = claims
        if pod != watch.pod:
            self._unshow(watch)
            watch.pod = pod

    def _show(self, watch: SliceWatch) -> None:
        assert watch.usage is not None
        watch.labels = (watch.namespace, watch.name, watch.pod)
        metrics.SLICE_MEMORY_USED.labels(*watch.labels).set(watch.usage.memory_used)
        metrics.SLICE_MEMORY_PEAK.labels(*watch.labels).set(watch.usage.memory_peak)
        metrics.SLICE_PROCESSES.labels(*watch.labels).set(watch.usage.processes)

    @staticmethod
    def _unshow(watch: SliceWatch) -> None:
        if watch.labels is None:
            return
        for gauge in (metrics.SLICE_MEMORY_USED, metrics.SLICE_MEMORY_PEAK, metrics.SLICE_PROCESSES):
            try:
                gauge.remove(*watch.labels)
            except KeyError:
                pass
        watch.labels = None

    # ---- what to write -----------------------------------------------------------------------------

    def shown(self, uid: str, watch: SliceWatch) -> tuple[SliceUsage | None, Mapping | None]:
        """The usage and Active condition the slice shows: as its latest event says, or as this agent's
        own write says while that event is older than the write."""
        seen = self.slices.get(uid)
        if seen is None or seen.version < watch.written_version:
            return watch.written, watch.written_active
        current = seen.body.get("status") or {}
        return parse_usage(current), active_of(current.get("conditions"))

    def wanted(self, uid: str, watch: SliceWatch) -> Wanted:
        assert watch.usage is not None
        usage, shown_active = self.shown(uid, watch)
        active = active_condition(watch.usage, watch.ready_at, self.clock(), self.settings.idle_after_s,
                                  shown_active)
        shown_state = (shown_active.get("status"), shown_active.get("reason")) if shown_active else None
        changed = shown_state != (active["status"], active["reason"])
        entry = self.store.record.owners.get(uid)
        memory = entry.granted_bytes if entry is not None else 0
        write = changed or worth_writing(usage, watch.usage, memory)
        turns_idle = active["status"] == "False" and (shown_active or {}).get("status") != "False"
        return Wanted(watch.usage, active, write, turns_idle)

    # ---- the write ---------------------------------------------------------------------------------

    async def reconcile(self, uid: str) -> None:
        """Write the slice's usage and Active condition if it is behind; raises on an API error (the
        queue tries again; after a conflict the slice is read again first)."""
        watch = self.watched.get(uid)
        if watch is None or watch.usage is None or self.ready_entry(uid) is None:
            return
        if watch.stale:
            await self._read_again(uid, watch)
            watch = self.watched.get(uid)
            if watch is None or watch.usage is None:
                return
        seen = self.slices.get(uid)
        if seen is None or seen.gone:
            return
        wanted = self.wanted(uid, watch)
        if not wanted.write:
            return
        body = seen.body
        current = body.get("status") or {}
        kept = [c for c in current.get("conditions") or () if c.get("type") != ACTIVE_CONDITION]
        patch = {"metadata": {"resourceVersion": str(seen.version)},
                 "status": {"usage": usage_status(wanted.usage, watch.advice),
                            "conditions": [*kept, wanted.active]}}
        meta = body["metadata"]
        try:
            answer = await self.client.merge_patch(slice_path(meta["namespace"], meta["name"], status=True), patch)
        except ApiError as exc:
            metrics.RECONCILE_ERRORS.labels("agent", "api").inc()
            if exc.conflict:
                watch.stale = True
            elif exc.not_found:
                return  # deleted: its watch event says so, and the slice is forgotten
            raise
        version = resource_version(answer.get("metadata") or {})
        watch.written, watch.written_active, watch.written_version = wanted.usage, wanted.active, version
        self.realiser.written[uid] = max(self.realiser.written.get(uid, 0), version)
        if wanted.turns_idle:
            log.info("slice %s is idle: %s", watch.ref, wanted.active["message"])
            self.events.post({"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", **body}, "Normal",
                             IDLE_EVENT, wanted.active["message"])

    async def _read_again(self, uid: str, watch: SliceWatch) -> None:
        try:
            fresh = await self.client.get(slice_path(watch.namespace, watch.name))
        except ApiError as exc:
            if exc.not_found:
                self.forget(uid)
                return
            raise
        if fresh["metadata"].get("uid") != uid:
            self.forget(uid)
            return
        self.slices.take(slice_body(fresh))
        watch.stale = False

