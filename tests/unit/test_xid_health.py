"""A GPU's health: the Xid table, the simulator's injected faults (kept in its state file), and the
conditions read back from a GpuNode."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from mig_operator.core.node.health import (
    GPU_LOST,
    HEALTHY,
    GpuHealth,
    cleared_at,
    condition,
    health_from_conditions,
    unhealthy_note,
    xid_critical,
    xid_health,
    xids_to_clear,
)
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.simulated import SimulatedBackend

# NVIDIA k8s-device-plugin's default skip list (internal/rm/health.go): Xids an application causes.
APPLICATION = [13, 31, 43, 45, 68, 109]


@pytest.mark.parametrize("xid", APPLICATION)
def test_application_xids_are_not_critical(xid: int) -> None:
    assert not xid_critical(xid)


@pytest.mark.parametrize("xid", [1, 8, 48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154, 999])
def test_every_other_xid_is_critical(xid: int) -> None:
    assert xid_critical(xid)


def test_the_simulator_reports_a_critical_xid_until_the_gpu_is_reset(tmp_path: Path) -> None:
    state = str(tmp_path / "state.json")
    sim = SimulatedBackend("h200-141gb", count=2, state_file=state)
    assert sim.health(0) == sim.health(1) == HEALTHY
    sim.inject_xid(1, 79)
    other = SimulatedBackend("h200-141gb", count=2, state_file=state)  # another process sees it
    got = other.health(1)
    assert (got.healthy, got.reason) == (False, "Xid79")
    assert "Xid 79" in got.message and "GPU 1" in got.message
    assert other.health(0) == HEALTHY
    assert json.loads(Path(state).read_text())["gpus"][1]["xid"] == 79
    sim.reset_gpu(1)
    assert other.health(1) == HEALTHY
    assert "xid" not in json.loads(Path(state).read_text())["gpus"][1]


@pytest.mark.parametrize("xid", APPLICATION)
def test_an_application_xid_leaves_the_simulated_gpu_healthy(xid: int) -> None:
    sim = SimulatedBackend("h100-80gb")
    sim.inject_xid(0, xid)
    assert sim.health(0) == HEALTHY


def test_a_lost_gpu_is_unhealthy_until_reset_and_a_reboot_clears_both(tmp_path: Path) -> None:
    sim = SimulatedBackend("h100-80gb", count=2, state_file=str(tmp_path / "s.json"))
    sim.lose_gpu(0)
    sim.inject_xid(1, 48)
    assert sim.health(0).reason == GPU_LOST and not sim.health(0).healthy
    assert sim.health(1).reason == "Xid48"
    sim.reset_gpu(0)
    assert sim.health(0) == HEALTHY
    sim.reboot()
    assert sim.health(1) == HEALTHY


def test_health_hooks_refuse_bad_input() -> None:
    sim = SimulatedBackend("h100-80gb")
    with pytest.raises(ValueError, match="'x'.*e.g. 79"):
        sim.inject_xid(0, "x")  # type: ignore[arg-type]
    with pytest.raises(GpuError) as excinfo:
        sim.health(3)
    assert excinfo.value.name == "INVALID_ARGUMENT"


def test_a_state_file_with_a_bad_health_field_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    SimulatedBackend("h100-80gb", state_file=str(state))
    data = json.loads(state.read_text())
    data["gpus"][0]["lost"] = "yes"
    state.write_text(json.dumps(data))
    with pytest.raises(GpuError, match="lost is not true or false"):
        SimulatedBackend("h100-80gb", state_file=str(state)).health(0)


def test_conditions_round_trip_and_a_missing_condition_is_healthy() -> None:
    sick = GpuHealth(False, "Xid94", "GPU 0 reported Xid 94")
    cond = condition("Healthy", sick, "2026-01-01T00:00:00Z")
    assert cond == {"type": "Healthy", "status": "False", "reason": "Xid94", "message": "GPU 0 reported Xid 94",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}
    assert health_from_conditions([cond]) == sick
    assert health_from_conditions([condition("Healthy", HEALTHY, "t")]) == HEALTHY
    assert health_from_conditions(None) == HEALTHY
    assert health_from_conditions([{"type": "Other", "status": "False"}]) == HEALTHY


def test_the_note_names_each_unhealthy_gpu_and_caps_the_list() -> None:
    one = unhealthy_note({("n1", 1): GpuHealth(False, "Xid79")})
    assert one == "GPU 1 of node n1 (Xid79) is unhealthy and takes no new slice"
    many = unhealthy_note({(f"n{i}", 0): GpuHealth(False, GPU_LOST) for i in range(7)})
    assert many.startswith("7 GPUs are unhealthy") and many.endswith("and 2 more")
    assert many.count("GpuLost") == 5


@pytest.mark.parametrize(("value", "expected"), [
    ("2026-11-27T18:00:00Z", datetime(2026, 11, 27, 18, 0, 0, tzinfo=UTC)),
    ("2026-11-27T19:30:05+01:30", datetime(2026, 11, 27, 18, 0, 5, tzinfo=UTC)),
    (" 2026-11-27T18:00:00.250Z", datetime(2026, 11, 27, 18, 0, 0, 250000, tzinfo=UTC)),
])
def test_a_clear_mark_is_an_rfc3339_time(value: str, expected: datetime) -> None:
    assert cleared_at(value) == expected


@pytest.mark.parametrize("value", ["yesterday", "2026-11-27T18:00:00", "", "1764266400"])
def test_a_clear_mark_that_is_no_time_with_a_zone_is_refused_with_an_example(value: str) -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 2026-11-27T18:00:00Z"):
        cleared_at(value)


def test_a_clear_mark_forgets_the_xids_seen_until_its_time_and_never_a_lost_gpu() -> None:
    health = {0: xid_health(0, 79), 1: xid_health(1, 48), 2: GpuHealth(False, GPU_LOST, "lost"), 3: HEALTHY}
    seen = {0: "2026-11-27T17:59:59Z", 1: "2026-11-27T18:00:01Z", 2: "2026-11-27T17:00:00Z",
            3: "2026-11-27T17:00:00Z"}
    mark = datetime(2026, 11, 27, 18, 0, 0, tzinfo=UTC)
    assert xids_to_clear(health, seen, mark) == [0]  # GPU 1's Xid came after the mark
    assert xids_to_clear(health, {**seen, 0: "2026-11-27T18:00:00Z"}, mark) == [0]  # the same second counts
    assert xids_to_clear(health, seen, datetime(2026, 11, 27, 18, 0, 1, tzinfo=UTC)) == [0, 1]
    assert xids_to_clear(health, {1: seen[1]}, mark) == []  # a GPU never seen is not cleared


def test_the_simulator_clears_an_xid_and_keeps_a_lost_gpu_lost() -> None:
    sim = SimulatedBackend("h100-80gb", count=2)
    sim.inject_xid(0, 79)
    sim.inject_xid(1, 79)
    sim.lose_gpu(1)
    sim.clear_xid(0)
    sim.clear_xid(1)
    assert sim.health(0) == HEALTHY
    assert sim.health(1).reason == GPU_LOST
    sim.reset_gpu(1)
    assert sim.health(1) == HEALTHY  # the cleared Xid does not come back after the loss ends
