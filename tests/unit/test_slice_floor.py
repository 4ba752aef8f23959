"""The floor of a slice (issue 19 item 1): no fraction is placed where its grant is under 1 GiB.

Every figure is computed here by hand from the rule "a fraction's grant is share x GPU memory,
rounded down to a whole MiB" and the 1 GiB floor, not taken from the code under test.
"""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.placement.cluster import MODE_FRACTION, Binding, GpuState, NodeInventory, Refusal
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.requests.request import SliceRequest, slice_request

MIB = 2**20


def board(index: int, memory_mib: int) -> GpuState:
    return GpuState(index, f"GPU-{index}", "Board", "", memory_mib, False, False)


def planner_with(*gpus_mib: int) -> ClusterPlanner:
    planner = ClusterPlanner()
    planner.set_inventory(NodeInventory("a", tuple(board(i, mib) for i, mib in enumerate(gpus_mib))))
    return planner


@pytest.mark.parametrize(
    ("memory_mib", "placed"),
    [
        (2048, True),   # 0.5 x 2048 MiB = 1024 MiB: exactly the floor
        (2049, True),   # 1024.5 MiB, rounded down to 1024
        (2047, False),  # 1023.5 MiB, rounded down to 1023: one MiB under
        (2046, False),  # 1023 MiB
    ],
)
def test_a_half_is_placed_only_where_it_comes_to_a_gibibyte(memory_mib: int, placed: bool) -> None:
    planner = planner_with(memory_mib)
    request = slice_request(fraction=0.5)
    if placed:
        assert planner.plan(request) == Binding("", "a", 0, MODE_FRACTION, 1024 * MIB)
    else:
        with pytest.raises(Refusal) as refused:
            planner.plan(request)
        assert refused.value.code == "TooSmall"
        assert "below the smallest slice, 1Gi" in refused.value.message
        assert f"0.5 comes to 1023Mi even on the largest GPU ({memory_mib}Mi)" in refused.value.message


def test_a_small_gpu_is_skipped_for_a_larger_one_even_when_it_fits_best() -> None:
    # A T4 (15360 MiB) and an L40S (46068 MiB), both empty. 0.05 of the T4 is 768 MiB: under the
    # floor, so the L40S takes it (0.05 x 46068 = 2303.4 -> 2303 MiB) although best fit alone would
    # prefer the T4 (less free memory left over).
    planner = planner_with(15360, 46068)
    assert planner.plan(slice_request(fraction=0.05)) == Binding("", "a", 1, MODE_FRACTION, 2303 * MIB)
    # The same through the unindexed rule.
    view = build_view([NodeInventory("a", (board(0, 15360), board(1, 46068)))], set(), [])
    assert plan_binding(slice_request(fraction=0.05), view).gpu == 1


def test_with_only_small_gpus_a_small_fraction_waits_with_the_floor_named() -> None:
    planner = planner_with(15360)
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(fraction=0.05))
    assert refused.value.code == "TooSmall"
    assert refused.value.message == (
        "fraction 0.05 fits nowhere in the cluster: fractions: fraction 0.05 comes to 768Mi even on the "
        "largest GPU (15Gi), below the smallest slice, 1Gi"
    )


def test_the_floor_never_applies_to_memory_requests_in_the_planner() -> None:
    # Admission refuses memory under 1 GiB; the planner (and `plan` traces) place any size.
    planner = planner_with(15360)
    assert planner.plan(SliceRequest(memory_bytes=MIB)) == Binding("", "a", 0, MODE_FRACTION, MIB)


def test_a_full_gpu_still_says_full_not_too_small() -> None:
    planner = planner_with(4096)
    planner.put_binding(Binding("x", "a", 0, MODE_FRACTION, 3584 * MIB))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(fraction=0.5))  # 2048 MiB: above the floor, but 512 MiB are free
    assert refused.value.code == "NoCapacity"
    assert "none has 2Gi free" in refused.value.message
