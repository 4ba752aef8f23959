"""`mig-operator advise`: each slice whose peak would have fit a smaller MIG profile or fraction on the same
GPU model, or that is too small, and what the cluster would get back.

Pure: ``build_report`` reads the GpuSlices' and GpuNodes' bodies as the API serves them and recomputes the
advice from ``status.usage.memoryPeak`` with the caller's headroom (not the agent's advice, made with the
default); ``report_json`` is ``advise --json``'s shape (docs/operations.md), ``render_text`` its text.
Reading the objects is kube/advise.py's job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..placement.cluster import MODE_FRACTION, MODE_MIG, GpuState, inventory_from_status, model_of
from ..placement.profiles import CATALOG, GpuModel
from ..requests.quantities import MIB, short_bytes
from ..usage.advice import DEFAULT_HEADROOM, TOO_SMALL, Advice, advise_fraction, advise_mig
from ..usage.figures import parse_usage
from .top_view import SliceInfo, slice_info


@dataclass(frozen=True)
class AdviceRow:
    namespace: str
    name: str
    node: str
    mode: str
    peak: int
    advice: Advice
    gpu_memory: int  # bytes of the slice's GPU; 0 when not known (its GpuNode not read)


@dataclass(frozen=True)
class AdviceReport:
    rows: tuple[AdviceRow, ...]
    measured: int  # slices with usage figures, advised or not
    notes: tuple[str, ...] = field(default=())

    @property
    def memory_back(self) -> int:
        return sum(r.advice.memory_back for r in self.rows)

    @property
    def whole_gpus(self) -> float:
        """The memory back in whole GPUs: each slice's share of its own GPU's memory, summed."""
        return sum(r.advice.memory_back / r.gpu_memory for r in self.rows if r.gpu_memory > 0)


def _gpus(gpunodes: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], GpuState]:
    found = {}
    for body in gpunodes:
        name = str((body.get("metadata") or {}).get("name", ""))
        for gpu in inventory_from_status(name, body.get("status")).gpus:
            found[(name, gpu.index)] = gpu
    return found


def _model_from_grant(profile: str, granted_bytes: int) -> GpuModel | None:
    """The one built-in model with ``profile`` of exactly ``granted_bytes`` (a MIG slice's grant is its
    profile's memory, which differs between boards with the same profile names), where the slice's GpuNode
    cannot be read; None when no model, or more than one, matches."""
    found = [m for m in CATALOG.values()
             if m.has_profile(profile) and m.profile(profile).memory_mib * MIB == granted_bytes]
    return found[0] if len(found) == 1 else None


def _advise(info: SliceInfo, peak: int, refusals: int, gpu: GpuState | None,
            headroom: float) -> tuple[Advice | None, int, bool]:
    """The slice's advice, its GPU's memory in bytes (0 when unknown), and whether its model was unknown."""
    if info.mode == MODE_FRACTION:
        memory = gpu.memory_mib * MIB if gpu is not None else 0
        return advise_fraction(info.granted_bytes, peak, refusals, headroom), memory, False
    if gpu is not None and gpu.profiles:
        model = model_of(gpu.model, gpu.product, gpu.memory_mib, gpu.profiles)
    else:
        model = _model_from_grant(info.profile, info.granted_bytes)
    if model is None:
        return None, 0, True
    memory = gpu.memory_mib * MIB if gpu is not None and gpu.memory_mib else model.memory_mib * MIB
    return advise_mig(model, info.profile, peak, headroom), memory, False


def build_report(slices: Sequence[Mapping[str, Any]], gpunodes: Sequence[Mapping[str, Any]] | None,
                 headroom: float = DEFAULT_HEADROOM) -> AdviceReport:
    """``gpunodes`` None: not readable by the caller (a MIG slice's model is then the built-in one its
    profile and grant name, and fractions count no whole GPUs)."""
    gpus = _gpus(gpunodes or ())
    rows, measured, unknown, fraction_unknown = [], 0, 0, 0
    for body in slices:
        usage = parse_usage(body.get("status"))
        info = slice_info(body)
        if usage is None or info.mode not in (MODE_MIG, MODE_FRACTION) or info.gpu is None:
            continue
        measured += 1
        gpu = gpus.get((info.node, info.gpu))
        advice, memory, unknown_model = _advise(info, usage.memory_peak, usage.refusals, gpu, headroom)
        unknown += unknown_model
        if advice is None:
            continue
        if info.mode == MODE_FRACTION and memory == 0 and advice.memory_back:
            fraction_unknown += 1
        namespace, _, name = info.ref.partition("/")
        rows.append(AdviceRow(namespace, name, info.node, info.mode, usage.memory_peak, advice, memory))
    notes = []
    if unknown:
        why = "cannot be read" if gpunodes is None else "do not publish it"
        notes.append(f"{unknown} MIG slice(s) not advised: their GPU's model is not known (the GpuNodes {why})")
    if fraction_unknown:
        notes.append(f"{fraction_unknown} fraction(s) not counted in whole GPUs: their GPU's memory is not known "
                     "(the GpuNodes cannot be read)")
    rows.sort(key=lambda r: (r.namespace, r.name))
    return AdviceReport(tuple(rows), measured, tuple(notes))


def report_json(report: AdviceReport) -> dict[str, Any]:
    """``advise --json``: keys and meanings are documented in docs/operations.md and kept stable."""
    return {
        "slices": [{
            "namespace": r.namespace, "name": r.name, "node": r.node, "mode": r.mode, "current": r.advice.current,
            "peak": r.peak, "verdict": r.advice.verdict, "suggested": r.advice.suggested,
            "memoryBack": r.advice.memory_back, "message": r.advice.message,
        } for r in report.rows],
        "totals": {"memoryBack": report.memory_back, "wholeGpus": round(report.whole_gpus, 3)},
    }


def render_text(report: AdviceReport) -> str:
    """A line per advised slice (columns aligned, the message last) and a total line; ends in a newline."""
    head = ["NAMESPACE", "NAME", "NODE", "MODE", "CURRENT", "PEAK", "ADVICE", "BACK", "WHY"]
    table = [head] + [[r.namespace, r.name, r.node, r.mode, r.advice.current, short_bytes(r.peak),
                       "too small" if r.advice.verdict == TOO_SMALL else f"-> {r.advice.suggested}",
                       short_bytes(r.advice.memory_back), r.advice.message] for r in report.rows]
    lines = []
    if report.rows:
        widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
                 for row in table]
    smaller = sum(1 for r in report.rows if r.advice.verdict != TOO_SMALL)
    too_small = len(report.rows) - smaller
    if report.measured == 0:
        lines.append("no slice has usage figures yet (its node's agent writes status.usage once it is Ready)")
    lines.append(f"total: {short_bytes(report.memory_back)} back, {report.whole_gpus:.2f} whole GPU(s); "
                 f"{smaller} slice(s) smaller, {too_small} too small, of {report.measured} measured")
    return "\n".join(lines) + "\n"
