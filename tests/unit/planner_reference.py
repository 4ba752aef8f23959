"""The planner's rule written out plainly, for tests only: ``reference_choose_mig``.

Nothing here is shared with ``planner.choose_mig`` or ``PlanningIndex`` beyond the record types: it
computes which profiles cover a request from the catalog's numbers, enumerates every option of every
GPU (reuse, create, reclaim), scores each from scratch (no caches) and takes the smallest key. The
property tests hold ``choose_mig`` and ``PlanningIndex.choose`` to exactly its decisions, so a change
to the rule is made here first, in the plainest words, and the fast paths follow.

The rule (DESIGN "Which profile is smallest" and "Where a slice goes", docs/architecture.md):

1. Grants, across all models: a profile that covers the request (NVML MiB >= the request rounded up
   to whole MiB; for a fraction, at least that share of the model's memory slots, rounded up; by
   name, that profile), not ``+me`` unless named, with at least one placement. Grant sizes ordered by
   (MiB, compute slices); without ``allow_larger``, only each model's smallest grant counts.
2. For the smallest grant size with any option: the option with the smallest key (below), then the
   lowest (node, index), then the profile's place in (MiB, slices, SMs, id) order.
3. Key: slots are counted around the instances in use. Free placements of the profiles a memory
   request can get (plain, first of each MiB size), grouped by the share of the GPU they span;
   ``lost`` = those placements the option removes; ``stranded`` = free slots no free placement covers
   gained. Key = (whole-GPU placements lost, stranded gained, half/quarter/eighth/sixteenth lost,
   tier (0 reuse, 1 create, 2 reclaim), slots not in use, idle instances destroyed, their slots,
   free slots, then the capacity left around every instance (larger first, as a negated score),
   then the start).
"""

from __future__ import annotations

import math

from mig_operator.core.placement.planner import InstanceSlot, MigDecision, MigGpu, Reclaim, Unplaceable
from mig_operator.core.placement.profiles import GpuModel, Profile
from mig_operator.core.requests.request import SliceRequest

_MIB = 2**20


def reference_candidates(model: GpuModel, request: SliceRequest) -> list[Profile]:
    """Profiles of ``model`` that cover ``request``, smallest first, from the catalog's numbers."""
    usable = [p for p in model.profiles if p.placements]
    if request.profile is not None:
        return [p for p in usable if p.name == request.profile]
    plain = [p for p in usable if "+" not in p.name and "-me" not in p.name]
    if request.memory_bytes is not None:
        need_mib = (request.memory_bytes + _MIB - 1) // _MIB
        fitting = [p for p in plain if p.memory_mib >= need_mib]
    else:
        assert request.fraction is not None
        if model.memory_slots <= 0:
            return []
        need_slots = math.ceil(request.fraction * model.memory_slots - 1e-9)
        fitting = [p for p in plain if p.placements[0].size >= need_slots]
    return sorted(fitting, key=lambda p: (p.memory_mib, p.slices, p.sm, p.id))


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def _capacity(model: GpuModel, taken: int) -> tuple[int, list[tuple[int, int]]]:
    """(stranded free slots, [(placement size, free placements of that size)], largest size first)."""
    sought: dict[int, Profile] = {}
    plain = [p for p in model.profiles if p.placements and "+" not in p.name and "-me" not in p.name]
    for p in sorted(plain, key=lambda p: (p.memory_mib, p.slices, p.sm)):
        sought.setdefault(p.memory_mib, p)
    per_size: dict[int, int] = {}
    covered = 0
    for p in sought.values():
        for pl in p.placements:
            m = _mask(pl.start, pl.size)
            per_size.setdefault(pl.size, 0)
            if not m & taken:
                per_size[pl.size] += 1
                covered |= m
    free = ((1 << model.memory_slots) - 1) & ~taken
    stranded = bin(free & ~covered).count("1")
    return stranded, sorted(per_size.items(), reverse=True)


def _loss(model: GpuModel, busy: int, placed: int) -> tuple[int, ...]:
    stranded_before, before = _capacity(model, busy)
    stranded_after, after = _capacity(model, busy | placed)
    lost = [0, 0, 0, 0, 0]  # whole, half, quarter, eighth, sixteenth of the GPU
    for (size, was), (_, now) in zip(before, after, strict=True):
        share = 0
        while share < 4 and model.memory_slots // size >= 2 ** (share + 1):
            share += 1
        lost[share] += was - now
    return (lost[0], stranded_after - stranded_before, *lost[1:])


def _score(model: GpuModel, taken: int) -> tuple[int, ...]:
    stranded, counts = _capacity(model, taken)
    return (-stranded, *(n for _, n in counts))


def reference_options(gpu: MigGpu, profile: Profile) -> list[tuple[tuple, int, int, int, tuple[InstanceSlot, ...]]]:
    """Every (key, tier, start, size, victims) for ``profile`` on ``gpu``, unsorted."""
    model = gpu.model
    busy = occupied = 0
    for inst in gpu.instances:
        occupied |= inst.mask
        if inst.in_use:
            busy |= inst.mask
    same = sum(1 for i in gpu.instances if i.profile_id == profile.id)
    unused = model.memory_slots - bin(busy).count("1")
    free = model.memory_slots - bin(occupied).count("1")
    out = []

    def add(tier: int, start: int, size: int, victims: tuple[InstanceSlot, ...]) -> None:
        placed = _mask(start, size)
        gone = 0
        for v in victims:
            gone |= v.mask
        after = (occupied & ~gone) | placed
        key = (*_loss(model, busy, placed), tier, unused, len(victims), sum(v.size for v in victims), free,
               *(-s for s in _score(model, after)), start)
        out.append((key, tier, start, size, victims))

    for inst in gpu.instances:
        if not inst.in_use and inst.profile_id == profile.id:
            add(0, inst.start, inst.size, ())
    for pl in profile.placements:
        placed = _mask(pl.start, pl.size)
        if placed & busy:
            continue
        victims = tuple(i for i in gpu.instances if i.mask & placed)
        if not victims:
            if same < profile.max_instances:
                add(1, pl.start, pl.size, ())
        elif same - sum(1 for v in victims if v.profile_id == profile.id) < profile.max_instances:
            add(2, pl.start, pl.size, victims)
    return out


def reference_choose_mig(request: SliceRequest, gpus: list[MigGpu], allow_larger: bool = True) -> MigDecision:
    """The decision the rule gives; raises Unplaceable (with a short reason, not the operator's)."""
    grants: dict[tuple[int, int], list[tuple[GpuModel, Profile]]] = {}
    models = {gpu.model for gpu in gpus}
    for model in models:
        cands = reference_candidates(model, request)
        for profile in cands if allow_larger else cands[:1]:
            grants.setdefault((profile.memory_mib, profile.slices), []).append((model, profile))
    for size in sorted(grants):
        order = sorted(grants[size], key=lambda mp: (mp[1].memory_mib, mp[1].slices, mp[1].sm, mp[1].id,
                                                      mp[0].name))
        best = None
        for gpu in gpus:
            for rank, (model, profile) in enumerate(order):
                if model != gpu.model:
                    continue
                for key, tier, start, size_, victims in reference_options(gpu, profile):
                    candidate = (key, gpu.node, gpu.index, rank)
                    if best is None or candidate < best[0]:
                        best = (candidate, gpu, profile, tier, start, size_, victims)
        if best is not None:
            _, gpu, profile, tier, start, size_, victims = best
            reclaim = tuple(Reclaim(gpu.node, gpu.index, v.profile_id, gpu.model.profile_by_id(v.profile_id).name,
                                    v.start, v.size) for v in victims)
            return MigDecision(gpu.node, gpu.index, profile, start, size_, "reuse" if tier == 0 else "create",
                               reclaim)
    raise Unplaceable("no GPU can take it" if grants else "no profile covers it")
