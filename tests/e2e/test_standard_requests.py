"""Requests people already write (issue 17): a container's nvidia.com/mig-<profile>: 1 is served as a
MIG slice for that container, a namespace may opt out, and an unknown cdmo.io/* annotation is
refused. On the local control plane: the API server evaluates the webhook configuration's CEL
matchConditions and namespaceSelector, kube-scheduler reserves the slice's claim."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import OperatorHarness, check_invariants, wait_until
from kubernetes.client.rest import ApiException
from test_pods import KWOK_TOLERATION, running, start


def mig_pod(name: str, limits: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"tolerations": [KWOK_TOLERATION], "containers": [
                {"name": "sidecar", "image": "busybox", "resources": {"limits": {"cpu": "100m"}}},
                {"name": "train", "image": "busybox", "resources": {"limits": {**limits, "cpu": "200m"}}},
            ]}}


@pytest.mark.compat
def test_a_containers_mig_resource_runs_on_a_slice_of_that_profile_for_that_container(
        operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb")
    start(operator, mig)
    ns = operator.namespace()
    operator.core.create_namespaced_pod(ns, mig_pod("train", {"nvidia.com/mig-1g.10gb": "1"}))
    pod = running(operator, ns, "train")
    assert pod.spec.node_name == mig.name
    sidecar, train = pod.spec.containers
    # The extended resource is gone (no scheduler or device plugin needs it); what was asked is recorded.
    assert train.resources.limits == {"cpu": "200m"} and sidecar.resources.limits == {"cpu": "100m"}
    assert json.loads(pod.metadata.annotations["cdmo.io/requested-resources"]) == {
        "train": {"nvidia.com/mig-1g.10gb": "1"}}
    # Only the asking container names the slice's claim.
    name = pod.metadata.labels["cdmo.io/gpu-slice"]
    assert [c.name for c in train.resources.claims] == ["gpu-slice"] and not sidecar.resources.claims
    assert [(c.name, c.resource_claim_name) for c in pod.spec.resource_claims] == [("gpu-slice", name)]
    sl = operator.get_slice(ns, name)
    assert sl["spec"]["migProfile"] == "1g.10gb"
    assert sl["status"]["profile"] == "1g.10gb" and sl["status"]["deviceUUID"].startswith("MIG-")
    claim = operator.custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == ("gpu.cdmo.io", mig.name, sl["metadata"]["uid"])
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod.metadata.uid]
    check_invariants(operator)


@pytest.mark.compat
def test_an_opted_out_namespace_keeps_its_mig_resources_for_a_device_plugin(operator: OperatorHarness) -> None:
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    operator.core.patch_namespace(ns, {"metadata": {"labels": {"cdmo.io/mig-requests": "off"}}})
    created = operator.core.create_namespaced_pod(ns, mig_pod("static", {"nvidia.com/mig-1g.10gb": "1"}))
    assert created.spec.containers[1].resources.limits == {"nvidia.com/mig-1g.10gb": "1", "cpu": "200m"}
    assert not created.spec.scheduling_gates and not created.spec.resource_claims
    assert "cdmo.io/gpu-slice" not in (created.metadata.labels or {})
    assert not operator.custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]


@pytest.mark.parametrize(("limits", "annotations", "fragments"), [
    ({"nvidia.com/mig-1g.10gb": "17"}, None, ["'nvidia.com/mig-1g.10gb': '17'", "from 1 to 16", "e.g. "]),
    ({"nvidia.com/mig-1g.10gb": "0"}, None, ["'nvidia.com/mig-1g.10gb': '0'", "from 1 to 16"]),
    ({"nvidia.com/mig-huge": "1"}, None, ["'nvidia.com/mig-huge'", "is not a MIG profile name"]),
    ({"nvidia.com/mig-1g.10gb": "1"}, {"cdmo.io/gpu-memory": "4G"}, ["cdmo.io/gpu-memory: '4G'", "one or the other"]),
    ({"cpu": "1"}, {"cdmo.io/gpu": "1"}, ["annotation cdmo.io/gpu: '1' is not a slice annotation",
                                          "cdmo.io/gpu-memory, cdmo.io/gpu-fraction, cdmo.io/mig-profile"]),
])
@pytest.mark.compat
def test_what_is_not_served_is_refused_naming_the_key_and_value(operator: OperatorHarness, limits: dict[str, str],
                                                                  annotations: dict[str, str] | None,
                                                                  fragments: list[str]) -> None:
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    with pytest.raises(ApiException) as refused:
        operator.core.create_namespaced_pod(ns, mig_pod("bad", limits, annotations))
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 400, message
    for fragment in fragments:
        assert fragment in message, message
    assert operator.core.list_namespaced_pod(ns).items == []


def _claim_device(operator: OperatorHarness, ns: str, name: str) -> tuple[str, str]:
    claim = operator.custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    return result["pool"], result["device"]


def test_two_containers_get_a_device_each_and_see_only_their_own(operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb")
    start(operator, mig)
    ns = operator.namespace()
    body = mig_pod("pair", {"nvidia.com/mig-1g.10gb": "1"})
    body["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-2g.20gb"] = "1"
    operator.core.create_namespaced_pod(ns, body)
    pod = running(operator, ns, "pair")
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    assert [(c.name, c.resource_claim_name) for c in pod.spec.resource_claims] == [
        ("gpu-slice-0", f"{group}-0"), ("gpu-slice-1", f"{group}-1")]
    sidecar, train = pod.spec.containers
    # Devices in container order: the sidecar's 2g.20gb is device 0, train's 1g.10gb device 1.
    assert [c.name for c in sidecar.resources.claims] == ["gpu-slice-0"]
    assert [c.name for c in train.resources.claims] == ["gpu-slice-1"]
    slices = [operator.get_slice(ns, f"{group}-{k}") for k in (0, 1)]
    assert [s["status"]["profile"] for s in slices] == ["2g.20gb", "1g.10gb"]
    assert {s["status"]["node"] for s in slices} == {mig.name} == {pod.spec.node_name}
    assert slices[0]["status"]["deviceUUID"] != slices[1]["status"]["deviceUUID"]
    for k, sl in enumerate(slices):
        assert sl["metadata"]["annotations"]["cdmo.io/group"] == group
        assert _claim_device(operator, ns, f"{group}-{k}") == (mig.name, sl["metadata"]["uid"])
    check_invariants(operator)


def test_a_device_count_annotation_gives_the_pod_that_many_slices(operator: OperatorHarness) -> None:
    mig = operator.add_node("a100-40gb")
    start(operator, mig)
    ns = operator.namespace()
    operator.core.create_namespaced_pod(ns, mig_pod("counted", {}, {"cdmo.io/gpu-memory": "4G",
                                                                    "cdmo.io/gpu-count": "3"}))
    pod = running(operator, ns, "counted")
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    for c in pod.spec.containers:
        assert [x.name for x in c.resources.claims] == ["gpu-slice-0", "gpu-slice-1", "gpu-slice-2"]
    devices = {operator.get_slice(ns, f"{group}-{k}")["status"]["deviceUUID"] for k in range(3)}
    assert len(devices) == 3


def test_two_four_device_pods_racing_for_six_gpus_one_runs_the_other_waits_holding_nothing(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=6)
    start(operator, node)
    ns = operator.namespace()
    for name in ("left", "right"):
        operator.core.create_namespaced_pod(ns, mig_pod(name, {"nvidia.com/mig-7g.80gb": "4"}))

    def settled() -> tuple[str, str] | None:
        pods = {n: operator.core.read_namespaced_pod(n, ns) for n in ("left", "right")}
        ran = [n for n, p in pods.items() if p.status.phase == "Running"]
        if len(ran) != 1:
            return None
        other = "right" if ran[0] == "left" else "left"
        group = pods[other].metadata.labels["cdmo.io/gpu-slice"]
        slices = [operator.get_slice(ns, f"{group}-{k}") for k in range(4)]
        if not all(s and (s.get("status") or {}).get("reason") for s in slices):
            return None
        return ran[0], other

    winner, waiting = wait_until(settled, 60, lambda: f"one pod running, the other waiting\n{operator.logs()}")
    pod = operator.core.read_namespaced_pod(waiting, ns)
    assert any(g.name == "cdmo.io/gpu-slice" for g in pod.spec.scheduling_gates)
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    for k in range(4):
        st = operator.get_slice(ns, f"{group}-{k}")["status"]
        assert st["phase"] == "Pending" and st["reason"] == "NoCapacity" and "node" not in st, st
        assert "on one node" in st["message"] and "holding none" in st["message"]
    # The winner's four instances are on four GPUs (the simulator's own state); the waiting pod holds none.
    backend = node.backend()
    assert sum(1 for gpu in backend.gpus() if backend.instances(gpu.index)) == 4
    operator.core.delete_namespaced_pod(winner, ns, grace_period_seconds=0)
    running(operator, ns, waiting, timeout=60)


def test_whole_gpus_in_an_opted_in_namespace_are_full_size_slices_on_one_node(operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb", count=2)
    plain = operator.add_node("l40s-48gb", count=2, labelled=False)
    start(operator, mig, plain)
    ns = operator.namespace()
    operator.core.patch_namespace(ns, {"metadata": {"labels": {"cdmo.io/whole-gpus": "on"}}})
    for name, node in (("on-mig", mig), ("on-plain", plain)):
        body = mig_pod(name, {"nvidia.com/gpu": "2"})
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
        operator.core.create_namespaced_pod(ns, body)
    pod = running(operator, ns, "on-mig")
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    statuses = [operator.get_slice(ns, f"{group}-{k}")["status"] for k in (0, 1)]
    # A MIG GPU's whole is its full-size profile: all 8 memory slots of an H100, one per GPU.
    assert [s["profile"] for s in statuses] == ["7g.80gb", "7g.80gb"]
    assert sorted(s["gpu"] for s in statuses) == [0, 1] and {s["node"] for s in statuses} == {mig.name}
    assert [c.name for c in pod.spec.containers[1].resources.claims] == ["gpu-slice-0", "gpu-slice-1"]
    assert "nvidia.com/gpu" not in (pod.spec.containers[1].resources.limits or {})
    pod = running(operator, ns, "on-plain")
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    statuses = [operator.get_slice(ns, f"{group}-{k}")["status"] for k in (0, 1)]
    # Without MIG, the whole GPU: a fraction of 1 holding all its memory, nothing else beside it.
    assert [(s["mode"], s["grantedBytes"]) for s in statuses] == [("fraction", 46068 * 2**20)] * 2
    assert sorted(s["gpu"] for s in statuses) == [0, 1]
    check_invariants(operator)


def test_whole_gpus_elsewhere_are_left_to_the_device_plugin(operator: OperatorHarness) -> None:
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    created = operator.core.create_namespaced_pod(ns, mig_pod("plugin", {"nvidia.com/gpu": "1"}))
    assert created.spec.containers[1].resources.limits == {"nvidia.com/gpu": "1", "cpu": "200m"}
    assert not created.spec.scheduling_gates and not created.spec.resource_claims


def test_a_group_half_bound_when_the_controller_died_is_completed_on_its_node(operator: OperatorHarness) -> None:
    """The controller writes a group's bindings one by one; killed after the first, its successor binds
    the rest beside it (never on another node), so the pod's devices end on one node."""
    nodes = [operator.add_node("h100-80gb"), operator.add_node("h100-80gb")]
    for node in nodes:
        operator.agent(node)
    for node in nodes:
        operator.wait_gpunode(node)
    controller = operator.controller({"MIG_OPERATOR_CRASHPOINT": "controller:after-bind"})
    ns = operator.namespace()
    group = {"cdmo.io/group": "job", "cdmo.io/group-size": "2"}
    for k in (0, 1):
        operator.custom.create_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices", {
            "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
            "metadata": {"name": f"job-{k}", "annotations": group}, "spec": {"migProfile": "3g.40gb"}})
    assert operator.wait_exit(controller) == -9
    phases = [(operator.get_slice(ns, f"job-{k}").get("status") or {}).get("phase") for k in (0, 1)]
    assert sorted(phases, key=str) == sorted(["Bound", None], key=str), phases
    operator.start(controller, env={})
    statuses = [operator.wait_phase(ns, f"job-{k}", "Ready")["status"] for k in (0, 1)]
    assert statuses[0]["node"] == statuses[1]["node"]
    assert {s["placement"]["start"] for s in statuses} == {0, 4}
    check_invariants(operator)
