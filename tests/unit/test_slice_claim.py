"""core/books/slice_claim.py: the claim of a slice and the allocation the controller writes into it, by table,
against resource.k8s.io/v1 as kube-apiserver 1.34 validates it (pkg/apis/resource/validation: a result's
request names a request of the spec, its driver is a DNS subdomain of at most 63 characters, its pool
a '/'-separated path of DNS subdomains of at most 253, its device a DNS label; the node selector a
core/v1 NodeSelector). tests/e2e/test_claim_pinning.py writes the same bodies to a real API server."""

from __future__ import annotations

import re

import pytest

from mig_operator.core.books.slice_claim import (
    ELSEWHERE,
    PINNED,
    STAMP_LATER,
    STAMP_NOW,
    STAMP_OK,
    UNALLOCATED,
    allocation,
    allocation_patch,
    allocation_state,
    claim_body,
    claim_user,
    deallocation_patch,
    node_pool,
    pod_consumer,
    restamp,
    serves_stamp,
    unreserve_patch,
)

UID = "0b9e6a8c-2f43-4d7a-9c1e-5a6b7c8d9e0f"
AT = "2026-11-27T11:40:05Z"
RFC3339_SECONDS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
OWNER = {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": "train", "uid": UID, "controller": True}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _pinned(node: str) -> dict:
    return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}


@pytest.mark.parametrize("node", ["n", "gpu-node-7", "ip-10-0-3-17.ec2.internal", "a" * 253])
def test_the_allocation_is_the_slices_device_in_the_nodes_pool_usable_there_only(node: str) -> None:
    claim = claim_body("ns", "train", OWNER)
    alloc = allocation(node, UID, AT)
    assert alloc == {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": node,
                                              "device": UID}]},
                     "nodeSelector": _pinned(node), "allocationTimestamp": AT}
    assert allocation_patch(node, UID, AT) == {"status": {"allocation": alloc}}
    # What kube-apiserver checks of a new allocation result.
    requests = {r["name"] for r in claim["spec"]["devices"]["requests"]}
    [result] = alloc["devices"]["results"]
    assert result["request"] in requests
    assert DNS_SUBDOMAIN.fullmatch(result["driver"]) and len(result["driver"]) <= 63
    assert len(result["pool"]) <= 253 and all(DNS_SUBDOMAIN.fullmatch(p) for p in result["pool"].split("/"))
    assert DNS_LABEL.fullmatch(result["device"]) and len(result["device"]) <= 63
    # Stamped by the controller: kube-scheduler (1.36+) would otherwise stamp it, changing an immutable field.
    assert set(alloc) == {"devices", "nodeSelector", "allocationTimestamp"}
    assert RFC3339_SECONDS.fullmatch(alloc["allocationTimestamp"])
    [term] = alloc["nodeSelector"]["nodeSelectorTerms"]
    assert term["matchFields"][0]["key"] == "metadata.name"  # the only field a node selector may match


def test_a_pods_claim_is_reserved_for_it_in_the_allocating_write() -> None:
    pod = pod_consumer("train-0", "8d3c1f2e-0000-4000-8000-000000000001")
    # resource.k8s.io/v1 ResourceClaimConsumerReference, written out by hand: kube-controller-manager
    # keeps an entry of the empty API group and resource "pods" while that pod lives.
    assert pod == {"resource": "pods", "name": "train-0", "uid": "8d3c1f2e-0000-4000-8000-000000000001"}
    assert allocation_patch("n", UID, AT, pod) == {"status": {"allocation": allocation("n", UID, AT),
                                                              "reservedFor": [pod]}}
    assert "reservedFor" not in allocation_patch("n", UID, AT)["status"]


def test_a_claim_is_reserved_only_for_a_pod_that_names_it() -> None:
    def pod(*claims: str) -> dict:
        return {"metadata": {"name": "train-0", "uid": "u-1"},
                "spec": {"resourceClaims": [{"name": f"gpu-slice-{i}", "resourceClaimName": c}
                                            for i, c in enumerate(claims)]}}

    user = {"resource": "pods", "name": "train-0", "uid": "u-1"}
    assert claim_user(pod("train"), "train") == user
    assert claim_user(pod("other", "train-1"), "train-1") == user
    # A pod that does not name the claim (a plain pod an owner reference names) never gets it reserved.
    assert claim_user(pod("other"), "train") is None
    assert claim_user(pod(), "train") is None
    assert claim_user({"metadata": {"name": "p", "uid": "u"}, "spec": {}}, "train") is None
    # A template's claim entry (no resourceClaimName) is not this claim.
    assert claim_user({"metadata": {"name": "p", "uid": "u"}, "spec": {"resourceClaims": [
        {"name": "x", "resourceClaimTemplateName": "train"}]}}, "train") is None


def test_unreserve_is_a_strategic_delete_by_the_pods_uid() -> None:
    # The directive kube-scheduler's Unreserve sends: reservedFor merges by uid, others stay.
    assert unreserve_patch("u-1") == {"status": {"reservedFor": [{"$patch": "delete", "uid": "u-1"}]}}


def test_the_pool_is_the_nodes_name() -> None:
    # The agent's ResourceSlices name their pool so (tests/e2e compare with the published slices).
    assert node_pool("gpu-7") == "gpu-7"


def test_the_claim_keeps_its_selector_and_carries_no_finalizer() -> None:
    claim = claim_body("ns", "train", OWNER)
    assert claim["metadata"] == {"name": "train", "namespace": "ns", "ownerReferences": [OWNER]}
    [request] = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": f'device.attributes["gpu.cdmo.io"].slice == "{UID}"'}}]
    assert "status" not in claim  # the API server drops it on create: the allocation is a second write


RESULT = {"request": "gpu", "driver": "gpu.cdmo.io", "pool": "n", "device": UID}


@pytest.mark.parametrize(("status", "state"), [
    ({}, UNALLOCATED),
    ({"allocation": None}, UNALLOCATED),
    ({"reservedFor": []}, UNALLOCATED),
    ({"allocation": {"devices": {"results": [RESULT]}, "nodeSelector": _pinned("n")}}, PINNED),
    # kube-scheduler's own allocation of the true device (claims of an earlier version): the same.
    ({"allocation": {"devices": {"results": [RESULT]}, "nodeSelector": _pinned("n")},
      "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}, PINNED),
    ({"allocation": {"devices": {"results": [{**RESULT, "pool": "thief"}]}, "nodeSelector": _pinned("thief")}},
     ELSEWHERE),
    ({"allocation": {"devices": {"results": [{**RESULT, "pool": "thief"}]}, "nodeSelector": _pinned("n")}},
     ELSEWHERE),
    ({"allocation": {"devices": {"results": [RESULT]}, "nodeSelector": _pinned("thief")}}, ELSEWHERE),
    ({"allocation": {"devices": {"results": [RESULT]}}}, ELSEWHERE),  # usable on any node
    ({"allocation": {"devices": {"results": [{**RESULT, "device": "another-uid"}]}, "nodeSelector": _pinned("n")}},
     ELSEWHERE),
    ({"allocation": {"devices": {"results": [{**RESULT, "driver": "gpu.other.io"}]}, "nodeSelector": _pinned("n")}},
     ELSEWHERE),
    ({"allocation": {"devices": {"results": [RESULT, {**RESULT, "device": "x"}]}, "nodeSelector": _pinned("n")}},
     ELSEWHERE),
    ({"allocation": {"devices": {"results": []}, "nodeSelector": _pinned("n")}}, ELSEWHERE),
])
def test_an_existing_allocation_counts_only_when_it_is_exactly_the_slices_device_on_its_node(
        status: dict, state: str) -> None:
    assert allocation_state({"status": status}, "n", UID) == state


# ---- claims allocated under a release that dropped allocationTimestamp ----------------------------------


@pytest.mark.parametrize(("version", "serves"), [
    ({"major": "1", "minor": "34", "gitVersion": "v1.34.4"}, False),
    ({"major": "1", "minor": "35", "gitVersion": "v1.35.0"}, False),
    ({"major": "1", "minor": "36", "gitVersion": "v1.36.0"}, True),
    ({"major": "1", "minor": "37+", "gitVersion": "v1.37.2-eks-1a2b3c"}, True),  # a vendor's build
    ({"major": "2", "minor": "0", "gitVersion": "v2.0.0"}, True),
    ({"major": "1", "minor": "40", "gitVersion": "v0.0.0-master+$Format:%H$"}, False),  # names no release
    ({"gitVersion": "v1.\u0663\u0667.0"}, False),  # Arabic-Indic digits are not a release
    ({}, False),
])
def test_the_stamp_is_served_from_kubernetes_1_36_as_the_version_answer_names_it(version: dict, serves: bool) -> None:
    assert serves_stamp(version) is serves


STAMPLESS = {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": "n", "device": UID}]},
             "nodeSelector": _pinned("n")}
POD = {"resource": "pods", "name": "notebook", "uid": "pod-uid"}


@pytest.mark.parametrize(("status", "serves", "action"), [
    ({"allocation": STAMPLESS}, True, STAMP_NOW),  # written under 1.34, read on 1.37: again, at once
    ({"allocation": STAMPLESS, "reservedFor": []}, True, STAMP_NOW),
    ({"allocation": STAMPLESS, "reservedFor": [POD]}, True, STAMP_LATER),  # its pod runs: once it is gone
    ({"allocation": {**STAMPLESS, "allocationTimestamp": AT}}, True, STAMP_OK),
    ({"allocation": {**STAMPLESS, "allocationTimestamp": AT}, "reservedFor": [POD]}, True, STAMP_OK),
    ({"allocation": STAMPLESS}, False, STAMP_OK),  # as a 1.34 or 1.35 API server keeps it
    ({"allocation": STAMPLESS, "reservedFor": [POD]}, False, STAMP_OK),
    ({}, True, STAMP_OK),  # not allocated: the allocation written next is stamped
    ({"allocation": None}, True, STAMP_OK),
])
def test_an_allocation_without_a_stamp_is_written_again_where_the_api_server_keeps_one_and_no_pod_holds_it(
        status: dict, serves: bool, action: str) -> None:
    assert restamp({"status": status}, serves) == action


def test_the_allocation_is_taken_away_only_from_the_version_read() -> None:
    # A JSON merge patch: null removes the field; a resourceVersion in it is the write's precondition.
    assert deallocation_patch("4711") == {"metadata": {"resourceVersion": "4711"}, "status": {"allocation": None}}
