"""Durations as people write them in flags and specs: ``30s``, ``10m``, ``1.5h``, ``2d`` (a plain number is
seconds); positive and at most a year. The one grammar of the CLI's duration flags and of
GpuQuota ``spec.idlePodTimeout`` (whose CRD pattern asks for the unit)."""

from __future__ import annotations

import re

from .quantities import QuantityError, clip_repr

DURATION_EXAMPLE = "10m"
_DURATION = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>ms|s|m|h|d)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
MAX_DURATION_S = 365 * 86400.0
MAX_DURATION_LENGTH = 32
# What a spec field takes (its CRD's pattern, e.g. GpuQuota spec.idlePodTimeout): the unit written out.
SPEC_DURATION_PATTERN = "^[0-9]+([.][0-9]+)?(ms|s|m|h|d)$"
_SPEC_DURATION = re.compile(SPEC_DURATION_PATTERN)


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``10m``, ``1.5h``, ``2d`` or a plain number of seconds; positive, under a year."""
    match = _DURATION.match(text.strip()) if isinstance(text, str) and len(text) <= MAX_DURATION_LENGTH else None
    if match is None:
        clipped = text if len(str(text)) <= 40 else str(text)[:40] + "…"
        raise QuantityError(f"duration {clipped!r} is not a duration; use e.g. {DURATION_EXAMPLE!r} or '30s'")
    seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    if not 0 < seconds <= MAX_DURATION_S:
        raise QuantityError(f"duration {text!r} must be more than 0 and at most a year; use e.g. {DURATION_EXAMPLE!r}")
    return seconds


def parse_spec_duration(text: object) -> float:
    """A spec field's duration (``SPEC_DURATION_PATTERN``: ``30m``, ``2h``, ``1.5h``) in seconds; refused
    (QuantityError naming the value) as its CRD refuses it, or as ``parse_duration`` does."""
    if not isinstance(text, str) or len(text) > MAX_DURATION_LENGTH or not _SPEC_DURATION.match(text):
        raise QuantityError(f"duration {clip_repr(text)} is not a duration with its unit (ms, s, m, h, d); "
                            f"use e.g. {DURATION_EXAMPLE!r} or '2h'")
    return parse_duration(text)
