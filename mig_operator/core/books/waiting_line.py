"""The line of slices waiting for a binding, as the ledger (core.books.ledger) keeps it."""

from __future__ import annotations

from ..placement.cluster import NO_CAPACITY
from .quota import QUOTA_EXCEEDED


class WaitingLine:
    """Refused slices by uid -> (namespace, refusal code), counted so that whether a new slice must
    queue costs O(1)."""

    def __init__(self) -> None:
        self.waiting: dict[str, tuple[str, str]] = {}
        self._by_namespace: dict[str, int] = {}
        self._for_room = 0  # how many wait for GPU room (NoCapacity)
        self._touched: set[str] = set()  # namespaces whose waiting slices changed, not yet drained

    def set(self, uid: str, entry: tuple[str, str] | None) -> None:
        """Put ``uid`` in line with (namespace, code), or take it out (None)."""
        old = self.waiting.pop(uid, None)
        if old is not None:
            self._by_namespace[old[0]] -= 1
            if not self._by_namespace[old[0]]:
                del self._by_namespace[old[0]]
            self._for_room -= old[1] == NO_CAPACITY
        if entry is not None:
            self.waiting[uid] = entry
            self._by_namespace[entry[0]] = self._by_namespace.get(entry[0], 0) + 1
            self._for_room += entry[1] == NO_CAPACITY
        if old != entry:
            self._touched.update(e[0] for e in (old, entry) if e is not None)

    def in_line(self, namespace: str) -> bool:
        """Whether a new slice of ``namespace`` must queue: slices wait for GPU room, or older slices
        of its own namespace wait (for room or for its quota)."""
        return self._for_room > 0 or namespace in self._by_namespace

    def drain_touched(self) -> set[str]:
        """The namespaces whose waiting slices changed since the last call (their GpuQuota status)."""
        touched, self._touched = self._touched, set()
        return touched

    def quota_waiting(self, namespace: str) -> int:
        """Pending slices of ``namespace`` held back by its quota (status.waiting of its GpuQuota)."""
        return sum(1 for ns, reason in self.waiting.values() if ns == namespace and reason == QUOTA_EXCEEDED)

    def by_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _ns, reason in self.waiting.values():
            counts[reason] = counts.get(reason, 0) + 1
        return counts
