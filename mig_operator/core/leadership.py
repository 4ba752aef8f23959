"""Which controller replica acts: the rule kopf's peering pauses replicas by, read from the status of the
ClusterKopfPeering the replicas share (peer identity -> priority, lastseen, lifetime).

A replica acts while its own entry is live and no other live entry has a priority as high as its own (kopf
pauses every replica of a tied priority). A replica that starts acts only once it has seen its own entry
in two reads at least ``SETTLE_S`` apart: a replica started beside it in the same moment has written its
own entry by the second read, so two replicas started together never both act.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

SETTLE_S = 1.0
MAX_PEERS = 1024  # more entries than this in one peering object are not read (none is the operator's)


@dataclass(frozen=True)
class Standing:
    """What one read of the peering says of this replica: ``own`` (its entry is there and live) and
    ``outranked`` (another live entry's priority is as high or higher)."""

    own: bool
    outranked: bool


def _seconds(value: Any) -> float | None:
    """An RFC 3339 time as seconds since the epoch; None when it is not one (bounded, ASCII)."""
    if not isinstance(value, str) or len(value) > 64 or not value.isascii():
        return None
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        return None
    return stamp.timestamp()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def read_standing(status: Any, own_id: str, own_priority: int, now: float) -> Standing:
    """This replica's standing among the live peers of a peering's ``status``; entries that cannot be
    read count as absent."""
    if not isinstance(status, Mapping):
        return Standing(own=False, outranked=False)
    own = outranked = False
    for index, (peer, entry) in enumerate(status.items()):
        if index >= MAX_PEERS:
            break
        if not isinstance(entry, Mapping):
            continue
        seen, lifetime, priority = _seconds(entry.get("lastseen")), _number(entry.get("lifetime")), _number(
            entry.get("priority"))
        if seen is None or lifetime is None or priority is None or seen + lifetime < now:
            continue  # dead, or not an entry
        if peer == own_id:
            own = True
        elif priority >= own_priority:
            outranked = True
    return Standing(own=own, outranked=outranked)


class Settling:
    """Whether this replica acts, read after read: not until its own entry has been seen in two reads
    ``settle_s`` apart, then for as long as it is not outranked."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self._own_since: float | None = None

    def acts(self, standing: Standing, now: float) -> bool:
        if not standing.own:
            self._own_since = None
            return False
        if self._own_since is None:
            self._own_since = now
        return now - self._own_since >= self.settle_s and not standing.outranked
