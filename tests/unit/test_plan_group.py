"""A pod's devices are planned as one group: all on one node, or none (issue 17, item 3).

Expected placements are counted by hand from NVIDIA's H100 placement table (3g.40gb starts at slot 0
or 4, 7g.80gb takes all 8 slots), not from the planner."""

from __future__ import annotations

import pytest

from mig_operator.core.placement.cluster import NO_CAPACITY, GpuState, NodeInventory, Refusal
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import SliceRequest

H100 = get_model("h100-80gb")
THREE_G = SliceRequest(profile="3g.40gb")
SEVEN_G = SliceRequest(profile="7g.80gb")


def node(name: str, gpus: int) -> NodeInventory:
    return NodeInventory(name, tuple(
        GpuState(i, f"GPU-{name}-{i}", H100.product, H100.name, H100.memory_mib, True, True, H100.profiles, ())
        for i in range(gpus)))


def planner(*nodes: NodeInventory) -> ClusterPlanner:
    p = ClusterPlanner()
    for inventory in nodes:
        p.set_inventory(inventory)
        p.set_labelled(inventory.node, True)
    return p


def members(request: SliceRequest, count: int, prefix: str = "m") -> list[tuple[str, SliceRequest]]:
    return [(f"{prefix}{k}", request) for k in range(count)]


def test_a_group_goes_to_the_one_node_that_holds_it_all() -> None:
    # Node a has one H100: two 3g.40gb. Node b has two: four. Three go to b only.
    p = planner(node("a", 1), node("b", 2))
    placed = p.plan_group(members(THREE_G, 3))
    assert {b.node for b in placed} == {"b"} and [b.uid for b in placed] == ["m0", "m1", "m2"]
    assert sorted((b.gpu, b.start) for b in placed)[:2] == [(0, 0), (0, 4)]
    # They hold their room: a fourth fits on b (the last 3g.40gb), a fifth nowhere but a.
    assert p.plan(THREE_G, "b").gpu == 1
    assert p.plan_group(members(THREE_G, 2, "n"))[0].node == "a"


def test_a_group_that_fits_no_single_node_holds_nothing() -> None:
    # Six 7g.80gb on three nodes of two GPUs each: room for six, but four fit no single node.
    p = planner(node("a", 2), node("b", 2), node("c", 2))
    with pytest.raises(Refusal) as refused:
        p.plan_group(members(SEVEN_G, 4), what="the group job")
    assert refused.value.code == NO_CAPACITY
    assert "the group job needs 4 devices" in refused.value.message and "holding none" in refused.value.message
    # Nothing was kept: each node still takes two whole GPUs.
    for name in ("a", "b", "c"):
        assert len(p.plan_group(members(SEVEN_G, 2, name), node=name)) == 2


def test_two_four_device_groups_on_six_gpus_one_fits_the_other_holds_nothing() -> None:
    p = planner(node("big", 6))
    first = p.plan_group(members(SEVEN_G, 4, "x"))
    assert sorted(b.gpu for b in first) == [0, 1, 2, 3]
    with pytest.raises(Refusal):
        p.plan_group(members(SEVEN_G, 4, "y"))
    # The two GPUs left are free: the refused group kept neither.
    assert sorted(b.gpu for b in p.plan_group(members(SEVEN_G, 2, "z"))) == [4, 5]


def test_a_group_pinned_to_a_node_goes_there_or_nowhere() -> None:
    p = planner(node("a", 1), node("b", 2))
    assert {b.node for b in p.plan_group(members(THREE_G, 2), node="a")} == {"a"}
    with pytest.raises(Refusal) as refused:
        p.plan_group(members(THREE_G, 1, "late"), node="a")
    assert "node a" in refused.value.message


def test_a_request_no_gpu_can_take_is_refused_with_its_own_reason() -> None:
    p = planner(node("a", 1))
    with pytest.raises(Refusal) as refused:
        p.plan_group(members(SliceRequest(profile="9g.200gb"), 2), what="the group g")
    assert refused.value.code != NO_CAPACITY and refused.value.message.startswith("the group g of 2 devices: ")


def test_a_group_gathers_only_its_own_namespaces_slices() -> None:
    """The group annotations are a tenant's to write on slices it makes by hand: another namespace's
    slices of the same group name never join its group (nor are bound, held or given back with it)."""
    from mig_operator.core.books.ledger import Ledger
    from mig_operator.kube.controller.observe import slice_record

    def body(ns: str, name: str, size: str = "2") -> dict:
        return {"metadata": {"uid": f"{ns}-{name}", "namespace": ns, "name": name, "resourceVersion": "1",
                             "annotations": {"cdmo.io/group": "job", "cdmo.io/group-size": size}},
                "spec": {"migProfile": "1g.10gb"}}

    state = Ledger()
    for ns, name in (("a", "job-0"), ("a", "job-1"), ("b", "job-0")):
        state.put_slice(slice_record(body(ns, name)))
    mine = state.group_members(state.slices["a-job-0"])
    assert [m.uid for m in mine] == ["a-job-0", "a-job-1"]
    assert [m.uid for m in state.group_members(state.slices["b-job-0"])] == ["b-job-0"]
    # A size outside 2 to 16 is no group: the slice is planned on its own.
    state.put_slice(slice_record(body("c", "alone", "99")))
    assert state.slices["c-alone"].group is None
