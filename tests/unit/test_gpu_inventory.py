"""The NVML backend against a fake pynvml built from the H200 capture, and describe()/render_text().

The fake answers the calls ``gpu/nvml.py`` makes the way the real H200 did (profile-index holes,
``INVALID_ARGUMENT`` past the end, "MIG " name prefix, placements v2), so the backend's parsing,
rollback and UUID matching are exercised without a GPU. tests/gpu checks the same against hardware.
"""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace
from typing import Any

import pytest

pynvml = pytest.importorskip("pynvml")

from mig_operator.core.placement.profiles import get_model  # noqa: E402
from mig_operator.gpu import nvml as nvml_backend  # noqa: E402
from mig_operator.gpu import nvml_query  # noqa: E402
from mig_operator.gpu.inventory import describe, render_text  # noqa: E402
from mig_operator.gpu.protocol import GpuError  # noqa: E402
from mig_operator.gpu.simulated import SimulatedBackend  # noqa: E402

# Profile-info index -> (id, name, slices, instances, MiB, SM, placement starts, size): the H200 capture.
H200_INDEX = {
    0: (19, "1g.18gb", 1, 7, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    1: (14, "2g.35gb", 2, 3, 33280, 32, (0, 2, 4), 2),
    2: (9, "3g.71gb", 3, 2, 71424, 60, (0, 4), 4),
    3: (5, "4g.71gb", 4, 1, 71424, 64, (0,), 4),
    4: (0, "7g.141gb", 7, 1, 143360, 132, (0,), 8),
    7: (20, "1g.18gb+me", 1, 1, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    9: (15, "1g.35gb", 1, 4, 33280, 26, (0, 2, 4, 6), 2),
}
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}


def _err(name: str) -> Exception:
    return pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{name}"))


def _ptr(kind: Any, value: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(value), kind)


def _addr(ptr: Any) -> int:
    return int(ctypes.cast(ptr, ctypes.c_void_p).value or 0)


class FakeNvml:
    """Enough of pynvml for NvmlBackend: one H200, GIs keyed by id, handles are fake pointers."""

    def __init__(self, mig_enabled: bool = True) -> None:
        self.mode = 1 if mig_enabled else 0
        self.gis: dict[int, dict[str, Any]] = {}  # gi id -> profile id, start, size, slices, cis
        self.busy: set[int] = set()
        self.fail_ci = False
        self.fail_gi_destroy = False  # nvmlGpuInstanceDestroy answers UNKNOWN
        self.hide_devices = False  # the MIG device of a new CI has not shown up (yet)
        self.invalid_indices: set[int] = set()  # profile-info holes answered INVALID_ARGUMENT
        self.scanned: list[int] = []
        self.product = "NVIDIA H200"
        self.mig_capable = True
        self.inits = 0
        self.shutdowns = 0
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        # Constants, structs and the error class come from the real module.
        return getattr(pynvml, name)

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index != 0:
            raise _err("INVALID_ARGUMENT")
        return "gpu0"

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self.product

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return 0  # /dev/nvidia0: the one GPU

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, tuple):
            return f"MIG-fake-{handle[1]}-{handle[2]}"
        return "GPU-fake"

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return SimpleNamespace(total=150754820096 if self.mig_capable else 23034 * 2**20)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        if not self.mig_capable:
            raise _err("NOT_SUPPORTED")
        return [self.mode, self.mode]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, idx: int, version: int = 2) -> Any:
        self.scanned.append(idx)
        if idx >= 17 or idx in self.invalid_indices:
            raise _err("INVALID_ARGUMENT")
        if idx not in H200_INDEX or not self.mig_capable:
            raise _err("NOT_SUPPORTED")
        pid, name, slices, count, mib, sm, _starts, _size = H200_INDEX[idx]
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = pid, slices, count
        info.memorySizeMB, info.multiprocessorCount = mib, sm
        info.name = f"MIG {name}".encode()
        return info

    def _by_id(self, pid: int) -> tuple[Any, ...]:
        return next(v for v in H200_INDEX.values() if v[0] == pid)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: Any, pid: int, array: Any, count: Any) -> int:
        starts, size = self._by_id(pid)[6], self._by_id(pid)[7]
        count._obj.value = len(starts)
        if array is not None:
            for i, start in enumerate(starts):
                array[i].start, array[i].size = start, size
        return 0

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, pid: int, placement: Any) -> Any:
        self.calls.append("create_gi")
        if self.mode == 0:
            raise _err("NOT_SUPPORTED")
        place = placement._obj
        mask = ((1 << place.size) - 1) << place.start
        for gi in self.gis.values():
            if ((1 << gi["size"]) - 1) << gi["start"] & mask:
                raise _err("INSUFFICIENT_RESOURCES")
        gi_id = 8 // place.size - 1 + place.start // place.size
        self.gis[gi_id] = {"pid": pid, "start": place.start, "size": place.size,
                           "slices": self._by_id(pid)[2], "cis": []}
        return _ptr(pynvml.c_nvmlGpuInstance_t, 0x100 + gi_id)

    def _gi(self, gi: Any) -> tuple[int, dict[str, Any]]:
        gi_id = _addr(gi) - 0x100
        if gi_id not in self.gis:
            raise _err("NOT_FOUND")
        return gi_id, self.gis[gi_id]

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any:
        gi_id, rec = self._gi(gi)
        return SimpleNamespace(id=gi_id, profileId=rec["pid"],
                               placement=SimpleNamespace(start=rec["start"], size=rec["size"]))

    def nvmlDeviceGetGpuInstances(self, handle: Any, pid: int, array: Any, count: Any) -> int:
        ids = [g for g, rec in sorted(self.gis.items()) if rec["pid"] == pid]
        for i, gi_id in enumerate(ids):
            array[i] = _ptr(pynvml.c_nvmlGpuInstance_t, 0x100 + gi_id)
        count._obj.value = len(ids)
        return 0

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        if gi_id not in self.gis:
            raise _err("NOT_FOUND")
        return _ptr(pynvml.c_nvmlGpuInstance_t, 0x100 + gi_id)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, idx: int, eng: int) -> Any:
        _gi_id, rec = self._gi(gi)
        if idx not in CI_SLICES or CI_SLICES[idx] > rec["slices"]:
            raise _err("NOT_SUPPORTED")
        return SimpleNamespace(id=idx, sliceCount=CI_SLICES[idx], instanceCount=rec["slices"] // CI_SLICES[idx])

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, ci_pid: int) -> Any:
        gi_id, rec = self._gi(gi)
        self.calls.append(f"create_ci:{ci_pid}")
        if self.fail_ci:
            raise _err("INSUFFICIENT_RESOURCES")
        rec["cis"].append((0, ci_pid))
        return _ptr(pynvml.c_nvmlComputeInstance_t, 0x10000 + gi_id * 16)

    def nvmlGpuInstanceGetComputeInstances(self, gi: Any, ci_pid: int, array: Any, count: Any) -> int:
        gi_id, rec = self._gi(gi)
        cis = [ci for ci, p in rec["cis"] if p == ci_pid]
        for i, ci in enumerate(cis):
            array[i] = _ptr(pynvml.c_nvmlComputeInstance_t, 0x10000 + gi_id * 16 + ci)
        count._obj.value = len(cis)
        return 0

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> Any:
        return SimpleNamespace(id=(_addr(ci) - 0x10000) % 16)

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        gi_id = (_addr(ci) - 0x10000) // 16
        if gi_id in self.busy:
            raise _err("IN_USE")
        self.calls.append("destroy_ci")
        self.gis[gi_id]["cis"] = []
        return 0

    def nvmlGpuInstanceDestroy(self, gi: Any) -> int:
        gi_id, rec = self._gi(gi)
        if rec["cis"]:
            raise _err("IN_USE")
        if self.fail_gi_destroy:
            raise _err("UNKNOWN")
        self.calls.append("destroy_gi")
        del self.gis[gi_id]
        return 0

    def _mig_list(self) -> list[tuple[str, int, int]]:
        if self.hide_devices:
            return []
        return [("mig", g, ci) for g, rec in sorted(self.gis.items()) for ci, _p in rec["cis"]]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 7 if self.mode else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, i: int) -> Any:
        migs = self._mig_list()
        if i >= len(migs):
            raise _err("NOT_FOUND")
        return migs[i]

    def nvmlDeviceGetGpuInstanceId(self, mig: Any) -> int:
        return mig[1]

    def nvmlDeviceGetComputeInstanceId(self, mig: Any) -> int:
        return mig[2]

    def nvmlDeviceGetComputeRunningProcesses(self, mig: Any) -> list[Any]:
        return [SimpleNamespace(pid=4242)] if mig[1] in self.busy else []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml()
    monkeypatch.setattr(nvml_backend, "pynvml", nvml)
    monkeypatch.setattr(nvml_query, "pynvml", nvml)
    monkeypatch.setattr(nvml_backend, "_session_refs", 0)
    return nvml


def test_nvml_model_reads_profiles_in_index_order_like_the_capture(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    model = backend.model(0)
    assert [p.id for p in model.profiles] == [19, 14, 9, 5, 0, 20, 15]
    assert model.name == "h200-141gb" and model.memory_slots == 8 and model.memory_mib == 143771
    catalog = get_model("h200-141gb")
    for profile in model.profiles:
        # Discovered from (fake) NVML, it must agree with the catalog built from the same capture.
        assert profile == catalog.profile_by_id(profile.id)


def test_nvml_profile_scan_skips_holes_of_either_kind(fake: FakeNvml) -> None:
    # Some drivers answer a hole with INVALID_ARGUMENT rather than NOT_SUPPORTED: the scan must go on
    # to the profiles after it (7 and 9 here) and cover the whole documented index range.
    fake.invalid_indices = {5, 6, 8}
    model = nvml_backend.NvmlBackend().model(0)
    assert [p.id for p in model.profiles] == [19, 14, 9, 5, 0, 20, 15]
    assert set(range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)) <= set(fake.scanned)


def test_nvml_session_is_one_init_per_process(fake: FakeNvml) -> None:
    first, second = nvml_backend.NvmlBackend(), nvml_backend.NvmlBackend()
    first.close()
    first.close()  # closing twice must not release the other backend's share
    assert (fake.inits, fake.shutdowns) == (1, 0)
    second.close()
    assert (fake.inits, fake.shutdowns) == (1, 1)


def test_nvml_create_list_destroy(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    made = backend.create_instance(0, 9, 4)
    assert (made.gi_id, made.ci_id, made.profile, made.start, made.size) == (2, 0, "3g.71gb", 4, 4)
    assert made.device_uuid == "MIG-fake-2-0"
    assert "create_ci:2" in fake.calls  # the full CI of a 3-slice GI is the 3-slice CI profile
    fake.busy.add(2)
    [listed] = backend.instances(0)
    assert listed.in_use and listed.device_uuid == made.device_uuid
    with pytest.raises(GpuError) as busy:
        backend.destroy_instance(0, 2)
    assert busy.value.name == "IN_USE" and busy.value.code == 19 and busy.value.transient
    assert "placement 4:4" in str(busy.value)
    fake.busy.clear()
    backend.destroy_instance(0, 2)
    assert fake.calls[-2:] == ["destroy_ci", "destroy_gi"]
    assert backend.instances(0) == []


def test_nvml_create_rolls_back_the_gi_when_the_ci_fails(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    fake.fail_ci = True
    with pytest.raises(GpuError) as failed:
        backend.create_instance(0, 19, 3)
    assert failed.value.name == "INSUFFICIENT_RESOURCES"
    assert fake.gis == {} and fake.calls[-1] == "destroy_gi"


def test_nvml_create_with_a_failed_rollback_says_what_it_left(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    fake.fail_ci = fake.fail_gi_destroy = True
    with pytest.raises(GpuError) as failed:
        backend.create_instance(0, 9, 4)
    message = str(failed.value)
    assert failed.value.name == "INSUFFICIENT_RESOURCES"  # the compute instance's error, not the rollback's
    assert "rollback failed too" in message and "left without a compute instance" in message
    assert "NVML_ERROR_UNKNOWN" in message and "\n" not in message
    [half] = backend.instances(0)
    assert (half.gi_id, half.ci_id, half.device_uuid, half.complete) == (2, -1, "", False)
    fake.fail_ci = False
    done = backend.create_compute_instance(0, 2)
    assert (done.gi_id, done.ci_id, done.device_uuid, done.complete) == (2, 0, "MIG-fake-2-0", True)
    creates = fake.calls.count("create_ci:2")
    assert backend.create_compute_instance(0, 2) == done  # complete already: no second CI
    assert fake.calls.count("create_ci:2") == creates
    with pytest.raises(GpuError) as missing:
        backend.create_compute_instance(0, 9)
    assert missing.value.name == "NOT_FOUND"


def test_nvml_destroy_that_stops_half_way_says_so(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    made = backend.create_instance(0, 19, 3)
    fake.fail_gi_destroy = True
    with pytest.raises(GpuError) as failed:
        backend.destroy_instance(0, made.gi_id)
    assert failed.value.name == "UNKNOWN"
    assert f"GPU instance {made.gi_id} is left without one" in str(failed.value)
    [half] = backend.instances(0)
    assert (half.gi_id, half.ci_id, half.complete) == (made.gi_id, -1, False)
    fake.fail_gi_destroy = False
    backend.destroy_instance(0, made.gi_id)
    assert backend.instances(0) == [] and fake.gis == {}


def test_nvml_create_never_returns_an_instance_without_its_device(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend(mig_device_wait_s=0.3)
    fake.hide_devices = True
    with pytest.raises(GpuError) as late:
        backend.create_instance(0, 14, 2)
    message = str(late.value)
    assert late.value.name == "TIMEOUT" and late.value.transient
    assert "compute instance 0, but its MIG device did not appear within 0.3 s" in message
    assert "left in place" in message
    assert fake.gis[4]["cis"]  # created with its CI; only its device is missing
    fake.hide_devices = False
    [found] = backend.instances(0)
    assert found.complete and found.device_uuid == "MIG-fake-4-0"


def test_describe_a_gpu_without_mig_through_nvml(fake: FakeNvml) -> None:
    fake.mig_capable = False
    fake.product = "NVIDIA L4"
    backend = nvml_backend.NvmlBackend()
    with pytest.raises(GpuError) as no_mig:
        backend.model(0)
    assert no_mig.value.name == "NOT_SUPPORTED"
    [gpu] = describe(backend)["gpus"]
    assert (gpu["model"], gpu["memory_mib"], gpu["mig_capable"], gpu["mig_enabled"]) == ("l4-24gb", 23034, False, False)
    assert gpu["profiles"] == [] and gpu["instances"] == []
    assert "GPU 0: NVIDIA L4 (l4-24gb), 23034 MiB, no MIG" in render_text({"gpus": [gpu]})


def test_render_text_marks_a_gpu_instance_without_compute_instance() -> None:
    sim = SimulatedBackend("h200-141gb")
    sim.create_half_instance(0, 9, 0)
    text = render_text(describe(sim))
    [row] = [line for line in text.splitlines() if "3g.71gb" in line and "0:4" in line]
    assert row.split()[:2] == ["1", "-"] and row.endswith("- (no compute instance)")


def test_nvml_errors_keep_codes(fake: FakeNvml) -> None:
    backend = nvml_backend.NvmlBackend()
    backend.create_instance(0, 14, 0)
    with pytest.raises(GpuError) as overlap:
        backend.create_instance(0, 19, 1)
    assert overlap.value.code == 23 and "placement start 1" in str(overlap.value)
    with pytest.raises(GpuError) as missing:
        backend.destroy_instance(0, 9)
    assert missing.value.name == "NOT_FOUND"
    fake.mode = 0
    with pytest.raises(GpuError) as off:
        backend.instances(0)
    assert off.value.name == "NOT_SUPPORTED"


def test_describe_nvml_with_mig_disabled_lists_profiles_not_instances(fake: FakeNvml) -> None:
    fake.mode = 0
    desc = describe(nvml_backend.NvmlBackend())
    [gpu] = desc["gpus"]
    assert gpu["mig_capable"] and not gpu["mig_enabled"] and gpu["instances"] == []
    assert gpu["profiles"][0] == {
        "name": "1g.18gb", "id": 19, "slices": 1, "memory_mib": 16384, "sm": 16, "max_instances": 7,
        "placements": [[s, 1] for s in range(7)],
    }


def test_derived_profile_names_match_nvidia_smi() -> None:
    # Used only when the binding cannot give NVML's name; checked against names nvidia-smi prints.
    assert nvml_backend.derived_profile_name(1, 1, 8, 143771, 0) == "1g.18gb"
    assert nvml_backend.derived_profile_name(3, 4, 8, 143771, 2) == "3g.71gb"
    assert nvml_backend.derived_profile_name(7, 8, 8, 143771, 4) == "7g.141gb"
    assert nvml_backend.derived_profile_name(1, 1, 8, 143771, 7) == "1g.18gb+me"
    assert nvml_backend.derived_profile_name(1, 2, 8, 81559, 9) == "1g.20gb"
    assert nvml_backend.derived_profile_name(2, 2, 8, 95830, 1) == "2g.24gb"
    assert nvml_backend.derived_profile_name(1, 1, 4, 24576, 0) == "1g.6gb"


def test_describe_shape_and_text_from_the_simulator() -> None:
    sim = SimulatedBackend("h100-80gb", count=2)
    sim.create_instance(1, 15, 6)
    sim.set_in_use(1, 6, True)
    desc = describe(sim)
    json.dumps(desc)  # JSON-ready as it is
    assert [g["index"] for g in desc["gpus"]] == [0, 1]
    gpu = desc["gpus"][1]
    assert set(gpu) == {"index", "uuid", "product", "model", "memory_mib", "mig_capable", "mig_enabled",
                        "profiles", "instances"}
    assert gpu["model"] == "h100-80gb" and gpu["uuid"].startswith("GPU-")
    assert [p["id"] for p in gpu["profiles"]] == [19, 20, 15, 14, 9, 5, 0]
    assert gpu["instances"] == [{
        "gi_id": 6, "ci_id": 0, "profile": "1g.20gb", "profile_id": 15, "start": 6, "size": 2,
        "device_uuid": gpu["instances"][0]["device_uuid"], "in_use": True,
    }]
    assert gpu["instances"][0]["device_uuid"].startswith("MIG-")
    text = render_text(desc)
    assert "GPU 1: NVIDIA H100 80GB HBM3 (h100-80gb)" in text
    assert "{0,2,4,6}:2" in text and "6:2" in text and "yes" in text
    assert "no MIG instances" in text  # GPU 0
