"""Each Ready GpuSlice's ResourceClaim (kube/controller/claims.py): its shape, when it is written and
allocated, and what happens to a claim of the same name that is not this slice's or is allocated
otherwise."""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import pytest
from books import BodyLedger

from mig_operator.core.books.ledger import CLAIM_ALLOCATED, CLAIM_NONE, CLAIM_WRITTEN
from mig_operator.core.placement.cluster import Binding, binding_from_status
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.names import POD_SLICE_LABEL, SCHEDULING_GATE
from mig_operator.kube.common.workqueue import WorkQueue
from mig_operator.kube.controller import claims as claims_module
from mig_operator.kube.controller.claims import SliceClaims, claim_body, slice_owner
from mig_operator.kube.controller.observe import pod_record

UID = "0b9e6a8c-2f43-4d7a-9c1e-5a6b7c8d9e0f"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims"
CLAIM_STATUS = f"{CLAIMS}/train/status"
SLICE_STATUS = "/apis/cdmo.io/v1alpha1/namespaces/ns/gpuslices/train/status"
# Written out by hand from resource.k8s.io/v1 (AllocationResult), not from the code: node n's pool.
# resource.k8s.io/v1 ResourceClaimConsumerReference of pod p (the core group is the empty one).
POD_P = {"resource": "pods", "name": "p", "uid": "pod-uid"}
PINNED = {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": "n", "device": UID}]},
          "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
              {"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}}


def test_the_claim_asks_for_exactly_the_slices_device_of_the_operators_class() -> None:
    body = claim_body("ns", "train", UID)
    # Written out by hand from resource.k8s.io/v1 (ResourceClaim, DeviceRequest.exactly), not from the code.
    assert body == {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ns", "ownerReferences": [
            {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": "train", "uid": UID, "controller": True}]},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpuslice.cdmo.io", "allocationMode": "ExactCount", "count": 1,
            "selectors": [{"cel": {"expression": f'device.attributes["gpu.cdmo.io"].slice == "{UID}"'}}]}}]}},
    }


@pytest.mark.parametrize(("refs", "owner"), [
    ([{"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "uid": "u1"}], "u1"),
    ([{"apiVersion": "v1", "kind": "Pod", "uid": "p"}, {"apiVersion": "cdmo.io/v1", "kind": "GpuSlice", "uid": "u2"}],
     "u2"),
    ([{"apiVersion": "other.io/v1", "kind": "GpuSlice", "uid": "u3"}], None),  # same kind, another group
    ([{"apiVersion": "v1", "kind": "Pod", "uid": "p"}], None),
    ([], None),
])
def test_only_a_gpuslice_of_this_api_owns_a_claim(refs: list[dict], owner: str | None) -> None:
    assert slice_owner({"metadata": {"ownerReferences": refs}}) == owner


class _Client:
    def __init__(self, existing: dict | None = None, gone_after: int = 0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.existing = existing
        self.gone_after = gone_after  # GETs of the existing claim before it is gone (after a delete)
        self.deleted = False
        self.refusal: ApiError | None = None  # what the API server answers an allocation with, if not OK
        # The API server's release (its /version): before 1.36 it drops an allocation's allocationTimestamp.
        self.release = (1, 34)
        self.version_reads = 0

    async def create(self, path: str, body: dict) -> dict:
        self.calls.append(("POST", path))
        if self.existing is not None:
            raise ApiError(409, "AlreadyExists", "exists")
        self.existing = body
        return body

    async def get(self, path: str) -> dict:
        if path == "/version":
            self.version_reads += 1
            return {"major": str(self.release[0]), "minor": f"{self.release[1]}+",
                    "gitVersion": f"v{self.release[0]}.{self.release[1]}.2"}
        self.calls.append(("GET", path))
        if self.existing is None:
            raise ApiError(404, "NotFound", "gone")
        if self.deleted:
            if self.gone_after <= 0:
                self.existing = None
                raise ApiError(404, "NotFound", "gone")
            self.gone_after -= 1
        return self.existing

    async def delete(self, path: str) -> dict:
        self.calls.append(("DELETE", path))
        self.deleted = True
        if self.existing is not None:  # kept by its finalizer a while: going
            meta = {**self.existing.get("metadata", {}), "deletionTimestamp": "2026-01-01T00:00:00Z"}
            self.existing = {**self.existing, "metadata": meta}
        return {}

    async def merge_patch(self, path: str, body: dict) -> dict:
        self.calls.append(("MERGE", path))
        if path == SLICE_STATUS:
            assert body == {"status": {"claim": "train"}}
            return body
        assert path == CLAIM_STATUS and self.existing is not None
        if body["status"].get("allocation", "") is None:
            return self._deallocate(body)
        body = {"status": {**body["status"], "allocation": dict(body["status"]["allocation"])}}
        # The controller stamps its allocation (RFC 3339 to the second); the rest is compared by hand.
        stamp = body["status"]["allocation"].pop("allocationTimestamp")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
        assert body == {"status": {"allocation": PINNED}} or body == {
            "status": {"allocation": PINNED, "reservedFor": [POD_P]}}
        if self.refusal is not None:
            raise self.refusal
        current = (self.existing.get("status") or {}).get("allocation")
        if current is not None and current != PINNED:
            raise ApiError(422, "Invalid", "status.allocation: field is immutable")
        if current is not None and self.release >= (1, 36):  # a stamp where there was none is a change
            raise ApiError(422, "Invalid", "status.allocation: field cannot be modified once set")
        self.existing = {**self.existing, "status": dict(body["status"])}
        if self.release >= (1, 36):
            self.existing["status"]["allocation"] = {**body["status"]["allocation"], "allocationTimestamp": stamp}
        self.existing["metadata"] = {**self.existing.get("metadata", {}), "resourceVersion": str(next(_VERSIONS))}
        return self.existing

    def _deallocate(self, body: dict) -> dict:
        """resource.k8s.io/v1's rules for taking an allocation away: only of the version named, never
        while the claim is reserved (a reservation needs an allocation)."""
        assert body == {"metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
                        "status": {"allocation": None}}
        if body["metadata"]["resourceVersion"] != self.existing["metadata"].get("resourceVersion"):
            raise ApiError(409, "Conflict", "the object has been modified")
        status = dict(self.existing.get("status") or {})
        if status.get("reservedFor"):
            raise ApiError(422, "Invalid", "status.reservedFor: Forbidden: may not be set when allocation is not set")
        status.pop("allocation", None)
        self.existing = {**self.existing, "status": status,
                         "metadata": {**self.existing["metadata"], "resourceVersion": str(next(_VERSIONS))}}
        return self.existing

    async def strategic_patch(self, path: str, body: dict) -> dict:
        self.calls.append(("STRATEGIC", path))
        assert path == CLAIM_STATUS
        if self.existing is None:
            raise ApiError(404, "NotFound", "gone")
        # kube-apiserver's merge of reservedFor by uid, written out for the one directive used.
        gone = {entry["uid"] for entry in body["status"]["reservedFor"] if entry.get("$patch") == "delete"}
        status = dict(self.existing.get("status") or {})
        status["reservedFor"] = [r for r in status.get("reservedFor", []) if r["uid"] not in gone]
        self.existing = {**self.existing, "status": status}
        return self.existing


class _Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def post(self, obj: Any, kind: str, reason: str, message: str) -> None:
        self.posted.append((reason, message))


_VERSIONS = itertools.count(5)


def _slice(phase: str = "Ready", device: str = "GPU-1") -> dict:
    """The slice as the API server would show it next: each body a newer resourceVersion."""
    return {"metadata": {"uid": UID, "namespace": "ns", "name": "train", "resourceVersion": str(next(_VERSIONS))},
            "spec": {"memory": "4G"},
            "status": {"phase": phase, "mode": "fraction", "node": "n", "gpu": 0, "grantedBytes": 4 * 10**9,
                       "deviceUUID": device, "gpuUUID": "GPU-1"}}


def _claims(client: _Client, phase: str = "Ready", inventory: bool = True,
            device: str = "GPU-1") -> tuple[SliceClaims, BodyLedger, _Events]:
    state = BodyLedger()
    state.put_slice(_slice(phase, device))
    if inventory:
        state.put_inventory({"metadata": {"name": "n"}, "spec": {"nodeName": "n"},
                             "status": {"gpus": [{"index": 0, "uuid": "GPU-1", "memoryMiB": 81559}]}})
    events, queue = _Events(), WorkQueue()
    claims = SliceClaims(client, events, state, queue)  # type: ignore[arg-type]
    # The slice's key, as far as its claim goes (slice_key.py's claim step).
    queue.register("slice", lambda namespace, name: claims.ensure(state.slice_named(namespace, name)))
    return claims, state, events


def test_a_ready_slice_gets_its_claim_once_and_its_status_names_it() -> None:
    client = _Client()
    claims, state, _ = _claims(client)
    info = state.slice_named("ns", "train")
    assert asyncio.run(claims.ensure(info)) is True
    assert asyncio.run(claims.ensure(info)) is True
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS), ("MERGE", SLICE_STATUS)]
    assert client.existing["status"]["allocation"] == PINNED


@pytest.mark.parametrize("phase", ["Pending", "Bound", "Creating", "Failed", "Released"])
def test_a_slice_not_ready_gets_no_claim(phase: str) -> None:
    client = _Client()
    claims, state, _ = _claims(client, phase=phase)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == []


def test_a_device_its_gpunode_does_not_list_yet_gets_its_claim_when_the_gpunode_does() -> None:
    client = _Client()
    claims, state, _ = _claims(client, inventory=False)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == []
    state.put_inventory({"metadata": {"name": "n"}, "spec": {"nodeName": "n"},
                         "status": {"gpus": [{"index": 0, "uuid": "GPU-1", "memoryMiB": 81559}]}})

    async def changed() -> None:
        assert state.take_device_waits("n") == [("ns", "train")]  # one wait, as main.py reads it
        assert state.take_device_waits("n") == []  # taken once
        claims.look("ns", "train")
        while len(claims.queue):
            await asyncio.sleep(0.01)

    asyncio.run(changed())
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS), ("MERGE", SLICE_STATUS)]


def test_a_device_of_another_gpu_never_gets_a_claim() -> None:
    client = _Client()
    claims, state, _ = _claims(client, device="GPU-someone-elses")
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == []


def test_a_claim_the_operator_did_not_write_is_left_alone_and_said() -> None:
    client = _Client(existing={"metadata": {"name": "train", "ownerReferences": []}})
    claims, state, events = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert [c[0] for c in client.calls] == ["POST", "GET"]
    [(reason, message)] = events.posted
    assert reason == "ClaimNameTaken" and "ns/train" in message and "not written by mig-operator" in message


def test_this_slices_own_claim_is_taken_as_written() -> None:
    mine = claim_body("ns", "train", UID)
    client = _Client(existing=mine)
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls == [("POST", CLAIMS), ("GET", f"{CLAIMS}/train"), ("MERGE", CLAIM_STATUS),
                            ("MERGE", SLICE_STATUS)]


def test_an_earlier_slices_claim_is_deleted_and_this_ones_written_once_it_is_gone(monkeypatch) -> None:
    monkeypatch.setattr(claims_module, "STALE_CLAIM_RECHECK_S", (0.01, 0.01))
    client = _Client(existing=claim_body("ns", "train", "an-earlier-uid"), gone_after=2)
    claims, state, _ = _claims(client)

    async def main() -> bool:
        written = await claims.ensure(state.slice_named("ns", "train"))
        assert claims.queue.pending(("slice", "ns", "train"))  # looked at again later, not waited for
        while len(claims.queue):
            await asyncio.sleep(0.01)
        return written

    assert asyncio.run(main()) is False
    # Deleted once, then looked at until it is gone (two looks find it going), then written and allocated.
    assert [c[0] for c in client.calls] == ["POST", "GET", "DELETE", "POST", "GET", "POST", "GET", "POST", "GET",
                                            "POST", "MERGE", "MERGE"]
    assert slice_owner(client.existing) == UID and state.claim_state(UID) == CLAIM_ALLOCATED


def _pods_slice(state: BodyLedger, phase: str) -> None:
    body = _slice(phase)
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}]
    state.put_slice(body)


def test_a_pods_slice_gets_its_claim_at_once_and_its_allocation_once_bound() -> None:
    client = _Client()
    claims, state, _ = _claims(client)
    pending = _slice("Pending")
    pending["status"] = {"phase": "Pending"}  # not bound: no node to allocate the claim on
    pending["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}]
    state.put_slice(pending)
    asked: list[str] = []
    claims.consumer = lambda info: asked.append(info.uid) or POD_P  # the pod the controller made it for
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == [("POST", CLAIMS)] and "status" not in client.existing
    # Bound: allocated while the agent realises the slice. A fraction without a compute share on a GPU
    # its GpuNode lists takes no NVML call, so it is handed on at once (its pod need not wait for the
    # Ready write; core/books/device_check.check_bound_device), with no write of the slice's status.
    _pods_slice(state, "Bound")
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls[1:] == [("MERGE", CLAIM_STATUS)]
    assert client.existing["status"]["allocation"] == PINNED
    # Reserved for the pod in the same write: kube-scheduler, which reserves only a claim not reserved
    # for the pod yet, then writes nothing to it.
    assert client.existing["status"]["reservedFor"] == [POD_P] and asked == [UID]
    _pods_slice(state, "Ready")
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls[2:] == []  # nothing left to write once Ready (the agent's Ready names the claim)


def _pending_pods_slice(state: BodyLedger) -> None:
    pending = _slice("Pending")
    pending["status"] = {"phase": "Pending"}
    pending["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}]
    state.put_slice(pending)


def _decided_on_n(state: BodyLedger) -> Binding:
    """The binding the binder decided for the slice (on node n) and is writing: the ledger's reservation."""
    binding = binding_from_status(UID, _slice("Bound")["status"])
    assert binding is not None and binding.node == "n"
    reserved = {UID: binding}
    state.reserved = lambda uid: reserved.get(uid)  # type: ignore[method-assign]
    state.reservations = reserved  # type: ignore[attr-defined]
    return binding


def test_a_pods_slice_claim_is_allocated_while_its_binding_is_written_and_handed_on_once_written() -> None:
    client = _Client()
    claims, state, _ = _claims(client)
    _pending_pods_slice(state)
    claims.consumer = lambda info: POD_P
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    _decided_on_n(state)  # decided, its write under way
    # Allocated now on the decided node, reserved for the pod; not handed on: the binding is not written.
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS)]
    assert client.existing["status"]["allocation"] == PINNED and client.existing["status"]["reservedFor"] == [POD_P]
    assert state.claim_state(UID) == CLAIM_ALLOCATED
    state.reservations.clear()  # written: its answer observed
    _pods_slice(state, "Bound")
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls[2:] == []


def test_a_claim_allocated_while_the_binding_write_fails_is_not_taken_as_allocated() -> None:
    client = _Client()
    claims, state, _ = _claims(client)
    _pending_pods_slice(state)
    claims.consumer = lambda info: POD_P
    _decided_on_n(state)
    allocate = client.merge_patch

    async def binding_fails_meanwhile(path: str, body: dict) -> dict:
        answer = await allocate(path, body)
        state.reservations.clear()  # the binding's write failed while the allocation was under way
        return answer

    client.merge_patch = binding_fails_meanwhile  # type: ignore[method-assign]
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert state.claim_state(UID) == CLAIM_WRITTEN  # the next binding's allocation is checked anew


def test_a_pods_mig_slice_bound_for_a_new_instance_is_handed_on_only_once_ready() -> None:
    client = _Client()
    claims, state, _ = _claims(client, inventory=False)
    state.put_inventory({"metadata": {"name": "n"}, "spec": {"nodeName": "n"}, "status": {"gpus": [
        {"index": 0, "uuid": "GPU-1", "memoryMiB": 81559, "migEnabled": True, "instances": []}]}})
    body = _slice("Bound")
    body["status"].update(mode="mig", profileId=19, profile="1g.10gb", placement={"start": 0, "size": 1})
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid"}]
    state.put_slice(body)
    # No idle instance at the placement: the agent makes one through NVML, so the pod waits for Ready.
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS)]


def test_a_slice_whose_owner_reference_alone_names_a_pod_is_reserved_for_no_pod() -> None:
    # A tenant wrote the reference (kubectl apply): no pod the controller made the slice for, so its
    # claim is allocated early, as a pod's slice's, and reserved for nobody.
    client = _Client()
    claims, state, _ = _claims(client)
    _pods_slice(state, "Bound")
    asyncio.run(claims.ensure(state.slice_named("ns", "train")))
    assert client.existing["status"] == {"allocation": PINNED}


def test_a_pod_is_the_consumer_only_of_its_own_gated_slice_whose_claim_it_names() -> None:
    state = BodyLedger()
    claims = SliceClaims(None, None, state, WorkQueue())  # type: ignore[arg-type]
    _pods_slice(state, "Bound")
    info = state.slice_named("ns", "train")
    made = {"metadata": {"name": "p", "uid": "pod-uid", "namespace": "ns", "labels": {POD_SLICE_LABEL: "train"}},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}],
                     "resourceClaims": [{"name": "gpu-slice", "resourceClaimName": "train"}]}}
    assert claims.consumer(info) is None  # no pod seen
    state.put_pod("ns", "train", pod_record(made))
    assert claims.consumer(info) == POD_P
    # Another pod of that name and label (another UID), one not naming the claim, one no longer gated:
    # none of them is the pod the slice was made for while gated.
    state.put_pod("ns", "train", pod_record({**made, "metadata": {**made["metadata"], "uid": "other-uid"}}))
    assert claims.consumer(info) is None
    state.put_pod("ns", "train", pod_record({**made, "spec": {**made["spec"], "resourceClaims": []}}))
    assert claims.consumer(info) is None
    state.put_pod("ns", "train", pod_record({**made, "spec": {**made["spec"], "schedulingGates": []}}))
    assert claims.consumer(info) is None
    # Another namespace's pod of the slice's name is never looked at.
    state.remove_pod("ns", "train")
    state.put_pod("other", "train", pod_record({**made, "metadata": {**made["metadata"], "namespace": "other"}}))
    assert claims.consumer(info) is None


def test_a_slice_made_directly_is_reserved_for_no_pod() -> None:
    client = _Client()
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.existing["status"] == {"allocation": PINNED}  # any pod of the namespace may name it


def test_unreserve_takes_away_only_the_slices_pods_reservation_and_only_once() -> None:
    other = {"resource": "pods", "name": "q", "uid": "q-uid"}
    client = _Client(existing={**claim_body("ns", "train", UID),
                               "status": {"allocation": PINNED, "reservedFor": [POD_P, other]}})
    claims, state, _ = _claims(client)
    _pods_slice(state, "Ready")
    info = state.slice_named("ns", "train")
    asyncio.run(claims.unreserve(info))
    asyncio.run(claims.unreserve(info))
    assert client.calls == [("STRATEGIC", CLAIM_STATUS)]
    assert client.existing["status"] == {"allocation": PINNED, "reservedFor": [other]}


def test_unreserve_leaves_a_directly_made_slices_claim_alone_and_a_gone_claim_is_no_error() -> None:
    client = _Client(existing={**claim_body("ns", "train", UID), "status": {"allocation": PINNED,
                                                                            "reservedFor": [POD_P]}})
    claims, state, _ = _claims(client)
    asyncio.run(claims.unreserve(state.slice_named("ns", "train")))  # no Pod owner: its pods are users'
    assert client.calls == [] and client.existing["status"]["reservedFor"] == [POD_P]
    gone = _Client()
    claims, state, _ = _claims(gone)
    _pods_slice(state, "Ready")
    asyncio.run(claims.unreserve(state.slice_named("ns", "train")))
    assert gone.calls == [("STRATEGIC", CLAIM_STATUS)]


def test_a_slice_made_directly_is_not_allocated_before_it_is_ready() -> None:
    client = _Client()
    claims, state, _ = _claims(client, phase="Bound")
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == []  # any pod of the namespace may name its claim: nothing before Ready


def test_a_claim_already_allocated_to_the_slices_device_on_its_node_is_not_written_again() -> None:
    client = _Client(existing={**claim_body("ns", "train", UID), "status": {"allocation": PINNED}})
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls == [("POST", CLAIMS), ("GET", f"{CLAIMS}/train"), ("MERGE", SLICE_STATUS)]


ELSEWHERE = {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": "thief", "device": UID}]},
             "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                 {"key": "metadata.name", "operator": "In", "values": ["thief"]}]}]}}


def test_a_claim_allocated_in_another_pool_is_deleted_with_a_warning_and_never_handed_on() -> None:
    client = _Client(existing={**claim_body("ns", "train", UID), "status": {"allocation": ELSEWHERE}})
    claims, state, events = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == [("POST", CLAIMS), ("GET", f"{CLAIMS}/train"), ("DELETE", f"{CLAIMS}/train")]
    [(reason, message)] = events.posted
    assert reason == "ClaimAllocatedElsewhere" and "gpu.cdmo.io/thief/" + UID in message
    assert state.claim_state(UID) == CLAIM_NONE  # written anew at the next event


def test_an_allocation_refused_for_another_reason_is_reported_and_the_claim_kept() -> None:
    # Kubernetes 1.36+ without the binding subresource's permission: 422, and the claim stays unallocated.
    client = _Client()
    client.refusal = ApiError(422, "Invalid", 'status.allocation: Forbidden: changing status.allocation or '
                              'status.reservedFor requires resource="resourceclaims/binding", verb="patch" permission')
    claims, state, events = _claims(client)
    with pytest.raises(ApiError, match="resourceclaims/binding"):
        asyncio.run(claims.ensure(state.slice_named("ns", "train")))
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS), ("GET", f"{CLAIMS}/train")]
    assert client.existing is not None and not client.deleted  # never deleted
    [(reason, message)] = events.posted
    assert reason == "ClaimNotAllocated" and "resourceclaims/binding" in message


class _RacedClient(_Client):
    """kube-scheduler allocated the claim between its create and the controller's allocation."""

    def __init__(self, theirs: dict) -> None:
        super().__init__()
        self.theirs = theirs

    async def create(self, path: str, body: dict) -> dict:
        created = await super().create(path, body)
        self.existing = {**created, "status": {"allocation": self.theirs}}
        return created


def test_an_allocation_that_won_the_race_is_kept_when_it_is_the_slices_device_on_its_node() -> None:
    client = _RacedClient(PINNED)  # the same allocation again: the API server takes it as no change
    claims, state, events = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS), ("MERGE", SLICE_STATUS)]
    assert events.posted == []


def test_an_allocation_in_another_pool_that_won_the_race_is_deleted_and_never_handed_on() -> None:
    client = _RacedClient(ELSEWHERE)
    claims, state, events = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is False
    assert client.calls == [("POST", CLAIMS), ("MERGE", CLAIM_STATUS), ("GET", f"{CLAIMS}/train"),
                            ("DELETE", f"{CLAIMS}/train")]
    assert [reason for reason, _ in events.posted] == ["ClaimAllocatedElsewhere"]


def test_a_claim_kube_scheduler_allocated_before_is_allocated_again_at_each_look_until_it_is_the_controllers() -> None:
    # Its finalizer has kube-controller-manager clear the allocation once no pod uses it.
    legacy = claim_body("ns", "train", UID)
    legacy["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    client = _Client(existing={**legacy, "status": {"allocation": PINNED}})
    claims, state, _ = _claims(client)
    info = state.slice_named("ns", "train")
    assert asyncio.run(claims.ensure(info)) is True
    assert state.claim_state(UID) != CLAIM_ALLOCATED
    client.existing = {**claim_body("ns", "train", UID), "status": {}}  # deallocated, finalizer gone
    assert asyncio.run(claims.ensure(info)) is True
    assert client.calls == [("POST", CLAIMS), ("GET", f"{CLAIMS}/train"), ("MERGE", SLICE_STATUS),
                            ("MERGE", CLAIM_STATUS), ("MERGE", SLICE_STATUS)]
    assert client.existing["status"]["allocation"] == PINNED
    assert state.claim_state(UID) == CLAIM_ALLOCATED


def test_the_ledger_forgets_a_claims_state_with_its_slice() -> None:
    """The claim's state is the ledger's, kept only while its slice is known: a slice gone (or missing
    from a full list) leaves nothing behind, and a late write's answer for it records nothing."""
    client = _Client()
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert state.claim_state(UID) == CLAIM_ALLOCATED
    state.replace_all([], [], {})
    assert state.claim_state(UID) == CLAIM_NONE
    state.set_claim_state(UID, CLAIM_ALLOCATED)  # the slice is gone: nothing is kept for it
    assert state.claim_state(UID) == CLAIM_NONE and not state.unreserving(UID)


def test_a_going_slices_reservation_is_taken_off_only_for_its_gated_pod_not_being_ungated() -> None:
    """``slice_going`` reads the pod from the ledger: the reservation goes for a gated pod that owns the
    slice, and stays for a pod being ungated (it is about to run on the device) or one let go already."""
    made = {"metadata": {"name": "p", "uid": "pod-uid", "namespace": "ns", "labels": {POD_SLICE_LABEL: "train"}},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}],
                     "resourceClaims": [{"name": "gpu-slice", "resourceClaimName": "train"}]}}
    for pod, ungating, unreserved in ((None, False, False), (made, True, False),
                                      ({**made, "spec": {**made["spec"], "schedulingGates": []}}, False, False),
                                      (made, False, True)):
        client = _Client(existing={**claim_body("ns", "train", UID),
                                   "status": {"allocation": PINNED, "reservedFor": [POD_P]}})
        claims, state, _ = _claims(client)
        _pods_slice(state, "Ready")
        if pod is not None:
            state.put_pod("ns", "train", pod_record(pod))
        state.set_ungating("ns", "train", ungating)
        asyncio.run(claims.slice_going(state.slice_named("ns", "train")))
        assert (client.calls == [("STRATEGIC", CLAIM_STATUS)]) is unreserved, (pod is not None, ungating)


# ---- claims allocated under a release that dropped allocationTimestamp ----------------------------------

# As a 1.34 API server kept the controller's allocation: without its allocationTimestamp.
STAMPLESS = {**claim_body("ns", "train", UID), "status": {"allocation": PINNED}}
STAMPLESS["metadata"] = {**STAMPLESS["metadata"], "resourceVersion": "100"}
READ_CLAIM = ("GET", f"{CLAIMS}/train")


def _stamped_again(client: _Client) -> bool:
    """The claim is allocated to the slice's device on its node, and now with a stamp."""
    allocation = dict(client.existing["status"]["allocation"])
    return bool(allocation.pop("allocationTimestamp", None)) and allocation == PINNED


def test_a_claim_allocated_under_1_34_is_allocated_again_with_its_stamp_when_read_at_start_on_1_37() -> None:
    client = _Client(existing=STAMPLESS)
    client.release = (1, 37)
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    # The start-up read finds it; its allocation is taken away (a write of its own: an allocation
    # cannot change), then written again to the same device.
    assert client.calls == [("POST", CLAIMS), READ_CLAIM, ("MERGE", CLAIM_STATUS), ("MERGE", CLAIM_STATUS),
                            ("MERGE", SLICE_STATUS)]
    assert _stamped_again(client) and not client.existing["status"].get("reservedFor")
    assert state.claim_state(UID) == CLAIM_ALLOCATED
    asyncio.run(claims.ensure(state.slice_named("ns", "train")))
    assert len(client.calls) == 5  # done: not looked at again


def test_a_controller_that_runs_through_the_upgrade_allocates_its_claims_again_once_the_release_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(claims_module.time, "monotonic", lambda: clock[0])
    client = _Client()  # 1.34
    claims, state, _ = _claims(client)
    info = state.slice_named("ns", "train")
    assert asyncio.run(claims.ensure(info)) is True
    assert "allocationTimestamp" not in client.existing["status"]["allocation"]  # dropped by 1.34
    written = list(client.calls)
    for _ in range(3):  # looked at again (events, resyncs): the release is read once in its time to live
        assert asyncio.run(claims.ensure(info)) is True
    assert client.calls == written and client.version_reads == 1
    client.release = (1, 37)  # kube-apiserver replaced by 1.37's on the same etcd
    assert asyncio.run(claims.ensure(info)) is True
    assert client.calls == written  # the release is known for SERVER_VERSION_TTL_S
    clock[0] += claims_module.SERVER_VERSION_TTL_S + 1
    assert asyncio.run(claims.ensure(info)) is True
    # Read, its allocation taken away, written again; the slice's status names its claim (as before).
    assert client.calls[len(written):] == [READ_CLAIM, ("MERGE", CLAIM_STATUS), ("MERGE", CLAIM_STATUS),
                                           ("MERGE", SLICE_STATUS)]
    assert _stamped_again(client) and client.version_reads == 2


def test_a_claim_a_running_pod_reserves_is_left_and_allocated_again_once_the_reservation_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims_module, "RESTAMP_RECHECK_S", 0.01)
    client = _Client(existing={**STAMPLESS, "status": {"allocation": PINNED, "reservedFor": [POD_P]}})
    client.release = (1, 37)
    claims, state, _ = _claims(client)

    async def main() -> None:
        assert await claims.ensure(state.slice_named("ns", "train")) is True  # the pod that reserves it runs on
        assert claims.queue.pending(("slice", "ns", "train"))  # and it is read again later
        while READ_CLAIM not in client.calls[2:]:
            await asyncio.sleep(0.01)
        assert [c[0] for c in client.calls] == ["POST", "GET", "MERGE", "GET"]  # left while reserved
        # kube-controller-manager takes the reservation of the finished pod away.
        client.existing = {**client.existing, "status": {"allocation": PINNED},
                           "metadata": {**client.existing["metadata"], "resourceVersion": "101"}}
        while not _stamped_again(client):
            await asyncio.sleep(0.01)
        while len(claims.queue):
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert client.calls[-4:] == [READ_CLAIM, ("MERGE", CLAIM_STATUS), ("MERGE", CLAIM_STATUS), ("MERGE", SLICE_STATUS)]
    assert state.claim_state(UID) == CLAIM_ALLOCATED and not client.existing["status"].get("reservedFor")


class _ReservedMeanwhile(_Client):
    """kube-scheduler reserves the claim for a pod between the controller's read and its write."""

    async def get(self, path: str) -> dict:
        claim = await super().get(path)
        if path != "/version":
            self.existing = {**claim, "status": {**claim["status"], "reservedFor": [POD_P]},
                             "metadata": {**claim["metadata"], "resourceVersion": "200"}}
        return claim


def test_a_claim_reserved_between_the_read_and_the_write_keeps_its_allocation_and_the_key_is_retried() -> None:
    client = _ReservedMeanwhile(existing=STAMPLESS)
    client.release = (1, 37)
    claims, state, _ = _claims(client)
    with pytest.raises(ApiError) as refused:  # raised: the work queue looks at the key again after a back-off
        asyncio.run(claims.ensure(state.slice_named("ns", "train")))
    assert refused.value.status == 409
    assert client.existing["status"] == {"allocation": PINNED, "reservedFor": [POD_P]}


def test_on_1_34_an_allocation_without_a_stamp_is_as_expected() -> None:
    client = _Client(existing=STAMPLESS)
    claims, state, _ = _claims(client)
    assert asyncio.run(claims.ensure(state.slice_named("ns", "train"))) is True
    assert client.calls == [("POST", CLAIMS), READ_CLAIM, ("MERGE", SLICE_STATUS)]


def test_an_allocation_taken_away_whose_answer_was_lost_is_written_again_at_the_next_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(claims_module.time, "monotonic", lambda: clock[0])
    client = _Client()
    claims, state, _ = _claims(client)
    info = state.slice_named("ns", "train")
    assert asyncio.run(claims.ensure(info)) is True  # on 1.34: allocated without a stamp
    client.release = (1, 37)
    clock[0] += claims_module.SERVER_VERSION_TTL_S + 1
    client.existing = {**client.existing, "status": {}}  # the deallocating write went through; its answer did not
    assert asyncio.run(claims.ensure(info)) is True
    assert _stamped_again(client) and state.claim_state(UID) == CLAIM_ALLOCATED


def test_claims_without_a_stamp_are_looked_at_once_the_api_server_is_upgraded_with_no_event_at_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims_module, "SERVER_VERSION_TTL_S", 0.05)
    client = _Client()  # 1.34
    claims, state, _ = _claims(client)

    async def main() -> None:
        assert await claims.ensure(state.slice_named("ns", "train")) is True
        await claims.ensure(state.slice_named("ns", "train"))  # the release read: 1.34
        assert claims.queue.pending(claims_module.RELEASE_KEY)  # and read again later
        await asyncio.sleep(0.2)
        assert client.version_reads >= 2 and "allocationTimestamp" not in client.existing["status"]["allocation"]
        client.release = (1, 37)  # upgraded; nothing else happens
        for _ in range(500):
            if _stamped_again(client):
                break
            await asyncio.sleep(0.01)
        assert _stamped_again(client)
        while len(claims.queue):
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert state.claim_state(UID) == CLAIM_ALLOCATED
