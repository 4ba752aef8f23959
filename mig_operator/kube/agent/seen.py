"""The agent's books of its node's slices: the latest of each slice its watch brought (or read again),
by UID, or that it is gone. Watch events only record here; ``NodeAgent.reconcile`` reads the entry of
its key and acts on it, so a failed step is tried again from what is known then, never from an event
that may not come again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..common.client import resource_version


@dataclass
class SeenSlice:
    body: Mapping  # the slice as last seen (kube/common/trim.py's slice_body)
    gone: bool = False  # deleted, or no longer bound to this node (the watch's field selector)
    stale: bool = False  # a write on it met a conflict: read it again before acting

    @property
    def version(self) -> int:
        return resource_version(self.body["metadata"])


class SeenSlices:
    """One entry per slice UID; a body older than the one recorded is ignored, and a deletion is final."""

    def __init__(self) -> None:
        self._by_uid: dict[str, SeenSlice] = {}

    def take(self, body: Mapping, gone: bool = False) -> bool:
        """Record ``body`` (or that its slice is gone); False when it says nothing newer than the entry."""
        uid = body["metadata"]["uid"]
        known = self._by_uid.get(uid)
        if known is not None and (known.gone or (not gone and resource_version(body["metadata"]) < known.version)):
            return False
        self._by_uid[uid] = SeenSlice(body, gone)
        return True

    def get(self, uid: str) -> SeenSlice | None:
        return self._by_uid.get(uid)

    def mark_stale(self, uid: str) -> None:
        known = self._by_uid.get(uid)
        if known is not None:
            known.stale = True

    def forget(self, uid: str, entry: SeenSlice) -> None:
        """Drop the entry, unless a newer one replaced it meanwhile."""
        if self._by_uid.get(uid) is entry:
            del self._by_uid[uid]

    def __len__(self) -> int:
        return len(self._by_uid)

    def __contains__(self, uid: object) -> bool:
        return uid in self._by_uid
