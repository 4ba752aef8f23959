"""A slice's usage figures: one reading on its node (``UsageSample``) folded into what ``status.usage`` holds
(``SliceUsage``), when that is worth a status write, its body, and reading it back from a status.

The status is written by the bound node's agent only (the status subresource), but it is read back by
the agent after a restart, the controller and the commands: ``parse_usage`` is bounded and tolerant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..requests.quantities import MAX_BYTES, short_bytes
from ..times import read_time, rfc3339
from .advice import Advice, advice_status

# A figure moving by more than this share of the slice's memory is worth a status write.
WRITE_SHARE_PERCENT = 5
MAX_PROCESSES = 2**31 - 1


@dataclass(frozen=True)
class UsageSample:
    """One reading of one slice on its node."""

    memory_used: int  # bytes
    processes: int
    active_percent: int | None  # None: not available (MIG devices)
    refusals: int = 0  # allocations the shim refused (fractions)
    ledger_peak: int = 0  # the shim ledger's own high-water mark (fractions), 0 otherwise


@dataclass(frozen=True)
class SliceUsage:
    """What ``status.usage`` holds."""

    memory_used: int
    memory_peak: int
    processes: int
    active_percent: int | None
    refusals: int
    last_active: datetime | None
    observed_at: datetime


def next_usage(previous: SliceUsage | None, sample: UsageSample, now: datetime) -> SliceUsage:
    """``previous`` with ``sample`` read at ``now``: the peak never goes down (the ledger's own peak counts,
    it sees allocations between readings); refusals never go down (a ledger made anew starts at 0);
    ``last_active`` is ``now`` while a process runs."""
    peak = max(previous.memory_peak if previous else 0, sample.memory_used, sample.ledger_peak)
    refusals = max(previous.refusals if previous else 0, sample.refusals)
    last_active = now if sample.processes > 0 else (previous.last_active if previous else None)
    return SliceUsage(memory_used=sample.memory_used, memory_peak=peak, processes=sample.processes,
                      active_percent=sample.active_percent, refusals=refusals, last_active=last_active,
                      observed_at=now)


def _moved(before: int, after: int, slice_memory: int) -> bool:
    return abs(after - before) * 100 > WRITE_SHARE_PERCENT * max(slice_memory, 0)


def worth_writing(written: SliceUsage | None, current: SliceUsage, slice_memory: int) -> bool:
    """Whether ``current`` differs enough from the usage last ``written`` to write the status: nothing written
    yet; memory in use or the peak moved by more than 5 % of ``slice_memory``; processes went from none to
    some or back; the first refusal.

    ``last_active`` alone never is: while processes run, the written ``processes`` says the slice is active
    now, and the write that shows them all gone carries the moment one was last seen. Writing it as it
    moves would cost one write a minute per busy slice (33 a second at 2,000 slices)."""
    if written is None:
        return True
    if _moved(written.memory_used, current.memory_used, slice_memory):
        return True
    if _moved(written.memory_peak, current.memory_peak, slice_memory):
        return True
    if (written.processes > 0) != (current.processes > 0):
        return True
    return (written.refusals > 0) != (current.refusals > 0)


def usage_status(usage: SliceUsage, advice: Advice | None) -> dict:
    """The ``status.usage`` body (docs/api.md); ``activePercent``, ``lastActive`` and ``advice`` absent when
    there is none. ``used`` and ``peak`` are the short forms kubectl's columns show."""
    body: dict[str, Any] = {
        "memoryUsed": usage.memory_used, "memoryPeak": usage.memory_peak, "processes": usage.processes,
        "refusals": usage.refusals, "observedAt": rfc3339(usage.observed_at),
        "used": short_bytes(usage.memory_used), "peak": short_bytes(usage.memory_peak),
    }
    if usage.active_percent is not None:
        body["activePercent"] = usage.active_percent
    if usage.last_active is not None:
        body["lastActive"] = rfc3339(usage.last_active)
    if advice is not None:
        body["advice"] = advice_status(advice)
    return body


def _count(value: Any, high: int) -> int | None:
    """A whole number from 0 to ``high`` as JSON gives it (an int, not a bool, not text); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        return None
    return value


def parse_usage(status: Mapping | None) -> SliceUsage | None:
    """The ``usage`` of a GpuSlice's ``status``; None when absent or when a figure it cannot do without
    (``memoryUsed``, ``memoryPeak``, ``processes``, ``observedAt``) is missing or not well formed. A
    malformed optional figure is dropped (``activePercent``, ``lastActive``: None; ``refusals``: 0).
    Never raises: the body is read, not trusted."""
    usage = status.get("usage") if isinstance(status, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    used = _count(usage.get("memoryUsed"), MAX_BYTES)
    peak = _count(usage.get("memoryPeak"), MAX_BYTES)
    processes = _count(usage.get("processes"), MAX_PROCESSES)
    observed = read_time(usage.get("observedAt"))
    if used is None or peak is None or processes is None or observed is None:
        return None
    return SliceUsage(memory_used=used, memory_peak=max(peak, used), processes=processes,
                      active_percent=_count(usage.get("activePercent"), 100),
                      refusals=_count(usage.get("refusals"), MAX_PROCESSES) or 0,
                      last_active=read_time(usage.get("lastActive")), observed_at=observed)
