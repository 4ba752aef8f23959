"""`mig-operator top`: who holds what, from the GpuNodes, GpuSlices and GpuQuotas as the API serves them.

Pure: ``build_view`` turns the objects' bodies into a ``TopView`` (``namespace_view``: one namespace's
slices, for a caller who may not list the cluster's); ``render_text`` draws it as plain
text for a terminal or a log (ASCII, no colours, at most ``width`` columns: the terminal's, at least
``MIN_WIDTH``); ``core.views.top_json`` gives
the stable shape of ``top --json`` (docs/operations.md). Reading the objects is kube/top.py's job.

A MIG GPU is drawn as its memory slots (an H100 has 8): each instance is a box over the slots it
spans, filled by its state; a GPU without MIG is a bar of its memory with each fraction's share.
Each instance and fraction shows its compute (``core.placement.compute``): a profile's ``3/7``, a share, or
``shared``.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..autoscale.demand import WAITING_FOR_NODE
from ..node.health import health_from_conditions
from ..placement.cluster import published_profiles
from ..placement.compute import SHARED, compute_from_status, format_compute, gpu_compute, mig_compute
from ..requests.quantities import QuantityError, parse_memory, read_integer, short_bytes
from ..usage.advice import TOO_SMALL, Advice, parse_advice
from ..usage.figures import SliceUsage, parse_usage

WIDTH = 100  # the width where no terminal says one (a pipe, a log)
MIN_WIDTH = 60
SLOT_CELL = 7  # columns per memory slot in the map: room for "[A~~~~]"; fewer where the width needs
MIN_SLOT_CELL = 3  # "[A]": a one-slot box keeps its label
BAR_WIDTH = 50  # columns of a fraction GPU's memory bar: one per 2 %; fewer where the width needs
MAP_INDENT = " " * 10
BAR_LEAD = "    memory |"

IN_USE, CREATING, IDLE, FREE = "in_use", "creating", "idle", "free"
STATE_WORDS = {IN_USE: "in use", CREATING: "creating", IDLE: "idle", FREE: "free"}
STATE_FILL = {IN_USE: "#", CREATING: "~", IDLE: "-", FREE: "."}
_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# A slice whose instance is on its way: bound, its instance being made or about to be.
_ON_ITS_WAY = frozenset({"Bound", "Creating"})
_ZERO = re.compile(r"0+(\.0*)?[A-Za-z]*")

# Why there is no quota table (view_json's quotas.state).
QUOTAS_LISTED, QUOTAS_ABSENT, QUOTAS_UNREADABLE = "listed", "absent", "unreadable"


@dataclass(frozen=True)
class SliceInfo:
    """What top needs of a GpuSlice."""

    uid: str
    ref: str  # namespace/name
    phase: str
    reason: str
    mode: str
    node: str
    gpu: int | None
    start: int | None
    size: int | None
    profile: str
    granted_bytes: int
    compute: float | None = None  # a fraction's share (status.compute); None: shared
    usage: SliceUsage | None = None  # status.usage as its node's agent measured it; None: none yet
    advice: Advice | None = None  # status.usage.advice
    pool: str = ""  # status.pool: the node pool whose new node it waits for; "" when none


@dataclass(frozen=True)
class Span:
    """A MIG instance on a GPU's memory slots, or one a bound slice is about to get."""

    label: str
    start: int
    size: int
    profile: str
    state: str  # IN_USE, CREATING or IDLE
    slice: str  # namespace/name of its owner, "" when none
    slice_uid: str
    device_uuid: str
    drawn: bool  # False: it overlaps instances that exist (it waits for them to be reclaimed)
    compute: str = ""  # its profile's compute slices over the GPU's, e.g. 3/7
    usage: SliceUsage | None = None  # its slice's measured usage
    advice: Advice | None = None


@dataclass(frozen=True)
class Share:
    """A fraction slice's part of a whole GPU's memory."""

    label: str
    slice: str
    slice_uid: str
    bytes: int
    state: str  # IN_USE or CREATING
    compute: float | None = None  # its compute share; None: shared
    usage: SliceUsage | None = None  # its slice's measured usage
    advice: Advice | None = None


@dataclass(frozen=True)
class GpuView:
    node: str
    index: int
    product: str
    model: str
    memory_bytes: int
    mig: bool
    serves: str
    serves_reason: str
    slots: int
    slot_states: tuple[str, ...]  # per memory slot (MIG GPUs)
    granted_bytes: int
    spans: tuple[Span, ...] = ()
    shares: tuple[Share, ...] = ()
    compute: str = ""  # shares given out (0.75), shared, or the MIG instances' (4/7); "" when none
    unhealthy: str = ""  # while its Healthy condition is False: the reason (Xid79, GpuLost); "" when healthy
    health_message: str = ""

    def slot_counts(self) -> dict[str, int]:
        return {state: self.slot_states.count(state) for state in (IN_USE, CREATING, IDLE, FREE)}


@dataclass(frozen=True)
class NodeView:
    name: str
    observed_at: str
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True)
class QuotaRow:
    namespace: str
    name: str
    used_bytes: int
    hard_bytes: int | None
    used_slices: int
    hard_slices: int | None
    waiting: int
    whole_gpus: int = 0  # fraction GPUs the namespace holds alone, each charged its whole memory


@dataclass(frozen=True)
class TopView:
    nodes: tuple[NodeView, ...]
    pending: dict[str, int]  # reason -> Pending slices
    quota_state: str
    quota_note: str = ""
    quotas: tuple[QuotaRow, ...] = field(default=())
    # Set: the picture of this namespace's slices only, without GPUs (nodes empty); "" for the cluster's.
    namespace: str = ""
    slices: tuple[SliceInfo, ...] = field(default=())  # the namespace's slices, by name
    note: str = ""  # one line for stderr: why the picture is one namespace's; "" when asked for
    waiting_for_node: dict[str, int] = field(default_factory=dict)  # pool -> slices waiting for a new node of it


# ---- from API bodies -----------------------------------------------------------------------------


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _bytes(value: Any) -> int | None:
    """A quantity as the API serves it (``80Gi``, or a number of bytes); None when absent or unreadable."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value)
    if _ZERO.fullmatch(text):  # parse_memory refuses zero: no request asks for none
        return 0
    try:
        return parse_memory(text)
    except QuantityError:
        return None


def slice_info(body: Mapping[str, Any]) -> SliceInfo:
    meta = body.get("metadata") or {}
    st = body.get("status") or {}
    placement = st.get("placement") or {}
    gpu = st.get("gpu")
    return SliceInfo(
        uid=str(meta.get("uid", "")), ref=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        phase=str(st.get("phase") or "Pending"), reason=str(st.get("reason") or ""), mode=str(st.get("mode") or ""),
        node=str(st.get("node") or ""), gpu=gpu if isinstance(gpu, int) else None,
        start=placement.get("start") if isinstance(placement.get("start"), int) else None,
        size=placement.get("size") if isinstance(placement.get("size"), int) else None,
        profile=str(st.get("profile") or ""), granted_bytes=_int(st.get("grantedBytes")),
        compute=compute_from_status(st.get("compute")),
        usage=parse_usage(st), advice=parse_advice(st.get("usage")), pool=str(st.get("pool") or ""),
    )


def _slot_count(profiles: Sequence[Any]) -> int:
    """Memory slots of a GPU, from its model's published profile table (as the controller reads it)."""
    return max((_int(pl.get("start")) + _int(pl.get("size")) for p in profiles if isinstance(p, Mapping)
                for pl in p.get("placements") or [] if isinstance(pl, Mapping)), default=0)


def _instance_state(inst: Mapping[str, Any], owner: SliceInfo | None) -> str:
    # The GpuNode's rule: held by a slice (the agent's record names it) or running a process is in use.
    if inst.get("sliceUID"):
        if (owner is not None and owner.phase in _ON_ITS_WAY) or inst.get("complete") is False:
            return CREATING
        return IN_USE
    return IN_USE if inst.get("inUse") else IDLE


def _mig_gpu(node: str, gpu: Mapping[str, Any], profiles: Sequence[Any], slots: int, slices: Sequence[SliceInfo],
             by_uid: Mapping[str, SliceInfo]) -> tuple[tuple[Span, ...], tuple[str, ...]]:
    states = [FREE] * slots
    found: list[tuple[int, int, str, str, str, str, str, bool]] = []
    owned = set()
    for inst in gpu.get("instances") or []:
        start, size = _int(inst.get("start")), _int(inst.get("size"))
        uid = str(inst.get("sliceUID") or "")
        owned.add(uid)
        state = _instance_state(inst, by_uid.get(uid))
        for slot in range(start, min(start + size, slots)):
            states[slot] = state
        found.append((start, size, str(inst.get("profile", "")), state, str(inst.get("slice") or ""), uid,
                      str(inst.get("deviceUUID") or ""), True))
    index = _int(gpu.get("index"), -1)
    for s in slices:
        # Bound here, its instance not yet listed: drawn where the slots are free, else it waits.
        if (s.mode == "mig" and s.node == node and s.gpu == index and s.phase in _ON_ITS_WAY
                and s.uid not in owned and s.start is not None and s.size is not None):
            span = range(s.start, min(s.start + s.size, slots))
            drawn = all(states[slot] == FREE for slot in span)
            if drawn:
                for slot in span:
                    states[slot] = CREATING
            found.append((s.start, s.size, s.profile, CREATING, s.ref, s.uid, "", drawn))
    found.sort(key=lambda f: (f[0], not f[7], f[4]))
    slices_of = {str(p.get("name", "")): _int(p.get("slices")) or _named_slices(str(p.get("name", "")))
                 for p in profiles if isinstance(p, Mapping)}
    whole = max(slices_of.values(), default=0)
    spans = tuple(Span(_label(i), *f, compute=mig_compute(slices_of.get(f[2]) or _named_slices(f[2]), whole),
                       **_measured(by_uid.get(f[5])))
                  for i, f in enumerate(found))
    return spans, tuple(states)


def _named_slices(profile: str) -> int:
    """Compute slices as a profile's name gives them (``3g.40gb``: 3), where the table says none."""
    head = profile.partition("g.")[0]
    return read_integer(head) or 0


def _label(i: int) -> str:
    return _LABELS[i] if i < len(_LABELS) else "*"


def _fraction_gpu(node: str, gpu: Mapping[str, Any], slices: Sequence[SliceInfo],
                  by_uid: Mapping[str, SliceInfo]) -> tuple[Share, ...]:
    found: list[tuple[str, str, int, str, float | None]] = []
    listed = set()
    for f in gpu.get("fractions") or []:
        uid = str(f.get("sliceUID") or "")
        listed.add(uid)
        owner = by_uid.get(uid)
        state = CREATING if owner is not None and owner.phase in _ON_ITS_WAY else IN_USE
        share = f.get("compute")
        found.append((str(f.get("slice") or ""), uid, _int(f.get("bytes")), state,
                      compute_from_status(format_compute(share) if isinstance(share, (int, float)) else None)))
    index = _int(gpu.get("index"), -1)
    for s in slices:
        if (s.mode == "fraction" and s.node == node and s.gpu == index and s.phase in _ON_ITS_WAY
                and s.uid not in listed):
            found.append((s.ref, s.uid, s.granted_bytes, CREATING, s.compute))
    return tuple(Share(_label(i), *f, **_measured(by_uid.get(f[1]))) for i, f in enumerate(found))


def _measured(owner: SliceInfo | None) -> dict[str, Any]:
    """The usage and advice of an instance's or share's slice, as Span and Share take them."""
    return {"usage": owner.usage, "advice": owner.advice} if owner is not None else {}


def quota_row(body: Mapping[str, Any]) -> QuotaRow:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    st = body.get("status") or {}
    used = st.get("used") or {}
    hard_slices = spec.get("slices")
    return QuotaRow(
        namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
        used_bytes=_bytes(used.get("memory")) or 0, hard_bytes=_bytes(spec.get("memory")),
        used_slices=_int(used.get("slices")),
        hard_slices=hard_slices if isinstance(hard_slices, int) and not isinstance(hard_slices, bool) else None,
        waiting=_int(st.get("waiting")), whole_gpus=_int(used.get("wholeGpus")),
    )


def build_view(gpunodes: Sequence[Mapping[str, Any]], slices: Sequence[Mapping[str, Any]],
               quotas: Sequence[Mapping[str, Any]] | None, quota_state: str = QUOTAS_LISTED,
               quota_note: str = "") -> TopView:
    """``quotas`` None: not read (``quota_state`` and ``quota_note`` say why, in one line)."""
    infos = [slice_info(b) for b in slices]
    by_uid = {s.uid: s for s in infos if s.uid}
    nodes = []
    for body in sorted(gpunodes, key=lambda b: str((b.get("metadata") or {}).get("name", ""))):
        name = str((body.get("metadata") or {}).get("name", ""))
        st = body.get("status") or {}
        tables = published_profiles(st)
        gpus = []
        for gpu in sorted(st.get("gpus") or [], key=lambda g: _int(g.get("index"))):
            # A GPU naming a model with no published table has no known slots: drawn without its map.
            profiles = tables.get(str(gpu.get("model") or ""), [])
            slots = _slot_count(profiles)
            mig = bool(gpu.get("migEnabled")) and slots > 0
            spans, states = _mig_gpu(name, gpu, profiles, slots, infos, by_uid) if mig else ((), ())
            shares = () if mig else _fraction_gpu(name, gpu, infos, by_uid)
            granted = _int(gpu.get("grantedBytes")) if mig else sum(s.bytes for s in shares)
            compute = (str(gpu.get("compute") or "") if mig
                       else gpu_compute(s.compute for s in shares).describe())
            health = health_from_conditions(gpu.get("conditions"))
            gpus.append(GpuView(
                node=name, index=_int(gpu.get("index")), product=str(gpu.get("product", "")),
                model=str(gpu.get("model", "")), memory_bytes=_int(gpu.get("memoryMiB")) * 2**20, mig=mig,
                serves=str(gpu.get("serves", "")), serves_reason=str(gpu.get("servesReason", "")), slots=slots,
                slot_states=states, granted_bytes=granted, spans=spans, shares=shares, compute=compute,
                unhealthy="" if health.healthy else health.reason, health_message=health.message,
            ))
        nodes.append(NodeView(name, str(st.get("observedAt", "")), tuple(gpus)))
    return TopView(tuple(nodes), _pending(infos), quota_state, quota_note, _quota_rows(quotas),
                   waiting_for_node=_waiting_for_node(infos))


def namespace_view(namespace: str, slices: Sequence[Mapping[str, Any]], quotas: Sequence[Mapping[str, Any]] | None,
                   quota_state: str = QUOTAS_LISTED, quota_note: str = "", note: str = "") -> TopView:
    """One namespace's slices and GpuQuotas, with no GpuNode read: each slice's node, GPU, size, phase,
    usage and advice as its status says; ``note``: why the picture is limited (empty when asked for)."""
    infos = sorted((slice_info(b) for b in slices), key=lambda s: s.ref)
    return TopView((), _pending(infos), quota_state, quota_note, _quota_rows(quotas), namespace, tuple(infos), note,
                   _waiting_for_node(infos))


def _pending(infos: Sequence[SliceInfo]) -> dict[str, int]:
    """Pending slices by reason, the reasons in order."""
    pending: dict[str, int] = {}
    for s in infos:
        if s.phase == "Pending":
            pending[s.reason or "Pending"] = pending.get(s.reason or "Pending", 0) + 1
    return dict(sorted(pending.items()))


def _waiting_for_node(infos: Sequence[SliceInfo]) -> dict[str, int]:
    """Slices Pending with reason WaitingForNode, by the pool their status names, the pools in order."""
    waiting: dict[str, int] = {}
    for s in infos:
        if s.phase == "Pending" and s.reason == WAITING_FOR_NODE and s.pool:
            waiting[s.pool] = waiting.get(s.pool, 0) + 1
    return dict(sorted(waiting.items()))


def _quota_rows(quotas: Sequence[Mapping[str, Any]] | None) -> tuple[QuotaRow, ...]:
    return tuple(sorted((quota_row(q) for q in quotas or ()), key=lambda r: (r.namespace, r.name)))


# ---- text ----------------------------------------------------------------------------------------


def gib(num_bytes: int) -> str:
    """``80 GiB``, ``9.8 GiB``, ``0 GiB``: one decimal, dropped when it is 0."""
    text = f"{num_bytes / 2**30:.1f}"
    return f"{text.removesuffix('.0')} GiB"


def _percent(part: int, whole: int) -> str:
    return f"{round(100 * part / whole)}%" if whole > 0 else "-"


def _clip(text: str, width: int) -> str:
    """A table row cut to ``width`` (its last column, a slice's name, loses its end)."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def _wrap(text: str, width: int, indent: str = "    ") -> list[str]:
    """A sentence on lines of at most ``width`` columns, continued further in by ``indent``: nothing is cut."""
    if len(text) <= width:
        return [text]
    lead = " " * (len(text) - len(text.lstrip(" ")))
    return textwrap.wrap(text.lstrip(" "), width, initial_indent=lead, subsequent_indent=lead + indent,
                         break_on_hyphens=False)


def slot_cell(gpu: GpuView, width: int = WIDTH) -> int:
    """Columns per memory slot: SLOT_CELL, or as many as fit ``width`` (at least MIN_SLOT_CELL)."""
    room = (width - len(MAP_INDENT)) // max(gpu.slots, 1)
    return max(MIN_SLOT_CELL, min(SLOT_CELL, room))


def _box(span: Span, cells: int, cell: int = SLOT_CELL) -> str:
    inner = cells * cell - 2
    text = f"{span.label} {span.profile} "
    if len(text) + 1 > inner:
        text = span.label
    return "[" + text + STATE_FILL[span.state] * (inner - len(text)) + "]"


def slot_map(gpu: GpuView, cell: int = SLOT_CELL) -> str:
    """One line: each drawn instance a box over its slots, each free slot a dot under its number;
    ``cell`` columns per slot."""
    out, slot = [], 0
    drawn = {s.start: s for s in gpu.spans if s.drawn}
    while slot < gpu.slots:
        span = drawn.get(slot)
        if span is not None and span.size > 0:
            size = min(span.size, gpu.slots - slot)
            out.append(_box(span, size, cell))
            slot += size
        elif gpu.slot_states[slot] == FREE:
            out.append(".".center(cell))
            slot += 1
        else:  # under an instance whose box began earlier (placements never do this): its state's mark
            out.append(STATE_FILL[gpu.slot_states[slot]] * cell)
            slot += 1
    return (MAP_INDENT + "".join(out)).rstrip()


def memory_bar(gpu: GpuView, bar_width: int = BAR_WIDTH) -> str:
    """Each share a run of ``bar_width`` columns (its label, then its state's mark) in proportion to its bytes."""
    out, end, total = [], 0, gpu.memory_bytes
    held = 0
    for share in gpu.shares:
        held += share.bytes
        stop = min(bar_width, max(end + 1, round(bar_width * held / total) if total else bar_width))
        if stop > end:
            out.append(share.label + STATE_FILL[share.state] * (stop - end - 1))
        end = stop
    out.append(STATE_FILL[FREE] * (bar_width - end))
    return BAR_LEAD + "".join(out) + "|"


def advice_word(advice: Advice | None) -> str:
    """``->1g.10gb`` (a smaller size would have held the peak), ``too small``, or ``""``."""
    if advice is None:
        return ""
    return "too small" if advice.verdict == TOO_SMALL else f"->{advice.suggested}"


def _usage_cells(items: Sequence[Span] | Sequence[Share]) -> list[str]:
    """Per instance or share, ``used/peak`` and the advice word, padded to one width and ending in two
    spaces; all empty when none of them has usage figures yet (the rows then stay as they were)."""
    if not any(i.usage is not None for i in items):
        return ["" for _ in items]
    figures = [f"{short_bytes(i.usage.memory_used)}/{short_bytes(i.usage.memory_peak)}" if i.usage else "-"
               for i in items]
    words = [advice_word(i.advice) for i in items]
    size, word = max(len(f) for f in figures), max(len(w) for w in words)
    return [f"{f.ljust(size)}  {w.ljust(word)}  " if word else f"{f.ljust(size)}  " for f, w in zip(figures, words,
                                                                                                strict=True)]


def _gpu_lines(gpu: GpuView, width: int) -> list[str]:
    name = f"{gpu.product} ({gpu.model})" if gpu.model else gpu.product
    lines = []
    if gpu.mig:
        counts = gpu.slot_counts()
        cell = slot_cell(gpu, width)
        lines += _wrap(f"  GPU {gpu.index}  {name}  MIG, {gpu.slots} slots: {counts[IN_USE]} in use, "
                       f"{counts[CREATING]} creating, {counts[IDLE]} idle, {counts[FREE]} free", width)
        lines.append(("    slot  " + "".join(str(i).center(cell) for i in range(gpu.slots))).rstrip())
        lines.append(slot_map(gpu, cell))
        place = max((len(f"{{{s.start}}}:{s.size}") for s in gpu.spans), default=0)
        profile = max((len(s.profile) for s in gpu.spans), default=0)
        compute = max((len(s.compute) for s in gpu.spans), default=0)
        for s, used in zip(gpu.spans, _usage_cells(gpu.spans), strict=True):
            where = f"{{{s.start}}}:{s.size}".ljust(place)
            note = "" if s.drawn else " (waits for the instances there to be reclaimed)"
            if not s.slice and s.state == IN_USE:
                note = " (a process outside any slice)"
            text = (f"      {s.label}  {where}  {s.profile.ljust(profile)}  {s.compute.ljust(compute)}  "
                    f"{STATE_WORDS[s.state]:<8}  {used}")
            owner = s.slice or "-"
            if note and len(text + owner + note) > width:  # the note on lines of its own, under the row
                lines.append(_clip(text + owner, width))
                lines += _wrap(" " * 9 + note.strip(), width, "")
            else:
                lines.append(_clip(text + owner + note, width))
        if not gpu.spans:
            lines.append("      no instances")
    else:
        held = {state: sum(1 for s in gpu.shares if s.state == state) for state in (IN_USE, CREATING)}
        compute = {"": "", SHARED: ", compute shared"}.get(gpu.compute, f", compute {gpu.compute} of 1")
        lines += _wrap(f"  GPU {gpu.index}  {name}  fractions, {gib(gpu.granted_bytes)} of "
                       f"{gib(gpu.memory_bytes)} granted{compute}: {held[IN_USE]} in use, "
                       f"{held[CREATING]} creating", width)
        lines.append(memory_bar(gpu, min(BAR_WIDTH, width - len(BAR_LEAD) - 1)))
        size = max((len(gib(s.bytes)) for s in gpu.shares), default=0)
        shares = max((len(format_compute(s.compute)) for s in gpu.shares), default=0)
        for s, used in zip(gpu.shares, _usage_cells(gpu.shares), strict=True):
            text = (f"      {s.label}  {gib(s.bytes).rjust(size)}  {_percent(s.bytes, gpu.memory_bytes):>4}  "
                    f"{format_compute(s.compute).ljust(shares)}  {STATE_WORDS[s.state]:<8}  {used}")
            lines.append(_clip(text + (s.slice or "-"), width))
    if gpu.unhealthy:
        lines += _wrap(f"      UNHEALTHY ({gpu.unhealthy}), takes no new slices: {gpu.health_message}", width)
    elif gpu.serves == "none":
        lines += _wrap(f"      takes no new slices: {gpu.serves_reason}", width)
    return lines


def _quota_lines(view: TopView, width: int) -> list[str]:
    if view.quota_state != QUOTAS_LISTED:
        return _wrap(f"quotas: {view.quota_note}", width)
    if not view.quotas:
        return _wrap("quotas: none (no GpuQuota: every namespace may take any free GPU memory)", width)
    rows = [["namespace", "memory used / hard", "%", "slices used / hard", "waiting", "whole GPUs"]]
    short = ["namespace", "memory", "%", "slices", "waiting", "whole"]  # the headings where the long ones do not fit
    for q in view.quotas:
        hard = gib(q.hard_bytes) if q.hard_bytes is not None else "-"
        share = _percent(q.used_bytes, q.hard_bytes) if q.hard_bytes else "-"
        slices = f"{q.used_slices} / {q.hard_slices if q.hard_slices is not None else '-'}"
        rows.append([q.namespace, f"{gib(q.used_bytes)} / {hard}", share, slices, str(q.waiting), str(q.whole_gpus)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if 2 + sum(widths[:5]) + 2 * 5 + max(len(r[5]) for r in rows) > width:
        rows[0] = short
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = _wrap("quotas (GpuQuota; memory counts each slice's grant, and a fraction GPU held alone whole)", width)
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].ljust(widths[3]),
                 r[4].rjust(widths[4]), r[5]]
        lines.append(_clip(("  " + "  ".join(cells)).rstrip(), width))
    return lines


def slice_size(s: SliceInfo) -> str:
    """What a slice holds: its MIG profile, its fraction's memory (``8 GiB``), ``-`` while unbound."""
    if s.mode == "mig" and s.profile:
        return s.profile
    return gib(s.granted_bytes) if s.mode == "fraction" and s.granted_bytes else "-"


def _namespace_lines(view: TopView, width: int) -> list[str]:
    """One row per slice of ``view.namespace``: where it is bound, what it holds, its phase, usage and advice."""
    lines = _wrap(f"namespace {view.namespace}: {len(view.slices)} slice(s); GPUs not drawn (that needs the "
                  "cluster-wide lists)", width)
    lines.append("")
    if not view.slices:
        return [*lines, f"  no GpuSlices in namespace {view.namespace}"]
    rows = [["node", "gpu", "size", "phase", "used/peak", "advice", "slice"]]
    for s in view.slices:
        phase = f"{s.phase} ({s.reason})" if s.reason and s.phase != "Ready" else s.phase
        used = f"{short_bytes(s.usage.memory_used)}/{short_bytes(s.usage.memory_peak)}" if s.usage else "-"
        rows.append([s.node or "-", str(s.gpu) if s.gpu is not None else "-", slice_size(s), phase, used,
                     advice_word(s.advice) or "-", s.ref.partition("/")[2]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [cell.ljust(size) for cell, size in zip(r, widths, strict=False)]
        lines.append(_clip("  " + "  ".join([*cells, r[-1]]), width))
    return lines


def render_text(view: TopView, width: int = WIDTH) -> str:
    """The whole picture as plain text, every line at most ``width`` columns (at least MIN_WIDTH), ending
    in a newline: sentences wrap, a table row's last column (a slice's or node's name) is cut."""
    width = max(MIN_WIDTH, width)
    if view.namespace:
        measured = any(s.usage is not None for s in view.slices)
        return "\n".join(_footer(view, _namespace_lines(view, width), measured, width)) + "\n"
    gpu_count = sum(len(n.gpus) for n in view.nodes)
    lines = _wrap(f"{len(view.nodes)} node(s), {gpu_count} GPU(s); slots and memory: # in use, ~ creating, "
                  "- idle, . free", width)
    if not view.nodes:
        lines += _wrap("no GpuNodes: no mig-operator agent has published its GPUs (kubectl get gn)", width)
    for node in view.nodes:
        lines.append("")
        lines.append(_clip(f"node {node.name}  (observed {node.observed_at or 'never'})", width))
        if not node.gpus:
            lines.append("  no GPUs")
        for gpu in node.gpus:
            lines.extend(_gpu_lines(gpu, width))
    measured = any(i.usage is not None for n in view.nodes for g in n.gpus for i in (*g.spans, *g.shares))
    return "\n".join(_footer(view, lines, measured, width)) + "\n"


def _footer(view: TopView, lines: list[str], measured: bool, width: int) -> list[str]:
    """After the GPUs (or a namespace's slices): the usage legend where figures are shown, the Pending
    slices, those waiting for a new node by pool, and the quota table."""
    lines.append("")
    if measured:
        lines += _wrap("used/peak: GPU memory in use now and its peak since Ready; ->SIZE: that smaller size would "
                       "have held the peak (mig-operator advise)", width)
    total = sum(view.pending.values())
    if total:
        reasons = ", ".join(f"{reason} {count}" for reason, count in view.pending.items())
        lines += _wrap(f"pending slices: {total} ({reasons})", width)
    else:
        lines.append("pending slices: none")
    if view.waiting_for_node:
        pools = ", ".join(f"pool {pool}: {count} slice{'' if count == 1 else 's'}"
                          for pool, count in view.waiting_for_node.items())
        lines += _wrap(f"waiting for a new node: {pools}", width)
    lines.extend(_quota_lines(view, width))
    return lines
