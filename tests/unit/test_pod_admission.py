"""The pod path's pure parts: what the webhook adds or refuses, the slice name, the slice's
environment, the ungate-and-pin patch, the webhook configuration and its certificate."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import ipaddress
import re
from collections.abc import Coroutine
from typing import Any

import jsonpatch
import pytest
from books import BodyLedger
from cluster_reference import build_view, plan_binding
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st
from pod_reference import slice_spec_for

from mig_operator.core.node.environment import SHIM_PATH_IN_CONTAINER, gpu_mem_limit_gb, shim_files, slice_environment
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, GpuState, NodeInventory, Refusal
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.node_selection import constrains_nodes, node_allowed
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.pod_admission import PodRefused, check_pod
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.request import slice_request
from mig_operator.kube.common.workqueue import WorkQueue
from mig_operator.kube.controller.binder import assemble
from mig_operator.kube.controller.observe import node_record, owned_by, pod_record
from mig_operator.kube.controller.observe import slice_record as slice_info
from mig_operator.kube.controller.pod_nodes import eligible as eligible_nodes
from mig_operator.kube.controller.pod_nodes import hostname
from mig_operator.kube.controller.pods import PodSlices, ungate_ops
from mig_operator.kube.webhook.admission import mutate_pod, slice_name_for
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


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb",
                                      "nvidia.com/mig-3g.40gb"])
@pytest.mark.parametrize("kind", ["limits", "requests"])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_pod_asking_for_device_plugin_gpus_too_is_refused(resource: str, kind: str, where: str) -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"})
    body["spec"][where] = [{"name": "c", "resources": {kind: {resource: "1"}}}]
    with pytest.raises(PodRefused) as refused:
        check_pod(body)
    text = str(refused.value)
    assert resource in text and "'c'" in text
    assert "cdmo.io/gpu-memory: '4G'" in text and "e.g. cdmo.io/gpu-memory: '4Gi'" in text


def test_look_alike_resources_are_not_gpus() -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"}, containers=[{"name": "c", "resources": {"limits": {
        "nvidia.com/gpumem": "1", "example.com/nvidia.com/gpu": "1", "cpu": "1"}}}])
    assert check_pod(body) is not None


@pytest.mark.parametrize("variable", ["NVIDIA_VISIBLE_DEVICES", "CDMO_GPU_MEMORY_LIMIT", "CDMO_SLICE", "LD_PRELOAD"])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_container_that_sets_the_slices_variables_itself_is_refused(variable: str, where: str) -> None:
    # env wins over envFrom: NVIDIA_VISIBLE_DEVICES=all would show the whole GPU, another LD_PRELOAD
    # would drop the shim, and the pod would run unlimited beside the others.
    body = pod({"cdmo.io/gpu-fraction": "0.5"})
    body["spec"][where] = [{"name": "c", "image": "x", "env": [{"name": "A", "value": "1"},
                                                                {"name": variable, "value": "all"}]}]
    with pytest.raises(PodRefused) as refused:
        check_pod(body)
    text = str(refused.value)
    assert variable in text and "'c'" in text and "cdmo.io/gpu-fraction: '0.5'" in text


@pytest.mark.parametrize("variable", ["CDMO_SHIM_DISABLE", "CDMO_SHIM_DEBUG", "CDMO_SHIM_FOOTPRINT", "CDMO_",
                                      "CDMO_ANYTHING_ELSE"])
@pytest.mark.parametrize("annotation", [{"cdmo.io/gpu-fraction": "0.5"}, {"cdmo.io/mig-profile": "1g.10gb"}])
def test_every_cdmo_variable_in_a_sliced_containers_env_is_refused(variable: str, annotation: dict) -> None:
    # CDMO_SHIM_DISABLE=1 used to turn the limit off; a prefix no shim reads today is refused all the same.
    body = pod(annotation)
    body["spec"]["initContainers"] = [{"name": "init", "image": "x", "env": [{"name": variable, "value": "1"}]}]
    with pytest.raises(PodRefused) as refused:
        check_pod(body)
    text = str(refused.value)
    assert f"container 'init' sets {variable!r} in env" in text
    assert "CDMO_*" in text and "drop that env entry" in text


@pytest.mark.parametrize("variable", ["CDMO", "CDMOX_LIMIT", "cdmo_shim_disable", "XCDMO_SHIM_DISABLE",
                                      "GPU_MEM_LIMIT_GB"])
def test_names_that_only_look_like_the_operators_are_allowed(variable: str) -> None:
    body = pod({"cdmo.io/gpu-fraction": "0.5"}, containers=[{"name": "c", "env": [{"name": variable, "value": "1"}]}])
    assert check_pod(body) is not None


def test_a_mig_profile_pod_may_preload_its_own_library_and_anyone_may_set_the_informational_limit() -> None:
    env = [{"name": "LD_PRELOAD", "value": "/usr/lib/libtcmalloc.so"}, {"name": "GPU_MEM_LIMIT_GB", "value": "9"}]
    assert check_pod(pod({"cdmo.io/mig-profile": "1g.10gb"}, containers=[{"name": "c", "env": env}])) is not None
    with pytest.raises(PodRefused, match="cdmo.io/mig-profile: '2g.35gb'"):
        check_pod(pod({"cdmo.io/gpu-memory": "4G"}, containers=[{"name": "c", "env": env}]))


@pytest.mark.parametrize(("annotations", "words"), [
    ({"cdmo.io/gpu-memory": "9" * 5000}, ["cdmo.io/gpu-memory", "'9999", "(5000 characters)", "too long", "'4Gi'"]),
    ({"cdmo.io/mig-profile": "1g." + "1" * 500}, ["cdmo.io/mig-profile", "'1g.111", "(503 characters)", "'2g.35gb'"]),
    ({"cdmo.io/gpu-fraction": "0." + "5" * 500}, ["cdmo.io/gpu-fraction", "'0.555", "(502 characters)", "'0.5'"]),
    ({"cdmo.io/gpu-memory": "4G", "cdmo.io/mig-profile": "x" * 5000},
     ["cdmo.io/gpu-memory: '4G'", "cdmo.io/mig-profile: 'xxx", "(5000 characters)", "only one of", "'4Gi'"]),
])
def test_long_annotation_values_are_quoted_clipped_with_an_example(annotations: dict, words: list[str]) -> None:
    with pytest.raises(QuantityError) as refused:
        check_pod(pod(annotations))
    text = str(refused.value)
    for word in words:
        assert word in text, (word, text)
    assert len(text) < 400, text


def test_other_resources_are_fine_and_the_request_is_parsed() -> None:
    body = pod({"cdmo.io/gpu-memory": "17Gi"}, containers=[{"name": "c", "resources": {"limits": {"cpu": "2"}}}])
    request = check_pod(body)
    assert request is not None and request.memory_bytes == 17 * 2**30


def test_a_pod_that_names_its_node_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(PodRefused) as refused:
        check_pod(pod({"cdmo.io/gpu-memory": "4G"}, nodeName="gpu-1"))
    text = str(refused.value)
    assert "spec.nodeName" in text and "'gpu-1'" in text and "cdmo.io/gpu-memory: '4G'" in text
    assert "kubernetes.io/hostname" in text


# --- what the webhook adds ----------------------------------------------------------------------


def test_mutation_adds_gate_label_and_the_slices_claim_to_every_container_and_nothing_else() -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"}, initContainers=[{"name": "init", "image": "x", "envFrom": [
        {"secretRef": {"name": "s"}}]}], volumes=[{"name": "data", "emptyDir": {}}],
        schedulingGates=[{"name": "other.io/gate"}],
        resourceClaims=[{"name": "fpga", "resourceClaimName": "team-fpga"}])
    before = copy.deepcopy(body)
    mutate_pod(body, "train-gs-1234abcd")
    spec = body["spec"]
    assert body["metadata"]["labels"] == {"cdmo.io/gpu-slice": "train-gs-1234abcd"}
    assert spec["schedulingGates"] == [{"name": "other.io/gate"}, {"name": GATE}]
    assert spec["resourceClaims"] == [{"name": "fpga", "resourceClaimName": "team-fpga"},
                                      {"name": "gpu-slice", "resourceClaimName": "train-gs-1234abcd"}]
    for container in spec["containers"] + spec["initContainers"]:
        assert container["resources"]["claims"] == [{"name": "gpu-slice"}]
    # No env, no envFrom, no volume, no mount: the device and its variables come only through the claim.
    for key in ("volumes",):
        assert spec[key] == before["spec"][key]
    for got, was in zip(spec["containers"] + spec["initContainers"],
                        before["spec"]["containers"] + before["spec"]["initContainers"], strict=True):
        assert {k: v for k, v in got.items() if k != "resources"} == was


def test_a_pod_copied_from_a_sliced_pod_gets_a_slice_of_its_own() -> None:
    # `kubectl get pod -o yaml` of a running sliced pod, re-created: the label and the claim of the
    # other pod's slice come with it, its gate is long gone. It must name a claim of its own.
    original = pod({"cdmo.io/gpu-memory": "4G"}, initContainers=[{"name": "init", "image": "x"}])
    mutate_pod(original, "train-gs-00000000")
    copied = copy.deepcopy(original)
    copied["spec"]["schedulingGates"] = []
    copied["spec"]["containers"][0]["resources"]["claims"].insert(0, {"name": "own"})
    copied["spec"]["resourceClaims"].insert(0, {"name": "own", "resourceClaimName": "mine"})
    mutate_pod(copied, "train-gs-11111111")
    assert copied["metadata"]["labels"] == {"cdmo.io/gpu-slice": "train-gs-11111111"}
    assert copied["spec"]["schedulingGates"] == [{"name": GATE}]
    assert copied["spec"]["resourceClaims"] == [{"name": "own", "resourceClaimName": "mine"},
                                                {"name": "gpu-slice", "resourceClaimName": "train-gs-11111111"}]
    assert copied["spec"]["containers"][0]["resources"]["claims"] == [{"name": "own"}, {"name": "gpu-slice"}]
    assert copied["spec"]["initContainers"][0]["resources"]["claims"] == [{"name": "gpu-slice"}]


def test_mutating_twice_leaves_one_gate_and_one_claim() -> None:
    body = pod({"cdmo.io/gpu-memory": "4G"})
    mutate_pod(body, "a-gs-00000000")
    mutate_pod(body, "b-gs-11111111")
    spec = body["spec"]
    assert spec["schedulingGates"] == [{"name": GATE}]
    assert spec["resourceClaims"] == [{"name": "gpu-slice", "resourceClaimName": "b-gs-11111111"}]
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "gpu-slice"}]


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


def test_a_pod_without_a_slice_annotation_gets_no_slice_spec() -> None:
    # A pod carrying the label by hand but no annotation: not the operator's (it used to raise KeyError).
    assert slice_spec_for({}) is None and slice_spec_for({"team": "a"}) is None


def test_a_slice_is_the_pods_only_if_its_owner_reference_names_the_pods_uid() -> None:
    the_pod = {"metadata": {"name": "p", "uid": "u1"}}
    mine = {"metadata": {"ownerReferences": [{"kind": "Pod", "name": "p", "uid": "u1"}]}}
    other = {"metadata": {"ownerReferences": [{"kind": "Pod", "name": "p", "uid": "u0"}]}}
    assert owned_by(mine, the_pod) and not owned_by(other, the_pod) and not owned_by({"metadata": {}}, the_pod)


def test_mig_slices_get_no_variable_but_void_devices() -> None:
    # The device nodes come from the CDI spec; "void" keeps the NVIDIA runtime hook from adding any.
    assert slice_environment("mig", 10 * 2**30, "ns", "s") == {"NVIDIA_VISIBLE_DEVICES": "void"}


@pytest.mark.parametrize(("granted", "gb"), [(4 * 2**30, "4.29"), (4 * 10**9, "4"), (10**9 + 6 * 10**6, "1.01"),
                                             (1, "0"), (123_456_789_012, "123.46")])
def test_fraction_slices_show_their_limit_and_get_it_in_files(granted: int, gb: str) -> None:
    # The variables are for display: nothing in the environment loads the shim or sets its limit.
    env = slice_environment("fraction", granted, "team-a", "train")
    assert env == {"NVIDIA_VISIBLE_DEVICES": "void",
                   "CDMO_GPU_MEMORY_LIMIT": str(granted), "GPU_MEM_LIMIT_GB": gb, "CDMO_SLICE": "team-a/train"}
    assert gpu_mem_limit_gb(granted) == gb
    assert SHIM_PATH_IN_CONTAINER.endswith("/libgpuslice.so")
    # What the shim reads instead, and the line glibc's loader reads.
    assert shim_files(granted) == {"limit": f"{granted}\n", "ld.so.preload": f"{SHIM_PATH_IN_CONTAINER}\n"}


@pytest.mark.parametrize("granted", [0, -1, 2**64])
def test_a_limit_the_shim_would_refuse_is_not_written(granted: int) -> None:
    with pytest.raises(ValueError, match=rf"granted bytes {granted} are not a limit the shim takes; e.g. 4294967296"):
        shim_files(granted)


def test_an_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="'whole'"):
        slice_environment("whole", 1, "ns", "s")


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


def test_existing_terms_gain_the_nodes_hostname_label_which_may_differ_from_its_name() -> None:
    terms = [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
    body = _gated(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": copy.deepcopy(terms)}}})
    after = jsonpatch.apply_patch(body, ungate_ops(body, "ip-10-0-0-7.ec2.internal", "ip-10-0-0-7"))
    assert _required(after)["nodeSelectorTerms"][0]["matchExpressions"][-1] == {
        "key": "kubernetes.io/hostname", "operator": "In", "values": ["ip-10-0-0-7"]}
    bare = _gated()
    after = jsonpatch.apply_patch(bare, ungate_ops(bare, "ip-10-0-0-7.ec2.internal", "ip-10-0-0-7"))
    assert _required(after)["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["ip-10-0-0-7.ec2.internal"]


def test_ungating_tests_the_gate_first_so_a_changed_pod_is_not_patched_blindly() -> None:
    body = _gated()
    ops = ungate_ops(body, "n")
    assert ops[0] == {"op": "test", "path": "/spec/schedulingGates/1", "value": {"name": GATE}}
    moved = _gated()
    moved["spec"]["schedulingGates"].reverse()
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, ops)


# --- the slice's node: one the pod's own nodeSelector and required node affinity allow ------------

LABELS = {"kubernetes.io/hostname": "gpu-a", "pool": "train", "gpus": "8", "zone": "z1"}


def _terms(*terms: dict) -> dict:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}


@pytest.mark.parametrize(("spec", "allowed"), [
    ({}, True),
    ({"nodeSelector": {"pool": "train"}}, True),
    ({"nodeSelector": {"pool": "train", "zone": "z2"}}, False),
    ({"nodeSelector": {"missing": ""}}, False),
    ({"affinity": {"podAffinity": {}}, "nodeSelector": {}}, True),
    ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x"]}]}}]}}},
     True),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["infer", "train"]}]}), True),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["train"]}]}), False),
    (_terms({"matchExpressions": [{"key": "other", "operator": "NotIn", "values": ["train"]}]}), True),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "Exists"}]}), True),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "DoesNotExist"}]}), False),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4"]}]}), True),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Lt", "values": ["4"]}]}), False),
    (_terms({"matchExpressions": [{"key": "zone", "operator": "Gt", "values": ["4"]}]}), False),
    # Each operator on both sides and at its edges (the scheduler's nodeaffinity rules).
    (_terms({"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["infer"]}]}), True),
    (_terms({"matchExpressions": [{"key": "other", "operator": "DoesNotExist"}]}), True),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Lt", "values": ["16"]}]}), True),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Lt", "values": ["8"]}]}), False),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["8"]}]}), False),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["7"]}]}), True),
    (_terms({"matchExpressions": [{"key": "other", "operator": "Gt", "values": ["4"]}]}), False),
    (_terms({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4", "5"]}]}), False),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "Equals", "values": ["train"]}]}), False),
    (_terms({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]}), True),
    (_terms({"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-a"]}]}), False),
    # A term ANDs its requirements; terms are ORed; an empty term matches nothing.
    (_terms({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["train"]}],
             "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}]}), False),
    (_terms({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}), True),
    (_terms({}), False),
    ({"nodeSelector": {"pool": "x"}, **_terms({"matchExpressions": [{"key": "pool", "operator": "Exists"}]})}, False),
])
def test_which_nodes_a_pod_allows(spec: dict, allowed: bool) -> None:
    assert node_allowed(spec, "gpu-a", LABELS) is allowed


def test_only_a_node_selector_or_required_node_affinity_constrains_a_pods_nodes() -> None:
    assert not constrains_nodes({}) and not constrains_nodes({"nodeSelector": {}, "affinity": {"podAffinity": {}}})
    assert not constrains_nodes({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}})
    assert constrains_nodes({"nodeSelector": {"pool": "x"}})
    assert constrains_nodes(_terms({"matchExpressions": [{"key": "pool", "operator": "Exists"}]}))


def _gpu(model_name: str, index: int = 0) -> GpuState:
    model = get_model(model_name)
    return GpuState(index, f"GPU-{model_name}-{index}", model.product, model.name, model.memory_mib,
                    model.mig_capable, model.mig_capable, model.profiles if model.mig_capable else (), ())


def _planner() -> ClusterPlanner:
    planner = ClusterPlanner()
    for node, model in (("a", "h100-80gb"), ("b", "l40s-48gb"), ("c", "l40s-48gb")):
        planner.set_inventory(NodeInventory(node, (_gpu(model),)))
    planner.set_labelled("a", True)
    return planner


def test_the_planner_chooses_only_among_a_slices_eligible_nodes() -> None:
    planner = _planner()
    request = slice_request(memory="30Gi")
    assert planner.plan(request).mode == MODE_MIG, "unrestricted, MIG first"
    first = planner.plan(request, nodes=["b", "c"])
    assert first.mode == MODE_FRACTION and first.node in ("b", "c")
    planner.put_binding(dataclasses.replace(first, uid="one"))
    second = planner.plan(request, nodes=["c", "b"])
    assert {first.node, second.node} == {"b", "c"}, "a full node is skipped for the other eligible one"
    planner.put_binding(dataclasses.replace(second, uid="two"))
    with pytest.raises(Refusal) as refused:
        planner.plan(request, nodes=["b", "c"])
    assert refused.value.code == "NoCapacity" and "eligible nodes (b, c)" in refused.value.message
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="4G"), nodes=[])
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="4G"), "a", nodes=["b"])
    assert planner.plan(slice_request(memory="4G"), "a", nodes=["a", "b"]).node == "a"
    assert planner.plan(slice_request(profile="1g.10gb"), nodes=["a"]).profile == "1g.10gb"


def test_a_refusal_names_at_most_five_eligible_nodes() -> None:
    # Every GPU is taken by whole-GPU slices, so a refusal says where it looked: the eligible nodes,
    # five of them named, "..." when there are more, "none" when there are none.
    planner = ClusterPlanner()
    names = [f"n{i}" for i in range(7)]
    for node in names:
        planner.set_inventory(NodeInventory(node, (_gpu("l40s-48gb"),)))
    for k, node in enumerate(names):
        planner.put_binding(dataclasses.replace(planner.plan(slice_request(fraction="1"), node), uid=f"u{k}"))
    request = slice_request(memory="4G")
    for eligible, shown in ((names[:5], "(n0, n1, n2, n3, n4)"), (names[:6], "(n0, n1, n2, n3, n4 ...)"),
                            (names, "(n0, n1, n2, n3, n4 ...)")):
        with pytest.raises(Refusal) as refused:
            planner.plan(request, nodes=list(reversed(eligible)))
        assert f"on its eligible nodes {shown}" in refused.value.message, refused.value.message
    with pytest.raises(Refusal) as none:
        planner.plan(request, nodes=[])
    assert none.value.message.startswith("no GPU on its eligible nodes (none) can take slices"), none.value.message


@given(st.lists(st.sampled_from(["h100-80gb", "a100-40gb", "l40s-48gb", "l4-24gb"]), min_size=3, max_size=3),
       st.sets(st.sampled_from(["n0", "n1", "n2"])), st.sets(st.sampled_from(["n0", "n1", "n2"])),
       st.sampled_from(["4G", "9Gi", "17Gi", "30Gi", "70Gi", "200Gi"]))
@settings(max_examples=150, deadline=None)
def test_planning_among_nodes_decides_as_planning_on_those_nodes_alone(models: list[str], labelled: set[str],
                                                                       eligible: set[str], memory: str) -> None:
    inventories = [NodeInventory(f"n{i}", (_gpu(m, 0), _gpu(m, 1))) for i, m in enumerate(models)]
    planner = ClusterPlanner()
    planner.reset(inventories, labelled, [])
    request = slice_request(memory=memory)
    view = build_view([inv for inv in inventories if inv.node in eligible], labelled, [])
    try:
        expected: Binding | str = plan_binding(request, view)
    except Refusal as refusal:
        expected = refusal.code
    try:
        got: Binding | str = planner.plan(request, nodes=eligible)
    except Refusal as refusal:
        got = refusal.code
    assert got == expected


def test_a_slices_eligible_nodes_come_from_its_annotation() -> None:
    body = {"metadata": {"uid": "u", "namespace": "ns", "name": "s",
                         "annotations": {"cdmo.io/eligible-nodes": "c, a,,b"}}, "spec": {"memory": "4G"}}
    assert slice_info(body).eligible == ("a", "b", "c")
    del body["metadata"]["annotations"]
    assert slice_info(body).eligible is None


# --- the webhook configuration and its certificate -------------------------------------------------


def test_only_annotated_pods_outside_the_operators_namespace_are_sent() -> None:
    config = webhook_configuration(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"), b"CA")
    hook = config["webhooks"][0]
    assert hook["matchConditions"] == [{"name": "asks-for-a-gpu-slice", "expression": MATCH_EXPRESSION}]
    for key in ("k.lowerAscii().startsWith('cdmo.io/')", "has(object.metadata.annotations)"):
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


# --- a finished pod releases its slice; a slice is handed only to its own pod ---------------------


class _Client:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def delete(self, path: str) -> dict:
        self.calls.append(("DELETE", path))
        return {}

    async def json_patch(self, path: str, ops: list) -> dict:
        self.calls.append(("PATCH", path))
        return {}

    async def create(self, path: str, body: dict) -> dict:
        """As the API server answers: the object with its UID and resourceVersion."""
        self.calls.append(("POST", path))
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{len(self.calls)}")
        meta.setdefault("resourceVersion", str(len(self.calls)))
        return body

    async def merge_patch(self, path: str, body: dict) -> dict:
        self.calls.append(("MERGE", path))
        return body


class _Events:
    def __init__(self) -> None:
        self.posted: list[str] = []

    def post(self, obj: dict, kind: str, reason: str, message: str) -> None:
        self.posted.append(reason)

    def forget(self, uid: str) -> None:
        pass


def _slice_body(owner_uid: str, phase: str = "Ready") -> dict:
    return {"metadata": {"uid": "s-uid", "namespace": "ns", "name": "p-gs-1", "resourceVersion": "5",
                         "ownerReferences": [{"kind": "Pod", "name": "p", "uid": owner_uid}],
                         "finalizers": ["cdmo.io/agent"]},
            "spec": {"memory": "4G"},
            "status": {"phase": phase, "mode": "fraction", "node": "n", "gpu": 0, "grantedBytes": 4 * 10**9,
                       "deviceUUID": "GPU-1", "gpuUUID": "GPU-1"}}


def _pod_slices(owner_uid: str, client: _Client | None = None) -> tuple[PodSlices, _Client, _Events]:
    state = BodyLedger()
    state.put_slice(_slice_body(owner_uid))
    # Node n's GpuNode lists the slice's device, so the controller's device check accepts it.
    state.put_inventory({"metadata": {"name": "n"}, "spec": {"nodeName": "n"},
                         "status": {"gpus": [{"index": 0, "uuid": "GPU-1", "memoryMiB": 81559}]}})
    client, events = client or _Client(), _Events()
    pods = assemble(client, events, queue=WorkQueue(), ledger=state).pods  # type: ignore[arg-type]
    return pods, client, events


def _settle(pods: PodSlices, call: Coroutine[Any, Any, None]) -> None:
    """Run an event's handling, then the work it queued, to the end."""
    async def main() -> None:
        await call
        while len(pods.queue):
            await asyncio.sleep(0.005)

    asyncio.run(main())


async def _look(pods: PodSlices, info: Any) -> None:
    """The slice's watch event, as the controller's handler takes it: its key is added."""
    pods.queue.enqueue(("slice", info.namespace, info.name))


async def _last_steps(pods: PodSlices, info: Any) -> None:
    """The last two steps of a slice's key (``slice_key``): its claim, then its pod moved on."""
    await pods.move_on(info, await pods.claims.ensure(info))


def _pod(phase: str, gated: bool = False) -> dict:
    spec = {"containers": [{"name": "c"}], **({"schedulingGates": [{"name": GATE}]} if gated else {})}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid", "labels": {"cdmo.io/gpu-slice": "p-gs-1"}},
            "spec": spec, "status": {"phase": phase}}


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_pod_has_its_slice_and_the_slices_claim_deleted(phase: str) -> None:
    # The claim first: kube-controller-manager reserves an allocated claim again for a bound pod,
    # finished or not, and a reserved claim holds the slice.
    pods, client, _ = _pod_slices("pod-uid")
    _settle(pods, pods.pod_event(_pod(phase), deleted=False))
    assert client.calls == [("DELETE", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/p-gs-1"),
                            ("DELETE", "/apis/cdmo.io/v1alpha1/namespaces/ns/gpuslices/p-gs-1")]


@pytest.mark.parametrize("phase", ["Running", "Pending"])
def test_a_running_pod_keeps_its_slice(phase: str) -> None:
    pods, client, _ = _pod_slices("pod-uid")
    _settle(pods, pods.pod_event(_pod(phase), deleted=False))
    assert client.calls == []


def test_another_pods_slice_is_neither_released_nor_handed_over() -> None:
    pods, client, events = _pod_slices("someone-else")
    _settle(pods, pods.pod_event(_pod("Succeeded"), deleted=False))
    _settle(pods, pods.pod_event(_pod("Pending", gated=True), deleted=False))
    # The slice's own key still writes its claim (the slice's business); nothing is deleted or ungated.
    assert not [c for c in client.calls if c[0] in ("DELETE", "PATCH")] and events.posted == ["SliceNotOwned"]
    mine, client, _ = _pod_slices("pod-uid")
    _settle(mine, mine.pod_event(_pod("Pending", gated=True), deleted=False))
    assert [c[0] for c in client.calls] == ["POST", "MERGE", "MERGE", "PATCH"], \
        "its own Ready slice: claim, its allocation, status, ungate"
    assert client.calls[0][1] == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims"


class _SlowPatchClient(_Client):
    """The API answers the ungate patch only after a moment, as a loaded API server does."""

    async def json_patch(self, path: str, ops: list) -> dict:
        self.calls.append(("PATCH", path))
        await asyncio.sleep(0.05)
        return {"metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"}, "spec": {}}


def test_a_pod_found_ready_twice_at_once_is_ungated_with_one_patch() -> None:
    """The pod's own event and its slice's Ready event may both find it ready while the first ungate
    is on its way: a second patch would only be refused (and counted by the API server)."""
    pods, client, _ = _pod_slices("pod-uid", _SlowPatchClient())
    state = pods.state
    pods.state.put_pod("ns", "p-gs-1", pod_record(_pod("Pending", gated=True)))
    info = state.slice_named("ns", "p-gs-1")
    assert info is not None

    async def both() -> None:
        await asyncio.gather(_last_steps(pods, info), _last_steps(pods, info))

    asyncio.run(both())
    assert [c[0] for c in client.calls].count("PATCH") == 1
    _settle(pods, _look(pods, info))
    assert [c[0] for c in client.calls].count("PATCH") == 1, "ungated: nothing more to do"


def test_a_pass_that_awaited_while_the_pod_was_ungated_sends_no_second_patch() -> None:
    """A slice event's pass read the pod gated, then awaited its claim; meanwhile another pass ungated the
    pod (the watch's view is now ungated): the late pass must not patch the pod as it read it."""
    pods, client, _ = _pod_slices("pod-uid")
    gated = _pod("Pending", gated=True)
    now = {**gated, "spec": {"containers": [{"name": "c"}]}}  # as the watch sees it now
    pods.state.put_pod("ns", "p-gs-1", pod_record(now))
    info = pods.state.slice_named("ns", "p-gs-1")
    assert info is not None
    asyncio.run(pods._release_gate(gated, info))
    assert [c for c in client.calls if c[0] == "PATCH"] == []
    pods.state.put_pod("ns", "p-gs-1", pod_record(gated))
    asyncio.run(pods._release_gate(gated, info))
    assert [c for c in client.calls if c[0] == "PATCH"] == [("PATCH", "/api/v1/namespaces/ns/pods/p")]


class _AnsweringClient(_Client):
    """The ungate's answer is the pod ungated, at a newer resourceVersion than any event before it."""

    async def json_patch(self, path: str, ops: list) -> dict:
        self.calls.append(("PATCH", path))
        pod = _pod("Pending")
        pod["metadata"]["resourceVersion"] = "20"
        return pod


def test_an_event_older_than_the_ungates_answer_sends_no_second_patch() -> None:
    """The watch may deliver a gated copy of the pod after the controller's own ungate answered; taking
    it as the pod's state led to a second ungate, refused by the API server (a write per pod wasted)."""
    pods, client, _ = _pod_slices("pod-uid", _AnsweringClient())
    state = pods.state
    older = _pod("Pending", gated=True)
    older["metadata"]["resourceVersion"] = "10"
    _settle(pods, pods.pod_event(older, deleted=False))
    assert [c[0] for c in client.calls].count("PATCH") == 1
    _settle(pods, pods.pod_event(older, deleted=False))  # the same old copy, late
    info = state.slice_named("ns", "p-gs-1")
    assert info is not None
    _settle(pods, _look(pods, info))
    assert [c[0] for c in client.calls].count("PATCH") == 1
    newer = _pod("Running")
    newer["metadata"]["resourceVersion"] = "30"
    _settle(pods, pods.pod_event(newer, deleted=False))
    assert pods.state.pod("ns", "p-gs-1").body["metadata"]["resourceVersion"] == "30"


def _node(name: str, taints: list[dict] | None = None, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"host-{name}", **labels}},
            "spec": {"taints": taints or []}}


def test_where_a_pod_may_go_is_read_from_the_ledgers_one_node_cache() -> None:
    """The controller keeps one Node cache, the ledger's, fed by the Node watch: a Node event changes
    where a pod may go and what its hostname term says at once, with no list of nodes."""
    state = BodyLedger()
    for name in ("a", "b"):
        state.put_inventory({"metadata": {"name": name}, "spec": {"nodeName": name},
                             "status": {"gpus": [{"index": 0, "uuid": f"GPU-{name}", "memoryMiB": 81559}]}})
        state.put_node(name, node_record(_node(name)))
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [{"name": "c"}]}}
    assert eligible_nodes(pod, state.inventories, state.nodes) is None  # every GPU node
    assert state.put_node("b", node_record(_node("b", [{"key": "gpu", "value": "x", "effect": "NoSchedule"}]))) is None
    assert eligible_nodes(pod, state.inventories, state.nodes) == ["a"], "b's new taint, seen from its event"
    picky = {"metadata": {"name": "q", "namespace": "ns"},
             "spec": {"containers": [{"name": "c"}], "nodeSelector": {"zone": "z1"}}}
    assert eligible_nodes(picky, state.inventories, state.nodes) == []
    assert state.put_node("a", node_record(_node("a", zone="z1"))) is None  # no label placement reads changed
    assert eligible_nodes(picky, state.inventories, state.nodes) == ["a"], "a's new label, seen from its event"
    assert hostname({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]}}}}},
        "a", state.nodes) == "host-a"
    state.put_node("b", None)  # b is gone
    state.put_node("c", node_record(_node("c")))
    assert state.nodes.keys() == {"a", "c"}
    assert eligible_nodes(picky, state.inventories, state.nodes) == ["a"]


def test_a_pods_request_is_read_once_per_change_of_what_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller reads a pod's request as it observes the pod and keeps it in the pod's record:
    events that change only its status read nothing again, and making its slice reads nothing."""
    from mig_operator.kube.controller import observe

    reads: list[str] = []

    def counted(pod: dict) -> object:
        reads.append(pod["metadata"].get("resourceVersion", ""))
        return observe_ask(pod)

    observe_ask = observe.pod_ask
    monkeypatch.setattr(observe, "pod_ask", counted)
    state, client, events = BodyLedger(), _Client(), _Events()
    pods = assemble(client, events, queue=WorkQueue(), ledger=state).pods  # type: ignore[arg-type]
    asked = _pod("Pending", gated=True)
    asked["metadata"].update(annotations={"cdmo.io/gpu-memory": "lots"}, resourceVersion="1")
    _settle(pods, pods.pod_event(asked, deleted=False))
    first = pods.state.pod("ns", "p-gs-1").ask
    assert (first.reason, reads) == ("InvalidAnnotation", ["1"])
    assert events.posted.count("InvalidAnnotation") == 1
    later = copy.deepcopy(asked)
    later["metadata"]["resourceVersion"] = "2"
    later["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}
    _settle(pods, pods.pod_event(later, deleted=False))
    assert reads == ["1"] and pods.state.pod("ns", "p-gs-1").ask is first
    fixed = copy.deepcopy(later)
    fixed["metadata"].update(annotations={"cdmo.io/gpu-memory": "4Gi"}, resourceVersion="3")
    asyncio.run(pods.pod_event(fixed, deleted=False))  # observed: read (its slice's making is not this test's)
    assert reads == ["1", "3"]
    assert [d.request.memory_bytes for d in pods.state.pod("ns", "p-gs-1").ask.devices] == [4 * 2**30]
