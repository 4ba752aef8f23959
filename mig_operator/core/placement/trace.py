"""Replay an allocation trace through the planner: what `mig-operator plan` prints.

A trace is a JSON list of events: ``{"op": "alloc", "id": "a1", "memory": "10Gi"}`` (or
``"fraction": 0.25``, or ``"profile": "3g.40gb"``) and ``{"op": "free", "id": "a1"}``. A freed
instance stays idle (lazy reclaim) unless ``eager`` is set, in which case it is destroyed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..requests.quantities import QuantityError, clip_repr
from ..requests.request import SliceRequest, slice_request
from .planner import MigDecision, MigGpu, PlannerSettings, Unplaceable
from .planning_index import PlanningIndex
from .profiles import GpuModel

TRACE_EXAMPLE = '[{"op": "alloc", "id": "a1", "memory": "10Gi"}, {"op": "free", "id": "a1"}]'


class TraceError(ValueError):
    """A malformed trace; the message names the event and shows a valid one."""


@dataclass(frozen=True)
class TraceEvent:
    op: str  # "alloc" or "free"
    id: str
    request: SliceRequest | None = None


def parse_trace(data: object) -> list[TraceEvent]:
    """Validate a decoded JSON trace; every problem names the event's position."""
    if not isinstance(data, list):
        raise TraceError(f"a trace is a JSON list of events, e.g. {TRACE_EXAMPLE}")
    events: list[TraceEvent] = []
    live: set[str] = set()
    seen: set[str] = set()
    for n, raw in enumerate(data):
        where = f"event {n}"
        if not isinstance(raw, dict):
            raise TraceError(f"{where} is not an object: {clip_repr(raw)}; e.g. {TRACE_EXAMPLE}")
        op, ident = raw.get("op"), raw.get("id")
        if not isinstance(ident, str) or not ident:
            raise TraceError(f"{where} needs a non-empty string 'id': {clip_repr(raw)}")
        if op == "alloc":
            extra = set(raw) - {"op", "id", "memory", "fraction", "profile"}
            if extra:
                raise TraceError(f"{where} has unknown fields {clip_repr(sorted(extra))}: {clip_repr(raw)}")
            if ident in live:
                raise TraceError(f"{where} allocates {clip_repr(ident)} again before freeing it")
            try:
                request = slice_request(raw.get("memory"), raw.get("fraction"), raw.get("profile"))
            except QuantityError as exc:
                raise TraceError(f"{where} ({clip_repr(ident)}): {exc}") from None
            events.append(TraceEvent("alloc", ident, request))
            live.add(ident)
            seen.add(ident)
        elif op == "free":
            if ident not in seen:
                raise TraceError(f"{where} frees {clip_repr(ident)}, which was never allocated")
            events.append(TraceEvent("free", ident))
            live.discard(ident)
        else:
            raise TraceError(f"{where} has op {clip_repr(op)}; use 'alloc' or 'free', e.g. {TRACE_EXAMPLE}")
    return events


Chooser = Callable[[SliceRequest, list[MigGpu]], MigDecision]


@dataclass
class Replay:
    """What a replay did: one result per alloc, and the NVML mutations it would have cost."""

    results: list[dict] = field(default_factory=list)
    creates: int = 0
    destroys: int = 0


def replay(
    events: list[TraceEvent],
    model: GpuModel,
    gpu_count: int = 1,
    eager: bool = False,
    choose: Chooser | None = None,
    initial: list[MigGpu] | None = None,
    settings: PlannerSettings | None = None,
) -> Replay:
    """Run events on ``gpu_count`` empty GPUs (or ``initial``); one result object per alloc, in order.

    Without ``choose`` the planner decides through a ``PlanningIndex`` kept current as the operator
    keeps it; ``choose`` replaces it (a baseline, or ``choose_mig`` over the whole list).
    """
    gpus = list(initial) if initial is not None else [MigGpu("", i, model) for i in range(gpu_count)]
    position = {(gpu.node, gpu.index): n for n, gpu in enumerate(gpus)}
    index = PlanningIndex(gpus) if choose is None else None
    settings = settings or PlannerSettings()
    held: dict[str, tuple[int, int]] = {}  # slice id -> (position in gpus, start)
    out = Replay()
    for event in events:
        if event.op == "free":
            if event.id in held:
                n, start = held.pop(event.id)
                gpus[n] = gpus[n].with_released(start, destroy=eager)
                if index is not None:
                    index.release(gpus[n].node, gpus[n].index, start, destroy=eager)
                out.destroys += int(eager)
            continue
        assert event.request is not None
        try:
            decision = index.choose(event.request, settings) if index is not None else choose(event.request, gpus)
        except Unplaceable as exc:
            out.results.append({"id": event.id, "error": exc.reason})
            continue
        n = position[(decision.node, decision.gpu)]
        gpus[n] = gpus[n].with_decision(decision)
        if index is not None:
            index.apply(decision)
        held[event.id] = (n, decision.start)
        out.creates += int(decision.action == "create")
        out.destroys += len(decision.reclaim)
        out.results.append(decision_json(event.id, decision))
    return out


def decision_json(ident: str, decision: MigDecision) -> dict:
    return {
        "id": ident,
        "gpu": decision.gpu,
        "profile": decision.profile.name,
        "profile_id": decision.profile.id,
        "start": decision.start,
        "size": decision.size,
        "action": decision.action,
        "reclaimed": [{"gpu": r.gpu, "profile": r.profile, "start": r.start} for r in decision.reclaim],
    }
