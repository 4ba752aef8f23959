"""Per-namespace GPU quotas and the fair order of waiting slices (pure: no I/O).

A namespace's ``GpuQuota`` caps the GPU memory its slices hold, counted by what each is charged
(``core.books.charges``: a MIG slice its grant, so a ``1g.18gb`` for a ``10G`` request counts 16384 MiB; a
fraction on a GPU its namespace holds alone that GPU's whole memory, once), and optionally how many
slices it holds. A slice holds its charge from Bound on (Bound, Creating, Ready) until it is gone: a slice being deleted
still holds it (its agent keeps it while its claim is in use), and a device an agent still holds for
a slice that is gone (``agent_holdings``) is charged to that slice's namespace; Pending and Failed
slices hold nothing. ``admit`` says whether one more binding keeps the namespace within its quota.

When slices of several namespaces wait, ``FairQueue`` serves next the namespace that holds the
smallest share of its quota (of the cluster's GPU memory when it has none), then its oldest slice.
Within a namespace the oldest waiting slice goes first; one that cannot be bound for lack of room
holds the namespace's younger slices back for at most ``hold_s`` seconds of its waiting (so room
freed piece by piece collects for a large request), after which they are served around it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Generic, TypeVar

from ..placement.cluster import NO_CAPACITY, NodeInventory
from ..requests.quantities import MEMORY_EXAMPLE, MIB, QuantityError, clip_repr, format_bytes, parse_memory

# The one GpuQuota a namespace may have is named this (the CRD's CEL rule refuses any other name).
QUOTA_NAME = "quota"
# status.reason of a slice a quota keeps Pending.
QUOTA_EXCEEDED = "QuotaExceeded"
# status.reason of a slice whose namespace has no GpuQuota, where one is required (--quota-required).
NO_QUOTA = "NoQuota"
# How long a slice refused for room keeps its namespace's younger slices waiting behind it.
DEFAULT_HOLD_S = 60.0
MAX_QUOTA_MEMORY_LENGTH = 64


@dataclass(frozen=True)
class Quota:
    """A namespace's GpuQuota spec: ``memory_bytes`` hard, ``slices`` hard when set."""

    namespace: str
    memory_bytes: int
    slices: int | None = None
    name: str = QUOTA_NAME

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Usage:
    """What a namespace's slices hold: the bytes charged (``core.books.charges``), the number of slices, and
    how many fraction GPUs it holds whole (each charged its whole memory, once)."""

    memory_bytes: int = 0
    slices: int = 0
    whole_gpus: int = 0

    def plus(self, charged_bytes: int, slices: int = 1, whole_gpus: int = 0) -> Usage:
        return Usage(self.memory_bytes + charged_bytes, self.slices + slices, self.whole_gpus + whole_gpus)


def agent_holdings(inventory: NodeInventory) -> dict[str, tuple[str, int]]:
    """What a node's agent holds, by slice UID: (namespace, granted bytes), from its GpuNode. A MIG
    instance counts while a slice owns it and it is in use (a claim still prepared on it, or a
    process), a fraction while its agent lists it. The controller charges these only for slices it
    no longer knows: a slice whose finalizer was removed while its device was still in use."""
    held: dict[str, tuple[str, int]] = {}
    for gpu in inventory.gpus:
        memory = {p.id: p.memory_mib * MIB for p in gpu.profiles}
        for inst in gpu.instances:
            if inst.slice_uid and inst.in_use:
                held[inst.slice_uid] = (inst.slice.partition("/")[0], memory.get(inst.profile_id, 0))
        for fraction in gpu.fractions:
            held[fraction.slice_uid] = (fraction.slice.partition("/")[0], fraction.granted_bytes)
    return held


def quota_from_spec(namespace: str, spec: Mapping[str, Any] | None, name: str = QUOTA_NAME) -> Quota:
    """A GpuQuota's spec as a Quota; refused (QuantityError naming the value) where the CRD refuses it."""
    spec = spec if isinstance(spec, Mapping) else {}
    memory = spec.get("memory")
    if not isinstance(memory, str):
        raise QuantityError(f"GpuQuota memory {clip_repr(memory)} must be a quantity string; "
                            f"use e.g. memory: '{MEMORY_EXAMPLE}'")
    if len(memory) > MAX_QUOTA_MEMORY_LENGTH:
        raise QuantityError(f"GpuQuota memory is too long: may not be more than {MAX_QUOTA_MEMORY_LENGTH} characters")
    slices = spec.get("slices")
    if slices is not None and (isinstance(slices, bool) or not isinstance(slices, int) or slices < 0):
        raise QuantityError(f"GpuQuota slices {clip_repr(slices)} must be a whole number >= 0; use e.g. slices: 8")
    return Quota(namespace, parse_memory(memory), slices, name)


@dataclass(frozen=True)
class Admission:
    """The verdict on one binding: ``allowed``, else why (``message``), and whether the slice could
    ever fit this quota while nothing else of its namespace is held (``could_fit``)."""

    allowed: bool
    message: str = ""
    could_fit: bool = True


def admit(quota: Quota | None, used: Usage, granted_bytes: int, at_least: bool = False, slices: int = 1,
          note: str = "") -> Admission:
    """Would bindings charging ``granted_bytes`` in all (``core.books.charges``) to ``slices`` slices (a pod's
    devices are bound together) take the namespace past its quota?

    No quota: no limit. ``at_least``: the charge is not known (no placement was found), so
    ``granted_bytes`` is a lower bound (the request's bytes) and the message says so. ``note`` says
    why the charge is what it is (a fraction GPU held whole, ``core.placement.tenancy.whole_gpu_note``).
    """
    if quota is None:
        return Admission(True)
    over_memory = used.memory_bytes + granted_bytes > quota.memory_bytes
    over_slices = quota.slices is not None and used.slices + slices > quota.slices
    if not over_memory and not over_slices:
        return Admission(True)
    could_fit = granted_bytes <= quota.memory_bytes and (quota.slices is None or quota.slices >= slices)
    add = f"{'at least ' if at_least else ''}{format_bytes(granted_bytes)}"
    held = f"{format_bytes(used.memory_bytes)} of its {format_bytes(quota.memory_bytes)} GPU memory"
    if quota.slices is not None:
        held += f" and {used.slices} of its {quota.slices} slices"
    over = " and ".join(part for part, yes in (("memory", over_memory), ("slices", over_slices)) if yes)
    message = (
        f"GpuQuota {quota.ref}: namespace {quota.namespace} holds {held}; "
        f"{'this slice' if slices == 1 else 'this group'} would add {add}{note} "
        f"and {slices} slice{'s' if slices != 1 else ''}, past the quota's {over}: it waits until the namespace "
        "releases slices or the quota is raised"
    )
    if not could_fit:
        field_name = "memory" if granted_bytes > quota.memory_bytes else "slices"
        message += f" (the quota cannot hold it even alone: raise spec.{field_name})"
    return Admission(False, message, could_fit)


def quota_missing(namespace: str, quota: Quota | None, required: bool, error: str | None = None) -> str | None:
    """Why a slice of ``namespace`` gets nothing when the cluster requires a GpuQuota (controller flag
    ``--quota-required``, chart value ``quota.required``) and the namespace has none (or one whose spec
    is not valid, ``error``); None when it may be planned. The message shows a GpuQuota to apply."""
    if not required or quota is not None:
        return None
    why = f"its GpuQuota {namespace}/{QUOTA_NAME} is not valid ({error})" if error else "it has no GpuQuota"
    return (
        f"namespace {namespace} gets no GPU: {why}, and this cluster gives slices only to namespaces with one "
        f"(the controller runs with --quota-required, chart value quota.required). An admin grants one, e.g. "
        f"kubectl apply -f - <<< '{{apiVersion: cdmo.io/v1alpha1, kind: GpuQuota, metadata: {{name: {QUOTA_NAME}, "
        f"namespace: {namespace}}}, spec: {{memory: 40Gi, slices: 4}}}}'; the slice binds then"
    )


def share(quota: Quota | None, used: Usage, cluster_bytes: int) -> Fraction:
    """How much of its due a namespace holds: the larger of its memory and slice shares of its quota,
    or its memory's share of the cluster's GPU memory when it has no quota. Past a quota of zero
    slices counts as its slices held (so more than any share within a quota)."""
    if quota is None:
        return Fraction(used.memory_bytes, cluster_bytes) if cluster_bytes > 0 else Fraction(0)
    memory = Fraction(used.memory_bytes, quota.memory_bytes)
    if quota.slices is None:
        return memory
    slices = Fraction(used.slices, quota.slices) if quota.slices > 0 else Fraction(used.slices)
    return max(memory, slices)


def holds_back(code: str, could_fit: bool, waited_s: float, hold_s: float) -> bool:
    """Whether a namespace's oldest waiting slice, just refused with ``code``, keeps the namespace's
    younger slices waiting this pass: only when it waits for room that can free (no capacity now, or
    its quota full though its grant alone fits the quota), and only for its first ``hold_s`` seconds."""
    return code in (NO_CAPACITY, QUOTA_EXCEEDED) and could_fit and 0 <= waited_s < hold_s


def held_behind(own_code: str | None) -> bool:
    """Whether a younger slice is held behind its namespace's waiting head (``holds_back``), given its
    own plan: refused with ``own_code``, or placeable (None). A slice that no freed room could serve
    (no GPU of its kind, too large, ...) keeps its own refusal: it waits for that, not for the head."""
    return own_code is None or own_code == NO_CAPACITY


T = TypeVar("T")


@dataclass(order=True)
class _Line:
    key: tuple[Fraction, Any, str]
    namespace: str = field(compare=False)


class FairQueue(Generic[T]):
    """Waiting slices in the order they are served.

    ``items`` are (namespace, age key, item); a smaller age key is older. ``next`` gives the head of
    the namespace with the smallest share (then the oldest head, then the namespace's name); after
    the caller has tried it, ``settle(namespace, share)`` puts the namespace back with its new share,
    or ``settle(namespace, share, hold=True)`` takes the rest of it out of this pass (they are
    returned, for the caller to mark as waiting). Each step costs O(log namespaces).
    """

    def __init__(self, items: Iterable[tuple[str, Any, T]], shares: Mapping[str, Fraction]) -> None:
        by_namespace: dict[str, list[tuple[Any, int, T]]] = {}
        for seq, (namespace, age, item) in enumerate(items):
            by_namespace.setdefault(namespace, []).append((age, seq, item))
        self._lines: dict[str, list[tuple[Any, int, T]]] = {}
        self._heap: list[_Line] = []
        for namespace, entries in by_namespace.items():
            entries.sort(key=lambda e: (e[0], e[1]), reverse=True)  # oldest last: popped first
            self._lines[namespace] = entries
            heapq.heappush(self._heap, _Line((shares.get(namespace, Fraction(0)), entries[-1][0], namespace),
                                             namespace))
        self._out: str | None = None

    def next(self) -> tuple[str, T] | None:
        """The next slice to try, or None when the pass is done. Call ``settle`` before the next one."""
        assert self._out is None, "settle the namespace given last before asking for the next slice"
        if not self._heap:
            return None
        line = heapq.heappop(self._heap)
        age, seq, item = self._lines[line.namespace].pop()
        self._out = line.namespace
        return line.namespace, item

    def settle(self, namespace: str, new_share: Fraction, hold: bool = False) -> list[T]:
        """Put ``namespace`` back in line with ``new_share``; with ``hold``, drop (and return) its rest."""
        assert self._out == namespace, f"settle({namespace!r}) but the slice given last is of {self._out!r}"
        self._out = None
        rest = self._lines[namespace]
        if hold or not rest:
            del self._lines[namespace]
            return [item for _age, _seq, item in reversed(rest)]
        heapq.heappush(self._heap, _Line((new_share, rest[-1][0], namespace), namespace))
        return []

    def __len__(self) -> int:
        return sum(len(v) for v in self._lines.values())
