"""The agent's owner record on the node's disk: written atomically before and after each NVML step.

The file is JSON (``core.node.lifecycle.OwnerRecord``): the boot id it was written in, each slice the
agent has taken on by UID, and when each idle instance became idle; beside it, the ResourceClaims
the kubelet has had prepared (claim UID -> slice UID) and the slices deleted while a claim on them
was prepared (their instances stay held until the kubelet unprepares the claim). Every change is written to a
temporary file, fsynced and renamed over the old one, so a crash leaves the old record or the new
one, never half of either; the directory is fsynced too, so the rename survives a power cut.

Changes made while a write is under way share the next write (a group commit): a burst of slices on
one node costs a few fsyncs, not one each. A change returns once a write holding it is on disk, and
what ``record`` shows is what the file holds; a failed write loses every change staged with it, and
each of their callers gets the error.

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
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from mig_operator.core.node.lifecycle import OwnerEntry, OwnerRecord
from mig_operator.gpu.files import write_atomically

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


_State = tuple[OwnerRecord, dict[str, PreparedClaim], frozenset[str]]  # record, prepared claims, revoked
_R = TypeVar("_R")


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


class RecordStore:
    """The owner record in memory and on disk; every change goes through ``update`` (or the prepared
    claims' and revocations' methods), staged in memory and then written with whatever else was staged."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()  # the staged state and the generations
        self._write_lock = threading.Lock()  # one write at a time
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
        # Staged: the written state with the changes not written yet. Each change gets the next
        # generation; ``_written`` is the newest generation on disk, and generations up to ``_lost``
        # that never reached it were dropped by a failed write (``_lost_error`` says why).
        self._staged: _State = (self._record, self._prepared, self._revoked)
        self._generation = self._written = self._lost = 0
        self._lost_error = ""

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
        self._change(lambda record, prepared, revoked: ((record, {**prepared, claim.claim_uid: claim}, revoked), None))

    def drop_prepared(self, claim_uid: str) -> PreparedClaim | None:
        """Forget a prepared claim; a revoked slice no claim names any more is dropped with it (its
        instance becomes idle from ``now``). Returns the claim forgotten, if any."""
        def change(record: OwnerRecord, prepared: dict[str, PreparedClaim], revoked: frozenset[str]
                   ) -> tuple[_State | None, PreparedClaim | None]:
            if claim_uid not in prepared:
                return None, None
            rest = dict(prepared)
            return (record, rest, revoked), rest.pop(claim_uid)

        return self._change(change)

    def revoke(self, slice_uid: str) -> None:
        """Slice ``slice_uid`` is gone but a claim on it is prepared: keep its owner entry, held."""
        self._change(lambda record, prepared, revoked: ((record, prepared, revoked | {slice_uid}), None))

    def update(self, change: Callable[[OwnerRecord], OwnerRecord]) -> OwnerRecord:
        """Apply ``change`` to the record and write it; ``record`` shows the change once it is written."""
        def staged(record: OwnerRecord, prepared: dict[str, PreparedClaim], revoked: frozenset[str]
                   ) -> tuple[_State, OwnerRecord]:
            new = change(record)
            # A slice no longer in the record is no longer held for a claim.
            return (new, prepared, frozenset(uid for uid in revoked if uid in new.owners)), new

        return self._change(staged)

    def _change(self, change: Callable[..., tuple[_State | None, _R]]) -> _R:
        """Stage ``change`` (given the staged record, prepared claims and revocations, it returns their
        new values, or None for no change, and what to return), then wait until a write holds it."""
        with self._lock:
            new, result = change(*self._staged)
            if new is None:
                return result
            self._staged = new
            self._generation += 1
            generation = self._generation
        self._commit(generation)
        return result

    def _commit(self, generation: int) -> None:
        with self._write_lock:
            with self._lock:
                if generation <= self._written:
                    return  # a write since this change was staged held it
                if generation <= self._lost:
                    raise RecordError(self._lost_error)
                state, upto = self._staged, self._generation
            try:
                self._write(*state)
            except BaseException as exc:
                with self._lock:  # every change staged so far is gone: back to what the file holds
                    self._staged = (self._record, self._prepared, self._revoked)
                    self._lost = self._generation
                    self._lost_error = (str(exc) if isinstance(exc, RecordError) else
                                        f"cannot write owner record {self.path!r}: {type(exc).__name__}: {exc}")
                raise
            with self._lock:
                self._record, self._prepared, self._revoked = state
                self._written = upto

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
            "owners": {uid: {**self._unknown_owners.get(uid, {}), **{f: getattr(entry, f) for f in _FIELD_TYPES}}
                       for uid, entry in sorted(record.owners.items())},
            "idleSince": dict(sorted(record.idle_since.items())),
            "preparedClaims": {uid: {**self._unknown_claims.get(uid, {}), "namespace": c.namespace, "name": c.name,
                                     "sliceUID": c.slice_uid}
                               for uid, c in sorted(prepared.items())},
            "revoked": sorted(revoked),
        }
        try:
            # One line: json.dumps encodes it in C, where indenting (or json.dump) takes the pure-Python
            # encoder, the larger part of a write's CPU in a burst (bench/results/benchmark-history.md).
            write_atomically(self.path, json.dumps(data), prefix=".owners-")
        except OSError as exc:
            raise RecordError(f"cannot write owner record {self.path!r}: {exc.strerror}") from None
