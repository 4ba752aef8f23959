"""The agent's usage loop (kube/agent/usage.py) on simulated GPUs and the in-memory API stand-in: each Ready
slice's figures reach status.usage and the per-slice metrics, a write only when worth it, the peak kept
across a restart, Active=False (NoProcess) with one Event once idle, a conflict read again, a fraction
read from its shim ledger, the series gone with the slice; and the agent's flags."""

from __future__ import annotations

import asyncio
import copy
import struct
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubelet_harness import CLAIMS, NODE, SLICES, ApiStandIn, mig_slice, settled
from prometheus_client import REGISTRY
from test_cli import assert_one_line_error, part

from mig_operator.gpu.files import host_boot_id
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import NodeAgent
from mig_operator.kube.agent.context import AgentSettings
from mig_operator.kube.agent.record import PreparedClaim, RecordStore
from mig_operator.kube.common.client import ApiError

GIB = 2**30
PATH = f"{SLICES}/namespaces/team/gpuslices/train"
STATUS = f"{PATH}/status"


class RecordingApi(ApiStandIn):
    """Counts the usage writes on the slice; refuses the first ``conflicts`` of them with 409."""

    def __init__(self, conflicts: int = 0) -> None:
        super().__init__()
        self.usage_writes: list[dict] = []
        self.conflicts = conflicts
        self.gets: list[str] = []

    async def merge_patch(self, path: str, body: dict) -> dict:
        if path.endswith("/status") and "usage" in (body.get("status") or {}):
            if self.conflicts:
                self.conflicts -= 1
                raise ApiError(409, "Conflict", "the object has been modified")
            self.usage_writes.append(copy.deepcopy(body))
        return await super().merge_patch(path, body)

    async def get(self, path: str, params: Any = None) -> dict:
        self.gets.append(path)
        return await super().get(path, params)


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str, str]] = []  # (name, type, reason, message)

    def post(self, obj: dict, kind: str, reason: str, message: str) -> None:
        self.posted.append((obj["metadata"]["name"], kind, reason, message))

    async def drain(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def _sample(name: str, slice_name: str = "train", pod: str = "") -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": "team", "slice": slice_name, "pod": pod})


def _run(tmp_path: Path, api: ApiStandIn, scenario: Callable[[NodeAgent], Awaitable[None]], events: Any = None,
         model: str = "h100-80gb", mig: bool = True, idle_after_s: float = 1800.0) -> None:
    async def main() -> None:
        backend = SimulatedBackend(model, count=1, state_file=str(tmp_path / "sim.json"), mig_enabled=mig, host=NODE)
        settings = AgentSettings(NODE, publish_delay_s=0.01, heartbeat_s=3600, usage_interval_s=10.0,
                                 idle_after_s=idle_after_s, ledger_host_dir=str(tmp_path / "ledgers"))
        agent = NodeAgent(settings, backend, RecordStore(str(tmp_path / "owners.json")), api,
                          events or Events())  # type: ignore[arg-type]
        assert agent.usage is not None
        agent.usage.run = asyncio.Event().wait  # type: ignore[method-assign]  # the test reads when it says
        agent.usage.jitter = lambda interval: 0.0
        await agent.start()
        api.watch = agent.saw
        try:
            await scenario(agent)
        finally:
            await agent.stop()

    asyncio.run(main())


async def _ready(agent: NodeAgent, api: ApiStandIn, body: dict) -> dict:
    path = f"{SLICES}/namespaces/team/gpuslices/{body['metadata']['name']}"
    api.objects[path] = copy.deepcopy(body)
    agent.saw(body)
    await settled(agent, body)
    await asyncio.sleep(0.01)  # the watch hands the agent its own Ready write
    assert api.objects[path]["status"]["phase"] == "Ready"
    return api.objects[path]


async def _read(agent: NodeAgent) -> None:
    """One reading of every slice, then until the writes it asked for are done."""
    assert agent.usage is not None
    for watch in agent.usage.watched.values():
        watch.due = 0.0
    await agent.usage.read_once()
    deadline = asyncio.get_running_loop().time() + 10
    while any(agent.queue.pending(("usage", "team", uid)) for uid in agent.usage.watched):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.01)  # the watch hands the agent its own write


def _active(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Active")


def test_a_mig_slices_figures_reach_its_status_and_metrics_and_its_peak_stays(tmp_path: Path) -> None:
    api = RecordingApi()

    async def scenario(agent: NodeAgent) -> None:
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        agent.backend.set_usage(st["deviceUUID"], 3 * GIB, [4242], None)
        await _read(agent)
        usage = api.objects[PATH]["status"]["usage"]
        assert (usage["memoryUsed"], usage["memoryPeak"], usage["processes"]) == (3 * GIB, 3 * GIB, 1)
        assert (usage["used"], usage["peak"]) == ("3.0Gi", "3.0Gi")
        assert "activePercent" not in usage  # NVML gives none for a MIG device
        assert usage["lastActive"] == usage["observedAt"]
        assert (_active(api.objects[PATH]["status"])["status"], _active(api.objects[PATH]["status"])["reason"]) \
            == ("True", "Running")
        # The Ready and Bound conditions the realiser wrote are kept beside Active.
        assert {c["type"] for c in api.objects[PATH]["status"]["conditions"]} == {"Bound", "Ready", "Active"}
        assert _sample("mig_operator_slice_memory_used_bytes") == 3 * GIB
        assert _sample("mig_operator_slice_processes") == 1
        # 1g.10gb holds 3 GiB + 10 %, and is what it is: nothing to advise.
        assert "advice" not in usage

        agent.backend.set_usage(st["deviceUUID"], 1 * GIB, [], None)
        await _read(agent)
        usage = api.objects[PATH]["status"]["usage"]
        assert (usage["memoryUsed"], usage["memoryPeak"], usage["processes"]) == (1 * GIB, 3 * GIB, 0)
        assert _sample("mig_operator_slice_memory_used_bytes") == 1 * GIB
        assert _sample("mig_operator_slice_memory_peak_bytes") == 3 * GIB
        assert _sample("mig_operator_slice_processes") == 0
        assert len(api.usage_writes) == 2

    _run(tmp_path, api, scenario)


def test_a_change_under_five_percent_of_the_slice_is_not_written(tmp_path: Path) -> None:
    api = RecordingApi()

    async def scenario(agent: NodeAgent) -> None:
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        memory = st["grantedBytes"]
        agent.backend.set_usage(st["deviceUUID"], 2 * GIB, [7], None)
        await _read(agent)
        assert len(api.usage_writes) == 1
        small = 2 * GIB + memory * 4 // 100  # 4 % of the slice's memory more
        agent.backend.set_usage(st["deviceUUID"], small, [7], None)
        await _read(agent)
        assert len(api.usage_writes) == 1
        assert api.objects[PATH]["status"]["usage"]["memoryUsed"] == 2 * GIB
        assert _sample("mig_operator_slice_memory_used_bytes") == small  # the metric follows every reading
        agent.backend.set_usage(st["deviceUUID"], 2 * GIB + memory * 6 // 100, [7], None)
        await _read(agent)
        assert len(api.usage_writes) == 2

    _run(tmp_path, api, scenario)


def test_an_idle_slice_turns_active_false_once_with_one_event(tmp_path: Path) -> None:
    api = RecordingApi()
    events = Events()
    clock = Clock()

    async def scenario(agent: NodeAgent) -> None:
        assert agent.usage is not None
        agent.usage.clock = clock
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        ready_at = datetime.fromisoformat(st["phaseTimes"]["Ready"])
        clock.now = ready_at + timedelta(seconds=30)
        await _read(agent)
        assert _active(api.objects[PATH]["status"])["status"] == "True"
        assert events.posted == []

        clock.now = ready_at + timedelta(seconds=61)
        await _read(agent)
        active = _active(api.objects[PATH]["status"])
        assert (active["status"], active["reason"]) == ("False", "NoProcess")
        # Idle since it became Ready (never used), to the second.
        assert active["lastTransitionTime"] == ready_at.replace(microsecond=0).isoformat().replace("+00:00", "Z")
        assert [(n, t, r) for n, t, r, _ in events.posted] == [("train", "Normal", "Idle")]
        writes = len(api.usage_writes)

        clock.now = ready_at + timedelta(seconds=90)
        await _read(agent)
        assert len(api.usage_writes) == writes and len(events.posted) == 1

        # A process comes: Active again, and a later idle spell counts from its last sight.
        agent.backend.set_usage(st["deviceUUID"], GIB, [9], None)
        await _read(agent)
        assert _active(api.objects[PATH]["status"])["status"] == "True"
        seen_at = clock.now
        agent.backend.set_usage(st["deviceUUID"], 0, [], None)
        clock.now = seen_at + timedelta(seconds=61)
        await _read(agent)
        active = _active(api.objects[PATH]["status"])
        assert active["status"] == "False"
        assert active["lastTransitionTime"] == seen_at.replace(microsecond=0).isoformat().replace("+00:00", "Z")
        assert len(events.posted) == 2

    _run(tmp_path, api, scenario, events=events, idle_after_s=60.0)


def test_the_peak_a_status_carries_survives_an_agent_restart(tmp_path: Path) -> None:
    api = RecordingApi()

    async def before(agent: NodeAgent) -> None:
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        agent.backend.set_usage(st["deviceUUID"], 5 * GIB, [11], None)
        await _read(agent)

    async def after(agent: NodeAgent) -> None:
        await asyncio.sleep(0.01)
        agent.saw(copy.deepcopy(api.objects[PATH]))  # the watch lists the slice again
        await settled(agent, api.objects[PATH])
        st = api.objects[PATH]["status"]
        agent.backend.set_usage(st["deviceUUID"], 1 * GIB, [11], None)
        await _read(agent)
        usage = api.objects[PATH]["status"]["usage"]
        assert (usage["memoryUsed"], usage["memoryPeak"]) == (1 * GIB, 5 * GIB)

    _run(tmp_path, api, before)
    _run(tmp_path, api, after)


def test_a_conflict_reads_the_slice_again_and_the_write_lands(tmp_path: Path) -> None:
    api = RecordingApi(conflicts=1)

    async def scenario(agent: NodeAgent) -> None:
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        agent.backend.set_usage(st["deviceUUID"], 2 * GIB, [5], None)
        api.gets.clear()
        await _read(agent)
        assert api.conflicts == 0 and len(api.usage_writes) == 1
        assert PATH in api.gets  # read again before the second try
        assert api.objects[PATH]["status"]["usage"]["memoryUsed"] == 2 * GIB

    _run(tmp_path, api, scenario)


def test_a_slice_that_goes_takes_its_series_and_state_with_it(tmp_path: Path) -> None:
    api = RecordingApi()

    async def scenario(agent: NodeAgent) -> None:
        assert agent.usage is not None
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        agent.backend.set_usage(st["deviceUUID"], GIB, [3], None)
        await _read(agent)
        assert _sample("mig_operator_slice_memory_used_bytes") == GIB
        body = copy.deepcopy(api.objects[PATH])
        body["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        api.objects[PATH] = copy.deepcopy(body)
        agent.saw(body)
        await settled(agent, body)
        await _read(agent)
        assert "s-1" not in agent.usage.watched
        for name in ("mig_operator_slice_memory_used_bytes", "mig_operator_slice_memory_peak_bytes",
                     "mig_operator_slice_processes"):
            assert _sample(name) is None, name

    _run(tmp_path, api, scenario)


def test_the_pod_label_names_the_pod_its_claim_is_reserved_for(tmp_path: Path) -> None:
    api = RecordingApi()

    async def scenario(agent: NodeAgent) -> None:
        st = (await _ready(agent, api, mig_slice("s-1", "train", 0)))["status"]
        agent.backend.set_usage(st["deviceUUID"], GIB, [3], None)
        await _read(agent)
        assert _sample("mig_operator_slice_processes") == 1
        api.objects[f"{CLAIMS}/namespaces/team/resourceclaims/train"] = {
            "metadata": {"name": "train", "namespace": "team", "uid": "c-1"},
            "status": {"reservedFor": [{"resource": "pods", "name": "notebook-0", "uid": "p-1"}]}}
        await asyncio.to_thread(agent.store.put_prepared, PreparedClaim("c-1", "team", "train", "s-1"))
        await _read(agent)
        assert _sample("mig_operator_slice_processes", pod="notebook-0") == 1
        assert _sample("mig_operator_slice_processes") is None  # the series without the pod went

    _run(tmp_path, api, scenario)


def _ledger(path: Path, used: int, peak: int, pids: list[int], refused: int) -> None:
    """A ledger file as shim/region.c lays it out (gpu/ledger.py's docstring): the header, the mutex's
    room, ``used`` one 64-byte line before the slots, the slots (``u32 pid`` first) at the end."""
    nslots, slots_at = 4, 192
    size = slots_at + nslots * 32
    data = bytearray(size)
    struct.pack_into("<QIIIIQQQ40s", data, 0, 0x31474D48534F4443, 2, size, nslots, refused, peak, 0, 0,
                     host_boot_id().encode())
    struct.pack_into("<Q", data, slots_at - 64, used)
    for i, pid in enumerate(pids):
        struct.pack_into("<I", data, slots_at + 32 * i, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(data))


def test_a_fraction_is_read_from_its_ledger_and_its_gpus_activity(tmp_path: Path) -> None:
    api = RecordingApi()
    path = f"{SLICES}/namespaces/team/gpuslices/job"

    async def scenario(agent: NodeAgent) -> None:
        body = {"metadata": {"uid": "f-1", "name": "job", "namespace": "team", "resourceVersion": "1",
                             "finalizers": ["cdmo.io/agent"]},
                "status": {"phase": "Bound", "node": NODE, "gpu": 0, "mode": "fraction", "grantedBytes": 8 * GIB}}
        st = (await _ready(agent, api, body))["status"]
        gpu = st["deviceUUID"]
        agent.backend.set_usage(gpu, 20 * GIB, [1, 2, 3], 37)
        await _read(agent)  # no ledger yet: nothing of the claim runs
        usage = api.objects[path]["status"]["usage"]
        assert (usage["memoryUsed"], usage["processes"], usage["activePercent"]) == (0, 0, 37)

        ledger = tmp_path / "ledgers" / "f-1" / ("gpu-" + gpu.removeprefix("GPU-").replace("-", "").lower())
        _ledger(ledger, used=3 * GIB, peak=6 * GIB, pids=[100, 101], refused=0)
        await _read(agent)
        usage = api.objects[path]["status"]["usage"]
        assert (usage["memoryUsed"], usage["memoryPeak"], usage["processes"]) == (3 * GIB, 6 * GIB, 2)
        # 6 GiB + 10 % fits 7Gi of the 8Gi limit.
        assert usage["advice"] == {"verdict": "Smaller", "current": "8Gi", "suggested": "7Gi",
                                   "memoryBack": GIB, "message": usage["advice"]["message"]}

        _ledger(ledger, used=3 * GIB, peak=6 * GIB, pids=[100, 101], refused=2)
        await _read(agent)
        usage = api.objects[path]["status"]["usage"]
        assert usage["refusals"] == 2 and usage["advice"]["verdict"] == "TooSmall"

    _run(tmp_path, api, scenario, model="l40s-48gb", mig=False)


def test_a_fraction_of_the_whole_gpu_is_read_from_the_gpu(tmp_path: Path) -> None:
    """A whole GPU runs no shim, so keeps no ledger: NVML's figures of the GPU are the slice's."""
    api = RecordingApi()
    path = f"{SLICES}/namespaces/team/gpuslices/job"

    async def scenario(agent: NodeAgent) -> None:
        whole = agent.gpus.memory_bytes(0)
        assert whole is not None
        body = {"metadata": {"uid": "f-1", "name": "job", "namespace": "team", "resourceVersion": "1",
                             "finalizers": ["cdmo.io/agent"]},
                "status": {"phase": "Bound", "node": NODE, "gpu": 0, "mode": "fraction", "grantedBytes": whole}}
        st = (await _ready(agent, api, body))["status"]
        agent.backend.set_usage(st["deviceUUID"], 20 * GIB, [1, 2], 55)
        await _read(agent)
        usage = api.objects[path]["status"]["usage"]
        assert (usage["memoryUsed"], usage["processes"], usage["activePercent"]) == (20 * GIB, 2, 55)

    _run(tmp_path, api, scenario, model="l40s-48gb", mig=False)


def test_first_readings_spread_over_the_interval(tmp_path: Path) -> None:
    """Slices found Ready together are not all read (and written) in one tick."""

    async def main() -> None:
        backend = SimulatedBackend("h100-80gb", count=1, state_file=str(tmp_path / "sim.json"), host=NODE)
        agent = NodeAgent(AgentSettings(NODE, usage_interval_s=100.0), backend,
                          RecordStore(str(tmp_path / "owners.json")), ApiStandIn(), Events())  # type: ignore[arg-type]
        assert agent.usage is not None
        agent.usage.run = asyncio.Event().wait  # type: ignore[method-assign]
        await agent.start()
        try:
            for i in range(7):
                await _ready(agent, agent.client, mig_slice(f"s-{i}", f"train-{i}", i))  # type: ignore[arg-type]
            started = asyncio.get_running_loop().time()
            await agent.usage.read_once()
            dues = [w.due - started for w in agent.usage.watched.values()]
            # A slice read in this tick is next due an interval after its first reading (> 100 s); the
            # others' first readings lie ahead, within the interval.
            unread = sorted(d for d in dues if d <= 100)
            assert len(dues) == 7 and all(d >= 0 for d in unread), dues
            assert len(unread) >= 4, dues  # seven uniform draws over 100 s, read if due within 5 s
            assert unread[-1] - unread[0] > 5, dues
        finally:
            await agent.stop()

    asyncio.run(main())


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--usage-interval", "often"], "--usage-interval: duration 'often' is not a duration"),
    (["--usage-interval", "-1"], "--usage-interval '-1' is negative"),
    (["--idle-after", "0"], "--idle-after: duration '0' must be more than 0"),
    (["--idle-after", "soon"], "--idle-after: duration 'soon' is not a duration"),
])
def test_bad_usage_flags_exit_2_naming_the_flag(tmp_path: Path, argv: list[str], fragment: str) -> None:
    proc = part(tmp_path, "agent", "--node", "n1", "--backend", "sim:h100-80gb", *argv)
    assert_one_line_error(proc, 2, fragment)


def test_usage_interval_zero_reads_nothing(tmp_path: Path) -> None:
    backend = SimulatedBackend("h100-80gb", count=1, state_file=str(tmp_path / "sim.json"), host=NODE)
    agent = NodeAgent(AgentSettings(NODE, usage_interval_s=0.0), backend, RecordStore(str(tmp_path / "o.json")),
                      ApiStandIn(), Events())  # type: ignore[arg-type]
    assert agent.usage is None
