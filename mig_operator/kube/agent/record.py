"""The agent's owner record on the node's disk: written atomically before and after each NVML step.

The file is JSON (``core.lifecycle.OwnerRecord``): the boot id it was written in, each slice the
agent has taken on by UID, and when each idle instance became idle. Every change is written to a
temporary file, fsynced and renamed over the old one, so a crash leaves the old record or the new
one, never half of either; the directory is fsynced too, so the rename survives a power cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, fields, replace

from mig_operator.core.lifecycle import OwnerEntry, OwnerRecord

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_VERSION = 1


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
        self._record = self._read()

    @property
    def record(self) -> OwnerRecord:
        return self._record

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
            self._write(new)
            self._record = new
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

    def _write(self, record: OwnerRecord) -> None:
        data = {
            "version": _VERSION,
            "bootId": record.boot_id,
            "owners": {uid: asdict(entry) for uid, entry in sorted(record.owners.items())},
            "idleSince": dict(sorted(record.idle_since.items())),
        }
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, tmp = tempfile.mkstemp(prefix=".owners-", dir=directory)
        except OSError as exc:
            raise RecordError(f"cannot write owner record {self.path!r}: {exc.strerror}") from None
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise RecordError(f"cannot write owner record {self.path!r}: {exc.strerror}") from None
            raise
