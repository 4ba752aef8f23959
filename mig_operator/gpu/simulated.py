"""A MIG simulator that answers as NVML does, built from the catalog in ``core.profiles``.

What it reproduces, because the operator's logic depends on it:

- only the catalog's legal placements are accepted (others: ``INVALID_ARGUMENT``); an occupied
  placement or a profile already at its instance limit gives ``INSUFFICIENT_RESOURCES``, as real
  NVML does (never ``ALREADY_EXISTS``, see the field notes);
- destroying an instance a process uses gives ``IN_USE``; MIG mode off gives ``NOT_SUPPORTED``;
- GPU instance ids follow the hardware's numbering by memory span (7g is GI 0, the two halves are
  GI 1 and 2, the quarters 3-6, the eighths 7-14, as ``nvidia-smi mig -lgi`` shows on A100/H100), so
  the same placement always gets the same id; the full compute instance is CI 0;
- a MIG device UUID is new each time an instance is created, even at the same placement, because
  real hardware does that and the agent must not trust a recorded UUID after a recreate.

State lives in memory, or in a JSON file when ``state_file`` is given: it is read under an ``fcntl``
lock before every operation and written atomically (temp file + rename) after every mutation, so a
restarted agent, or several processes at once, see the instances left behind, as on a real GPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from mig_operator.core.profiles import GpuModel, Profile, get_model
from mig_operator.gpu.protocol import NVML_ERROR_CODES, GpuError, GpuInfo, MigInstance

# Fixed namespace so every run, process and machine derives the same UUIDs from the same names.
_UUID_NAMESPACE = uuid.UUID("6b1f3c2e-9a4d-5e8f-8c1b-2d7e4f6a9b30")
_STATE_VERSION = 1

FAULT_OPS = frozenset(
    {"gpus", "model", "instances", "create_instance", "create_compute_instance", "destroy_instance",
     "set_mig_mode"}
)


@dataclass
class _Instance:
    gi_id: int
    profile_id: int
    start: int
    size: int
    ci_id: int
    generation: int
    in_use: bool = False


@dataclass
class _Gpu:
    mig_enabled: bool
    instances: dict[int, _Instance] = field(default_factory=dict)
    # Counts creations on this GPU; part of each MIG UUID so a recreated instance gets a new one.
    generation: int = 0


def gpu_uuid(model_name: str, index: int) -> str:
    """The simulated GPU UUID of GPU ``index`` of ``model_name``; the same in every process."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{model_name}/{index}')}"


def mig_uuid(parent_uuid: str, gi_id: int, start: int, generation: int) -> str:
    """The simulated MIG device UUID of one creation of an instance."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{parent_uuid}/{gi_id}/{start}/{generation}')}"


def gpu_instance_id(model: GpuModel, start: int, size: int) -> int:
    """The hardware's GI id for a placement: spans are numbered largest first, then by start."""
    return (model.memory_slots // size - 1) + start // size


class SimulatedBackend:
    """``count`` GPUs of catalog model ``model_name`` with NVML's MIG semantics (see module doc)."""

    def __init__(
        self,
        model_name: str,
        count: int = 1,
        state_file: str | None = None,
        latency_s: float = 0.0,
        mig_enabled: bool = True,
    ) -> None:
        if count < 1:
            raise ValueError(f"GPU count {count} must be at least 1; e.g. 2")
        self._model = get_model(model_name)
        self._count = count
        self._state_file = state_file
        self._latency_s = latency_s
        self._lock = threading.RLock()
        self._faults: dict[str, list[list[str | int]]] = {}
        self._gpus = [_Gpu(mig_enabled=mig_enabled) for _ in range(count)]
        self._uuids = [gpu_uuid(model_name, i) for i in range(count)]
        if state_file is not None:
            # Read (and validate) now so a bad or foreign state file fails at start-up; write the
            # initial state when there is none. The read happens under the lock, so two processes
            # starting together do not overwrite each other's instances.
            with self._state(mutate=not os.path.exists(state_file)):
                pass

    # ---- test hooks ------------------------------------------------------------------------------

    def inject_fault(self, op: str, error_name: str, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` fail with NVML error ``error_name``.

        ``create_compute_instance`` fails the compute-instance step of ``create_instance`` after
        its GPU instance exists, to exercise the no-leak rollback.
        """
        if op not in FAULT_OPS:
            raise ValueError(f"unknown operation {op!r}; one of {', '.join(sorted(FAULT_OPS))}")
        if error_name not in NVML_ERROR_CODES:
            raise ValueError(f"unknown NVML error {error_name!r}; e.g. 'IN_USE'")
        with self._lock:
            self._faults.setdefault(op, []).append([error_name, times])

    def set_in_use(self, index: int, gi_id: int, in_use: bool) -> None:
        """Mark an instance as used by a process (or not), as if a CUDA program ran on it."""
        with self._state(mutate=True):
            gpu = self._gpu(index, "set_in_use")
            inst = self._find(gpu, index, gi_id, "set_in_use")
            inst.in_use = in_use

    # ---- GpuBackend ------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        with self._state(mutate=False):
            self._maybe_fail("gpus", "list GPUs")
            return [
                GpuInfo(
                    index=i,
                    uuid=self._uuids[i],
                    product=self._model.product,
                    memory_mib=self._model.memory_mib,
                    mig_capable=True,
                    mig_enabled=gpu.mig_enabled,
                )
                for i, gpu in enumerate(self._gpus)
            ]

    def model(self, index: int) -> GpuModel:
        # Profiles and placements answer with MIG disabled on real GPUs too (H200 capture).
        with self._lock:
            self._check_index(index, "read profiles")
            self._maybe_fail("model", f"read profiles of GPU {index}")
            return self._model

    def instances(self, index: int) -> list[MigInstance]:
        with self._state(mutate=False):
            gpu = self._gpu(index, "list instances")
            self._maybe_fail("instances", f"list instances on GPU {index}")
            self._require_mig(gpu, index, "list instances")
            ordered = sorted(gpu.instances.values(), key=lambda i: i.gi_id)
            return [self._record(index, inst) for inst in ordered]

    def create_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        op = f"create GPU instance (profile id {profile_id}, placement start {start}) on GPU {index}"
        with self._state(mutate=True):
            gpu = self._gpu(index, op)
            self._maybe_fail("create_instance", op)
            self._require_mig(gpu, index, op)
            profile = self._profile(profile_id, op)
            legal = {p.start for p in profile.placements}
            if start not in legal:
                raise GpuError(
                    "INVALID_ARGUMENT", f"{op}: start {start} is not a legal placement of {profile.name} "
                    f"(legal starts {sorted(legal)})"
                )
            self._check_room(gpu, profile, start, op)
            self._pause()
            gpu.generation += 1
            inst = _Instance(
                gi_id=gpu_instance_id(self._model, start, profile.size),
                profile_id=profile_id,
                start=start,
                size=profile.size,
                ci_id=0,
                generation=gpu.generation,
            )
            # The CI step can fail after the GI exists; NVML would leave the GI behind, the
            # contract is to destroy it, so a failure here simply never records the GI.
            self._maybe_fail("create_compute_instance", f"{op}: create compute instance")
            gpu.instances[inst.gi_id] = inst
            return self._record(index, inst)

    def destroy_instance(self, index: int, gi_id: int) -> None:
        op = f"destroy GPU instance {gi_id} on GPU {index}"
        with self._state(mutate=True):
            gpu = self._gpu(index, op)
            self._maybe_fail("destroy_instance", op)
            self._require_mig(gpu, index, op)
            inst = self._find(gpu, index, gi_id, op)
            if inst.in_use:
                raise GpuError(
                    "IN_USE", f"{op} (placement {inst.start}:{inst.size}): a process is running on it"
                )
            self._pause()
            del gpu.instances[gi_id]

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        op = f"set MIG mode {'on' if enabled else 'off'} on GPU {index}"
        with self._state(mutate=True):
            gpu = self._gpu(index, op)
            self._maybe_fail("set_mig_mode", op)
            if gpu.mig_enabled == enabled:
                return
            if not enabled and gpu.instances:
                # The driver refuses to leave MIG mode while instances exist (the GPU is not idle).
                raise GpuError("IN_USE", f"{op}: {len(gpu.instances)} GPU instance(s) still exist")
            self._pause()
            gpu.mig_enabled = enabled

    def close(self) -> None:
        # Nothing is held between calls: the state file is locked only inside each operation.
        return None

    # ---- internals -------------------------------------------------------------------------------

    def _record(self, index: int, inst: _Instance) -> MigInstance:
        return MigInstance(
            gpu_index=index,
            gi_id=inst.gi_id,
            ci_id=inst.ci_id,
            profile_id=inst.profile_id,
            profile=self._model.profile_by_id(inst.profile_id).name,
            start=inst.start,
            size=inst.size,
            device_uuid=mig_uuid(self._uuids[index], inst.gi_id, inst.start, inst.generation),
            in_use=inst.in_use,
        )

    def _check_index(self, index: int, op: str) -> None:
        if not 0 <= index < self._count:
            raise GpuError("INVALID_ARGUMENT", f"{op}: no GPU {index} (this node has {self._count})")

    def _gpu(self, index: int, op: str) -> _Gpu:
        self._check_index(index, op)
        return self._gpus[index]

    def _require_mig(self, gpu: _Gpu, index: int, op: str) -> None:
        if not gpu.mig_enabled:
            raise GpuError("NOT_SUPPORTED", f"{op}: MIG mode is disabled on GPU {index}")

    def _profile(self, profile_id: int, op: str) -> Profile:
        for profile in self._model.profiles:
            if profile.id == profile_id:
                return profile
        known = ", ".join(str(p.id) for p in self._model.profiles)
        raise GpuError(
            "INVALID_ARGUMENT", f"{op}: no profile id {profile_id} on {self._model.name} (known: {known})"
        )

    def _find(self, gpu: _Gpu, index: int, gi_id: int, op: str) -> _Instance:
        try:
            return gpu.instances[gi_id]
        except KeyError:
            raise GpuError("NOT_FOUND", f"{op}: GPU {index} has no GPU instance {gi_id}") from None

    def _check_room(self, gpu: _Gpu, profile: Profile, start: int, op: str) -> None:
        wanted = ((1 << profile.size) - 1) << start
        for other in gpu.instances.values():
            if ((1 << other.size) - 1) << other.start & wanted:
                raise GpuError(
                    "INSUFFICIENT_RESOURCES",
                    f"{op}: placement {start}:{profile.size} overlaps GPU instance {other.gi_id} "
                    f"at {other.start}:{other.size}",
                )
        same = sum(1 for other in gpu.instances.values() if other.profile_id == profile.id)
        if same >= profile.max_instances:
            raise GpuError(
                "INSUFFICIENT_RESOURCES",
                f"{op}: {profile.name} already has its maximum of {profile.max_instances} instance(s)",
            )
        # Compute slices are a budget of their own (7 on 8-slot boards); the memory geometry keeps
        # every catalog layout within it, but checking costs nothing and guards future catalogs.
        total = max(p.slices for p in self._model.profiles)
        used = sum(self._model.profile_by_id(o.profile_id).slices for o in gpu.instances.values())
        if used + profile.slices > total:
            raise GpuError(
                "INSUFFICIENT_RESOURCES", f"{op}: {used} of {total} compute slices in use, {profile.name} "
                f"needs {profile.slices}"
            )

    def _maybe_fail(self, op: str, message: str) -> None:
        with self._lock:
            queue = self._faults.get(op)
            if not queue:
                return
            entry = queue[0]
            name = str(entry[0])
            entry[1] = int(entry[1]) - 1
            if int(entry[1]) <= 0:
                queue.pop(0)
        raise GpuError(name, f"{message} (injected fault)")

    def _pause(self) -> None:
        # Mutations take time on real GPUs (GI destroy "may take O(1 s)", DRA nvlib.go).
        if self._latency_s > 0:
            time.sleep(self._latency_s)

    @contextlib.contextmanager
    def _state(self, mutate: bool) -> Iterator[None]:
        """Hold the state for one operation: thread lock, file lock, fresh read, write back on success."""
        with self._lock:
            if self._state_file is None:
                yield
                return
            lock_path = self._state_file + ".lock"
            with open(lock_path, "a") as lock_fd:
                fcntl.flock(lock_fd, fcntl.LOCK_EX if mutate else fcntl.LOCK_SH)
                try:
                    self._load()
                    yield
                    if mutate:
                        self._save()
                finally:
                    fcntl.flock(lock_fd, fcntl.LOCK_UN)

    def _load(self) -> None:
        assert self._state_file is not None
        try:
            with open(self._state_file) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise ValueError(f"simulator state file {self._state_file!r} is unreadable: {exc}") from None
        if data.get("model") != self._model.name or len(data.get("gpus", [])) != self._count:
            raise ValueError(
                f"simulator state file {self._state_file!r} holds {len(data.get('gpus', []))} GPU(s) of "
                f"{data.get('model')!r}, not {self._count} of {self._model.name!r}; use another file"
            )
        self._gpus = [
            _Gpu(
                mig_enabled=bool(g["mig_enabled"]),
                instances={int(i["gi_id"]): _Instance(**i) for i in g["instances"]},
                generation=int(g["generation"]),
            )
            for g in data["gpus"]
        ]

    def _save(self) -> None:
        assert self._state_file is not None
        data = {
            "version": _STATE_VERSION,
            "model": self._model.name,
            "gpus": [
                {
                    "mig_enabled": g.mig_enabled,
                    "generation": g.generation,
                    "instances": [asdict(i) for i in sorted(g.instances.values(), key=lambda i: i.gi_id)],
                }
                for g in self._gpus
            ],
        }
        directory = os.path.dirname(os.path.abspath(self._state_file))
        fd, tmp = tempfile.mkstemp(prefix=".simstate-", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._state_file)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
