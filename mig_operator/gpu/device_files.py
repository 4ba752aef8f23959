"""The NVIDIA device files a container needs for one GPU or MIG device, read as NVIDIA's tools read them.

- ``/dev/nvidia<minor>`` (the GPU), ``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``;
- for a MIG device also the GPU instance's and the compute instance's capability nodes
  ``/dev/nvidia-caps/nvidia-cap<minor>``, the minor read from ``DeviceFileMinor: N`` in
  ``/proc/driver/nvidia/capabilities/gpu<gpu minor>/mig/gi<G>/access`` and ``.../gi<G>/ci<C>/access``;
- the character-device majors from ``/proc/devices`` where it lists them (``nvidia-frontend`` or
  ``nvidia``, ``nvidia-uvm``, ``nvidia-caps``), so the CDI spec is complete on its own.

Every path is under ``root`` ("/" on a node; the simulator writes the same files under a root of its
own, ``write_simulated_files``, so the same reading code runs end to end without a GPU).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from mig_operator.core.node.cdi import DeviceNode
from mig_operator.core.requests.quantities import read_integer
from mig_operator.gpu.files import write_atomically

CAPABILITIES_DIR = "proc/driver/nvidia/capabilities"
PROC_DEVICES = "proc/devices"
FRONTEND_MAJOR = 195  # /dev/nvidia<N> and /dev/nvidiactl: fixed by the driver
CTL_MINOR = 255
UVM_MINOR, UVM_TOOLS_MINOR = 0, 1
_MINOR_LINE = re.compile(r"^DeviceFileMinor:\s*([0-9]{1,9})\s*$", re.MULTILINE)
_MAX_FILE_BYTES = 64 * 1024


class DeviceFileError(Exception):
    """A device file is missing or unreadable; the message names the file and what was expected."""


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(_MAX_FILE_BYTES).decode("ascii", errors="replace")
    except FileNotFoundError:
        raise DeviceFileError(f"{path} does not exist (is the NVIDIA driver loaded, and the instance there?)") \
            from None
    except OSError as exc:
        raise DeviceFileError(f"cannot read {path}: {exc.strerror or exc}") from None


def _under(root: str, relative: str) -> str:
    return os.path.join(root, relative)


def capability_path(root: str, gpu_minor: int, gi_id: int, ci_id: int | None = None) -> str:
    """The ``access`` file of a GPU instance (``ci_id`` None) or of one of its compute instances."""
    tail = f"gpu{gpu_minor}/mig/gi{gi_id}" + (f"/ci{ci_id}" if ci_id is not None else "") + "/access"
    return _under(root, f"{CAPABILITIES_DIR}/{tail}")


def read_device_file_minor(path: str) -> int:
    """The ``DeviceFileMinor`` of a capability ``access`` file, e.g. ``DeviceFileMinor: 12`` -> 12."""
    match = _MINOR_LINE.search(_read(path))
    if match is None:
        raise DeviceFileError(f"{path} has no 'DeviceFileMinor: N' line (e.g. 'DeviceFileMinor: 12')")
    return int(match[1])


def read_majors(root: str) -> dict[str, int]:
    """Character-device majors by name from ``/proc/devices``; empty when the file is absent."""
    try:
        text = _read(_under(root, PROC_DEVICES))
    except DeviceFileError:
        return {}
    majors: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        if line.endswith(":"):
            section = line
            continue
        parts = line.split()
        major = read_integer(parts[0]) if len(parts) == 2 else None
        if section.startswith("Character") and major is not None:
            majors.setdefault(parts[1], major)
    return majors


def device_nodes(root: str, gpu_minor: int, gi_id: int | None = None, ci_id: int | None = None) -> list[DeviceNode]:
    """The device nodes of a whole GPU (``gi_id`` None) or of one MIG device on it.

    Raises DeviceFileError when a MIG instance's capability file is missing or bad: handing over the
    GPU without them would give the container no MIG device at all.
    """
    if gpu_minor < 0:
        raise DeviceFileError(f"GPU minor {gpu_minor} is not a device minor (e.g. 0 for /dev/nvidia0)")
    majors = read_majors(root)
    frontend = majors.get("nvidia-frontend", majors.get("nvidia", FRONTEND_MAJOR))
    uvm, caps = majors.get("nvidia-uvm"), majors.get("nvidia-caps")
    nodes = [
        DeviceNode("/dev/nvidiactl", frontend, CTL_MINOR),
        DeviceNode("/dev/nvidia-uvm", uvm, UVM_MINOR if uvm is not None else None),
        DeviceNode("/dev/nvidia-uvm-tools", uvm, UVM_TOOLS_MINOR if uvm is not None else None),
        DeviceNode(f"/dev/nvidia{gpu_minor}", frontend, gpu_minor),
    ]
    if gi_id is not None:
        if ci_id is None or ci_id < 0:
            raise DeviceFileError(f"GPU instance {gi_id} on GPU minor {gpu_minor} has no compute instance")
        for path in (capability_path(root, gpu_minor, gi_id), capability_path(root, gpu_minor, gi_id, ci_id)):
            minor = read_device_file_minor(path)
            nodes.append(DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minor}", caps, minor if caps is not None else None))
    return nodes


# ---- the simulator's files --------------------------------------------------------------------------

# The driver's numbering of MIG capability minors (/proc/driver/nvidia-caps/mig-minors): 1 config,
# 2 monitor, then per GPU 15 GPU instances of 1 + 8 compute-instance minors each.
_MINORS_PER_GI = 9
_GIS_PER_GPU = 15
SIMULATED_MAJORS = {"nvidia-frontend": FRONTEND_MAJOR, "nvidia-uvm": 509, "nvidia-caps": 510}


def simulated_cap_minor(gpu_minor: int, gi_id: int, ci_id: int | None = None) -> int:
    base = 3 + gpu_minor * _GIS_PER_GPU * _MINORS_PER_GI + gi_id * _MINORS_PER_GI
    return base if ci_id is None else base + 1 + ci_id


def _write_atomically(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomically(path, text, durable=False)


def write_simulated_files(root: str, gpu_minors: Iterable[int], instances: Iterable[tuple[int, int, int]]) -> None:
    """Lay out ``/proc/devices`` and the MIG capability files of ``instances`` ((gpu minor, GI, CI);
    CI -1 for a GPU instance without one) under ``root``, as the driver shows them; files of
    instances that are gone are removed."""
    devices = "Character devices:\n" + "".join(f"{major} {name}\n" for name, major in SIMULATED_MAJORS.items())
    _write_atomically(_under(root, PROC_DEVICES), devices)
    wanted: set[str] = set()
    for gpu_minor in gpu_minors:
        os.makedirs(_under(root, f"{CAPABILITIES_DIR}/gpu{gpu_minor}/mig"), exist_ok=True)
    for gpu_minor, gi_id, ci_id in instances:
        keys: list[int | None] = [None] + ([ci_id] if ci_id >= 0 else [])
        for key in keys:
            path = capability_path(root, gpu_minor, gi_id, key)
            wanted.add(path)
            text = f"DeviceFileMinor: {simulated_cap_minor(gpu_minor, gi_id, key)}\nDeviceFileMode: 292\n" \
                   "DeviceFileModify: 1\n"
            _write_atomically(path, text)
    caps = _under(root, CAPABILITIES_DIR)
    for directory, _dirs, files in os.walk(caps):
        for name in files:
            path = os.path.join(directory, name)
            if name == "access" and path not in wanted:
                os.unlink(path)
