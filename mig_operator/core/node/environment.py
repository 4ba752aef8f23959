"""The environment a sliced container gets (docs/architecture.md, section 9), as one pure function.

The agent's CDI spec (core/node/cdi.py) gives it to the container; the real-GPU test starts processes
with exactly what that spec gives. The device itself reaches the container only as the spec's device
nodes: ``NVIDIA_VISIBLE_DEVICES=void`` tells the NVIDIA runtime hook to add none. A fraction's limit
is shown in variables, but the shim takes nothing from the environment: it is loaded through a
read-only ``/etc/ld.so.preload`` and reads its limit from a read-only file beside its ledger, both
mounted by the CDI spec (``shim_files``), so no process of the container unloads it or lifts its
limit by changing its environment. A fraction with a compute share is also an MPS client: the pipe
directory, its active-thread percentage and its pinned device memory limit.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..placement.cluster import MODE_FRACTION, MODE_MIG

SHIM_PATH_IN_CONTAINER = "/usr/local/lib/cdmo/libgpuslice.so"
# The slice's ledger (the shim's shared accounting): the claim's own directory on the node, mounted
# here by the CDI spec. The shim has this path built in; no variable names another.
LEDGER_PATH_IN_CONTAINER = "/run/cdmo/ledger"
# The slice's limit, beside the ledger: the shim has this path built in (GS_LIMIT_FILE) and reads
# the limit from it, never from a variable.
LIMIT_PATH_IN_CONTAINER = "/run/cdmo/limit"
# glibc's dynamic loader preloads what this file names into every dynamically linked process,
# whatever LD_PRELOAD says (setuid programs included).
PRELOAD_PATH_IN_CONTAINER = "/etc/ld.so.preload"
# The files a fraction's CDI spec mounts read-only, by their names in the node's per-slice directory.
LIMIT_FILE = "limit"
PRELOAD_FILE = "ld.so.preload"
DEVICES_VARIABLE = "NVIDIA_VISIBLE_DEVICES"
# The value the NVIDIA runtime hook reads as "no devices": the CDI edits alone decide what is visible.
NO_DEVICES = "void"
PRELOAD_VARIABLE = "LD_PRELOAD"
LIMIT_VARIABLE = "CDMO_GPU_MEMORY_LIMIT"  # for display: the shim reads LIMIT_PATH_IN_CONTAINER
LIMIT_GB_VARIABLE = "GPU_MEM_LIMIT_GB"  # informational, as in ClearML's containers
SLICE_VARIABLE = "CDMO_SLICE"
# A fraction with a compute share is an MPS client of its GPU's control daemon (gpu/mps.py). The pipe
# directory is mounted at MPS's own default, so a client that drops the variable still finds it.
MPS_PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
MPS_SHM_IN_CONTAINER = "/dev/shm"
MPS_PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREADS_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PINNED_VARIABLE = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def gpu_mem_limit_gb(granted_bytes: int) -> str:
    """GPU_MEM_LIMIT_GB as ClearML's fractional containers show it: decimal GB, two places at most."""
    return f"{granted_bytes / 10**9:.2f}".rstrip("0").rstrip(".")


def thread_percentage(compute: float) -> int:
    """MPS's active-thread percentage of a compute share: the nearest whole percent, at least 1."""
    if not 0 < compute <= 1:
        raise ValueError(f"compute {compute!r} is not in (0, 1]; e.g. 0.25")
    return max(1, min(100, round(compute * 100)))


def mps_ceilings(shares: Iterable[tuple[str, float, int]]) -> dict[str, tuple[int, int]]:
    """What each GPU's MPS daemon must hold, from its compute shares (GPU UUID, share, granted bytes):
    GPU UUID -> (the largest thread percentage, the largest granted bytes). MPS limits a daemon or a
    server, not a client, so the daemon holds the loosest of its slices' limits and each client's own
    comes from its CDI spec."""
    ceilings: dict[str, tuple[int, int]] = {}
    for gpu_uuid, compute, granted_bytes in shares:
        pct, size = ceilings.get(gpu_uuid, (0, 0))
        ceilings[gpu_uuid] = (max(pct, thread_percentage(compute)), max(size, granted_bytes))
    return ceilings


def pinned_limit(granted_bytes: int) -> str:
    """MPS's pinned device memory limit of a slice's only device (ordinal 0 in its container), in
    whole MiB rounded down (MPS reads ``M`` as MiB): never more than the slice was granted."""
    return f"0={max(1, granted_bytes >> 20)}M"


def mps_environment(compute: float, granted_bytes: int) -> dict[str, str]:
    """What an MPS client of a slice with a compute share gets beside the slice's variables."""
    return {MPS_PIPE_VARIABLE: MPS_PIPE_IN_CONTAINER, MPS_THREADS_VARIABLE: str(thread_percentage(compute)),
            MPS_PINNED_VARIABLE: pinned_limit(granted_bytes)}


def shim_files(granted_bytes: int, shim_path: str = SHIM_PATH_IN_CONTAINER) -> dict[str, str]:
    """What the node writes for a limited fraction, by file name: its limit (a plain decimal byte count
    and a newline, as the shim reads it) and the ``/etc/ld.so.preload`` line naming the shim. Raises
    ValueError for a limit the shim would refuse (below 1 byte or beyond 64 bits)."""
    if not 1 <= granted_bytes < 2**64:
        raise ValueError(f"granted bytes {granted_bytes!r} are not a limit the shim takes; e.g. 4294967296")
    return {LIMIT_FILE: f"{granted_bytes}\n", PRELOAD_FILE: f"{shim_path}\n"}


def slice_environment(mode: str, granted_bytes: int, namespace: str, name: str,
                      whole_gpu: bool = False, compute: float | None = None) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES=void`` always; in fraction mode also ``CDMO_GPU_MEMORY_LIMIT`` (bytes),
    ``GPU_MEM_LIMIT_GB`` and ``CDMO_SLICE``, all for display (the shim reads its limit from the file the
    CDI spec mounts, and its ledger is a mount), except for a fraction that is its whole GPU
    (``whole_gpu``), which has nothing to limit. A fraction with a ``compute`` share also gets
    ``mps_environment``."""
    if mode == MODE_MIG:
        return {DEVICES_VARIABLE: NO_DEVICES}
    if mode != MODE_FRACTION:
        raise ValueError(f"mode {mode!r} is not 'mig' or 'fraction'")
    mps = mps_environment(compute, granted_bytes) if compute is not None else {}
    if whole_gpu:
        return {DEVICES_VARIABLE: NO_DEVICES, **mps}
    return {
        DEVICES_VARIABLE: NO_DEVICES,
        LIMIT_VARIABLE: str(granted_bytes),
        LIMIT_GB_VARIABLE: gpu_mem_limit_gb(granted_bytes),
        SLICE_VARIABLE: f"{namespace}/{name}",
        **mps,
    }
