"""The agent's owner record on the node's disk: written atomically before and after each NVML step.

The file is JSON (``core.lifecycle.OwnerRecord``): the boot id it was written in, each slice the
agent has taken on by UID, and when each idle instance became idle; beside it, the ResourceClaims
the kubelet has had prepared (claim UID -> slice UID) and the slices deleted while a claim on them
was prepared (their instances stay held until the kubelet unprepares the claim). Every change is written to a
temporary file, fsynced and renamed over the old one, so a crash leaves the old record or the new
one, never half of either; the directory is fsynced too, so the rename survives a power cut.

Versioned as NVIDIA's DRA driver checkpoint is: the file says which ``version`` wrote it; an older
version is converted on read (``_UPGRADES``, one step per version: a format change adds a step and
bumps ``VERSION``); fields this version does not know are kept and written back as they were, so an
agent downgraded later still reads what a newer one wrote (a newer record keeps its version number
when rewritten). Only a record of a newer version may carry unknown entry fields: in a version this
code knows, one is a corrupt record, refused.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from mig_operator.core.lifecycle import OwnerEntry, OwnerRecord
from mig_operator.gpu.files import write_atomically

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
VERSION = 2  # what this code writes


def _to_2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 adds an owner entry's ``compute`` (a fraction's compute share, null = shared): a
    version-1 entry has none, so it reads as shared; an agent of version 1 keeps the field unread."""
    return {**data, "version": 2}


# version -> the conversion of a record of that version to the next one.
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _to_2}
_TOP_FIELDS = ("version", "bootId", "owners", "idleSince", "preparedClaims", "revoked")
_CLAIM_FIELDS = ("namespace", "name", "sliceUID")


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


def _entry(raw: object, newer: bool) -> tuple[OwnerEntry, dict[str, Any]]:
    """One owner entry, every field of the type OwnerEntry declares (a wrongly typed one would
    never match its instance, and its instance would look unowned), and the fields it does not
    know (kept only from a newer version's record)."""
    if not isinstance(raw, dict):
        raise TypeError(f"an owner entry is {type(raw).__name__}, not an object")
    known: dict[str, Any] = {}
    unknown: dict[str, Any] = {}
    for key, value in raw.items():
        kind = _FIELD_TYPES.get(key)
        if kind is None:
            if not newer:
                raise TypeError(f"unknown field {key!r}")
            unknown[key] = value
            continue
        if kind == "float | None":
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise TypeError(f"field {key!r} is {value!r}, not a number or null")
            known[key] = None if value is None else float(value)
            continue
        expected = {"str": str, "int": int, "bool": bool}[kind]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"field {key!r} is {value!r}, not {kind}")
        known[key] = value
    return OwnerEntry(**known), unknown


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """The record converted step by step from the version that wrote it to this one (a record
    without a version is version 1, the first); a newer record is left as it is."""
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TypeError(f"version is {version!r}, not a positive integer")
    while version < VERSION:
        data = _UPGRADES[version](data)
        version += 1
    return data


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
        # What a newer version wrote that this one does not know, written back as it was: top-level
        # keys, and fields of owner entries and prepared claims (while those exist).
        self._version = VERSION  # a newer record keeps its version: its unknown fields are still in it
        self._unknown: dict[str, Any] = {}
        self._unknown_owners: dict[str, dict[str, Any]] = {}
        self._unknown_claims: dict[str, dict[str, Any]] = {}
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
            data = _upgraded(data)
            self._version = max(VERSION, data.get("version", 1))
            newer = self._version > VERSION
            owners: dict[str, OwnerEntry] = {}
            for uid, raw in (data.get("owners") or {}).items():
                owners[uid], unknown = _entry(raw, newer)
                if unknown:
                    self._unknown_owners[uid] = unknown
            self._prepared = {uid: _prepared(uid, raw) for uid, raw in (data.get("preparedClaims") or {}).items()}
            self._unknown_claims = {uid: {k: v for k, v in raw.items() if k not in _CLAIM_FIELDS}
                                    for uid, raw in (data.get("preparedClaims") or {}).items()
                                    if set(raw) - set(_CLAIM_FIELDS)}
            self._unknown = {k: v for k, v in data.items() if k not in _TOP_FIELDS}
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
            **self._unknown,
            "version": self._version,
            "bootId": record.boot_id,
            "owners": {uid: {**self._unknown_owners.get(uid, {}), **asdict(entry)}
                       for uid, entry in sorted(record.owners.items())},
            "idleSince": dict(sorted(record.idle_since.items())),
            "preparedClaims": {uid: {**self._unknown_claims.get(uid, {}), "namespace": c.namespace, "name": c.name,
                                     "sliceUID": c.slice_uid}
                               for uid, c in sorted(prepared.items())},
            "revoked": sorted(revoked),
        }
        try:
            write_atomically(self.path, lambda fh: json.dump(data, fh, indent=1), prefix=".owners-")
        except OSError as exc:
            raise RecordError(f"cannot write owner record {self.path!r}: {exc.strerror}") from None
