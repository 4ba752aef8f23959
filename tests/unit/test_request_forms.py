"""nvidia.com/mig-<profile> requests served as MIG slices (issue 17, item 1): what is read from a pod,
what is refused, and the pod the webhook lets through."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mig_operator.core.requests.pod_admission import PodRefused, check_pod_devices
from mig_operator.core.requests.request import SliceRequest
from mig_operator.core.requests.request_forms import (
    PodDevice,
    RequestFormError,
    device_slice_names,
    mig_resource_request,
    pod_devices,
    resource_form,
    without_resources,
)
from mig_operator.kube.common.names import POD_CLAIM_ENTRY, POD_SLICE_LABEL, SCHEDULING_GATE
from mig_operator.kube.webhook.admission import mutate_pod, serve_mig_request, with_mig_request
from mig_operator.kube.webhook.server import (
    MIG_MATCH_EXPRESSION,
    WebhookOptions,
    webhook_configuration,
)


def pod(*containers: dict[str, Any], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": list(containers)}}
    if init:
        body["spec"]["initContainers"] = init
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


def container(name: str, limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None) -> dict:
    resources = {k: v for k, v in (("limits", limits), ("requests", requests)) if v is not None}
    return {"name": name, "image": "x", **({"resources": resources} if resources else {})}


def test_a_pod_without_mig_resources_asks_for_nothing() -> None:
    assert mig_resource_request(pod(container("a"))) is None
    assert mig_resource_request(pod(container("a", {"cpu": "1", "nvidia.com/gpu-x": "1"}))) is None
    # An extended resource of another vendor that merely looks similar is not ours.
    assert mig_resource_request(pod(container("a", {"example.com/mig-1g.10gb": "1"}))) is None


@pytest.mark.parametrize("value", ["1", 1, " 1 "])
def test_one_mig_device_in_one_container(value: object) -> None:
    body = pod(container("sidecar", {"cpu": "1"}), container("train", {"nvidia.com/mig-1g.10gb": value, "cpu": "2"}))
    asked = mig_resource_request(body)
    assert asked is not None
    annotations = asked.annotations()
    assert json.loads(annotations["cdmo.io/requested-resources"]) == {"train": {"nvidia.com/mig-1g.10gb": "1"}}
    assert pod_devices(annotations) == (
        PodDevice({"migProfile": "1g.10gb"}, SliceRequest(profile="1g.10gb"), ("train",)),)


def test_requests_alone_or_equal_to_limits_are_read() -> None:
    only_requests = pod(container("a", requests={"nvidia.com/mig-3g.40gb": "1"}))
    assert mig_resource_request(only_requests).asked == {"a": {"nvidia.com/mig-3g.40gb": "1"}}
    both = pod(container("a", {"nvidia.com/mig-3g.40gb": "1"}, {"nvidia.com/mig-3g.40gb": "1"}))
    assert mig_resource_request(both).asked == {"a": {"nvidia.com/mig-3g.40gb": "1"}}


def test_an_init_container_asking_is_the_one_that_gets_it() -> None:
    asked = mig_resource_request(pod(container("main"), init=[container("warm", {"nvidia.com/mig-1g.18gb+me": 1})]))
    [device] = pod_devices(asked.annotations())
    assert device.spec == {"migProfile": "1g.18gb+me"} and device.containers == ("warm",)


def test_each_container_gets_its_own_devices_in_container_then_resource_order() -> None:
    body = pod(container("b", {"nvidia.com/mig-2g.20gb": "1", "nvidia.com/mig-1g.10gb": "2"}),
               container("a", {"nvidia.com/mig-1g.10gb": "1"}))
    devices = pod_devices(mig_resource_request(body).annotations())
    assert [(d.spec["migProfile"], d.containers) for d in devices] == [
        ("1g.10gb", ("a",)), ("1g.10gb", ("b",)), ("1g.10gb", ("b",)), ("2g.20gb", ("b",))]


def test_sixteen_devices_are_served_and_seventeen_refused() -> None:
    sixteen = pod(container("a", {"nvidia.com/mig-1g.10gb": "8"}), container("b", {"nvidia.com/mig-1g.10gb": "8"}))
    assert len(pod_devices(mig_resource_request(sixteen).annotations())) == 16
    seventeen = pod(container("a", {"nvidia.com/mig-1g.10gb": "8"}), container("b", {"nvidia.com/mig-1g.10gb": "9"}))
    with pytest.raises(RequestFormError, match="asks for 17 devices .* at most 16"):
        mig_resource_request(seventeen)
    with pytest.raises(RequestFormError, match="from 1 to 16"):
        mig_resource_request(pod(container("a", {"nvidia.com/mig-1g.10gb": "17"})))


@pytest.mark.parametrize(("count", "expected"), [(None, 1), ("1", 1), ("2", 2), ("16", 16)])
def test_a_device_count_beside_a_request_annotation(count: str | None, expected: int) -> None:
    annotations = {"cdmo.io/gpu-memory": "4G", **({"cdmo.io/gpu-count": count} if count else {})}
    devices = pod_devices(annotations)
    assert devices == (PodDevice({"memory": "4G"}, SliceRequest(memory_bytes=4 * 10**9), None),) * expected


@pytest.mark.parametrize(("annotations", "fragment"), [
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-count": "0"}, "cdmo.io/gpu-count: '0' is not a device count"),
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-count": "17"}, "cdmo.io/gpu-count: '17' is not a device count"),
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-count": "two"}, "cdmo.io/gpu-count: 'two' is not a device count"),
    ({"cdmo.io/gpu-count": "2"}, "cdmo.io/gpu-count: '2' goes beside a request"),
    ({"cdmo.io/requested-resources": "{}"}, "is not what the webhook records"),
    ({"cdmo.io/requested-resources": "nonsense"}, "is not what the webhook records"),
    ({"cdmo.io/requested-resources": '{"a":{"example.com/gpu":"1"}}'}, "'example.com/gpu' is not a nvidia.com/mig-*"),
    ({"cdmo.io/requested-resources": '{"a":{"nvidia.com/mig-1g.10gb":"0"}}'}, "a MIG device count"),
    ({"cdmo.io/mig-profile": "1g.10gb", "cdmo.io/requested-resources": '{"a":{"nvidia.com/mig-1g.10gb":"1"}}'},
     "keep one of the two"),
])
def test_bad_counts_and_records_are_refused_naming_the_value(annotations: dict[str, str], fragment: str) -> None:
    with pytest.raises(RequestFormError) as caught:
        pod_devices(annotations)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "one", "", True, None, "1e3"])
def test_a_bad_device_count_is_refused_naming_container_key_and_value(value: object) -> None:
    with pytest.raises(RequestFormError) as caught:
        mig_resource_request(pod(container("train", {"nvidia.com/mig-1g.10gb": value})))
    message = str(caught.value)
    assert "container 'train' asks for 'nvidia.com/mig-1g.10gb'" in message and repr(value) in message
    assert "e.g. nvidia.com/mig-2g.35gb: 1" in message


@pytest.mark.parametrize("key", ["nvidia.com/mig-", "nvidia.com/mig-big", "nvidia.com/mig-1g.10gb.extra",
                                 "nvidia.com/mig-1G.10GB"])
def test_a_resource_that_names_no_profile_is_refused(key: str) -> None:
    with pytest.raises(RequestFormError, match="is not a MIG profile name"):
        mig_resource_request(pod(container("train", {key: "1"})))


def test_limits_and_requests_that_differ_are_refused() -> None:
    with pytest.raises(RequestFormError, match="with limits '1' and requests '2'"):
        mig_resource_request(pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}, {"nvidia.com/mig-1g.10gb": "2"})))


def test_an_annotation_and_a_mig_resource_together_are_refused() -> None:
    body = pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}), annotations={"cdmo.io/gpu-memory": "4G"})
    with pytest.raises(RequestFormError, match="annotation cdmo.io/gpu-memory: '4G' and for container 'a'"):
        mig_resource_request(body)


def test_without_mig_resources_keeps_every_other_resource() -> None:
    c = container("a", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, {"nvidia.com/mig-1g.10gb": "1"})
    assert without_resources(c, resource_form(False)) == {"limits": {"cpu": "1"}}
    assert without_resources(container("b", {"nvidia.com/mig-1g.10gb": "1"}), resource_form(False)) == {}


def test_the_pod_goes_on_with_its_record_and_the_claim_reaches_only_the_asking_container() -> None:
    body = pod(container("sidecar", {"cpu": "1"}), container("train", {"nvidia.com/mig-1g.10gb": "1", "cpu": "2"}),
               init=[container("setup")])
    asked = mig_resource_request(body)
    # The admission check sees the pod as it goes on: a MIG slice request, no device-plugin resource left.
    devices = check_pod_devices(with_mig_request(body, asked))
    assert [d.request for d in devices] == [SliceRequest(profile="1g.10gb")]
    assert "nvidia.com/mig-1g.10gb" in body["spec"]["containers"][1]["resources"]["limits"]  # the copy only
    serve_mig_request(body, asked, "p-gs-0000abcd", devices)
    sidecar, train = body["spec"]["containers"]
    assert train["resources"] == {"limits": {"cpu": "2"}, "claims": [{"name": POD_CLAIM_ENTRY}]}
    assert sidecar["resources"] == {"limits": {"cpu": "1"}}
    assert "resources" not in body["spec"]["initContainers"][0]
    assert body["spec"]["resourceClaims"] == [{"name": POD_CLAIM_ENTRY, "resourceClaimName": "p-gs-0000abcd"}]
    assert body["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]
    assert body["metadata"]["labels"] == {POD_SLICE_LABEL: "p-gs-0000abcd"}
    assert "cdmo.io/mig-profile" not in body["metadata"]["annotations"]


def test_several_devices_get_numbered_claims_and_each_container_only_its_own() -> None:
    body = pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}), container("b", {"nvidia.com/mig-2g.20gb": "2"}),
               container("log"))
    body["spec"]["resourceClaims"] = [{"name": "gpu-slice-0", "resourceClaimName": "someone-elses"},
                                      {"name": "gpu-slice-extra", "resourceClaimName": "users-own"}]
    asked = mig_resource_request(body)
    devices = check_pod_devices(with_mig_request(body, asked))
    serve_mig_request(body, asked, "p-gs-00000001", devices)
    assert body["spec"]["resourceClaims"] == [
        {"name": "gpu-slice-extra", "resourceClaimName": "users-own"},
        {"name": "gpu-slice-0", "resourceClaimName": "p-gs-00000001-0"},
        {"name": "gpu-slice-1", "resourceClaimName": "p-gs-00000001-1"},
        {"name": "gpu-slice-2", "resourceClaimName": "p-gs-00000001-2"}]
    a, b, log = body["spec"]["containers"]
    assert a["resources"]["claims"] == [{"name": "gpu-slice-0"}]
    assert b["resources"]["claims"] == [{"name": "gpu-slice-1"}, {"name": "gpu-slice-2"}]
    assert "resources" not in log


def test_a_device_count_annotation_gives_every_container_every_device() -> None:
    body = pod(container("a"), container("b"), annotations={"cdmo.io/gpu-fraction": "0.5", "cdmo.io/gpu-count": "2"})
    devices = check_pod_devices(body)
    mutate_pod(body, "g", devices)
    assert [c["resources"]["claims"] for c in body["spec"]["containers"]] == [
        [{"name": "gpu-slice-0"}, {"name": "gpu-slice-1"}]] * 2
    assert [c["resourceClaimName"] for c in body["spec"]["resourceClaims"]] == ["g-0", "g-1"]
    assert device_slice_names("g", 1) == ("g",) and device_slice_names("g", 3) == ("g-0", "g-1", "g-2")


def test_the_mig_entry_leaves_out_opted_out_namespaces_and_honours_the_list() -> None:
    config = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"), b"CA")
    first, mig, whole = config["webhooks"]
    assert whole["name"] == "whole-gpus.cdmo.io" and whole["clientConfig"]["url"].endswith("/whole-gpus")
    assert whole["namespaceSelector"]["matchExpressions"][-1] == {
        "key": "cdmo.io/whole-gpus", "operator": "In", "values": ["on"]}
    everywhere = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops",
                                                      whole_gpus_everywhere=True), b"CA")["webhooks"][-1]
    assert everywhere["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["ops"]}]
    assert first["clientConfig"]["url"].endswith("/gpu-slice") and mig["clientConfig"]["url"].endswith("/mig-resources")
    assert mig["name"] == "mig-requests.cdmo.io"
    assert mig["matchConditions"] == [{"name": "asks-for-a-mig-device", "expression": MIG_MATCH_EXPRESSION}]
    assert mig["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["ops"]},
        {"key": "cdmo.io/mig-requests", "operator": "NotIn", "values": ["off"]}]
    listed = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops",
                                                  mig_request_namespaces=("team-a", "team-b")), b"CA")
    assert listed["webhooks"][1]["namespaceSelector"]["matchExpressions"][-1] == {
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
    assert listed["webhooks"][0] == config["webhooks"][0]


@pytest.mark.parametrize(("limits", "count"), [({"nvidia.com/gpu": "1"}, 1), ({"nvidia.com/gpu": 2}, 2)])
def test_whole_gpus_are_fraction_one_slices_for_the_asking_container(limits: dict[str, Any], count: int) -> None:
    body = pod(container("log"), container("train", {**limits, "cpu": "1"}))
    asked = mig_resource_request(body, whole_gpus=True)
    assert asked.asked == {"train": {"nvidia.com/gpu": str(count)}}
    devices = pod_devices(asked.annotations())
    # Fraction 1: all of a GPU's memory slots on MIG (7g.* on an H100), the whole GPU without MIG.
    assert devices == (PodDevice({"fraction": 1.0}, SliceRequest(fraction=1.0), ("train",)),) * count
    assert without_resources(body["spec"]["containers"][1], resource_form(True)) == {"limits": {"cpu": "1"}}
    assert without_resources(body["spec"]["containers"][1], resource_form(False)) == {"limits": {**limits, "cpu": "1"}}
    assert without_resources(container("x", {"nvidia.com/mig-1g.10gb": "1"}), resource_form(True)) == {
        "limits": {"nvidia.com/mig-1g.10gb": "1"}}


def test_whole_gpus_and_mig_devices_are_read_apart_and_never_mixed() -> None:
    assert mig_resource_request(pod(container("a", {"nvidia.com/gpu": "1"}))) is None
    assert mig_resource_request(pod(container("a", {"nvidia.com/mig-1g.10gb": "1"})), whole_gpus=True) is None
    mixed = pod(container("a", {"nvidia.com/gpu": "1"}), container("b", {"nvidia.com/mig-1g.10gb": "1"}))
    for whole_gpus, other in ((False, "nvidia.com/gpu"), (True, "nvidia.com/mig-1g.10gb")):
        with pytest.raises(RequestFormError, match=f"and for '{other}'; a pod asks for MIG devices"):
            mig_resource_request(mixed, whole_gpus=whole_gpus)


@pytest.mark.parametrize("value", ["0", "17", "1.5"])
def test_a_bad_whole_gpu_count_is_refused(value: str) -> None:
    with pytest.raises(RequestFormError, match=f"'nvidia.com/gpu': '{value}'; a GPU count is a whole number"):
        mig_resource_request(pod(container("a", {"nvidia.com/gpu": value})), whole_gpus=True)


def test_a_whole_gpu_pod_may_set_its_own_ld_preload_a_share_may_not() -> None:
    env = [{"name": "LD_PRELOAD", "value": "/opt/lib/libjemalloc.so"}]
    whole = pod({**container("a", {"nvidia.com/gpu": "1"}), "env": env})
    asked = mig_resource_request(whole, whole_gpus=True)
    assert len(check_pod_devices(with_mig_request(whole, asked, whole_gpus=True))) == 1
    share = pod({**container("a"), "env": env}, annotations={"cdmo.io/gpu-fraction": "0.99"})
    with pytest.raises(PodRefused, match="LD_PRELOAD"):
        check_pod_devices(share)
