"""The simulated GPUs' identities and NVML's placement rules: UUIDs derived from names (the same in
every process), and which profile may go where (legal starts, overlaps, instance and slice limits)."""

from __future__ import annotations

import uuid

from mig_operator.core.placement.profiles import GpuModel, Profile
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.sim_state import SimGpu

# Fixed namespace so every run, process and machine derives the same UUIDs from the same names.
_UUID_NAMESPACE = uuid.UUID("6b1f3c2e-9a4d-5e8f-8c1b-2d7e4f6a9b30")


def gpu_uuid(model_name: str, index: int, host: str = "") -> str:
    """The simulated GPU UUID of GPU ``index`` of ``model_name``; the same in every process."""
    # Real GPUs have unique UUIDs; simulated nodes named by ``host`` get distinct ones (the same
    # in every process for the same host, so a restarted agent sees the same GPUs).
    seed = f"{host}/{model_name}/{index}" if host else f"{model_name}/{index}"
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, seed)}"


def mig_uuid(parent_uuid: str, gi_id: int, start: int, generation: int) -> str:
    """The simulated MIG device UUID of one creation of an instance."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{parent_uuid}/{gi_id}/{start}/{generation}')}"


def legal_profile(model: GpuModel, profile_id: int, start: int, op: str) -> Profile:
    """The profile, if ``start`` is one of its legal placements (else INVALID_ARGUMENT, as NVML)."""
    profile = profile_of(model, profile_id, op)
    legal = {p.start for p in profile.placements}
    if start not in legal:
        raise GpuError(
            "INVALID_ARGUMENT", f"{op}: start {start} is not a legal placement of {profile.name} "
            f"(legal starts {sorted(legal)})"
        )
    return profile


def profile_of(model: GpuModel, profile_id: int, op: str) -> Profile:
    for profile in model.profiles:
        if profile.id == profile_id:
            return profile
    known = ", ".join(str(p.id) for p in model.profiles)
    raise GpuError(
        "INVALID_ARGUMENT", f"{op}: no profile id {profile_id} on {model.name} (known: {known})"
    )


def check_room(model: GpuModel, gpu: SimGpu, profile: Profile, start: int, op: str) -> None:
    """INSUFFICIENT_RESOURCES, as NVML, unless ``profile`` fits at ``start`` on ``gpu``."""
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
    # A GPU instance holds its slices whether or not it has its compute instance.
    total = max(p.slices for p in model.profiles)
    used = sum(model.profile_by_id(o.profile_id).slices for o in gpu.instances.values())
    if used + profile.slices > total:
        raise GpuError(
            "INSUFFICIENT_RESOURCES", f"{op}: {used} of {total} compute slices in use, {profile.name} "
            f"needs {profile.slices}"
        )
