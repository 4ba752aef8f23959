"""Reading NVML through pynvml: its errors as GpuError, the profiles and placements a GPU offers,
its GPU and compute instances, the walk of MIG device handles that finds their UUIDs and
processes, and what a device is used for. ``nvml.NvmlBackend`` makes its changes with these."""

from __future__ import annotations

import contextlib
import ctypes
import math
import re
from collections.abc import Iterator
from typing import Any

import pynvml

from mig_operator.core.placement.profiles import Placement, Profile
from mig_operator.gpu.protocol import GpuError, MigInstance, ProcessUsage

# Profile-info indices scanned: the binding's documented count, or more, for a driver newer than it.
PROFILE_INDEX_SCAN = max(int(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)), 32)


@contextlib.contextmanager
def translate(operation: str) -> Iterator[None]:
    """Turn a pynvml error into a GpuError that names the operation and keeps NVML's code."""
    try:
        yield
    except pynvml.NVMLError as exc:
        code = int(getattr(exc, "value", 999))
        raise GpuError(code, f"{operation}: {exc}") from exc


def text(value: bytes | str) -> str:
    # pynvml returns str in recent releases and bytes in older ones.
    return value.decode() if isinstance(value, bytes) else value


def nvml_code(exc: pynvml.NVMLError) -> int:
    return int(getattr(exc, "value", 999))


def slug(product: str) -> str:
    """A model name for a board the catalog does not know: ``NVIDIA H20`` -> ``nvidia-h20``."""
    return re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")


# Profile-info indices whose profiles carry a suffix (nvml.h NVML_GPU_INSTANCE_PROFILE_*); only used to
# name profiles when the binding cannot return NVML's own name (pynvml without the v2 struct).
_SUFFIX_BY_INDEX = {7: "+me", 8: "+me", 10: "+gfx", 11: "+gfx", 12: "+gfx", 13: "-me", 14: "-me",
                    15: "+me.all", 16: "+me.all", 17: "+gfx"}


def derived_profile_name(slices: int, span: int, slots: int, total_mib: int, index: int) -> str:
    """The nvidia-smi name of a profile, rebuilt from its numbers when NVML's name is not available.

    The ``gb`` in a name is the board's marketed size (total memory in GiB, rounded up) times the
    profile's share of memory slots, rounded half up: H200 1g spans 1/8 of 141 -> ``1g.18gb``,
    2g spans 2/8 -> ``2g.35gb``; H100 NVL 2/8 of 94 -> ``2g.24gb``. The MiB a profile holds is not
    that number (1g.18gb holds 16384 MiB).
    """
    board_gb = math.ceil(total_mib / 1024)
    gb = math.floor(board_gb * span / slots + 0.5)
    return f"{slices}g.{gb}gb{_SUFFIX_BY_INDEX.get(index, '')}"


def mig_mode(handle: Any, index: int) -> tuple[bool, bool]:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError as exc:
        # NOT_SUPPORTED is the documented answer of a GPU without MIG, not a failure.
        if nvml_code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return False, False
        raise GpuError(nvml_code(exc), f"read MIG mode of GPU {index}: {exc}") from exc
    return True, current == pynvml.NVML_DEVICE_MIG_ENABLE


def read_profiles(handle: Any, index: int) -> dict[int, tuple[Any, str, tuple[Placement, ...]]]:
    """Profile-info index -> (info struct, NVML's name or '', placements), in index order."""
    found: dict[int, tuple[Any, str, tuple[Placement, ...]]] = {}
    for idx in range(PROFILE_INDEX_SCAN):
        try:
            info, name = profile_info(handle, idx)
        except pynvml.NVMLError as exc:
            code = nvml_code(exc)
            # Holes in the index table (H200: 5, 6, 8, 10-16 NOT_SUPPORTED; past the driver's last
            # index, or a hole on some drivers, INVALID_ARGUMENT): skip, never stop early.
            if code in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise GpuError(code, f"read MIG profile index {idx} of GPU {index}: {exc}") from exc
        found[idx] = (info, name, placements(handle, index, int(info.id)))
    return found


def profile_info(handle: Any, idx: int) -> tuple[Any, str]:
    try:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx, version=2)
    except TypeError:
        # A pynvml without the version argument knows only the v1 struct, which has no name.
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx), ""
    except pynvml.NVMLError as exc:
        if nvml_code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx, version=1), ""
    name = text(getattr(info, "name", b""))
    # NVML names profiles as nvidia-smi prints them, "MIG 1g.18gb"; the catalog drops "MIG ".
    return info, name.removeprefix("MIG ").strip()


def placements(handle: Any, index: int, profile_id: int) -> tuple[Placement, ...]:
    op = f"read placements of profile id {profile_id} on GPU {index}"
    count = ctypes.c_uint(0)
    with translate(op):
        # A NULL array asks only for the count (nvml.h, ..PossiblePlacements_v2).
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    if count.value == 0:
        return ()
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    with translate(op):
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return tuple(sorted(Placement(int(p.start), int(p.size)) for p in array[: count.value]))


def gpu_instances(handle: Any, index: int, profile: Profile) -> list[Any]:
    size = max(profile.max_instances, 1)
    array = (pynvml.c_nvmlGpuInstance_t * size)()
    count = ctypes.c_uint(0)
    with translate(f"list GPU instances of {profile.name} (profile id {profile.id}) on GPU {index}"):
        pynvml.nvmlDeviceGetGpuInstances(handle, profile.id, array, ctypes.byref(count))
    return list(array[: count.value])


def ci_profiles(gi: Any, index: int) -> list[Any]:
    """The compute-instance profiles this GI offers (info structs), in index order."""
    found = []
    for idx in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            found.append(
                pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, idx, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            )
        except pynvml.NVMLError as exc:
            if nvml_code(exc) in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise GpuError(nvml_code(exc), f"read compute profile {idx} on GPU {index}: {exc}") from exc
    return found


def full_ci_profile(gi: Any, index: int) -> int:
    # The full CI uses every compute slice of its GI: the offered CI profile with most slices.
    profiles = ci_profiles(gi, index)
    if not profiles:
        raise GpuError("NOT_SUPPORTED", f"GPU {index}: the new GPU instance offers no compute profile")
    return int(max(profiles, key=lambda p: p.sliceCount).id)


def compute_instances(gi: Any, index: int) -> list[Any]:
    found = []
    for ci_profile in ci_profiles(gi, index):
        size = max(int(ci_profile.instanceCount), 1)
        array = (pynvml.c_nvmlComputeInstance_t * size)()
        count = ctypes.c_uint(0)
        with translate(f"list compute instances on GPU {index}"):
            pynvml.nvmlGpuInstanceGetComputeInstances(gi, int(ci_profile.id), array, ctypes.byref(count))
        found.extend(array[: count.value])
    return found


def mig_devices(handle: Any, index: int) -> dict[tuple[int, int], tuple[str, bool]]:
    """(GI id, CI id) -> (MIG device UUID, a process runs on it), by walking the MIG handles."""
    devices: dict[tuple[int, int], tuple[str, bool]] = {}
    with translate(f"count MIG devices of GPU {index}"):
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    for slot in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError as exc:
            # Unused slots answer NOT_FOUND (or INVALID_ARGUMENT on some drivers): holes, not errors.
            if nvml_code(exc) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise GpuError(nvml_code(exc), f"open MIG device {slot} of GPU {index}: {exc}") from exc
        with translate(f"read MIG device {slot} of GPU {index}"):
            gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
            ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
            uuid = text(pynvml.nvmlDeviceGetUUID(mig))
            busy = len(pynvml.nvmlDeviceGetComputeRunningProcesses(mig)) > 0
        devices[(gi_id, ci_id)] = (uuid, busy)
    return devices


def describe_gi(
    index: int, gi: Any, profile: Profile, devices: dict[tuple[int, int], tuple[str, bool]]
) -> MigInstance:
    with translate(f"read GPU instance of {profile.name} on GPU {index}"):
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
    gi_id = int(info.id)
    ci_ids = []
    for ci in compute_instances(gi, index):
        with translate(f"read compute instance of GPU instance {gi_id} on GPU {index}"):
            ci_ids.append(int(pynvml.nvmlComputeInstanceGetInfo(ci).id))
    # The operator makes one full CI per GI; with several (made by hand) the lowest stands for
    # the GI, and the GI counts as used when a process runs on any of them.
    ci_id = min(ci_ids) if ci_ids else -1
    uuid = devices.get((gi_id, ci_id), ("", False))[0]
    busy = any(devices.get((gi_id, c), ("", False))[1] for c in ci_ids)
    return MigInstance(
        gpu_index=index,
        gi_id=gi_id,
        ci_id=ci_id,
        profile_id=int(info.profileId),
        profile=profile.name,
        start=int(info.placement.start),
        size=int(info.placement.size),
        device_uuid=uuid,
        in_use=busy,
    )


def is_mig_handle(handle: Any, what: str) -> bool:
    """Whether ``handle`` is a MIG device's (else a whole GPU's)."""
    try:
        flag = pynvml.nvmlDeviceIsMigDeviceHandle(handle)
    except pynvml.NVMLError as exc:
        # A GPU that has no MIG cannot have MIG device handles, and answers NOT_SUPPORTED.
        if nvml_code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return False
        raise GpuError(nvml_code(exc), f"tell whether {what} is a MIG device: {exc}") from exc
    return bool(int(getattr(flag, "value", flag)))


def running_processes(handle: Any, what: str) -> tuple[ProcessUsage, ...]:
    """The compute processes on the device, with their memory (0 where NVML does not say)."""
    with translate(f"list the processes of {what}"):
        found = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    processes = []
    for proc in found:
        used = getattr(proc, "usedGpuMemory", None)
        # pynvml gives None for NVML_VALUE_NOT_AVAILABLE; a raw all-ones value means the same.
        if not isinstance(used, int) or used < 0 or used >= 2**64 - 1:
            used = 0
        processes.append(ProcessUsage(pid=int(proc.pid), memory_used=used))
    return tuple(sorted(processes, key=lambda p: p.pid))


def kernel_share(handle: Any, since_us: int, what: str) -> tuple[int | None, int]:
    """The share (0-100) of the time since ``since_us`` (NVML's CPU timestamps, microseconds) that a
    kernel ran on the whole GPU, averaged over NVML's utilisation samples, and the newest sample's
    timestamp (``since_us`` when there was none). Without new samples it is the utilisation of NVML's
    last sample period; None when the GPU reports no utilisation."""
    try:
        value_type, samples = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since_us)
    except pynvml.NVMLError as exc:
        # NOT_FOUND: no sample since ``since_us``; NOT_SUPPORTED: the GPU keeps none.
        if nvml_code(exc) not in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
            raise GpuError(nvml_code(exc), f"read the utilisation samples of {what}: {exc}") from exc
        samples = []
    values = [(int(s.timeStamp), _sample_value(value_type, s.sampleValue)) for s in samples]
    if values:
        share = sum(v for _t, v in values) / len(values)
        return _percent(share), max(since_us, max(t for t, _v in values))
    try:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    except pynvml.NVMLError as exc:
        if nvml_code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return None, since_us
        raise GpuError(nvml_code(exc), f"read the utilisation of {what}: {exc}") from exc
    return _percent(int(rates.gpu)), since_us


def _sample_value(value_type: int, value: Any) -> float:
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(value.dVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(value.ullVal)
    if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(value.ulVal)
    return float(value.uiVal)  # NVML's type for utilisation samples


def _percent(value: float) -> int:
    return min(100, max(0, round(value)))
