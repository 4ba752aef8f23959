"""The pod path's pure parts: what the webhook adds or refuses, the slice name, the ConfigMap's
environment, the ungate-and-pin patch, the webhook configuration and its certificate."""

from __future__ import annotations

import copy
import datetime
import ipaddress
import re

import jsonpatch
import pytest
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.environment import SHIM_PATH_IN_CONTAINER, gpu_mem_limit_gb, slice_environment
from mig_operator.core.quantities import QuantityError
from mig_operator.kube.controller.pods import slice_spec_for, ungate_ops
from mig_operator.kube.webhook.admission import PodRefused, ShimMount, check_pod, mutate_pod, slice_name_for
from mig_operator.kube.webhook.certs import make_certificate
from mig_operator.kube.webhook.server import MATCH_EXPRESSION, WebhookOptions, webhook_configuration

GATE = "cdmo.io/gpu-slice"
# A DNS subdomain (the slice's and ConfigMap's name) that is also a label value (the pod's label).
SLICE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def pod(annotations: dict | None = None, **spec: object) -> dict:
    return {"metadata": {"name": "train", "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "image": "x"}], **spec}}


# --- what the webhook refuses -------------------------------------------------------------------


def test_a_pod_without_slice_annotations_asks_for_nothing() -> None:
    assert check_pod(pod({"team": "a"})) is None
    assert check_pod({"metadata": {}}) is None


@pytest.mark.parametrize(("annotations", "words"), [
    ({"cdmo.io/gpu-memory": "4X"}, ["cdmo.io/gpu-memory", "'4X'", "4Gi"]),
    ({"cdmo.io/gpu-fraction": "1.5"}, ["cdmo.io/gpu-fraction", "1.5", "0.5"]),
    ({"cdmo.io/mig-profile": "2G.35GB"}, ["cdmo.io/mig-profile", "2G.35GB", "2g.35gb"]),
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/mig-profile": "1g.10gb"}, ["only one of"]),
    ({"cdmo.io/gpu-memroy": "4G"}, ["cdmo.io/gpu-memroy", "not a slice annotation"]),
])
def test_bad_annotations_are_refused_naming_the_annotation_the_value_and_an_example(annotations, words) -> None:
    with pytest.raises(QuantityError) as refused:
        check_pod(pod(annotations))
    for word in words:
        assert word in str(refused.value)


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"])
@pytest.mark.parametrize("kind", ["limits", "requests"])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_pod_asking_for_device_plugin_gpus_too_is_refused(resource: str, kind: str, where: str) -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"})
    body["spec"][where] = [{"name": "c", "resources": {kind: {resource: "1"}}}]
    with pytest.raises(PodRefused) as refused:
        check_pod(body)
    assert resource in str(refused.value) and "'c'" in str(refused.value)


def test_other_resources_are_fine_and_the_request_is_parsed() -> None:
    body = pod({"cdmo.io/gpu-memory": "17Gi"}, containers=[{"name": "c", "resources": {"limits": {"cpu": "2"}}}])
    request = check_pod(body)
    assert request is not None and request.memory_bytes == 17 * 2**30


def test_a_pod_that_names_its_node_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(PodRefused) as refused:
        check_pod(pod({"cdmo.io/gpu-memory": "4G"}, nodeName="gpu-1"))
    assert "spec.nodeName" in str(refused.value) and "'gpu-1'" in str(refused.value)


# --- what the webhook adds ----------------------------------------------------------------------


def test_mutation_adds_gate_label_env_from_and_read_only_shim_to_every_container() -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"}, initContainers=[{"name": "init", "image": "x", "envFrom": [
        {"secretRef": {"name": "s"}}]}], volumes=[{"name": "data", "emptyDir": {}}],
        schedulingGates=[{"name": "other.io/gate"}])
    mutate_pod(body, "train-gs-1234abcd", ShimMount("/host/shim", "/opt/shim"))
    spec = body["spec"]
    assert body["metadata"]["labels"] == {"cdmo.io/gpu-slice": "train-gs-1234abcd"}
    assert spec["schedulingGates"] == [{"name": "other.io/gate"}, {"name": GATE}]
    assert spec["volumes"] == [{"name": "data", "emptyDir": {}},
                               {"name": "cdmo-shim", "hostPath": {"path": "/host/shim", "type": "Directory"}}]
    for container in spec["containers"] + spec["initContainers"]:
        assert container["envFrom"][-1] == {"configMapRef": {"name": "train-gs-1234abcd"}}
        assert container["volumeMounts"] == [{"name": "cdmo-shim", "mountPath": "/opt/shim", "readOnly": True}]
    assert spec["initContainers"][0]["envFrom"][0] == {"secretRef": {"name": "s"}}, "existing envFrom kept first"


def test_mutation_is_idempotent() -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"})
    mutate_pod(body, "a-gs-00000000")
    once = copy.deepcopy(body)
    mutate_pod(body, "b-gs-11111111")
    assert body == once


# Pod names are DNS subdomains; generateName prefixes may end in "-" or ".".
@given(st.from_regex(r"[a-z0-9]([-a-z0-9]{0,60}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,60}[a-z0-9])?){0,3}[-.]?",
                     fullmatch=True) | st.just(""),
       st.booleans())
@settings(max_examples=150, deadline=None)
def test_slice_names_are_valid_label_values_and_dns_names(base: str, generated: bool) -> None:
    meta = {"generateName": base} if generated else {"name": base}
    name = slice_name_for({"metadata": meta}, token="0a1b2c3d")
    assert len(name) <= 63 and SLICE_NAME.match(name), name
    assert name.endswith("-gs-0a1b2c3d")


def test_slice_names_differ_for_pods_made_from_one_generate_name() -> None:
    names = {slice_name_for({"metadata": {"generateName": "worker-"}}) for _ in range(200)}
    assert len(names) == 200 and all(n.startswith("worker-gs-") for n in names)


# --- the GpuSlice a pod gets and the environment its containers see -------------------------------


@pytest.mark.parametrize(("annotations", "spec"), [
    ({"cdmo.io/gpu-memory": "4G"}, {"memory": "4G"}),
    ({"cdmo.io/gpu-fraction": "0.25"}, {"fraction": 0.25}),
    ({"cdmo.io/mig-profile": "1g.10gb"}, {"migProfile": "1g.10gb"}),
])
def test_a_pods_annotation_becomes_its_slice_spec(annotations: dict, spec: dict) -> None:
    assert slice_spec_for(annotations) == spec


def test_mig_slices_get_only_their_device() -> None:
    assert slice_environment("mig", "MIG-abc", 10 * 2**30, "ns", "s") == {"NVIDIA_VISIBLE_DEVICES": "MIG-abc"}


@pytest.mark.parametrize(("granted", "gb"), [(4 * 2**30, "4.29"), (4 * 10**9, "4"), (10**9 + 6 * 10**6, "1.01"),
                                             (1, "0"), (123_456_789_012, "123.46")])
def test_fraction_slices_get_the_shim_and_their_limit(granted: int, gb: str) -> None:
    env = slice_environment("fraction", "GPU-1", granted, "team-a", "train")
    assert env == {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "LD_PRELOAD": SHIM_PATH_IN_CONTAINER,
                   "CDMO_GPU_MEMORY_LIMIT": str(granted), "GPU_MEM_LIMIT_GB": gb, "CDMO_SLICE": "team-a/train"}
    assert gpu_mem_limit_gb(granted) == gb
    assert SHIM_PATH_IN_CONTAINER.endswith("/libgpuslice.so")


def test_an_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="'whole'"):
        slice_environment("whole", "GPU-1", 1, "ns", "s")


# --- releasing the pod: one patch removes the gate and pins the node ---------------------------


def _gated(**spec: object) -> dict:
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}],
                                                "schedulingGates": [{"name": "a/b"}, {"name": GATE}], **spec}}


def _required(body: dict) -> dict:
    return body["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_ungating_a_pod_without_affinity_pins_it_by_node_name_and_keeps_other_gates() -> None:
    body = _gated()
    after = jsonpatch.apply_patch(body, ungate_ops(body, "gpu-7"))
    assert after["spec"]["schedulingGates"] == [{"name": "a/b"}]
    assert _required(after) == {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}]}


@pytest.mark.parametrize("affinity", [{"podAffinity": {}}, {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuring"
                                                                                "Execution": []}}])
def test_ungating_adds_required_node_affinity_beside_what_is_there(affinity: dict) -> None:
    body = _gated(affinity=copy.deepcopy(affinity))
    after = jsonpatch.apply_patch(body, ungate_ops(body, "gpu-7"))
    assert _required(after)["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-7"]
    for key, value in affinity.items():
        for inner, v in value.items():
            assert after["spec"]["affinity"][key][inner] == v


def test_ungating_a_pod_with_required_terms_adds_the_node_to_every_term() -> None:
    terms = [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
             {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}]
    body = _gated(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": copy.deepcopy(terms)}}})
    after = jsonpatch.apply_patch(body, ungate_ops(body, "gpu-7"))
    host = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-7"]}
    got = _required(after)["nodeSelectorTerms"]
    assert got[0]["matchExpressions"] == [*terms[0]["matchExpressions"], host]
    assert got[1]["matchExpressions"] == [host] and got[1]["matchFields"] == terms[1]["matchFields"]


def test_ungating_tests_the_gate_first_so_a_changed_pod_is_not_patched_blindly() -> None:
    body = _gated()
    ops = ungate_ops(body, "n")
    assert ops[0] == {"op": "test", "path": "/spec/schedulingGates/1", "value": {"name": GATE}}
    moved = _gated()
    moved["spec"]["schedulingGates"].reverse()
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, ops)


# --- the webhook configuration and its certificate -------------------------------------------------


def test_only_annotated_pods_outside_the_operators_namespace_are_sent() -> None:
    config = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"), b"CA")
    hook = config["webhooks"][0]
    assert hook["matchConditions"] == [{"name": "asks-for-a-gpu-slice", "expression": MATCH_EXPRESSION}]
    for key in ("cdmo.io/gpu-", "cdmo.io/mig-profile", "has(object.metadata.annotations)"):
        assert key in MATCH_EXPRESSION
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["ops"]}]}
    assert hook["rules"][0]["operations"] == ["CREATE"] and hook["rules"][0]["resources"] == ["pods"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9443/gpu-slice", "caBundle": "Q0E="}


def test_in_a_cluster_the_configuration_points_at_the_service() -> None:
    config = webhook_configuration(WebhookOptions(listen="0.0.0.0:9443", namespace="ops",
                                                  service="ops/mig-operator-webhook:443"), b"CA")
    assert config["webhooks"][0]["clientConfig"]["service"] == {
        "namespace": "ops", "name": "mig-operator-webhook", "port": 443, "path": "/gpu-slice"}


def test_the_certificate_covers_its_hosts_and_chains_to_its_ca() -> None:
    bundle = make_certificate(["127.0.0.1", "svc.ns.svc"])
    ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["svc.ns.svc"]
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)
    with pytest.raises(ValueError, match="127.0.0.1"):
        make_certificate([])
