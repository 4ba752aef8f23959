"""What a node's GPUs offer and hold, as the JSON that ``mig-operator inspect --json`` prints.

``describe`` reads a backend once and returns plain dicts (JSON-ready); ``render_text`` turns that
into the human table. The profile list keeps the backend's order, which for NVML is the
profile-info index order (H200: 19, 14, 9, 5, 0, 20, 15), so it can be checked against
``nvidia-smi mig -lgip`` profile by profile.
"""

from __future__ import annotations

from typing import Any

from mig_operator.core.placement.profiles import GpuModel, model_for_product
from mig_operator.gpu.protocol import GpuBackend, MigInstance


def profiles_json(model: GpuModel) -> list[dict[str, Any]]:
    """Profiles as `inspect --json` and `catalog --json` print them."""
    return [
        {
            "name": p.name,
            "id": p.id,
            "slices": p.slices,
            "memory_mib": p.memory_mib,
            "sm": p.sm,
            "max_instances": p.max_instances,
            "placements": [[pl.start, pl.size] for pl in p.placements],
        }
        for p in model.profiles
    ]


def _instance(inst: MigInstance) -> dict[str, Any]:
    return {
        "gi_id": inst.gi_id,
        "ci_id": inst.ci_id,
        "profile": inst.profile,
        "profile_id": inst.profile_id,
        "start": inst.start,
        "size": inst.size,
        "device_uuid": inst.device_uuid,
        "in_use": inst.in_use,
    }


def describe(backend: GpuBackend) -> dict[str, Any]:
    """Every GPU with its profiles, placements and instances.

    A GPU without MIG gets empty lists and, as ``model``, the catalog's name for its product and
    memory (``l4-24gb``) or null when the catalog does not know it; one with MIG disabled lists its
    profiles (NVML answers those with MIG off) and no instances. A GPU instance without a compute
    instance is listed with ``ci_id`` -1 and an empty ``device_uuid``.
    """
    gpus = []
    for info in backend.gpus():
        model = backend.model(info.index) if info.mig_capable else None
        instances = backend.instances(info.index) if info.mig_enabled else []
        if model is not None:
            name: str | None = model.name
        else:
            known = model_for_product(info.product, info.memory_mib)
            name = known.name if known is not None else None
        gpus.append(
            {
                "index": info.index,
                "uuid": info.uuid,
                "product": info.product,
                "model": name,
                "memory_mib": info.memory_mib,
                "mig_capable": info.mig_capable,
                "mig_enabled": info.mig_enabled,
                "profiles": profiles_json(model) if model is not None else [],
                "instances": [_instance(i) for i in instances],
            }
        )
    return {"gpus": gpus}


def _placements_text(placements: list[list[int]]) -> str:
    # nvidia-smi's -lgipp notation: {0,2,4}:2 when every placement has one size.
    sizes = {size for _start, size in placements}
    if len(sizes) == 1:
        return "{" + ",".join(str(start) for start, _size in placements) + "}:" + str(sizes.pop())
    return " ".join(f"{start}:{size}" for start, size in placements)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def render_text(desc: dict[str, Any]) -> str:
    """The human form of ``describe``'s result: one block per GPU, profiles then instances."""
    if not desc.get("gpus"):
        return "no GPUs found\n"
    lines: list[str] = []
    for gpu in desc["gpus"]:
        mode = "MIG enabled" if gpu["mig_enabled"] else ("MIG disabled" if gpu["mig_capable"] else "no MIG")
        lines.append(
            f"GPU {gpu['index']}: {gpu['product']} ({gpu['model'] or 'unknown model'}), "
            f"{gpu['memory_mib']} MiB, {mode}, {gpu['uuid']}"
        )
        if gpu["profiles"]:
            rows = [
                [p["name"], str(p["id"]), str(p["slices"]), str(p["memory_mib"]), str(p["sm"]),
                 str(p["max_instances"]), _placements_text(p["placements"])]
                for p in gpu["profiles"]
            ]
            lines.extend("  " + line for line in _table(
                ["profile", "id", "slices", "MiB", "SM", "max", "placements"], rows))
        if gpu["instances"]:
            rows = [
                [str(i["gi_id"]), str(i["ci_id"]) if i["ci_id"] >= 0 else "-", i["profile"],
                 f"{i['start']}:{i['size']}", "yes" if i["in_use"] else "no",
                 i["device_uuid"] or ("- (no compute instance)" if i["ci_id"] < 0 else "-")]
                for i in gpu["instances"]
            ]
            lines.extend("  " + line for line in _table(
                ["GI", "CI", "profile", "placement", "in use", "device"], rows))
        elif gpu["mig_enabled"]:
            lines.append("  no MIG instances")
        lines.append("")
    return "\n".join(lines)
