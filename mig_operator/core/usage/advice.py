"""Right sizes: the smaller MIG profile or fraction that would have held a slice's peak plus headroom, or
that the slice is too small (its peak reached its limit, or the shim refused allocations).

A MIG suggestion is a profile of the same GPU model (its memory as NVML reports it, ``memory_mib``), chosen
the way the planner orders profiles: by memory, then compute slices, then SMs, no ``+me`` variants. A
fraction suggestion is a whole number of GiB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from ..placement.profiles import GpuModel, Profile
from ..requests.quantities import MIB, format_bytes, short_bytes

SMALLER = "Smaller"
TOO_SMALL = "TooSmall"
DEFAULT_HEADROOM = 0.10
MAX_HEADROOM = 1.0
GIB = 2**30
# A peak within this share of the limit counts as having reached it (the last allocation that would
# have crossed it was refused, or nearly so).
FULL_SHARE = Fraction(99, 100)


@dataclass(frozen=True)
class Advice:
    """What a slice's peak says of its size: ``Smaller`` (``suggested`` would have held it, giving
    ``memory_back`` bytes back) or ``TooSmall`` (``suggested`` None, ``memory_back`` 0)."""

    verdict: str
    current: str  # the profile (MIG) or the limit as a quantity (fraction, "8Gi")
    suggested: str | None
    memory_back: int
    message: str


def needed_bytes(peak: int, headroom: float) -> int:
    """``peak`` plus ``headroom`` (0.10: 10 %), rounded up to a whole byte; exact, whatever the float."""
    return math.ceil(max(peak, 0) * (1 + Fraction(headroom).limit_denominator(10**6)))


def _headroom_text(headroom: float) -> str:
    return f"{float(headroom) * 100:g}%"


def _reached(peak: int, limit: int) -> bool:
    return limit > 0 and peak >= FULL_SHARE * limit


def _too_small(current: str, limit: int, peak: int, refusals: int) -> Advice:
    if refusals > 0:
        why = f"the shim refused {refusals} allocation{'s' if refusals != 1 else ''} at the limit {short_bytes(limit)}"
    else:
        why = f"peak {short_bytes(peak)} reached the limit {short_bytes(limit)}"
    return Advice(TOO_SMALL, current, None, 0, why)


def _order(profile: Profile) -> tuple[int, int, int]:
    return (profile.memory_mib, profile.slices, profile.sm)


def advise_mig(model: GpuModel, profile: str, peak: int, headroom: float = DEFAULT_HEADROOM) -> Advice | None:
    """The smallest profile of ``model`` holding ``peak`` plus ``headroom``, when it is smaller than
    ``profile``; TooSmall when the peak reached ``profile``'s memory; None when there is nothing to say
    (the profile already is the smallest that fits, or ``model`` does not have it)."""
    if not model.has_profile(profile):
        return None
    current = model.profile(profile)
    limit = current.memory_mib * MIB
    if _reached(peak, limit):
        return _too_small(profile, limit, peak, 0)
    need = needed_bytes(peak, headroom)
    fits = [p for p in model.profiles if p.size > 0 and not p.media_extension and p.memory_mib * MIB >= need]
    if not fits:
        return None
    best = min(fits, key=_order)
    if best.memory_mib >= current.memory_mib:
        return None
    back = (current.memory_mib - best.memory_mib) * MIB
    message = (f"peak {short_bytes(peak)} + {_headroom_text(headroom)} fits {best.name} "
               f"({short_bytes(best.memory_mib * MIB)})")
    return Advice(SMALLER, profile, best.name, back, message)


def advise_fraction(limit: int, peak: int, refusals: int, headroom: float = DEFAULT_HEADROOM) -> Advice | None:
    """A fraction of ``limit`` bytes: TooSmall when the shim refused allocations or the peak reached the
    limit; else the whole GiB holding ``peak`` plus ``headroom`` (at least 1 GiB), when below the limit."""
    current = format_bytes(limit)
    if refusals > 0 or _reached(peak, limit):
        return _too_small(current, limit, peak, refusals)
    suggested = max(1, -(-needed_bytes(peak, headroom) // GIB)) * GIB
    if suggested >= limit:
        return None
    message = f"peak {short_bytes(peak)} + {_headroom_text(headroom)} fits {format_bytes(suggested)}"
    return Advice(SMALLER, current, format_bytes(suggested), limit - suggested, message)


def advice_status(advice: Advice) -> dict:
    """``status.usage.advice`` (docs/api.md): ``suggested`` absent for TooSmall."""
    body: dict = {"verdict": advice.verdict, "current": advice.current, "memoryBack": advice.memory_back,
                  "message": advice.message}
    if advice.suggested is not None:
        body["suggested"] = advice.suggested
    return body


MAX_ADVICE_TEXT = 64
MAX_ADVICE_MESSAGE = 1024  # the CRD's maxLength


def _text(value: object, limit: int) -> str | None:
    return value if isinstance(value, str) and len(value) <= limit and value.isprintable() else None


def parse_advice(usage: object) -> Advice | None:
    """``status.usage.advice`` as the agent wrote it; None when absent or not well formed (bounded: a known
    verdict, short printable strings, a whole number of bytes)."""
    raw = usage.get("advice") if isinstance(usage, Mapping) else None
    if not isinstance(raw, Mapping) or raw.get("verdict") not in (SMALLER, TOO_SMALL):
        return None
    current = _text(raw.get("current"), MAX_ADVICE_TEXT)
    suggested = _text(raw.get("suggested"), MAX_ADVICE_TEXT) if raw.get("suggested") is not None else None
    back = raw.get("memoryBack", 0)
    message = _text(raw.get("message", ""), MAX_ADVICE_MESSAGE)
    if current is None or message is None or isinstance(back, bool) or not isinstance(back, int) or back < 0:
        return None
    if (raw["verdict"] == SMALLER) != (suggested is not None):
        return None
    return Advice(raw["verdict"], current, suggested, back, message)
