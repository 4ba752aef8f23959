"""The one interface every GPU backend offers: records, NVML's error vocabulary, and the protocol.

The real backend (``nvml.py``) and the simulator (``simulated.py``) both raise :class:`GpuError`
with NVML's numeric codes, so callers (the agent, the planner's reclaim loop, tests) handle one
set of failures whichever backend runs. This module imports no NVML binding: the simulator and the
controller must work on machines without the NVIDIA driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mig_operator.core.node.health import GpuHealth
from mig_operator.core.placement.profiles import GpuModel

# NVML's return codes (nvml.h ``nvmlReturn_t``). They are a stable ABI, so they are written out here
# rather than read from pynvml, which only the real backend may import.
NVML_ERROR_CODES: dict[str, int] = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "INSUFFICIENT_POWER": 8,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "CORRUPTED_INFOROM": 14,
    "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "IN_USE": 19,
    "MEMORY": 20,
    "NO_DATA": 21,
    "VGPU_ECC_NOT_SUPPORTED": 22,
    "INSUFFICIENT_RESOURCES": 23,
    "FREQ_NOT_SUPPORTED": 24,
    "ARGUMENT_VERSION_MISMATCH": 25,
    "DEPRECATED": 26,
    "NOT_READY": 27,
    "GPU_NOT_FOUND": 28,
    "INVALID_STATE": 29,
    "UNKNOWN": 999,
}
_NAMES_BY_CODE = {code: name for name, code in NVML_ERROR_CODES.items()}

# Errors worth retrying with backoff (the GPU is busy or briefly unavailable, not refusing):
# - IN_USE: a process (or DCGM holding MIG handles, DCGM #276) still uses the instance; it may let go.
# - TIMEOUT, NOT_READY: the driver was busy, e.g. right after a MIG reconfiguration.
# - MEMORY: host memory pressure inside the driver call.
# Everything else is permanent for the same arguments: INSUFFICIENT_RESOURCES means the placement is
# occupied (re-plan, do not retry blindly), and GPU_IS_LOST / RESET_REQUIRED need a GPU reset, which
# this operator never does.
TRANSIENT_ERRORS = frozenset({"IN_USE", "TIMEOUT", "NOT_READY", "MEMORY"})


class GpuError(Exception):
    """A failed GPU operation, in NVML's terms: ``code`` is the NVML value, ``name`` its short name.

    The message names the operation, the GPU and, where there is one, the placement, so that a
    ``GpuSlice`` status or Event can quote it as it is.
    """

    def __init__(self, name_or_code: str | int, message: str) -> None:
        if isinstance(name_or_code, int):
            self.code = name_or_code
            self.name = _NAMES_BY_CODE.get(name_or_code, f"CODE_{name_or_code}")
        else:
            if name_or_code not in NVML_ERROR_CODES:
                raise ValueError(f"unknown NVML error name {name_or_code!r}; e.g. 'IN_USE'")
            self.name = name_or_code
            self.code = NVML_ERROR_CODES[name_or_code]
        self.message = message
        super().__init__(f"{message}: NVML_ERROR_{self.name} ({self.code})")

    @property
    def transient(self) -> bool:
        """True when the same call may succeed later (see ``TRANSIENT_ERRORS``)."""
        return self.name in TRANSIENT_ERRORS

    def __reduce__(self) -> tuple[type[GpuError], tuple[int, str]]:
        # Keep the code across pickling (multiprocessing, test workers); the default would pass str(self).
        return (type(self), (self.code, self.message))


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML enumerates it."""

    index: int
    uuid: str
    product: str
    memory_mib: int
    mig_capable: bool
    mig_enabled: bool
    minor: int = -1  # the device minor: /dev/nvidia<minor>, and gpu<minor> under /proc/driver/nvidia


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance with its compute instance: what a MIG slice is on the device.

    ``ci_id`` is -1 and ``device_uuid`` empty for a GPU instance that has no compute instance (one
    left half-made by another tool, a failed rollback or a destroy that stopped half-way): it exists
    and holds its slots, but no process can run on it. Such an instance is never idle capacity to
    hand out: complete it (``GpuBackend.create_compute_instance``) or destroy it.
    """

    gpu_index: int
    gi_id: int
    ci_id: int
    profile_id: int
    profile: str
    start: int
    size: int
    device_uuid: str
    in_use: bool

    @property
    def complete(self) -> bool:
        """True when the GPU instance has its compute instance and MIG device, so a slice can use it."""
        return self.ci_id >= 0 and bool(self.device_uuid)


@dataclass(frozen=True)
class ProcessUsage:
    """One process using a device, as NVML lists it."""

    pid: int  # in the host's pid namespace, as NVML reports it
    memory_used: int  # bytes; 0 where NVML does not say


@dataclass(frozen=True)
class DeviceUsage:
    """What a device (a whole GPU or a MIG device) is used for now."""

    memory_used: int  # bytes in use on the device: a MIG device's own, a whole GPU's
    processes: tuple[ProcessUsage, ...]
    # Share (0-100) of the last interval with a kernel running on the device; None where NVML gives
    # none (MIG devices).
    active_percent: int | None


@runtime_checkable
class GpuBackend(Protocol):
    """What the agent needs from a node's GPUs. Every method may raise :class:`GpuError`."""

    def gpus(self) -> list[GpuInfo]:
        """All GPUs of the node, in NVML index order."""
        ...

    def model(self, index: int) -> GpuModel:
        """Profiles (in NVML profile-index order) and legal placements; answers with MIG disabled."""
        ...

    def instances(self, index: int) -> list[MigInstance]:
        """Every GPU instance on the GPU with its compute instance; NOT_SUPPORTED when MIG is off."""
        ...

    def create_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        """A GPU instance at that placement plus its full compute instance, with its MIG device UUID.

        On failure nothing is left, except when the rollback of the GPU instance fails too: then the
        GpuError says the GPU instance was left without a compute instance (complete or destroy it).
        A returned instance is always ``complete``.
        """
        ...

    def create_compute_instance(self, index: int, gi_id: int) -> MigInstance:
        """Complete a half-made GPU instance: create its full compute instance and return it.

        A GPU instance that already has a compute instance is returned as it is (a retry is safe).
        NOT_FOUND when there is no such GPU instance.
        """
        ...

    def destroy_instance(self, index: int, gi_id: int) -> None:
        """Compute instances first, then the GPU instance; IN_USE while a process runs on it.

        When the compute instances go but the GPU instance does not, the GpuError says the GPU instance
        was left without a compute instance; destroying it again finishes the job.
        """
        ...

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        """Turn MIG mode on or off; IN_USE when the GPU is not idle."""
        ...

    def device_root(self) -> str:
        """Where this node's ``/dev`` and ``/proc`` device files are (``gpu.device_files``): "/" on a
        node; the simulator lays out the files of its GPUs and instances there first."""
        ...

    def boot_id(self) -> str:
        """The id of the machine's current boot: MIG instances do not outlive it, so an owner record
        written in another boot names instances that are gone."""
        ...

    def health(self, index: int) -> GpuHealth:
        """The GPU's health now (``core.node.health``): a critical Xid reported since it was last reset, or
        the GPU lost. Never blocks and never raises for the GPU's own failure: that is what it reports."""
        ...

    def device_usage(self, device_uuid: str) -> DeviceUsage:
        """What the device ``device_uuid`` ("GPU-..." or "MIG-...") is used for now: memory in use,
        its processes, and (whole GPUs only) the share of time since the last call that a kernel ran.
        NOT_FOUND when no device has that UUID."""
        ...

    def clear_xid(self, index: int) -> None:
        """Forget the critical Xid kept for the GPU (an admin dealt with it): ``health`` reports it healthy
        until another is reported. A lost GPU stays lost: that is NVML's answer now, not a kept event."""
        ...

    def close(self) -> None:
        """Release the backend's resources (NVML session, file locks)."""
        ...
