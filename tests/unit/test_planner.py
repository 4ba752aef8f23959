import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.planner import (
    FractionGpu,
    InstanceSlot,
    MigGpu,
    PlannerSettings,
    Unplaceable,
    candidate_profiles,
    capacity_score,
    choose_fraction,
    choose_mig,
    choose_placement,
)
from mig_operator.core.profiles import CATALOG, GpuModel, Placement, Profile, get_model
from mig_operator.core.request import slice_request

H200 = get_model("h200-141gb")
H100 = get_model("h100-80gb")
A30 = get_model("a30-24gb")


def inst(model, name: str, start: int, in_use: bool = True) -> InstanceSlot:
    p = model.profile(name)
    return InstanceSlot(p.id, start, p.size, in_use)


def names(model, request) -> list[str]:
    return [p.name for p in candidate_profiles(model, request)]


# --- smallest profile -------------------------------------------------------------------------


def test_memory_is_nvml_mib_not_the_name() -> None:
    assert names(H200, slice_request(memory="17G"))[0] == "1g.18gb"  # 16213 MiB <= 16384
    assert names(H200, slice_request(memory="17Gi"))[0] == "1g.35gb"  # 17408 MiB > 16384
    assert names(H200, slice_request(memory="16Gi"))[0] == "1g.18gb"  # exactly 16384 MiB


def test_equal_memory_prefers_fewer_slices_and_skips_media_extension() -> None:
    assert names(H200, slice_request(memory="20Gi")) == ["1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert all("+me" not in n for n in names(H200, slice_request(memory="1G")))


def test_media_extension_only_by_name() -> None:
    assert names(H200, slice_request(profile="1g.18gb+me")) == ["1g.18gb+me"]
    assert names(H200, slice_request(profile="3g.40gb")) == []


@pytest.mark.parametrize(
    ("fraction", "first"),
    [(0.125, "1g.18gb"), (0.25, "1g.35gb"), (0.5, "3g.71gb"), (0.51, "7g.141gb"), (1.0, "7g.141gb")],
)
def test_fraction_on_mig_is_a_share_of_memory_slots(fraction: float, first: str) -> None:
    assert names(H200, slice_request(fraction=fraction))[0] == first


def test_too_large_is_refused_with_the_largest_profile() -> None:
    with pytest.raises(Unplaceable) as info:
        choose_mig(slice_request(memory="200G"), [MigGpu("", 0, H200)])
    assert "larger than any MIG profile" in info.value.reason and "7g.141gb" in info.value.reason


# --- placement on one GPU ---------------------------------------------------------------------


def test_small_instances_strand_no_slot_and_keep_a_half_free() -> None:
    gpu = MigGpu("", 0, H200)
    for _ in range(3):
        d = choose_placement(gpu, H200.profile("1g.18gb"))
        assert d is not None and d.action == "create"
        gpu = gpu.with_decision(d)
    assert capacity_score(H200, gpu.occupied_mask)[0] == 0, "no free slot is left unusable"
    # A 3g still fits in the other half: the DRA #933 layout {1g@0, 1g@1, 1g@5} never happens.
    assert choose_placement(gpu, H200.profile("3g.71gb")) is not None


def test_3g_first_goes_to_start_4_keeping_4g() -> None:
    d = choose_placement(MigGpu("", 0, H200), H200.profile("3g.71gb"))
    assert d.start == 4


def test_score_counts_stranded_slots_and_larger_profiles() -> None:
    # 1g at slot 6 strands slot 7 (only 1g.35gb@6, 3g@4 or 7g reach it); 1g at 5 does not.
    assert capacity_score(H200, 1 << 6) < capacity_score(H200, 1 << 5)
    # DRA #933: 1g at 0, 1, 5 blocks 3g in both halves; 1g at 0, 1, 2 keeps 3g@4.
    assert capacity_score(H200, 0b00100011) < capacity_score(H200, 0b00000111)


def test_reuse_idle_instance_before_creating() -> None:
    gpu = MigGpu("", 0, H200, (inst(H200, "1g.18gb", 2, in_use=False),))
    d = choose_placement(gpu, H200.profile("1g.18gb"))
    assert (d.action, d.start, d.reclaim) == ("reuse", 2, ())


def test_reclaim_fewest_idle_instances() -> None:
    # GPU full: 4 idle 1g at 0..3 (left), in-use 3g at 4. A 2g needs 2 slots: destroy 2 idle 1g, not 4.
    instances = tuple(inst(H200, "1g.18gb", s, in_use=False) for s in range(4)) + (inst(H200, "3g.71gb", 4),)
    d = choose_placement(MigGpu("", 0, H200, instances), H200.profile("2g.35gb"))
    assert d is not None and d.action == "create"
    assert len(d.reclaim) == 2
    assert {r.start for r in d.reclaim} == {d.start, d.start + 1}


def test_never_reclaims_an_instance_in_use() -> None:
    instances = (inst(H200, "4g.71gb", 0), inst(H200, "3g.71gb", 4))
    assert choose_placement(MigGpu("", 0, H200, instances), H200.profile("1g.18gb")) is None


def test_refused_when_only_busy_instances_block() -> None:
    gpu = MigGpu("", 0, H200, (inst(H200, "1g.18gb", 0), inst(H200, "1g.18gb", 2), inst(H200, "1g.18gb", 4),
                                inst(H200, "1g.18gb", 6)))
    # Free slots 1, 3, 5, 7: no aligned pair is free, so neither 1g.35gb nor anything larger fits.
    with pytest.raises(Unplaceable) as info:
        choose_mig(slice_request(memory="17Gi"), [gpu])
    assert "every GPU is held by slices in use" in info.value.reason
    assert "gpu 0: 4/8 slots in use" in info.value.reason


def test_reclaim_of_the_smallest_beats_reusing_a_larger_one() -> None:
    # DESIGN's order: reuse, free placement, reclaim for the smallest profile, and only then larger ones.
    a30 = MigGpu("", 0, A30, (inst(A30, "2g.12gb", 0), inst(A30, "2g.12gb", 2, in_use=False)))
    d = choose_mig(slice_request(memory="5G"), [a30])
    assert (d.profile.name, d.action, d.start, len(d.reclaim)) == ("1g.6gb", "create", 2, 1)


# A board whose smallest profile has fewer placements than a larger one (possible with profiles read
# from NVML at run time), to exercise upsizing.
ODD = GpuModel(
    "odd", "Odd GPU", 4, 4096,
    (
        Profile("1g.1gb", 1, 1, 1024, 10, 1, (Placement(0, 1),)),
        Profile("2g.2gb", 2, 2, 2048, 20, 1, (Placement(2, 2),)),
    ),
)


def test_upsizes_when_the_smallest_cannot_be_placed() -> None:
    gpu = MigGpu("", 0, ODD, (InstanceSlot(1, 0, 1, in_use=True),))
    d = choose_mig(slice_request(memory="512Mi"), [gpu])
    assert (d.profile.name, d.start) == ("2g.2gb", 2)


def test_upsizing_can_be_turned_off() -> None:
    gpu = MigGpu("", 0, ODD, (InstanceSlot(1, 0, 1, in_use=True),))
    with pytest.raises(Unplaceable):
        choose_mig(slice_request(memory="512Mi"), [gpu], PlannerSettings(allow_larger_profile=False))


def test_max_instances_is_respected() -> None:
    # Only one +me instance per GPU, although its placements are free.
    gpu = MigGpu("", 0, H200, (inst(H200, "1g.18gb+me", 0),))
    with pytest.raises(Unplaceable):
        choose_mig(slice_request(profile="1g.18gb+me"), [gpu])


# --- many GPUs --------------------------------------------------------------------------------


def test_seven_1g_pack_one_gpu_instead_of_spreading() -> None:
    gpus = [MigGpu("", i, H100) for i in range(4)]
    used = set()
    for _ in range(7):
        d = choose_mig(slice_request(memory="5G"), gpus)
        gpus[d.gpu] = gpus[d.gpu].with_decision(d)
        used.add(d.gpu)
    assert used == {0}, "DRA #932: 7x1g must pack one GPU"
    d = choose_mig(slice_request(profile="7g.80gb"), gpus)
    assert d.gpu == 1


def test_best_fit_keeps_whole_gpus_free() -> None:
    gpus = [MigGpu("", 0, H100), MigGpu("", 1, H100, (inst(H100, "3g.40gb", 4),))]
    d = choose_mig(slice_request(memory="10Gi"), gpus)
    assert d.gpu == 1
    assert choose_mig(slice_request(profile="7g.80gb"), [gpus[0], gpus[1].with_decision(d)]).gpu == 0


def test_reuse_anywhere_comes_before_creating() -> None:
    # GPU 1 holds only an idle 1g; GPU 0 has a 3g in use. Reusing costs no NVML call (DESIGN's order),
    # and GPU 0 keeps its free half.
    gpus = [MigGpu("", 0, H100, (inst(H100, "3g.40gb", 4),)), MigGpu("", 1, H100, (inst(H100, "1g.10gb", 3, False),))]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.gpu, d.action, d.start) == (1, "reuse", 3)


def test_reuse_beats_creating_on_equally_packed_gpus() -> None:
    gpus = [MigGpu("", 0, H100), MigGpu("", 1, H100, (inst(H100, "1g.10gb", 3, in_use=False),))]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.gpu, d.action, d.start) == (1, "reuse", 3)


def test_no_gpus() -> None:
    with pytest.raises(Unplaceable):
        choose_mig(slice_request(memory="1G"), [])


# --- fractions --------------------------------------------------------------------------------


def test_fraction_best_fit_and_refusals() -> None:
    gib = 2**30
    gpus = [FractionGpu("n", 0, 80 * gib), FractionGpu("n", 1, 80 * gib, granted_bytes=60 * gib)]
    d = choose_fraction(slice_request(memory="10Gi"), gpus)
    assert (d.gpu, d.granted_bytes) == (1, 10 * gib)
    d = choose_fraction(slice_request(fraction=0.5), gpus)
    assert (d.gpu, d.granted_bytes) == (0, 40 * gib)
    with pytest.raises(Unplaceable) as info:
        choose_fraction(slice_request(memory="100Gi"), gpus)
    assert "larger than any GPU" in info.value.reason
    with pytest.raises(Unplaceable) as info:
        choose_fraction(slice_request(memory="70Gi"), [FractionGpu("n", 0, 80 * gib, 20 * gib)])
    assert "held by slices in use" in info.value.reason
    with pytest.raises(Unplaceable) as info:
        choose_fraction(slice_request(profile="1g.10gb"), gpus)
    assert "needs a MIG node" in info.value.reason


# --- properties -------------------------------------------------------------------------------


def _brute_force_fits(gpu: MigGpu, profile_names: list[str]) -> bool:
    """Can any candidate be placed if every idle instance were destroyed?"""
    busy = gpu.busy_mask
    return any(not (pl.mask & busy) for n in profile_names for pl in gpu.model.profile(n).placements)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free"]), st.sampled_from(["1G", "12G", "17Gi", "30G", "60G", "100G", "150G"]),
              st.integers(0, 20)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(sorted(CATALOG)), st.integers(1, 3))
def test_decisions_are_always_legal_and_refusals_justified(events, model_name, count) -> None:
    model = CATALOG[model_name]
    gpus = [MigGpu("", i, model) for i in range(count)]
    held: list[tuple[int, int]] = []
    for op, memory, pick in events:
        if op == "free":
            if held:
                g, start = held.pop(pick % len(held))
                gpus[g] = gpus[g].with_released(start)
            continue
        request = slice_request(memory=memory)
        try:
            d = choose_mig(request, gpus)
        except Unplaceable:
            for g in gpus:
                assert not _brute_force_fits(g, names(model, request)), "refused although room existed"
            continue
        gpu = gpus[d.gpu]
        assert d.profile.memory_mib * 2**20 >= request.memory_bytes
        assert any(pl.start == d.start and pl.size == d.size for pl in d.profile.placements)
        mask = ((1 << d.size) - 1) << d.start
        assert not mask & gpu.busy_mask, "never placed over an instance in use"
        for r in d.reclaim:
            victim = next(i for i in gpu.instances if i.start == r.start)
            assert not victim.in_use, "never reclaims an instance in use"
        after = gpu.with_decision(d)
        occupied = 0
        for i in after.instances:
            assert not occupied & i.mask, "instances never overlap"
            occupied |= i.mask
        gpus[d.gpu] = after
        held.append((d.gpu, d.start))
