"""What a device is used for (``GpuBackend.device_usage``): the simulator's figures, set by a test
through ``set_usage`` or its state file, and the NVML backend against a fake pynvml (the one of
test_gpu_inventory.py, with the usage calls added), whose MIG devices have no activity figure."""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mig_operator.core.placement.profiles import get_model
from mig_operator.gpu.protocol import DeviceUsage, GpuError, ProcessUsage
from mig_operator.gpu.simulated import SimulatedBackend

GIB = 2**30
MIB = 2**20


# ---- the simulator -------------------------------------------------------------------------------

def test_a_device_without_usage_is_unused(tmp_path: Path) -> None:
    sim = SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json"))
    mig = sim.create_instance(0, 19, 0).device_uuid
    assert sim.device_usage(sim.gpus()[0].uuid) == DeviceUsage(0, (), 0)
    assert sim.device_usage(mig) == DeviceUsage(0, (), None)  # NVML gives no activity of a MIG device


def test_usage_set_is_read_back_by_another_process_through_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    sim = SimulatedBackend("h200-141gb", state_file=str(state))
    gpu = sim.gpus()[0].uuid
    mig = sim.create_instance(0, 19, 0).device_uuid
    sim.set_usage(mig, 3 * GIB + 1, [77, 42, 42], None)
    sim.set_usage(gpu, 10 * GIB, (9,), 37)
    other = SimulatedBackend("h200-141gb", state_file=str(state))
    # an even share per process, the odd bytes to the first, so that they sum to the device's figure
    assert other.device_usage(mig) == DeviceUsage(
        3 * GIB + 1, (ProcessUsage(42, 3 * GIB // 2 + 1), ProcessUsage(77, 3 * GIB // 2)), None)
    assert other.device_usage(gpu) == DeviceUsage(10 * GIB, (ProcessUsage(9, 10 * GIB),), 37)
    assert json.loads(state.read_text())["usage"] == {
        gpu: {"memoryUsed": 10 * GIB, "pids": [9], "activePercent": 37},
        mig: {"memoryUsed": 3 * GIB + 1, "pids": [42, 77], "activePercent": None},
    }


def test_a_test_may_write_usage_into_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    sim = SimulatedBackend("h200-141gb", state_file=str(state))
    mig = sim.create_instance(0, 19, 0).device_uuid
    data = json.loads(state.read_text())
    data["usage"] = {mig: {"memoryUsed": 5 * MIB, "pids": [], "activePercent": None}}
    state.write_text(json.dumps(data))
    assert sim.device_usage(mig) == DeviceUsage(5 * MIB, (), None)


def test_a_destroyed_mig_device_takes_its_usage_with_it(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    sim = SimulatedBackend("h200-141gb", state_file=str(state))
    gpu = sim.gpus()[0].uuid
    first = sim.create_instance(0, 19, 0).device_uuid
    sim.set_usage(first, GIB, [5], None)
    sim.set_usage(gpu, GIB, [5], 10)
    sim.destroy_instance(0, 7)
    with pytest.raises(GpuError) as gone:
        sim.device_usage(first)
    assert gone.value.name == "NOT_FOUND" and first in str(gone.value)
    assert set(json.loads(state.read_text())["usage"]) == {gpu}
    again = sim.create_instance(0, 19, 0).device_uuid  # the same placement: a new device, unused
    assert again != first and sim.device_usage(again) == DeviceUsage(0, (), None)


def test_a_destroy_that_stops_half_way_still_takes_the_mig_devices_usage(tmp_path: Path) -> None:
    sim = SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json"))
    mig = sim.create_instance(0, 19, 0).device_uuid
    sim.set_usage(mig, GIB, [5], None)
    sim.inject_fault("destroy_gpu_instance", "UNKNOWN")
    with pytest.raises(GpuError):
        sim.destroy_instance(0, 7)  # the compute instance, and with it the MIG device, is gone
    with pytest.raises(GpuError, match="no device has that UUID"):
        sim.device_usage(mig)


def test_a_reboot_ends_every_process() -> None:
    sim = SimulatedBackend("l4-24gb")
    gpu = sim.gpus()[0].uuid
    sim.set_usage(gpu, GIB, [5], 80)
    sim.reboot()
    assert sim.device_usage(gpu) == DeviceUsage(0, (), 0)


@pytest.mark.parametrize(("args", "said"), [
    ((GIB, [1], 101), "active percent"),
    ((GIB, [1], -1), "active percent"),
    ((GIB, [1], True), "active percent"),
    ((-1, [1], 0), "memory used"),
    (("1Gi", [1], 0), "memory used"),
    ((GIB, [0], 0), "pids"),
    ((GIB, "12", 0), "pids"),
    ((GIB, [1] * 1025, 0), "pids"),
    ((150 * GIB, [1], 0), "more than device"),
])
def test_usage_that_cannot_be_is_refused(args: tuple[Any, Any, Any], said: str) -> None:
    sim = SimulatedBackend("h200-141gb")
    with pytest.raises(ValueError, match=said):
        sim.set_usage(sim.gpus()[0].uuid, *args)


def test_a_mig_device_has_no_activity_and_no_more_memory_than_its_profile() -> None:
    sim = SimulatedBackend("h200-141gb")
    made = sim.create_instance(0, 19, 0)
    profile_bytes = get_model("h200-141gb").profile_by_id(19).memory_mib * MIB
    with pytest.raises(ValueError, match="null for a MIG device"):
        sim.set_usage(made.device_uuid, GIB, [1], 20)
    with pytest.raises(ValueError, match="more than device"):
        sim.set_usage(made.device_uuid, profile_bytes + 1, [1], None)
    sim.set_usage(made.device_uuid, profile_bytes, [1], None)


def test_an_unknown_device_is_not_found() -> None:
    sim = SimulatedBackend("h200-141gb")
    for uuid in ("GPU-00000000-0000-0000-0000-000000000000", "MIG-00000000-0000-0000-0000-000000000000"):
        with pytest.raises(GpuError) as missing:
            sim.device_usage(uuid)
        assert missing.value.name == "NOT_FOUND"
        with pytest.raises(GpuError):
            sim.set_usage(uuid, 0, [], None)
    with pytest.raises(ValueError, match="not a GPU-... or MIG-... UUID"):
        sim.set_usage("nvidia0", 0, [], 0)


BAD_USAGE = {
    "not-object": [],
    "not-a-uuid": {"nvidia0": {"memoryUsed": 0, "pids": [], "activePercent": 0}},
    "missing-field": {"GPU-x1": {"memoryUsed": 0, "pids": []}},
    "extra-field": {"GPU-x1": {"memoryUsed": 0, "pids": [], "activePercent": 0, "colour": "red"}},
    "string-bytes": {"GPU-x1": {"memoryUsed": "1Gi", "pids": [], "activePercent": 0}},
    "pids-not-list": {"GPU-x1": {"memoryUsed": 0, "pids": 5, "activePercent": 0}},
    "mig-activity": {"MIG-x1": {"memoryUsed": 0, "pids": [], "activePercent": 5}},
    "too-many": {f"GPU-{i}": {"memoryUsed": 0, "pids": [], "activePercent": 0} for i in range(4097)},
}


@pytest.mark.parametrize("name", sorted(BAD_USAGE))
def test_bad_usage_in_the_state_file_is_a_one_line_gpu_error(tmp_path: Path, name: str) -> None:
    state = tmp_path / "s.json"
    sim = SimulatedBackend("h200-141gb", state_file=str(state))
    data = json.loads(state.read_text())
    data["usage"] = BAD_USAGE[name]
    state.write_text(json.dumps(data))
    with pytest.raises(GpuError) as bad:
        sim.device_usage(sim.gpus()[0].uuid)
    assert bad.value.name == "UNKNOWN" and "is not usable" in str(bad.value) and "usage" in str(bad.value)
    assert str(state) in str(bad.value) and "\n" not in str(bad.value)


# ---- NVML ---------------------------------------------------------------------------------------

pynvml = pytest.importorskip("pynvml")
from test_gpu_inventory import FakeNvml, _err  # noqa: E402 (after the skip: the fake needs pynvml)

from mig_operator.gpu import nvml as nvml_backend  # noqa: E402
from mig_operator.gpu import nvml_query  # noqa: E402


class UsageNvml(FakeNvml):
    """FakeNvml with what a device is used for: memory, processes, utilisation samples."""

    def __init__(self) -> None:
        super().__init__()
        self.used = {"gpu0": 20 * GIB}
        self.processes: dict[Any, list[Any]] = {}
        self.samples: list[tuple[int, int]] = []  # (timestamp in us, percent)
        self.rate = 0  # nvmlDeviceGetUtilizationRates' gpu figure
        self.asked: list[tuple[str, Any]] = []
        self.mig_flag_supported = True

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        if uuid == "GPU-fake":
            return "gpu0"
        for handle in self._mig_list():
            if self.nvmlDeviceGetUUID(handle) == uuid:
                return handle
        raise _err("NOT_FOUND")

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        info = super().nvmlDeviceGetMemoryInfo(handle)
        return SimpleNamespace(total=info.total, used=self.used.get(handle, 0))

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> Any:
        self.asked.append(("is_mig", handle))
        if not self.mig_flag_supported:
            raise _err("NOT_SUPPORTED")
        return ctypes.c_uint(1 if isinstance(handle, tuple) else 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self.processes.get(handle, [])

    def nvmlDeviceGetSamples(self, handle: Any, kind: int, since: int) -> Any:
        self.asked.append(("samples", since))
        if isinstance(handle, tuple):
            raise _err("NOT_SUPPORTED")
        assert kind == pynvml.NVML_GPU_UTILIZATION_SAMPLES
        found = [(t, v) for t, v in self.samples if t > since]
        if not found:
            raise _err("NOT_FOUND")
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, [
            SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=v)) for t, v in found]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        self.asked.append(("rates", handle))
        if isinstance(handle, tuple):
            raise _err("NOT_SUPPORTED")
        return SimpleNamespace(gpu=self.rate, memory=0)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> UsageNvml:
    nvml = UsageNvml()
    monkeypatch.setattr(nvml_backend, "pynvml", nvml)
    monkeypatch.setattr(nvml_query, "pynvml", nvml)
    monkeypatch.setattr(nvml_backend, "_session_refs", 0)
    return nvml


def _now_us() -> int:
    return time.time_ns() // 1000


def test_nvml_whole_gpu_memory_processes_and_activity_since_the_last_reading(fake: UsageNvml) -> None:
    fake.processes["gpu0"] = [SimpleNamespace(pid=300, usedGpuMemory=2 * GIB),
                              SimpleNamespace(pid=100, usedGpuMemory=None)]  # pynvml's "not available"
    now = _now_us()
    # older than the first reading's window (10 s), then two samples inside it
    fake.samples = [(now - 60_000_000, 100), (now - 5_000_000, 30), (now - 2_000_000, 50)]
    backend = nvml_backend.NvmlBackend()
    first = backend.device_usage("GPU-fake")
    assert first == DeviceUsage(20 * GIB, (ProcessUsage(100, 0), ProcessUsage(300, 2 * GIB)), 40)
    # the next reading covers only what came after the newest sample read
    fake.samples.append((now - 1_000_000, 91))
    assert backend.device_usage("GPU-fake").active_percent == 91
    assert ("samples", now - 2_000_000) in fake.asked
    # no sample since: the utilisation of NVML's last sample period
    fake.rate = 7
    assert backend.device_usage("GPU-fake").active_percent == 7
    backend.close()


def test_nvml_mig_device_has_its_own_memory_and_processes_and_no_activity(fake: UsageNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    made = backend.create_instance(0, 19, 0)
    handle = ("mig", made.gi_id, made.ci_id)
    fake.used[handle] = 3 * GIB
    fake.processes[handle] = [SimpleNamespace(pid=4242, usedGpuMemory=3 * GIB - 5 * MIB)]
    fake.asked.clear()
    usage = backend.device_usage(made.device_uuid)
    assert usage == DeviceUsage(3 * GIB, (ProcessUsage(4242, 3 * GIB - 5 * MIB),), None)
    # the handle's kind was asked, and no utilisation call made of a MIG device
    assert fake.asked == [("is_mig", handle)]
    backend.close()


def test_nvml_a_gpu_that_cannot_say_whether_a_handle_is_mig_is_a_whole_gpu(fake: UsageNvml) -> None:
    fake.mig_flag_supported = False
    fake.rate = 12
    backend = nvml_backend.NvmlBackend()
    assert backend.device_usage("GPU-fake").active_percent == 12
    backend.close()


def test_nvml_an_unknown_device_is_not_found(fake: UsageNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    with pytest.raises(GpuError) as missing:
        backend.device_usage("MIG-nothing")
    assert missing.value.name == "NOT_FOUND" and "MIG-nothing" in str(missing.value)
    backend.close()
