"""Times as the API writes them (RFC 3339, ``2026-11-29T06:00:00Z``): read from a body that may hold
anything, and written."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

MAX_TIME_LENGTH = 64


def read_time(value: Any) -> datetime | None:
    """An RFC 3339 time with its zone; None when ``value`` is not one (absent, another type, naive, not
    ASCII, or longer than MAX_TIME_LENGTH characters)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TIME_LENGTH or not value.isascii():
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def rfc3339(when: datetime) -> str:
    """``2026-11-29T06:00:00Z``: UTC to the second, as the API's own timestamps."""
    return when.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
