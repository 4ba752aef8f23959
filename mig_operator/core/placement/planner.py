"""Where a slice goes: the profile, the GPU and the placement, as pure functions.

MIG. Candidates are *grants*: a profile of some GPU model, ranked across all models
by memory (NVML MiB), then compute slices (``grant_levels``), so a 4Gi request takes an A100
``1g.5gb`` before an H200 ``1g.18gb``. For the smallest grant some GPU can take, every option on every
GPU that offers it (reuse an idle instance, create at a free placement, reclaim idle instances) is
ranked by ``PlacementOption.key``: first what it takes from the GPU's future capacity, then the tier
(reuse, create, reclaim), then best fit, so whole GPUs stay free for large requests. Only when no
GPU can take the smallest grant, even by reclaiming, is the next larger one tried
(``PlannerSettings.allow_larger_profile``). Fractions (``core.placement.fraction_planner``) are memory bin-packing
on GPUs without MIG; refusals are worded by ``core.placement.mig_refusals``.

This module holds the rule's parts: grants, one GPU's options and their keys. The one MIG planner
that applies them across GPUs is ``planning_index.PlanningIndex`` (its cost independent of the number
of GPUs); ``tests/unit/planner_reference.py`` writes the same rule out plainly and the property tests
hold the index to it. Slots are bit masks (bit i = memory slot i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..requests.quantities import mib_ceil
from ..requests.request import SliceRequest
from .compute import SHARED
from .profiles import GpuModel, Profile


class Unplaceable(Exception):
    """No GPU can take the request now; ``reason`` says why, for the slice's status."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PlannerSettings:
    # Give a GPU a larger profile than its model's smallest fitting one when no GPU can take the
    # smaller grants (HAMi does this always; it trades memory for latency, so it can be turned off).
    allow_larger_profile: bool = True
    # The compute of a fraction without spec.compute (core.placement.compute): shared, or proportional to its memory.
    default_compute: str = SHARED


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
    """One MIG-enabled GPU: its model and the instances on it (in use and idle).

    A GPU whose model offers no MIG profile (an L4, or a board with 0 memory slots) is accepted and
    simply never chosen: an inventory that lists one here is a caller's slip that must not stop
    every other slice from binding.
    """

    node: str
    index: int
    model: GpuModel
    instances: tuple[InstanceSlot, ...] = ()

    # Derived once per state: every planning step reads them for every GPU.
    occupied_mask: int = field(init=False, repr=False, compare=False)
    busy_mask: int = field(init=False, repr=False, compare=False)
    # Best option per profile id, filled on demand by ``gpu_option``.
    _options: dict[int, PlacementOption | None] = field(
        init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        occupied = busy = 0
        for inst in self.instances:
            if inst.size < 1 or inst.start < 0 or inst.start + inst.size > self.model.memory_slots \
                    or inst.mask & occupied:
                raise ValueError(
                    f"GPU {self.index} of node {self.node!r} ({self.model.name}, {self.model.memory_slots} slots): "
                    f"instance of profile id {inst.profile_id} at slots {inst.start}..{inst.start + inst.size - 1} "
                    "is outside the GPU or overlaps another; instances must be disjoint within the slots, "
                    "e.g. InstanceSlot(profile_id=19, start=0, size=1, in_use=True)"
                )
            occupied |= inst.mask
            if inst.in_use:
                busy |= inst.mask
        object.__setattr__(self, "occupied_mask", occupied)
        object.__setattr__(self, "busy_mask", busy)

    def idle_instances(self) -> tuple[InstanceSlot, ...]:
        return tuple(i for i in self.instances if not i.in_use)

    def with_decision(self, decision: MigDecision) -> MigGpu:
        """This GPU after the decision: reclaimed instances gone, the chosen one in use."""
        return replace(self, instances=instances_after(self.instances, decision))

    def with_released(self, start: int, destroy: bool = False) -> MigGpu:
        """This GPU after the slice at ``start`` is released: idle (lazy reclaim) or destroyed (eager)."""
        return replace(self, instances=instances_released(self.instances, start, destroy))


def instances_after(instances: tuple[InstanceSlot, ...], decision: MigDecision) -> tuple[InstanceSlot, ...]:
    """The instances of the decision's GPU once it is carried out, sorted by start."""
    gone = {(r.start, r.profile_id) for r in decision.reclaim}
    kept = [
        i for i in instances
        if (i.start, i.profile_id) not in gone and not (i.start == decision.start and i.size == decision.size)
    ]
    kept.append(InstanceSlot(decision.profile.id, decision.start, decision.size, in_use=True))
    return tuple(sorted(kept, key=lambda i: i.start))


def instances_released(instances: tuple[InstanceSlot, ...], start: int, destroy: bool) -> tuple[InstanceSlot, ...]:
    """The instances once the slice at ``start`` is released: kept idle, or destroyed if ``destroy``."""
    kept: list[InstanceSlot] = []
    for inst in instances:
        if inst.start == start:
            if not destroy:
                kept.append(replace(inst, in_use=False))
        else:
            kept.append(inst)
    return tuple(kept)


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


# --- profiles ---------------------------------------------------------------------------------


def candidate_profiles(model: GpuModel, request: SliceRequest) -> list[Profile]:
    """Profiles of ``model`` that cover the request, smallest first (docs/architecture.md, "How the planner decides").

    Memory is NVML's ``memorySizeMB``; ties go to fewer compute slices, then fewer SMs; ``+me`` and
    other engine variants only when asked for by name. A fraction is that share of the GPU's memory
    slots (0.5 of 8 slots is 4: ``3g``), since slots are the unit MIG divides memory into. A profile
    with no legal placement can never be created, so it is never a candidate.
    """
    if request.profile is not None:
        if not model.has_profile(request.profile):
            return []
        named = model.profile(request.profile)
        return [named] if named.placements else []
    plain = [p for p in model.profiles if not p.media_extension and p.placements]
    if request.memory_bytes is not None:
        need_mib = mib_ceil(request.memory_bytes)
        fitting = [p for p in plain if p.memory_mib >= need_mib]
    else:
        assert request.fraction is not None
        if model.memory_slots <= 0:
            return []
        # Tolerate float noise: 0.5 * 8 must be 4 slots, not 5.
        need_slots = math.ceil(request.fraction * model.memory_slots - 1e-9)
        fitting = [p for p in plain if p.size >= need_slots]
    return sorted(fitting, key=lambda p: (p.memory_mib, p.slices, p.sm, p.id))


@lru_cache(maxsize=4096)
def _candidates(model: GpuModel, request: SliceRequest) -> tuple[Profile, ...]:
    # Every GPU of a node shares its model: sort once per (model, request), not once per GPU.
    return tuple(candidate_profiles(model, request))


def grant_key(profile: Profile) -> tuple[int, int]:
    """How large a grant is, across models: NVML MiB, then compute slices (the smallest wins)."""
    return (profile.memory_mib, profile.slices)


@dataclass(frozen=True)
class GrantLevel:
    """One grant size: the (model, profile) pairs of that size the request may get, in candidate order."""

    key: tuple[int, int]
    options: tuple[tuple[GpuModel, Profile], ...]


@lru_cache(maxsize=4096)
def grant_levels(models: tuple[GpuModel, ...], request: SliceRequest, allow_larger: bool) -> tuple[GrantLevel, ...]:
    """The grants ``request`` may get on these models, smallest first.

    Without ``allow_larger`` each model offers only its smallest fitting profile: a GPU is never given
    more than its own smallest fit, but a larger model's smallest fit still serves when the smaller
    models are full.
    """
    by_key: dict[tuple[int, int], list[tuple[GpuModel, Profile]]] = {}
    for model in models:
        cands = _candidates(model, request)
        for profile in cands if allow_larger else cands[:1]:
            by_key.setdefault(grant_key(profile), []).append((model, profile))
    return tuple(GrantLevel(key, tuple(by_key[key])) for key in sorted(by_key))


# --- one GPU ----------------------------------------------------------------------------------


def _sought(model: GpuModel) -> list[Profile]:
    """Profiles a memory request can get: plain, and the first of each memory size (``2g.35gb`` and
    ``4g.71gb`` hold no more than ``1g.35gb`` and ``3g.71gb``, so only a request by name gets them)."""
    firsts: dict[int, Profile] = {}
    plain = (p for p in model.profiles if not p.media_extension and p.placements)
    for p in sorted(plain, key=lambda p: (p.memory_mib, p.slices, p.sm)):
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


TIER_REUSE, TIER_CREATE, TIER_RECLAIM = 0, 1, 2

# Loss vectors put placements of each size in a fixed position by the share of the GPU they span
# (whole, half, quarter, eighth, sixteenth), so options on different models compare position by position.
_SHARES = 5


@dataclass(frozen=True)
class PlacementOption:
    """One way to put a profile on one GPU, and its rank among all options of the same grant size.

    ``key`` (smaller is better), compared lexicographically:

    1. ``loss``: what the option takes from the GPU's future, counted around the instances in use
       (idle ones are reclaimed when needed): whether it breaks a whole free GPU, then the slots it
       strands (free, but no free placement reaches them any more), then the free placements it
       removes per size, half a GPU first. So reusing an idle instance on an otherwise empty GPU
       loses to any option on a GPU already in use (the trap where lazy reuse lost to first-fit),
       seven 1g slices fill one GPU (DRA #932), and an option that breaks a place where a larger
       profile fits loses to one that keeps it.
    2. ``tier``: reuse an idle instance (no NVML call), else create at a free placement, else
       reclaim idle instances (in that order), among options that cost the same.
    3. Best fit: the GPU with the most slots in use, then the fewest idle instances destroyed (and
       their slots), then the fewest free slots; then the most capacity left around every instance;
       then the lower start, NVML's order.

    Every term depends only on the GPU's state (model and instances), which is what lets
    ``PlanningIndex`` rank states instead of GPUs.
    """

    tier: int  # TIER_REUSE, TIER_CREATE or TIER_RECLAIM
    start: int
    size: int
    reclaim: tuple[InstanceSlot, ...]
    key: tuple[int, ...]


def _count(instances: tuple[InstanceSlot, ...], profile_id: int) -> int:
    return sum(1 for inst in instances if inst.profile_id == profile_id)


def _neg(score: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-s for s in score)


def _union(instances: tuple[InstanceSlot, ...]) -> int:
    mask = 0
    for inst in instances:
        mask |= inst.mask
    return mask


@lru_cache(maxsize=64)
def _share_of_size(model: GpuModel) -> tuple[int, ...]:
    """For each component of ``capacity_score`` after the first, its loss-vector position."""
    positions = []
    for size, _ in _shapes(model):
        # 8 of 8 slots is a whole GPU (0), 4 of 8 a half (1), 1 of 8 an eighth (3); 3 of 8 counts as a half.
        positions.append(min(_SHARES - 1, (model.memory_slots // size).bit_length() - 1))
    return tuple(positions)


def _loss(model: GpuModel, before: int, after: int) -> tuple[int, ...]:
    """Whole-GPU placements lost, stranded slots gained, then placements lost per share of the GPU."""
    old, new = capacity_score(model, before), capacity_score(model, after)
    lost = [0] * _SHARES
    for position, was, now in zip(_share_of_size(model), old[1:], new[1:], strict=True):
        lost[position] += was - now
    return (lost[0], old[0] - new[0], *lost[1:])


@lru_cache(maxsize=131072)
def plan_on_gpu(model: GpuModel, instances: tuple[InstanceSlot, ...], profile_id: int) -> PlacementOption | None:
    """The best option for the profile on a GPU in this state (see ``PlacementOption``), or None
    when it cannot go there even after reclaiming every idle instance."""
    profile = model.profile_by_id(profile_id)
    occupied = busy = 0
    for inst in instances:
        occupied |= inst.mask
        if inst.in_use:
            busy |= inst.mask
    count = _count(instances, profile_id)
    unused = model.memory_slots - busy.bit_count()
    free = model.memory_slots - occupied.bit_count()
    best: PlacementOption | None = None

    def consider(tier: int, start: int, size: int, mask: int, victims: tuple[InstanceSlot, ...]) -> None:
        nonlocal best
        after = (occupied & ~_union(victims)) | mask
        key = (*_loss(model, busy, busy | mask), tier, unused, len(victims), sum(v.size for v in victims), free,
               *_neg(capacity_score(model, after)), start)
        if best is None or key < best.key:
            best = PlacementOption(tier, start, size, victims, key)

    for inst in instances:
        if not inst.in_use and inst.profile_id == profile_id:
            consider(TIER_REUSE, inst.start, inst.size, inst.mask, ())
    for pl in profile.placements:
        if pl.mask & busy:
            continue
        victims = tuple(i for i in instances if i.mask & pl.mask)
        if not victims:
            if count < profile.max_instances:
                consider(TIER_CREATE, pl.start, pl.size, pl.mask, ())
        elif count - _count(victims, profile_id) < profile.max_instances:
            consider(TIER_RECLAIM, pl.start, pl.size, pl.mask, victims)
    return best


def gpu_option(gpu: MigGpu, profile: Profile) -> PlacementOption | None:
    """``plan_on_gpu`` for this GPU, remembered on the GPU object (a replay asks again every step)."""
    try:
        return gpu._options[profile.id]
    except KeyError:
        option = plan_on_gpu(gpu.model, gpu.instances, profile.id) if profile.placements else None
        gpu._options[profile.id] = option
        return option


def choose_placement(gpu: MigGpu, profile: Profile) -> MigDecision | None:
    """Where ``profile`` goes on this GPU (the best ``PlacementOption``), or None if nowhere."""
    option = gpu_option(gpu, profile)
    return None if option is None else option_decision(gpu.node, gpu.index, gpu.model, profile, option)


def option_decision(node: str, index: int, model: GpuModel, profile: Profile, option: PlacementOption) -> MigDecision:
    reclaim = tuple(
        Reclaim(node, index, v.profile_id, model.profile_by_id(v.profile_id).name, v.start, v.size)
        for v in option.reclaim
    )
    action = "reuse" if option.tier == TIER_REUSE else "create"
    return MigDecision(node, index, profile, option.start, option.size, action, reclaim)


# --- refusals ---------------------------------------------------------------------------------
