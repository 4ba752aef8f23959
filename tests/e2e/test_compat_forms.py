"""The seed platforms' request forms (issue 17, item 4) on the local control plane, with the controller's
``--compat runai,clearml`` (chart value ``compat``): the API server evaluates the third webhook entry's
CEL, the webhook turns the pod into an annotated one, kube-scheduler reserves the slice's claim.

The pods are the seeds' own examples (tests/seed_examples.py, with their sources), less
``schedulerName: kai-scheduler`` (this cluster runs kube-scheduler only) and plus the kwok toleration."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from harness import OperatorHarness, SimNode
from kubernetes.client.rest import ApiException
from seed_examples import KAI_GPU_MEMORY, KAI_NON_DEFAULT_CONTAINER, RUNAI_MULTI_FRACTIONAL
from test_pods import KWOK_TOLERATION, running


def clearml_pod(fraction: str, share: str) -> dict[str, Any]:
    """The pod ClearML's agent makes for the Fractional GPU Injector's queue default0500 (clearml-docs
    094aac99, "Non-MIG Devices"): the template's labels on the pod, its limits on the task's container."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "clearml-id-1",
                         "labels": {"required-resources": share, "clearml-injector/fraction": fraction}},
            "spec": {"tolerations": [KWOK_TOLERATION], "containers": [
                {"name": "clearml-task", "image": "python:3.11",
                 "resources": {"limits": {"nvidia.com/gpu": "1", "clear.ml/fraction-1": share}}}]}}


def kai(text: str) -> dict[str, Any]:
    pod = yaml.safe_load(text)
    del pod["spec"]["schedulerName"]
    pod["spec"]["tolerations"] = [KWOK_TOLERATION]
    return pod


def start_with_compat(operator: OperatorHarness, *nodes: SimNode) -> None:
    for node in nodes:
        operator.agent(node)
    for node in nodes:
        operator.wait_gpunode(node)
    operator.controller_with_webhook(None, "--compat", "runai,clearml")
    operator.wait_webhook()


def _slice(operator: OperatorHarness, pod: Any) -> dict:
    return operator.get_slice(pod.metadata.namespace, pod.metadata.labels["cdmo.io/gpu-slice"])


def test_run_ai_and_clearml_pods_run_on_slices(operator: OperatorHarness) -> None:
    plain = operator.add_node("l40s-48gb", labelled=False)
    mig = operator.add_node("h100-80gb", count=2)
    start_with_compat(operator, plain, mig)
    ns = operator.namespace()

    operator.core.create_namespaced_pod(ns, kai(KAI_NON_DEFAULT_CONTAINER))
    pod = running(operator, ns, "gpu-sharing-non-default")
    sl = _slice(operator, pod)
    # Half a GPU: a MIG instance when a MIG GPU can hold it (hardware isolation), as for the annotation.
    assert sl["spec"] == {"fraction": 0.5} and sl["status"]["phase"] == "Ready"
    assert pod.metadata.annotations["cdmo.io/gpu-fraction"] == "0.5"
    # Only the container the annotation names sees the device.
    assert [(c.name, [x.name for x in (c.resources.claims or [])]) for c in pod.spec.containers] == [
        ("sidecar", []), ("gpu-workload", ["gpu-slice"]), ("another-sidecar", [])]

    operator.core.create_namespaced_pod(ns, kai(KAI_GPU_MEMORY))
    pod = running(operator, ns, "gpu-sharing")
    sl = _slice(operator, pod)
    assert sl["spec"]["memory"] == "2000Mi" and sl["status"]["profile"] == "1g.10gb"  # 2000 MiB fits 1g.10gb

    operator.core.create_namespaced_pod(ns, clearml_pod("0.500", "0.5"))
    pod = running(operator, ns, "clearml-id-1")
    sl = _slice(operator, pod)
    assert sl["spec"] == {"fraction": 0.5} and sl["status"]["phase"] == "Ready"
    [task] = pod.spec.containers
    # The injector's resources are gone: no device plugin or scheduler needs them.
    assert not (task.resources.limits or {}) and [x.name for x in task.resources.claims] == ["gpu-slice"]
    assert json.loads(pod.metadata.annotations["cdmo.io/compat-request"])

    # Run:ai's multi-fractional pod (its docs, verbatim less its scheduler and namespace): two half GPUs
    # for its one container, on one node.
    multi = yaml.safe_load(RUNAI_MULTI_FRACTIONAL)
    del multi["spec"]["schedulerName"], multi["metadata"]["namespace"]
    multi["spec"]["tolerations"] = [KWOK_TOLERATION]
    operator.core.create_namespaced_pod(ns, multi)
    pod = running(operator, ns, "multi-fractional-pod-job")
    group = pod.metadata.labels["cdmo.io/gpu-slice"]
    statuses = [operator.get_slice(ns, f"{group}-{k}")["status"] for k in (0, 1)]
    assert all(s["phase"] == "Ready" for s in statuses) and len({s["node"] for s in statuses}) == 1
    assert [c.name for c in pod.spec.containers[0].resources.claims] == ["gpu-slice-0", "gpu-slice-1"]

    # ClearML's CDMO queue template slice-1 (clearml-docs cdmo.md): the MIG device by its standard name.
    cdmo = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "clearml-id-2"},
            "spec": {"tolerations": [KWOK_TOLERATION], "containers": [
                {"name": "clearml-task", "image": "python:3.11",
                 "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}]}}
    operator.core.create_namespaced_pod(ns, cdmo)
    pod = running(operator, ns, "clearml-id-2")
    assert _slice(operator, pod)["status"]["profile"] == "1g.10gb" and pod.spec.node_name == mig.name


@pytest.mark.parametrize(("pod", "fragments"), [
    (clearml_pod("0.300", "0.3"), ["clearml-injector/fraction", "'0.300'"]),
    (kai(KAI_GPU_MEMORY.replace('"2000" # in Mib', '"lots"')), ["gpu-memory", "'lots'"]),
])
def test_what_a_dialect_does_not_define_is_refused_naming_key_and_value(operator: OperatorHarness,
                                                                        pod: dict, fragments: list[str]) -> None:
    start_with_compat(operator, operator.add_node("l40s-48gb", labelled=False))
    ns = operator.namespace()
    with pytest.raises(ApiException) as refused:
        operator.core.create_namespaced_pod(ns, pod)
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 400
    for fragment in fragments:
        assert fragment in message, message
