"""GPU health in placement: a GPU whose GpuNode entry says Healthy=False takes no new slice and its idle
instances are not reused; the slices bound there stay and count; a refusal names the GPU and why when
that is the only reason. Decided by plan_binding on build_view and by ClusterPlanner alike."""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.node.health import GPU_UNHEALTHY, GpuHealth, condition
from mig_operator.core.node.lifecycle import OwnerRecord
from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    Binding,
    NodeInventory,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request
from mig_operator.gpu.protocol import GpuInfo, MigInstance
from mig_operator.kube.agent.inventory import gpunode_status

H100 = get_model("h100-80gb")
L40S = get_model("l40s-48gb")
SMALL = next(p for p in H100.profiles if p.name == "1g.10gb")
MODELS = [{"name": H100.name, "profiles": [
    {"name": p.name, "id": p.id, "slices": p.slices, "memoryMiB": p.memory_mib, "sm": p.sm,
     "maxInstances": p.max_instances, "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements]}
    for p in H100.profiles]}]
XID79 = [{"type": "Healthy", "status": "False", "reason": "Xid79", "message": "GPU 0 reported Xid 79"}]
FINE = [{"type": "Healthy", "status": "True", "reason": "Healthy", "message": ""}]


def mig_gpu(index: int, conditions: list | None = None, idle_small_at: int | None = None) -> dict:
    gpu = {"index": index, "uuid": f"GPU-h100-{index}", "product": H100.product, "model": H100.name,
           "memoryMiB": H100.memory_mib, "migCapable": True, "migEnabled": True, "instances": []}
    if idle_small_at is not None:
        gpu["instances"] = [{"giId": 9, "ciId": 0, "profileId": SMALL.id, "profile": SMALL.name,
                             "start": idle_small_at, "size": 1, "deviceUUID": f"MIG-{index}", "inUse": False}]
    if conditions is not None:
        gpu["conditions"] = conditions
    return gpu


def fraction_gpu(index: int, conditions: list | None = None) -> dict:
    gpu = {"index": index, "uuid": f"GPU-l40s-{index}", "product": L40S.product, "model": "",
           "memoryMiB": L40S.memory_mib}
    if conditions is not None:
        gpu["conditions"] = conditions
    return gpu


def node(name: str, *gpus: dict) -> NodeInventory:
    return inventory_from_status(name, {"models": MODELS, "gpus": list(gpus)})


def decide(inventories, request, pinned=None, bindings=()) -> Binding | Refusal:
    labelled = [i.node for i in inventories]
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
    return second


def test_the_condition_is_read_back_from_a_gpunode() -> None:
    inventory = node("n1", mig_gpu(0, XID79), mig_gpu(1, FINE), mig_gpu(2))
    assert [g.health.healthy for g in inventory.gpus] == [False, True, True]
    assert inventory.gpus[0].health.reason == "Xid79"


def test_an_idle_instance_on_an_unhealthy_gpu_is_not_reused() -> None:
    request = slice_request(memory="9Gi")
    healthy = decide([node("n1", mig_gpu(0, FINE, idle_small_at=4), mig_gpu(1))], request)
    # Healthy, the idle instance is the choice (reuse, keeping GPU 1 whole): the test below means something.
    assert isinstance(healthy, Binding) and (healthy.gpu, healthy.start) == (0, 4)
    sick = decide([node("n1", mig_gpu(0, XID79, idle_small_at=4), mig_gpu(1))], request)
    assert isinstance(sick, Binding) and sick.gpu == 1 and sick.mode == MODE_MIG


@pytest.mark.parametrize("gpu", [mig_gpu(0, XID79), fraction_gpu(0, XID79)], ids=["mig", "fraction"])
def test_the_only_gpu_unhealthy_is_the_refusal_and_names_it(gpu: dict) -> None:
    got = decide([node("n1", gpu)], slice_request(memory="4Gi"))
    assert isinstance(got, Refusal) and got.code == GPU_UNHEALTHY
    assert "GPU 0 of node n1 (Xid79)" in got.message, got.message
    pinned = decide([node("n1", gpu), node("n2", mig_gpu(0))], slice_request(memory="4Gi"), "n1")
    assert isinstance(pinned, Refusal) and pinned.code == GPU_UNHEALTHY


def test_a_full_healthy_gpu_is_no_capacity_and_the_note_names_the_unhealthy_one() -> None:
    full = next(p for p in H100.profiles if p.name == "7g.80gb")
    bindings = [Binding("big", "n1", 1, MODE_MIG, full.memory_mib * 2**20, full.id, full.name, 0, 8)]
    got = decide([node("n1", mig_gpu(0, XID79), mig_gpu(1))], slice_request(memory="4Gi"), bindings=bindings)
    assert isinstance(got, Refusal) and got.code == NO_CAPACITY
    assert "GPU 0 of node n1 (Xid79) is unhealthy" in got.message, got.message


def test_a_gpu_healthy_again_takes_slices_and_bound_slices_count_meanwhile() -> None:
    planner = ClusterPlanner()
    planner.reset([node("n1", fraction_gpu(0))], [], [])
    first = planner.plan(slice_request(fraction=0.5), "n1")
    planner.put_binding(Binding("s1", first.node, first.gpu, first.mode, first.granted_bytes))
    planner.set_inventory(node("n1", fraction_gpu(0, XID79)))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(fraction=0.25), "n1")
    assert refused.value.code == GPU_UNHEALTHY
    planner.set_inventory(node("n1", fraction_gpu(0, FINE)))
    assert planner.plan(slice_request(fraction=0.5), "n1").mode == MODE_FRACTION
    with pytest.raises(Refusal) as full:  # the 0.5 bound before still counts
        planner.plan(slice_request(fraction=0.75), "n1")
    assert full.value.code == NO_CAPACITY


def test_the_agent_publishes_what_the_controller_reads() -> None:
    infos = [GpuInfo(i, f"GPU-{i}", H100.product, H100.memory_mib, True, True, i) for i in range(2)]
    sick = GpuHealth(False, "GpuLost", "GPU 1 is lost")
    health = {0: [condition("Healthy", GpuHealth(), "t")], 1: [condition("Healthy", sick, "t")]}
    instances: dict[int, list[MigInstance]] = {0: [], 1: []}
    body = gpunode_status(infos, {0: H100, 1: H100}, instances, OwnerRecord(), True, "t", health=health)
    assert body["gpus"][1]["conditions"][0]["reason"] == "GpuLost"
    inventory = inventory_from_status("n1", body)
    assert [g.health for g in inventory.gpus] == [GpuHealth(), sick]


def test_a_node_gone_with_its_unhealthy_gpu_is_not_named_in_refusals() -> None:
    planner = ClusterPlanner()
    planner.set_inventory(node("n1", mig_gpu(0, XID79)))
    planner.set_labelled("n1", True)
    with pytest.raises(Refusal) as before:
        planner.plan(slice_request(profile="1g.10gb"))
    assert before.value.code == GPU_UNHEALTHY
    planner.remove_inventory("n1")
    with pytest.raises(Refusal) as after:
        planner.plan(slice_request(profile="1g.10gb"))
    assert after.value.code == "NoGpu" and "n1" not in after.value.message, after.value
