"""core.placement.cluster: what mutation testing found untested (docs/testing.md).

Expected values are written out by hand from the record formats (docs/api.md) and the catalog, never
read back from the code under test.
"""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    NO_SUCH_PROFILE,
    Binding,
    GpuState,
    InstanceState,
    NodeInventory,
    Refusal,
    binding_from_status,
    describe_binding,
    gpu_role,
    inventory_from_status,
    model_of,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.planner import PlannerSettings
from mig_operator.core.placement.profiles import Placement, Profile, get_model
from mig_operator.core.requests.request import SliceRequest, slice_request

MiB = 2**20
GiB = 2**30
H200 = get_model("h200-141gb")
H100 = get_model("h100-80gb")


def mig_gpu(model, index: int = 0, instances: tuple[InstanceState, ...] = ()) -> GpuState:
    return GpuState(index, f"GPU-{model.name}-{index}", model.product, model.name, model.memory_mib, True, True,
                    model.profiles, instances)


# --- reading published records: every optional field has its documented default ------------------


def test_a_gpunode_status_with_only_the_required_fields_reads_with_the_defaults() -> None:
    status = {
        "models": [{"name": "m", "profiles": [{"name": "1g.18gb", "id": 19,
                                                "placements": [{"start": 2, "size": 1}, {"start": 0, "size": 1}]}]}],
        "gpus": [{"index": 0, "uuid": "GPU-0", "model": "m", "instances": [{"profileId": 19, "start": 2, "size": 1}]}],
    }
    profile = Profile("1g.18gb", 19, 0, 0, 0, 2, (Placement(0, 1), Placement(2, 1)))  # as many as placements
    instance = InstanceState(gi_id=-1, ci_id=-1, profile_id=19, profile="", start=2, size=1, device_uuid="",
                             in_use=False, slice_uid="", slice="", idle_since=None)
    gpu = GpuState(index=0, uuid="GPU-0", product="", model="m", memory_mib=0, mig_capable=False, mig_enabled=False,
                   profiles=(profile,), instances=(instance,))
    assert inventory_from_status("node-a", status) == NodeInventory("node-a", (gpu,))
    assert not instance.complete  # no compute instance, no device: never handed out


def test_a_gpunode_status_with_every_field_reads_them_all() -> None:
    status = {
        "models": [{"name": "h200-141gb",
                    "profiles": [{"name": "1g.35gb", "id": 15, "slices": 1, "memoryMiB": 33280, "sm": 26,
                                  "maxInstances": 4, "placements": [{"start": 6, "size": 2}]}]}],
        "gpus": [{
            "index": 1, "uuid": "GPU-1", "product": "NVIDIA H200", "model": "h200-141gb", "memoryMiB": 143771,
            "migCapable": True, "migEnabled": True,
            "instances": [{"giId": 3, "ciId": 0, "profileId": 15, "profile": "1g.35gb", "start": 6, "size": 2,
                           "deviceUUID": "MIG-3", "inUse": True, "sliceUID": "uid-1", "slice": "ns/a",
                           "idleSince": "2026-01-01T00:00:00Z"}],
        }],
    }
    inventory = inventory_from_status("node-a", status)
    assert inventory == NodeInventory("node-a", (GpuState(
        1, "GPU-1", "NVIDIA H200", "h200-141gb", 143771, True, True,
        (Profile("1g.35gb", 15, 1, 33280, 26, 4, (Placement(6, 2),)),),
        (InstanceState(3, 0, 15, "1g.35gb", 6, 2, "MIG-3", True, "uid-1", "ns/a", "2026-01-01T00:00:00Z"),),
    ),))


def test_a_bound_status_with_only_the_required_fields_reads_with_the_defaults() -> None:
    mig = {"phase": "Bound", "node": "n", "gpu": 1, "mode": "mig", "profileId": 19,
           "placement": {"start": 3, "size": 1}}
    assert binding_from_status("u", mig) == Binding("u", "n", 1, MODE_MIG, 0, 19, "", 3, 1)
    fraction = {"phase": "Ready", "node": "n", "gpu": 0, "mode": "fraction"}
    assert binding_from_status("u", fraction) == Binding("u", "n", 0, MODE_FRACTION, 0)
    full = dict(mig, grantedBytes=16384 * MiB, profile="1g.18gb")
    assert binding_from_status("u", full) == Binding("u", "n", 1, MODE_MIG, 16384 * MiB, 19, "1g.18gb", 3, 1)
    assert binding_from_status("u", dict(fraction, grantedBytes=4 * GiB)).granted_bytes == 4 * GiB


def test_describe_binding() -> None:
    mig = Binding("u", "node-a", 1, MODE_MIG, 16384 * MiB, 19, "1g.18gb", 6, 1)
    assert describe_binding(mig) == "1g.18gb at {6}:1 on node-a GPU 1"
    assert describe_binding(Binding("u", "node-b", 0, MODE_FRACTION, 4 * GiB)) == "4Gi fraction of node-b GPU 0"


# --- ClusterPlanner: every input change reaches the next decision ---------------------------------


def whole(uid: str, node: str, index: int = 0) -> Binding:
    """The H200's 7g.141gb, which leaves nothing else on the GPU."""
    return Binding(uid, node, index, MODE_MIG, 143360 * MiB, 0, "7g.141gb", 0, 8)


def planner_with(*nodes: NodeInventory, labelled=()) -> ClusterPlanner:
    planner = ClusterPlanner()
    for inventory in nodes:
        planner.set_inventory(inventory)
    for node in labelled:
        planner.set_labelled(node, True)
    return planner


def test_a_dropped_binding_gives_its_room_back() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200),)), labelled=["a"])
    planner.put_binding(whole("u1", "a"))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="1Gi"))
    assert refused.value.code == NO_CAPACITY
    planner.drop_binding("u2")  # unknown: nothing changes
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="1Gi"))
    planner.drop_binding("u1")
    assert planner.plan(slice_request(memory="1Gi")).profile == "1g.18gb"
    planner.drop_binding("u1")  # twice is harmless


def test_a_dropped_binding_leaves_the_others_on_its_gpu() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200),)), labelled=["a"])
    half = Binding("u1", "a", 0, MODE_MIG, 71424 * MiB, 9, "3g.71gb", 0, 4)
    other = Binding("u2", "a", 0, MODE_MIG, 71424 * MiB, 9, "3g.71gb", 4, 4)
    planner.put_binding(half)
    planner.put_binding(other)
    planner.drop_binding("u1")
    got = planner.plan(slice_request(profile="3g.71gb"))
    assert (got.start, got.size) == (0, 4)  # u2 still holds slots 4..7


def test_a_binding_put_again_elsewhere_leaves_its_old_gpu() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200),)), NodeInventory("b", (mig_gpu(H200),)),
                           labelled=["a", "b"])
    planner.put_binding(whole("u1", "a"))
    planner.put_binding(whole("u1", "b"))  # the same slice, now bound to b
    assert planner.plan(slice_request(profile="7g.141gb")).node == "a"
    planner.put_binding(whole("u1", "b"))  # unchanged: nothing to do
    assert planner.plan(slice_request(profile="7g.141gb")).node == "a"


def test_labelling_a_node_after_a_decision_makes_its_gpus_mig_gpus() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200),)))
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="1Gi"))  # MIG enabled but not labelled: no new slices
    planner.set_labelled("a", True)
    assert planner.plan(slice_request(memory="1Gi")).mode == MODE_MIG
    planner.set_labelled("a", False)
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="1Gi"))


def test_reset_replaces_every_input() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200),)), labelled=["a"])
    planner.put_binding(whole("u1", "a"))
    planner.reset([NodeInventory("b", (mig_gpu(H200),))], ["b"], [])
    got = planner.plan(slice_request(profile="7g.141gb"))
    assert (got.node, got.start) == ("b", 0)
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="1Gi"), node="a")  # a's inventory is gone with the reset
    planner.reset([NodeInventory("a", (mig_gpu(H200),))], ["a"], [])
    assert planner.plan(slice_request(memory="1Gi")).node == "a"
    planner.reset([NodeInventory("a", (mig_gpu(H200),))], [], [])
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="1Gi"))  # a is no longer labelled: MIG enabled, no new slices
    planner.reset([NodeInventory("a", (mig_gpu(H200),))], ["a"], [whole("u9", "a")])
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="1Gi"))  # u9 holds the whole GPU
    assert refused.value.code == NO_CAPACITY
    assert planner.uuids == {("a", 0): "GPU-h200-141gb-0"}


def test_a_pinned_refusal_names_the_node_and_judges_only_its_models() -> None:
    nodes = [NodeInventory("a", (mig_gpu(H200),)), NodeInventory("b", (mig_gpu(H100),))]
    planner = planner_with(*nodes, labelled=["a", "b"])
    request = slice_request(profile="1g.10gb")  # an H100 profile: b has it, a does not
    with pytest.raises(Refusal) as pinned:
        planner.plan(request, node="a")
    with pytest.raises(Refusal) as fresh:
        plan_binding(request, build_view(nodes, {"a", "b"}, []), node="a")
    assert pinned.value.code == fresh.value.code == NO_SUCH_PROFILE
    assert pinned.value.message == fresh.value.message
    assert "fits nowhere on node a: " in pinned.value.message
    assert planner.plan(request, node="b").node == "b"


def test_the_planner_passes_its_settings_on_when_pinned() -> None:
    # A board whose one-slice profile allows a single instance, which is in use: a 10Gi request
    # fits only the larger profile, which allow_larger_profile=False refuses.
    small = Profile("1g.20gb", 19, 1, 20480, 16, 1, tuple(Placement(s, 1) for s in range(4)))
    large = Profile("2g.40gb", 14, 2, 40960, 32, 2, (Placement(0, 2), Placement(2, 2)))
    held = (InstanceState(1, 0, 19, "1g.20gb", 0, 1, "MIG-1", in_use=True),)
    board = GpuState(0, "GPU-x", "Board", "board", 81920, True, True, (small, large), held)
    nodes = [NodeInventory("a", (board,))]
    planner = planner_with(*nodes, labelled=["a"])
    request = SliceRequest(memory_bytes=10 * GiB)
    strict = PlannerSettings(allow_larger_profile=False)
    view = build_view(nodes, {"a"}, [])
    for node in (None, "a"):
        got = planner.plan(request, node=node)
        assert (got.profile, got.start) == ("2g.40gb", 2)
        with pytest.raises(Refusal) as refused:
            planner.plan(request, node=node, settings=strict)
        with pytest.raises(Refusal) as expected:
            plan_binding(request, view, node, strict)
        assert refused.value.message == expected.value.message


def test_a_fraction_binding_covers_no_mig_slot() -> None:
    assert Binding("u", "n", 0, MODE_FRACTION, 4 * GiB, 19, "1g.18gb", 2, 1).mask == 0
    assert Binding("u", "n", 0, MODE_MIG, 0, 19, "1g.18gb", 2, 1).mask == 0b100


def no_mig_gpu(index: int, memory_mib: int) -> GpuState:
    return GpuState(index, f"GPU-{index}", "Board", "", memory_mib, False, False)


def test_a_gpu_gone_from_its_nodes_inventory_is_gone_from_the_planner() -> None:
    planner = planner_with(NodeInventory("a", (mig_gpu(H200, 0), mig_gpu(H200, 1))), labelled=["a"])
    planner.put_binding(whole("u1", "a", 0))
    assert planner.plan(slice_request(profile="7g.141gb")).gpu == 1
    planner.set_inventory(NodeInventory("a", (mig_gpu(H200, 0),)))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(profile="7g.141gb"))
    assert refused.value.code == NO_CAPACITY
    assert planner.uuids == {("a", 0): "GPU-h200-141gb-0"}


def test_fraction_gpus_count_their_fraction_bindings_only() -> None:
    l40s = no_mig_gpu(0, 46068)  # 46068 MiB, just under 45 GiB
    planner = planner_with(NodeInventory("a", (l40s,)))
    planner.put_binding(Binding("f", "a", 0, MODE_FRACTION, 40 * GiB))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="5Gi"))
    assert refused.value.code == NO_CAPACITY
    assert planner.plan(slice_request(memory="4Gi")) == Binding("", "a", 0, MODE_FRACTION, 4 * GiB)


def test_a_gpu_that_reports_no_memory_serves_no_fraction() -> None:
    planner = planner_with(NodeInventory("a", (no_mig_gpu(0, 0),)))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="1Mi"))
    assert refused.value.code == "NoGpu"
    planner.set_inventory(NodeInventory("a", (no_mig_gpu(0, 1),)))  # one MiB is memory
    assert planner.plan(slice_request(memory="1Mi")) == Binding("", "a", 0, MODE_FRACTION, MiB)


# --- the view, the roles and the refusals, word for word ---------------------------------------------------


def test_no_gpu_refusals_say_what_kind_of_gpu_is_missing_and_where() -> None:
    empty = build_view([NodeInventory("n", ())], set(), [])  # node n has a GpuNode, with no GPU
    for request, node, message in [
        (slice_request(memory="1Gi"), None, "no GPU in the cluster can take slices: memory 1Gi waits for one"),
        (slice_request(profile="1g.18gb"), None,
         "no MIG GPU in the cluster can take slices: profile 1g.18gb waits for one"),
        (slice_request(memory="1Gi"), "n", "no GPU on node n can take slices: memory 1Gi waits for one"),
    ]:
        with pytest.raises(Refusal) as refused:
            plan_binding(request, empty, node)
        assert (refused.value.code, refused.value.message) == ("NoGpu", message)


def test_a_refusal_message_is_cut_to_4096_characters() -> None:
    base = len("no GPU on node  can take slices: memory 1Gi waits for one")
    for extra, cut in ((0, False), (1, True)):
        node = "n" * (4096 - base + extra)
        with pytest.raises(Refusal) as refused:
            plan_binding(slice_request(memory="1Gi"), build_view([NodeInventory(node, ())], set(), []), node)
        message = refused.value.message
        assert len(message) == 4096
        assert message.endswith("…") == cut
        assert message.endswith("waits for one") != cut


def test_a_refusal_gives_the_mig_and_the_fraction_reasons() -> None:
    nodes = [NodeInventory("a", (mig_gpu(H200),)), NodeInventory("b", (no_mig_gpu(0, 46068),))]
    with pytest.raises(Refusal) as refused:
        plan_binding(slice_request(memory="200Gi"), build_view(nodes, {"a"}, []))
    assert refused.value.code == "TooLarge"
    assert refused.value.message.startswith("memory 200Gi fits nowhere in the cluster: MIG: memory 200Gi (204800 MiB)")
    assert "; fractions: memory 200Gi is larger than any GPU (largest: 46068Mi)" in refused.value.message


def test_a_mig_binding_from_plan_binding_has_no_uid_yet() -> None:
    view = build_view([NodeInventory("a", (mig_gpu(H200),))], {"a"}, [])
    assert plan_binding(slice_request(memory="1Gi"), view) == Binding(
        "", "a", 0, MODE_MIG, 16384 * MiB, 19, "1g.18gb", 0, 1)


def test_refusal_codes_at_the_edges_of_too_large() -> None:
    # Exactly the largest MIG profile, on a GPU in use: it waits, it is not too large.
    busy = mig_gpu(H200, instances=(InstanceState(1, 0, 0, "7g.141gb", 0, 8, "MIG-1", in_use=True),))
    with pytest.raises(Refusal) as refused:
        plan_binding(SliceRequest(memory_bytes=143360 * MiB), build_view([NodeInventory("a", (busy,))], {"a"}, []))
    assert refused.value.code == NO_CAPACITY
    # Exactly a whole fraction GPU, partly granted: it waits.
    bound = [Binding("f", "b", 0, MODE_FRACTION, GiB)]
    view = build_view([NodeInventory("b", (no_mig_gpu(0, 46068),))], set(), bound)
    with pytest.raises(Refusal) as refused:
        plan_binding(SliceRequest(memory_bytes=46068 * MiB), view)
    assert refused.value.code == NO_CAPACITY
    # A GPU that lists a profile without any placement can never take even one byte.
    listed = Profile("1g.10gb", 19, 1, 10240, 16, 1, ())
    odd = GpuState(0, "GPU-0", "Board", "board", 81920, True, True, (listed,))
    with pytest.raises(Refusal) as refused:
        plan_binding(SliceRequest(memory_bytes=1), build_view([NodeInventory("c", (odd,))], {"c"}, []))
    assert refused.value.code == "TooLarge"


def test_build_view_records_uuids_and_the_published_model() -> None:
    nodes = [NodeInventory("a", (mig_gpu(H200), no_mig_gpu(1, 1), no_mig_gpu(2, 0)))]
    view = build_view(nodes, {"a"}, [])
    assert view.uuids == {("a", 0): "GPU-h200-141gb-0", ("a", 1): "GPU-1", ("a", 2): "GPU-2"}
    (gpu,) = view.mig
    assert (gpu.model.name, gpu.model.product, gpu.model.memory_mib, gpu.model.memory_slots) == (
        "h200-141gb", "NVIDIA H200", 143771, 8)
    assert [(g.index, g.memory_bytes) for g in view.fraction] == [(1, MiB)]  # no memory, no fractions


def test_model_of_a_published_profile_table() -> None:
    model = model_of("h200-141gb", "NVIDIA H200", 143771, H200.profiles)
    assert model == H200
    assert model_of("", "NVIDIA H200", 143771, H200.profiles).name == "NVIDIA H200"  # no model name: the product
    bare = model_of("", "Board", 100, ())
    assert (bare.name, bare.product, bare.memory_slots, bare.memory_mib) == ("Board", "Board", 0, 100)


@pytest.mark.parametrize(("labelled", "capable", "enabled", "role", "why"), [
    (True, True, True, "mig", "MIG mode is enabled and the node is labelled for MIG"),
    (False, True, True, "none", "MIG mode is enabled but the node is not labelled cdmo.clear.ml/gpu-partitioning=mig: "
                                "no new slices until it is labelled (or MIG is disabled)"),
    (True, False, False, "fraction", "the GPU has no MIG: it serves fractions"),
    (False, False, False, "fraction", "the GPU has no MIG: it serves fractions"),
    (True, True, False, "fraction", "the node is labelled for MIG but MIG mode is disabled on GPU 3: it serves "
                                    "fractions until an admin enables MIG (nvidia-smi -i 3 -mig 1)"),
    (False, True, False, "fraction", "MIG mode is disabled: the GPU serves fractions"),
])
def test_gpu_role_in_words(labelled: bool, capable: bool, enabled: bool, role: str, why: str) -> None:
    assert gpu_role(labelled, GpuState(3, "GPU-3", mig_capable=capable, mig_enabled=enabled)) == (role, why)
