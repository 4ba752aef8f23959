"""One allocator per GPU (issue 17, item 5): a node where NVIDIA's device plugin also advertises GPUs
takes no new slice until the plugin is off or an admin labels the node as shared deliberately.

core.node.device_plugin decides from the Node's maps; the agent writes the answer as a GpuNode condition
(kube/agent/inventory.gpunode_status); core.placement.cluster reads it back and keeps such nodes out of new
placements, in plan_binding and in ClusterPlanner alike.
"""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.node.device_plugin import (
    CONDITION_TYPE,
    GPU_OPERATOR_PLUGIN_LABEL,
    REASON_CONFLICT,
    REASON_NONE,
    REASON_SHARED,
    SHARED_LABEL,
    DevicePluginCheck,
    check_node,
    conflict_from_conditions,
    device_plugin_resources,
    is_device_plugin_resource,
    shared_deliberately,
)
from mig_operator.core.node.lifecycle import OwnerRecord
from mig_operator.core.placement.cluster import (
    DEVICE_PLUGIN_CONFLICT,
    MAX_MESSAGE,
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    NO_GPU,
    Binding,
    GpuState,
    NodeInventory,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request
from mig_operator.gpu.protocol import GpuInfo
from mig_operator.kube.agent.inventory import gpunode_status

H100 = get_model("h100-80gb")
L4 = get_model("l4-24gb")
NOW = "2026-01-01T00:00:00.000Z"
REQUESTS = [slice_request(memory="9Gi"), slice_request(fraction=0.5), slice_request(profile="1g.10gb")]


def mig_gpu(index: int = 0) -> GpuState:
    return GpuState(index=index, uuid=f"GPU-h100-{index}", product=H100.product, model=H100.name,
                    memory_mib=H100.memory_mib, mig_capable=True, mig_enabled=True, profiles=H100.profiles)


def fraction_gpu(index: int = 0) -> GpuState:
    return GpuState(index=index, uuid=f"GPU-l4-{index}", product=L4.product, model=L4.name,
                    memory_mib=L4.memory_mib)


def node(name: str, *gpus: GpuState, conflict: tuple[str, ...] = ()) -> NodeInventory:
    return NodeInventory(name, gpus or (mig_gpu(),), conflict)


# ---- which capacities count ---------------------------------------------------------------------


@pytest.mark.parametrize(("capacity", "expected"), [
    ({"nvidia.com/gpu": "8"}, ("nvidia.com/gpu",)),
    ({"nvidia.com/gpu": "0"}, ()),  # the kubelet zeroes a removed plugin's resource: no conflict
    ({"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "0"}, ()),
    ({"nvidia.com/gpu.shared": "16"}, ("nvidia.com/gpu.shared",)),  # time-slicing renames it
    ({"nvidia.com/mig-1g.10gb": "7"}, ("nvidia.com/mig-1g.10gb",)),  # MIG, mixed strategy
    ({"nvidia.com/mig-1g.10gb.shared": "2"}, ("nvidia.com/mig-1g.10gb.shared",)),
    ({"nvidia.com/mig-3g.40gb": "1", "nvidia.com/gpu": "2", "cpu": "64"},
     ("nvidia.com/gpu", "nvidia.com/mig-3g.40gb")),
    ({"example.com/gpu": "8"}, ()),  # another vendor's name is none of NVIDIA's plugin
    ({"nvidia.com/gpu.product": "1"}, ()),  # a label's key, never a device plugin resource
    ({"nvidia.com/mig-": "1"}, ()),  # no profile: not a resource the plugin names
    ({"gpu.cdmo.io/memory": "1"}, ()),
    ({"cpu": "64", "memory": "512Gi", "pods": "110"}, ()),
    ({}, ()),
])
def test_the_device_plugins_resources_above_zero_count(capacity: dict, expected: tuple) -> None:
    assert device_plugin_resources(capacity) == expected
    assert device_plugin_resources(None, capacity) == expected  # allocatable counts the same


def test_capacity_or_allocatable_above_zero_is_enough() -> None:
    # A stopped plugin: the kubelet keeps capacity for a grace period while allocatable is 0; the pods it
    # placed still hold their GPUs, so the conflict stays until capacity is 0 (or the resource is gone).
    assert device_plugin_resources({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "0"}) == ("nvidia.com/gpu",)
    assert device_plugin_resources({"nvidia.com/gpu": "0"}, {"nvidia.com/gpu": "1"}) == ("nvidia.com/gpu",)
    assert device_plugin_resources({"nvidia.com/gpu": "0"}, {"nvidia.com/gpu": "0"}) == ()


@pytest.mark.parametrize(("value", "counts"), [
    ("1", True), ("0", False), ("00", False), ("0.0", False), ("0m", False), ("1k", True), (" 2 ", True),
    (8, True), (0, False), ("nonsense", True),  # an unexpected spelling blocks rather than hides a conflict
])
def test_quantities_above_zero(value: object, counts: bool) -> None:
    assert bool(device_plugin_resources({"nvidia.com/gpu": value})) is counts


def test_resource_names() -> None:
    assert is_device_plugin_resource("nvidia.com/gpu")
    assert is_device_plugin_resource("nvidia.com/gpu.shared")
    assert is_device_plugin_resource("nvidia.com/mig-7g.80gb")
    assert not is_device_plugin_resource("nvidia.com/gpus")
    assert not is_device_plugin_resource("example.com/gpu")
    assert not is_device_plugin_resource("NVIDIA.com/gpu")  # resource names are case-sensitive


@pytest.mark.parametrize(("labels", "shared"), [
    ({SHARED_LABEL: "true"}, True), ({SHARED_LABEL: "True"}, True), ({SHARED_LABEL: "false"}, False),
    ({SHARED_LABEL: ""}, False), ({}, False), (None, False), ({"cdmo.io/device-plugin": "true"}, False),
])
def test_the_shared_label(labels: dict | None, shared: bool) -> None:
    assert shared_deliberately(labels) is shared


# ---- the condition --------------------------------------------------------------------------------


def test_a_conflict_names_the_node_the_resources_and_both_ways_out() -> None:
    check = DevicePluginCheck("gpu-7", ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"))
    assert check.conflict and check.reason == REASON_CONFLICT
    cond = check.condition(NOW)
    assert cond == {"type": CONDITION_TYPE, "status": "True", "reason": REASON_CONFLICT,
                    "message": check.message, "lastTransitionTime": NOW}
    for part in ("gpu-7", "nvidia.com/gpu, nvidia.com/mig-1g.10gb", f"{GPU_OPERATOR_PLUGIN_LABEL}=false",
                 f"{SHARED_LABEL}=true", "kubectl label node gpu-7"):
        assert part in check.message


def test_shared_deliberately_and_none_are_false() -> None:
    shared = DevicePluginCheck("gpu-7", ("nvidia.com/gpu",), shared=True)
    assert not shared.conflict and shared.reason == REASON_SHARED
    assert shared.condition(NOW)["status"] == "False" and "nvidia.com/gpu" in shared.message
    none = DevicePluginCheck("gpu-7", (), shared=True)  # the label alone changes nothing
    assert not none.conflict and none.reason == REASON_NONE and none.condition(NOW)["status"] == "False"


def test_check_node_reads_a_node_object() -> None:
    body = {"metadata": {"name": "n", "labels": {"type": "kwok"}},
            "status": {"capacity": {"cpu": "1k", "nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}}}
    assert check_node("n", body) == DevicePluginCheck("n", ("nvidia.com/gpu",), False)
    body["metadata"]["labels"][SHARED_LABEL] = "true"
    assert check_node("n", body) == DevicePluginCheck("n", ("nvidia.com/gpu",), True)
    assert check_node("n", {"metadata": {}}) == DevicePluginCheck("n")
    assert check_node("n", None) == DevicePluginCheck("n")


@pytest.mark.parametrize(("conditions", "resources", "expected"), [
    ([{"type": CONDITION_TYPE, "status": "True"}], ["nvidia.com/gpu"], ("nvidia.com/gpu",)),
    ([{"type": CONDITION_TYPE, "status": "False"}], ["nvidia.com/gpu"], ()),  # shared deliberately
    ([{"type": "Other", "status": "True"}], ["nvidia.com/gpu"], ()),
    ([{"type": CONDITION_TYPE, "status": "True"}], None, ("nvidia.com/gpu",)),  # True always blocks
    ([{"type": CONDITION_TYPE, "status": "True"}], "nvidia.com/gpu", ("nvidia.com/gpu",)),
    ("not a list", ["nvidia.com/gpu"], ()),
    (None, None, ()),
])
def test_the_controller_reads_the_condition_back(conditions: object, resources: object, expected: tuple) -> None:
    assert conflict_from_conditions(conditions, resources) == expected


@pytest.mark.parametrize("check", [
    DevicePluginCheck("n", ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")),
    DevicePluginCheck("n", ("nvidia.com/gpu",), shared=True),
    DevicePluginCheck("n"),
])
def test_gpunode_status_round_trips_the_conflict(check: DevicePluginCheck) -> None:
    info = GpuInfo(index=0, uuid="GPU-0", product=H100.product, memory_mib=H100.memory_mib, mig_capable=True,
                   mig_enabled=True)
    status = gpunode_status([info], {0: H100}, {0: []}, OwnerRecord(), True, NOW, frozenset(), check, "then")
    assert status["devicePluginResources"] == list(check.resources)
    assert status["conditions"] == [check.condition("then")]
    inventory = inventory_from_status("n", status)
    assert inventory.device_plugin_conflict == (check.resources if check.conflict else ())
    assert [g.uuid for g in inventory.gpus] == ["GPU-0"]  # the GPUs are still shown


def test_a_gpunode_written_before_this_check_has_no_conflict() -> None:
    info = GpuInfo(index=0, uuid="GPU-0", product=H100.product, memory_mib=H100.memory_mib, mig_capable=True,
                   mig_enabled=True)
    status = gpunode_status([info], {0: H100}, {0: []}, OwnerRecord(), True, NOW)
    assert "conditions" not in status
    assert inventory_from_status("n", status).device_plugin_conflict == ()


# ---- placement ------------------------------------------------------------------------------------


def both(inventories: list[NodeInventory], request, pinned: str | None = None,
         bindings: tuple[Binding, ...] = ()) -> Binding | Refusal:
    """plan_binding on build_view and ClusterPlanner.plan on the same inputs: they must agree."""
    labelled = [inv.node for inv in inventories]
    try:
        first: Binding | Refusal = plan_binding(request, build_view(inventories, labelled, bindings), pinned)
    except Refusal as refusal:
        first = refusal
    planner = ClusterPlanner()
    planner.reset(inventories, labelled, bindings)
    try:
        second: Binding | Refusal = planner.plan(request, pinned)
    except Refusal as refusal:
        second = refusal
    assert first == second
    return first


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.describe())
def test_a_slice_pinned_to_a_conflicting_node_waits_with_the_reason(request_) -> None:
    inventories = [node("a", mig_gpu(), fraction_gpu(1), conflict=("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")),
                   node("b")]
    refusal = both(inventories, request_, pinned="a")
    assert isinstance(refusal, Refusal) and refusal.code == DEVICE_PLUGIN_CONFLICT
    for part in ("node a", "nvidia.com/gpu, nvidia.com/mig-1g.10gb", GPU_OPERATOR_PLUGIN_LABEL, SHARED_LABEL):
        assert part in refusal.message
    # Unpinned, it goes to the other node.
    bound = both(inventories, request_)
    assert isinstance(bound, Binding) and bound.node == "b"


def test_when_every_node_conflicts_the_reason_is_the_conflict_not_no_gpu() -> None:
    refusal = both([node("a", conflict=("nvidia.com/gpu",))], slice_request(memory="9Gi"))
    assert isinstance(refusal, Refusal) and refusal.code == DEVICE_PLUGIN_CONFLICT and "node a" in refusal.message
    many = [node(f"n{i:03}", conflict=("nvidia.com/gpu",)) for i in range(300)]
    refusal = both(many, slice_request(memory="9Gi"))
    assert isinstance(refusal, Refusal) and refusal.code == DEVICE_PLUGIN_CONFLICT
    assert "300 node(s)" in refusal.message and "n000 (nvidia.com/gpu)" in refusal.message
    assert len(refusal.message) <= MAX_MESSAGE


def test_a_refusal_for_room_elsewhere_mentions_the_conflicting_nodes() -> None:
    # b is full (a binding holds its only 7g), a has room but a device plugin: NoCapacity, naming a.
    full = Binding("x", "b", 0, MODE_MIG, H100.profile("7g.80gb").memory_mib * 2**20,
                   H100.profile("7g.80gb").id, "7g.80gb", 0, 8)
    refusal = both([node("a", conflict=("nvidia.com/gpu",)), node("b")], slice_request(memory="9Gi"),
                   bindings=(full,))
    assert isinstance(refusal, Refusal) and refusal.code == NO_CAPACITY
    assert "a (nvidia.com/gpu)" in refusal.message


def test_a_node_without_gpus_to_offer_and_no_conflict_is_still_no_gpu() -> None:
    refusal = both([node("a", mig_gpu())], slice_request(memory="9Gi"), pinned="a")
    assert isinstance(refusal, Binding)
    idle = NodeInventory("a", (GpuState(0, "GPU-x", mig_capable=True, mig_enabled=True),))  # no profiles
    refusal = both([idle], slice_request(memory="9Gi"), pinned="a")
    assert isinstance(refusal, Refusal) and refusal.code == NO_GPU


def test_existing_bindings_stay_and_count_again_once_the_conflict_clears() -> None:
    planner = ClusterPlanner()
    planner.set_inventory(node("a", fraction_gpu()))
    first = planner.plan(slice_request(fraction=0.5), "a")
    assert first.mode == MODE_FRACTION
    planner.put_binding(Binding("s1", first.node, first.gpu, first.mode, first.granted_bytes))
    planner.set_inventory(node("a", fraction_gpu(), conflict=("nvidia.com/gpu",)))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(fraction=0.25), "a")
    assert refused.value.code == DEVICE_PLUGIN_CONFLICT
    # Resolved (the plugin is off, or the node is marked shared): the 0.5 already bound still counts.
    planner.set_inventory(node("a", fraction_gpu()))
    second = planner.plan(slice_request(fraction=0.5), "a")
    assert second.node == "a" and second.mode == MODE_FRACTION
    with pytest.raises(Refusal) as full:
        planner.plan(slice_request(fraction=0.75), "a")
    assert full.value.code == NO_CAPACITY


def test_eligible_nodes_that_all_conflict_wait_for_the_conflict() -> None:
    planner = ClusterPlanner()
    planner.reset([node("a", conflict=("nvidia.com/mig-1g.10gb",)), node("b", conflict=("nvidia.com/gpu",)),
                   node("c")], ["a", "b", "c"], [])
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="9Gi"), nodes=["a", "b"])
    assert refused.value.code == DEVICE_PLUGIN_CONFLICT
    assert "a (nvidia.com/mig-1g.10gb)" in refused.value.message and "b (nvidia.com/gpu)" in refused.value.message
    assert planner.plan(slice_request(memory="9Gi"), nodes=["a", "c"]).node == "c"


def test_a_node_shared_deliberately_takes_slices() -> None:
    shared = DevicePluginCheck("a", ("nvidia.com/gpu",), shared=True)
    info = GpuInfo(index=0, uuid="GPU-0", product=H100.product, memory_mib=H100.memory_mib, mig_capable=True,
                   mig_enabled=True)
    status = gpunode_status([info], {0: H100}, {0: []}, OwnerRecord(), True, NOW, frozenset(), shared, NOW)
    inventory = inventory_from_status("a", status)
    bound = both([inventory], slice_request(memory="9Gi"), pinned="a")
    assert isinstance(bound, Binding) and bound.node == "a" and bound.profile == "1g.10gb"
