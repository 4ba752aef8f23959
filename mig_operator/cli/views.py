"""What the offline commands print: the profile tables as text or JSON, a plan's decisions, and the
note that explains a placement the first time a user meets one."""

from __future__ import annotations

from ..core.placement.profiles import GpuModel


def placement_note(start: int, size: int, slots: int) -> str:
    """What ``{start}:size`` means, in words, for the first time a user meets it."""
    last = start + size - 1
    where = f"slot {start}" if size == 1 else f"slots {start}-{last}"
    return (f"({{{start}}}:{size} is where the instance sits on its GPU: {size} of the GPU's {slots} memory "
            f"slots, {where}; the number in braces is the first slot, the one after ':' how many)")


def model_json(model: GpuModel) -> dict:
    from ..gpu.inventory import profiles_json

    return {
        "model": model.name,
        "product": model.product,
        "memory_slots": model.memory_slots,
        "memory_mib": model.memory_mib,
        "profiles": profiles_json(model),
    }


def model_text(model: GpuModel) -> str:
    if not model.mig_capable:
        return f"{model.name} ({model.product}): {model.memory_mib} MiB, no MIG (fractions of the whole GPU only)"
    lines = [f"{model.name} ({model.product}): {model.memory_slots} memory slots, {model.memory_mib} MiB"]
    lines.append(f"  {'profile':<14}{'id':>4}{'slices':>8}{'MiB':>8}{'SM':>6}{'max':>5}  placements")
    for p in model.profiles:
        starts = ",".join(str(pl.start) for pl in p.placements)
        lines.append(
            f"  {p.name:<14}{p.id:>4}{p.slices:>8}{p.memory_mib:>8}{p.sm:>6}{p.max_instances:>5}"
            f"  {{{starts}}}:{p.size}"
        )
    return "\n".join(lines)




def plan_lines(results: list[dict]) -> list[str]:
    """One line per replayed event: the decision, or why it was refused."""
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"{r['id']}: refused: {r['error']}")
            continue
        reclaimed = "".join(f" (reclaim {x['profile']}@{x['start']} on gpu {x['gpu']})" for x in r["reclaimed"])
        lines.append(f"{r['id']}: {r['action']} {r['profile']} (id {r['profile_id']}) on gpu {r['gpu']} "
                     f"at {{{r['start']}}}:{r['size']}{reclaimed}")
    return lines
