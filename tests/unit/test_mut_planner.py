"""core.placement.planner and core.placement.planning_index: what mutation testing found untested (docs/testing.md).

Expected values are worked out by hand from the catalog's numbers and the rule in
docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from planner_reference import reference_candidates, reference_choose_mig

from mig_operator.core.placement.fraction_planner import FractionDecision, FractionGpu, choose_fraction, fraction_bytes
from mig_operator.core.placement.mig_refusals import RoomSummary, no_room_reason
from mig_operator.core.placement.planner import (
    InstanceSlot,
    MigGpu,
    PlannerSettings,
    Reclaim,
    Unplaceable,
    candidate_profiles,
    choose_placement,
    grant_levels,
)
from mig_operator.core.placement.planning_index import IndexStats, PlanningIndex, choose_mig
from mig_operator.core.placement.profiles import CATALOG, GpuModel, Placement, Profile, get_model
from mig_operator.core.requests.request import SliceRequest

MiB = 2**20
GiB = 2**30
H200 = get_model("h200-141gb")
L4_MIB, L40S_MIB = 23034, 46068


def test_choose_placement_names_the_gpu_it_was_given() -> None:
    decision = choose_placement(MigGpu("node-7", 3, H200), H200.profile("7g.141gb"))
    assert (decision.node, decision.gpu, decision.start, decision.size, decision.action) == (
        "node-7", 3, 0, 8, "create")
    full = MigGpu("node-7", 3, H200, (InstanceSlot(0, 0, 8, in_use=True),))
    assert choose_placement(full, H200.profile("1g.18gb")) is None


def test_idle_instances_are_those_not_in_use() -> None:
    idle, busy = InstanceSlot(19, 0, 1, in_use=False), InstanceSlot(19, 1, 1, in_use=True)
    assert MigGpu("n", 0, H200, (idle, busy)).idle_instances() == (idle,)
    assert MigGpu("n", 0, H200).idle_instances() == ()


def test_planning_index_get() -> None:
    held = (InstanceSlot(19, 2, 1, in_use=True),)
    index = PlanningIndex([MigGpu("a", 0, H200, held)])
    assert index.get("a", 0) == MigGpu("a", 0, H200, held)
    assert index.get("a", 0).instances == held
    assert index.get("a", 1) is None  # a known node, an unknown GPU
    assert index.get("b", 0) is None  # an unknown node


def test_planning_index_stats_count_ladders_and_buckets() -> None:
    # An empty H200 can take each of its seven profiles: seven ladders, one bucket each. A full GPU adds
    # a state and nothing else. An idle 7g.141gb adds a state whose keys all differ from the empty
    # GPU's (reuse for 7g.141gb, reclaim for the rest): seven more buckets on the same ladders.
    gpus = [MigGpu("a", 0, H200), MigGpu("a", 1, H200, (InstanceSlot(0, 0, 8, in_use=True),))]
    assert PlanningIndex(gpus).stats() == IndexStats(gpus=2, states=2, ladders=7, buckets=7)
    gpus.append(MigGpu("b", 0, H200, (InstanceSlot(0, 0, 8, in_use=False),)))
    assert PlanningIndex(gpus).stats() == IndexStats(gpus=3, states=3, ladders=7, buckets=14)


def test_fraction_bytes_is_whole_mib_rounded_down() -> None:
    got = fraction_bytes(SliceRequest(fraction=0.3), L4_MIB * MiB)  # 0.3 * 23034 MiB = 6910.2 MiB
    assert got == 6910 * MiB and isinstance(got, int)
    assert fraction_bytes(SliceRequest(memory_bytes=5), L4_MIB * MiB) == 5
    with pytest.raises(Unplaceable, match="^migProfile 1g.18gb needs a MIG node; this node shares GPUs by fractions$"):
        fraction_bytes(SliceRequest(profile="1g.18gb"), L4_MIB * MiB)


def test_choose_fraction_skips_a_gpu_too_small_and_takes_a_later_one() -> None:
    small, large = FractionGpu("a", 0, L4_MIB * MiB), FractionGpu("b", 0, L40S_MIB * MiB)
    assert choose_fraction(SliceRequest(memory_bytes=30 * GiB), [small, large]) == FractionDecision("b", 0, 30 * GiB)


def test_choose_fraction_fits_best_by_what_is_left() -> None:
    # Half of each GPU: the L40S (20000 MiB granted) keeps 46068 - 20000 - 23034 = 3034 MiB, the empty L4
    # 23034 - 11517 = 11517 MiB. Best fit is the L40S, although the L4 would be asked for less.
    busy_l40s = FractionGpu("a", 0, L40S_MIB * MiB, 20000 * MiB)
    empty_l4 = FractionGpu("b", 0, L4_MIB * MiB)
    assert choose_fraction(SliceRequest(fraction=0.5), [empty_l4, busy_l40s]) == FractionDecision(
        "a", 0, 23034 * MiB)


def test_choose_fraction_refusals() -> None:
    with pytest.raises(Unplaceable) as info:
        choose_fraction(SliceRequest(memory_bytes=1), [])
    assert info.value.reason == "no GPU is available for fractions"
    # A whole GPU asked of a GPU that is partly granted: it fits the GPU, not what is free on it.
    partly = FractionGpu("a", 0, L4_MIB * MiB, 1 * MiB)
    with pytest.raises(Unplaceable) as info:
        choose_fraction(SliceRequest(fraction=1.0), [partly])
    assert info.value.reason == f"every GPU is held by slices in use: none has {L4_MIB}Mi free"
    with pytest.raises(Unplaceable) as info:
        choose_fraction(SliceRequest(memory_bytes=L4_MIB * MiB + 1), [FractionGpu("a", 0, L4_MIB * MiB)])
    assert info.value.reason == f"memory {L4_MIB * MiB + 1} is larger than any GPU (largest: {L4_MIB}Mi)"


# --- every layout of one GPU, and many pairs: the three implementations of the rule agree ----------------
# The property tests draw a few hundred random clusters; mutation testing showed changes to the loss
# vector and to the reference that they never told apart. These walk every layout of plain profiles on
# one GPU (in use, idle, or half of each) and a fixed sample of two-GPU clusters, deterministically.


def layouts(model, media: bool = False) -> list[tuple[tuple[int, int, int], ...]]:
    """Every set of disjoint instances of the model's plain profiles (and ``+me``/``-me`` ones if
    ``media``), as (profile id, start, size)."""
    profiles = [p for p in model.profiles if p.placements and (media or not p.media_extension)]
    found: list[tuple[tuple[int, int, int], ...]] = []

    def walk(slot: int, taken: int, chosen: tuple) -> None:
        if slot == model.memory_slots:
            found.append(chosen)
            return
        walk(slot + 1, taken, chosen)
        if taken >> slot & 1:
            return
        for p in profiles:
            for pl in p.placements:
                mask = ((1 << pl.size) - 1) << pl.start
                if pl.start == slot and not mask & taken:
                    walk(slot + 1, taken | mask, (*chosen, (p.id, pl.start, pl.size)))

    walk(0, 0, ())
    return found


def with_use(layout, pattern: int) -> tuple[InstanceSlot, ...]:
    """pattern 0: all in use; 1: all idle; 2: every other one in use."""
    return tuple(InstanceSlot(pid, start, size, in_use=pattern == 0 or (pattern == 2 and n % 2 == 0))
                 for n, (pid, start, size) in enumerate(layout))


REQUESTS = [SliceRequest(memory_bytes=n * GiB) for n in (1, 5, 17, 40, 100)] + [
    SliceRequest(memory_bytes=16384 * MiB), SliceRequest(memory_bytes=16384 * MiB + 1)] + [
    SliceRequest(fraction=f) for f in (0.25, 0.5)] + [
    SliceRequest(profile=p) for p in ("2g.35gb", "1g.10gb", "1g.18gb+me", "2g.12gb+me", "1g.10gb-me")]


STRICT = PlannerSettings(allow_larger_profile=False)


def decide(fn, *args):
    try:
        return fn(*args)
    except Unplaceable:
        return None


# Enough to reach every profile size, both sides of an edge, a fraction and requests by name.
LAYOUT_REQUESTS = [SliceRequest(memory_bytes=n) for n in (GiB, 16384 * MiB + 1, 40 * GiB, 100 * GiB)] + [
    SliceRequest(fraction=0.5), SliceRequest(profile="2g.35gb"), SliceRequest(profile="1g.10gb")]


def agree(gpus: list[MigGpu], strict_too: bool = False, requests=REQUESTS) -> None:
    index = PlanningIndex(gpus)
    for request in requests:
        expected = decide(reference_choose_mig, request, gpus)
        assert decide(choose_mig, request, gpus) == expected, (request, gpus)
        assert decide(index.choose, request) == expected, (request, gpus)
        if strict_too:
            expected = decide(reference_choose_mig, request, gpus, False)  # allow_larger=False
            assert decide(choose_mig, request, gpus, STRICT) == expected, (request, gpus)
            assert decide(index.choose, request, STRICT) == expected, (request, gpus)


def _ones(size: int, starts, pid: int, mib: int, name: str) -> Profile:
    return Profile(name, pid, size, mib, 16 * size, len(starts), tuple(Placement(s, size) for s in starts))


# Boards no catalog holds, but NVML could describe: placements of 3 and 4 slots that count as the same
# share of the GPU; and a profile listed without placements that sorts before a placeable one of its size.
ODD_BOARD = GpuModel("odd", "Board", 8, 81920, (
    _ones(1, range(8), 19, 10240, "1g.10gb"), _ones(3, (0, 3), 9, 30720, "3g.30gb"),
    _ones(4, (0, 4), 5, 40960, "4g.40gb"), _ones(8, (0,), 0, 81920, "8g.80gb")))
# A board whose one-slot profile cannot start at slot 0: slot 0 can be stranded. It also has a "-me"
# variant, which only a request by name gets.
GAP_BOARD = GpuModel("gap", "Board", 8, 81920, (
    _ones(1, range(1, 8), 19, 10240, "1g.10gb"), _ones(1, range(1, 8), 20, 10240, "1g.10gb-me"),
    _ones(2, (0, 2, 4, 6), 14, 20480, "2g.20gb"), _ones(4, (0, 4), 5, 40960, "4g.40gb"),
    _ones(8, (0,), 0, 81920, "8g.80gb")))
# Media-extension variants listed first, with fewer SMs and other placements than their plain profile:
# only a request by name may see them, in the rule's cost too.
MEDIA_FIRST_BOARD = GpuModel("media", "Board", 8, 81920, (
    _ones(1, (0,), 21, 10240, "1g.10gb+me"), _ones(1, (1,), 22, 10240, "1g.10gb-me"),
    _ones(1, range(8), 19, 10240, "1g.10gb"), _ones(2, (0, 2, 4, 6), 14, 20480, "2g.20gb"),
    _ones(4, (0, 4), 5, 40960, "4g.40gb"), _ones(8, (0,), 0, 81920, "8g.80gb")))
SHADOW_BOARD = GpuModel("shadow", "Board", 8, 81920, (
    Profile("1g.10gb-x", 30, 1, 10240, 8, 1, ()), _ones(1, range(7), 19, 10240, "1g.10gb"),
    _ones(2, (0, 2, 4, 6), 14, 20480, "2g.20gb"), _ones(4, (0, 4), 5, 40960, "4g.40gb"),
    _ones(8, (0,), 0, 81920, "7g.80gb")))


@pytest.mark.parametrize("model", [get_model("h200-141gb"), get_model("a30-24gb"), ODD_BOARD, SHADOW_BOARD,
                                   GAP_BOARD, MEDIA_FIRST_BOARD],
                         ids=lambda m: m.name)
def test_every_layout_of_one_gpu(model: GpuModel) -> None:
    patterns = range(3) if model.name in CATALOG or model is ODD_BOARD else (0, 2)
    for layout in layouts(model):
        for pattern in patterns:
            agree([MigGpu("n", 0, model, with_use(layout, pattern))], requests=LAYOUT_REQUESTS)


def test_a_fixed_sample_of_two_gpu_clusters() -> None:
    # Media-extension instances included (a +me instance allows no second one), and the rule with
    # allow_larger_profile=False as well.
    models = [get_model("h200-141gb"), get_model("a100-40gb"), get_model("a30-24gb"), GAP_BOARD]
    rng = random.Random(12)
    pool = {m: layouts(m, media=True) for m in models}
    for _ in range(300):
        first, second = rng.choice(models[:2]), rng.choice(models)
        agree([MigGpu("n", 0, first, with_use(rng.choice(pool[first]), rng.randrange(3))),
               MigGpu("n", 1, second, with_use(rng.choice(pool[second]), rng.randrange(3)))], strict_too=True)


# --- single behaviours the equivalence tests do not pin ---------------------------------------------------


def test_a_released_instance_is_idle_and_a_destroyed_one_gone() -> None:
    gpu = MigGpu("n", 0, H200, (InstanceSlot(19, 0, 1, in_use=True), InstanceSlot(19, 1, 1, in_use=True)))
    assert gpu.with_released(1).instances == (InstanceSlot(19, 0, 1, True), InstanceSlot(19, 1, 1, False))
    assert gpu.with_released(1, destroy=True).instances == (InstanceSlot(19, 0, 1, True),)


def test_a_decision_names_what_it_reclaims() -> None:
    idle = MigGpu("node-2", 5, H200, (InstanceSlot(0, 0, 8, in_use=False),))
    decision = choose_mig(SliceRequest(memory_bytes=GiB), [idle])
    assert decision.reclaim == (Reclaim("node-2", 5, 0, "7g.141gb", 0, 8),)
    assert (decision.node, decision.gpu, decision.action) == ("node-2", 5, "create")


def board(*profiles: Profile, slots: int = 8) -> GpuModel:
    return GpuModel("board", "Board", slots, 81920, profiles)


def test_too_large_names_the_largest_placeable_profile_and_the_request() -> None:
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(memory_bytes=200 * GiB), [MigGpu("n", 0, H200)])
    assert info.value.reason == (
        "memory 200Gi (204800 MiB) is larger than any MIG profile of any GPU (largest: 7g.141gb, 143360 MiB)")
    # A board whose largest profile has no placement, and whose one-slot profile cannot hold a whole GPU.
    small = Profile("1g.10gb", 19, 1, 10240, 16, 8, tuple(Placement(s, 1) for s in range(8)))
    listed = Profile("7g.80gb", 0, 7, 81920, 132, 1, ())
    gpus = [MigGpu("n", 0, board(small, listed))]
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(memory_bytes=20 * GiB), gpus)
    assert info.value.reason.endswith("(largest: 1g.10gb, 10240 MiB)")
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(fraction=1.0), gpus)
    assert info.value.reason == (
        "fraction 1 is larger than any MIG profile of any GPU (largest: 1g.10gb, 10240 MiB)")


def test_the_index_keeps_the_lowest_gpu_of_a_state_as_gpus_come_and_go() -> None:
    index = PlanningIndex([MigGpu("a", i, H200) for i in range(41)])
    whole = SliceRequest(profile="7g.141gb")
    for i in range(40):  # removing the lowest each time, past the point where the heaps are rebuilt
        assert index.choose(whole).gpu == i
        index.remove("a", i)
    index.put(MigGpu("a", 3, H200))
    assert index.choose(whole).gpu == 3


def test_the_index_stays_right_through_many_decisions_and_releases() -> None:
    index = PlanningIndex([MigGpu("a", 0, H200), MigGpu("b", 0, H200)])
    request = SliceRequest(memory_bytes=GiB)
    for _ in range(40):  # the same GPU fills and empties again and again: buckets come and go
        decision = index.choose(request)
        assert (decision.node, decision.gpu) == ("a", 0)
        after = index.apply(decision)
        assert after == MigGpu("a", 0, H200, (InstanceSlot(19, decision.start, 1, in_use=True),))
        released = index.release("a", 0, decision.start, destroy=True)
        assert released == MigGpu("a", 0, H200)
    assert index.release("a", 0, 0) == MigGpu("a", 0, H200)  # nothing there: nothing changes


def test_a_refusal_from_the_index_says_the_most_room_as_choose_mig_does() -> None:
    three_g = InstanceSlot(9, 0, 4, in_use=True)  # a/0: slots 0..3 in use
    ones = (InstanceSlot(19, 2, 1, in_use=True), InstanceSlot(19, 5, 1, in_use=True))  # b/0: two slots in use
    gpus = [MigGpu("a", 0, H200, (three_g,)), MigGpu("b", 0, H200, ones)]
    request = SliceRequest(profile="7g.141gb")
    with pytest.raises(Unplaceable) as indexed:
        PlanningIndex(gpus).choose(request)
    with pytest.raises(Unplaceable) as listed:
        choose_mig(request, gpus)
    assert indexed.value.reason == listed.value.reason
    assert "h200-141gb: 2 GPU(s), 4/8 slots in use on 1 GPU, 2/8 slots in use on 1 GPU" in indexed.value.reason
    assert indexed.value.reason.endswith("most room: 6/8 slots not in use on one GPU")


@pytest.mark.parametrize(("nodes", "message"), [
    (["p", "q", "r", "s", "t", "u"], "no MIG-enabled GPU on node p, q, r, s, t ..."),
    (["q", "p", "r", "s", "t"], "no MIG-enabled GPU on node p, q, r, s, t"),
    ([], "no node given"),
])
def test_pinning_to_nodes_without_gpus(nodes, message: str) -> None:
    with pytest.raises(Unplaceable) as info:
        PlanningIndex([MigGpu("a", 0, H200)]).choose(SliceRequest(memory_bytes=GiB), nodes=nodes)
    assert info.value.reason == message


def test_two_models_with_one_grant_size_are_both_tried() -> None:
    # Two boards with the same profile table offer the same grants; the one whose name sorts first
    # is full, so the other one's 1g.10gb is the answer, not a larger profile.
    h100 = get_model("h100-80gb")
    twin = GpuModel("board-twin", "Board", 8, h100.memory_mib, h100.profiles)
    request = SliceRequest(memory_bytes=GiB)
    for twin_full in (True, False):
        held = (InstanceSlot(0, 0, 8, in_use=True),) if twin_full else ()
        gpus = [MigGpu("a", 0, twin, held), MigGpu("b", 0, h100)]
        expected = reference_choose_mig(request, gpus)
        assert expected.profile.name == "1g.10gb"
        assert choose_mig(request, gpus) == expected
        assert PlanningIndex(gpus).choose(request) == expected


def test_the_index_compacts_a_states_heap_of_departed_gpus() -> None:
    index = PlanningIndex([MigGpu("a", i, H200) for i in range(41)])
    for i in range(40, 4, -1):  # the highest leave: their heap entries go stale below the top
        index.remove("a", i)
    assert index.choose(SliceRequest(profile="7g.141gb")).gpu == 0
    assert [g.index for g in index.gpus()] == [0, 1, 2, 3, 4]


def test_a_lazy_release_through_the_index_leaves_the_instance_idle() -> None:
    index = PlanningIndex([MigGpu("a", 0, H200, (InstanceSlot(19, 4, 1, in_use=True),))])
    assert index.release("a", 0, 4) == MigGpu("a", 0, H200, (InstanceSlot(19, 4, 1, in_use=False),))


def test_the_reference_says_why_it_refuses() -> None:
    with pytest.raises(Unplaceable, match="^no profile covers it$"):
        reference_choose_mig(SliceRequest(memory_bytes=200 * GiB), [MigGpu("n", 0, H200)])
    full = MigGpu("n", 0, H200, (InstanceSlot(0, 0, 8, in_use=True),))
    with pytest.raises(Unplaceable, match="^no GPU can take it$"):
        reference_choose_mig(SliceRequest(memory_bytes=GiB), [full])


def test_a_fraction_on_a_one_slot_board() -> None:
    one = _ones(1, (0,), 0, 10240, "1g.10gb")
    tiny = GpuModel("tiny", "Board", 1, 10240, (one,))
    for fraction in (0.5, 1.0):
        request = SliceRequest(fraction=fraction)
        assert reference_candidates(tiny, request) == candidate_profiles(tiny, request) == [one]


# --- refusal messages, word for word ---------------------------------------------------------------------


def full(node: str, model=H200, index: int = 0) -> MigGpu:
    whole = next(p for p in model.profiles if p.size == model.memory_slots)
    return MigGpu(node, index, model, (InstanceSlot(whole.id, 0, whole.size, in_use=True),))


def refusal(request: SliceRequest, gpus: list[MigGpu]) -> str:
    """The reason choose_mig gives, after checking that the index gives the same."""
    with pytest.raises(Unplaceable) as listed:
        choose_mig(request, gpus)
    with pytest.raises(Unplaceable) as indexed:
        PlanningIndex(gpus).choose(request)
    assert indexed.value.reason == listed.value.reason
    return listed.value.reason


def test_no_room_names_each_model_and_the_most_room() -> None:
    a100 = get_model("a100-40gb")
    reason = refusal(SliceRequest(profile="7g.141gb"), [full("", H200), full("b", a100)])
    assert reason == (
        "every GPU is held by slices in use: no room for profile 7g.141gb even after reclaiming every idle "
        "instance (a100-40gb: 1 GPU(s), 8/8 slots in use on 1 GPU; h200-141gb: 1 GPU(s), 8/8 slots in use on 1 GPU); "
        "most room: 0/8 slots not in use on one GPU")


def test_no_room_counts_gpus_without_mig_and_never_names_one_as_roomiest() -> None:
    a10, l4 = get_model("a10-24gb"), get_model("l4-24gb")
    gpus = [MigGpu("a", 0, a10), full("b"), MigGpu("c", 0, l4)]
    reason = refusal(SliceRequest(memory_bytes=GiB), gpus)
    assert "(a10-24gb: 1 GPU(s) without MIG profiles; h200-141gb: 1 GPU(s), 8/8 slots in use on 1 GPU; " \
           "l4-24gb: 1 GPU(s) without MIG profiles)" in reason
    assert reason.endswith("most room: 0/8 slots not in use on one GPU")


def test_no_room_on_a_one_slot_board() -> None:
    one = _ones(1, (0,), 0, 10240, "1g.10gb")
    tiny = GpuModel("tiny", "Board", 1, 10240, (one,))
    reason = refusal(SliceRequest(memory_bytes=GiB), [MigGpu("a", 0, tiny, (InstanceSlot(0, 0, 1, True),))])
    assert "(tiny: 1 GPU(s), 1/1 slots in use on 1 GPU); most room: 0/1 slots not in use on one GPU" in reason


def boards(count: int) -> list[MigGpu]:
    h100 = get_model("h100-80gb")
    return [full("n", GpuModel(f"b{k}", "Board", 8, h100.memory_mib, h100.profiles), k) for k in range(count)]


def test_at_most_eight_models_are_named() -> None:
    eight = refusal(SliceRequest(memory_bytes=GiB), boards(8))
    assert "b7: 1 GPU(s), 8/8 slots in use on 1 GPU)" in eight and "more models" not in eight
    nine = refusal(SliceRequest(memory_bytes=GiB), boards(9))
    assert "b7: 1 GPU(s), 8/8 slots in use on 1 GPU; and 1 more models)" in nine
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(memory_bytes=500 * GiB), [MigGpu("n", k, g.model) for k, g in enumerate(boards(8))])
    assert "(largest: 7g.80gb, 81152 MiB)" in info.value.reason
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(profile="9g.1gb"), boards(8))
    assert info.value.reason.endswith("(models: b0, b1, b2, b3, b4, b5, b6, b7)")
    with pytest.raises(Unplaceable) as info:
        choose_mig(SliceRequest(profile="9g.1gb"), boards(10))
    assert info.value.reason.endswith("(models: b0, b1, b2, b3, b4, b5, b6, b7 and 2 more)")


def test_at_most_twelve_profiles_are_named() -> None:
    # Thirteen one-slot profiles of growing memory on one board, every slot in use: all are tried.
    many = tuple(_ones(1, range(8), 100 + k, 1024 * (k + 1), f"1g.{k + 1}gb") for k in range(13))
    model = GpuModel("many", "Board", 8, 16384, many)
    busy = tuple(InstanceSlot(100, s, 1, in_use=True) for s in range(8))
    reason = refusal(SliceRequest(memory_bytes=1), [MigGpu("n", 0, model, busy)])
    names = sorted(p.name for p in many)
    assert f"(profiles {', '.join(names[:12])} and 1 more)" in reason
    reason = refusal(SliceRequest(memory_bytes=1024 * MiB + 1), [MigGpu("n", 0, model, busy)])  # 12 of them
    assert f"(profiles {', '.join(sorted(p.name for p in many[1:]))})" in reason


def test_a_refusal_is_cut_to_4096_characters() -> None:
    # Padded by the model's name (a refusal names no node or GPU, so a long node name cannot pad it).
    request = SliceRequest(profile="7g.141gb")

    def named(length: int) -> list[MigGpu]:
        return [full("x", dataclasses.replace(H200, name="m" * length))]

    base = len(refusal(request, named(1))) - 1
    exact = refusal(request, named(4096 - base))
    assert len(exact) == 4096 and exact.endswith("on one GPU")
    whole = exact.replace("m" * (4096 - base), "m" * (4097 - base))  # what it would say uncut: 4097 characters
    assert refusal(request, named(4097 - base)) == whole[:4093] + "..."


def test_no_room_reason_without_a_summary() -> None:
    assert no_room_reason(SliceRequest(memory_bytes=GiB), (), RoomSummary()) == (
        "every GPU is held by slices in use: no room for memory 1Gi (profiles ) even after reclaiming every "
        "idle instance ()")


def test_an_instance_must_lie_inside_the_gpu_and_apart_from_the_others() -> None:
    for instances in [(InstanceSlot(19, 0, 0, True),), (InstanceSlot(19, 0, 1, True), InstanceSlot(19, 2, 1, True),
                                                         InstanceSlot(15, 0, 2, True))]:
        with pytest.raises(ValueError) as info:
            MigGpu("node", 1, H200, instances)
        assert str(info.value).startswith("GPU 1 of node 'node' (h200-141gb, 8 slots): instance of profile id")
        assert str(info.value).endswith(
            "is outside the GPU or overlaps another; instances must be disjoint within the slots, "
            "e.g. InstanceSlot(profile_id=19, start=0, size=1, in_use=True)")


def test_an_idle_instance_of_a_profile_without_placements_is_never_handed_out() -> None:
    listed = Profile("1g.10gb-x", 30, 1, 10240, 8, 1, ())
    model = GpuModel("shadow", "Board", 8, 81920, (listed, *SHADOW_BOARD.profiles[1:]))
    gpu = MigGpu("n", 0, model, (InstanceSlot(30, 7, 1, in_use=False),))
    assert choose_placement(gpu, listed) is None
    # Nor is the GPU filed under that profile in the index: one ladder per placeable profile.
    assert PlanningIndex([gpu]).stats() == IndexStats(gpus=1, states=1, ladders=4, buckets=4)


def test_grant_levels_are_keyed_by_mib_then_slices() -> None:
    levels = grant_levels((H200,), SliceRequest(memory_bytes=GiB), True)
    assert [level.key for level in levels] == [(16384, 1), (33280, 1), (33280, 2), (71424, 3), (71424, 4),
                                               (143360, 7)]
    assert [[p.name for _, p in level.options] for level in levels][:3] == [["1g.18gb"], ["1g.35gb"], ["2g.35gb"]]


def test_the_index_compacts_a_buckets_heap_of_moved_lowest_gpus() -> None:
    index = PlanningIndex([MigGpu("a", i, H200) for i in range(30)])
    for i in range(20):  # the lowest leaves twenty times before anyone reads the bucket
        index.remove("a", i)
    assert index.choose(SliceRequest(profile="7g.141gb")).gpu == 20


def test_allow_larger_profile_in_all_three() -> None:
    # The smaller profile allows one instance, which is in use: only the larger one can take 10Gi.
    small = _ones(1, range(4), 19, 20480, "1g.20gb")
    small = Profile(small.name, small.id, small.slices, small.memory_mib, small.sm, 1, small.placements)
    large = _ones(2, (0, 2), 14, 40960, "2g.40gb")
    gpus = [MigGpu("n", 0, GpuModel("limit", "Board", 4, 81920, (small, large)), (InstanceSlot(19, 0, 1, True),))]
    request = SliceRequest(memory_bytes=10 * GiB)
    got = reference_choose_mig(request, gpus)
    assert (got.profile.name, got.start) == ("2g.40gb", 2)
    assert choose_mig(request, gpus) == PlanningIndex(gpus).choose(request) == got
    for refuse in (lambda: reference_choose_mig(request, gpus, False), lambda: choose_mig(request, gpus, STRICT),
                   lambda: PlanningIndex(gpus).choose(request, STRICT)):
        with pytest.raises(Unplaceable):
            refuse()
