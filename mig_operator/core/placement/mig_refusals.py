"""Why no MIG GPU can take a request, in words that fit a status message on any number of GPUs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..requests.quantities import mib_ceil
from ..requests.request import SliceRequest
from .profiles import GpuModel

if TYPE_CHECKING:
    from .planner import GrantLevel, MigGpu

# What Kubernetes keeps of a status message; a refusal must fit in it on any number of GPUs.
STATUS_MESSAGE_LIMIT = 4096


def model_order(model: GpuModel) -> tuple:
    """A fixed order of models, so decisions and messages never depend on the order GPUs arrive in."""
    return (model.name, model.memory_slots, model.memory_mib, model.product)


@dataclass
class RoomSummary:
    """What a refusal says about the GPUs, in space independent of their number: per model, how
    many GPUs have each count of slots in use, and the GPU with the most slots not in use."""

    # (model name, its memory slots) -> {slots in use: GPU count}
    by_model: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    roomiest: tuple[int, str, int, int] | None = None  # (slots not in use, node, index, model's slots)

    def count(self, model: GpuModel, used: int, gpus: int) -> None:
        hist = self.by_model.setdefault((model.name, model.memory_slots), {})
        hist[used] = hist.get(used, 0) + gpus


def room_summary(gpus: Iterable[MigGpu]) -> RoomSummary:
    summary = RoomSummary()
    best: tuple[int, str, int] | None = None
    for gpu in gpus:
        used = gpu.busy_mask.bit_count()
        summary.count(gpu.model, used, 1)
        slots = gpu.model.memory_slots
        if slots > 0 and (best is None or (used - slots, gpu.node, gpu.index) < best):
            best = (used - slots, gpu.node, gpu.index)
            summary.roomiest = (slots - used, gpu.node, gpu.index, slots)
    return summary


# Enough to name every model a cluster plausibly mixes; more are counted, not named.
_MODELS_SHOWN = 8
_PROFILES_SHOWN = 12


def _shown(items: list[str], limit: int) -> str:
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f" and {len(items) - limit} more"


def no_room_reason(request: SliceRequest, levels: tuple[GrantLevel, ...], summary: RoomSummary) -> str:
    """Why no GPU can take the request: the profiles tried, and the GPUs summarised by model and by
    slots in use (never one line per GPU: the message must fit a status on any cluster). It names no
    node or GPU: the GPUs hold other namespaces' slices, and the same words go to every namespace."""
    names = sorted({p.name for level in levels for _, p in level.options})
    profiles = "" if request.profile is not None else f" (profiles {_shown(names, _PROFILES_SHOWN)})"
    parts = []
    for name, slots in sorted(summary.by_model)[:_MODELS_SHOWN]:
        hist = summary.by_model[(name, slots)]
        total = sum(hist.values())
        if slots <= 0:
            parts.append(f"{name}: {total} GPU(s) without MIG profiles")
            continue
        counts = ", ".join(f"{used}/{slots} slots in use on {n} GPU{'' if n == 1 else 's'}"
                           for used, n in sorted(hist.items(), reverse=True))
        parts.append(f"{name}: {total} GPU(s), {counts}")
    if len(summary.by_model) > _MODELS_SHOWN:
        parts.append(f"and {len(summary.by_model) - _MODELS_SHOWN} more models")
    room = ""
    if summary.roomiest is not None:
        free, _node, _index, slots = summary.roomiest
        room = f"; most room: {free}/{slots} slots not in use on one GPU"
    reason = (
        f"every GPU is held by slices in use: no room for {request.describe()}{profiles} "
        f"even after reclaiming every idle instance ({'; '.join(parts)}){room}"
    )
    return _clip(reason)


def too_large_reason(request: SliceRequest, models: Iterable[GpuModel]) -> str:
    """Why no GPU model here has a profile for the request at all."""
    models = sorted(set(models), key=model_order)
    model_names = _shown(sorted({m.name for m in models}), _MODELS_SHOWN)
    if request.profile is not None:
        return _clip(f"profile {request.profile} does not exist with a legal placement on any GPU here "
                     f"(models: {model_names})")
    offered = [p for m in models for p in m.profiles if not p.media_extension and p.placements]
    if not offered:
        return _clip(f"no GPU here offers a MIG profile (models: {model_names})")
    largest = max(offered, key=lambda p: (p.memory_mib, p.size))
    if request.memory_bytes is not None:
        asked = f"{request.describe()} ({mib_ceil(request.memory_bytes)} MiB)"
    else:
        asked = request.describe()
    return _clip(f"{asked} is larger than any MIG profile of any GPU (largest: {largest.name}, "
                 f"{largest.memory_mib} MiB)")


def _clip(reason: str) -> str:
    # The summaries are bounded already; this only guards a pathological profile or node name.
    if len(reason) <= STATUS_MESSAGE_LIMIT:
        return reason
    return reason[: STATUS_MESSAGE_LIMIT - 3] + "..."
