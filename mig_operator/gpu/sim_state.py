"""The simulator's state: its instances and GPUs, and the state file that keeps them across processes.

The file is JSON, read whole (at most 16 MiB) and checked field by field: a file that is not this
simulator's state gives a one-line GpuError naming the file and what is wrong, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from mig_operator.core.placement.profiles import CatalogError, GpuModel
from mig_operator.core.requests.quantities import clip_repr
from mig_operator.gpu.files import write_atomically
from mig_operator.gpu.protocol import NVML_ERROR_CODES, GpuError

STATE_VERSION = 1
# A state file is a few KiB; anything this large is not one (and is not read into memory whole).
_MAX_STATE_BYTES = 16 * 2**20

FAULT_OPS = frozenset(
    {"gpus", "model", "instances", "create_instance", "create_compute_instance", "destroy_instance",
     "destroy_gpu_instance", "set_mig_mode"}
)
# Operations that change the GPU and so take time on hardware; the latency applies to these.
LATENCY_OPS = ("create_instance", "create_compute_instance", "destroy_instance", "set_mig_mode")
MAX_LATENCY_S = 600.0
_INSTANCE_FIELDS = ("gi_id", "profile_id", "start", "size", "ci_id", "generation", "in_use")
# Bounds of a device's usage entry: a node has a few dozen devices, a device a few hundred processes.
MAX_USAGE_DEVICES = 4096
MAX_USAGE_PIDS = 1024
_MAX_UUID_CHARS = 64
_MAX_BYTES = 2**63 - 1


@dataclass
class SimInstance:
    gi_id: int
    profile_id: int
    start: int
    size: int
    ci_id: int  # 0: the full compute instance; -1: none (a half-made GPU instance)
    generation: int
    in_use: bool = False


@dataclass
class SimGpu:
    mig_enabled: bool
    instances: dict[int, SimInstance] = field(default_factory=dict)
    # Counts creations on this GPU; part of each MIG UUID so a recreated instance gets a new one.
    generation: int = 0
    xid: int = 0  # the critical Xid reported since the last reset; 0: none
    lost: bool = False  # fallen off the bus: NVML would answer GPU_IS_LOST


@dataclass
class SimUsage:
    """What a simulated device is used for, as a test set it (``SimulatedBackend.set_usage``)."""

    memory_used: int  # bytes
    pids: list[int]
    active_percent: int | None  # None: not available, as NVML says of MIG devices


class StateCorrupt(Exception):
    """A state file whose content is not this simulator's state; the message says what is wrong."""

Faults = dict[str, list[list[Any]]]  # operation -> [[NVML error name, times left], ...]
Usage = dict[str, SimUsage]  # device UUID ("GPU-..." or "MIG-...") -> its usage
# GPUs, faults, latencies, the simulated machine's boot id ("": the host's), and devices' usage.
State = tuple[list[SimGpu], Faults, dict[str, float], str, Usage]


def gpu_instance_id(model: GpuModel, start: int, size: int) -> int:
    """The hardware's GI id for a placement: spans are numbered largest first, then by start."""
    return (model.memory_slots // size - 1) + start // size


def latency_table(latency_s: float | Mapping[str, float]) -> dict[str, float]:
    """Seconds per mutating operation: one number for all of them, or a mapping for some.

    Raises ValueError naming the bad value; negative, non-finite and above ``MAX_LATENCY_S`` are refused.
    """
    if isinstance(latency_s, Mapping):
        items = list(latency_s.items())
    else:
        items = [(op, latency_s) for op in LATENCY_OPS]
    table: dict[str, float] = {}
    for op, seconds in items:
        if op not in LATENCY_OPS:
            raise ValueError(f"latency for {clip_repr(op)}: not one of {', '.join(LATENCY_OPS)}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or not 0 <= seconds <= MAX_LATENCY_S:
            raise ValueError(
                f"simulator latency {clip_repr(seconds)} must be a number of seconds from 0 to "
                f"{MAX_LATENCY_S:g}; e.g. 1.5"
            )
        if seconds > 0:
            table[op] = float(seconds)
    return table


def file_error(path: str, exc: OSError) -> GpuError:
    name = "NO_PERMISSION" if isinstance(exc, PermissionError) else "UNKNOWN"
    return GpuError(name, f"simulator state file {clip_repr(path)}: {exc.strerror or exc}")

def _corrupt(path: str, reason: str) -> GpuError:
    return GpuError(
        "UNKNOWN",
        f"simulator state file {clip_repr(path)} is not usable: {reason}; "
        "move it aside or use another state file",
    )

def read_state(path: str) -> bytes | None:
    """The state file's bytes (at most one more than the limit); None when there is no file."""
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None


def parse_state(raw: bytes, path: str, model: GpuModel, count: int) -> State | None:
    """The state ``raw`` (read from ``path``) holds, checked; None when there is no state yet (an empty
    file, made by `touch`, is a fresh simulator)."""
    if not raw:
        return None
    if len(raw) > _MAX_STATE_BYTES:
        raise _corrupt(path, f"larger than {_MAX_STATE_BYTES // 2**20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _corrupt(path, "not UTF-8 text") from None
    except RecursionError:
        raise _corrupt(path, "JSON nested too deeply") from None
    except ValueError as exc:
        # JSONDecodeError, or an integer beyond Python's 4300-digit limit.
        detail = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "a number too long"
        raise _corrupt(path, f"not JSON ({detail})") from None
    try:
        return _decode(data, model, count, path)
    except StateCorrupt as exc:
        raise _corrupt(path, str(exc)) from None

def _decode(data: object, model: GpuModel, count: int, path: str) -> State:
    """The state a file holds, checked field by field; raises StateCorrupt (or GpuError for a file of
    another model or GPU count)."""
    _need(isinstance(data, dict), "the top level is not a JSON object")
    assert isinstance(data, dict)
    version = data.get("version")
    _need(version == STATE_VERSION, f"'version' is {clip_repr(version)}, not {STATE_VERSION}")
    model_name, gpus = data.get("model"), data.get("gpus")
    _need(isinstance(model_name, str), "'model' is not a string")
    _need(isinstance(gpus, list), "'gpus' is not a list")
    assert isinstance(gpus, list)
    if model_name != model.name or len(gpus) != count:
        raise GpuError(
            "INVALID_ARGUMENT",
            f"simulator state file {clip_repr(path)} holds {len(gpus)} GPU(s) of "
            f"{clip_repr(model_name)}, not {count} of {model.name!r}; use another file",
        )
    decoded = [_decode_gpu(i, g, model) for i, g in enumerate(gpus)]
    faults = data.get("faults", {})
    _need(isinstance(faults, dict), "'faults' is not an object")
    checked: dict[str, list[list[Any]]] = {}
    for op, queue in faults.items():
        _need(op in FAULT_OPS, f"faults: unknown operation {clip_repr(op)}")
        _need(isinstance(queue, list), f"faults.{op} is not a list")
        for entry in queue:
            _need(isinstance(entry, list) and len(entry) == 2 and entry[0] in NVML_ERROR_CODES
                  and is_int(entry[1]) and entry[1] >= 1,
                  f"faults.{op}: {clip_repr(entry)} is not [NVML error name, count >= 1]")
        if queue:
            checked[op] = [list(entry) for entry in queue]
    latency = data.get("latency_s", {})
    _need(isinstance(latency, dict), "'latency_s' is not an object")
    try:
        table = latency_table(latency)
    except ValueError as exc:
        raise StateCorrupt(f"latency_s: {exc}") from None
    boot = data.get("bootId", "")
    _need(isinstance(boot, str) and len(boot) <= 64, "'bootId' is not a string of at most 64 characters")
    return decoded, checked, table, boot, _decode_usage(data.get("usage", {}))


def _decode_usage(raw: object) -> Usage:
    _need(isinstance(raw, dict), "'usage' is not an object")
    assert isinstance(raw, dict)
    _need(len(raw) <= MAX_USAGE_DEVICES, f"'usage' holds more than {MAX_USAGE_DEVICES} devices")
    usage: Usage = {}
    for device, entry in raw.items():
        _need(device_uuid_shape(device), f"usage: {clip_repr(device)} is not a GPU-... or MIG-... UUID")
        at = f"usage[{device}]"
        _need(isinstance(entry, dict) and set(entry) == {"memoryUsed", "pids", "activePercent"},
              f"{at} does not have exactly the fields memoryUsed, pids, activePercent")
        assert isinstance(entry, dict)
        try:
            usage[device] = usage_entry(entry["memoryUsed"], entry["pids"], entry["activePercent"],
                                        mig=device.startswith("MIG-"))
        except ValueError as exc:
            raise StateCorrupt(f"{at}: {exc}") from None
    return usage


def device_uuid_shape(device: object) -> bool:
    """Whether ``device`` looks like a device UUID NVML gives ("GPU-..." or "MIG-...")."""
    return isinstance(device, str) and 4 < len(device) <= _MAX_UUID_CHARS and device[:4] in ("GPU-", "MIG-")


def usage_entry(memory_used: object, pids: object, active_percent: object, mig: bool) -> SimUsage:
    """A device's usage, checked; ValueError names what is wrong. A MIG device has no activity figure
    (``mig``), as NVML keeps none for one."""
    if not (is_int(memory_used) and 0 <= memory_used <= _MAX_BYTES):
        raise ValueError(f"memory used {clip_repr(memory_used)} is not a number of bytes; e.g. 3221225472")
    if not isinstance(pids, (list, tuple)) or len(pids) > MAX_USAGE_PIDS \
            or not all(is_int(p) and 0 < p < 2**32 for p in pids):
        raise ValueError(f"pids {clip_repr(pids)} is not a list of at most {MAX_USAGE_PIDS} process ids; e.g. [4242]")
    if not (active_percent is None or (is_int(active_percent) and 0 <= active_percent <= 100)):
        raise ValueError(f"active percent {clip_repr(active_percent)} is not 0-100 or null; e.g. 37")
    if mig and active_percent is not None:
        raise ValueError("active percent must be null for a MIG device: NVML gives none")
    return SimUsage(memory_used=memory_used, pids=sorted(set(pids)), active_percent=active_percent)

def _decode_gpu(i: int, g: object, model: GpuModel) -> SimGpu:
    where = f"gpus[{i}]"
    _need(isinstance(g, dict), f"{where} is not an object")
    assert isinstance(g, dict)
    enabled, generation, raw_instances = g.get("mig_enabled"), g.get("generation"), g.get("instances")
    _need(isinstance(enabled, bool), f"{where}.mig_enabled is not true or false")
    _need(is_int(generation) and generation >= 0, f"{where}.generation is not a count")
    _need(isinstance(raw_instances, list), f"{where}.instances is not a list")
    assert isinstance(raw_instances, list) and isinstance(generation, int)
    xid, lost = g.get("xid", 0), g.get("lost", False)
    _need(is_int(xid) and xid >= 0, f"{where}.xid is not an Xid number")
    _need(isinstance(lost, bool), f"{where}.lost is not true or false")
    assert isinstance(xid, int)
    _need(model.mig_capable or (not enabled and not raw_instances),
          f"{where} has MIG state, but {model.name} has no MIG")
    instances: dict[int, SimInstance] = {}
    for j, raw in enumerate(raw_instances):
        at = f"{where}.instances[{j}]"
        _need(isinstance(raw, dict) and set(raw) == set(_INSTANCE_FIELDS),
              f"{at} does not have exactly the fields {', '.join(_INSTANCE_FIELDS)}")
        assert isinstance(raw, dict)
        _need(all(is_int(raw[k]) for k in _INSTANCE_FIELDS if k != "in_use") and isinstance(raw["in_use"], bool),
              f"{at} has a field of the wrong type")
        inst = SimInstance(**raw)
        try:
            profile = model.profile_by_id(inst.profile_id)
        except CatalogError:
            raise StateCorrupt(f"{at}: no profile id {inst.profile_id} on {model.name}") from None
        _need(inst.start in {p.start for p in profile.placements} and inst.size == profile.size,
              f"{at}: {inst.start}:{inst.size} is not a placement of {profile.name}")
        _need(inst.gi_id == gpu_instance_id(model, inst.start, inst.size),
              f"{at}: GPU instance id {inst.gi_id} does not belong to placement {inst.start}:{inst.size}")
        _need(inst.ci_id in (0, -1), f"{at}: compute instance id {inst.ci_id} is not 0 or -1")
        _need(not (inst.in_use and inst.ci_id < 0), f"{at} is in use without a compute instance")
        _need(0 <= inst.generation <= generation, f"{at}: generation {inst.generation} is out of range")
        mask = ((1 << inst.size) - 1) << inst.start
        for other in instances.values():
            _need(not ((1 << other.size) - 1) << other.start & mask,
                  f"{at} overlaps GPU instance {other.gi_id}")
        instances[inst.gi_id] = inst
    return SimGpu(mig_enabled=enabled, instances=instances, generation=generation, xid=xid, lost=lost)

def snapshot(model: GpuModel, gpus: list[SimGpu], faults: Faults, latency: dict[str, float],
             boot: str = "", usage: Usage | None = None) -> dict[str, Any]:
    """The state as the file holds it, sharing nothing mutable with the state. The dicts are built
    here, fields in ``_INSTANCE_FIELDS`` order, as ``asdict`` would at several times the cost."""
    return {
        "version": STATE_VERSION,
        "model": model.name,
        "gpus": [
            {
                "mig_enabled": g.mig_enabled,
                "generation": g.generation,
                "instances": [
                    {"gi_id": i.gi_id, "profile_id": i.profile_id, "start": i.start, "size": i.size,
                     "ci_id": i.ci_id, "generation": i.generation, "in_use": i.in_use}
                    for i in sorted(g.instances.values(), key=lambda i: i.gi_id)
                ],
                **({"xid": g.xid} if g.xid else {}),
                **({"lost": True} if g.lost else {}),
            }
            for g in gpus
        ],
        "faults": {op: [list(entry) for entry in queue] for op, queue in sorted(faults.items()) if queue},
        "latency_s": dict(sorted(latency.items())),
        **({"bootId": boot} if boot else {}),
        **({"usage": {device: {"memoryUsed": u.memory_used, "pids": list(u.pids), "activePercent": u.active_percent}
                      for device, u in sorted(usage.items())}} if usage else {}),
    }


def save_state(path: str, data: dict[str, Any]) -> bytes:
    """Write ``data`` (a ``snapshot``) to the state file; the bytes written."""
    content = json.dumps(data, indent=1).encode("utf-8")
    # Not fsync'd: the file stands in for a GPU's MIG state, which a reboot loses on hardware too,
    # and a process crash keeps the page cache, where the rename is already atomic.
    write_atomically(path, content, prefix=".simstate-", durable=False)
    return content


def _need(condition: bool, reason: str) -> None:
    if not condition:
        raise StateCorrupt(reason)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_state_path(path: str) -> None:
    """Refuse, before anything is created, a state file the simulator cannot keep (ValueError)."""
    shown = clip_repr(path)
    example = "e.g. --state-file /tmp/mig-sim.json"
    if not isinstance(path, str) or not path:
        raise ValueError(f"simulator state file {shown} is not a path; {example}")
    for candidate in (path, path + ".lock"):
        # /dev/null, a directory, a FIFO: nothing may be created beside it, nor written through it.
        if os.path.lexists(candidate) and not os.path.isfile(candidate):
            raise ValueError(
                f"simulator state file {clip_repr(candidate)} exists and is not a regular file; {example}"
            )
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"simulator state file {shown}: directory {clip_repr(directory)} does not exist; {example}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"simulator state file {shown}: directory {clip_repr(directory)} is not writable; {example}")
