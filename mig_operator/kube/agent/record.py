"""The agent's owner record on the node's disk: written atomically before and after each NVML step.

The file is JSON (``core.lifecycle.OwnerRecord``): the boot id it was written in, each slice the
agent has taken on by UID, and when each idle instance became idle; beside it, the ResourceClaims
the kubelet has had prepared (claim UID -> slice UID) and the slices deleted while a claim on them
was prepared (their instances stay held until the kubelet unprepares the claim). Every change is written to a
temporary file, fsynced and renamed over the old one, so a crash leaves the old record or the new
one, never half of either; the directory is fsynced too, so the rename survives a power cut.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

from mig_operator.core.lifecycle import OwnerEntry, OwnerRecord
from mig_operator.gpu.files import write_atomically

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_VERSION = 1


@dataclass(frozen=True)
class PreparedClaim:
    """A ResourceClaim the kubelet had the agent prepare: which slice's device it got."""

    claim_uid: str
    namespace: str
    name: str
    slice_uid: str


class RecordError(Exception):
    """The record file cannot be read or written; the message names the file and the cause."""


_FIELD_TYPES = {f.name: f.type for f in fields(OwnerEntry)}


def _entry(raw: object) -> OwnerEntry:
    """One owner entry, every field of the type OwnerEntry declares (a wrongly typed one would
    never match its instance, and its instance would look unowned)."""
    if not isinstance(raw, dict):
        raise TypeError(f"an owner entry is {type(raw).__name__}, not an object")
    for key, value in raw.items():
        kind = _FIELD_TYPES.get(key)
        if kind is None:
            raise TypeError(f"unknown field {key!r}")
        expected = {"str": str, "int": int, "bool": bool}[kind]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"field {key!r} is {value!r}, not {kind}")
    return OwnerEntry(**raw)


def _prepared(claim_uid: str, raw: object) -> PreparedClaim:
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in ("namespace", "name", "sliceUID")):
        raise TypeError(f"prepared claim {claim_uid!r} is {raw!r}, not {{namespace, name, sliceUID}}")
    return PreparedClaim(str(claim_uid), raw["namespace"], raw["name"], raw["sliceUID"])


def boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot's id: MIG instances do not survive a reboot, so a record from another boot is stale."""
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


class RecordStore:
    """The owner record in memory and on disk; every change goes through ``update``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.exists(path) and not os.path.isfile(path):
            raise RecordError(f"owner record {path!r} exists and is not a regular file; "
                              "use e.g. /var/lib/mig-operator/owners.json")
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise RecordError(f"cannot create the directory of owner record {path!r}: {exc.strerror}") from None
        self._prepared: dict[str, PreparedClaim] = {}
        self._revoked: frozenset[str] = frozenset()
        self._record = self._read()

    @property
    def record(self) -> OwnerRecord:
        return self._record

    @property
    def prepared(self) -> dict[str, PreparedClaim]:
        """Prepared claims by claim UID (a copy)."""
        return dict(self._prepared)

    @property
    def revoked(self) -> frozenset[str]:
        """Slice UIDs whose slice is gone while a claim on it is prepared: held, never handed out."""
        return self._revoked

    def claims_on(self, slice_uid: str) -> list[PreparedClaim]:
        return [c for c in self._prepared.values() if c.slice_uid == slice_uid]

    def put_prepared(self, claim: PreparedClaim) -> None:
        with self._lock:
            prepared = {**self._prepared, claim.claim_uid: claim}
            self._write(self._record, prepared, self._revoked)
            self._prepared = prepared

    def drop_prepared(self, claim_uid: str) -> PreparedClaim | None:
        """Forget a prepared claim; a revoked slice no claim names any more is dropped with it (its
        instance becomes idle from ``now``). Returns the claim forgotten, if any."""
        with self._lock:
            prepared = dict(self._prepared)
            claim = prepared.pop(claim_uid, None)
            if claim is None:
                return None
            self._write(self._record, prepared, self._revoked)
            self._prepared = prepared
            return claim

    def revoke(self, slice_uid: str) -> None:
        """Slice ``slice_uid`` is gone but a claim on it is prepared: keep its owner entry, held."""
        with self._lock:
            revoked = self._revoked | {slice_uid}
            self._write(self._record, self._prepared, revoked)
            self._revoked = revoked

    def _read(self) -> OwnerRecord:
        try:
            with open(self.path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return OwnerRecord()
        except (OSError, ValueError) as exc:
            raise RecordError(f"owner record {self.path!r} is unreadable ({exc}); "
                              "move it aside to start afresh") from None
        try:
            owners = {uid: _entry(entry) for uid, entry in (data.get("owners") or {}).items()}
            self._prepared = {uid: _prepared(uid, raw) for uid, raw in (data.get("preparedClaims") or {}).items()}
            self._revoked = frozenset(str(uid) for uid in (data.get("revoked") or ()))
            return OwnerRecord(
                boot_id=str(data.get("bootId", "")),
                owners=owners,
                idle_since={str(k): str(v) for k, v in (data.get("idleSince") or {}).items()},
            )
        except (TypeError, AttributeError, ValueError) as exc:
            raise RecordError(f"owner record {self.path!r} is not a record ({exc}); "
                              "move it aside to start afresh") from None

    def update(self, change: Callable[[OwnerRecord], OwnerRecord]) -> OwnerRecord:
        """Apply ``change`` to the record and write it; the in-memory record changes only if the write did."""
        with self._lock:
            new = change(self._record)
            # A slice no longer in the record is no longer held for a claim.
            revoked = frozenset(uid for uid in self._revoked if uid in new.owners)
            self._write(new, self._prepared, revoked)
            self._record, self._revoked = new, revoked
            return new

    def put(self, entry: OwnerEntry) -> OwnerRecord:
        def change(record: OwnerRecord) -> OwnerRecord:
            idle = dict(record.idle_since)
            idle.pop(entry.device_uuid, None)
            return replace(record, owners={**record.owners, entry.uid: entry}, idle_since=idle)

        return self.update(change)

    def drop(self, uid: str, idle_at: str | None) -> OwnerRecord:
        """Forget slice ``uid``; its instance (if any) is idle from ``idle_at``."""
        def change(record: OwnerRecord) -> OwnerRecord:
            owners = dict(record.owners)
            entry = owners.pop(uid, None)
            idle = dict(record.idle_since)
            if entry is not None and entry.device_uuid and idle_at is not None:
                idle[entry.device_uuid] = idle_at
            return replace(record, owners=owners, idle_since=idle)

        return self.update(change)

    def _write(self, record: OwnerRecord, prepared: dict[str, PreparedClaim], revoked: frozenset[str]) -> None:
        data = {
            "version": _VERSION,
            "bootId": record.boot_id,
            "owners": {uid: asdict(entry) for uid, entry in sorted(record.owners.items())},
            "idleSince": dict(sorted(record.idle_since.items())),
            "preparedClaims": {uid: {"namespace": c.namespace, "name": c.name, "sliceUID": c.slice_uid}
                               for uid, c in sorted(prepared.items())},
            "revoked": sorted(revoked),
        }
        try:
            write_atomically(self.path, lambda fh: json.dump(data, fh, indent=1), prefix=".owners-")
        except OSError as exc:
            raise RecordError(f"cannot write owner record {self.path!r}: {exc.strerror}") from None
