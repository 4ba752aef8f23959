"""Placement by compute: the shares on one fraction GPU sum to at most 1, compared exactly; a GPU serves
compute shares (MPS) or shared fractions, not both; a request with compute goes to fraction GPUs only;
the proportional default; and the refusals' words.

Every expected sum is worked out here with ``decimal.Decimal`` from the shares as written, never with
the code under test's arithmetic.
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    NO_CAPACITY,
    NO_GPU,
    Binding,
    FractionState,
    GpuState,
    NodeInventory,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.compute import (
    PROPORTIONAL,
    SHARED,
    exact,
    format_exact,
    gpu_compute,
    parse_compute,
    proportional,
)
from mig_operator.core.placement.fraction_compute import COMPUTE_MODE
from mig_operator.core.placement.planner import PlannerSettings
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.request import SliceRequest

GIB = 2**30
H100_MIB = 81559  # an H100 80GB's memory as NVML reports it
PROPORTIONAL_SETTINGS = PlannerSettings(default_compute=PROPORTIONAL)


def fraction_gpu(index: int, fractions: tuple[FractionState, ...] = ()) -> GpuState:
    return GpuState(index, f"GPU-{index}", "NVIDIA H100 80GB HBM3", memory_mib=H100_MIB, mig_capable=True,
                    fractions=fractions)


def planner(*nodes: NodeInventory, labelled: tuple[str, ...] = ()) -> ClusterPlanner:
    cp = ClusterPlanner()
    for inv in nodes:
        cp.set_inventory(inv)
    for node in labelled:
        cp.set_labelled(node, True)
    return cp


def one_gpu(count: int = 1) -> ClusterPlanner:
    return planner(NodeInventory("node-a", tuple(fraction_gpu(i) for i in range(count))))


def place(cp: ClusterPlanner, uid: str, request: SliceRequest, settings: PlannerSettings | None = None,
          namespace: str = "team-a") -> Binding:
    binding = replace(cp.plan(request, settings=settings, namespace=namespace), uid=uid)
    cp.put_binding(binding)
    return binding


def refused(cp: ClusterPlanner, request: SliceRequest, settings: PlannerSettings | None = None) -> Refusal:
    with pytest.raises(Refusal) as info:
        cp.plan(request, settings=settings, namespace="team-a")
    return info.value


def asking(compute: float, memory: int = 4 * GIB) -> SliceRequest:
    return SliceRequest(memory_bytes=memory, compute=compute)


# --- the value ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1", "1.0", "0.25", ".5", "0.0001", "0.3333333333333333"])
def test_shares_in_range_are_accepted_as_written(text: str) -> None:
    assert Decimal(repr(parse_compute(text))) == Decimal(text)


@pytest.mark.parametrize("text", ["0", "0.0", "1.0000001", "1.0000000000000000001", "-0.5", "2", "1e-1", "x", ""])
def test_shares_out_of_range_or_not_decimals_are_refused_naming_the_value(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_compute(text)
    assert f"compute {text!r}" in str(info.value) and "'0.25'" in str(info.value)  # a valid one


# --- sums ------------------------------------------------------------------------------------------


def test_two_halves_fill_a_gpu_and_a_third_share_goes_to_the_next() -> None:
    cp = one_gpu(2)
    assert [place(cp, u, asking(0.5)).gpu for u in ("a", "b")] == [0, 0]  # best fit: the same GPU
    assert place(cp, "c", asking(0.5)).gpu == 1


def test_a_full_gpu_refuses_even_the_smallest_share_saying_what_is_left() -> None:
    cp = one_gpu()
    place(cp, "a", asking(0.5))
    place(cp, "b", asking(0.5))
    refusal = refused(cp, asking(0.0001))
    assert refusal.code == NO_CAPACITY
    # The same words go to every namespace: the GPU, held, is not named.
    assert "one GPU has" in refusal.message and "compute 0 of 1 left, not 0.0001" in refusal.message
    assert "node-a" not in refusal.message


@pytest.mark.parametrize("shares", [("0.34", "0.56", "0.1"), ("0.33", "0.56", "0.11"), ("0.1",) * 10,
                                    ("0.3333333333333333", "0.3333333333333333", "0.3333333333333334")])
def test_shares_summing_exactly_to_one_all_fit_though_their_floats_do_not_add_up_to_one(shares) -> None:
    assert sum(Decimal(s) for s in shares) == 1
    cp = one_gpu()
    for i, share in enumerate(shares):
        place(cp, f"s{i}", asking(float(share), memory=GIB))
    assert refused(cp, asking(0.0001, memory=GIB)).code == NO_CAPACITY


def test_three_thirds_leave_a_ten_quadrillionth() -> None:
    third = "0.3333333333333333"  # 1/3 as a float writes itself
    cp = one_gpu()
    for u in "abc":
        place(cp, u, asking(float(third)))
    left = 1 - 3 * Decimal(third)
    assert left == Decimal("1e-16")
    assert "compute 0.0000000000000001 of 1 left, not 0.0001" in refused(cp, asking(0.0001)).message
    place(cp, "d", asking(float(left)))  # exactly what is left fits
    assert refused(cp, asking(1e-16)).code == NO_CAPACITY


def test_a_share_over_what_is_left_is_refused_by_a_hair() -> None:
    cp = one_gpu()
    place(cp, "a", asking(0.66))
    place(cp, "b", asking(0.33))
    assert refused(cp, asking(0.0100001)).code == NO_CAPACITY  # 0.99 + 0.0100001 = 1.0000001
    assert place(cp, "c", asking(0.01)).gpu == 0


def test_format_exact_writes_sums_in_plain_decimal() -> None:
    assert format_exact(exact(0.34) + exact(0.56)) == "0.9"
    assert format_exact(exact(0.5) + exact(0.5)) == "1"
    assert format_exact(exact(1e-7)) == "0.0000001"


# --- one kind per GPU -----------------------------------------------------------------------------


def test_a_shared_fraction_does_not_join_a_gpu_serving_shares() -> None:
    cp = one_gpu()
    place(cp, "a", asking(0.25))
    refusal = refused(cp, SliceRequest(memory_bytes=4 * GIB))
    assert refusal.code == COMPUTE_MODE
    assert "GPU 0 of node node-a" in refusal.message and "serves compute shares through MPS (0.25 of 1" in (
        refusal.message)


def test_a_share_does_not_join_a_gpu_serving_shared_fractions() -> None:
    cp = one_gpu()
    place(cp, "a", SliceRequest(fraction=0.25))
    refusal = refused(cp, asking(0.5))
    assert refusal.code == COMPUTE_MODE
    assert "GPU 0 of node node-a" in refusal.message and "serves 1 shared fraction(s)" in refusal.message


def test_each_kind_takes_its_own_gpu_when_there_are_two() -> None:
    cp = one_gpu(2)
    first = place(cp, "a", asking(0.25))
    second = place(cp, "b", SliceRequest(memory_bytes=4 * GIB))
    assert first.compute == 0.25 and second.compute is None and first.gpu != second.gpu
    assert place(cp, "c", asking(0.25)).gpu == first.gpu
    assert place(cp, "d", SliceRequest(fraction=0.25)).gpu == second.gpu


def test_a_gpu_is_free_for_either_kind_once_its_last_fraction_goes() -> None:
    cp = one_gpu()
    place(cp, "a", asking(1.0))
    cp.drop_binding("a")
    assert place(cp, "b", SliceRequest(fraction=0.5)).compute is None


def test_what_an_agent_still_holds_counts_as_a_binding_does() -> None:
    held = (FractionState("gone", "team-a/gone", 4 * GIB, 0.75),)
    cp = planner(NodeInventory("node-a", (fraction_gpu(0, held),)))
    assert "compute 0.25 of 1 left, not 0.5" in refused(cp, asking(0.5)).message
    assert refused(cp, SliceRequest(fraction=0.1)).code == COMPUTE_MODE
    assert place(cp, "b", asking(0.25)).gpu == 0


def test_the_gpunode_fraction_compute_is_read_back() -> None:
    status = {"gpus": [{"index": 0, "uuid": "GPU-0", "memoryMiB": H100_MIB, "fractions": [
        {"slice": "a/x", "sliceUID": "x", "bytes": GIB, "compute": 0.75},
        {"slice": "a/y", "sliceUID": "y", "bytes": GIB},
        {"slice": "a/z", "sliceUID": "z", "bytes": GIB, "compute": 3}]}]}
    fractions = inventory_from_status("n", status).gpus[0].fractions
    assert [f.compute for f in fractions] == [0.75, None, None]  # out of range: not a share


# --- fractions only --------------------------------------------------------------------------------


def mig_node() -> NodeInventory:
    model = get_model("h100-80gb")
    return NodeInventory("mig-a", (GpuState(0, "GPU-M", model.product, model.name, model.memory_mib, True, True,
                                            model.profiles),))


def test_a_request_with_compute_goes_to_a_fraction_gpu_though_a_mig_gpu_has_room() -> None:
    cp = planner(mig_node(), NodeInventory("plain", (fraction_gpu(0),)), labelled=("mig-a",))
    assert place(cp, "a", SliceRequest(memory_bytes=4 * GIB)).node == "mig-a"  # without: MIG first
    with_share = place(cp, "b", asking(0.5))
    assert (with_share.node, with_share.mode, with_share.compute) == ("plain", MODE_FRACTION, 0.5)


def test_a_request_with_compute_where_only_mig_gpus_are_waits_saying_why() -> None:
    cp = planner(mig_node(), labelled=("mig-a",))
    refusal = refused(cp, asking(0.5))
    assert refusal.code == NO_GPU
    assert "a compute share is served to fractions only" in refusal.message


def test_under_the_proportional_default_a_mig_slice_has_no_share() -> None:
    cp = planner(mig_node(), labelled=("mig-a",))
    assert place(cp, "a", SliceRequest(memory_bytes=4 * GIB), PROPORTIONAL_SETTINGS).compute is None


# --- the proportional default ------------------------------------------------------------------------


def test_proportional_gives_the_memory_share_rounded_down_to_four_places() -> None:
    cp = one_gpu()
    gpu_bytes = H100_MIB * 2**20
    b = place(cp, "a", SliceRequest(memory_bytes=20 * GIB), PROPORTIONAL_SETTINGS)
    expected = (Decimal(20 * GIB) / Decimal(gpu_bytes)).quantize(Decimal("0.0001"), rounding="ROUND_FLOOR")
    assert Decimal(repr(b.compute)) == expected == Decimal("0.2511")
    half = place(cp, "b", SliceRequest(fraction=0.5), PROPORTIONAL_SETTINGS)
    # 0.5 of the GPU in whole MiB (40779.5 -> 40779 MiB) is a hair under half of it.
    assert Decimal(repr(half.compute)) == Decimal("0.4999")


def test_proportional_shares_fill_a_gpu_as_their_memory_does() -> None:
    cp = one_gpu()
    for u in "abcd":
        assert place(cp, u, SliceRequest(fraction=0.25), PROPORTIONAL_SETTINGS).gpu == 0
    assert refused(cp, SliceRequest(memory_bytes=GIB), PROPORTIONAL_SETTINGS).code == NO_CAPACITY


def test_an_asked_share_overrides_the_proportional_default() -> None:
    cp = one_gpu()
    assert place(cp, "a", asking(0.9, memory=GIB), PROPORTIONAL_SETTINGS).compute == 0.9
    # 40 GiB fits in memory, but its proportional share (0.5022) does not fit in the 0.1 left.
    assert refused(cp, SliceRequest(memory_bytes=40 * GIB), PROPORTIONAL_SETTINGS).code == NO_CAPACITY


def test_under_shared_the_default_fraction_has_no_share() -> None:
    assert place(one_gpu(), "a", SliceRequest(fraction=0.5), PlannerSettings(default_compute=SHARED)).compute is None


@pytest.mark.parametrize(("granted", "gpu", "expected"), [
    (1, 10**12, "0.0001"),  # at least one step: never a share of 0
    (10, 10, "1"), (11, 10, "1"), (1, 3, "0.3333"), (2, 3, "0.6666"), (0, 10, "0.0001")])
def test_proportional_rounding(granted: int, gpu: int, expected: str) -> None:
    assert Decimal(repr(proportional(granted, gpu))) == Decimal(expected)


# --- exactness, against Decimal ----------------------------------------------------------------------

decimal_share = st.builds(lambda digits, places: Decimal(digits).scaleb(-places), st.integers(1, 10**6),
                          st.integers(1, 17)).filter(lambda d: 0 < d <= 1)


@given(st.lists(decimal_share, max_size=8), decimal_share)
@example([Decimal("0.34"), Decimal("0.56")], Decimal("0.1"))  # exactly 1 (floats: 1.0000000000000002)
@example([Decimal("0.34"), Decimal("0.56")], Decimal("0.1000000000000001"))  # a hair over
@example([Decimal("0.3333333333333333")] * 3, Decimal("1e-16"))  # exactly 1
@example([Decimal("0.1")] * 9, Decimal("0.1"))  # exactly 1 (floats: 0.9999999999999999)
# 0.8999999106682958 is the float nearest what is left (0.89999991066829574423649), and above it.
@example([Decimal("0.1"), Decimal("8.933170425576351e-08")], Decimal("0.8999999106682958"))
def test_room_for_a_share_is_decided_as_decimals_add_up(held: list[Decimal], asked: Decimal) -> None:
    shares = [float(d) for d in held]
    assume(all(Decimal(repr(f)) == d for f, d in zip(shares, held, strict=True)))  # written as floats write
    assume(Decimal(repr(float(asked))) == asked)
    compute = gpu_compute(shares)
    assert compute.has_room(float(asked)) == (sum(held, Decimal(0)) + asked <= 1)
