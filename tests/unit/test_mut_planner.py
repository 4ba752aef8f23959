"""core.planner and core.planning_index: what mutation testing found untested (docs/testing.md).

Expected values are worked out by hand from the catalog's numbers and the rule in
docs/architecture.md.
"""

from __future__ import annotations

import pytest

from mig_operator.core.planner import (
    FractionDecision,
    FractionGpu,
    InstanceSlot,
    MigGpu,
    Unplaceable,
    choose_fraction,
    choose_placement,
    fraction_bytes,
)
from mig_operator.core.planning_index import IndexStats, PlanningIndex
from mig_operator.core.profiles import get_model
from mig_operator.core.request import SliceRequest

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
