"""core.node.lifecycle and core.node.environment: what mutation testing found untested (docs/testing.md).

Records, NVML instance lists and expected owner entries are written out by hand.
"""

from __future__ import annotations

from mig_operator.core.node.environment import gpu_mem_limit_gb, slice_environment
from mig_operator.core.node.lifecycle import (
    COMPLETED,
    STARTED,
    Blocked,
    MigSteps,
    OwnerEntry,
    OwnerRecord,
    adopt,
    plan_mig,
)
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, InstanceState

MiB = 2**20
BOOT = "boot-1"


def one_g(start: int, gi: int, **kw) -> InstanceState:
    """An H200 1g.18gb (profile id 19, one slot) at ``start``."""
    return InstanceState(gi, kw.pop("ci", 0), 19, "1g.18gb", start, 1, kw.pop("device", f"MIG-{gi}"), **kw)


def one_g_binding(uid: str, start: int, gpu: int = 0) -> Binding:
    return Binding(uid, "node", gpu, MODE_MIG, 16384 * MiB, 19, "1g.18gb", start, 1)


def test_an_entry_found_by_its_binding_takes_the_found_instance_whole() -> None:
    # The record names the slice's intent on another GPU and placement (written before a rebind);
    # the binding and NVML agree on GPU 1, 1g.35gb at slots 2..3.
    entry = OwnerEntry("u1", "ns/a", MODE_MIG, 0, STARTED, 16384 * MiB, 19, "1g.18gb", 0, 1)
    found = InstanceState(4, 1, 15, "1g.35gb", 2, 2, "MIG-4")
    bound = Binding("u1", "node", 1, MODE_MIG, 33280 * MiB, 15, "1g.35gb", 2, 2)
    result = adopt(OwnerRecord(BOOT, {"u1": entry}), BOOT, {1: [found]}, {"u1": bound})
    assert result.adopted == ("u1",)
    assert result.record.owners["u1"] == OwnerEntry("u1", "ns/a", MODE_MIG, 1, STARTED, 16384 * MiB, 15, "1g.35gb",
                                                    2, 2, 4, 1, "MIG-4")


def test_a_binding_the_record_does_not_know_gets_an_entry_of_its_own() -> None:
    bound = Binding("u2", "node", 0, MODE_MIG, 16384 * MiB, 19, "1g.18gb", 3, 1)
    result = adopt(OwnerRecord(BOOT, {}), BOOT, {0: [one_g(3, 7)]}, {"u2": bound})
    assert result.adopted == ("u2",)
    assert result.record.owners == {
        "u2": OwnerEntry("u2", "", MODE_MIG, 0, STARTED, 16384 * MiB, 19, "1g.18gb", 3, 1, 7, 0, "MIG-7")}


def test_the_record_names_the_instance_even_when_the_binding_points_elsewhere() -> None:
    # GI ids are NVML's and 0 is one of them. u1's record entry names GI 0 at slot 3; its binding says
    # slot 4, where GI 7 sits. The record is the authority: u1 keeps GI 0 and GI 7 stays idle, whatever
    # entries come before it in the record.
    gi0, gi7 = one_g(3, 0, device="MIG-0"), one_g(4, 7)
    u1 = OwnerEntry("u1", "ns/a", MODE_MIG, 0, COMPLETED, 0, 19, "1g.18gb", 3, 1, 0, 0, "MIG-0")
    intent = OwnerEntry("u0", "ns/z", MODE_MIG, 0, STARTED, 0, 19, "1g.18gb", 5, 1)  # no GI yet
    fraction = OwnerEntry("f", "ns/f", MODE_FRACTION, 0, COMPLETED, 4 * 2**30)
    bindings = {"f": Binding("f", "node", 0, MODE_FRACTION, 4 * 2**30), "u0": one_g_binding("u0", 5),
                "u1": one_g_binding("u1", 4)}
    for first in (fraction, intent):
        result = adopt(OwnerRecord(BOOT, {first.uid: first, "u1": u1}), BOOT, {0: [gi0, gi7]},
                       {uid: bindings[uid] for uid in (first.uid, "u1")})
        assert result.record.owners["u1"] == u1, first.uid
        assert "u1" in result.adopted
        assert all(e.gi_id != 7 for e in result.record.owners.values())


def test_every_entry_and_binding_is_considered_whatever_comes_first() -> None:
    # u1 is found by its recorded GI, u2 only by its binding, u3 is not in the record at all.
    u1 = OwnerEntry("u1", "ns/1", MODE_MIG, 0, COMPLETED, 0, 19, "1g.18gb", 0, 1, 1, 0, "MIG-1")
    u2 = OwnerEntry("u2", "ns/2", MODE_MIG, 0, STARTED, 0, 19, "1g.18gb", 1, 1)
    bindings = {"u1": one_g_binding("u1", 0), "u2": one_g_binding("u2", 1), "u3": one_g_binding("u3", 2)}
    result = adopt(OwnerRecord(BOOT, {"u1": u1, "u2": u2}), BOOT, {0: [one_g(0, 1), one_g(1, 2), one_g(2, 3)]},
                   bindings)
    assert sorted(result.adopted) == ["u1", "u2", "u3"]
    assert {uid: e.gi_id for uid, e in result.record.owners.items()} == {"u1": 1, "u2": 2, "u3": 3}
    # u2 keeps its own record entry (its slice's name), found through its binding.
    assert result.record.owners["u2"] == OwnerEntry("u2", "ns/2", MODE_MIG, 0, STARTED, 0, 19, "1g.18gb", 1, 1,
                                                    2, 0, "MIG-2")


def test_adopt_on_a_gpu_nvml_no_longer_lists() -> None:
    u1 = OwnerEntry("u1", "ns/1", MODE_MIG, 2, COMPLETED, 0, 19, "1g.18gb", 0, 1, 1, 0, "MIG-1")
    bindings = {"u1": one_g_binding("u1", 0, gpu=2), "u3": one_g_binding("u3", 1, gpu=2)}
    result = adopt(OwnerRecord(BOOT, {"u1": u1}), BOOT, {}, bindings)
    assert result.adopted == () and result.incomplete == ()
    assert result.record.owners == {
        "u1": OwnerEntry("u1", "ns/1", MODE_MIG, 2, STARTED, 0, 19, "1g.18gb", 0, 1)}  # the intent stands


def test_a_stranger_process_blocks_with_a_message_naming_the_instance() -> None:
    busy = one_g(3, 5, in_use=True)
    try:
        plan_mig("u1", one_g_binding("u1", 3), [busy], OwnerRecord(BOOT))
    except Blocked as blocked:
        assert blocked.transient
        assert blocked.message == str(blocked) == (
            "a process runs on GPU 0 instance 1g.18gb@3 (GI 5) that no slice owns; waiting for it to exit")
    else:
        raise AssertionError("plan_mig handed out an instance a process runs on")


def test_completing_a_half_made_target_still_destroys_what_overlaps_the_binding() -> None:
    half = InstanceState(2, -1, 15, "1g.35gb", 0, 2, "")  # 1g.35gb at 0..1 without its compute instance
    # The binding is 1g.35gb at 0; an idle 1g.18gb at slot 1 cannot be there together with it, but NVML
    # lists both here (a state the agent must clean up): the overlap goes first.
    stray = one_g(1, 6)
    steps = plan_mig("u1", Binding("u1", "node", 0, MODE_MIG, 0, 15, "1g.35gb", 0, 2), [half, stray],
                     OwnerRecord(BOOT))
    assert steps == MigSteps("complete", half, (stray,))
    assert steps.needs_nvml


def test_reusing_after_destroying_needs_nvml() -> None:
    assert MigSteps("reuse", one_g(0, 1), (one_g(1, 2),)).needs_nvml
    assert not MigSteps("reuse", one_g(0, 1)).needs_nvml
    assert not MigSteps("resume", one_g(0, 1)).needs_nvml


def test_gpu_mem_limit_gb_is_decimal_gb_with_at_most_two_places() -> None:
    assert [gpu_mem_limit_gb(b) for b in (4 * 10**9, 4_500_000_000, 4_250_000_000, 10**9 // 2, 16384 * MiB)] == [
        "4", "4.5", "4.25", "0.5", "17.18"]
    env = slice_environment(MODE_FRACTION, 20 * 10**9, "ns", "a")
    assert env["GPU_MEM_LIMIT_GB"] == "20"


def test_an_entry_holds_its_gi_while_either_side_does_not_know_the_device_yet() -> None:
    named = OwnerEntry("u", "ns/u", MODE_MIG, 0, COMPLETED, 0, 19, "1g.18gb", 3, 1, 5, 0, "MIG-5")
    unnamed = OwnerEntry("u", "ns/u", MODE_MIG, 0, STARTED, 0, 19, "1g.18gb", 3, 1, 5, -1, "")
    assert named.holds(one_g(3, 5), 0)
    assert named.holds(one_g(3, 5, ci=-1, device=""), 0)  # the instance lost its compute instance
    assert unnamed.holds(one_g(3, 5), 0)  # the entry was written before the device existed
    assert not named.holds(one_g(3, 5, device="MIG-9"), 0)  # another device under the same GI id
    assert not named.holds(one_g(3, 5), 1) and not named.holds(one_g(3, 6), 0)
