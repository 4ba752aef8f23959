"""The real backend: NVML through pynvml (PyPI ``nvidia-ml-py``).

Choices that matter on hardware:

- One ``nvmlInit`` per process, shared by every backend object and released by the last ``close``:
  repeated init/shutdown cycles cost mig-manager 4.7x its CPU time (mig-parted 4fdc47b9).
- Profiles are discovered, not tabulated: every profile-info index of the documented range
  (``NVML_GPU_INSTANCE_PROFILE_COUNT``, with room for a driver newer than the binding), skipping the
  holes, which drivers answer with ``NOT_SUPPORTED`` or ``INVALID_ARGUMENT`` (so the scan never stops
  at the first hole), and placements from ``..PossiblePlacements_v2``. Both answer with MIG mode
  disabled (H200 capture). They do not change while the driver runs, so they are cached.
- No half-made slice is ever returned: ``create_instance`` returns only an instance with its compute
  instance and MIG device UUID, or raises. A GPU instance left without a compute instance (a failed
  rollback, a destroy that stopped half-way) is reported as such in the GpuError, and
  ``create_compute_instance`` completes one.
- MIG device UUIDs come from walking ``nvmlDeviceGetMigDeviceHandleByIndex`` and matching GI/CI ids,
  because the ``device`` field of the GI/CI info structs is documented as the *parent* device.
- Every ``pynvml.NVMLError`` becomes a :class:`GpuError` that keeps NVML's code.
- Health (``health``) drains NVML's event set for critical Xid events without waiting (timeout 0), keeps
  each GPU's last critical Xid (``core.node.health.xid_critical`` classifies them) for as long as the
  backend lives (NVML does not replay events: an agent started after a reset sees the GPU healthy), and
  reads the GPU's memory info to see whether it answers ``GPU_IS_LOST``, which a reset ends.
- Usage (``device_usage``) opens the device by UUID, a MIG device's as a GPU's. A whole GPU's activity
  is the mean of NVML's utilisation samples (share of each sample period with a kernel running) since
  the previous reading of that GPU; a MIG device has none in NVML, so it is reported as not available.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from typing import Any

import pynvml

from mig_operator.core.node.health import HEALTHY, GpuHealth, lost_health, xid_critical, xid_health
from mig_operator.core.placement.profiles import GpuModel, Profile, model_for_product
from mig_operator.gpu.files import host_boot_id
from mig_operator.gpu.nvml_query import (
    compute_instances,
    derived_profile_name,
    describe_gi,
    full_ci_profile,
    gpu_instances,
    is_mig_handle,
    kernel_share,
    mig_devices,
    mig_mode,
    nvml_code,
    read_profiles,
    running_processes,
    slug,
    text,
    translate,
)
from mig_operator.gpu.protocol import DeviceUsage, GpuError, GpuInfo, MigInstance

log = logging.getLogger("mig_operator.gpu")

_MIB = 1024 * 1024
# How long a create waits for the new MIG device to appear in the handle walk: DCGM #230 saw 1-2 s,
# DRA measured the walk itself at O(10 s) under load.
MIG_DEVICE_WAIT_S = 10.0
# The window of a GPU's first activity reading; later ones cover the time since the one before.
ACTIVITY_FIRST_WINDOW_S = 10.0

_session_lock = threading.Lock()
_session_refs = 0


def _acquire_session() -> None:
    global _session_refs
    with _session_lock:
        if _session_refs == 0:
            with translate("initialise NVML"):
                pynvml.nvmlInit()
        _session_refs += 1


def _release_session() -> None:
    global _session_refs
    with _session_lock:
        if _session_refs == 0:
            return
        _session_refs -= 1
        if _session_refs == 0:
            with translate("shut NVML down"):
                pynvml.nvmlShutdown()


class NvmlBackend:
    """The node's GPUs through NVML. Thread-safe: mutations on one GPU are serialised."""

    def __init__(self, mig_device_wait_s: float = MIG_DEVICE_WAIT_S) -> None:
        self._device_wait_s = mig_device_wait_s
        _acquire_session()
        self._closed = False
        self._models: dict[int, GpuModel] = {}
        self._gpu_locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        # NVML's event set for critical Xids, made at the first ``health``; False: NVML would not make one.
        self._events: Any = None
        self._events_lock = threading.Lock()
        self._xids: dict[str, int] = {}  # GPU UUID -> its last critical Xid
        # GPU UUID -> the newest utilisation sample's timestamp read, where the next reading starts.
        self._samples_read: dict[str, int] = {}
        self._samples_lock = threading.Lock()

    # ---- GpuBackend ------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        with translate("count GPUs"):
            count = pynvml.nvmlDeviceGetCount()
        return [self._info(i) for i in range(count)]

    def model(self, index: int) -> GpuModel:
        cached = self._models.get(index)
        if cached is not None:
            return cached
        handle = self._handle(index)
        with translate(f"read product of GPU {index}"):
            product = text(pynvml.nvmlDeviceGetName(handle))
            total_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        raw = read_profiles(handle, index)
        if not raw:
            raise GpuError("NOT_SUPPORTED", f"read MIG profiles of GPU {index} ({product}): none offered")
        slots = max((p.start + p.size for _info, _name, places in raw.values() for p in places), default=0)
        profiles = tuple(
            Profile(
                name=name if name else derived_profile_name(
                    info.sliceCount, placements[0].size if placements else 0, slots, total_mib, idx
                ),
                id=int(info.id),
                slices=int(info.sliceCount),
                memory_mib=int(info.memorySizeMB),
                sm=int(info.multiprocessorCount),
                max_instances=int(info.instanceCount),
                placements=placements,
            )
            for idx, (info, name, placements) in raw.items()
        )
        known = model_for_product(product, total_mib)
        model = GpuModel(
            name=known.name if known is not None else slug(product),
            product=product,
            memory_slots=slots,
            memory_mib=total_mib,
            profiles=profiles,
        )
        self._models[index] = model
        return model

    def instances(self, index: int) -> list[MigInstance]:
        handle = self._handle(index)
        self._require_mig(handle, index, "list instances")
        model = self.model(index)
        devices = mig_devices(handle, index)
        found: list[MigInstance] = []
        for profile in model.profiles:
            for gi in gpu_instances(handle, index, profile):
                found.append(describe_gi(index, gi, profile, devices))
        return sorted(found, key=lambda m: m.gi_id)

    def create_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        op = f"create GPU instance (profile id {profile_id}, placement start {start}) on GPU {index}"
        handle = self._handle(index)
        model = self.model(index)
        profile = next((p for p in model.profiles if p.id == profile_id), None)
        if profile is None:
            raise GpuError(
                "INVALID_ARGUMENT", f"{op}: GPU {index} ({model.name}) has no profile id {profile_id}"
            )
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = profile.size
        with self._gpu_lock(index):
            with translate(op):
                gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, profile_id, ctypes.byref(placement)
                )
            try:
                with translate(f"{op}: read GPU instance info"):
                    gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
                self._create_full_ci(gi, index, op)
            except GpuError as failed:
                raise self._roll_back(gi, index, op, failed) from failed
            except Exception:
                with contextlib.suppress(GpuError), translate(f"{op}: roll back GPU instance"):
                    pynvml.nvmlGpuInstanceDestroy(gi)
                raise
        return self._wait_for_device(handle, index, gi, gi_id, profile, op)

    def create_compute_instance(self, index: int, gi_id: int) -> MigInstance:
        op = f"create the compute instance of GPU instance {gi_id} on GPU {index}"
        handle = self._handle(index)
        self._require_mig(handle, index, op)
        with self._gpu_lock(index):
            with translate(op):
                gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            with translate(f"{op}: read GPU instance info"):
                info = pynvml.nvmlGpuInstanceGetInfo(gi)
            profile = next((p for p in self.model(index).profiles if p.id == int(info.profileId)), None)
            if profile is None:
                raise GpuError("NOT_SUPPORTED", f"{op}: its profile id {int(info.profileId)} is not one NVML lists")
            # A retry after a create that did land must not make a second CI.
            if not compute_instances(gi, index):
                self._create_full_ci(gi, index, op)
        return self._wait_for_device(handle, index, gi, gi_id, profile, op)

    def destroy_instance(self, index: int, gi_id: int) -> None:
        op = f"destroy GPU instance {gi_id} on GPU {index}"
        handle = self._handle(index)
        self._require_mig(handle, index, op)
        with self._gpu_lock(index):
            with translate(op):
                gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            with translate(f"{op}: read placement"):
                info = pynvml.nvmlGpuInstanceGetInfo(gi)
            where = f"{op} (placement {info.placement.start}:{info.placement.size})"
            # NVML refuses to destroy a GI that still has compute instances: CIs go first.
            destroyed = 0
            for ci in compute_instances(gi, index):
                try:
                    with translate(f"{where}: destroy compute instance"):
                        pynvml.nvmlComputeInstanceDestroy(ci)
                except GpuError as failed:
                    if destroyed:
                        raise GpuError(failed.code, f"{failed.message}; {destroyed} of its compute instances "
                                       "were destroyed already, destroy it again to finish") from failed
                    raise
                destroyed += 1
            try:
                with translate(where):
                    pynvml.nvmlGpuInstanceDestroy(gi)
            except GpuError as failed:
                if not destroyed:
                    raise
                # The slice is gone but its slots are not: say so, so the caller retries the destroy
                # (or completes the GI) and never takes it for an idle instance.
                raise GpuError(
                    failed.code,
                    f"{failed.message}; its compute instance was destroyed, so GPU instance {gi_id} is "
                    "left without one: destroy it again or complete it with create_compute_instance",
                ) from failed

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        op = f"set MIG mode {'on' if enabled else 'off'} on GPU {index}"
        handle = self._handle(index)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        with self._gpu_lock(index), translate(op):
            status = pynvml.nvmlDeviceSetMigMode(handle, mode)
        # The call can succeed while the activation fails (IN_USE if not idle, RESET_REQUIRED in VMs).
        if status != pynvml.NVML_SUCCESS:
            raise GpuError(int(status), f"{op}: activation failed")
        self._models.pop(index, None)

    def health(self, index: int) -> GpuHealth:
        with self._events_lock:
            self._drain_events()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = text(pynvml.nvmlDeviceGetUUID(handle))
            pynvml.nvmlDeviceGetMemoryInfo(handle)  # reaches the GPU: a lost one answers GPU_IS_LOST
        except pynvml.NVMLError as exc:
            if nvml_code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST:
                return lost_health(index)
            raise GpuError(nvml_code(exc), f"read the health of GPU {index}: {exc}") from exc
        xid = self._xids.get(uuid)
        return xid_health(index, xid) if xid is not None else HEALTHY

    def clear_xid(self, index: int) -> None:
        try:
            uuid = text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index)))
        except pynvml.NVMLError as exc:
            raise GpuError(nvml_code(exc), f"clear the Xid of GPU {index}: {exc}") from exc
        with self._events_lock:
            self._drain_events()  # an Xid NVML still holds is from before the clear
            self._xids.pop(uuid, None)

    def device_usage(self, device_uuid: str) -> DeviceUsage:
        what = f"device {device_uuid}"
        with translate(f"open {what}"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
        with translate(f"read the memory of {what}"):
            used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        processes = running_processes(handle, what)
        # NVML keeps no utilisation of a MIG device: say so rather than guess from the parent GPU's.
        if is_mig_handle(handle, what):
            return DeviceUsage(memory_used=used, processes=processes, active_percent=None)
        with self._samples_lock:
            since = self._samples_read.get(device_uuid)
            if since is None:
                since = max(0, time.time_ns() // 1000 - int(ACTIVITY_FIRST_WINDOW_S * 1_000_000))
            share, newest = kernel_share(handle, since, what)
            self._samples_read[device_uuid] = newest
        return DeviceUsage(memory_used=used, processes=processes, active_percent=share)

    def device_root(self) -> str:
        return "/"

    def boot_id(self) -> str:
        return host_boot_id()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._events is not None and self._events is not False:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._events)
                self._events = None
            _release_session()

    def _drain_events(self) -> None:
        """Every critical Xid event NVML holds, without waiting; the event set is made (and every GPU
        registered) on the first call. A GPU that cannot report Xid events is left out."""
        if self._events is False:
            return
        if self._events is None:
            try:
                self._events = pynvml.nvmlEventSetCreate()
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as exc:
                log.warning("no NVML event set (%s): GPU health is read from NVML's answers only, without Xids", exc)
                self._events = False
                return
            for index in range(count):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError as exc:
                    log.warning("GPU %s cannot report Xid events, its health is read from NVML's answers "
                                "only: %s", index, exc)
        while True:
            try:
                event = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError as exc:
                if nvml_code(exc) != pynvml.NVML_ERROR_TIMEOUT:
                    log.warning("reading NVML's Xid events failed: %s", exc)
                return
            xid = int(event.eventData)
            if event.eventType != pynvml.nvmlEventTypeXidCriticalError or not xid_critical(xid):
                continue
            try:
                uuid = text(pynvml.nvmlDeviceGetUUID(event.device))
            except pynvml.NVMLError as exc:
                log.warning("Xid %s on a GPU whose UUID cannot be read: %s", xid, exc)
                continue
            log.warning("GPU %s reported critical Xid %s", uuid, xid)
            self._xids[uuid] = xid

    # ---- internals -------------------------------------------------------------------------------

    def _create_full_ci(self, gi: Any, index: int, op: str) -> None:
        ci_profile_id = full_ci_profile(gi, index)
        with translate(f"{op}: create compute instance (CI profile id {ci_profile_id})"):
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile_id)

    def _roll_back(self, gi: Any, index: int, op: str, failed: GpuError) -> GpuError:
        """Destroy a GI whose CI could not be made; the error to raise says whether that worked."""
        # No half-made slice: a GI without its CI holds slots nobody can use.
        try:
            with translate(f"{op}: roll back GPU instance"):
                pynvml.nvmlGpuInstanceDestroy(gi)
        except GpuError as rollback:
            return GpuError(
                failed.code,
                f"{failed.message}; the rollback failed too ({rollback}), so the GPU instance is left "
                "without a compute instance: complete it with create_compute_instance or destroy it",
            )
        return failed

    def _wait_for_device(self, handle: Any, index: int, gi: Any, gi_id: int, profile: Profile, op: str) -> MigInstance:
        """The GI with its CI and MIG device UUID, once the device shows in the handle walk."""
        # The new MIG device can lag behind the create call (DCGM #230 saw 1-2 s).
        deadline = time.monotonic() + self._device_wait_s
        while True:
            made = describe_gi(index, gi, profile, mig_devices(handle, index))
            if made.complete:
                return made
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        what = ("has no compute instance" if made.ci_id < 0
                else f"has compute instance {made.ci_id}, but its MIG device did not appear")
        raise GpuError(
            "TIMEOUT",
            f"{op}: GPU instance {gi_id} (placement {made.start}:{made.size}) {what} within "
            f"{self._device_wait_s:g} s; it was left in place: list instances to find it, or destroy it",
        )

    def _handle(self, index: int) -> Any:
        with translate(f"open GPU {index}"):
            return pynvml.nvmlDeviceGetHandleByIndex(index)

    def _gpu_lock(self, index: int) -> threading.Lock:
        with self._locks_lock:
            return self._gpu_locks.setdefault(index, threading.Lock())

    def _info(self, index: int) -> GpuInfo:
        handle = self._handle(index)
        with translate(f"read GPU {index}"):
            uuid = text(pynvml.nvmlDeviceGetUUID(handle))
            product = text(pynvml.nvmlDeviceGetName(handle))
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        try:
            minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError as exc:
            # Only handing the GPU to a container needs it (/dev/nvidia<minor>); that refuses then.
            log.warning("cannot read the device minor of GPU %s: %s", index, exc)
            minor = -1
        capable, enabled = mig_mode(handle, index)
        return GpuInfo(index, uuid, product, memory_mib, capable, enabled, minor)

    def _require_mig(self, handle: Any, index: int, op: str) -> None:
        _capable, enabled = mig_mode(handle, index)
        if not enabled:
            raise GpuError("NOT_SUPPORTED", f"{op} on GPU {index}: MIG mode is disabled")
