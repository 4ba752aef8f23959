"""Requests people already write (issue 17): a container's nvidia.com/mig-<profile>: 1 is served as a
MIG slice for that container, a namespace may opt out, and an unknown cdmo.io/* annotation is
refused. On the local control plane: the API server evaluates the webhook configuration's CEL
matchConditions and namespaceSelector, kube-scheduler allocates the slice's claim."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import OperatorHarness, check_invariants
from kubernetes.client.rest import ApiException
from test_pods import KWOK_TOLERATION, running, start


def mig_pod(name: str, limits: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"tolerations": [KWOK_TOLERATION], "containers": [
                {"name": "sidecar", "image": "busybox", "resources": {"limits": {"cpu": "100m"}}},
                {"name": "train", "image": "busybox", "resources": {"limits": {**limits, "cpu": "200m"}}},
            ]}}


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
    ({"nvidia.com/mig-1g.10gb": "2"}, None, ["asks for 2 MIG devices", "nvidia.com/mig-1g.10gb", "e.g. "]),
    ({"nvidia.com/mig-huge": "1"}, None, ["'nvidia.com/mig-huge'", "is not a MIG profile name"]),
    ({"nvidia.com/mig-1g.10gb": "1"}, {"cdmo.io/gpu-memory": "4G"}, ["cdmo.io/gpu-memory: '4G'", "one or the other"]),
    ({"cpu": "1"}, {"cdmo.io/gpu": "1"}, ["annotation cdmo.io/gpu: '1' is not a slice annotation",
                                          "cdmo.io/gpu-memory, cdmo.io/gpu-fraction, cdmo.io/mig-profile"]),
])
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
