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
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pynvml

from mig_operator.core.profiles import GpuModel, Placement, Profile, model_for_product
from mig_operator.gpu.protocol import GpuError, GpuInfo, MigInstance

log = logging.getLogger("mig_operator.gpu")

_MIB = 1024 * 1024
# Profile-info indices scanned: the binding's documented count, or more, for a driver newer than it.
_PROFILE_INDEX_SCAN = max(int(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)), 32)
# How long a create waits for the new MIG device to appear in the handle walk: DCGM #230 saw 1-2 s,
# DRA measured the walk itself at O(10 s) under load.
MIG_DEVICE_WAIT_S = 10.0

_session_lock = threading.Lock()
_session_refs = 0


def _acquire_session() -> None:
    global _session_refs
    with _session_lock:
        if _session_refs == 0:
            with _translate("initialise NVML"):
                pynvml.nvmlInit()
        _session_refs += 1


def _release_session() -> None:
    global _session_refs
    with _session_lock:
        if _session_refs == 0:
            return
        _session_refs -= 1
        if _session_refs == 0:
            with _translate("shut NVML down"):
                pynvml.nvmlShutdown()


@contextlib.contextmanager
def _translate(operation: str) -> Iterator[None]:
    """Turn a pynvml error into a GpuError that names the operation and keeps NVML's code."""
    try:
        yield
    except pynvml.NVMLError as exc:
        code = int(getattr(exc, "value", 999))
        raise GpuError(code, f"{operation}: {exc}") from exc


def _text(value: bytes | str) -> str:
    # pynvml returns str in recent releases and bytes in older ones.
    return value.decode() if isinstance(value, bytes) else value


def _nvml_code(exc: pynvml.NVMLError) -> int:
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


class NvmlBackend:
    """The node's GPUs through NVML. Thread-safe: mutations on one GPU are serialised."""

    def __init__(self, mig_device_wait_s: float = MIG_DEVICE_WAIT_S) -> None:
        self._device_wait_s = mig_device_wait_s
        _acquire_session()
        self._closed = False
        self._models: dict[int, GpuModel] = {}
        self._gpu_locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # ---- GpuBackend ------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        with _translate("count GPUs"):
            count = pynvml.nvmlDeviceGetCount()
        return [self._info(i) for i in range(count)]

    def model(self, index: int) -> GpuModel:
        cached = self._models.get(index)
        if cached is not None:
            return cached
        handle = self._handle(index)
        with _translate(f"read product of GPU {index}"):
            product = _text(pynvml.nvmlDeviceGetName(handle))
            total_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        raw = self._read_profiles(handle, index)
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
        devices = self._mig_devices(handle, index)
        found: list[MigInstance] = []
        for profile in model.profiles:
            for gi in self._gpu_instances(handle, index, profile):
                found.append(self._describe_gi(index, gi, profile, devices))
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
            with _translate(op):
                gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, profile_id, ctypes.byref(placement)
                )
            try:
                with _translate(f"{op}: read GPU instance info"):
                    gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
                self._create_full_ci(gi, index, op)
            except GpuError as failed:
                raise self._roll_back(gi, index, op, failed) from failed
            except Exception:
                with contextlib.suppress(GpuError), _translate(f"{op}: roll back GPU instance"):
                    pynvml.nvmlGpuInstanceDestroy(gi)
                raise
        return self._wait_for_device(handle, index, gi, gi_id, profile, op)

    def create_compute_instance(self, index: int, gi_id: int) -> MigInstance:
        op = f"create the compute instance of GPU instance {gi_id} on GPU {index}"
        handle = self._handle(index)
        self._require_mig(handle, index, op)
        with self._gpu_lock(index):
            with _translate(op):
                gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            with _translate(f"{op}: read GPU instance info"):
                info = pynvml.nvmlGpuInstanceGetInfo(gi)
            profile = next((p for p in self.model(index).profiles if p.id == int(info.profileId)), None)
            if profile is None:
                raise GpuError("NOT_SUPPORTED", f"{op}: its profile id {int(info.profileId)} is not one NVML lists")
            # A retry after a create that did land must not make a second CI.
            if not self._compute_instances(gi, index):
                self._create_full_ci(gi, index, op)
        return self._wait_for_device(handle, index, gi, gi_id, profile, op)

    def destroy_instance(self, index: int, gi_id: int) -> None:
        op = f"destroy GPU instance {gi_id} on GPU {index}"
        handle = self._handle(index)
        self._require_mig(handle, index, op)
        with self._gpu_lock(index):
            with _translate(op):
                gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            with _translate(f"{op}: read placement"):
                info = pynvml.nvmlGpuInstanceGetInfo(gi)
            where = f"{op} (placement {info.placement.start}:{info.placement.size})"
            # NVML refuses to destroy a GI that still has compute instances: CIs go first.
            destroyed = 0
            for ci in self._compute_instances(gi, index):
                try:
                    with _translate(f"{where}: destroy compute instance"):
                        pynvml.nvmlComputeInstanceDestroy(ci)
                except GpuError as failed:
                    if destroyed:
                        raise GpuError(failed.code, f"{failed.message}; {destroyed} of its compute instances "
                                       "were destroyed already, destroy it again to finish") from failed
                    raise
                destroyed += 1
            try:
                with _translate(where):
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
        with self._gpu_lock(index), _translate(op):
            status = pynvml.nvmlDeviceSetMigMode(handle, mode)
        # The call can succeed while the activation fails (IN_USE if not idle, RESET_REQUIRED in VMs).
        if status != pynvml.NVML_SUCCESS:
            raise GpuError(int(status), f"{op}: activation failed")
        self._models.pop(index, None)

    def device_root(self) -> str:
        return "/"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release_session()

    # ---- internals -------------------------------------------------------------------------------

    def _create_full_ci(self, gi: Any, index: int, op: str) -> None:
        ci_profile_id = self._full_ci_profile(gi, index)
        with _translate(f"{op}: create compute instance (CI profile id {ci_profile_id})"):
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile_id)

    def _roll_back(self, gi: Any, index: int, op: str, failed: GpuError) -> GpuError:
        """Destroy a GI whose CI could not be made; the error to raise says whether that worked."""
        # No half-made slice: a GI without its CI holds slots nobody can use.
        try:
            with _translate(f"{op}: roll back GPU instance"):
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
            made = self._describe_gi(index, gi, profile, self._mig_devices(handle, index))
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
        with _translate(f"open GPU {index}"):
            return pynvml.nvmlDeviceGetHandleByIndex(index)

    def _gpu_lock(self, index: int) -> threading.Lock:
        with self._locks_lock:
            return self._gpu_locks.setdefault(index, threading.Lock())

    def _info(self, index: int) -> GpuInfo:
        handle = self._handle(index)
        with _translate(f"read GPU {index}"):
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            product = _text(pynvml.nvmlDeviceGetName(handle))
            memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        try:
            minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError as exc:
            # Only handing the GPU to a container needs it (/dev/nvidia<minor>); that refuses then.
            log.warning("cannot read the device minor of GPU %s: %s", index, exc)
            minor = -1
        capable, enabled = self._mig_mode(handle, index)
        return GpuInfo(index, uuid, product, memory_mib, capable, enabled, minor)

    def _mig_mode(self, handle: Any, index: int) -> tuple[bool, bool]:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as exc:
            # NOT_SUPPORTED is the documented answer of a GPU without MIG, not a failure.
            if _nvml_code(exc) == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return False, False
            raise GpuError(_nvml_code(exc), f"read MIG mode of GPU {index}: {exc}") from exc
        return True, current == pynvml.NVML_DEVICE_MIG_ENABLE

    def _require_mig(self, handle: Any, index: int, op: str) -> None:
        _capable, enabled = self._mig_mode(handle, index)
        if not enabled:
            raise GpuError("NOT_SUPPORTED", f"{op} on GPU {index}: MIG mode is disabled")

    def _read_profiles(self, handle: Any, index: int) -> dict[int, tuple[Any, str, tuple[Placement, ...]]]:
        """Profile-info index -> (info struct, NVML's name or '', placements), in index order."""
        found: dict[int, tuple[Any, str, tuple[Placement, ...]]] = {}
        for idx in range(_PROFILE_INDEX_SCAN):
            try:
                info, name = self._profile_info(handle, idx)
            except pynvml.NVMLError as exc:
                code = _nvml_code(exc)
                # Holes in the index table (H200: 5, 6, 8, 10-16 NOT_SUPPORTED; past the driver's last
                # index, or a hole on some drivers, INVALID_ARGUMENT): skip, never stop early.
                if code in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise GpuError(code, f"read MIG profile index {idx} of GPU {index}: {exc}") from exc
            found[idx] = (info, name, self._placements(handle, index, int(info.id)))
        return found

    @staticmethod
    def _profile_info(handle: Any, idx: int) -> tuple[Any, str]:
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx, version=2)
        except TypeError:
            # A pynvml without the version argument knows only the v1 struct, which has no name.
            return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx), ""
        except pynvml.NVMLError as exc:
            if _nvml_code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, idx, version=1), ""
        name = _text(getattr(info, "name", b""))
        # NVML names profiles as nvidia-smi prints them, "MIG 1g.18gb"; the catalog drops "MIG ".
        return info, name.removeprefix("MIG ").strip()

    def _placements(self, handle: Any, index: int, profile_id: int) -> tuple[Placement, ...]:
        op = f"read placements of profile id {profile_id} on GPU {index}"
        count = ctypes.c_uint(0)
        with _translate(op):
            # A NULL array asks only for the count (nvml.h, ..PossiblePlacements_v2).
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
        if count.value == 0:
            return ()
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        with _translate(op):
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
        return tuple(sorted(Placement(int(p.start), int(p.size)) for p in array[: count.value]))

    def _gpu_instances(self, handle: Any, index: int, profile: Profile) -> list[Any]:
        size = max(profile.max_instances, 1)
        array = (pynvml.c_nvmlGpuInstance_t * size)()
        count = ctypes.c_uint(0)
        with _translate(f"list GPU instances of {profile.name} (profile id {profile.id}) on GPU {index}"):
            pynvml.nvmlDeviceGetGpuInstances(handle, profile.id, array, ctypes.byref(count))
        return list(array[: count.value])

    def _ci_profiles(self, gi: Any, index: int) -> list[Any]:
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
                if _nvml_code(exc) in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise GpuError(_nvml_code(exc), f"read compute profile {idx} on GPU {index}: {exc}") from exc
        return found

    def _full_ci_profile(self, gi: Any, index: int) -> int:
        # The full CI uses every compute slice of its GI: the offered CI profile with most slices.
        profiles = self._ci_profiles(gi, index)
        if not profiles:
            raise GpuError("NOT_SUPPORTED", f"GPU {index}: the new GPU instance offers no compute profile")
        return int(max(profiles, key=lambda p: p.sliceCount).id)

    def _compute_instances(self, gi: Any, index: int) -> list[Any]:
        found = []
        for ci_profile in self._ci_profiles(gi, index):
            size = max(int(ci_profile.instanceCount), 1)
            array = (pynvml.c_nvmlComputeInstance_t * size)()
            count = ctypes.c_uint(0)
            with _translate(f"list compute instances on GPU {index}"):
                pynvml.nvmlGpuInstanceGetComputeInstances(gi, int(ci_profile.id), array, ctypes.byref(count))
            found.extend(array[: count.value])
        return found

    def _mig_devices(self, handle: Any, index: int) -> dict[tuple[int, int], tuple[str, bool]]:
        """(GI id, CI id) -> (MIG device UUID, a process runs on it), by walking the MIG handles."""
        devices: dict[tuple[int, int], tuple[str, bool]] = {}
        with _translate(f"count MIG devices of GPU {index}"):
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        for slot in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError as exc:
                # Unused slots answer NOT_FOUND (or INVALID_ARGUMENT on some drivers): holes, not errors.
                if _nvml_code(exc) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise GpuError(_nvml_code(exc), f"open MIG device {slot} of GPU {index}: {exc}") from exc
            with _translate(f"read MIG device {slot} of GPU {index}"):
                gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
                ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
                uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
                busy = len(pynvml.nvmlDeviceGetComputeRunningProcesses(mig)) > 0
            devices[(gi_id, ci_id)] = (uuid, busy)
        return devices

    def _describe_gi(
        self, index: int, gi: Any, profile: Profile, devices: dict[tuple[int, int], tuple[str, bool]]
    ) -> MigInstance:
        with _translate(f"read GPU instance of {profile.name} on GPU {index}"):
            info = pynvml.nvmlGpuInstanceGetInfo(gi)
        gi_id = int(info.id)
        ci_ids = []
        for ci in self._compute_instances(gi, index):
            with _translate(f"read compute instance of GPU instance {gi_id} on GPU {index}"):
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
