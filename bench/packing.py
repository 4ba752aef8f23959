"""Packing benchmark: the planner against the baselines the field uses, on seeded traces, and the
time of one decision at cluster scale.

    .venv/bin/python bench/packing.py [--seed 7] [--seeds 20] [--scale 64,1024,16384] [--json out.json]

Policies (each replays the same traces through core.placement.trace.replay):
  planner        core.placement.planner.choose_mig, lazy reclaim (idle instances kept and reused)
  planner-eager  the same choices, but an instance is destroyed as soon as it is freed
  first-fit      each GPU's smallest profile, first GPU in index order, first free placement in
                 NVML order, destroyed when freed (NVIDIA's DRA driver, early InstaSlice)
  spread         smallest profile on the least-used GPU, first free placement, destroyed when freed
  fixed-1g       every GPU pre-split into 1g instances once (mig-parted all-1g); only requests that
                 fit 1g are served

Part 1, one seed (``--seed``): per trace family, allocations accepted, NVML creates and destroys,
memory granted over memory asked, planning time per decision. The planner's replay is also run
through ``PlanningIndex`` (trace.replay's default) and must give the same results.

Part 2, ``--seeds`` seeds from ``--seed`` on: per family and seed, the planner's accepted count
against first-fit's (summed over the family's models and GPU counts), and lazy creates on churn.

Part 3, ``--scale``: one decision on N h200-141gb GPUs in random partly used states, 200 memory
requests through ``PlanningIndex.choose`` (the one MIG planner); also a refusal, the index's build
time and its memory (tracemalloc).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mig_operator.core.placement.planner import (  # noqa: E402
    InstanceSlot,
    MigDecision,
    MigGpu,
    Unplaceable,
    candidate_profiles,
)
from mig_operator.core.placement.planning_index import PlanningIndex, choose_mig  # noqa: E402
from mig_operator.core.placement.profiles import GpuModel, get_model  # noqa: E402
from mig_operator.core.placement.trace import TraceEvent, replay  # noqa: E402
from mig_operator.core.requests.quantities import MIB  # noqa: E402
from mig_operator.core.requests.request import SliceRequest, slice_request  # noqa: E402

MODELS = ("h100-80gb", "a100-40gb", "h200-141gb")
GPU_COUNTS = (1, 2, 4, 8)
# Mixed pools as a cluster has them: nodes of one model each (two or four GPUs here), models side by
# side, listed in GPU index order (first-fit walks them in that order).
MIXED_POOLS = (
    ("a100-40gb",) * 2 + ("h100-80gb",) * 2,
    ("h200-141gb",) * 2 + ("a100-40gb",) * 2 + ("h100-80gb",) * 2,
    ("a30-24gb",) * 2 + ("a100-40gb",) * 2 + ("h100-80gb",) * 2 + ("h200-141gb",) * 2,
    ("h100-80gb",) * 4 + ("a100-80gb",) * 2 + ("a100-40gb",) * 4 + ("a30-24gb",) * 2 + ("h200-141gb",) * 4,
)


@dataclass(frozen=True)
class Case:
    """One trace on one pool: what every policy replays."""

    pool: tuple[GpuModel, ...]  # GPU i's model
    events: list[TraceEvent]


# --- traces -----------------------------------------------------------------------------------


def _sizes(model: GpuModel) -> list[tuple[int, float]]:
    """Request sizes in bytes with weights: mostly small, some medium, a few whole-GPU."""
    plain = sorted({p.memory_mib for p in model.profiles if not p.media_extension})
    weights = [0.45, 0.25, 0.2, 0.1][: len(plain)]
    # Ask a bit under each profile's memory, as users ask for round numbers below the profile size.
    return [(int(mib * MIB * 0.9), w) for mib, w in zip(plain, weights, strict=False)]


def _pick(rng: random.Random, sizes: list[tuple[int, float]]) -> int:
    return rng.choices([s for s, _ in sizes], weights=[w for _, w in sizes])[0]


def _slots(model: GpuModel, num_bytes: int) -> int:
    """Memory slots the smallest fitting profile spans: the offered load of one request."""
    return candidate_profiles(model, SliceRequest(memory_bytes=num_bytes))[0].size


class _Trace:
    """Builds a trace while tracking the offered load (slots the live requests' smallest profiles span)."""

    def __init__(self, model: GpuModel, prefix: str) -> None:
        self.model, self.prefix = model, prefix
        self.events: list[TraceEvent] = []
        self.live: list[tuple[str, int]] = []
        self.offered = self.n = 0

    def alloc(self, size: int) -> str:
        self.n += 1
        ident = f"{self.prefix}{self.n}"
        self.live.append((ident, _slots(self.model, size)))
        self.offered += self.live[-1][1]
        self.events.append(TraceEvent("alloc", ident, SliceRequest(memory_bytes=size)))
        return ident

    def free(self, ident: str) -> None:
        for k, (live_id, slots) in enumerate(self.live):
            if live_id == ident:
                del self.live[k]
                self.offered -= slots
                self.events.append(TraceEvent("free", ident))
                return

    def free_random(self, rng: random.Random) -> None:
        self.free(self.live[rng.randrange(len(self.live))][0])


def _offered(model: GpuModel, gpus: int, rng: random.Random, steps: int, sizes: list[tuple[int, float]],
             load: float, prefix: str) -> list[TraceEvent]:
    """Arrivals and departures that keep the offered load near ``load`` times the capacity, so
    acceptance measures fragmentation, not overload."""
    trace = _Trace(model, prefix)
    capacity = gpus * model.memory_slots
    for _ in range(steps):
        p_alloc = 0.7 if trace.offered < load * capacity else 0.2
        if trace.live and rng.random() >= p_alloc:
            trace.free_random(rng)
        else:
            trace.alloc(_pick(rng, sizes))
    return trace.events


def steady(model: GpuModel, gpus: int, rng: random.Random) -> list[TraceEvent]:
    """Steady arrivals and departures of the usual mix, offered load around full capacity."""
    return _offered(model, gpus, rng, 100 * gpus, _sizes(model), 1.0, "s")


def mixed(model: GpuModel, gpus: int, rng: random.Random) -> list[TraceEvent]:
    """Every profile size equally likely: the hardest mix for fragmentation."""
    sizes = [(s, 1.0) for s, _ in _sizes(model)]
    return _offered(model, gpus, rng, 100 * gpus, sizes, 1.0, "m")


def burst_drain(model: GpuModel, gpus: int, rng: random.Random, rounds: int = 4) -> list[TraceEvent]:
    """Bursts that fill the GPUs, each drained before the next; odd rounds switch to a different mix."""
    trace = _Trace(model, "b")
    sizes = _sizes(model)
    for r in range(rounds):
        mix = sizes[:2] if r % 2 == 0 else sizes[1:]
        ids = []
        while trace.offered < gpus * model.memory_slots:
            ids.append(trace.alloc(_pick(rng, mix)))
        rng.shuffle(ids)
        for ident in ids:
            trace.free(ident)
    return trace.events


def churn(model: GpuModel, gpus: int, rng: random.Random) -> list[TraceEvent]:
    """Short jobs of a few recurring sizes (notebooks, CI jobs): where lazy reuse pays off."""
    return _offered(model, gpus, rng, 100 * gpus, _sizes(model)[:2], 0.6, "c")


def large_after_small(model: GpuModel, gpus: int, rng: random.Random, rounds: int = 4) -> list[TraceEvent]:
    """Small requests fill part of the pool and mostly leave (their instances stay idle, scattered),
    a few small ones come back, then whole-GPU and half-GPU requests arrive: reusing an idle small
    instance on an otherwise empty GPU is what refuses them."""
    trace = _Trace(model, "l")
    sizes = _sizes(model)
    small, whole, half = sizes[:2], sizes[-1][0], sizes[-2][0]
    capacity = gpus * model.memory_slots
    for _ in range(rounds):
        target = rng.uniform(0.3, 1.0) * capacity
        while trace.offered < target:
            trace.alloc(_pick(rng, small))
        leaving = rng.uniform(0.5, 1.0)
        for ident in [i for i, _ in trace.live if rng.random() < leaving]:
            trace.free(ident)
        for _ in range(rng.randint(1, 2 * gpus)):
            trace.alloc(_pick(rng, small))
        large = [trace.alloc(rng.choice((whole, whole, half))) for _ in range(rng.randint(1, gpus))]
        for ident in large:
            if rng.random() < 0.8:
                trace.free(ident)
    return trace.events


def whole_gpu_bursts(model: GpuModel, gpus: int, rng: random.Random) -> list[TraceEvent]:
    """Small and medium jobs churn at moderate load; now and then a burst of whole-GPU requests
    arrives and leaves a little later."""
    trace = _Trace(model, "w")
    sizes = _sizes(model)[:-1]
    whole = _sizes(model)[-1][0]
    bursts: list[list[str]] = []
    for step in range(80 * gpus):
        if step % 20 == 19:
            bursts.append([trace.alloc(whole) for _ in range(rng.randint(1, max(1, gpus // 2 + 1)))])
        elif bursts and rng.random() < 0.15:
            for ident in bursts.pop(0):
                trace.free(ident)
        elif trace.live and rng.random() >= (0.7 if trace.offered < 0.6 * gpus * model.memory_slots else 0.25):
            trace.free_random(rng)
        else:
            trace.alloc(_pick(rng, sizes))
    return trace.events


TRACES: dict[str, Callable[[GpuModel, int, random.Random], list[TraceEvent]]] = {
    "steady": steady, "mixed": mixed, "burst-drain": burst_drain, "churn": churn,
    "large-after-small": large_after_small, "whole-gpu-bursts": whole_gpu_bursts,
}


def mixed_pool_trace(pool: tuple[GpuModel, ...], rng: random.Random) -> list[TraceEvent]:
    """One pool of several models; requests sized for any of them (a 4Gi notebook, an 18 GB job,
    a whole H200), offered load near the pool's memory."""
    sizes = sorted({s for model in set(pool) for s, _ in _sizes(model)})
    weights = [1.0 / (1 + k % 4) for k in range(len(sizes))]
    capacity = sum(model.memory_mib * MIB for model in pool)
    events: list[TraceEvent] = []
    live: list[tuple[str, int]] = []
    offered = n = 0
    for _ in range(60 * len(pool)):
        if live and rng.random() >= (0.7 if offered < capacity else 0.2):
            ident, size = live.pop(rng.randrange(len(live)))
            offered -= size
            events.append(TraceEvent("free", ident))
        else:
            n += 1
            size = rng.choices(sizes, weights=weights)[0]
            live.append((f"x{n}", size))
            offered += size
            events.append(TraceEvent("alloc", f"x{n}", SliceRequest(memory_bytes=size)))
    return events


def cases(family: str, seed: int) -> list[Case]:
    """The traces of one family and seed: each model at each GPU count, or each mixed pool."""
    if family == "mixed-models":
        out = []
        for k, names in enumerate(MIXED_POOLS):
            pool = tuple(get_model(n) for n in names)
            out.append(Case(pool, mixed_pool_trace(pool, random.Random(f"{seed}/{family}/{k}"))))
        return out
    make = TRACES[family]
    out = []
    for model_name in MODELS:
        model = get_model(model_name)
        for count in GPU_COUNTS:
            rng = random.Random(f"{seed}/{family}/{model_name}/{count}")
            out.append(Case((model,) * count, make(model, count, rng)))
    return out


FAMILIES = (*TRACES, "mixed-models")


# --- baselines --------------------------------------------------------------------------------


def first_fit(request: SliceRequest, gpus: list[MigGpu]) -> MigDecision:
    for gpu in gpus:
        cands = candidate_profiles(gpu.model, request)
        if not cands:
            continue
        profile = cands[0]
        if sum(1 for i in gpu.instances if i.profile_id == profile.id) >= profile.max_instances:
            continue
        for pl in profile.placements:
            if not pl.mask & gpu.occupied_mask:
                return MigDecision(gpu.node, gpu.index, profile, pl.start, pl.size, "create")
    raise Unplaceable("no free placement")


def spread(request: SliceRequest, gpus: list[MigGpu]) -> MigDecision:
    for gpu in sorted(gpus, key=lambda g: (bin(g.occupied_mask).count("1"), g.index)):
        try:
            return first_fit(request, [gpu])
        except Unplaceable:
            continue
    raise Unplaceable("no free placement")


def fixed_1g(request: SliceRequest, gpus: list[MigGpu]) -> MigDecision:
    for gpu in gpus:
        small = min((p for p in gpu.model.profiles if not p.media_extension), key=lambda p: p.memory_mib)
        if request.memory_bytes is None or request.memory_bytes > small.memory_mib * MIB:
            continue
        for inst in gpu.instances:
            if not inst.in_use:
                return MigDecision(gpu.node, gpu.index, small, inst.start, inst.size, "reuse")
    raise Unplaceable("no free 1g instance")


def fixed_1g_gpus(pool: tuple[GpuModel, ...]) -> list[MigGpu]:
    out = []
    for i, model in enumerate(pool):
        small = min((p for p in model.profiles if not p.media_extension), key=lambda p: p.memory_mib)
        out.append(MigGpu("", i, model, tuple(InstanceSlot(small.id, pl.start, pl.size, False)
                                               for pl in small.placements)))
    return out


@dataclass
class Totals:
    asked: int = 0
    accepted: int = 0
    creates: int = 0
    destroys: int = 0
    granted_bytes: int = 0
    asked_bytes: int = 0
    decisions: int = 0
    seconds: float = 0.0
    # Refusals split by cause: some GPU had enough slots not in use for the request's smallest profile
    # there, but in the wrong places (fragmented), or no GPU had that many (full).
    refused_fragmented: int = 0
    refused_full: int = 0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


POLICIES = ("planner", "planner-eager", "first-fit", "spread", "fixed-1g")
CHOOSERS = {"planner": choose_mig, "planner-eager": choose_mig, "first-fit": first_fit, "spread": spread,
            "fixed-1g": fixed_1g}


def refusal_is_fragmentation(request: SliceRequest, gpus: list[MigGpu]) -> bool:
    """Whether some GPU had as many slots not in use as the request's smallest profile there spans."""
    for gpu in gpus:
        cands = candidate_profiles(gpu.model, request)
        if cands and gpu.model.memory_slots - gpu.busy_mask.bit_count() >= cands[0].size:
            return True
    return False


def run_policy(policy: str, case: Case, check_index: bool = False) -> Totals:
    chooser = CHOOSERS[policy]
    totals = Totals()

    def timed(request: SliceRequest, gpus: list[MigGpu]) -> MigDecision:
        t0 = time.perf_counter()
        try:
            return chooser(request, gpus)
        except Unplaceable:
            if refusal_is_fragmentation(request, gpus):
                totals.refused_fragmented += 1
            else:
                totals.refused_full += 1
            raise
        finally:
            totals.seconds += time.perf_counter() - t0
            totals.decisions += 1

    initial = fixed_1g_gpus(case.pool) if policy == "fixed-1g" else [
        MigGpu("", i, model) for i, model in enumerate(case.pool)]
    eager = policy in ("planner-eager", "first-fit", "spread")
    result = replay(case.events, case.pool[0], eager=eager, choose=timed, initial=initial)
    if check_index and policy.startswith("planner"):
        # trace.replay's default path keeps a PlanningIndex: it must decide exactly as choose_mig.
        indexed = replay(case.events, case.pool[0], eager=eager, initial=initial)
        assert indexed.results == result.results, f"PlanningIndex and choose_mig disagree ({policy})"
    requests = {e.id: e.request for e in case.events if e.op == "alloc"}
    for r in result.results:
        totals.asked += 1
        if "error" not in r:
            totals.accepted += 1
            totals.asked_bytes += requests[r["id"]].memory_bytes
            totals.granted_bytes += case.pool[r["gpu"]].profile(r["profile"]).memory_mib * MIB
    totals.creates = result.creates + (sum(len(g.instances) for g in initial) if policy == "fixed-1g" else 0)
    totals.destroys = result.destroys
    return totals


# --- part 1 and 2: packing --------------------------------------------------------------------


def packing_table(seed: int) -> dict[str, dict[str, Totals]]:
    table: dict[str, dict[str, Totals]] = {f: {p: Totals() for p in POLICIES} for f in FAMILIES}
    for family in FAMILIES:
        for case in cases(family, seed):
            for policy in POLICIES:
                table[family][policy].add(run_policy(policy, case, check_index=True))
        print(f"# {family} done", file=sys.stderr)
    return table


def print_packing(table: dict[str, dict[str, Totals]], seed: int) -> None:
    print(f"Trace families: {', '.join(FAMILIES)}; models {', '.join(MODELS)} at {GPU_COUNTS} GPUs, "
          f"{len(MIXED_POOLS)} mixed pools; seed {seed}\n")
    print("| trace | policy | accepted | creates | destroys | granted/asked | µs/decision |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for family, row in table.items():
        for policy, t in row.items():
            ratio = t.granted_bytes / t.asked_bytes if t.asked_bytes else 0.0
            per = t.seconds / t.decisions * 1e6 if t.decisions else 0.0
            print(f"| {family} | {policy} | {t.accepted}/{t.asked} | {t.creates} | {t.destroys} | "
                  f"{ratio:.2f} | {per:.1f} |")


@dataclass
class SeedSweep:
    seeds: list[int]
    # family -> per seed (planner accepted, first-fit accepted, asked)
    per_family: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    lost_traces: int = 0  # single traces (one model and count) where first-fit accepted more
    traces: int = 0
    churn_lazy_creates: int = 0
    churn_eager_creates: int = 0
    # family -> refusals over every seed: planner (fragmented, full), first-fit (fragmented, full)
    refusals: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


def seed_sweep(first: int, count: int) -> SeedSweep:
    sweep = SeedSweep(list(range(first, first + count)))
    for family in FAMILIES:
        rows = []
        causes = [0, 0, 0, 0]
        for seed in sweep.seeds:
            planner_total, ff_total, asked = 0, 0, 0
            for case in cases(family, seed):
                mine = run_policy("planner", case)
                theirs = run_policy("first-fit", case)
                planner_total += mine.accepted
                ff_total += theirs.accepted
                for k, n in enumerate((mine.refused_fragmented, mine.refused_full,
                                       theirs.refused_fragmented, theirs.refused_full)):
                    causes[k] += n
                asked += mine.asked
                sweep.traces += 1
                sweep.lost_traces += int(mine.accepted < theirs.accepted)
                if family == "churn":
                    sweep.churn_lazy_creates += mine.creates
                    sweep.churn_eager_creates += run_policy("planner-eager", case).creates
            rows.append((planner_total, ff_total, asked))
        sweep.per_family[family] = rows
        sweep.refusals[family] = (causes[0], causes[1], causes[2], causes[3])
        print(f"# sweep {family} done", file=sys.stderr)
    return sweep


def print_sweep(sweep: SeedSweep) -> None:
    print(f"\nSeeds {sweep.seeds[0]}..{sweep.seeds[-1]} ({len(sweep.seeds)} seeds), planner against first-fit, "
          "accepted per seed (summed over the family's models and GPU counts):\n")
    print("| family | planner accepted | first-fit accepted | seeds where planner < first-fit | "
          "worst seed (planner - first-fit) |")
    print("|---|---:|---:|---:|---:|")
    for family, rows in sweep.per_family.items():
        mine = sum(r[0] for r in rows)
        theirs = sum(r[1] for r in rows)
        asked = sum(r[2] for r in rows)
        lost = sum(1 for r in rows if r[0] < r[1])
        worst = min(r[0] - r[1] for r in rows)
        print(f"| {family} | {mine}/{asked} | {theirs}/{asked} | {lost} | {worst:+d} |")
    print("\nRefusals over every seed, by cause: *fragmented* (some GPU had enough slots not in use, in the "
          "wrong places) or *full* (no GPU had that many slots not in use):\n")
    print("| family | planner fragmented | planner full | first-fit fragmented | first-fit full |")
    print("|---|---:|---:|---:|---:|")
    for family, (pf, pu, ff, fu) in sweep.refusals.items():
        print(f"| {family} | {pf} | {pu} | {ff} | {fu} |")
    print(f"\nSingle traces where first-fit accepted more: {sweep.lost_traces} of {sweep.traces}. "
          f"Churn creates, lazy against eager: {sweep.churn_lazy_creates} vs {sweep.churn_eager_creates}.")


# --- part 3: decision time at scale -----------------------------------------------------------


def random_pool(count: int, rng: random.Random, model: GpuModel, kind: str = "planned") -> list[MigGpu]:
    """``count`` GPUs in random partly used states: some slices in use, some released (idle).

    ``planned``: each GPU's slices were placed by the planner, as in a cluster it runs (few distinct
    states). ``arbitrary``: any legal layout of any profiles, in use or idle at random (what a
    cluster inherits from other tools; thousands of distinct states)."""
    gpus = []
    sizes = _sizes(model)
    for i in range(count):
        gpu = MigGpu(f"node-{i // 8:05d}", i % 8, model)
        if kind == "arbitrary":
            taken, made = 0, []
            for _ in range(rng.randrange(0, 8)):
                profile = rng.choice(model.profiles)
                pl = rng.choice(profile.placements)
                if pl.mask & taken or sum(1 for x in made if x.profile_id == profile.id) >= profile.max_instances:
                    continue
                taken |= pl.mask
                made.append(InstanceSlot(profile.id, pl.start, pl.size, rng.random() < 0.6))
            gpus.append(MigGpu(gpu.node, gpu.index, model, tuple(sorted(made, key=lambda x: x.start))))
            continue
        for _ in range(rng.randrange(0, 6)):
            try:
                d = choose_mig(SliceRequest(memory_bytes=_pick(rng, sizes)), [gpu])
            except Unplaceable:
                break
            gpu = gpu.with_decision(d)
            if rng.random() < 0.3:
                gpu = gpu.with_released(d.start)
        gpus.append(gpu)
    return gpus


def _stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return {"mean_us": statistics.fmean(times) * 1e6, "p99_us": p99 * 1e6}


def decision_times(count: int, seed: int, samples: int = 200, kind: str = "planned") -> dict[str, dict[str, float]]:
    """One decision on ``count`` H200 GPUs through PlanningIndex.choose."""
    model = get_model("h200-141gb")
    rng = random.Random(f"{seed}/scale/{kind}/{count}")
    gpus = random_pool(count, rng, model, kind)
    requests = [slice_request(memory=f"{rng.choice([5, 10, 17, 30, 60, 100])}G") for _ in range(samples)]
    out: dict[str, dict[str, float]] = {}

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = _clock()
    index = PlanningIndex(gpus)
    build = _clock() - t0
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    out["index"] = {"build_ms": build * 1e3, "memory_mb": index_bytes / 1e6, "states": float(index.state_count())}

    timed = {"index": lambda r: index.choose(r)}
    for label, fn in timed.items():
        n = samples
        # Warm the caches every request kind fills once (candidate lists, per-state plans): the
        # figures are for a running controller, not its first decision of each kind.
        for req in set(requests[:n]):
            _outcome(fn, req)
        times = []
        with _no_gc():
            for req in requests[:n]:
                t0 = _clock()
                _outcome(fn, req)
                times.append(_clock() - t0)
        out.setdefault(label, {}).update(_stats(times))

    # Keeping the index current: apply a decision (then put the GPU back, untimed).
    updates = []
    with _no_gc():
        for req in requests:
            got = _outcome(index.choose, req)
            if not isinstance(got, MigDecision):
                continue
            before = index.get(got.node, got.gpu)
            assert before is not None
            t0 = _clock()
            index.apply(got)
            updates.append(_clock() - t0)
            index.put(before)
    out["update"] = _stats(updates)

    # A refusal: every GPU holds a whole-GPU slice in use. The index is built afresh so the pool above
    # stays as drawn.
    full = [MigGpu(g.node, g.index, model, (InstanceSlot(0, 0, 8, True),)) for g in gpus]
    full_index = PlanningIndex(full)
    refusals: dict[str, Callable[[SliceRequest], object]] = {"index": full_index.choose}
    request = slice_request(memory="10G")
    for label, fn in refusals.items():
        times = []
        with _no_gc():
            for _ in range(samples if label == "index" else 10):
                t0 = _clock()
                try:
                    fn(request)
                except Exception as exc:  # noqa: BLE001 - either module's Unplaceable
                    message = str(exc)
                times.append(_clock() - t0)
        out[f"refusal_{label}"] = {**_stats(times), "message_chars": float(len(message))}
    return out


# Part 3's clock: wall time by default; ``--clock cpu`` takes this thread's CPU time, which leaves out
# the time the process waits for a core on a machine shared with other work.
_clock = time.perf_counter


@contextmanager
def _no_gc() -> Iterator[None]:
    """Time without the cyclic collector, as timeit does: a full collection over the benchmark's own
    millions of objects lands in whichever sample it likes and is not the planner's cost."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _outcome(fn: Callable[[SliceRequest], object], request: SliceRequest) -> object:
    """The decision, or the refusal's class name (either module's Unplaceable)."""
    try:
        return fn(request)
    except Exception as exc:  # noqa: BLE001 - the baseline module has its own Unplaceable
        if type(exc).__name__ != "Unplaceable":
            raise
        return type(exc).__name__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=20, help="seeds in the sweep (0 to skip it)")
    parser.add_argument("--scale", default="64,1024,16384", help="GPU counts to time a decision on ('' to skip)")
    parser.add_argument("--samples", type=int, default=200, help="requests timed per GPU count")
    parser.add_argument("--only-scale", action="store_true", help="skip parts 1 and 2")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="part 3: wall time, or this thread's CPU time (leaves out waiting for a core)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    global _clock
    _clock = time.perf_counter if args.clock == "wall" else time.thread_time

    table = packing_table(args.seed) if not args.only_scale else {}
    if table:
        print_packing(table, args.seed)
    sweep = seed_sweep(args.seed, args.seeds) if args.seeds and not args.only_scale else None
    if sweep is not None:
        print_sweep(sweep)

    scale: dict[str, dict[int, dict]] = {"planned": {}, "arbitrary": {}}
    for kind, by_count in scale.items():
        for count in (int(c) for c in args.scale.split(",") if c):
            by_count[count] = decision_times(count, args.seed, args.samples, kind=kind)
            print(f"# scale {kind} {count} done", file=sys.stderr)
    for kind, by_count in scale.items():
        if not by_count:
            continue
        what = ("placed by the planner" if kind == "planned"
                else "arbitrary legal layouts of any profiles, in use or idle")
        print(f"\nOne decision on N h200-141gb GPUs in random partly used states, {what} ({args.samples} memory "
              f"requests per N, caches warm, {args.clock} clock; µs, mean / p99):\n")
        columns = [("PlanningIndex.choose", "index")]
        print("| GPUs | states | " + " | ".join(c for c, _ in columns) + " | index apply | refusal: "
              + " / ".join(c for c, _ in columns) + " | refusal length | index memory | index build |")
        print("|---:" * (5 + len(columns)) + "|---:|---:|")
        for count, t in by_count.items():
            cells = [f"{t[k]['mean_us']:.0f} / {t[k]['p99_us']:.0f}" for _, k in columns]
            refusal = [f"{t['refusal_' + k]['mean_us']:.0f}" for _, k in columns]
            chars = ", ".join(f"{t['refusal_' + k]['message_chars']:.0f}" for _, k in columns)
            print(f"| {count} | {t['index']['states']:.0f} | " + " | ".join(cells)
                  + f" | {t['update']['mean_us']:.0f} / {t['update']['p99_us']:.0f} | " + " / ".join(refusal)
                  + f" | {chars} chars | {t['index']['memory_mb']:.1f} MB | {t['index']['build_ms']:.0f} ms |")

    print("\nTargets:")
    if table:
        totals = {p: Totals() for p in POLICIES}
        for row in table.values():
            for p, t in row.items():
                totals[p].add(t)
        failures = [p for p in POLICIES if totals[p].accepted > totals["planner"].accepted]
        churn_lazy, churn_eager = table["churn"]["planner"].creates, table["churn"]["planner-eager"].creates
        print(f"  planner accepts >= every baseline over seed {args.seed}: "
              f"{'yes' if not failures else 'NO ' + str(failures)}; "
              f"lazy creates on churn {churn_lazy} vs eager {churn_eager} "
              f"({'at least halved' if 2 * churn_lazy <= churn_eager else 'NOT halved'})")
    if sweep is not None:
        lost = sum(1 for rows in sweep.per_family.values() for r in rows if r[0] < r[1])
        print(f"  sweep: (family, seed) pairs where first-fit accepted more: {lost}; churn creates lazy "
              f"{sweep.churn_lazy_creates} vs eager {sweep.churn_eager_creates} "
              f"({'at least halved' if 2 * sweep.churn_lazy_creates <= sweep.churn_eager_creates else 'NOT halved'})")
    for kind, by_count in scale.items():
        if 16384 not in by_count:
            continue
        t = by_count[16384]
        print(f"  16,384 GPUs ({kind}): decision p99 {t['index']['p99_us']:.0f} µs (target < 500), refusal "
              f"p99 {t['refusal_index']['p99_us']:.0f} µs (target < 1000), index memory "
              f"{t['index']['memory_mb']:.1f} MB (target < 50)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "table": {f: {p: vars(v) for p, v in row.items()} for f, row in table.items()},
            "sweep": vars(sweep) if sweep is not None else None,
            "scale": scale,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
