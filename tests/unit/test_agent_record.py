"""kube.agent.record.RecordStore: the owner record on disk, written atomically.

A failed write must leave the old file and the in-memory record as they were; a file that is not a
record is refused with a RecordError that names it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace

import pytest

from mig_operator.core.node.lifecycle import COMPLETED, STARTED, OwnerEntry, OwnerRecord
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG
from mig_operator.gpu import files as files_module
from mig_operator.kube.agent import record as record_module
from mig_operator.kube.agent.record import PreparedClaim, RecordError, RecordStore

MIG_ENTRY = OwnerEntry("uid-a", "ns/a", MODE_MIG, 1, COMPLETED, 16384 * 2**20, 19, "1g.18gb", 3, 1, 7, 0, "MIG-7",
                       reused=True)
FRACTION_ENTRY = OwnerEntry("uid-b", "ns/b", MODE_FRACTION, 0, COMPLETED, 4 * 2**30, device_uuid="GPU-0")
STARTED_ENTRY = OwnerEntry("uid-c", "ns/c", MODE_MIG, 0, STARTED, 33280 * 2**20, 14, "2g.35gb", 2, 2)


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".owners-"))


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "owners.json")


def test_missing_file_is_an_empty_record(path) -> None:
    store = RecordStore(path)
    assert store.record == OwnerRecord()
    assert not os.path.exists(path)  # reading writes nothing


def test_round_trip_through_the_file(path) -> None:
    store = RecordStore(path)
    store.update(lambda r: replace(r, boot_id="boot-1"))
    store.put(MIG_ENTRY)
    store.put(FRACTION_ENTRY)
    store.put(STARTED_ENTRY)
    store.update(lambda r: replace(r, idle_since={"MIG-9": "2024-01-01T00:00:00.000Z"}))
    again = RecordStore(path).record
    assert again == OwnerRecord("boot-1", {e.uid: e for e in (MIG_ENTRY, FRACTION_ENTRY, STARTED_ENTRY)},
                                {"MIG-9": "2024-01-01T00:00:00.000Z"})
    assert again == store.record
    assert leftovers(os.path.dirname(path)) == []


def test_file_is_json_with_the_boot_id_and_owners_by_uid(path) -> None:
    store = RecordStore(path)
    store.update(lambda r: replace(r, boot_id="b"))
    store.put(MIG_ENTRY)
    with open(path) as fh:
        data = json.load(fh)
    assert data["bootId"] == "b"
    assert data["owners"]["uid-a"]["gi_id"] == 7
    assert data["owners"]["uid-a"]["device_uuid"] == "MIG-7"


def test_directory_is_created(tmp_path) -> None:
    path = tmp_path / "a" / "b" / "owners.json"
    RecordStore(str(path)).put(MIG_ENTRY)
    assert RecordStore(str(path)).record.owners == {"uid-a": MIG_ENTRY}


def test_update_returns_and_keeps_the_new_record(path) -> None:
    store = RecordStore(path)
    new = store.put(MIG_ENTRY)
    assert store.record is new
    assert new.owners == {"uid-a": MIG_ENTRY}


# --- a crash during the write ----------------------------------------------------------------------------


def _stored(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _assert_as_before(store: RecordStore, path: str, disk: bytes, memory: OwnerRecord) -> None:
    """The file, the in-memory record and the directory are as before a failed write."""
    assert _stored(path) == disk
    assert store.record is memory
    assert leftovers(os.path.dirname(path)) == []


def test_failure_while_serialising_leaves_old_file_and_memory(path) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record
    bad = replace(FRACTION_ENTRY, device_uuid=object())  # json.dump fails half-way through the file
    with pytest.raises(TypeError):
        store.put(bad)
    assert _stored(path) == before_disk
    assert store.record is before_memory and store.record.owners == {"uid-a": MIG_ENTRY}
    assert leftovers(os.path.dirname(path)) == []
    assert RecordStore(path).record.owners == {"uid-a": MIG_ENTRY}


def test_encoding_interrupted_leaves_old_file_and_memory(path, monkeypatch) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record

    def crash(data, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(record_module.json, "dumps", crash)
    with pytest.raises(KeyboardInterrupt):
        store.drop("uid-a", "2024-01-01T00:00:00.000Z")
    monkeypatch.undo()
    _assert_as_before(store, path, before_disk, before_memory)
    store.put(FRACTION_ENTRY)  # the interrupted change is gone; the next one is written on the old record
    assert set(RecordStore(path).record.owners) == {"uid-a", "uid-b"}


def test_a_write_cut_short_leaves_old_file(path, monkeypatch) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record
    real_fdopen = files_module.os.fdopen

    class HalfFile:
        """Writes half of what it is given to the temporary file, then the machine stops."""

        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            self.fh.write(text[: len(text) // 2])
            raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(files_module.os, "fdopen", lambda fd, mode: HalfFile(real_fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        store.drop("uid-a", "2024-01-01T00:00:00.000Z")
    monkeypatch.undo()
    _assert_as_before(store, path, before_disk, before_memory)


def test_rename_failing_gives_record_error_and_leaves_old_file_and_memory(path, monkeypatch) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record

    def refuse(src, dst, *a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record_module.os, "replace", refuse)
    with pytest.raises(RecordError) as info:
        store.put(FRACTION_ENTRY)
    monkeypatch.undo()
    assert path in str(info.value)
    _assert_as_before(store, path, before_disk, before_memory)


def test_fsync_failing_gives_record_error_and_keeps_memory(path, monkeypatch) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(record_module.os, "fsync", broken)
    with pytest.raises(RecordError):
        store.put(FRACTION_ENTRY)
    monkeypatch.undo()
    _assert_as_before(store, path, before_disk, before_memory)


def test_change_function_raising_writes_nothing(path) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    before_disk, before_memory = _stored(path), store.record

    def change(record):
        raise ValueError("no")

    with pytest.raises(ValueError):
        store.update(change)
    assert _stored(path) == before_disk and store.record is before_memory


def test_temp_file_cannot_be_created_gives_record_error(path, monkeypatch) -> None:
    store = RecordStore(path)

    def no_temp(*a, **kw):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(files_module.tempfile, "mkstemp", no_temp)
    with pytest.raises(RecordError) as info:
        store.put(MIG_ENTRY)
    assert path in str(info.value)
    assert store.record == OwnerRecord()


# --- files that are not records ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "not json",
        "[]",
        "null",
        "5",
        '"owners"',
        '{"owners": [1]}',
        '{"owners": {"u": 5}}',
        '{"owners": {"u": "x"}}',
        '{"owners": {"u": {"uid": "u"}}}',  # fields missing
        '{"owners": {"u": {"uid": "u", "slice": "s", "mode": "mig", "gpu": 0, "colour": "red"}}}',
        '{"idleSince": [1]}',
        '{"idleSince": "x"}',
    ],
)
def test_file_that_is_not_a_record_is_refused_naming_the_file(path, content: str) -> None:
    with open(path, "w") as fh:
        fh.write(content)
    with pytest.raises(RecordError) as info:
        RecordStore(path)
    assert path in str(info.value)


def test_undecodable_bytes_are_refused_naming_the_file(path) -> None:
    with open(path, "wb") as fh:
        fh.write(b"\xff\xfe\x00garbage")
    with pytest.raises(RecordError) as info:
        RecordStore(path)
    assert path in str(info.value)


@pytest.mark.parametrize("field", [("gpu", "0"), ("gi_id", None), ("mode", 7)])
def test_entry_with_wrongly_typed_fields_is_refused(path, field) -> None:
    entry = {"uid": "u", "slice": "ns/u", "mode": "mig", "gpu": 0, "gi_id": 3, "device_uuid": "MIG-3"}
    entry[field[0]] = field[1]
    with open(path, "w") as fh:
        json.dump({"bootId": "b", "owners": {"u": entry}}, fh)
    with pytest.raises(RecordError):
        RecordStore(path)


def test_a_directory_at_the_path_is_refused(tmp_path) -> None:
    path = tmp_path / "owners.json"
    path.mkdir()
    with pytest.raises(RecordError) as info:
        RecordStore(str(path))
    assert str(path) in str(info.value)


def test_a_fifo_at_the_path_is_refused_without_blocking(tmp_path) -> None:
    path = tmp_path / "owners.json"
    os.mkfifo(path)
    outcome: dict[str, object] = {}

    def attempt() -> None:
        try:
            RecordStore(str(path))
        except RecordError as exc:
            outcome["error"] = exc
        else:
            outcome["store"] = True

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():  # blocked opening the pipe for reading: let it go, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("RecordStore blocked reading a FIFO instead of refusing it")
    assert "error" in outcome and str(path) in str(outcome["error"])


def test_directory_that_cannot_be_created_gives_record_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = blocker / "sub" / "owners.json"
    with pytest.raises(RecordError) as info:
        RecordStore(str(path))
    assert str(path) in str(info.value)


# --- put and drop -----------------------------------------------------------------------------------------


def test_drop_records_idle_since_for_the_device(path) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    store.drop("uid-a", "2024-02-03T04:05:06.789Z")
    assert store.record.owners == {}
    assert store.record.idle_since == {"MIG-7": "2024-02-03T04:05:06.789Z"}
    assert RecordStore(path).record.idle_since == {"MIG-7": "2024-02-03T04:05:06.789Z"}


def test_drop_without_a_time_or_a_device_records_no_idle_time(path) -> None:
    store = RecordStore(path)
    store.put(MIG_ENTRY)
    store.put(STARTED_ENTRY)  # no device yet
    store.drop("uid-a", None)
    store.drop("uid-c", "2024-01-01T00:00:00.000Z")
    assert store.record.owners == {} and store.record.idle_since == {}


def test_drop_of_an_unknown_uid_changes_nothing_but_keeps_other_idle_times(path) -> None:
    store = RecordStore(path)
    store.update(lambda r: replace(r, idle_since={"MIG-1": "t1"}))
    store.put(MIG_ENTRY)
    store.drop("nobody", "t2")
    assert store.record.owners == {"uid-a": MIG_ENTRY}
    assert store.record.idle_since == {"MIG-1": "t1"}


def test_put_clears_the_idle_time_of_the_device_it_takes(path) -> None:
    store = RecordStore(path)
    store.update(lambda r: replace(r, idle_since={"MIG-7": "t0", "MIG-8": "t1"}))
    store.put(MIG_ENTRY)
    assert store.record.idle_since == {"MIG-8": "t1"}
    assert RecordStore(path).record.idle_since == {"MIG-8": "t1"}


# --- versions: a record of the previous commit, and of a newer agent ------------------------------------

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_a_record_written_by_the_previous_commit_is_read(tmp_path) -> None:
    # Written by main@03d318a's record.py (tests/unit/fixtures/make_owners_record.py says how).
    path = tmp_path / "owners.json"
    with open(os.path.join(FIXTURES, "owners-main-03d318a.json")) as src:
        path.write_text(src.read())
    store = RecordStore(str(path))
    owners = store.record.owners
    assert store.record.boot_id == "0b8d6c1e-5b2f-4f7e-9a51-3c2d7a0e9f11"
    assert sorted(owners) == ["uid-a", "uid-b", "uid-c", "uid-d"]
    assert owners["uid-a"] == OwnerEntry("uid-a", "team-a/notebook", MODE_MIG, 1, COMPLETED, 16384 * 2**20, 19,
                                         "1g.18gb", 3, 1, 7, 0, "MIG-7f0c2f9e-0000-5000-8000-000000000007",
                                         reused=True)
    assert owners["uid-b"].mode == MODE_FRACTION and owners["uid-b"].granted_bytes == 4 * 2**30
    assert owners["uid-c"].state == STARTED and owners["uid-c"].gi_id == -1
    assert store.record.idle_since == {"MIG-7f0c2f9e-0000-5000-8000-000000000011": "2026-11-26T11:00:00.000Z"}
    assert {c.claim_uid: c.slice_uid for c in store.prepared.values()} == {"claim-1": "uid-a", "claim-2": "uid-d"}
    assert store.revoked == frozenset({"uid-d"})
    store.drop("uid-b", "2026-11-26T12:00:00.000Z")  # a rewrite is read back the same way
    again = RecordStore(str(path))
    assert again.record == store.record and again.prepared == store.prepared and again.revoked == store.revoked
    assert json.loads(path.read_text())["version"] == record_module.VERSION


def test_a_newer_records_unknown_fields_are_read_and_kept_on_rewrite(path) -> None:
    entry = {"uid": "u", "slice": "ns/u", "mode": "mig", "gpu": 0, "state": "completed", "gi_id": 3,
             "device_uuid": "MIG-3", "migDeviceKind": "mig-1g", "health": {"xid": []}}
    data = {"version": record_module.VERSION + 1, "bootId": "b", "owners": {"u": entry},
            "preparedClaims": {"c1": {"namespace": "ns", "name": "u", "sliceUID": "u", "generation": 2}},
            "checksum": "f00d", "futureSection": {"a": 1}}
    with open(path, "w") as fh:
        json.dump(data, fh)
    store = RecordStore(path)
    assert store.record.owners["u"] == OwnerEntry("u", "ns/u", MODE_MIG, 0, COMPLETED, gi_id=3, device_uuid="MIG-3")
    store.put(FRACTION_ENTRY)
    written = json.loads(open(path).read())
    assert written["checksum"] == "f00d" and written["futureSection"] == {"a": 1}
    assert written["owners"]["u"]["migDeviceKind"] == "mig-1g" and written["owners"]["u"]["health"] == {"xid": []}
    assert written["preparedClaims"]["c1"]["generation"] == 2
    assert "migDeviceKind" not in written["owners"]["uid-b"]
    assert written["version"] == record_module.VERSION + 1  # still says its fields are a newer version's
    assert RecordStore(path).record == store.record


@pytest.mark.parametrize("version", ["1", 0, -3, True, 1.5])
def test_a_record_with_a_bad_version_is_refused(path, version) -> None:
    with open(path, "w") as fh:
        json.dump({"version": version, "bootId": "b"}, fh)
    with pytest.raises(RecordError) as info:
        RecordStore(path)
    assert path in str(info.value)


# --- changes made during a write share the next one (group commit) ----------------------------------------


def _entry(n: int) -> OwnerEntry:
    return replace(MIG_ENTRY, uid=f"uid-{n}", gi_id=n, device_uuid=f"MIG-{n}")


def _put_from_threads(store: RecordStore, count: int, staged: threading.Semaphore) -> list[BaseException | None]:
    """``count`` threads each put one entry; ``staged`` is released as each change is staged."""
    outcomes: list[BaseException | None] = [None] * count

    def put(n: int) -> None:
        def change(record: OwnerRecord) -> OwnerRecord:
            staged.release()
            return replace(record, owners={**record.owners, f"uid-{n}": _entry(n)})
        try:
            store.update(change)
        except BaseException as exc:  # noqa: BLE001 - the test looks at every outcome
            outcomes[n] = exc

    threads = [threading.Thread(target=put, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def _first_write_waits(monkeypatch, staged: threading.Semaphore, count: int, fail: bool) -> list[dict]:
    """The first write waits until all ``count`` changes are staged (then fails, with ``fail``);
    returns the list of records written, as the file held each."""
    written: list[dict] = []
    real = record_module.write_atomically

    def write(path, content, **kwargs):
        if not written and not getattr(write, "waited", False):
            write.waited = True
            for _ in range(count):
                assert staged.acquire(timeout=10)
            if fail:
                raise OSError(28, "No space left on device")
        real(path, content, **kwargs)
        with open(path) as fh:
            written.append(json.load(fh))

    monkeypatch.setattr(record_module, "write_atomically", write)
    return written


def test_changes_staged_during_a_write_share_the_next_write(path, monkeypatch) -> None:
    store = RecordStore(path)
    staged = threading.Semaphore(0)
    written = _first_write_waits(monkeypatch, staged, 10, fail=False)
    outcomes = _put_from_threads(store, 10, staged)
    assert outcomes == [None] * 10
    # The first write holds what was staged when it began; every change staged while it waited went
    # into one write after it: at most 2 writes, not 10.
    assert 1 <= len(written) <= 2
    expected = {f"uid-{n}" for n in range(10)}
    assert set(written[-1]["owners"]) == expected
    assert set(store.record.owners) == expected
    assert set(RecordStore(path).record.owners) == expected


def test_a_failed_write_fails_every_change_staged_with_it(path, monkeypatch) -> None:
    store = RecordStore(path)
    store.put(FRACTION_ENTRY)
    before_disk, before_memory = _stored(path), store.record
    staged = threading.Semaphore(0)
    _first_write_waits(monkeypatch, staged, 6, fail=True)
    outcomes = _put_from_threads(store, 6, staged)
    # Each caller learns its change is not on disk, and neither the file nor the memory holds any.
    assert all(isinstance(o, RecordError) and path in str(o) and "No space left" in str(o) for o in outcomes)
    assert _stored(path) == before_disk
    assert store.record is before_memory
    # The next change is staged on what the file holds, not on the lost changes.
    store.put(_entry(42))
    assert set(RecordStore(path).record.owners) == {"uid-b", "uid-42"}
    assert leftovers(os.path.dirname(path)) == []


def test_a_first_version_record_written_by_hand_is_read_and_rewritten_in_this_version(tmp_path) -> None:
    # tests/unit/fixtures/owners-v1-by-hand.json: written by hand in the first format (no "version" key, no
    # "revoked", no entry's "compute"), as an agent of that format left it on a node before an upgrade.
    path = tmp_path / "owners.json"
    with open(os.path.join(FIXTURES, "owners-v1-by-hand.json")) as src:
        path.write_text(src.read())
    store = RecordStore(str(path))
    assert store.record.boot_id == "5e1f3a2b-7c4d-4e8f-9a0b-1c2d3e4f5a6b"
    assert store.record.owners == {
        "3f9c1e2a-mig": OwnerEntry("3f9c1e2a-mig", "vision/trainer", MODE_MIG, 0, COMPLETED, 9984 * 2**20, 19,
                                   "1g.10gb", 6, 1, 13, 0, "MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d4e5"),
        "8b7a6c5d-fraction": OwnerEntry("8b7a6c5d-fraction", "vision/notebook", MODE_FRACTION, 1, COMPLETED,
                                        2 * 10**9, device_uuid="GPU-9d8c7b6a-5f4e-4d3c-8b2a-1f0e9d8c7b6a"),
    }
    assert store.record.owners["8b7a6c5d-fraction"].compute is None  # before compute shares: shared
    assert store.record.idle_since == {"MIG-0c1d2e3f-4a5b-5c6d-8e7f-000000000003": "2026-10-01T08:00:00.000Z"}
    assert store.prepared == {"c0ffee00-claim": PreparedClaim("c0ffee00-claim", "vision", "notebook-gpu",
                                                              "8b7a6c5d-fraction")}
    assert store.revoked == frozenset()
    store.revoke("8b7a6c5d-fraction")  # the first write converts the file
    written = json.loads(path.read_text())
    assert written["version"] == record_module.VERSION and written["revoked"] == ["8b7a6c5d-fraction"]
    assert written["owners"]["8b7a6c5d-fraction"]["compute"] is None
    assert written["owners"]["3f9c1e2a-mig"]["gi_id"] == 13
    again = RecordStore(str(path))
    assert again.record == store.record and again.prepared == store.prepared and again.revoked == store.revoked
