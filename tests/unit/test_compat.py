"""The seed platforms' request forms (issue 17, item 4): Run:ai's annotations and ClearML's Fractional
GPU Injector label, read as the operator's annotations, with the seeds' own examples verbatim."""

from __future__ import annotations

import copy
import json
import textwrap
from typing import Any

import pytest
import yaml
from seed_examples import (  # the seeds' examples, verbatim
    CLEARML_CDMO_DEFAULT025,
    CLEARML_CDMO_QUEUES,
    CLEARML_INJECTOR_QUEUES,
    CLEARML_INJECTOR_QUEUES_1_3,
    CLEARML_INJECTOR_QUEUES_LEGACY,
    KAI_GPU_MEMORY,
    KAI_GPU_SHARING,
    KAI_NON_DEFAULT_CONTAINER,
    RUNAI_MULTI_FRACTIONAL,
)

from mig_operator.core.requests.compat import (
    COMPAT_DIALECTS,
    DialectError,
    DialectRequest,
    UnknownDialect,
    check_dialects,
    dialect_match_expression,
    dialect_request,
)
from mig_operator.core.requests.pod_admission import check_pod, check_pod_devices
from mig_operator.core.requests.request import SliceRequest
from mig_operator.core.requests.request_forms import RequestFormError, mig_resource_request

BOTH = ("runai", "clearml")
MIB = 1024 * 1024



def kai_pod(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)


def queue_pods(text: str) -> dict[str, dict[str, Any]]:
    """The pod the ClearML agent makes for each queue: its templateOverrides' labels on the pod, its
    resources on the task's container."""
    queues = yaml.safe_load(text)["agentk8sglue"]["queues"]
    return {name: template_pod(queue["templateOverrides"]) for name, queue in queues.items()}


def template_pod(overrides: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "clearml-task", "image": "python:3.11"}
    if "resources" in overrides:
        container["resources"] = copy.deepcopy(overrides["resources"])
    pod: dict[str, Any] = {"metadata": {"name": "clearml-id-1", "namespace": "clearml"},
                           "spec": {"containers": [container]}}
    if "labels" in overrides:
        pod["metadata"]["labels"] = dict(overrides["labels"])
    return pod


def as_api_server_sends(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as a webhook receives it: quantities in canonical form ("0.5" -> "500m", 1 -> "1") and an
    extended resource's requests defaulted from its limits."""
    out = copy.deepcopy(pod)
    canonical = {"0.5": "500m", "0.25": "250m", "0.125": "125m"}
    for container in out["spec"]["containers"]:
        resources = container.get("resources") or {}
        limits = {k: canonical.get(str(v), str(v)) for k, v in (resources.get("limits") or {}).items()}
        if limits:
            resources["limits"] = limits
            resources["requests"] = {**limits, **(resources.get("requests") or {})}
    return out


def served(pod: dict[str, Any], asked: DialectRequest) -> dict[str, Any]:
    """The pod as it goes on (what the webhook does with a DialectRequest before the slice's claim)."""
    out = copy.deepcopy(pod)
    meta = out.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), **asked.annotations}
    for container in (*out["spec"].get("initContainers", []), *out["spec"]["containers"]):
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            kept = {k: v for k, v in (resources.get(kind) or {}).items() if k not in asked.removed_resources}
            if kept:
                resources[kind] = kept
            else:
                resources.pop(kind, None)
    return out


def pod(annotations: dict[str, Any] | None = None, labels: dict[str, Any] | None = None,
        *containers: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    return {"metadata": meta, "spec": {"containers": list(containers) or [{"name": "main", "image": "x"}]}}


def container(name: str, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "image": "x", **({"resources": {"limits": limits}} if limits else {})}


# --- the chart value ------------------------------------------------------------------------------


def test_the_known_dialects() -> None:
    assert COMPAT_DIALECTS == ("runai", "clearml")
    assert check_dialects([]) == ()
    assert check_dialects(["clearml", "runai", "clearml"]) == ("runai", "clearml")
    assert check_dialects("clearml, runai") == ("runai", "clearml")
    assert check_dialects("") == ()


@pytest.mark.parametrize("names", [["kai"], ["runai", "RunAI"], "runai,clear-ml"])
def test_an_unknown_dialect_is_named_with_the_known_ones(names: Any) -> None:
    with pytest.raises(UnknownDialect) as caught:
        check_dialects(names)
    message = str(caught.value)
    assert "is not one the operator knows; use any of runai, clearml" in message
    assert ("'kai'" in message) or ("'RunAI'" in message) or ("'clear-ml'" in message)


# --- disabled dialects mean nothing ---------------------------------------------------------------


@pytest.mark.parametrize("text", [KAI_GPU_SHARING, KAI_GPU_MEMORY, KAI_NON_DEFAULT_CONTAINER])
def test_run_ai_annotations_mean_nothing_unless_runai_is_enabled(text: str) -> None:
    assert dialect_request(kai_pod(text), []) is None
    assert dialect_request(kai_pod(text), ["clearml"]) is None


def test_clearml_forms_mean_nothing_unless_clearml_is_enabled() -> None:
    for body in queue_pods(CLEARML_INJECTOR_QUEUES).values():
        assert dialect_request(body, []) is None
        assert dialect_request(body, ["runai"]) is None


def test_a_pod_without_a_dialect_key_asks_for_nothing() -> None:
    assert dialect_request(pod({"user": "test"}, {"app": "x"}), BOTH) is None
    # nvidia.com/gpu alone is not ClearML's (whole GPUs are item 2's).
    assert dialect_request(pod(None, None, container("a", {"nvidia.com/gpu": "1"})), BOTH) is None
    # Keys are case-sensitive, as Run:ai reads them.
    assert dialect_request(pod({"GPU-fraction": "0.5"}), BOTH) is None


# --- runai ----------------------------------------------------------------------------------------


def test_kai_gpu_fraction_example() -> None:
    body = kai_pod(KAI_GPU_SHARING)
    asked = dialect_request(body, ["runai"])
    assert asked is not None and asked.dialect == "runai"
    assert asked.annotations == {"cdmo.io/gpu-fraction": "0.5"}
    assert json.loads(asked.record()) == {"metadata.annotations": {"gpu-fraction": "0.5"}}
    assert asked.request == SliceRequest(fraction=0.5)
    assert asked.removed_resources == () and asked.containers == ("gpu-workload",)
    assert check_pod(served(body, asked)) == SliceRequest(fraction=0.5)


def test_kai_gpu_memory_example_is_mib() -> None:
    asked = dialect_request(kai_pod(KAI_GPU_MEMORY), ["runai"])
    assert asked.annotations["cdmo.io/gpu-memory"] == "2000Mi"
    assert asked.request.memory_bytes == 2000 * MIB == 2_097_152_000


def test_kai_non_default_container_example_gives_the_device_to_the_container_named() -> None:
    asked = dialect_request(kai_pod(KAI_NON_DEFAULT_CONTAINER), ["runai"])
    assert asked.containers == ("gpu-workload",)
    assert asked.asked == {
        "metadata.annotations": {"gpu-fraction": "0.5", "gpu-fraction-container-name": "gpu-workload"}}


def test_without_a_container_name_the_first_container_gets_the_device_as_in_kai() -> None:
    body = pod({"gpu-fraction": "0.25"}, None, container("first"), container("second"))
    assert dialect_request(body, ["runai"]).containers == ("first",)
    body["spec"]["initContainers"] = [container("warm")]
    body["metadata"]["annotations"]["gpu-fraction-container-name"] = "warm"
    assert dialect_request(body, ["runai"]).containers == ("warm",)


@pytest.mark.parametrize(("value", "expected_bytes"), [
    ("4G", 4_000_000_000),
    ("4Gi", 4 * 1024**3),
    ("4096M", 4_096_000_000),
    ("4096MiB", 4096 * MIB),
    ("1024", 1024 * MIB),
])
def test_gpu_memory_forms(value: str, expected_bytes: int) -> None:
    asked = dialect_request(pod({"gpu-memory": value}), ["runai"])
    assert asked.request.memory_bytes == expected_bytes
    assert asked.annotations["cdmo.io/gpu-memory"] == (value if not value.isdigit() else f"{value}Mi")


def test_mig_profile() -> None:
    asked = dialect_request(pod({"mig-profile": "2g.10gb"}), ["runai"])
    assert asked.annotations["cdmo.io/mig-profile"] == "2g.10gb"
    assert asked.request == SliceRequest(profile="2g.10gb")


def test_gpu_fraction_num_devices_one_is_the_default() -> None:
    asked = dialect_request(pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "1"}), ["runai"])
    assert asked.request == SliceRequest(fraction=0.5)


def test_run_ai_docs_example_with_two_devices_is_two_half_gpus_for_its_container() -> None:
    body = kai_pod(RUNAI_MULTI_FRACTIONAL)
    asked = dialect_request(body, ["runai"])
    assert asked.annotations == {"cdmo.io/gpu-fraction": "0.5", "cdmo.io/gpu-count": "2"}
    assert asked.containers == ("job",)
    served_pod = {**body, "metadata": {**body["metadata"],
                                       "annotations": {**body["metadata"]["annotations"], **asked.annotations}}}
    assert [d.request for d in check_pod_devices(served_pod)] == [SliceRequest(fraction=0.5)] * 2


@pytest.mark.parametrize("value", ["0", "17", "two", "-1"])
def test_a_bad_number_of_run_ai_devices_is_refused_naming_it(value: str) -> None:
    with pytest.raises(DialectError) as caught:
        dialect_request(pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": value}), ["runai"])
    message = str(caught.value)
    assert f"annotation gpu-fraction-num-devices: '{value}' is not a number of devices from 1 to 16" in message


@pytest.mark.parametrize(("annotations", "expected"), [
    ({"gpu-fraction": "half"}, "annotation gpu-fraction: 'half' is refused (fraction 'half' is not a number"),
    ({"gpu-fraction": "1"}, "annotation gpu-fraction: '1' is not a share of a GPU"),
    ({"gpu-fraction": "1.0"}, "annotation gpu-fraction: '1.0' is not a share of a GPU"),
    ({"gpu-fraction": "0"}, "annotation gpu-fraction: '0' is refused"),
    ({"gpu-fraction": "5e-1"}, "annotation gpu-fraction: '5e-1' is refused"),
    ({"gpu-fraction": "0.005"}, "annotation gpu-fraction: '0.005' is refused (fraction '0.005' is below the smallest"),
    ({"gpu-memory": "4X"}, "annotation gpu-memory: '4X' is refused (memory '4X' has an unknown unit 'X'"),
    ({"gpu-memory": "4g"}, "annotation gpu-memory: '4g' is refused"),
    ({"gpu-memory": "0"}, "annotation gpu-memory: '0' must be more than zero MiB"),
    ({"gpu-memory": "500"}, "annotation gpu-memory: '500' is refused, read as cdmo.io/gpu-memory: '500Mi'"),
    ({"mig-profile": "big"}, "annotation mig-profile: 'big' is refused (migProfile 'big' is not a MIG profile name"),
    ({"gpu-fraction": "0.5", "gpu-memory": "4G"}, "a pod may carry only one of gpu-memory, gpu-fraction, mig-profile"),
    ({"gpu-fraction": "0.25", "gpu-fraction-limit": "0.8"}, "annotation gpu-fraction-limit: '0.8' asks to burst"),
    ({"gpu-memory": "4G", "gpu-memory-limit": "8G"}, "annotation gpu-memory-limit: '8G' asks to burst"),
    ({"gpu-fraction-num-devices": "1"}, "annotation gpu-fraction-num-devices: '1' needs a request beside it"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "two"}, "gpu-fraction-num-devices: 'two' is not a number"),
    ({"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"},
     "annotation gpu-fraction-container-name: 'nope' names no container of the pod"),
    ({"gpu-fraction": "0.5", "cdmo.io/gpu-memory": "4G"},
     "annotation cdmo.io/gpu-memory: '4G' and with annotation gpu-fraction"),
    ({"gpu-fraction": "0.5", "cdmo.io/gpu-fraction": "0.25"}, "annotation cdmo.io/gpu-fraction: '0.25'"),
])
def test_runai_refusals_name_the_key_and_value_and_show_an_example(annotations: dict[str, str], expected: str) -> None:
    with pytest.raises(DialectError) as caught:
        dialect_request(pod(annotations), ["runai"])
    message = str(caught.value)
    assert expected in message
    assert "e.g." in message


def test_a_runai_request_beside_a_device_plugin_resource_is_refused() -> None:
    for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"):
        body = pod({"gpu-fraction": "0.5"}, None, container("train", {resource: "1"}))
        with pytest.raises(DialectError, match=f"container 'train' asks for '{resource}' and the pod for a GPU with "
                                               "annotation gpu-fraction: '0.5'"):
            dialect_request(body, ["runai"])


def test_a_copy_of_a_served_pod_is_served_the_same() -> None:
    body = kai_pod(KAI_GPU_SHARING)
    asked = dialect_request(body, ["runai"])
    again = dialect_request(served(body, asked), ["runai"])
    assert again == asked


def test_refusals_are_request_form_errors_the_webhook_already_reports() -> None:
    assert issubclass(DialectError, RequestFormError)


# --- clearml --------------------------------------------------------------------------------------


def test_clearml_injector_queue_template() -> None:
    pods = queue_pods(CLEARML_INJECTOR_QUEUES)
    for name, share, resource_text in (("default0500", 0.5, "0.5"), ("default0250", 0.25, "0.25")):
        for body, quantity in ((pods[name], resource_text), (as_api_server_sends(pods[name]), None)):
            asked = dialect_request(body, ["clearml"])
            assert asked is not None and asked.dialect == "clearml"
            assert asked.request == SliceRequest(fraction=share)
            label = body["metadata"]["labels"]["clearml-injector/fraction"]
            assert asked.annotations == {"cdmo.io/gpu-fraction": label}
            assert asked.removed_resources == ("clear.ml/fraction-1", "nvidia.com/gpu")
            assert asked.containers == ("clearml-task",)
            record = json.loads(asked.record())
            assert record["metadata.labels"] == {"clearml-injector/fraction": label}
            if quantity is not None:
                assert record["clearml-task"] == {"nvidia.com/gpu": "1", "clear.ml/fraction-1": quantity}
            going_on = served(body, asked)
            assert not going_on["spec"]["containers"][0].get("resources")
            assert check_pod(going_on) == SliceRequest(fraction=share)


def test_clearml_injector_1_3_queue_template_labels_only() -> None:
    pods = queue_pods(CLEARML_INJECTOR_QUEUES_1_3)
    shares = {"gpu-fraction-1_000": 1.0, "gpu-fraction-0_500": 0.5, "gpu-fraction-0_250": 0.25,
              "gpu-fraction-0_125": 0.125}
    for name, share in shares.items():
        asked = dialect_request(pods[name], ["clearml"])
        assert asked.request == SliceRequest(fraction=share)
        # No container asks: every container gets the device, as with an annotation.
        assert asked.containers is None and asked.removed_resources == ()


def test_clearml_injector_legacy_queue_template_eight_replicas() -> None:
    pods = queue_pods(CLEARML_INJECTOR_QUEUES_LEGACY)
    # The whole-GPU queue has no label: plain nvidia.com/gpu, not ClearML's form.
    assert dialect_request(pods["gpu-fraction-1_000"], ["clearml"]) is None
    for name, share in (("gpu-fraction-0_500", 0.5), ("gpu-fraction-0_250", 0.25), ("gpu-fraction-0_125", 0.125)):
        asked = dialect_request(pods[name], ["clearml"])
        assert asked.request == SliceRequest(fraction=share)
        assert asked.removed_resources == ("nvidia.com/gpu",) and asked.containers == ("clearml-task",)
        assert check_pod(served(pods[name], asked)) == SliceRequest(fraction=share)


def test_clearml_cdmo_queue_templates_are_served_as_mig_requests() -> None:
    expected = {"slice-1": "1g.10gb", "slice-2": "2g.20gb", "slice-4": "4g.40gb", "slice-7": "7g.80gb"}
    for name, body in queue_pods(CLEARML_CDMO_QUEUES).items():
        assert dialect_request(body, BOTH) is None  # not a dialect's form: request_forms serves it
        asked = mig_resource_request(body)
        assert asked.asked == {"clearml-task": {f"nvidia.com/mig-{expected[name]}": "1"}}
    old = template_pod(yaml.safe_load(textwrap.dedent(CLEARML_CDMO_DEFAULT025))["templateOverrides"])
    assert dialect_request(old, BOTH) is None
    assert mig_resource_request(old).asked == {"clearml-task": {"nvidia.com/mig-1g.10gb": "1"}}


@pytest.mark.parametrize(("value", "share"), [
    ("0.0625", 0.0625), ("0.125", 0.125), ("0.250", 0.25), ("0.375", 0.375), ("0.500", 0.5), ("0.5", 0.5),
    ("0.625", 0.625), ("0.750", 0.75), ("0.875", 0.875), ("1.000", 1.0), ("1", 1.0),
])
def test_clearml_documented_shares(value: str, share: float) -> None:
    asked = dialect_request(pod(None, {"clearml-injector/fraction": value}), ["clearml"])
    assert asked.request == SliceRequest(fraction=share)
    assert asked.annotations["cdmo.io/gpu-fraction"] == value


@pytest.mark.parametrize(("value", "expected"), [
    ("0.3", "label clearml-injector/fraction: '0.3' is not a share the injector defines"),
    ("0.1875", "label clearml-injector/fraction: '0.1875' is not a share the injector defines"),
    ("0.03125", "label clearml-injector/fraction: '0.03125' is not a share the injector defines"),
    ("1.125", "label clearml-injector/fraction: '1.125' is not a share the injector defines"),
    ("0", "label clearml-injector/fraction: '0' is not a share the injector defines"),
    ("half", "label clearml-injector/fraction: 'half' is not a decimal"),
    ("-0.5", "label clearml-injector/fraction: '-0.5' is not a decimal"),
    ("", "label clearml-injector/fraction: '' is not a decimal"),
    ("2", "label clearml-injector/fraction: '2' asks for 2 GPUs; one device per pod is served"),
    ("2.0", "label clearml-injector/fraction: '2.0' asks for 2 GPUs"),
])
def test_clearml_undefined_shares_are_refused_naming_the_label_and_value(value: str, expected: str) -> None:
    with pytest.raises(DialectError) as caught:
        dialect_request(pod(None, {"clearml-injector/fraction": value}), ["clearml"])
    message = str(caught.value)
    assert expected in message
    assert "use one of 0.0625, 0.125, 0.250, 0.375, 0.500, 0.625, 0.750, 0.875, 1.000" in message
    assert "e.g. clearml-injector/fraction: '0.500'" in message


LABEL = {"clearml-injector/fraction": "0.500"}


@pytest.mark.parametrize(("labels", "containers", "expected"), [
    (None, [container("t", {"nvidia.com/gpu": "1", "clear.ml/fraction-1": "0.5"})],
     "container 't' asks for 'clear.ml/fraction-1': '0.5' without the pod label clearml-injector/fraction"),
    (LABEL, [container("t", {"clear.ml/fraction-1": "0.5"})],
     "container 't' asks for clear.ml/fraction-1: '0.5' without nvidia.com/gpu"),
    (LABEL, [container("t", {"nvidia.com/gpu": "1", "clear.ml/fraction-1": "0.25"})],
     "container 't' asks for clear.ml/fraction-1: '0.25' but the pod's label clearml-injector/fraction: '0.500'"),
    (LABEL, [container("t", {"nvidia.com/gpu": "1", "clear.ml/fraction-2": "0.5"})],
     "container 't' asks for 'clear.ml/fraction-2': '0.5' beside label clearml-injector/fraction: '0.500'"),
    (LABEL, [container("t", {"nvidia.com/gpu": "2"})],
     "container 't' asks for nvidia.com/gpu: '2' beside label clearml-injector/fraction: '0.500'; with the label "
     "a container asks for nvidia.com/gpu: 1 or 4"),
    (LABEL, [container("a", {"nvidia.com/gpu": "1"}), container("b", {"nvidia.com/gpu": "1"})],
     "containers 'a', 'b' each ask for a GPU beside label clearml-injector/fraction: '0.500'"),
    (LABEL, [container("t", {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"})],
     "container 't' asks for 'nvidia.com/mig-1g.10gb' and the pod for a GPU share with label"),
])
def test_clearml_refusals(labels: dict[str, str] | None, containers: list[dict[str, Any]], expected: str) -> None:
    with pytest.raises(DialectError) as caught:
        dialect_request(pod(None, labels, *containers), ["clearml"])
    assert expected in str(caught.value)
    assert "e.g." in str(caught.value) or "asks for nvidia.com/gpu: 1" in str(caught.value)


def test_clearml_with_nvidia_gpu_one_alone_gives_that_container_the_device() -> None:
    body = pod(None, LABEL, container("side"), container("t", {"nvidia.com/gpu": "1", "cpu": "2"}))
    asked = dialect_request(body, ["clearml"])
    assert asked.containers == ("t",) and asked.removed_resources == ("nvidia.com/gpu",)
    assert served(body, asked)["spec"]["containers"][1]["resources"] == {"limits": {"cpu": "2"}}


def test_clearml_limits_and_requests_that_differ_are_refused() -> None:
    body = pod(None, LABEL, {"name": "t", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"},
                                                                       "requests": {"nvidia.com/gpu": "2"}}})
    with pytest.raises(DialectError, match="with limits '1' and requests '2'"):
        dialect_request(body, ["clearml"])


def test_clearml_label_beside_a_different_cdmo_annotation_is_refused() -> None:
    with pytest.raises(DialectError, match="annotation cdmo.io/gpu-memory: '4G' and with label clearml-injector"):
        dialect_request(pod({"cdmo.io/gpu-memory": "4G"}, LABEL), ["clearml"])


def test_two_dialects_at_once_are_refused() -> None:
    body = pod({"gpu-fraction": "0.5"}, LABEL)
    with pytest.raises(DialectError, match="Run:ai's annotation gpu-fraction: '0.5' and with ClearML's label"):
        dialect_request(body, BOTH)
    # One enabled: the other's keys mean nothing.
    assert dialect_request(body, ["runai"]).dialect == "runai"
    assert dialect_request(body, ["clearml"]).dialect == "clearml"


# --- the webhook entry's matchCondition -----------------------------------------------------------


def test_match_expression_names_each_enabled_dialect_only() -> None:
    assert dialect_match_expression([]) == "false"
    runai = dialect_match_expression(["runai"])
    assert "'gpu-fraction'" in runai and "'gpu-memory'" in runai and "'mig-profile'" in runai
    assert "clearml" not in runai
    clearml = dialect_match_expression(["clearml"])
    assert "'clearml-injector/fraction' in object.metadata.labels" in clearml
    assert "k.startsWith('clear.ml/fraction')" in clearml and "initContainers" in clearml
    assert "gpu-fraction" not in clearml
    both = dialect_match_expression(["clearml", "runai"])
    assert both == f"{runai} || {clearml}"
    with pytest.raises(UnknownDialect):
        dialect_match_expression(["kai"])
