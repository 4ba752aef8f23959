"""kube/agent/health.py: which GPUs changed, the Events they wait to post, and which Ready slices need
their DeviceHealthy written (each slice once per change, none on a GPU that was never unhealthy)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.gpus import Gpus
from mig_operator.kube.agent.health import HealthWatch
from mig_operator.kube.agent.record import RecordStore


def watch(tmp_path: Path) -> tuple[SimulatedBackend, HealthWatch]:
    sim = SimulatedBackend("h100-80gb", count=2)
    store = RecordStore(str(tmp_path / "owners.json"))
    store.put(OwnerEntry("u0", "team/on0", "mig", 0, COMPLETED, 1, 19, "1g.10gb", 0, 1, 9, 0, "MIG-a"))
    store.put(OwnerEntry("u1", "team/on1", "fraction", 1, COMPLETED, 1, device_uuid="GPU-1"))
    gpus = Gpus(sim)
    health = HealthWatch(gpus, store, None)  # type: ignore[arg-type]
    asyncio.run(gpus.refresh())
    return sim, health


def test_healthy_gpus_are_no_news_and_mark_no_slice(tmp_path: Path) -> None:
    _sim, health = watch(tmp_path)
    assert asyncio.run(health.poll())  # the first reading is recorded
    assert health.events == []
    assert health.slices_to_mark({"u0", "u1"}) == []
    assert not asyncio.run(health.poll())  # nothing changed: nothing to publish
    assert [c[0]["status"] for c in health.conditions().values()] == ["True", "True"]


def test_a_critical_xid_marks_the_slices_on_its_gpu_once_and_a_reset_takes_it_back(tmp_path: Path) -> None:
    sim, health = watch(tmp_path)
    asyncio.run(health.poll())
    sim.inject_xid(1, 94)
    assert asyncio.run(health.poll())
    assert [(kind, reason) for kind, reason, _ in health.events] == [("Warning", "GpuUnhealthy")]
    assert health.conditions()[1][0]["reason"] == "Xid94"
    marks = health.slices_to_mark({"u0", "u1"})
    assert [(uid, ref, h.reason) for uid, ref, h in marks] == [("u1", "team/on1", "Xid94")]
    assert health.slices_to_mark({"u0"}) == []  # only Ready slices are marked
    health.saw_slice("u1", {"status": {"conditions": [{"type": "DeviceHealthy", "status": "False"}]}})
    assert health.slices_to_mark({"u0", "u1"}) == []  # shown already: not written again
    sim.reset_gpu(1)
    health.events.clear()
    assert asyncio.run(health.poll())
    assert [(kind, reason) for kind, reason, _ in health.events] == [("Normal", "GpuHealthy")]
    [(uid, _ref, back)] = health.slices_to_mark({"u0", "u1"})
    assert (uid, back.healthy) == ("u1", True)
    health.saw_slice("u1", {"status": {"conditions": [{"type": "DeviceHealthy", "status": "True"}]}})
    assert health.slices_to_mark({"u0", "u1"}) == []


def test_a_clear_mark_after_the_xid_makes_the_gpu_healthy_and_one_before_it_changes_nothing(
        tmp_path: Path) -> None:
    sim, health = watch(tmp_path)
    asyncio.run(health.poll())
    sim.inject_xid(1, 79)
    sim.inject_xid(0, 48)
    sim.lose_gpu(0)
    asyncio.run(health.poll())
    health.events.clear()
    seen = datetime.fromisoformat(health.seen[1])
    assert not asyncio.run(health.poll(seen - timedelta(seconds=1)))  # a mark older than the Xid
    assert not health.of(1).healthy and sim.health(1).reason == "Xid79"
    assert asyncio.run(health.poll(datetime.now(UTC)))
    assert health.of(1).healthy and sim.health(1).healthy
    assert health.of(0).reason == "GpuLost"  # a lost GPU stays lost: NVML says so now
    assert [(kind, reason) for kind, reason, _ in health.events] == [("Normal", "GpuHealthy")]
    sim.inject_xid(1, 94)  # reported after the mark: kept although the mark stays
    assert asyncio.run(health.poll(datetime.now(UTC) - timedelta(seconds=5)))
    assert health.of(1).reason == "Xid94"


class LosingBackend(SimulatedBackend):
    """NVML's answers for a GPU fallen off the bus: every call on GPU 1 fails with GPU_IS_LOST once lost."""

    lost = False

    def instances(self, index: int):  # type: ignore[no-untyped-def]
        if self.lost and index == 1:
            raise GpuError("GPU_IS_LOST", f"list instances on GPU {index}")
        return super().instances(index)


def test_a_lost_gpu_keeps_its_last_reading_and_the_others_are_read() -> None:
    sim = LosingBackend("h100-80gb", count=2)
    sim.create_instance(0, 19, 0)
    sim.create_instance(1, 19, 0)
    gpus = Gpus(sim)
    asyncio.run(gpus.refresh())
    _models, before = asyncio.run(gpus.read_all())
    sim.lost = True
    sim.create_instance(0, 19, 1)
    _models, after = asyncio.run(gpus.read_all())
    assert len(after[0]) == 2  # GPU 0 read afresh
    assert after[1] == before[1] and len(after[1]) == 1  # GPU 1: what it last said
    fresh = Gpus(sim)  # nothing read before the loss: the error is the caller's
    asyncio.run(fresh.refresh())
    with pytest.raises(GpuError):
        asyncio.run(fresh.read_all())


def test_the_node_watch_reads_the_clear_mark_and_ignores_one_that_is_no_time(
        caplog: pytest.LogCaptureFixture) -> None:
    from mig_operator.kube.agent.node_watch import NodeWatch

    node = NodeWatch("gpu-1", None, "")  # type: ignore[arg-type]

    def event(mark: str | None) -> None:
        annotations = {} if mark is None else {"cdmo.io/gpu-health-cleared": mark}
        node.changed({"metadata": {"name": "gpu-1", "uid": "n1", "annotations": annotations}})

    event("2026-11-27T18:00:00Z")
    assert node.health_cleared == datetime(2026, 11, 27, 18, tzinfo=UTC)
    event("yesterday")
    assert node.health_cleared is None
    assert "'yesterday' is not an RFC 3339 time" in caplog.text and "2026-11-27T18:00:00Z" in caplog.text
    caplog.clear()
    event("yesterday")
    assert caplog.text == ""  # said once per value
    event(None)
    assert node.health_cleared is None
