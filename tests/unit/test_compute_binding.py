"""A fraction's compute share in its binding and in the agent's record: written, read back the same.

Expected values are written out by hand (the status text, the JSON), not computed by the code under test.
"""

from __future__ import annotations

import json
import os

import pytest

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, binding_from_status, describe_binding
from mig_operator.core.requests.request import SliceRequest
from mig_operator.kube.agent import record as record_module
from mig_operator.kube.agent.record import RecordError, RecordStore
from mig_operator.kube.common import status

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FRACTION = Binding("u1", "node-a", 0, MODE_FRACTION, 4 * 2**30, namespace="ns")


@pytest.mark.parametrize(("compute", "text"), [(None, "shared"), (0.25, "0.25"), (1.0, "1"), (0.1, "0.1"),
                                               (1 / 3, "0.3333333333333333"), (0.0001, "0.0001"),
                                               (0.00001, "1e-05")])
def test_a_fractions_compute_is_written_in_its_status_and_read_back(compute, text) -> None:
    binding = Binding("u1", "node-a", 0, MODE_FRACTION, 4 * 2**30, namespace="ns", compute=compute)
    body = status.bound(None, SliceRequest(memory_bytes=4 * 2**30), binding, "GPU-0", [], "bound")
    assert body["compute"] == text
    assert binding_from_status("u1", body, "ns") == binding


def test_a_status_without_compute_is_a_shared_fraction() -> None:
    written = {"phase": "Ready", "node": "node-a", "gpu": 0, "mode": "fraction", "grantedBytes": 4 * 2**30}
    assert binding_from_status("u1", written, "ns") == FRACTION
    assert binding_from_status("u1", {**written, "compute": "2"}, "ns").compute is None  # out of range: shared
    assert binding_from_status("u1", {**written, "compute": "x"}, "ns").compute is None


def test_a_mig_slice_shows_its_profiles_compute_and_its_binding_has_no_share() -> None:
    binding = Binding("u2", "node-a", 1, MODE_MIG, 33280 * 2**20, 9, "3g.71gb", 4, 4, "ns")
    body = status.bound(None, SliceRequest(profile="3g.71gb"), binding, "GPU-1", [], "bound", mig_compute="3/7")
    assert body["compute"] == "3/7"
    back = binding_from_status("u2", {**body, "phase": "Bound"}, "ns")
    assert back == binding and back.compute is None


def test_describe_binding_names_the_share() -> None:
    assert "with compute 0.25" in describe_binding(Binding("u", "n", 0, MODE_FRACTION, 2**30, compute=0.25))
    assert "compute" not in describe_binding(FRACTION)


def test_owner_entry_compute_is_recorded_and_read_back(tmp_path) -> None:
    path = str(tmp_path / "owners.json")
    store = RecordStore(path)
    store.put(OwnerEntry("u1", "ns/a", MODE_FRACTION, 0, COMPLETED, 2**30, device_uuid="GPU-0", compute=0.25))
    store.put(OwnerEntry("u2", "ns/b", MODE_FRACTION, 1, COMPLETED, 2**30, device_uuid="GPU-1"))
    written = json.loads(open(path).read())
    assert written["version"] == 2
    assert written["owners"]["u1"]["compute"] == 0.25 and written["owners"]["u2"]["compute"] is None
    again = RecordStore(path).record.owners
    assert again["u1"].compute == 0.25 and again["u2"].compute is None


def test_a_version_1_record_reads_every_fraction_as_shared(tmp_path) -> None:
    path = tmp_path / "owners.json"
    path.write_text(open(os.path.join(FIXTURES, "owners-main-03d318a.json")).read())
    store = RecordStore(str(path))
    assert all(e.compute is None for e in store.record.owners.values())
    store.drop("uid-a", None)
    assert json.loads(path.read_text())["version"] == record_module.VERSION == 2


@pytest.mark.parametrize("value", ["0.5", True, [1]])
def test_a_wrongly_typed_compute_is_refused(tmp_path, value) -> None:
    path = tmp_path / "owners.json"
    entry = {"uid": "u", "slice": "ns/u", "mode": "fraction", "gpu": 0, "compute": value}
    path.write_text(json.dumps({"version": 2, "bootId": "b", "owners": {"u": entry}}))
    with pytest.raises(RecordError):
        RecordStore(str(path))

