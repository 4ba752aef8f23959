"""The environment a sliced container gets (DESIGN "The contracts"), as one pure function.

The agent's CDI spec (core/cdi.py) gives it to the container; the real-GPU test starts processes
with exactly what that spec gives. The device itself reaches the container only as the spec's device
nodes: ``NVIDIA_VISIBLE_DEVICES=void`` tells the NVIDIA runtime hook to add none. Fractions also
preload the shim with the limit; the shim's ledger is a mount, not a variable. A fraction with a
compute share is also an MPS client: the pipe directory, its active-thread percentage and its pinned
device memory limit.
"""

from __future__ import annotations

from collections.abc import Iterable

from .cluster import MODE_FRACTION, MODE_MIG

SHIM_PATH_IN_CONTAINER = "/usr/local/lib/cdmo/libgpuslice.so"
# The slice's ledger (the shim's shared accounting): the claim's own directory on the node, mounted
# here by the CDI spec. The shim has this path built in; no variable names another.
LEDGER_PATH_IN_CONTAINER = "/run/cdmo/ledger"
DEVICES_VARIABLE = "NVIDIA_VISIBLE_DEVICES"
# The value the NVIDIA runtime hook reads as "no devices": the CDI edits alone decide what is visible.
NO_DEVICES = "void"
PRELOAD_VARIABLE = "LD_PRELOAD"
LIMIT_VARIABLE = "CDMO_GPU_MEMORY_LIMIT"
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


def slice_environment(mode: str, granted_bytes: int, namespace: str, name: str,
                      shim_path: str = SHIM_PATH_IN_CONTAINER, whole_gpu: bool = False,
                      compute: float | None = None) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES=void`` always; in fraction mode also ``LD_PRELOAD``,
    ``CDMO_GPU_MEMORY_LIMIT`` (bytes), ``GPU_MEM_LIMIT_GB`` (informational) and ``CDMO_SLICE``
    (informational: the shim's accounting is the ledger the CDI spec mounts), except for a fraction
    that is its whole GPU (``whole_gpu``), which has nothing to limit. A fraction with a ``compute``
    share also gets ``mps_environment``."""
    if mode == MODE_MIG:
        return {DEVICES_VARIABLE: NO_DEVICES}
    if mode != MODE_FRACTION:
        raise ValueError(f"mode {mode!r} is not 'mig' or 'fraction'")
    mps = mps_environment(compute, granted_bytes) if compute is not None else {}
    if whole_gpu:
        return {DEVICES_VARIABLE: NO_DEVICES, **mps}
    return {
        DEVICES_VARIABLE: NO_DEVICES,
        PRELOAD_VARIABLE: shim_path,
        LIMIT_VARIABLE: str(granted_bytes),
        LIMIT_GB_VARIABLE: gpu_mem_limit_gb(granted_bytes),
        SLICE_VARIABLE: f"{namespace}/{name}",
        **mps,
    }
