"""Where a slice goes: the profile, the GPU and the placement, as pure functions.

MIG (``choose_mig``), in order of preference for each candidate profile, smallest first:

1. reuse an idle instance of that profile (no NVML call);
2. create it at a free legal placement, chosen to keep the most future capacity;
3. reclaim the fewest idle instances that free a legal placement, then create.

Only then is the next larger profile tried (``PlannerSettings.allow_larger_profile``). Across GPUs
it packs (best fit by slots in use) so whole GPUs stay free for large requests. Fractions (``choose_fraction``) are
memory bin-packing on GPUs without MIG.

Slots are bit masks (bit i = memory slot i), so a decision on 64 GPUs stays well under a millisecond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .profiles import GpuModel, Profile
from .quantities import MIB, format_bytes, mib_ceil
from .request import SliceRequest


class Unplaceable(Exception):
    """No GPU can take the request now; ``reason`` says why, for the slice's status."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PlannerSettings:
    # Give a larger profile when the smallest fitting one has no room anywhere (HAMi does this
    # always; it trades memory for latency, so it can be turned off).
    allow_larger_profile: bool = True


@dataclass(frozen=True)
class InstanceSlot:
    """An existing GPU instance as the planner sees it: where it sits and whether a slice uses it."""

    profile_id: int
    start: int
    size: int
    in_use: bool

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True)
class MigGpu:
    """One MIG-enabled GPU: its model and the instances on it (in use and idle)."""

    node: str
    index: int
    model: GpuModel
    instances: tuple[InstanceSlot, ...] = ()

    # Derived once per state: every planning step reads them for every GPU.
    occupied_mask: int = field(init=False, repr=False, compare=False)
    busy_mask: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        occupied = busy = 0
        for inst in self.instances:
            occupied |= inst.mask
            if inst.in_use:
                busy |= inst.mask
        object.__setattr__(self, "occupied_mask", occupied)
        object.__setattr__(self, "busy_mask", busy)

    def idle_instances(self) -> tuple[InstanceSlot, ...]:
        return tuple(i for i in self.instances if not i.in_use)

    def with_decision(self, decision: MigDecision) -> MigGpu:
        """This GPU after the decision: reclaimed instances gone, the chosen one in use."""
        gone = {(r.start, r.profile_id) for r in decision.reclaim}
        kept = [
            i for i in self.instances
            if (i.start, i.profile_id) not in gone and not (i.start == decision.start and i.size == decision.size)
        ]
        kept.append(InstanceSlot(decision.profile.id, decision.start, decision.size, in_use=True))
        return replace(self, instances=tuple(sorted(kept, key=lambda i: i.start)))

    def with_released(self, start: int, destroy: bool = False) -> MigGpu:
        """This GPU after the slice at ``start`` is released: idle (lazy reclaim) or destroyed (eager)."""
        kept: list[InstanceSlot] = []
        for inst in self.instances:
            if inst.start == start:
                if not destroy:
                    kept.append(replace(inst, in_use=False))
            else:
                kept.append(inst)
        return replace(self, instances=tuple(kept))


@dataclass(frozen=True)
class Reclaim:
    """An idle instance to destroy to make room."""

    node: str
    gpu: int
    profile_id: int
    profile: str
    start: int
    size: int


@dataclass(frozen=True)
class MigDecision:
    node: str
    gpu: int
    profile: Profile
    start: int
    size: int
    action: str  # "create" or "reuse"
    reclaim: tuple[Reclaim, ...] = ()


@dataclass(frozen=True)
class FractionGpu:
    """A GPU shared by fractions: its memory and what slices were granted on it."""

    node: str
    index: int
    memory_bytes: int
    granted_bytes: int = 0

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.granted_bytes


@dataclass(frozen=True)
class FractionDecision:
    node: str
    gpu: int
    granted_bytes: int


# --- profiles ---------------------------------------------------------------------------------


def candidate_profiles(model: GpuModel, request: SliceRequest) -> list[Profile]:
    """Profiles of ``model`` that cover the request, smallest first (DESIGN "Which profile is smallest").

    Memory is NVML's ``memorySizeMB``; ties go to fewer compute slices, then fewer SMs; ``+me`` and
    other engine variants only when asked for by name. A fraction is that share of the GPU's memory
    slots (0.5 of 8 slots is 4: ``3g``), since slots are the unit MIG divides memory into.
    """
    if request.profile is not None:
        return [model.profile(request.profile)] if model.has_profile(request.profile) else []
    plain = [p for p in model.profiles if not p.media_extension]
    if request.memory_bytes is not None:
        need_mib = mib_ceil(request.memory_bytes)
        fitting = [p for p in plain if p.memory_mib >= need_mib]
    else:
        assert request.fraction is not None
        # Tolerate float noise: 0.5 * 8 must be 4 slots, not 5.
        need_slots = math.ceil(request.fraction * model.memory_slots - 1e-9)
        fitting = [p for p in plain if p.size >= need_slots]
    return sorted(fitting, key=lambda p: (p.memory_mib, p.slices, p.sm, p.id))


@lru_cache(maxsize=4096)
def _candidates(model: GpuModel, request: SliceRequest) -> tuple[Profile, ...]:
    # Every GPU of a node shares its model: sort once per (model, request), not once per GPU.
    return tuple(candidate_profiles(model, request))


# --- one GPU ----------------------------------------------------------------------------------


def _sought(model: GpuModel) -> list[Profile]:
    """Profiles a memory request can get: plain, and the first of each memory size (``2g.35gb`` and
    ``4g.71gb`` hold no more than ``1g.35gb`` and ``3g.71gb``, so only a request by name gets them)."""
    firsts: dict[int, Profile] = {}
    for p in sorted((p for p in model.profiles if not p.media_extension), key=lambda p: (p.memory_mib, p.slices, p.sm)):
        firsts.setdefault(p.memory_mib, p)
    return list(firsts.values())


@lru_cache(maxsize=64)
def _shapes(model: GpuModel) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Placements of the profiles memory requests get, grouped by size, largest first."""
    by_size: dict[int, list[int]] = {}
    for profile in _sought(model):
        for placement in profile.placements:
            by_size.setdefault(placement.size, []).append(placement.mask)
    return tuple((size, tuple(masks)) for size, masks in sorted(by_size.items(), reverse=True))


@lru_cache(maxsize=65536)
def capacity_score(model: GpuModel, occupied: int) -> tuple[int, ...]:
    """What can still be placed, compared lexicographically (larger is better).

    Free legal placements per size, largest size first, so a choice that keeps a 7g or 3g
    placeable beats one that only keeps more 1g spots (HAMi PR #2855 scores alike; DRA #933 is the
    failure it avoids); and free slots no free placement covers count against it: a 1g at slot 6
    strands slot 7, which only a 2-slot placement at 6, 3g at 4 or 7g can use.
    """
    shapes = _shapes(model)
    counts = tuple(sum(1 for mask in masks if not mask & occupied) for _, masks in shapes)
    covered = 0
    for _, masks in shapes:
        for mask in masks:
            if not mask & occupied:
                covered |= mask
    stranded = (model.full_mask & ~occupied & ~covered).bit_count()
    return (-stranded, *counts)


@dataclass(frozen=True)
class _Option:
    tier: int  # 0 reuse, 1 free placement, 2 reclaim
    start: int
    size: int
    reclaim: tuple[InstanceSlot, ...] = ()


def _count(instances: tuple[InstanceSlot, ...], profile_id: int) -> int:
    return sum(1 for inst in instances if inst.profile_id == profile_id)


def _fits(gpu: MigGpu, profile: Profile, tier: int) -> int | None:
    """Cheap feasibility of a tier on a GPU, no scoring: None if impossible, else the number of
    idle instances it would destroy (0 unless reclaiming)."""
    if tier == 0:
        return 0 if any(not i.in_use and i.profile_id == profile.id for i in gpu.instances) else None
    count = _count(gpu.instances, profile.id)
    if tier == 1:
        if count >= profile.max_instances:
            return None
        return 0 if any(not pl.mask & gpu.occupied_mask for pl in profile.placements) else None
    fewest: int | None = None
    for pl in profile.placements:
        if pl.mask & gpu.busy_mask:
            continue
        victims = [i for i in gpu.instances if i.mask & pl.mask]
        if count - sum(1 for v in victims if v.profile_id == profile.id) >= profile.max_instances:
            continue
        if fewest is None or len(victims) < fewest:
            fewest = len(victims)
    return fewest


@lru_cache(maxsize=65536)
def _best_on_gpu(model: GpuModel, instances: tuple[InstanceSlot, ...], profile_id: int, tier: int) -> _Option | None:
    """The placement for a tier on one GPU, scored by what stays placeable.

    Idle instances will be reclaimed when their space is needed, so placements are scored first by
    the capacity left around the instances in use, then around all instances.
    """
    profile = model.profile_by_id(profile_id)
    gpu = MigGpu("", 0, model, instances)
    occupied, busy = gpu.occupied_mask, gpu.busy_mask
    count = _count(instances, profile_id)
    best: tuple[tuple, _Option] | None = None
    if tier == 0:
        for inst in instances:
            if inst.in_use or inst.profile_id != profile_id:
                continue
            key = (_neg(capacity_score(model, busy | inst.mask)), inst.start)
            if best is None or key < best[0]:
                best = (key, _Option(0, inst.start, inst.size))
    elif tier == 1 and count < profile.max_instances:
        for pl in profile.placements:
            if pl.mask & occupied:
                continue
            key = (_neg(capacity_score(model, busy | pl.mask)), _neg(capacity_score(model, occupied | pl.mask)),
                   pl.start)
            if best is None or key < best[0]:
                best = (key, _Option(1, pl.start, pl.size))
    elif tier == 2:
        for pl in profile.placements:
            if pl.mask & busy:
                continue
            victims = tuple(i for i in instances if i.mask & pl.mask)
            if count - _count(victims, profile_id) >= profile.max_instances:
                continue
            after = (occupied & ~_union(victims)) | pl.mask
            key = (len(victims), sum(v.size for v in victims), _neg(capacity_score(model, busy | pl.mask)),
                   _neg(capacity_score(model, after)), pl.start)
            if best is None or key < best[0]:
                best = (key, _Option(2, pl.start, pl.size, reclaim=victims))
    return best[1] if best else None


def _neg(score: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-s for s in score)


def _union(instances: tuple[InstanceSlot, ...]) -> int:
    mask = 0
    for inst in instances:
        mask |= inst.mask
    return mask


def choose_placement(gpu: MigGpu, profile: Profile) -> MigDecision | None:
    """Where ``profile`` goes on this GPU: reuse, else a free placement, else the cheapest reclaim."""
    for tier in (0, 1, 2):
        option = _best_on_gpu(gpu.model, gpu.instances, profile.id, tier)
        if option is not None:
            return _decision(gpu, profile, option)
    return None


def _decision(gpu: MigGpu, profile: Profile, option: _Option) -> MigDecision:
    reclaim = tuple(
        Reclaim(gpu.node, gpu.index, v.profile_id, gpu.model.profile_by_id(v.profile_id).name, v.start, v.size)
        for v in option.reclaim
    )
    action = "reuse" if option.tier == 0 else "create"
    return MigDecision(gpu.node, gpu.index, profile, option.start, option.size, action, reclaim)


# --- many GPUs --------------------------------------------------------------------------------


def _fit_key(gpu: MigGpu, victims: int) -> tuple:
    """Best fit across GPUs: the GPU with the most slots in use that can take the request, so empty
    GPUs stay whole for large requests; then the fewest idle instances destroyed, then the fewest
    free slots. Slots of idle instances count as free for packing: they are reclaimed when needed.
    """
    unused = gpu.model.memory_slots - gpu.busy_mask.bit_count()
    free = gpu.model.memory_slots - gpu.occupied_mask.bit_count()
    return (unused, victims, free, gpu.node, gpu.index)


def choose_mig(
    request: SliceRequest, gpus: list[MigGpu], settings: PlannerSettings = PlannerSettings()
) -> MigDecision:
    """The placement for ``request`` among ``gpus``; raises Unplaceable with the reason.

    For each candidate profile, smallest first: reuse an idle instance on any GPU, else a free
    placement, else the fewest reclaims; within each, the best-fit GPU (``_fit_key``). The GPU is
    chosen with cheap mask checks and only its placements are scored, so a decision stays O(GPUs).
    """
    if not gpus:
        raise Unplaceable("no MIG-enabled GPU is available")
    candidates = [_candidates(gpu.model, request) for gpu in gpus]
    if not settings.allow_larger_profile:
        candidates = [c[:1] for c in candidates]
    ranks = max(len(c) for c in candidates)
    if ranks == 0:
        raise Unplaceable(_too_large(request, gpus))
    for rank in range(ranks):
        for tier in (0, 1, 2):
            best: tuple[tuple, MigGpu, Profile] | None = None
            for gpu, cands in zip(gpus, candidates, strict=True):
                if rank >= len(cands):
                    continue
                victims = _fits(gpu, cands[rank], tier)
                if victims is not None:
                    key = _fit_key(gpu, victims)
                    if best is None or key < best[0]:
                        best = (key, gpu, cands[rank])
            if best is not None:
                _, gpu, profile = best
                option = _best_on_gpu(gpu.model, gpu.instances, profile.id, tier)
                assert option is not None, "feasibility and placement disagree"
                return _decision(gpu, profile, option)
    raise Unplaceable(_no_room(request, gpus, candidates))


def _too_large(request: SliceRequest, gpus: list[MigGpu]) -> str:
    models = {gpu.model.name: gpu.model for gpu in gpus}
    if request.profile is not None:
        return f"profile {request.profile} does not exist on any GPU here (models: {', '.join(sorted(models))})"
    largest = max(
        (p for m in models.values() for p in m.profiles if not p.media_extension),
        key=lambda p: (p.memory_mib, p.size),
    )
    if request.memory_bytes is not None:
        asked = f"{request.describe()} ({mib_ceil(request.memory_bytes)} MiB)"
    else:
        asked = request.describe()
    return f"{asked} is larger than any MIG profile of any GPU (largest: {largest.name}, {largest.memory_mib} MiB)"


def _no_room(request: SliceRequest, gpus: list[MigGpu], candidates: list[list[Profile]]) -> str:
    names = sorted({p.name for c in candidates for p in c})
    held = ", ".join(
        f"{gpu.node + '/' if gpu.node else ''}gpu {gpu.index}: "
        f"{gpu.busy_mask.bit_count()}/{gpu.model.memory_slots} slots in use"
        for gpu in gpus
    )
    profiles = "" if request.profile is not None else f" (profiles {', '.join(names)})"
    return (
        f"every GPU is held by slices in use: no room for {request.describe()}{profiles} "
        f"even after reclaiming every idle instance ({held})"
    )


# --- fractions --------------------------------------------------------------------------------


def fraction_bytes(request: SliceRequest, gpu_memory_bytes: int) -> int:
    """Bytes a fraction-mode request needs on a GPU of this size."""
    if request.memory_bytes is not None:
        return request.memory_bytes
    if request.fraction is not None:
        # Whole MiB, rounded down, so fraction 1.0 is exactly the GPU and 0.5 + 0.5 fit.
        return int(request.fraction * gpu_memory_bytes) // MIB * MIB
    raise Unplaceable(f"migProfile {request.profile} needs a MIG node; this node shares GPUs by fractions")


def choose_fraction(request: SliceRequest, gpus: list[FractionGpu]) -> FractionDecision:
    """Memory bin-packing: the GPU with the least free memory that still fits (best fit)."""
    if not gpus:
        raise Unplaceable("no GPU is available for fractions")
    best: tuple[tuple, FractionGpu, int] | None = None
    for gpu in gpus:
        need = fraction_bytes(request, gpu.memory_bytes)
        if need > gpu.free_bytes:
            continue
        key = (gpu.free_bytes - need, gpu.node, gpu.index)
        if best is None or key < best[0]:
            best = (key, gpu, need)
    if best is None:
        largest = max(gpus, key=lambda g: g.memory_bytes)
        need = fraction_bytes(request, largest.memory_bytes)
        if need > largest.memory_bytes:
            raise Unplaceable(
                f"{request.describe()} is larger than any GPU (largest: {format_bytes(largest.memory_bytes)})"
            )
        raise Unplaceable(f"every GPU is held by slices in use: none has {format_bytes(need)} free")
    return FractionDecision(best[1].node, best[1].index, best[2])
