"""A GpuSlice's ResourceClaim and the allocation the controller writes into it (docs/architecture.md, section 8).

The claim asks for one device of class ``gpuslice.cdmo.io`` whose ``slice`` attribute is the slice's
UID. That selector alone would let kube-scheduler take the device from any pool, and an agent
publishes whatever it likes in its own node's ResourceSlice: a compromised agent could publish a
device named after another node's slice and draw that slice's pods to its node. So the controller
allocates the claim itself (a pre-allocated claim), once the device is checked on the bound node's
GpuNode: the result names the bound node's pool (the agent's pool is named after its node) and the
slice's device, and the allocation's node selector pins every pod of the claim to that node.
kube-scheduler then only checks the node selector and reserves the claim for the pod; it never looks
for the device in a ResourceSlice. The selector stays in the spec: it says what the claim is for,
and ``kubectl describe`` shows it.

No ``resource.kubernetes.io/delete-protection`` finalizer: kube-controller-manager's resourceclaim
controller clears the allocation of a claim carrying it once no pod uses it, and an unallocated claim
is one kube-scheduler would allocate from any pool again. Without it the claim stays allocated for
its whole life, which is the slice's.

Pure: the caller writes the bodies (the claim first, then ``status.allocation`` through the status
subresource: the API server drops the status of a created claim). In between, a pod that already
names the claim could have kube-scheduler allocate it from any pool; the chart's claim allocation
policy (templates/claim-allocation-policy.yaml) refuses that, and kube-scheduler's finalizer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..node.cdi import DRIVER

DRA_API = "resource.k8s.io/v1"
RESOURCE_CLAIMS = "resourceclaims"
DEVICE_CLASS = "gpuslice.cdmo.io"
REQUEST_NAME = "gpu"
# kube-scheduler's own finalizer on the claims it allocates (resource.k8s.io/v1 Finalizer).
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"

# How a claim's allocation stands against the slice's (``allocation_state``).
UNALLOCATED = "unallocated"
PINNED = "pinned"
ELSEWHERE = "elsewhere"

# The first Kubernetes release whose API server keeps an allocation's ``allocationTimestamp``.
STAMP_SERVED_FROM = (1, 36)
# What an allocated claim needs for the API server that runs now (``restamp``).
STAMP_OK = "ok"  # as that server expects it
STAMP_NOW = "now"  # written again: without its allocation, then with it, stamped
STAMP_LATER = "later"  # as STAMP_NOW, once no pod reserves it


def claim_path(namespace: str, name: str | None = None) -> str:
    """The API path of a namespace's ResourceClaims, or of one of them."""
    base = f"/apis/{DRA_API}/namespaces/{namespace}/{RESOURCE_CLAIMS}"
    return f"{base}/{name}" if name else base


def node_pool(node: str) -> str:
    """The name of the DRA pool of ``node``'s devices: the node's name (one pool per node, however
    many ResourceSlices it spreads over)."""
    return node


def device_selector(slice_uid: str) -> str:
    """The CEL expression that matches the device of slice ``slice_uid`` and no other."""
    return f'device.attributes["{DRIVER}"].slice == "{slice_uid}"'


def claim_body(namespace: str, name: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The ResourceClaim of slice ``namespace/name``; ``owner`` is the slice's ownerReference
    (``uid`` the slice's UID), the claim's only one, so deleting the slice deletes the claim."""
    return {
        "apiVersion": DRA_API, "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "ownerReferences": [dict(owner)]},
        "spec": {"devices": {"requests": [{"name": REQUEST_NAME, "exactly": {
            "deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": 1,
            "selectors": [{"cel": {"expression": device_selector(str(owner["uid"]))}}]}}]}},
    }


def allocation(node: str, slice_uid: str, at: str) -> dict[str, Any]:
    """The claim's ``status.allocation``: slice ``slice_uid``'s device in ``node``'s pool, usable on
    ``node`` only (the node selector kube-scheduler writes for a node-local pool), allocated at ``at``
    (RFC 3339, seconds).

    The allocation is immutable once written. From Kubernetes 1.36 kube-scheduler stamps an
    ``allocationTimestamp`` onto an allocation that has none when it writes a reservation, which the
    API server then refuses as a change of the allocation: a pod naming a directly made slice's claim
    would never bind. So the controller writes the stamp itself; 1.34 and 1.35 drop the field, and a
    claim allocated under them is written again once the API server keeps it (``restamp``).
    """
    return {
        "devices": {"results": [{"request": REQUEST_NAME, "driver": DRIVER, "pool": node_pool(node),
                                 "device": slice_uid}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        "allocationTimestamp": at,
    }


def pod_consumer(pod_name: str, pod_uid: str) -> dict[str, str]:
    """A ``status.reservedFor`` entry for a pod (resource.k8s.io/v1 ResourceClaimConsumerReference; the
    core API group is the empty one, left out as kube-scheduler leaves it)."""
    return {"resource": "pods", "name": pod_name, "uid": pod_uid}


def claim_user(pod: Mapping[str, Any], claim_name: str) -> dict[str, str] | None:
    """``pod``'s ``pod_consumer`` entry when its ``spec.resourceClaims`` names claim ``claim_name`` (the
    only pods kube-scheduler reserves a claim for), else None. A reservation for a pod that does not
    name the claim would hold the slice (``core.node.lifecycle.claim_hold``) for as long as that pod lives."""
    meta = pod.get("metadata") or {}
    if not any(c.get("resourceClaimName") == claim_name for c in (pod.get("spec") or {}).get("resourceClaims") or []):
        return None
    return pod_consumer(str(meta.get("name", "")), str(meta.get("uid", "")))


def allocation_patch(node: str, slice_uid: str, at: str,
                     reserved_for: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The merge patch of the claim's status subresource that allocates it (``allocation``) and, for a
    pod's slice, reserves it for that pod (``reserved_for``, a ``pod_consumer``) in the same write.

    kube-scheduler writes a reservation only for a pod the claim is not reserved for yet, and
    kube-controller-manager keeps one while its pod exists and has not finished: reserved here, the
    claim costs kube-scheduler no write of its own, and a pod's path from ungated to bound one write
    less. The reservation counts as a use (``core.node.lifecycle.claim_hold``):
    the controller takes it away before a slice of a pod that is still gated goes (``unreserve_patch``).
    """
    status: dict[str, Any] = {"allocation": allocation(node, slice_uid, at)}
    if reserved_for is not None:
        status["reservedFor"] = [dict(reserved_for)]
    return {"status": status}


def unreserve_patch(pod_uid: str) -> dict[str, Any]:
    """The strategic merge patch of the claim's status subresource that takes pod ``pod_uid``'s
    reservation away and leaves any other (``reservedFor`` merges by ``uid``), as kube-scheduler's
    Unreserve does; a claim not reserved for the pod is left as it is."""
    return {"status": {"reservedFor": [{"$patch": "delete", "uid": pod_uid}]}}


def allocation_state(claim: Mapping[str, Any], node: str, slice_uid: str) -> str:
    """``UNALLOCATED``; ``PINNED`` when the claim is allocated exactly as ``allocation`` would (the
    slice's device of ``node``'s pool and nothing else, usable on ``node`` only: written by the
    controller, or by kube-scheduler before the controller allocated claims itself, when the device
    was the true one); else ``ELSEWHERE``."""
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        return UNALLOCATED
    results = [(r.get("driver"), r.get("pool"), r.get("device"))
               for r in (alloc.get("devices") or {}).get("results") or []]
    if results != [(DRIVER, node_pool(node), slice_uid)]:
        return ELSEWHERE
    terms = (alloc.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    pinned = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    return PINNED if terms == pinned else ELSEWHERE


def serves_stamp(version: Mapping[str, Any]) -> bool:
    """Whether the API server whose ``/version`` answer is ``version`` keeps an allocation's
    ``allocationTimestamp`` (``STAMP_SERVED_FROM`` on). ``gitVersion`` (``v1.37.2``) is read, as
    ``minor`` may carry a suffix (``37+``); an answer that names no release counts as an old one."""
    found = re.match(r"v([0-9]{1,4})\.([0-9]{1,4})\.", str(version.get("gitVersion", "")))
    return found is not None and (int(found[1]), int(found[2])) >= STAMP_SERVED_FROM


def stamped(claim: Mapping[str, Any]) -> bool:
    """Whether ``claim`` is allocated with an ``allocationTimestamp``."""
    return bool(((claim.get("status") or {}).get("allocation") or {}).get("allocationTimestamp"))


def restamp(claim: Mapping[str, Any], serves: bool) -> str:
    """What the controller's allocated claim ``claim`` needs on an API server that keeps
    ``allocationTimestamp`` (``serves``) or drops it.

    An allocation written under a release that dropped the field has none, and from 1.36
    kube-scheduler adds one when it reserves the claim for a pod, which the API server refuses as a
    change of the allocation: no new pod could use the claim. An allocation cannot change, but it can
    be taken away and written again: STAMP_NOW while no pod reserves the claim, STAMP_LATER while one
    does (that pod runs already; the claim is written again once it is gone). STAMP_OK for a claim
    that is stamped, not allocated, or on a server that drops the field."""
    status = claim.get("status") or {}
    if not serves or not status.get("allocation") or stamped(claim):
        return STAMP_OK
    return STAMP_LATER if status.get("reservedFor") else STAMP_NOW


def deallocation_patch(resource_version: str) -> dict[str, Any]:
    """The merge patch of the claim's status subresource that takes its allocation away, applied only
    to version ``resource_version`` of the claim (the one read without reservations: a pod reserving
    it meanwhile makes the write a 409 Conflict)."""
    return {"metadata": {"resourceVersion": resource_version}, "status": {"allocation": None}}
