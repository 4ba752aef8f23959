"""What a user reads: the refusal of a slice pinned to a node without a GpuNode, the GpuNode's summary
figures (hand-computed here), the GpuNode written again for a change made while a write was under way,
the agent's reaction to its Node's MIG label, and refused pods logged at INFO, not ERROR."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry, OwnerRecord
from mig_operator.core.placement.cluster import GpuState, NodeInventory, Refusal
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request
from mig_operator.gpu.protocol import GpuInfo, MigInstance
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import NodeAgent
from mig_operator.kube.agent.context import AgentSettings
from mig_operator.kube.agent.inventory import gpunode_status
from mig_operator.kube.agent.record import RecordStore
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.webhook.review import review_response
from mig_operator.kube.webhook.server import HANDLER_ID, WebhookOptions, pod_handlers

H100 = get_model("h100-80gb")
MIB = 2**20


def profile(name: str) -> Any:
    return next(p for p in H100.profiles if p.name == name)


def fraction_gpu(node_gpu: int = 0) -> GpuState:
    return GpuState(node_gpu, "GPU-l4", "NVIDIA L4", "l4-24gb", 22_528)


# --- item 11: a slice pinned to a node that has no GpuNode -------------------------------------------


def test_a_slice_pinned_to_a_node_without_a_gpunode_says_the_node_does_not_exist() -> None:
    request = slice_request(memory="20Gi")
    view = build_view([NodeInventory("gpu-a", (fraction_gpu(),))], set(), [])
    planner = ClusterPlanner()
    planner.set_inventory(NodeInventory("gpu-a", (fraction_gpu(),)))
    for decide in (lambda: plan_binding(request, view, "gpu-x"), lambda: planner.plan(request, "gpu-x")):
        with pytest.raises(Refusal) as refused:
            decide()
        assert refused.value.code == "NoSuchNode"  # status.reason, the REASON column
        assert refused.value.message == (
            "node gpu-x does not exist or runs no mig-operator agent (there is no GpuNode gpu-x): "
            "memory 20Gi waits for it")


def test_a_node_with_a_gpunode_but_no_gpu_is_still_no_gpu_and_a_published_node_binds() -> None:
    request = slice_request(memory="20Gi")
    planner = ClusterPlanner()
    planner.set_inventory(NodeInventory("gpu-x", ()))  # the GpuNode exists, with no GPU yet
    with pytest.raises(Refusal) as refused:
        planner.plan(request, "gpu-x")
    assert refused.value.code == "NoGpu"
    planner.set_inventory(NodeInventory("gpu-x", (fraction_gpu(),)))  # its agent published a GPU
    assert planner.plan(request, "gpu-x").node == "gpu-x"


# --- item 14: the GpuNode's summary, computed by hand ----------------------------------------------------


def test_the_summary_counts_instances_and_slots_held_idle_and_free() -> None:
    three_g, one_g = profile("3g.40gb"), profile("1g.10gb")
    gpus = [GpuInfo(0, "GPU-0", H100.product, H100.memory_mib, True, True),
            GpuInfo(1, "GPU-1", H100.product, H100.memory_mib, True, True),
            GpuInfo(2, "GPU-2", H100.product, H100.memory_mib, True, False)]
    instances = {
        # GPU 0: a 3g held by slice a (slots 0-3), a 1g nobody holds (4), a 1g nobody holds but a
        # process runs on (5): never reclaimed, so in use. Slots 6 and 7 are free.
        0: [MigInstance(0, 1, 0, three_g.id, "3g.40gb", 0, 4, "MIG-a", False),
            MigInstance(0, 2, 0, one_g.id, "1g.10gb", 4, 1, "MIG-idle", False),
            MigInstance(0, 3, 0, one_g.id, "1g.10gb", 5, 1, "MIG-busy", True)],
        # GPU 1: three idle 1g instances (slots 0, 1, 2), the rest free.
        1: [MigInstance(1, g, 0, one_g.id, "1g.10gb", g - 1, 1, f"MIG-{g}", False) for g in (1, 2, 3)],
        2: [],
    }
    record = OwnerRecord("boot", {
        "a": OwnerEntry("a", "ns/a", "mig", 0, COMPLETED, three_g.memory_mib * MIB, three_g.id, "3g.40gb", 0, 4,
                        1, 0, "MIG-a"),
        "f": OwnerEntry("f", "ns/f", "fraction", 2, COMPLETED, 8 * 2**30, device_uuid="GPU-2"),
    })
    status = gpunode_status(gpus, {0: H100, 1: H100, 2: H100}, instances, record, True, "t")
    summary = {k: status[k] for k in ("gpuCount", "migGpuCount", "inUseInstances", "idleInstances", "usedSlots",
                                      "idleSlots", "freeSlots", "fractionSlices")}
    assert summary == {"gpuCount": 3, "migGpuCount": 2, "inUseInstances": 2, "idleInstances": 4,
                       "usedSlots": 4 + 1, "idleSlots": 1 + 3, "freeSlots": 2 + 5, "fractionSlices": 1}


# --- items 14 and 16: the GpuNode written after every change, the Node's label watched -----------------


class RecordingClient:
    """The agent's API client, recording the GpuNode status writes; one write may be held open."""

    def __init__(self) -> None:
        self.writes: list[dict] = []
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def merge_patch(self, path: str, body: dict) -> dict:
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        self.writes.append(body["status"])
        return {"metadata": {"resourceVersion": "1"}}

    async def get(self, path: str, params: Any = None) -> dict:
        raise ApiError(404, "NotFound", path)

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: object = None) -> list:
        # The ResourceSlices the agent publishes beside its GpuNode: none yet (it then creates them).
        return []

    async def create(self, path: str, body: dict) -> dict:
        return body


def make_agent(tmp_path: Any, client: RecordingClient) -> NodeAgent:
    backend = SimulatedBackend("h100-80gb", state_file=str(tmp_path / "sim.json"))
    settings = AgentSettings(node="gpu-a", publish_delay_s=0.01)
    agent = NodeAgent(settings, backend, RecordStore(str(tmp_path / "owners.json")), client, events=None)  # type: ignore[arg-type]
    agent.gpus.all = backend.gpus()
    return agent


def node(labelled: bool) -> dict:
    labels = {"cdmo.clear.ml/gpu-partitioning": "mig"} if labelled else {}
    return {"metadata": {"name": "gpu-a", "uid": "u-1", "labels": labels}}


def test_a_change_made_while_the_gpunode_is_written_gets_a_write_of_its_own(tmp_path: Any) -> None:
    async def scenario() -> list[str]:
        client = RecordingClient()
        agent = make_agent(tmp_path, client)
        agent.node_watch.labelled = True
        agent.schedule_publish()
        client.hold = asyncio.Event()
        await asyncio.wait_for(client.entered.wait(), 5)  # the first write is under way ...
        agent.node_watch.labelled = False  # ... when something changes (here the label, as the heartbeat reads it)
        agent.schedule_publish()
        client.hold.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
        return [w["gpus"][0]["serves"] for w in client.writes]

    assert asyncio.run(scenario()) == ["mig", "none"]


def test_a_change_that_must_go_out_at_once_does_not_wait_behind_a_coalescing_delay(tmp_path: Any) -> None:
    async def scenario() -> tuple[int, float]:
        client = RecordingClient()
        agent = make_agent(tmp_path, client)
        agent.publisher.settings = replace(agent.publisher.settings, publish_delay_s=30.0)
        agent.schedule_publish()  # a change that may wait (an instance released): 30 s of coalescing
        await asyncio.sleep(0.05)
        started = time.monotonic()
        agent.schedule_publish(at_once=True)  # a new instance's device, which a pod waits for
        while not client.writes and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        waited = time.monotonic() - started
        await agent.stop()
        return len(client.writes), waited

    writes, waited = asyncio.run(scenario())
    assert writes == 1 and waited < 2.0  # one write carries both, without the 30 s


def test_the_node_label_shows_in_the_gpunode_without_waiting_for_the_heartbeat(tmp_path: Any) -> None:
    async def scenario() -> list[str]:
        client = RecordingClient()
        agent = make_agent(tmp_path, client)
        agent.node_changed(node(True))
        await asyncio.sleep(0.2)
        agent.node_changed(node(True))  # the same label again (another field changed): no write
        await asyncio.sleep(0.2)
        agent.node_changed(node(False))
        await asyncio.sleep(0.2)
        return [w["gpus"][0]["serves"] for w in client.writes]

    assert asyncio.run(scenario()) == ["mig", "none"]


# --- item 13: a refused pod is INFO -------------------------------------------------------------------------


def review(pod: dict[str, Any], handler: Any) -> dict[str, Any]:
    return review_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "r-1", "operation": "CREATE", "namespace": "team-a", "object": pod}}, handler)


def test_a_refused_pod_is_logged_at_info_and_a_failing_handler_stays_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    handler = pod_handlers(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"))[HANDLER_ID]
    caplog.set_level(logging.INFO)
    bad = {"metadata": {"name": "trainer", "annotations": {"cdmo.io/gpu-memory": "4X"}},
           "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    answer = review(bad, handler)["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 400 and "'4X'" in answer["status"]["message"]

    def broken(pod: dict[str, Any]) -> None:
        raise KeyError("spec")

    assert review(bad, broken)["response"]["status"]["code"] == 500
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "mig_operator.webhook"]
    assert lines[0][0] == "INFO" and lines[0][1].startswith("pod team-a/trainer refused at admission: annotation "
                                                             "cdmo.io/gpu-memory")
    assert lines[1] == ("ERROR", "pod team-a/trainer: the admission handler failed")


def test_a_refused_pod_is_not_shown_when_only_warnings_are_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    handler = pod_handlers(WebhookOptions(listen="127.0.0.1:9443", namespace="ops"))[HANDLER_ID]
    caplog.set_level(logging.WARNING)
    review({"metadata": {"generateName": "job-", "annotations": {"cdmo.io/gpu-memory": "4X"}},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}, handler)
    assert [r for r in caplog.records if r.name == "mig_operator.webhook"] == []
