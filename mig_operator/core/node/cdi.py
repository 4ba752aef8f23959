"""The CDI spec that hands one slice's device to a container (docs/architecture.md, section 9).

The kubelet passes the CDI device ID this spec defines (``gpu.cdmo.io/slice=<slice UID>``) to the
container runtime, which applies the spec's edits: the device nodes of the GPU (and, for MIG, the
GPU and compute instance's ``nvidia-caps`` nodes), ``NVIDIA_VISIBLE_DEVICES=void`` so that no
runtime hook widens the set, the slice's variables (for display), and for fractions the shim
mounted read-only, the slice's ledger directory mounted read-write at the one path the shim knows,
so that every process of every pod of the claim shares one limit, and the slice's limit file and an
``/etc/ld.so.preload`` naming the shim, both read-only from the slice's own directory on the node
(``limit_dir``, its files ``environment.shim_files``): every dynamically linked process of the
container loads the shim and reads that limit whatever its environment says. A fraction with a
compute share also mounts its GPU's MPS pipe and shm directories and gets its MPS limits
(``environment``). Pure: the caller reads the device numbers, makes the ledger and limit directories
and writes the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..placement.cluster import MODE_FRACTION, MODE_MIG
from ..requests.quantities import read_integer
from .environment import (
    DEVICES_VARIABLE,
    LEDGER_PATH_IN_CONTAINER,
    LIMIT_FILE,
    LIMIT_PATH_IN_CONTAINER,
    MPS_PIPE_IN_CONTAINER,
    MPS_SHM_IN_CONTAINER,
    PRELOAD_FILE,
    PRELOAD_PATH_IN_CONTAINER,
    SHIM_PATH_IN_CONTAINER,
    slice_environment,
)

DRIVER = "gpu.cdmo.io"
CDI_KIND = f"{DRIVER}/slice"
NVIDIA_CDI_KIND = "nvidia.com/gpu"  # the NVIDIA Container Toolkit's spec (nvidia-ctk cdi generate)
SHIM_FILE = "libgpuslice.so"
DEFAULT_LEDGER_HOST_DIR = "/var/lib/mig-operator/ledgers"
DEFAULT_LIMITS_HOST_DIR = "/var/lib/mig-operator/limits"
# Read-only, and nothing in them runs or is a device.
_READ_ONLY = ["ro", "nosuid", "nodev", "noexec", "bind"]
# Device names starting with a digit need CDI 0.5.0 (a UID may start with one); nothing else here
# needs more than 0.3.0. The lowest version the fields need keeps older runtimes able to read it.
CDI_BASE_VERSION = "0.3.0"
CDI_DIGIT_NAME_VERSION = "0.5.0"
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class DeviceNode:
    """A device node the container gets at ``path``. ``major``/``minor`` (a character device) are given
    where the node's driver numbers are known, so the spec is complete even where the node's file is
    absent (the simulator); None leaves them to the runtime, which reads them from the host's file."""

    path: str
    major: int | None = None
    minor: int | None = None


@dataclass(frozen=True)
class SliceDevice:
    """What the CDI spec of one slice needs to know."""

    slice_uid: str
    namespace: str
    name: str
    mode: str  # MODE_MIG or MODE_FRACTION
    device_uuid: str  # MIG-... or GPU-...
    granted_bytes: int
    device_nodes: tuple[DeviceNode, ...]
    shim_host_dir: str = "/var/lib/mig-operator/shim"
    # Where the node keeps one ledger directory per slice (ledger_dir)
    ledger_host_dir: str = DEFAULT_LEDGER_HOST_DIR
    # Where the node keeps one directory per slice holding its limit and ld.so.preload (limit_dir)
    limits_host_dir: str = DEFAULT_LIMITS_HOST_DIR
    # A fraction that is all of its GPU (fraction 1: a whole GPU without MIG, nothing else on it):
    # nothing to limit, so no shim.
    whole_gpu: bool = False
    # A compute share in (0, 1] (None: shared, time-sliced): the slice is a client of its GPU's MPS
    # control daemon, whose pipe and shm directories on the node (gpu.mps.mps_dirs) it mounts.
    compute: float | None = None
    mps_pipe_dir: str = ""
    mps_shm_dir: str = ""


def _slice_dir(host_dir: str, slice_uid: str) -> str:
    if _DEVICE_NAME.fullmatch(slice_uid) is None or slice_uid in (".", ".."):
        raise ValueError(f"slice UID {slice_uid!r} is not a directory name; e.g. "
                         "'4f9c1e2a-0b7d-4c55-9a7e-2f1d3c4b5a6e'")
    return f"{host_dir.rstrip('/')}/{slice_uid}"


def ledger_dir(ledger_host_dir: str, slice_uid: str) -> str:
    """The node's ledger directory of one slice: made at prepare, mounted into each of its containers,
    removed at unprepare. Raises ValueError for a UID that is not a single path component."""
    return _slice_dir(ledger_host_dir, slice_uid)


def limit_dir(limits_host_dir: str, slice_uid: str) -> str:
    """The node's directory of one slice's limit file and ld.so.preload (``environment.shim_files``):
    written at prepare, each file mounted read-only into each of its containers, removed at unprepare.
    Apart from the ledger's, which containers may write. Raises ValueError as ``ledger_dir``."""
    return _slice_dir(limits_host_dir, slice_uid)


def device_id(slice_uid: str) -> str:
    """The fully qualified CDI device ID of a slice: ``gpu.cdmo.io/slice=<uid>``."""
    return f"{CDI_KIND}={slice_uid}"


def nvidia_device_id(device_uuid: str) -> str:
    """The NVIDIA toolkit's CDI device ID for the same GPU or MIG device (its specs name them by UUID)."""
    return f"{NVIDIA_CDI_KIND}={device_uuid}"


def spec_file_name(slice_uid: str) -> str:
    """The spec's file name in the CDI directory: vendor and class first, as CDI tools name them."""
    return f"{DRIVER}-slice_{slice_uid}.json"


def cdi_version(device_name: str) -> str:
    return CDI_DIGIT_NAME_VERSION if read_integer(device_name[:1]) is not None else CDI_BASE_VERSION


def _device_node(node: DeviceNode) -> dict[str, Any]:
    body: dict[str, Any] = {"path": node.path}
    if node.major is not None and node.minor is not None:
        body.update(type="c", major=node.major, minor=node.minor)
    return body


def slice_spec(device: SliceDevice) -> dict[str, Any]:
    """The CDI spec (as JSON-ready data) defining one device, named by the slice's UID.

    Raises ValueError for a name CDI cannot carry, a mode other than mig/fraction, or no device nodes.
    """
    if _DEVICE_NAME.fullmatch(device.slice_uid) is None:
        raise ValueError(f"slice UID {device.slice_uid!r} is not a CDI device name; e.g. "
                         "'4f9c1e2a-0b7d-4c55-9a7e-2f1d3c4b5a6e'")
    if device.mode not in (MODE_MIG, MODE_FRACTION):
        raise ValueError(f"mode {device.mode!r} is not 'mig' or 'fraction'")
    if not device.device_nodes:
        raise ValueError(f"slice {device.namespace}/{device.name} has no device nodes to hand over")
    mps = device.compute is not None
    if mps and (device.mode != MODE_FRACTION or not device.mps_pipe_dir or not device.mps_shm_dir):
        raise ValueError(f"slice {device.namespace}/{device.name} has compute {device.compute!r}: only a "
                         "fraction has a share, and its MPS pipe and shm directories must be given")
    shim_dir = SHIM_PATH_IN_CONTAINER.rsplit("/", 1)[0]
    env = slice_environment(device.mode, device.granted_bytes, device.namespace, device.name,
                            whole_gpu=device.whole_gpu, compute=device.compute)
    # NVIDIA_VISIBLE_DEVICES first (what a reader looks for), then the rest in name order.
    order = sorted(env, key=lambda key: (key != DEVICES_VARIABLE, key))
    variables = [f"{key}={env[key]}" for key in order]
    edits: dict[str, Any] = {
        "env": variables,
        "deviceNodes": [_device_node(node) for node in device.device_nodes],
    }
    mounts: list[dict[str, Any]] = []
    if device.mode == MODE_FRACTION and not device.whole_gpu:
        limits = limit_dir(device.limits_host_dir, device.slice_uid)
        mounts += [{
            "hostPath": f"{device.shim_host_dir.rstrip('/')}/{SHIM_FILE}",
            "containerPath": f"{shim_dir}/{SHIM_FILE}",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }, {
            "hostPath": ledger_dir(device.ledger_host_dir, device.slice_uid),
            "containerPath": LEDGER_PATH_IN_CONTAINER,
            "options": ["rw", "nosuid", "nodev", "noexec", "bind"],
        }, {
            "hostPath": f"{limits}/{LIMIT_FILE}",
            "containerPath": LIMIT_PATH_IN_CONTAINER,
            "options": list(_READ_ONLY),
        }, {
            "hostPath": f"{limits}/{PRELOAD_FILE}",
            "containerPath": PRELOAD_PATH_IN_CONTAINER,
            "options": list(_READ_ONLY),
        }]
    if mps:
        # What NVIDIA's DRA driver mounts into an MPS client: the daemon's pipe directory, and its shm
        # at /dev/shm (the daemon's own /dev/shm: gpu/mps.py), where server and clients share memory.
        mounts += [{
            "hostPath": device.mps_pipe_dir,
            "containerPath": MPS_PIPE_IN_CONTAINER,
            "options": ["rw", "nosuid", "nodev", "noexec", "bind"],
        }, {
            "hostPath": device.mps_shm_dir,
            "containerPath": MPS_SHM_IN_CONTAINER,
            "options": ["rw", "nosuid", "nodev", "noexec", "bind"],
        }]
    if mounts:
        edits["mounts"] = mounts
    return {
        "cdiVersion": cdi_version(device.slice_uid),
        "kind": CDI_KIND,
        "devices": [{"name": device.slice_uid, "containerEdits": edits}],
    }


def names_device(spec: Any, kind: str, name: str) -> bool:
    """Whether a parsed CDI spec (of any vendor) defines device ``name`` of ``kind``."""
    if not isinstance(spec, dict) or spec.get("kind") != kind:
        return False
    devices = spec.get("devices")
    return isinstance(devices, list) and any(isinstance(d, dict) and d.get("name") == name for d in devices)
