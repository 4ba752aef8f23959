"""nvidia.com/mig-<profile> requests served as MIG slices (issue 17, item 1): what is read from a pod,
what is refused, and the pod the webhook lets through."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mig_operator.core.pod_admission import check_pod
from mig_operator.core.request import SliceRequest
from mig_operator.core.request_forms import RequestFormError, mig_resource_request, without_mig_resources
from mig_operator.kube.common.names import POD_CLAIM_ENTRY, POD_SLICE_LABEL, SCHEDULING_GATE
from mig_operator.kube.webhook.admission import serve_mig_request, with_mig_request
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
    assert asked.profile == "1g.10gb" and asked.containers == ("train",)
    annotations = asked.annotations()
    assert annotations["cdmo.io/mig-profile"] == "1g.10gb"
    assert json.loads(annotations["cdmo.io/requested-resources"]) == {"train": {"nvidia.com/mig-1g.10gb": "1"}}


def test_requests_alone_or_equal_to_limits_are_read() -> None:
    only_requests = pod(container("a", requests={"nvidia.com/mig-3g.40gb": "1"}))
    assert mig_resource_request(only_requests).profile == "3g.40gb"
    both = pod(container("a", {"nvidia.com/mig-3g.40gb": "1"}, {"nvidia.com/mig-3g.40gb": "1"}))
    assert mig_resource_request(both).profile == "3g.40gb"


def test_an_init_container_asking_is_the_one_that_gets_it() -> None:
    asked = mig_resource_request(pod(container("main"), init=[container("warm", {"nvidia.com/mig-1g.18gb+me": 1})]))
    assert asked.profile == "1g.18gb+me" and asked.containers == ("warm",)


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


@pytest.mark.parametrize("body", [
    pod(container("a", {"nvidia.com/mig-1g.10gb": "2"})),
    pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}), container("b", {"nvidia.com/mig-1g.10gb": "1"})),
    pod(container("a", {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-2g.20gb": "1"})),
    pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}), init=[container("i", {"nvidia.com/mig-1g.10gb": "1"})]),
])
def test_more_than_one_device_in_all_is_refused_not_halved(body: dict[str, Any]) -> None:
    with pytest.raises(RequestFormError, match=r"asks for 2 MIG devices .*one device per pod is served"):
        mig_resource_request(body)


def test_an_annotation_and_a_mig_resource_together_are_refused() -> None:
    body = pod(container("a", {"nvidia.com/mig-1g.10gb": "1"}), annotations={"cdmo.io/gpu-memory": "4G"})
    with pytest.raises(RequestFormError, match="annotation cdmo.io/gpu-memory: '4G' and for container 'a'"):
        mig_resource_request(body)


def test_without_mig_resources_keeps_every_other_resource() -> None:
    c = container("a", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"}, {"nvidia.com/mig-1g.10gb": "1"})
    assert without_mig_resources(c) == {"limits": {"cpu": "1"}}
    assert without_mig_resources(container("b", {"nvidia.com/mig-1g.10gb": "1"})) == {}


def test_the_pod_goes_on_as_an_annotated_pod_whose_claim_reaches_only_the_asking_container() -> None:
    body = pod(container("sidecar", {"cpu": "1"}), container("train", {"nvidia.com/mig-1g.10gb": "1", "cpu": "2"}),
               init=[container("setup")])
    asked = mig_resource_request(body)
    # The admission check sees the pod as it goes on: a MIG slice request, no device-plugin resource left.
    assert check_pod(with_mig_request(body, asked)) == SliceRequest(profile="1g.10gb")
    assert "nvidia.com/mig-1g.10gb" in body["spec"]["containers"][1]["resources"]["limits"]  # the copy only
    serve_mig_request(body, asked, "p-gs-0000abcd")
    sidecar, train = body["spec"]["containers"]
    assert train["resources"] == {"limits": {"cpu": "2"}, "claims": [{"name": POD_CLAIM_ENTRY}]}
    assert sidecar["resources"] == {"limits": {"cpu": "1"}}
    assert "resources" not in body["spec"]["initContainers"][0]
    assert body["spec"]["resourceClaims"] == [{"name": POD_CLAIM_ENTRY, "resourceClaimName": "p-gs-0000abcd"}]
    assert body["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]
    assert body["metadata"]["labels"] == {POD_SLICE_LABEL: "p-gs-0000abcd"}
    assert body["metadata"]["annotations"]["cdmo.io/mig-profile"] == "1g.10gb"


def test_the_mig_entry_leaves_out_opted_out_namespaces_and_honours_the_list() -> None:
    config = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"), b"CA")
    first, mig = config["webhooks"]
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
