"""The environment a sliced container gets (DESIGN "The contracts"), as one pure function.

The agent's CDI spec (core/cdi.py) gives it to the container; the real-GPU test starts processes
with exactly what that spec gives. The device itself reaches the container only as the spec's device
nodes: ``NVIDIA_VISIBLE_DEVICES=void`` tells the NVIDIA runtime hook to add none. Fractions also
preload the shim with the limit; the shim's ledger is a mount, not a variable.
"""

from __future__ import annotations

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


def gpu_mem_limit_gb(granted_bytes: int) -> str:
    """GPU_MEM_LIMIT_GB as ClearML's fractional containers show it: decimal GB, two places at most."""
    return f"{granted_bytes / 10**9:.2f}".rstrip("0").rstrip(".")


def slice_environment(mode: str, granted_bytes: int, namespace: str, name: str,
                      shim_path: str = SHIM_PATH_IN_CONTAINER, whole_gpu: bool = False) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES=void`` always; in fraction mode also ``LD_PRELOAD``,
    ``CDMO_GPU_MEMORY_LIMIT`` (bytes), ``GPU_MEM_LIMIT_GB`` (informational) and ``CDMO_SLICE``
    (informational: the shim's accounting is the ledger the CDI spec mounts), except for a fraction
    that is its whole GPU (``whole_gpu``), which has nothing to limit."""
    if mode == MODE_MIG or (mode == MODE_FRACTION and whole_gpu):
        return {DEVICES_VARIABLE: NO_DEVICES}
    if mode != MODE_FRACTION:
        raise ValueError(f"mode {mode!r} is not 'mig' or 'fraction'")
    return {
        DEVICES_VARIABLE: NO_DEVICES,
        PRELOAD_VARIABLE: shim_path,
        LIMIT_VARIABLE: str(granted_bytes),
        LIMIT_GB_VARIABLE: gpu_mem_limit_gb(granted_bytes),
        SLICE_VARIABLE: f"{namespace}/{name}",
    }
