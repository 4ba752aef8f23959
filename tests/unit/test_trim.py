"""What the controller and the agent keep of objects (kube/common/trim.py): every decision taken on the
kept body is the one taken on the whole object, and what tenants write beyond that is not kept."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from mig_operator.core.books.slice_claim import claim_user
from mig_operator.core.placement.node_selection import (
    constrains_nodes,
    has_required_terms,
    node_allowed,
    taints_tolerated,
)
from mig_operator.core.placement.pod_fit import node_use, pod_requests
from mig_operator.core.requests.pod_admission import PodRefused, check_pod_devices
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.kube.common.trim import bound_pod_body, node_body, owned_body, pod_body, slice_body
from mig_operator.kube.controller.observe import gated, owned_by, slice_record
from mig_operator.kube.controller.pods import ungate_ops, unschedulable

BIG = "x" * 200_000
MANAGED = [{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {"f:annotations": {}}}}]


def _slice(**meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
        "metadata": {"name": "s-0", "namespace": "t", "uid": "u1", "resourceVersion": "42", "generation": 1,
                     "creationTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["cdmo.io/agent"],
                     "labels": {"cdmo.io/pod": "p", "team": "a"}, "managedFields": MANAGED,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pu",
                                          "controller": True}],
                     "annotations": {"cdmo.io/group": "s", "cdmo.io/group-size": "2", "cdmo.io/eligible-nodes": "a,b",
                                     "cdmo.io/slice-try": "2", "tenant/blob": BIG}, **meta},
        "spec": {"memory": "4Gi", "nodeName": "gpu-1"},
        "status": {"phase": "Bound", "node": "gpu-1", "gpu": 0, "mode": "mig", "profile": "1g.18gb", "profileId": 19,
                   "placement": {"start": 0, "size": 1}, "gpuUUID": "GPU-1"},
    }


def _size(body: object) -> int:
    return len(json.dumps(body))


def test_a_slice_record_is_the_same_from_the_kept_body_and_keeps_no_tenant_blob() -> None:
    whole = _slice()
    kept = slice_body(whole)
    record = slice_record(whole)
    assert record == slice_record(kept)
    for field in ("group", "group_size", "eligible", "request", "binding", "marked", "version", "created"):
        assert getattr(record, field) is not None, field
    assert "managedFields" not in kept["metadata"] and "labels" not in kept["metadata"]
    assert set(kept["metadata"]["annotations"]) == {"cdmo.io/group", "cdmo.io/group-size", "cdmo.io/eligible-nodes",
                                                    "cdmo.io/slice-try"}
    assert kept["metadata"]["ownerReferences"] == whole["metadata"]["ownerReferences"]
    assert kept["spec"] == whole["spec"] and kept["status"] == whole["status"]
    assert _size(record.body) < 2_000 < _size(whole)
    assert slice_body(kept) == kept, "keeping a kept body changes nothing"


def _pod(annotations: dict[str, str], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    base = {
        "nodeSelector": {"zone": "a"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "schedulingGates": [{"name": "other"}, {"name": "cdmo.io/gpu-slice"}],
        "resourceClaims": [{"name": "gpu-slice", "resourceClaimName": "p"}],
        "affinity": {"podAntiAffinity": {"preferred": BIG[:100]},
                     "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                         {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", BIG[:5000]],
                        "env": [{"name": "CDMO_SLICE", "value": BIG[:5000]}, {"name": "HOME", "value": "/"}],
                        "resources": {"limits": {"cpu": "1"}, "claims": [{"name": "gpu-slice"}]}}],
        "initContainers": [{"name": "init", "image": "busybox",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        "volumes": [{"name": "v", "emptyDir": {}}],
    }
    base.update(spec or {})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "t", "uid": "pu", "resourceVersion": "7", "managedFields": MANAGED,
                         "labels": {"cdmo.io/gpu-slice": "p", "app": "x"},
                         "annotations": {**annotations, "tenant/blob": BIG}},
            "spec": base, "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 1 Insufficient cpu."},
                {"type": "Initialized", "status": "True", "message": BIG[:100]}]}}


def _verdict(pod: dict[str, Any]) -> object:
    """The devices, or the refusal's type and its message as far as the quoted value (a stray key's
    long value is kept cut to what the message quotes, so the length it states differs)."""
    try:
        return check_pod_devices(pod)
    except (QuantityError, PodRefused) as exc:
        return type(exc), str(exc).split("... (")[0]


PODS = [
    _pod({"cdmo.io/gpu-memory": "4G"}),
    _pod({"cdmo.io/gpu-memory": "4G"}, {"containers": [{"name": "main", "resources": {}}], "initContainers": []}),
    _pod({"cdmo.io/gpu-fraction": "0.5", "cdmo.io/gpu-compute": "0.5", "cdmo.io/gpu-count": "2"},
         {"containers": [{"name": "a", "env": [{"name": "LD_PRELOAD", "value": "x"}]}], "initContainers": []}),
    _pod({"cdmo.io/mig-profile": "2g.35gb", "cdmo.io/gpu-memroy": "4G" + BIG}),
    _pod({"cdmo.io/gpu-memory": "4G"}, {"nodeName": "gpu-1", "initContainers": []}),
    _pod({}, {"affinity": {"podAffinity": {}}}),
    _pod({"cdmo.io/gpu-memory": "4G"}, {"affinity": None, "initContainers": []}),
    _pod({"cdmo.io/gpu-memory": "4G"}, {
        "overhead": {"cpu": "250m"}, "resources": {"requests": {"memory": "2Gi"}},
        "initContainers": [{"name": "proxy", "image": "x", "restartPolicy": "Always",
                            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
                           {"name": "setup", "image": "x", "resources": {"requests": {"cpu": "3"}}}]}),
]


@pytest.mark.parametrize("pod", PODS)
def test_every_pod_decision_is_the_same_on_the_kept_pod(pod: dict[str, Any]) -> None:
    original = copy.deepcopy(pod)
    kept = pod_body(pod)
    assert pod == original, "the whole pod is not changed"
    assert _verdict(kept) == _verdict(pod)
    spec, kept_spec = pod["spec"], kept["spec"]
    labels = {"zone": "a", "kubernetes.io/hostname": "gpu-1"}
    taints = [{"key": "gpu", "effect": "NoSchedule"}]
    assert constrains_nodes(kept_spec) == constrains_nodes(spec)
    assert has_required_terms(kept_spec) == has_required_terms(spec)
    assert node_allowed(kept_spec, "gpu-1", labels) == node_allowed(spec, "gpu-1", labels)
    assert taints_tolerated(kept_spec, taints) == taints_tolerated(spec, taints)
    assert claim_user(kept, "p") == claim_user(pod, "p")
    assert gated(kept) == gated(pod)
    if gated(pod):
        assert ungate_ops(kept, "gpu-1", "gpu-1") == ungate_ops(pod, "gpu-1", "gpu-1")
    assert owned_by(_slice(), kept) == owned_by(_slice(), pod)
    assert pod_requests(kept_spec) == pod_requests(spec)
    assert unschedulable(kept) == unschedulable(pod) == "0/3 nodes are available: 1 Insufficient cpu."
    assert kept["status"] == {"phase": "Pending", "conditions": [pod["status"]["conditions"][0]]}
    assert kept["metadata"]["labels"] == {"cdmo.io/gpu-slice": "p"} and "managedFields" not in kept["metadata"]
    assert "tenant/blob" not in kept["metadata"].get("annotations", {})
    assert _size(kept) < 2_000 < _size(pod)
    assert pod_body(kept) == kept


@pytest.mark.parametrize("pod", PODS)
def test_a_bound_pod_keeps_what_the_fit_of_another_pod_reads(pod: dict[str, Any]) -> None:
    bound = {**pod, "spec": {**pod["spec"], "nodeName": "gpu-1"}}
    kept = bound_pod_body(bound)
    assert node_use([kept]) == node_use([bound]) and pod_requests(kept["spec"]) == pod_requests(bound["spec"])
    assert kept["spec"]["nodeName"] == "gpu-1" and kept["status"] == {"phase": "Pending"}
    assert "annotations" not in kept["metadata"] and _size(kept) < 1_000 < _size(bound)
    assert bound_pod_body(kept) == kept


def test_a_node_keeps_labels_taints_the_device_plugin_status_and_the_health_clear_mark_only() -> None:
    from mig_operator.core.node.device_plugin import check_node

    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "gpu-1", "uid": "n1", "labels": {"a": "b"}, "annotations": {"big": BIG},
                         "managedFields": MANAGED},
            "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}], "podCIDR": "10.0.0.0/24"},
            "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True"}], "images": [{"names": [BIG]}]}}
    kept = node_body(node)
    assert check_node("gpu-1", kept) == check_node("gpu-1", node)
    assert kept["metadata"] == {"name": "gpu-1", "uid": "n1", "labels": {"a": "b"}}
    assert kept["spec"] == {"taints": node["spec"]["taints"]} and "images" not in kept["status"]
    # Of the annotations, only the admin's GPU health clear mark, which the agent reads.
    node["metadata"]["annotations"]["cdmo.io/gpu-health-cleared"] = "2026-11-27T18:00:00Z"
    assert node_body(node)["metadata"]["annotations"] == {"cdmo.io/gpu-health-cleared": "2026-11-27T18:00:00Z"}


def test_an_owned_object_keeps_spec_and_status_without_annotations() -> None:
    quota = {"metadata": {"name": "q", "namespace": "t", "generation": 3, "annotations": {"a": BIG},
                          "managedFields": MANAGED}, "spec": {"memory": "80Gi"}, "status": {"used": {}}}
    kept = owned_body(quota)
    assert kept == {"metadata": {"name": "q", "namespace": "t", "generation": 3}, "spec": {"memory": "80Gi"},
                    "status": {"used": {}}}
