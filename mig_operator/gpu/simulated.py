"""A MIG simulator that answers as NVML does, built from the catalog in ``core.placement.profiles``.

What it reproduces, because the operator's logic depends on it:

- only the catalog's legal placements are accepted (others: ``INVALID_ARGUMENT``); an occupied
  placement or a profile already at its instance limit gives ``INSUFFICIENT_RESOURCES``, as real
  NVML does (never ``ALREADY_EXISTS``, see the field notes);
- destroying an instance a process uses gives ``IN_USE``; MIG mode off gives ``NOT_SUPPORTED``;
- a catalog model without MIG (``l4-24gb``, ``l40s-48gb``, ...) is a GPU with ``mig_capable`` False:
  every MIG call on it (profiles, instances, create, destroy, MIG mode) gives ``NOT_SUPPORTED``;
- GPU instance ids follow the hardware's numbering by memory span (7g is GI 0, the two halves are
  GI 1 and 2, the quarters 3-6, the eighths 7-14, as ``nvidia-smi mig -lgi`` shows on A100/H100), so
  the same placement always gets the same id; the full compute instance is CI 0;
- a MIG device UUID is new each time a compute instance is created, even at the same placement,
  because real hardware does that and the agent must not trust a recorded UUID after a recreate;
- a GPU instance can be left without its compute instance (``ci_id`` -1, no device UUID), as on a
  real GPU when a create's rollback or a destroy stops half-way; ``create_compute_instance``
  completes one. Faults (``inject_fault``) and ``create_half_instance`` make such states on purpose;
- a GPU's health (``health``): ``inject_xid`` reports an Xid on it (a critical one, ``core.node.health``,
  makes it unhealthy), ``lose_gpu`` makes it fall off the bus, and ``reset_gpu`` (or ``reboot``) makes
  it healthy again, as a GPU reset does; ``clear_xid`` forgets the Xid only (an admin's clear mark).
  Only ``health`` reports a lost GPU; its other calls go on;
- what a device is used for (``device_usage``): memory, processes and activity a test sets with
  ``set_usage`` (or in the state file's ``usage``); a device without an entry is unused. A MIG
  device has no activity figure, as NVML keeps none, and its usage goes when it is destroyed.
  Usage does not mark an instance in use: ``set_in_use`` does, as it makes a destroy answer IN_USE.

State lives in memory, or in a JSON file when ``state_file`` is given: it is read under an ``fcntl``
lock before every operation (decoded only when its bytes changed) and written atomically (temp file
+ rename, no fsync) whenever the operation changed it, failed operations included (a half-made
instance, a fault used up). A mutation's latency is slept after the file is unlocked, so only that
caller waits. The file holds the instances, the pending faults and the latency, so a restarted
agent, or another process using the same file (an agent under test), sees the same GPUs, faults and
delays. A file that cannot be read as this simulator's state gives a one-line GpuError, never a
traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from mig_operator.core.node.health import HEALTHY, GpuHealth, lost_health, xid_critical, xid_health
from mig_operator.core.placement.profiles import GpuModel, Profile, get_model
from mig_operator.core.requests.quantities import MIB, clip_repr
from mig_operator.gpu.device_files import write_simulated_files
from mig_operator.gpu.files import host_boot_id
from mig_operator.gpu.protocol import NVML_ERROR_CODES, DeviceUsage, GpuError, GpuInfo, MigInstance, ProcessUsage
from mig_operator.gpu.sim_placement import check_room, gpu_uuid, legal_profile, mig_uuid
from mig_operator.gpu.sim_state import (
    FAULT_OPS,
    SimGpu,
    SimInstance,
    SimUsage,
    check_state_path,
    device_uuid_shape,
    file_error,
    gpu_instance_id,
    is_int,
    latency_table,
    parse_state,
    read_state,
    save_state,
    snapshot,
    usage_entry,
)


class SimulatedBackend:
    """``count`` GPUs of catalog model ``model_name`` with NVML's MIG semantics (see module doc).

    ``latency_s`` (seconds, for every mutating operation, or a mapping from operation to seconds)
    overrides the latency a state file holds; None keeps the file's (0 without a file).
    """

    def __init__(
        self,
        model_name: str,
        count: int = 1,
        state_file: str | None = None,
        latency_s: float | Mapping[str, float] | None = None,
        mig_enabled: bool = True,
        host: str = "",
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"GPU count {clip_repr(count)} must be at least 1; e.g. 2")
        self._model = get_model(model_name)
        self._count = count
        self._state_file = state_file
        self._device_root: str | None = None
        self._lock = threading.RLock()
        self._gpu_locks = [threading.Lock() for _ in range(count)]
        self._faults: dict[str, list[list[Any]]] = {}
        self._latency: dict[str, float] = {}
        self._boot = ""  # the simulated machine's boot id; "" until a simulated reboot: the host's
        self._usage: dict[str, SimUsage] = {}  # device UUID -> what it is used for
        self._latency_override = latency_table(latency_s) if latency_s is not None else None
        # The state file's bytes that the in-memory state holds, and its snapshot (see ``_state``).
        self._cache: tuple[bytes, dict[str, Any]] | None = None
        # A GPU without MIG can never be in MIG mode.
        enabled = mig_enabled and self._model.mig_capable
        self._gpus = [SimGpu(mig_enabled=enabled) for _ in range(count)]
        self._uuids = [gpu_uuid(model_name, i, host) for i in range(count)]
        if state_file is not None:
            check_state_path(state_file)
            # Read (and validate) now so a bad or foreign state file fails at start-up; write the
            # initial state when there is none. The read happens under the lock, so two processes
            # starting together do not overwrite each other's instances.
            try:
                with self._state(initial=True):
                    pass
            except OSError as exc:
                raise ValueError(
                    f"simulator state file {clip_repr(state_file)} cannot be used: {exc.strerror or exc}"
                ) from None

    # ---- test hooks ------------------------------------------------------------------------------

    def inject_fault(self, op: str, error_name: str, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` fail with NVML error ``error_name``.

        With a state file the fault is kept in the file, so another process using it fails too.
        ``create_compute_instance`` fails the compute-instance step (of ``create_instance``, after its
        GPU instance exists, or of ``create_compute_instance``); ``destroy_gpu_instance`` fails the
        GPU-instance step (of ``destroy_instance``, after the compute instance is gone, or of
        ``create_instance``'s rollback): together they leave a GPU instance without a compute instance.
        """
        if op not in FAULT_OPS:
            raise ValueError(f"unknown operation {clip_repr(op)}; one of {', '.join(sorted(FAULT_OPS))}")
        if error_name not in NVML_ERROR_CODES:
            raise ValueError(f"unknown NVML error {clip_repr(error_name)}; e.g. 'IN_USE'")
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"fault count {clip_repr(times)} must be at least 1; e.g. 1")
        with self._state():
            self._faults.setdefault(op, []).append([error_name, times])

    def clear_faults(self) -> None:
        """Forget every pending fault (in the state file too)."""
        with self._state():
            self._faults = {}

    def set_latency(self, latency_s: float | Mapping[str, float]) -> None:
        """Set the latency of mutating operations; with a state file, for every process using it."""
        table = latency_table(latency_s)
        with self._state():
            self._latency = table
            if self._latency_override is not None:
                self._latency_override = table

    def set_in_use(self, index: int, gi_id: int, in_use: bool) -> None:
        """Mark an instance as used by a process (or not), as if a CUDA program ran on it."""
        with self._state():
            gpu = self._gpu(index, "set_in_use")
            inst = self._find(gpu, index, gi_id, "set_in_use")
            if in_use and inst.ci_id < 0:
                raise GpuError(
                    "INVALID_ARGUMENT",
                    f"set_in_use: GPU instance {gi_id} on GPU {index} has no compute instance, so no "
                    "process can run on it",
                )
            inst.in_use = in_use

    def set_usage(self, device_uuid: str, memory_used: int, pids: list[int] | tuple[int, ...],
                  active_percent: int | None) -> None:
        """Device ``device_uuid`` (a GPU's or a MIG device's) has ``memory_used`` bytes in use by the
        processes ``pids``, with a kernel running ``active_percent`` of the time (None for a MIG
        device, which NVML gives none for). ValueError for figures that cannot be; NOT_FOUND when no
        device has that UUID."""
        if not device_uuid_shape(device_uuid):
            raise ValueError(f"device {clip_repr(device_uuid)} is not a GPU-... or MIG-... UUID")
        entry = usage_entry(memory_used, pids, active_percent, mig=device_uuid.startswith("MIG-"))
        with self._state():
            memory = self._device_memory(device_uuid, "set the usage")
            if entry.memory_used > memory:
                raise ValueError(f"memory used {entry.memory_used} is more than device {device_uuid} has ({memory})")
            self._usage[device_uuid] = entry

    def reboot(self) -> None:
        """The machine restarts: every GPU and compute instance is gone (MIG mode stays, as NVIDIA's
        persistent setting does), no process uses any device, and the boot id is a new one."""
        with self._state():
            for gpu in self._gpus:
                gpu.instances.clear()
                gpu.xid, gpu.lost = 0, False
            self._usage.clear()
            self._boot = f"sim-{uuid.uuid4()}"

    def inject_xid(self, index: int, xid: int) -> None:
        """GPU ``index`` reports Xid ``xid``: a critical one makes it unhealthy until ``reset_gpu`` (or
        ``clear_xid``); an application's (``core.node.health.APPLICATION_XIDS``) changes nothing, as on
        hardware."""
        if not is_int(xid) or xid < 1:
            raise ValueError(f"Xid {clip_repr(xid)} is not a positive number; e.g. 79")
        with self._state():
            gpu = self._gpu(index, "inject an Xid")
            if xid_critical(xid):
                gpu.xid = xid

    def lose_gpu(self, index: int) -> None:
        """GPU ``index`` falls off the bus: ``health`` reports it lost until ``reset_gpu``."""
        with self._state():
            self._gpu(index, "lose the GPU").lost = True

    def clear_xid(self, index: int) -> None:
        with self._state():
            self._gpu(index, "clear the GPU's Xid").xid = 0

    def reset_gpu(self, index: int) -> None:
        """GPU ``index`` is reset (``nvidia-smi -r``): its Xid and loss are cleared; its instances stay."""
        with self._state():
            gpu = self._gpu(index, "reset the GPU")
            gpu.xid, gpu.lost = 0, False

    def create_half_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        """A GPU instance without a compute instance, as another tool or a failed rollback leaves one."""
        op = f"create GPU instance only (profile id {profile_id}, placement start {start}) on GPU {index}"
        with self._state():
            gpu = self._gpu(index, op)
            self._require_mig(gpu, index, op)
            profile = legal_profile(self._model, profile_id, start, op)
            check_room(self._model, gpu, profile, start, op)
            inst = self._new_instance(gpu, profile, start)
            inst.ci_id = -1
            gpu.instances[inst.gi_id] = inst
            return self._record(index, inst)

    # ---- GpuBackend ------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        with self._state():
            self._maybe_fail("gpus", "list GPUs")
            return [
                GpuInfo(
                    index=i,
                    uuid=self._uuids[i],
                    product=self._model.product,
                    memory_mib=self._model.memory_mib,
                    mig_capable=self._model.mig_capable,
                    mig_enabled=gpu.mig_enabled,
                    minor=i,  # a node's GPUs are /dev/nvidia0.. in index order
                )
                for i, gpu in enumerate(self._gpus)
            ]

    def model(self, index: int) -> GpuModel:
        # Profiles and placements answer with MIG disabled on real GPUs too (H200 capture); a GPU
        # without MIG answers NOT_SUPPORTED, as NVML's profile-info call does there.
        op = f"read MIG profiles of GPU {index}"
        with self._state():
            self._check_index(index, op)
            self._maybe_fail("model", op)
            if not self._model.mig_capable:
                raise GpuError("NOT_SUPPORTED", f"{op} ({self._model.product}): the GPU has no MIG")
            return self._model

    def instances(self, index: int) -> list[MigInstance]:
        with self._state():
            gpu = self._gpu(index, "list instances")
            self._maybe_fail("instances", f"list instances on GPU {index}")
            self._require_mig(gpu, index, "list instances")
            ordered = sorted(gpu.instances.values(), key=lambda i: i.gi_id)
            return [self._record(index, inst) for inst in ordered]

    def create_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        op = f"create GPU instance (profile id {profile_id}, placement start {start}) on GPU {index}"
        with self._serial(index):
            with self._state():
                gpu = self._gpu(index, op)
                self._maybe_fail("create_instance", op)
                self._require_mig(gpu, index, op)
                profile = legal_profile(self._model, profile_id, start, op)
                check_room(self._model, gpu, profile, start, op)
                inst = self._new_instance(gpu, profile, start)
                try:
                    self._maybe_fail("create_compute_instance", f"{op}: create compute instance")
                except GpuError as failed:
                    # The contract is to destroy the GI again; only if that fails too is it left behind.
                    try:
                        self._maybe_fail("destroy_gpu_instance", f"{op}: roll back GPU instance {inst.gi_id}")
                    except GpuError as rollback:
                        inst.ci_id = -1
                        gpu.instances[inst.gi_id] = inst
                        raise GpuError(
                            failed.code,
                            f"{failed.message}; the rollback failed too ({rollback}), so GPU instance "
                            f"{inst.gi_id} is left without a compute instance: complete it with "
                            "create_compute_instance or destroy it",
                        ) from None
                    raise
                gpu.instances[inst.gi_id] = inst
                made, pause = self._record(index, inst), self._latency_of("create_instance")
            time.sleep(pause)
            return made

    def create_compute_instance(self, index: int, gi_id: int) -> MigInstance:
        op = f"create the compute instance of GPU instance {gi_id} on GPU {index}"
        with self._serial(index):
            with self._state():
                gpu = self._gpu(index, op)
                self._require_mig(gpu, index, op)
                inst = self._find(gpu, index, gi_id, op)
                if inst.ci_id >= 0:
                    return self._record(index, inst)  # complete already: a retry changes nothing
                self._maybe_fail("create_compute_instance", op)
                gpu.generation += 1
                inst.generation = gpu.generation  # a new compute instance is a new MIG device
                inst.ci_id = 0
                made, pause = self._record(index, inst), self._latency_of("create_compute_instance")
            time.sleep(pause)
            return made

    def destroy_instance(self, index: int, gi_id: int) -> None:
        op = f"destroy GPU instance {gi_id} on GPU {index}"
        with self._serial(index):
            with self._state():
                gpu = self._gpu(index, op)
                self._maybe_fail("destroy_instance", op)
                self._require_mig(gpu, index, op)
                inst = self._find(gpu, index, gi_id, op)
                where = f"{op} (placement {inst.start}:{inst.size})"
                if inst.in_use:
                    raise GpuError("IN_USE", f"{where}: a process is running on it")
                had_ci = inst.ci_id >= 0
                if had_ci:
                    self._usage.pop(self._record(index, inst).device_uuid, None)  # its MIG device goes
                inst.ci_id = -1  # compute instance first, as NVML requires
                try:
                    self._maybe_fail("destroy_gpu_instance", where)
                except GpuError as failed:
                    if not had_ci:
                        raise
                    raise GpuError(
                        failed.code,
                        f"{failed.message}; its compute instance was destroyed, so GPU instance {gi_id} is "
                        "left without one: destroy it again or complete it with create_compute_instance",
                    ) from None
                del gpu.instances[gi_id]
                pause = self._latency_of("destroy_instance")
            time.sleep(pause)

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        op = f"set MIG mode {'on' if enabled else 'off'} on GPU {index}"
        with self._serial(index):
            with self._state():
                gpu = self._gpu(index, op)
                self._maybe_fail("set_mig_mode", op)
                if not self._model.mig_capable:
                    raise GpuError("NOT_SUPPORTED", f"{op} ({self._model.product}): the GPU has no MIG")
                if gpu.mig_enabled == enabled:
                    return
                if not enabled and gpu.instances:
                    # The driver refuses to leave MIG mode while instances exist (the GPU is not idle).
                    raise GpuError("IN_USE", f"{op}: {len(gpu.instances)} GPU instance(s) still exist")
                gpu.mig_enabled = enabled
                pause = self._latency_of("set_mig_mode")
            time.sleep(pause)

    def device_root(self) -> str:
        """The driver's files for the simulated GPUs (``/proc/devices``, MIG capability files), laid
        out now from the current instances: beside the state file (``STATE.devices``), else in a
        directory of this process."""
        with self._state():
            if self._device_root is None:
                self._device_root = (f"{self._state_file}.devices" if self._state_file is not None
                                     else tempfile.mkdtemp(prefix="mig-operator-sim-devices-"))
            instances = [(i, inst.gi_id, inst.ci_id) for i, gpu in enumerate(self._gpus)
                         for inst in gpu.instances.values()]
            write_simulated_files(self._device_root, range(self._count), instances)
            return self._device_root

    def device_usage(self, device_uuid: str) -> DeviceUsage:
        with self._state():
            self._device_memory(device_uuid, "read the usage")
            mig = device_uuid.startswith("MIG-")
            entry = self._usage.get(device_uuid)
            if entry is None:
                return DeviceUsage(memory_used=0, processes=(), active_percent=None if mig else 0)
            # The simulator knows the device's total only: each process is given an even share of it.
            count = len(entry.pids)
            shares = [entry.memory_used // count] * count if count else []
            if shares:
                shares[0] += entry.memory_used - sum(shares)
            return DeviceUsage(
                memory_used=entry.memory_used,
                processes=tuple(ProcessUsage(pid, share) for pid, share in zip(entry.pids, shares, strict=True)),
                active_percent=entry.active_percent,
            )

    def health(self, index: int) -> GpuHealth:
        with self._state():
            gpu = self._gpu(index, "read the GPU's health")
            if gpu.lost:
                return lost_health(index)
            return xid_health(index, gpu.xid) if gpu.xid else HEALTHY

    def boot_id(self) -> str:
        with self._state():
            return self._boot or host_boot_id()

    def close(self) -> None:
        # Nothing is held between calls: the state file is locked only inside each operation.
        return None

    # ---- internals -------------------------------------------------------------------------------

    def _record(self, index: int, inst: SimInstance) -> MigInstance:
        complete = inst.ci_id >= 0
        return MigInstance(
            gpu_index=index,
            gi_id=inst.gi_id,
            ci_id=inst.ci_id,
            profile_id=inst.profile_id,
            profile=self._model.profile_by_id(inst.profile_id).name,
            start=inst.start,
            size=inst.size,
            device_uuid=mig_uuid(self._uuids[index], inst.gi_id, inst.start, inst.generation) if complete else "",
            in_use=inst.in_use,
        )

    def _device_memory(self, device_uuid: object, op: str) -> int:
        """The bytes of memory the device ``device_uuid`` has: a GPU's, or a live MIG device's profile's;
        NOT_FOUND, as NVML's open by UUID answers, when there is no such device."""
        if device_uuid in self._uuids:
            return self._model.memory_mib * MIB
        for index, gpu in enumerate(self._gpus):
            for inst in gpu.instances.values():
                if inst.ci_id >= 0 and self._record(index, inst).device_uuid == device_uuid:
                    return self._model.profile_by_id(inst.profile_id).memory_mib * MIB
        raise GpuError("NOT_FOUND", f"{op} of device {clip_repr(device_uuid)}: no device has that UUID")

    def _new_instance(self, gpu: SimGpu, profile: Profile, start: int) -> SimInstance:
        gpu.generation += 1
        return SimInstance(
            gi_id=gpu_instance_id(self._model, start, profile.size),
            profile_id=profile.id,
            start=start,
            size=profile.size,
            ci_id=0,
            generation=gpu.generation,
        )

    def _check_index(self, index: int, op: str) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._count:
            raise GpuError("INVALID_ARGUMENT", f"{op}: no GPU {clip_repr(index)} (this node has {self._count})")

    def _gpu(self, index: int, op: str) -> SimGpu:
        self._check_index(index, op)
        return self._gpus[index]

    def _require_mig(self, gpu: SimGpu, index: int, op: str) -> None:
        if not self._model.mig_capable:
            raise GpuError("NOT_SUPPORTED", f"{op}: GPU {index} ({self._model.product}) has no MIG")
        if not gpu.mig_enabled:
            raise GpuError("NOT_SUPPORTED", f"{op}: MIG mode is disabled on GPU {index}")

    def _find(self, gpu: SimGpu, index: int, gi_id: int, op: str) -> SimInstance:
        try:
            return gpu.instances[gi_id]
        except (KeyError, TypeError):
            raise GpuError("NOT_FOUND", f"{op}: GPU {index} has no GPU instance {clip_repr(gi_id)}") from None

    def _maybe_fail(self, op: str, message: str) -> None:
        queue = self._faults.get(op)
        if not queue:
            return
        entry = queue[0]
        name = str(entry[0])
        entry[1] = int(entry[1]) - 1
        if entry[1] <= 0:
            queue.pop(0)
            if not queue:
                del self._faults[op]
        raise GpuError(name, f"{message} (injected fault)")

    def _latency_of(self, op: str) -> float:
        # Mutations take time on real GPUs (GI destroy "may take O(1 s)", DRA nvlib.go). The caller
        # sleeps it after the state file is unlocked, so other GPUs and other processes go on
        # meanwhile, as they do on hardware; one GPU's mutations in this process wait (``_serial``),
        # as NvmlBackend's per-GPU lock makes them.
        latency = self._latency_override if self._latency_override is not None else self._latency
        return latency.get(op, 0.0)

    @contextlib.contextmanager
    def _serial(self, index: int) -> Iterator[None]:
        """One mutation at a time per GPU in this process (an invalid index is refused inside)."""
        lock = self._gpu_locks[index] if is_int(index) and 0 <= index < self._count else None
        if lock is None:
            yield
            return
        with lock:
            yield

    # ---- state -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _state(self, initial: bool = False) -> Iterator[None]:
        """Hold the state for one operation: thread lock, file lock, fresh read, and a write-back when
        the operation changed anything, also when it failed with a GpuError after a change (a fault
        used up, a GPU instance left half-made), since the hardware would have changed as well.

        The file is read every time, so another process's change is always seen, but decoded only
        when its bytes differ from those in ``_cache``: the bytes last read or written here, which
        the in-memory state holds, with that state's snapshot. The cache is None while an operation
        runs, and stays None when one ends without its state saved (an OSError on save, an
        exception other than GpuError), so the next operation decodes the file afresh."""
        with self._lock:
            if self._state_file is None:
                yield
                return
            try:
                # Every operation may use up a fault, so every one may write: always exclusive.
                with open(self._state_file + ".lock", "a") as lock_fd:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    try:
                        raw = read_state(self._state_file)
                        cache, self._cache = self._cache, None
                        if cache is not None and raw == cache[0]:
                            found, before = True, cache[1]
                        else:
                            found = self._load(raw)
                            before = self._snapshot()
                        try:
                            yield
                        except GpuError:
                            self._write_back(raw, before, force=False)
                            raise
                        self._write_back(raw, before, force=initial and not found)
                    finally:
                        fcntl.flock(lock_fd, fcntl.LOCK_UN)
            except OSError as exc:
                if initial:
                    raise
                raise self._file_error(exc) from None

    def _file_error(self, exc: OSError) -> GpuError:
        return file_error(self._state_file or "", exc)

    def _load(self, raw: bytes | None) -> bool:
        """Replace the in-memory state with the one ``raw`` holds; False when there is no state yet."""
        assert self._state_file is not None
        state = parse_state(raw, self._state_file, self._model, self._count) if raw is not None else None
        if state is None:
            return False
        self._gpus, self._faults, self._latency, self._boot, self._usage = state
        return True

    def _snapshot(self) -> dict[str, Any]:
        return snapshot(self._model, self._gpus, self._faults, self._latency, self._boot, self._usage)

    def _write_back(self, raw: bytes | None, before: dict[str, Any], force: bool) -> None:
        """Save the state when it differs from ``before`` (or ``force``); then cache the file's bytes."""
        assert self._state_file is not None
        after = self._snapshot()
        if force or after != before:
            self._cache = (save_state(self._state_file, after), after)
        elif raw:  # an empty or missing file holds no state: the next operation must see so
            self._cache = (raw, after)
