"""A pod's slice goes only where the pod's requests fit (the controller's side of NodeResourcesFit), an
ungated pod the scheduler cannot place has its slice released, and the pods' resync retries what failed.

Each node's free CPU below is worked out by hand: allocatable less the bound pods not finished."""

from __future__ import annotations

import asyncio
from typing import Any

from books import BodyLedger

from mig_operator.kube.common.workqueue import Requeue, WorkQueue
from mig_operator.kube.controller.binder import assemble
from mig_operator.kube.controller.observe import node_record, pod_record
from mig_operator.kube.controller.pod_nodes import BOUND_PODS_FIELDS
from mig_operator.kube.controller.pods import UNSCHEDULABLE_S, PodSlices

GATE = "cdmo.io/gpu-slice"
GROUP = "p-gs-1"


class Client:
    """The API as the controller's pod code reads and writes it; ``bound`` holds the pods per node."""

    def __init__(self, bound: dict[str, list[dict]] | None = None) -> None:
        self.bound = bound or {}
        self.calls: list[tuple[str, str]] = []
        self.made: list[dict] = []

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: Any = None) -> list[dict]:
        self.calls.append(("LIST", field_selector or ""))
        node = next(n for n in self.bound if field_selector == BOUND_PODS_FIELDS.format(node=n))
        # As the API server selects: the node's pods that are not finished.
        return [keep(p) if keep else p for p in self.bound[node]
                if p["status"]["phase"] not in ("Succeeded", "Failed")]

    async def create(self, path: str, body: dict) -> dict:
        """As the API server answers: the object with its UID and resourceVersion."""
        self.calls.append(("POST", path))
        self.made.append(body)
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{len(self.made)}")
        meta.setdefault("resourceVersion", str(len(self.calls)))
        return body

    async def delete(self, path: str, resource_version: str | None = None) -> dict:
        self.calls.append(("DELETE", path))
        return {}

    async def strategic_patch(self, path: str, body: dict) -> dict:
        self.calls.append(("STRATEGIC", path))
        return {}


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def post(self, obj: dict, kind: str, reason: str, message: str) -> None:
        self.posted.append((reason, message))

    def forget(self, uid: str) -> None:
        pass


def running(name: str, cpu: str, phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": "other"},
            "spec": {"nodeName": "?", "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase}}


def pod(gated: bool = True, cpu: str = "8", status: dict | None = None) -> dict:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "1",
                         "labels": {GATE: GROUP}, "annotations": {"cdmo.io/gpu-memory": "4Gi"}},
            "spec": spec, "status": status or {"phase": "Pending"}}


def cluster(client: Client, cpus: dict[str, str]) -> tuple[PodSlices, Events]:
    """GPU nodes named by ``cpus`` with that many CPUs allocatable, each with one GPU."""
    state = BodyLedger()
    for name, cpu in cpus.items():
        state.put_inventory({"metadata": {"name": name}, "spec": {"nodeName": name},
                             "status": {"gpus": [{"index": 0, "uuid": f"GPU-{name}", "memoryMiB": 81559}]}})
        state.put_node(name, node_record({"metadata": {"name": name},
                                          "status": {"allocatable": {"cpu": cpu, "memory": "64Gi", "pods": "110"}}}))
    events = Events()
    return assemble(client, events, queue=WorkQueue(), ledger=state).pods, events  # type: ignore[arg-type]


def make(pods: PodSlices, body: dict) -> Requeue | None:
    pods.state.put_pod("ns", GROUP, pod_record(body))
    return asyncio.run(pods._make_slices("ns", GROUP))


def test_a_pods_slice_waits_while_its_cpu_fits_no_gpu_node_and_is_made_where_it_then_fits() -> None:
    client = Client({"big": [running("busy", "10"), running("done", "16", "Succeeded")]})
    pods, events = cluster(client, {"small": "2", "big": "16"})
    again = make(pods, pod())
    assert isinstance(again, Requeue) and again.after_s > 0
    assert [c for c in client.calls if c[0] == "POST"] == []
    # small: 2 of 2 cores free, too small by its allocatable alone (no list); big: 16 - 10 = 6 free.
    assert [c for c in client.calls if c[0] == "LIST"] == [("LIST", BOUND_PODS_FIELDS.format(node="big"))]
    [(reason, message)] = events.posted
    assert reason == "InsufficientResources"
    assert "cpu: the pod asks 8, node big has 6 free of 16 allocatable" in message
    assert "cpu: the pod asks 8, node small has 2 free of 2 allocatable" in message

    client.bound["big"][0]["status"]["phase"] = "Succeeded"  # big: 16 free now
    assert make(pods, pod()) is None
    [slice_body] = client.made
    assert slice_body["spec"]["nodeName"] == "big", "the one node the pod fits: the slice is pinned there"


def test_a_pod_that_fits_every_gpu_node_leaves_its_slice_unlimited() -> None:
    client = Client({"a": [], "b": [running("small", "1")]})
    pods, events = cluster(client, {"a": "16", "b": "16"})
    assert make(pods, pod()) is None
    [slice_body] = client.made
    assert "nodeName" not in slice_body["spec"] and "cdmo.io/eligible-nodes" not in (
        slice_body["metadata"].get("annotations") or {})
    assert events.posted == []


def test_a_pod_that_asks_for_nothing_but_a_place_reads_no_list() -> None:
    """The hot path of most GPU pods: no CPU, memory or other request, so no node's pods are listed."""
    client = Client({"a": [running("busy", "16")]})
    pods, events = cluster(client, {"a": "16"})
    plain = pod()
    plain["spec"]["containers"][0]["resources"] = {}
    assert make(pods, plain) is None
    assert [c for c in client.calls if c[0] == "LIST"] == []
    assert len(client.made) == 1 and events.posted == []


def ready_slice() -> dict:
    return {"metadata": {"uid": "s-uid", "namespace": "ns", "name": GROUP, "resourceVersion": "5",
                         "ownerReferences": [{"kind": "Pod", "apiVersion": "v1", "name": "p", "uid": "pod-uid"}]},
            "spec": {"memory": "4Gi"},
            "status": {"phase": "Ready", "mode": "fraction", "node": "big", "gpu": 0, "grantedBytes": 4 * 2**30,
                       "deviceUUID": "GPU-big", "gpuUUID": "GPU-big"}}


# The scheduler's condition: False since the gate (SchedulingGated), so its lastTransitionTime is old.
UNSCHEDULABLE = {"phase": "Pending", "conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/3 nodes are available: 1 Insufficient cpu.", "lastTransitionTime": "2020-01-01T00:00:00Z"}]}


def test_an_ungated_pod_unschedulable_for_a_while_has_its_slice_released() -> None:
    client = Client()
    pods, events = cluster(client, {"big": "16"})
    now = [1000.0]
    pods.clock = lambda: now[0]
    pods.state.put_slice(ready_slice())
    pods.state.put_pod("ns", GROUP, pod_record(pod(gated=False, status=UNSCHEDULABLE)))
    assert asyncio.run(pods._unschedulable("ns", GROUP)) == Requeue(UNSCHEDULABLE_S), "first seen refused now"
    now[0] += UNSCHEDULABLE_S / 3
    # Refused for a third of the time: looked at again once the rest has passed.
    assert asyncio.run(pods._unschedulable("ns", GROUP)) == Requeue(UNSCHEDULABLE_S * 2 / 3)
    assert client.calls == [] and events.posted == []

    now[0] += UNSCHEDULABLE_S * 2 / 3

    async def released() -> None:
        assert await pods._unschedulable("ns", GROUP) is None
        while len(pods.queue):  # the slice's key deletes its claim, then the pod's key the slice
            await asyncio.sleep(0.005)

    asyncio.run(released())
    claim = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/p-gs-1"
    assert client.calls == [("DELETE", claim), ("DELETE", "/apis/cdmo.io/v1alpha1/namespaces/ns/gpuslices/p-gs-1")]
    [(reason, message)] = events.posted
    assert reason == "Unschedulable" and "Insufficient cpu" in message and "node big" in message


def test_a_scheduled_or_gated_pod_keeps_its_slice() -> None:
    client = Client()
    pods, _ = cluster(client, {"big": "16"})
    pods.state.put_slice(ready_slice())
    scheduled = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    for body in (pod(gated=False, status=scheduled), pod(gated=True, status=UNSCHEDULABLE)):
        pods.state.put_pod("ns", GROUP, pod_record(body))
        assert asyncio.run(pods._unschedulable("ns", GROUP)) is None
    assert client.calls == []
