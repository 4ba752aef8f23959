"""core.node.lifecycle.offered (whether a slice's device is offered to the kubelet and listed in the
ResourceSlice) and settle_adoption (the agent's record fix-ups after adopt, on start)."""

from __future__ import annotations

import pytest

from mig_operator.core.node.lifecycle import (
    COMPLETED,
    STARTED,
    OwnerEntry,
    OwnerRecord,
    adopt,
    offered,
    offered_entries,
    settle_adoption,
)
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, InstanceState

MIB = 2**20
DONE = OwnerEntry("u", "ns/a", MODE_MIG, 0, COMPLETED, 16384 * MIB, 19, "1g.18gb", 3, 1, 7, 0, "MIG-7")
FRACTION = OwnerEntry("f", "ns/f", MODE_FRACTION, 1, COMPLETED, 4 * 2**30, device_uuid="GPU-1")


@pytest.mark.parametrize(
    ("entry", "revoked", "shown_ready", "expected"),
    [
        (DONE, False, True, True),  # made, Ready, not revoked: offered
        (FRACTION, False, True, True),
        (DONE, False, False, False),  # its status does not say Ready (yet, or any more)
        (DONE, True, True, False),  # gone while a claim on it is prepared: held, offered to nobody
        (OwnerEntry("u", "ns/a", MODE_MIG, 0, STARTED, 16384 * MIB, 19, "1g.18gb", 3, 1), False, True, False),
        (OwnerEntry("u", "ns/a", MODE_MIG, 0, COMPLETED, 16384 * MIB, 19, "1g.18gb", 3, 1, 7, 0, ""), False, True,
         False),  # no device recorded
        (None, False, True, False),  # not in the record
    ],
)
def test_offered_table(entry, revoked: bool, shown_ready: bool, expected: bool) -> None:
    assert offered(entry, revoked, shown_ready) is expected


def test_offered_entries_keep_only_the_offered_ones() -> None:
    started = OwnerEntry("s", "ns/s", MODE_MIG, 0, STARTED)
    gone = OwnerEntry("g", "ns/g", MODE_MIG, 0, COMPLETED, gi_id=2, ci_id=0, device_uuid="MIG-2")
    record = OwnerRecord("b", {e.uid: e for e in (DONE, FRACTION, started, gone)})
    assert offered_entries(record, {"g"}, {"u", "s", "g"}) == [DONE]
    assert offered_entries(record, set(), {"u", "f", "g"}) == [DONE, FRACTION, gone]


def _inst(gi: int, start: int, uuid: str) -> InstanceState:
    return InstanceState(gi_id=gi, ci_id=0, profile_id=19, profile="1g.18gb", start=start, size=1, device_uuid=uuid)


def test_settle_adoption_names_keeps_held_revokes_and_times_idle() -> None:
    live = Binding("live", "n", 0, MODE_MIG, 16384 * MIB, 19, "1g.18gb", 3, 1)
    held = OwnerEntry("held", "ns/held", MODE_MIG, 0, COMPLETED, 16384 * MIB, 19, "1g.18gb", 4, 1, 4, 0, "MIG-4")
    gone = OwnerEntry("gone", "ns/gone", MODE_MIG, 0, COMPLETED, 16384 * MIB, 19, "1g.18gb", 5, 1, 5, 0, "MIG-5")
    before = OwnerRecord("boot", {"held": held, "gone": gone}, {"MIG-6": "2026-01-01T00:00:00.000Z"})
    found = {0: [_inst(3, 3, "MIG-3"), _inst(4, 4, "MIG-4"), _inst(5, 5, "MIG-5"), _inst(6, 6, "MIG-6")]}
    adoption = adopt(before, "boot", found, {"live": live})
    assert set(adoption.record.owners) == {"live"} and adoption.record.owners["live"].slice == ""
    record, revoke = settle_adoption(adoption, before, {"live": "ns/live"}, {"held"}, {"live"}, found,
                                     "2026-11-26T12:00:00.000Z")
    # the entry adopted from its binding alone is named; the held one is back (a claim is prepared on
    # it) and revoked (its slice is gone); the dropped one is not
    assert set(record.owners) == {"live", "held"}
    assert record.owners["live"].slice == "ns/live" and record.owners["live"].gi_id == 3
    assert record.owners["held"] == held
    assert revoke == ("held",)
    # idle: MIG-5 (its slice gone, no claim) from now; MIG-6 keeps the time the record had
    assert record.idle_since == {"MIG-5": "2026-11-26T12:00:00.000Z", "MIG-6": "2026-01-01T00:00:00.000Z"}
    assert record.boot_id == "boot"


def test_settle_adoption_revokes_nothing_for_a_held_slice_that_lives() -> None:
    entry = OwnerEntry("u", "ns/a", MODE_MIG, 0, COMPLETED, 16384 * MIB, 19, "1g.18gb", 3, 1, 3, 0, "MIG-3")
    binding = Binding("u", "n", 0, MODE_MIG, 16384 * MIB, 19, "1g.18gb", 3, 1)
    before = OwnerRecord("boot", {"u": entry})
    found = {0: [_inst(3, 3, "MIG-3")]}
    record, revoke = settle_adoption(adopt(before, "boot", found, {"u": binding}), before, {"u": "ns/a"}, {"u"},
                                     {"u"}, found, "t")
    assert record.owners == {"u": entry} and revoke == () and record.idle_since == {}
