"""Runtime trust in placement (issue 24): a node whose GpuNode says RuntimeTrusted=False takes no new slice unless
the Node is labelled cdmo.io/runtime-trust=accepted; True and Unknown place as before; slices already
bound stay and count. Decided by plan_binding on build_view and by ClusterPlanner alike.

And "no quota, no GPU" (core.books.quota.quota_missing), the rule the binder applies before planning.
"""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.books.quota import NO_QUOTA, QUOTA_NAME, Quota, quota_missing
from mig_operator.core.node.runtime_trust import (
    CONDITION_TYPE,
    TRUST_LABEL,
    TRUST_VALUE,
    accepted,
    untrusted_from_conditions,
)
from mig_operator.core.placement.cluster import (
    DEVICE_PLUGIN_CONFLICT,
    MAX_MESSAGE,
    MODE_FRACTION,
    NO_CAPACITY,
    RUNTIME_UNTRUSTED,
    Binding,
    NodeInventory,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request

H100 = get_model("h100-80gb")
L40S = get_model("l40s-48gb")
WHY = "nvidia-container-runtime honours NVIDIA_VISIBLE_DEVICES from unprivileged containers"


def condition(status: str, message: str = WHY) -> list[dict]:
    return [{"type": "DevicePluginConflict", "status": "False", "reason": "NoDevicePluginResources", "message": ""},
            {"type": CONDITION_TYPE, "status": status, "reason": "Checked", "message": message}]


H100_MODELS = [{"name": H100.name, "profiles": [
    {"name": p.name, "id": p.id, "slices": p.slices, "memoryMiB": p.memory_mib, "sm": p.sm,
     "maxInstances": p.max_instances, "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements]}
    for p in H100.profiles]}]


def mig_gpu() -> dict:
    return {"index": 0, "uuid": "GPU-h100-0", "product": H100.product, "model": H100.name,
            "memoryMiB": H100.memory_mib, "migCapable": True, "migEnabled": True}


def fraction_gpu() -> dict:
    return {"index": 0, "uuid": "GPU-l40s-0", "product": L40S.product, "model": "", "memoryMiB": L40S.memory_mib}


def gpunode(node: str, trusted: str | None, gpu: dict) -> NodeInventory:
    """A GpuNode status as the agent publishes it, read back as the controller does."""
    status: dict = {"models": H100_MODELS if gpu["model"] else [], "gpus": [gpu]}
    if trusted is not None:
        status["conditions"] = condition(trusted)
    return inventory_from_status(node, status)


def decide(inventories, request, node=None, accepted_nodes=(), bindings=(), nodes=None) -> Binding | Refusal:
    labelled = [i.node for i in inventories]
    try:
        if nodes is not None:
            raise LookupError
        first: Binding | Refusal | None = plan_binding(
            request, build_view(inventories, labelled, bindings, accepted_nodes=accepted_nodes), node)
    except Refusal as refusal:
        first = refusal
    except LookupError:
        first = None  # plan_binding has no node list; ClusterPlanner alone
    planner = ClusterPlanner()
    planner.reset(inventories, labelled, bindings, accepted=accepted_nodes)
    try:
        second: Binding | Refusal = planner.plan(request, node, nodes=nodes)
    except Refusal as refusal:
        second = refusal
    assert first is None or first == second
    return second


@pytest.mark.parametrize(("conditions", "expected"), [
    (condition("False"), WHY),
    (condition("False", ""), "Checked"),
    (condition("True"), None),
    (condition("Unknown"), None),
    ([], None),
    (None, None),
    ("garbage", None),
    ([{"type": CONDITION_TYPE, "status": "False", "message": "x" * 5000}], "x" * 1499 + "…"),
])
def test_the_condition_is_read_back(conditions, expected) -> None:
    assert untrusted_from_conditions(conditions) == expected


@pytest.mark.parametrize("gpu", [mig_gpu(), fraction_gpu()], ids=["mig", "fraction"])
@pytest.mark.parametrize(("trusted", "accept", "places"), [
    ("False", False, False),
    ("False", True, True),
    ("True", False, True),
    ("Unknown", False, True),  # e.g. containerd with CDI only: no toolkit config to read
    (None, False, True),  # an agent that does not publish the condition
])
def test_a_pinned_slice_places_by_the_condition_and_the_label(gpu, trusted, accept, places) -> None:
    inventories = [gpunode("n1", trusted, gpu)]
    got = decide(inventories, slice_request(memory="9Gi"), "n1", accepted_nodes=("n1",) if accept else ())
    if places:
        assert isinstance(got, Binding) and got.node == "n1"
    else:
        assert isinstance(got, Refusal) and got.code == RUNTIME_UNTRUSTED
        for part in ("node n1", WHY, f"kubectl label node n1 {TRUST_LABEL}={TRUST_VALUE}", CONDITION_TYPE):
            assert part in got.message, got.message


def test_an_unpinned_slice_goes_to_a_trusted_node() -> None:
    inventories = [gpunode("n1", "False", mig_gpu()), gpunode("n2", "True", mig_gpu())]
    got = decide(inventories, slice_request(memory="9Gi"))
    assert isinstance(got, Binding) and got.node == "n2"


def test_bound_slices_stay_and_count_while_the_node_is_untrusted() -> None:
    planner = ClusterPlanner()
    planner.reset([gpunode("n1", "True", fraction_gpu())], [], [])
    first = planner.plan(slice_request(fraction=0.5), "n1")
    planner.put_binding(Binding("s1", first.node, first.gpu, first.mode, first.granted_bytes))
    planner.set_inventory(gpunode("n1", "False", fraction_gpu()))
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(fraction=0.25), "n1")
    assert refused.value.code == RUNTIME_UNTRUSTED
    planner.set_runtime_accepted("n1", True)
    assert planner.plan(slice_request(fraction=0.5), "n1").mode == MODE_FRACTION
    with pytest.raises(Refusal) as full:  # the 0.5 bound before still counts
        planner.plan(slice_request(fraction=0.75), "n1")
    assert full.value.code == NO_CAPACITY
    planner.set_runtime_accepted("n1", False)
    with pytest.raises(Refusal) as again:
        planner.plan(slice_request(fraction=0.25), "n1")
    assert again.value.code == RUNTIME_UNTRUSTED


def test_a_device_plugin_conflict_comes_first_and_the_label_does_not_clear_it() -> None:
    both = inventory_from_status("n1", {"models": H100_MODELS, "gpus": [mig_gpu()], "conditions": [
        {"type": "DevicePluginConflict", "status": "True"}, *condition("False")[1:]],
        "devicePluginResources": ["nvidia.com/gpu"]})
    got = decide([both], slice_request(memory="9Gi"), "n1", accepted_nodes=("n1",))
    assert isinstance(got, Refusal) and got.code == DEVICE_PLUGIN_CONFLICT


def test_many_blocked_nodes_are_summarised_within_a_status() -> None:
    many = [gpunode(f"n{i:03}", "False", mig_gpu()) for i in range(300)]
    got = decide(many, slice_request(memory="9Gi"))
    assert isinstance(got, Refusal) and got.code == RUNTIME_UNTRUSTED
    assert "300 node(s)" in got.message and "n000 (RuntimeTrusted=False)" in got.message
    assert TRUST_LABEL in got.message and len(got.message) <= MAX_MESSAGE


def test_eligible_nodes_blocked_for_both_causes_name_both() -> None:
    plugin = inventory_from_status("p", {"models": H100_MODELS, "gpus": [mig_gpu()], "conditions": [
        {"type": "DevicePluginConflict", "status": "True"}], "devicePluginResources": ["nvidia.com/gpu"]})
    inventories = [plugin, gpunode("u1", "False", mig_gpu()), gpunode("u2", "False", mig_gpu())]
    got = decide(inventories, slice_request(memory="9Gi"), nodes=["p", "u1", "u2"])
    assert isinstance(got, Refusal) and got.code == RUNTIME_UNTRUSTED  # two of the three
    assert "p (nvidia.com/gpu)" in got.message and "u1 (RuntimeTrusted=False)" in got.message


@pytest.mark.parametrize(("labels", "expected"), [
    ({TRUST_LABEL: "accepted"}, True), ({TRUST_LABEL: "true"}, False), ({}, False), (None, False)])
def test_the_accepted_label_value_is_exact(labels, expected) -> None:
    assert accepted(labels) is expected


# ---- no quota, no GPU ---------------------------------------------------------------------------


@pytest.mark.parametrize(("required", "quota", "error", "refused"), [
    (False, None, None, False),
    (True, Quota("team-a", 2**30), None, False),
    (True, Quota("team-a", 0, 0), None, False),  # a quota of nothing is a quota: QuotaExceeded says the rest
    (True, None, None, True),
    (True, None, "GpuQuota memory '40X': unknown unit", True),
])
def test_no_quota_no_gpu(required, quota, error, refused) -> None:
    message = quota_missing("team-a", quota, required, error)
    assert (message is not None) is refused
    if message is not None:
        assert NO_QUOTA == "NoQuota"
        for part in ("namespace team-a", "GpuQuota", f"name: {QUOTA_NAME}", "namespace: team-a", "memory: 40Gi",
                     "quota.required"):
            assert part in message, message
        if error:
            assert error in message
