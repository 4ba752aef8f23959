"""The planner's rules, each checked against numbers written here or computed here from the catalog,
never against the planner's own helpers (issue 12)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.placement.fraction_planner import FractionGpu, choose_fraction
from mig_operator.core.placement.mig_refusals import STATUS_MESSAGE_LIMIT
from mig_operator.core.placement.planner import (
    InstanceSlot,
    MigGpu,
    PlannerSettings,
    Unplaceable,
    candidate_profiles,
    capacity_score,
    choose_placement,
)
from mig_operator.core.placement.planning_index import PlanningIndex, choose_mig
from mig_operator.core.placement.profiles import CATALOG, GpuModel, Placement, Profile, get_model
from mig_operator.core.requests.request import slice_request

H200 = get_model("h200-141gb")
H100 = get_model("h100-80gb")
A100_40 = get_model("a100-40gb")
A30 = get_model("a30-24gb")
MIB = 2**20
MIG_MODELS = sorted(name for name, model in CATALOG.items() if model.profiles)
# A board without MIG (L4-like), built here so the test does not depend on the catalog listing one.
NO_MIG = GpuModel("no-mig-24gb", "NVIDIA L4", 0, 23034, ())


def inst(model, name: str, start: int, in_use: bool = True) -> InstanceSlot:
    p = model.profile(name)
    return InstanceSlot(p.id, start, p.size, in_use)


def names(model, request) -> list[str]:
    return [p.name for p in candidate_profiles(model, request)]


def is_plain(p: Profile) -> bool:
    return "+" not in p.name and "-me" not in p.name


def smallest_by_catalog(model: GpuModel, num_bytes: int) -> Profile | None:
    """DESIGN's rule computed here: NVML MiB must cover every byte; then fewer slices, fewer SMs."""
    fitting = [p for p in model.profiles if is_plain(p) and p.placements and p.memory_mib * MIB >= num_bytes]
    return min(fitting, key=lambda p: (p.memory_mib, p.slices, p.sm), default=None)


# --- smallest profile -------------------------------------------------------------------------


def test_memory_is_nvml_mib_not_the_name() -> None:
    assert names(H200, slice_request(memory="17G"))[0] == "1g.18gb"  # 16213 MiB <= 16384
    assert names(H200, slice_request(memory="17Gi"))[0] == "1g.35gb"  # 17408 MiB > 16384
    assert names(H200, slice_request(memory="16Gi"))[0] == "1g.18gb"  # exactly 16384 MiB
    assert names(H200, slice_request(memory=16 * 2**30 + 1))[0] == "1g.35gb"  # one byte more


def _edge_requests(mib: int, name_gb: int) -> list[tuple[str | int, int]]:
    """(request as written, bytes) around a profile's edge ``mib`` MiB, in bytes, decimal and binary units."""
    edge = mib * MIB
    out: list[tuple[str | int, int]] = []
    for delta in (-1, 0, 1):
        b = edge + delta
        out.append((b, b))  # a plain integer is bytes
        out.append((str(b), b))
        out.append((f"{b // 10**9}.{b % 10**9:09d}G", b))  # decimal unit, exact to the byte
    out.append((f"{mib}Mi", edge))
    out.append((f"{mib}MiB", edge))
    out.append((f"{mib * 1024 - 1}Ki", edge - 1024))
    out.append((f"{mib * 1024 + 1}Ki", edge + 1024))
    if mib % 1024 == 0:
        out.append((f"{mib // 1024}Gi", edge))
    # The number in the profile's name, read as the user would (18G and 18Gi for 1g.18gb).
    out.append((f"{name_gb}G", name_gb * 10**9))
    out.append((f"{name_gb}GB", name_gb * 10**9))
    out.append((f"{name_gb}Gi", name_gb * 2**30))
    return out


@pytest.mark.parametrize("model_name", MIG_MODELS)
def test_every_profile_edge_gets_the_smallest_profile_that_covers_it(model_name: str) -> None:
    """One byte below, at and above every profile's NVML size, in bytes, decimal and binary units:
    the grant is the smallest profile that holds every byte, computed here from the catalog."""
    model = CATALOG[model_name]
    checked = 0
    for profile in (p for p in model.profiles if is_plain(p)):
        name_gb = int(profile.name.split(".")[1].removesuffix("gb").split("+")[0])
        for written, num_bytes in _edge_requests(profile.memory_mib, name_gb):
            request = slice_request(memory=written)
            assert request.memory_bytes == num_bytes, written
            expected = smallest_by_catalog(model, num_bytes)
            got = candidate_profiles(model, request)
            if expected is None:
                assert got == [], written
                with pytest.raises(Unplaceable, match="larger than any MIG profile"):
                    choose_mig(request, [MigGpu("", 0, model)])
                continue
            assert got[0] == expected, f"{written!r} on {model_name}"
            decision = choose_mig(request, [MigGpu("", 0, model)])
            assert decision.profile == expected, f"{written!r} on {model_name}"
            assert decision.profile.memory_mib * MIB >= num_bytes, "never less than asked"
            assert PlanningIndex([MigGpu("", 0, model)]).choose(request) == decision
            checked += 1
    assert checked >= 30


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


# --- across GPU models (issue 7) --------------------------------------------------------------


def test_smallest_grant_wins_across_models() -> None:
    # 4Gi (4096 MiB): an A100-40GB 1g.5gb (4864 MiB) before an H200 1g.18gb (16384 MiB), whatever
    # the order of the GPUs.
    gpus = [MigGpu("h", 0, H200), MigGpu("a", 0, A100_40)]
    for order in (gpus, gpus[::-1]):
        d = choose_mig(slice_request(memory="4Gi"), order)
        assert (d.node, d.profile.name, d.profile.memory_mib) == ("a", "1g.5gb", 4864)
        assert PlanningIndex(order).choose(slice_request(memory="4Gi")) == d


def test_tiers_apply_within_one_grant_size() -> None:
    # The A100 is full of idle 1g.5gb but for one slice in use: reclaiming one of them for the smaller
    # grant beats reusing an idle H200 1g.18gb (a larger grant).
    a100 = MigGpu("a", 0, A100_40, tuple(inst(A100_40, "1g.5gb", s, in_use=(s == 0)) for s in range(7)))
    h200 = MigGpu("h", 0, H200, (inst(H200, "1g.18gb", 0, in_use=False),))
    d = choose_mig(slice_request(memory="4Gi"), [h200, a100])
    assert (d.node, d.profile.name, d.action) == ("a", "1g.5gb", "reuse")
    # With every A100 slot in use, the next grant size, on the H200, is taken.
    full = MigGpu("a", 0, A100_40, (inst(A100_40, "7g.40gb", 0),))
    d = choose_mig(slice_request(memory="4Gi"), [h200, full])
    assert (d.node, d.profile.name, d.action, d.start) == ("h", "1g.18gb", "reuse", 0)


def test_without_larger_profiles_each_model_still_offers_its_smallest() -> None:
    full = MigGpu("a", 0, A100_40, (inst(A100_40, "7g.40gb", 0),))
    off = PlannerSettings(allow_larger_profile=False)
    d = choose_mig(slice_request(memory="4Gi"), [MigGpu("h", 0, H200), full], off)
    assert (d.node, d.profile.name) == ("h", "1g.18gb")


def test_a_gpu_without_mig_is_never_chosen() -> None:
    gpus = [MigGpu("l4", 0, NO_MIG), MigGpu("h", 0, H200)]
    assert choose_mig(slice_request(memory="1G"), gpus).node == "h"
    assert PlanningIndex(gpus).choose(slice_request(memory="1G")).node == "h"
    for chooser in (lambda r: choose_mig(r, gpus[:1]), PlanningIndex(gpus[:1]).choose):
        with pytest.raises(Unplaceable, match="no GPU here offers a MIG profile .*no-mig-24gb"):
            chooser(slice_request(memory="1G"))
        with pytest.raises(Unplaceable, match="does not exist"):
            chooser(slice_request(profile="1g.18gb"))
        with pytest.raises(Unplaceable, match="no GPU here offers a MIG profile"):
            chooser(slice_request(fraction=0.5))


# A board whose smallest profile NVML lists without a legal placement.
NO_PLACE = GpuModel(
    "no-place", "Odd GPU", 4, 4096,
    (
        Profile("1g.1gb", 1, 1, 1024, 10, 4, ()),
        Profile("2g.2gb", 2, 2, 2048, 20, 2, (Placement(0, 2), Placement(2, 2))),
    ),
)


def test_a_profile_without_placements_is_never_chosen_and_never_crashes() -> None:
    gpu = MigGpu("", 0, NO_PLACE)
    assert names(NO_PLACE, slice_request(memory="512Mi")) == ["2g.2gb"]
    assert choose_mig(slice_request(memory="512Mi"), [gpu]).profile.name == "2g.2gb"
    assert choose_mig(slice_request(fraction=0.25), [gpu]).profile.name == "2g.2gb"
    assert choose_placement(gpu, NO_PLACE.profile("1g.1gb")) is None
    with pytest.raises(Unplaceable, match="does not exist with a legal placement"):
        choose_mig(slice_request(profile="1g.1gb"), [gpu])
    assert capacity_score(NO_PLACE, 0) == (0, 2)  # two free 2-slot placements, nothing stranded


def test_an_impossible_layout_is_refused_with_the_gpu_named() -> None:
    with pytest.raises(ValueError, match=r"GPU 2 of node 'n1' \(h200-141gb, 8 slots\): instance of profile id 19 "
                                         r"at slots 7\.\.7 .*overlaps another.*e\.g\. InstanceSlot"):
        MigGpu("n1", 2, H200, (inst(H200, "1g.35gb", 6), inst(H200, "1g.18gb", 7)))
    with pytest.raises(ValueError, match="outside the GPU"):
        MigGpu("n1", 2, A30, (InstanceSlot(0, 0, 8, True),))
    with pytest.raises(ValueError, match="no-mig-24gb, 0 slots"):
        MigGpu("n1", 0, NO_MIG, (InstanceSlot(19, 0, 1, True),))


# --- placement on one GPU ---------------------------------------------------------------------


def test_small_instances_strand_no_slot_and_keep_a_half_free() -> None:
    gpu = MigGpu("", 0, H200)
    for _ in range(3):
        d = choose_placement(gpu, H200.profile("1g.18gb"))
        assert d is not None and d.action == "create"
        gpu = gpu.with_decision(d)
    assert capacity_score(H200, gpu.occupied_mask)[0] == 0, "no free slot is left unusable"
    # A 3g still fits in the other half: the DRA #933 layout {1g@0, 1g@1, 1g@5} never happens.
    assert [i.start for i in gpu.instances] == [0, 1, 2]
    assert choose_placement(gpu, H200.profile("3g.71gb")).start == 4


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
    assert (d.start, [r.start for r in d.reclaim]) == (0, [0, 1])


def test_never_reclaims_an_instance_in_use() -> None:
    instances = (inst(H200, "4g.71gb", 0), inst(H200, "3g.71gb", 4))
    assert choose_placement(MigGpu("", 0, H200, instances), H200.profile("1g.18gb")) is None


def test_refused_when_only_busy_instances_block() -> None:
    gpu = MigGpu("n1", 0, H200, (inst(H200, "1g.18gb", 0), inst(H200, "1g.18gb", 2), inst(H200, "1g.18gb", 4),
                                  inst(H200, "1g.18gb", 6)))
    # Free slots 1, 3, 5, 7: no aligned pair is free, so neither 1g.35gb nor anything larger fits.
    with pytest.raises(Unplaceable) as info:
        choose_mig(slice_request(memory="17Gi"), [gpu])
    assert info.value.reason == (
        "every GPU is held by slices in use: no room for memory 17Gi (profiles 1g.35gb, 2g.35gb, 3g.71gb, "
        "4g.71gb, 7g.141gb) even after reclaiming every idle instance (h200-141gb: 1 GPU(s), 4/8 slots in use "
        "on 1 GPU); most room: 4/8 slots not in use on one GPU"
    )


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


# --- many GPUs: best fit ----------------------------------------------------------------------


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


def test_best_fit_takes_the_fullest_gpu_among_equal_costs() -> None:
    # GPUs 0 and 1 can take a 1g by completing a half-used pair (it costs one 1g spot, nothing larger):
    # GPU 1 has more slots in use and wins. GPU 2 is fuller than GPU 0 but would break a free pair.
    gpus = [
        MigGpu("", 0, H100, (inst(H100, "3g.40gb", 4), inst(H100, "1g.10gb", 0))),  # 5 in use
        MigGpu("", 1, H100, (inst(H100, "3g.40gb", 4),) + tuple(inst(H100, "1g.10gb", s) for s in range(3))),  # 7
        MigGpu("", 2, H100, (inst(H100, "3g.40gb", 4), inst(H100, "1g.20gb", 0))),  # 6, pair 2-3 free
        MigGpu("", 3, H100),
    ]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.gpu, d.start) == (1, 3)
    d = choose_mig(slice_request(memory="5G"), [gpus[0], gpus[2], gpus[3]])
    assert (d.gpu, d.start) == (0, 1), "completing a pair beats breaking one on a fuller GPU"


def test_keeping_the_place_of_a_larger_profile_beats_packing_tighter() -> None:
    # GPU 0 has more slots in use, but a 1g there breaks its free half (the last place a 3g fits);
    # on GPU 1 both halves are broken already, so the 1g costs nothing larger.
    gpus = [
        MigGpu("", 0, H100, tuple(inst(H100, "1g.10gb", s) for s in range(4))),  # 4 in use, half free
        MigGpu("", 1, H100, (inst(H100, "1g.10gb", 0), inst(H100, "1g.10gb", 4))),  # 2 in use
    ]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert d.gpu == 1
    after = [gpus[0], gpus[1].with_decision(d)]
    assert choose_mig(slice_request(memory="35G"), after).gpu == 0, "the 3g still has its place"


def test_reuse_on_an_empty_gpu_loses_to_a_gpu_in_use() -> None:
    # GPU 1 holds only an idle 1g. Reusing it would break the last whole GPU (the trap where lazy reuse
    # lost to first-fit); a create on GPU 0, already in use, costs one NVML call and keeps it.
    gpus = [MigGpu("", 0, H100, (inst(H100, "3g.40gb", 4),)), MigGpu("", 1, H100, (inst(H100, "1g.10gb", 3, False),))]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.gpu, d.action) == (0, "create")
    assert choose_mig(slice_request(profile="7g.80gb"), [gpus[0].with_decision(d), gpus[1]]).gpu == 1


def test_reuse_beats_creating_on_equally_packed_gpus() -> None:
    gpus = [MigGpu("", 0, H100), MigGpu("", 1, H100, (inst(H100, "1g.10gb", 3, in_use=False),))]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.gpu, d.action, d.start) == (1, "reuse", 3)


def test_ties_go_to_the_lowest_node_then_index() -> None:
    gpus = [MigGpu("b", 0, H100), MigGpu("a", 1, H100), MigGpu("a", 0, H100)]
    d = choose_mig(slice_request(memory="5G"), gpus)
    assert (d.node, d.gpu) == ("a", 0)


def test_no_gpus() -> None:
    with pytest.raises(Unplaceable):
        choose_mig(slice_request(memory="1G"), [])


# --- refusals at scale ------------------------------------------------------------------------


def test_a_refusal_fits_a_status_message_on_16384_gpus() -> None:
    models = [H200, H100, A100_40, A30] + [
        GpuModel(f"board-{k:02d}-with-a-long-name", "Board", 8, 81920, H100.profiles) for k in range(20)
    ]
    gpus = []
    for i in range(16384):
        model = models[i % len(models)]
        whole = next(p for p in model.profiles if p.size == model.memory_slots)
        gpus.append(MigGpu(f"node-{i // 8:05d}.a-rather-long-cluster-domain.example", i % 8, model,
                           (InstanceSlot(whole.id, 0, whole.size, True),)))
    request = slice_request(memory="1G")
    with pytest.raises(Unplaceable) as info:
        choose_mig(request, gpus)
    reason = info.value.reason
    assert len(reason) <= STATUS_MESSAGE_LIMIT
    per_model = 16384 // len(models)
    assert f"a100-40gb: {per_model + 1} GPU(s), 8/8 slots in use on {per_model + 1} GPUs" in reason
    assert "and 16 more models" in reason  # counted, not listed
    assert "node-00001" not in reason, "no per-GPU list"
    with pytest.raises(Unplaceable) as indexed:
        PlanningIndex(gpus).choose(request)
    assert indexed.value.reason == reason


def test_a_refusal_says_the_most_room_without_naming_the_gpu() -> None:
    gpus = [
        MigGpu("n2", 0, H200, tuple(inst(H200, "1g.18gb", s) for s in (0, 2, 4, 6))),  # 4 free, no pair
        MigGpu("n1", 3, H200, tuple(inst(H200, "1g.18gb", s) for s in (0, 2, 4, 6))),
        MigGpu("n1", 1, H200, (inst(H200, "7g.141gb", 0),)),
    ]
    with pytest.raises(Unplaceable) as info:
        choose_mig(slice_request(memory="17Gi"), gpus)
    assert "8/8 slots in use on 1 GPU, 4/8 slots in use on 2 GPUs" in info.value.reason
    assert info.value.reason.endswith("most room: 4/8 slots not in use on one GPU")


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


def _edges() -> list[int]:
    """Byte counts one below, at and one above every MIG profile's NVML size in the catalog."""
    sizes = {p.memory_mib * MIB for name in MIG_MODELS for p in CATALOG[name].profiles}
    return sorted({s + d for s in sizes for d in (-1, 0, 1)})


def _placeable(gpu: MigGpu, profile: Profile) -> bool:
    """Could ``profile`` go on ``gpu`` if every idle instance were destroyed? From masks, here."""
    busy = 0
    for i in gpu.instances:
        if i.in_use:
            busy |= ((1 << i.size) - 1) << i.start
    same_in_use = sum(1 for i in gpu.instances if i.in_use and i.profile_id == profile.id)
    return same_in_use < profile.max_instances and any(
        not (((1 << pl.size) - 1) << pl.start) & busy for pl in profile.placements)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free"]), st.sampled_from(_edges()), st.integers(0, 40),
              st.booleans()),
    max_size=30,
)


@settings(max_examples=120, deadline=None)
@given(ops, st.lists(st.sampled_from(MIG_MODELS), min_size=1, max_size=4))
def test_decisions_are_legal_smallest_and_refusals_justified(events, pool) -> None:
    gpus = [MigGpu("", i, CATALOG[name]) for i, name in enumerate(pool)]
    held: list[tuple[int, int]] = []
    for op, num_bytes, pick, destroy in events:
        if op == "free":
            if held:
                g, start = held.pop(pick % len(held))
                gpus[g] = gpus[g].with_released(start, destroy=destroy)
            continue
        request = slice_request(memory=num_bytes)
        covering = [(g, p) for g in gpus for p in g.model.profiles
                    if is_plain(p) and p.placements and p.memory_mib * MIB >= num_bytes]
        try:
            d = choose_mig(request, gpus)
        except Unplaceable:
            assert not any(_placeable(g, p) for g, p in covering), "refused although room existed"
            continue
        gpu = gpus[d.gpu]
        assert d.profile.memory_mib * MIB >= num_bytes, "never less memory than asked"
        # The smallest grant any GPU could take (by reclaiming if need be) is the one given.
        smallest = min((p.memory_mib, p.slices) for g, p in covering if _placeable(g, p))
        assert (d.profile.memory_mib, d.profile.slices) == smallest
        assert any(pl.start == d.start and pl.size == d.size for pl in d.profile.placements)
        mask = ((1 << d.size) - 1) << d.start
        assert not mask & gpu.busy_mask, "never placed over an instance in use"
        for r in d.reclaim:
            victim = next(i for i in gpu.instances if i.start == r.start)
            assert not victim.in_use, "never reclaims an instance in use"
            assert victim.mask & mask, "reclaims only what is in the way"
        if d.action == "reuse":
            assert any(not i.in_use and i.start == d.start and i.profile_id == d.profile.id for i in gpu.instances)
        after = gpu.with_decision(d)
        occupied = 0
        for i in after.instances:
            assert not occupied & i.mask, "instances never overlap"
            occupied |= i.mask
        gpus[d.gpu] = after
        held.append((d.gpu, d.start))
