"""The environment a sliced container gets (DESIGN "The contracts"), as one pure function.

The controller writes it into the pod's ConfigMap; the real-GPU test starts processes with exactly
this environment. MIG slices name their device; fractions also preload the shim with the limit.
"""

from __future__ import annotations

from .cluster import MODE_FRACTION, MODE_MIG

SHIM_PATH_IN_CONTAINER = "/usr/local/lib/cdmo/libgpuslice.so"
DEVICES_VARIABLE = "NVIDIA_VISIBLE_DEVICES"
PRELOAD_VARIABLE = "LD_PRELOAD"
LIMIT_VARIABLE = "CDMO_GPU_MEMORY_LIMIT"
LIMIT_GB_VARIABLE = "GPU_MEM_LIMIT_GB"  # informational, as in ClearML's containers
SLICE_VARIABLE = "CDMO_SLICE"


def gpu_mem_limit_gb(granted_bytes: int) -> str:
    """GPU_MEM_LIMIT_GB as ClearML's fractional containers show it: decimal GB, two places at most."""
    return f"{granted_bytes / 10**9:.2f}".rstrip("0").rstrip(".")


def slice_environment(mode: str, device_uuid: str, granted_bytes: int, namespace: str, name: str,
                      shim_path: str = SHIM_PATH_IN_CONTAINER) -> dict[str, str]:
    """``NVIDIA_VISIBLE_DEVICES`` always; in fraction mode also ``LD_PRELOAD``, ``CDMO_GPU_MEMORY_LIMIT``
    (bytes), ``GPU_MEM_LIMIT_GB`` (informational) and ``CDMO_SLICE`` (the shim's accounting group)."""
    if mode == MODE_MIG:
        return {DEVICES_VARIABLE: device_uuid}
    if mode != MODE_FRACTION:
        raise ValueError(f"mode {mode!r} is not 'mig' or 'fraction'")
    return {
        DEVICES_VARIABLE: device_uuid,
        PRELOAD_VARIABLE: shim_path,
        LIMIT_VARIABLE: str(granted_bytes),
        LIMIT_GB_VARIABLE: gpu_mem_limit_gb(granted_bytes),
        SLICE_VARIABLE: f"{namespace}/{name}",
    }
