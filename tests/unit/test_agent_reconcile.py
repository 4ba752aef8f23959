"""The agent's slices, level-triggered: a watch event records the slice and enqueues its key, and a
failed step runs again from the work queue, with no new event. A conflict reads the slice again before
the next try; a slice deleted meanwhile is let go. Driven against the in-memory API stand-in
(kubelet_harness.py) and simulated GPUs, with no watch (``api.watch`` unset): nothing but the queue
brings the slice back."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kubelet_harness import NODE, SLICES, ApiStandIn, NoEvents, mig_slice, settled
from prometheus_client import REGISTRY

from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import NodeAgent, slice_key
from mig_operator.kube.agent.context import AgentSettings
from mig_operator.kube.agent.record import RecordStore
from mig_operator.kube.common.client import ApiError

PATH = f"{SLICES}/namespaces/team/gpuslices/train"


class RefusingApi(ApiStandIn):
    """Refuses the slice status writes whose phase ``refuse`` names, each with the next of ``codes``;
    counts the GETs of the slice."""

    def __init__(self, refuse: str, codes: list[int]) -> None:
        super().__init__()
        self.refuse = refuse
        self.codes = codes
        self.refused: list[int] = []
        self.reads: list[int] = []  # len(self.refused) at each GET of the slice

    async def merge_patch(self, path: str, body: dict) -> dict:
        if path == f"{PATH}/status" and self.codes and (body.get("status") or {}).get("phase") == self.refuse:
            code = self.codes.pop(0)
            self.refused.append(code)
            raise ApiError(code, {409: "Conflict", 404: "NotFound"}.get(code, "InternalError"), "refused")
        return await super().merge_patch(path, body)

    async def get(self, path: str, params: Any = None) -> dict:
        if path == PATH:
            self.reads.append(len(self.refused))
        return await super().get(path, params)


def _retries() -> float:
    return REGISTRY.get_sample_value("mig_operator_workqueue_retries_total",
                                     {"component": "agent", "kind": "slice"}) or 0.0


def _run(tmp_path: Path, api: ApiStandIn, scenario: Callable[[NodeAgent], Awaitable[None]]) -> None:
    async def main() -> None:
        backend = SimulatedBackend("h100-80gb", count=1, state_file=str(tmp_path / "sim.json"), host=NODE)
        agent = NodeAgent(AgentSettings(NODE, publish_delay_s=0.01, heartbeat_s=3600), backend,
                          RecordStore(str(tmp_path / "owners.json")), api, NoEvents())  # type: ignore[arg-type]
        await agent.start()
        try:
            await scenario(agent)
        finally:
            await agent.stop()

    asyncio.run(main())


def test_a_conflict_on_the_ready_write_is_read_again_and_the_slice_is_ready_with_no_new_event(tmp_path: Path) -> None:
    api = RefusingApi("Ready", [409])
    before = _retries()

    async def scenario(agent: NodeAgent) -> None:
        body = mig_slice("s-1", "train", 0)
        api.objects[PATH] = copy.deepcopy(body)
        agent.saw(body)  # the only event the agent gets
        await settled(agent, body)
        st = api.objects[PATH]["status"]
        assert api.refused == [409]
        assert st["phase"] == "Ready", st
        # The run after the conflict read the slice again first (the body recorded was stale).
        assert 1 in api.reads
        instances = agent.backend.instances(0)
        assert [(i.gi_id, i.device_uuid) for i in instances] == [(st["giId"], st["deviceUUID"])]  # made once
        assert agent.store.record.owners["s-1"].device_uuid == st["deviceUUID"]

    _run(tmp_path, api, scenario)
    assert _retries() - before == 1


def test_failed_writes_are_tried_again_from_the_queue_until_the_slice_is_ready(tmp_path: Path) -> None:
    api = RefusingApi("Creating", [500, 500, 500])
    before = _retries()

    async def scenario(agent: NodeAgent) -> None:
        body = mig_slice("s-1", "train", 0)
        api.objects[PATH] = copy.deepcopy(body)
        agent.saw(body)
        await settled(agent, body)
        assert api.refused == [500, 500, 500]
        assert api.objects[PATH]["status"]["phase"] == "Ready"
        assert len(agent.backend.instances(0)) == 1

    _run(tmp_path, api, scenario)
    assert _retries() - before == 3


def test_a_slice_deleted_meanwhile_is_let_go_and_done(tmp_path: Path) -> None:
    api = ApiStandIn()  # a write on a slice it no longer has answers 404

    async def scenario(agent: NodeAgent) -> None:
        body = mig_slice("s-1", "train", 0)
        api.objects[PATH] = copy.deepcopy(body)
        real = api.merge_patch

        async def gone_before_ready(path: str, patch: dict) -> dict:
            if (patch.get("status") or {}).get("phase") == "Ready":
                api.objects.pop(PATH, None)  # deleted (its finalizer removed by hand) while being realised
            return await real(path, patch)

        api.merge_patch = gone_before_ready  # type: ignore[method-assign]
        agent.saw(body)
        await settled(agent, body)
        assert "s-1" not in agent.store.record.owners
        uuid = agent.backend.instances(0)[0].device_uuid
        assert uuid in agent.store.record.idle_since  # its instance is idle, reusable
        assert "s-1" not in agent.slices and not agent.queue.pending(slice_key(body))

    _run(tmp_path, api, scenario)


def test_an_event_older_than_the_agents_own_write_is_not_acted_on(tmp_path: Path) -> None:
    api = ApiStandIn()

    async def scenario(agent: NodeAgent) -> None:
        body = mig_slice("s-1", "train", 0)
        api.objects[PATH] = copy.deepcopy(body)
        agent.saw(body)
        await settled(agent, body)
        assert api.objects[PATH]["status"]["phase"] == "Ready"
        writes = api.version
        agent.saw(copy.deepcopy(body))  # the watch's late copy of the Bound slice
        assert not agent.queue.pending(slice_key(body))
        await settled(agent, body)
        assert api.version == writes and len(agent.backend.instances(0)) == 1

    _run(tmp_path, api, scenario)


def test_probes_say_ready_once_started_and_alive_while_the_loops_run(tmp_path: Path) -> None:
    api = ApiStandIn()

    async def main() -> None:
        backend = SimulatedBackend("h100-80gb", count=1, state_file=str(tmp_path / "sim.json"), host=NODE)
        agent = NodeAgent(AgentSettings(NODE, heartbeat_s=3600), backend, RecordStore(str(tmp_path / "o.json")),
                          api, NoEvents())  # type: ignore[arg-type]
        assert agent.readiness() and NODE in agent.readiness()[0]
        await agent.start()
        try:
            assert agent.readiness() == [] and agent.liveness() == []
        finally:
            await agent.stop()

    asyncio.run(main())
