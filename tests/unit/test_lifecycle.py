"""core.node.lifecycle: the agent's next step, plan_mig (which instance a binding gets) and adopt (on start).

An instance belongs to the slice whose UID the owner record names; these tests build records and
NVML instance lists by hand from the catalog and check that ownership is never crossed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.node.lifecycle import (
    BOUND,
    COMPLETED,
    CREATING,
    FAILED,
    FORGET,
    NOTHING,
    PENDING,
    READY,
    REALISE,
    RELEASE,
    STARTED,
    Blocked,
    ClaimHold,
    OwnerEntry,
    OwnerRecord,
    adopt,
    agent_step,
    claim_hold,
    idle_instances,
    plan_mig,
)
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, InstanceState
from mig_operator.core.placement.profiles import get_model

MiB = 2**20
H200 = get_model("h200-141gb")
BOOT = "boot-1"


def slots(start: int, size: int) -> int:
    mask = 0
    for s in range(start, start + size):
        mask |= 1 << s
    return mask


def inst(name: str, start: int, gi: int, *, ci: int = 0, device: str | None = None, in_use: bool = False
         ) -> InstanceState:
    p = H200.profile(name)
    assert start in [pl.start for pl in p.placements], "test set-up: not a legal placement"
    return InstanceState(gi_id=gi, ci_id=ci, profile_id=p.id, profile=p.name, start=start, size=p.placements[0].size,
                         device_uuid=f"MIG-{gi}" if device is None else device, in_use=in_use)


def binding(uid: str, name: str, start: int, gpu: int = 0) -> Binding:
    p = H200.profile(name)
    return Binding(uid, "node", gpu, MODE_MIG, p.memory_mib * MiB, p.id, p.name, start, p.placements[0].size)


def owner(uid: str, i: InstanceState, gpu: int = 0, state: str = COMPLETED) -> OwnerEntry:
    return OwnerEntry(uid, f"ns/{uid}", MODE_MIG, gpu, state, 0, i.profile_id, i.profile, i.start, i.size,
                      i.gi_id, i.ci_id, i.device_uuid)


def record(*entries: OwnerEntry, boot: str = BOOT, idle: dict[str, str] | None = None) -> OwnerRecord:
    return OwnerRecord(boot, {e.uid: e for e in entries}, dict(idle or {}))


# --- agent_step -------------------------------------------------------------------------------------------

ANY_ENTRY = OwnerEntry("u", "ns/u", MODE_MIG, 0, COMPLETED)
STARTED_ENTRY = OwnerEntry("u", "ns/u", MODE_MIG, 0, STARTED)


@pytest.mark.parametrize(
    ("phase", "deleting", "finalizer", "entry", "step"),
    [
        # Being deleted: release while the finalizer or the record still holds it, else nothing is left to do.
        (READY, True, True, ANY_ENTRY, RELEASE),
        (READY, True, True, None, RELEASE),
        (READY, True, False, ANY_ENTRY, RELEASE),
        (BOUND, True, False, STARTED_ENTRY, RELEASE),
        (READY, True, False, None, NOTHING),
        (PENDING, True, False, None, NOTHING),
        (None, True, True, None, RELEASE),
        # Not carrying the finalizer yet (a slice made by hand, between its binding and the finalizer
        # write): nothing, unless the record already has it (the agent began before a restart).
        (BOUND, False, False, None, NOTHING),
        (CREATING, False, False, None, NOTHING),
        (READY, False, False, None, NOTHING),
        (BOUND, False, False, STARTED_ENTRY, REALISE),
        # Bound and Creating: realise (again after a crash).
        (BOUND, False, True, None, REALISE),
        (BOUND, False, True, STARTED_ENTRY, REALISE),
        (CREATING, False, True, STARTED_ENTRY, REALISE),
        (CREATING, False, True, None, REALISE),
        # Ready: done when the record has it completed; otherwise adopt it by realising.
        (READY, False, True, ANY_ENTRY, NOTHING),
        (READY, False, True, STARTED_ENTRY, REALISE),
        (READY, False, True, None, REALISE),
        # Failed: forget the record's entry so its instance is idle; nothing without one.
        (FAILED, False, True, ANY_ENTRY, FORGET),
        (FAILED, False, True, STARTED_ENTRY, FORGET),
        (FAILED, False, False, None, NOTHING),
        # Not bound yet: nothing for the agent.
        (PENDING, False, False, None, NOTHING),
        (None, False, False, None, NOTHING),
    ],
)
def test_agent_step_table(phase, deleting: bool, finalizer: bool, entry, step: str) -> None:
    assert agent_step(phase, deleting, finalizer, entry) == step


# --- claim_hold: what keeps a deleted slice from being released ------------------------------------------

SLICE_UID = "uid-s"


def claim(owner: str | None, reserved: list[tuple[str, str]] = (), deleting: bool = False) -> dict:
    meta: dict = {"name": "s", "namespace": "team", "uid": "uid-c"}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": "s", "uid": owner}]
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T10:00:00Z"
    return {"metadata": meta, "status": {"reservedFor": [{"resource": r, "name": n, "uid": f"u-{n}"}
                                                          for r, n in reserved]}}


@pytest.mark.parametrize(
    ("what", "body", "prepared", "hold"),
    [
        ("no claim, nothing prepared: free", None, [], ClaimHold()),
        ("its claim, reserved for nobody", claim(SLICE_UID), [], ClaimHold()),
        ("its claim reserved for a pod", claim(SLICE_UID, [("pods", "train")]), [],
         ClaimHold(("pod team/train",))),
        ("reserved for two pods, named in order", claim(SLICE_UID, [("pods", "b"), ("pods", "a")]), [],
         ClaimHold(("pod team/a", "pod team/b"))),
        ("being deleted but still reserved: held", claim(SLICE_UID, [("pods", "p")], deleting=True), [],
         ClaimHold(("pod team/p",))),
        ("prepared here only (its reservation already gone)", claim(SLICE_UID), ["team/s"], ClaimHold((), ("team/s",))),
        ("prepared here, no claim in the API any more", None, ["team/s", "team/s"], ClaimHold((), ("team/s",))),
        ("reserved and prepared", claim(SLICE_UID, [("pods", "p")]), ["team/s"],
         ClaimHold(("pod team/p",), ("team/s",))),
        # A claim of the slice's name that another slice (an earlier one of that name) or nobody owns
        # says nothing about this slice.
        ("a claim of that name owned by another slice", claim("uid-other", [("pods", "p")]), [], ClaimHold()),
        ("a claim of that name owned by nobody", claim(None, [("pods", "p")]), [], ClaimHold()),
    ],
)
def test_claim_hold_table(what: str, body: dict | None, prepared: list[str], hold: ClaimHold) -> None:
    got = claim_hold(SLICE_UID, body, prepared)
    assert got == hold, what
    assert got.free == (not hold.reserved_for and not hold.prepared)


def test_claim_hold_message_names_the_pods_and_the_node() -> None:
    text = ClaimHold(("pod team/a", "pod team/b"), ("team/s",)).message("node-1")
    assert "reserved for pod team/a, pod team/b" in text and "prepared on node node-1" in text
    assert "team/s" in text and "quota" in text


# --- plan_mig ---------------------------------------------------------------------------------------------


def test_plan_create_on_an_empty_gpu_needs_nvml_and_destroys_nothing() -> None:
    steps = plan_mig("u", binding("u", "3g.71gb", 4), [], record())
    assert (steps.action, steps.instance, steps.destroy) == ("create", None, ())
    assert steps.needs_nvml


def test_plan_create_destroys_exactly_the_overlapping_idle_instances() -> None:
    # 3g.71gb at 4 covers slots 4..7: the 1g at 4, the 2g at 6 go; the 1g at 3 and the 2g at 0 stay.
    insts = [inst("2g.35gb", 0, 1), inst("1g.18gb", 3, 2), inst("1g.18gb", 4, 3), inst("1g.35gb", 6, 4)]
    b = binding("u", "3g.71gb", 4)
    steps = plan_mig("u", b, insts, record())
    assert steps.action == "create"
    expected = [i for i in insts if slots(i.start, i.size) & slots(4, 4)]
    assert {i.gi_id for i in expected} == {3, 4}
    assert sorted(steps.destroy, key=lambda i: i.gi_id) == expected


def test_plan_reuse_of_an_idle_complete_target_needs_no_nvml() -> None:
    target = inst("1g.18gb", 2, 7)
    steps = plan_mig("u", binding("u", "1g.18gb", 2), [inst("1g.18gb", 1, 6), target], record())
    assert (steps.action, steps.instance, steps.destroy) == ("reuse", target, ())
    assert not steps.needs_nvml


def test_plan_resume_when_the_record_already_gives_the_target_to_this_slice() -> None:
    target = inst("2g.35gb", 2, 7, in_use=True)  # its own process runs on it: still this slice's
    steps = plan_mig("u", binding("u", "2g.35gb", 2), [target], record(owner("u", target)))
    assert (steps.action, steps.instance) == ("resume", target)
    assert not steps.needs_nvml


@pytest.mark.parametrize(("ci", "device"), [(-1, ""), (-1, "MIG-x"), (0, "")])
def test_plan_complete_for_a_half_made_target(ci: int, device: str) -> None:
    target = inst("1g.18gb", 0, 4, ci=ci, device=device)
    steps = plan_mig("u", binding("u", "1g.18gb", 0), [target], record())
    assert (steps.action, steps.instance) == ("complete", target)
    assert steps.needs_nvml


def test_plan_complete_keeps_the_overlap_to_destroy() -> None:
    # A same-start different-profile instance is not the target.
    target = inst("3g.71gb", 0, 4, ci=-1, device="")
    other = inst("1g.18gb", 0, 5)
    steps = plan_mig("u", binding("u", "1g.18gb", 0), [target, other], record())
    assert steps.action == "reuse" and steps.instance == other
    assert steps.destroy == (target,)


@pytest.mark.parametrize("role", ["target", "victim"])
def test_plan_never_takes_an_instance_owned_by_another_slice(role: str) -> None:
    if role == "target":
        theirs = inst("1g.18gb", 3, 9)
        b = binding("u", "1g.18gb", 3)
    else:
        theirs = inst("1g.18gb", 5, 9)
        b = binding("u", "3g.71gb", 4)
    with pytest.raises(Blocked) as info:
        plan_mig("u", b, [theirs], record(owner("other", theirs)))
    assert info.value.transient is False
    assert "ns/other" in info.value.message


def test_plan_refuses_an_instance_in_use_that_no_slice_owns_transiently() -> None:
    busy = inst("1g.18gb", 5, 9, in_use=True)
    with pytest.raises(Blocked) as info:
        plan_mig("u", binding("u", "3g.71gb", 4), [busy], record())
    assert info.value.transient is True
    with pytest.raises(Blocked) as info:
        plan_mig("u", binding("u", "1g.18gb", 5), [busy], record())
    assert info.value.transient is True


def test_plan_destroys_this_slices_own_old_instance() -> None:
    mine = inst("1g.18gb", 5, 9)
    steps = plan_mig("u", binding("u", "3g.71gb", 4), [mine], record(owner("u", mine)))
    assert steps.action == "create" and steps.destroy == (mine,)


def test_owner_on_another_gpu_or_device_does_not_own_the_instance() -> None:
    here = inst("1g.18gb", 3, 9, device="MIG-new")
    elsewhere = owner("other", inst("1g.18gb", 3, 9, device="MIG-new"), gpu=1)
    old_device = owner("old", inst("1g.18gb", 3, 9, device="MIG-old"))  # same GI id, recreated since
    steps = plan_mig("u", binding("u", "1g.18gb", 3), [here], record(elsewhere, old_device))
    assert (steps.action, steps.instance) == ("reuse", here)


def test_fraction_entry_never_owns_a_mig_instance() -> None:
    i = inst("1g.18gb", 0, 1)
    frac = OwnerEntry("f", "ns/f", MODE_FRACTION, 0, COMPLETED, gi_id=1, device_uuid="MIG-1")
    assert record(frac).owner_of(0, i) is None


def test_idle_instances_are_those_no_entry_owns() -> None:
    a, b, c = inst("1g.18gb", 0, 1), inst("1g.18gb", 1, 2), inst("1g.18gb", 2, 3)
    assert idle_instances(record(owner("x", b)), 0, [a, b, c]) == [a, c]
    assert idle_instances(record(owner("x", b, gpu=1)), 0, [a, b, c]) == [a, b, c]


OWNERSHIPS = st.sampled_from(["none", "me", "other"])


@st.composite
def gpu_states(draw):
    """A GPU of legal, non-overlapping instances, each owned by nobody, this slice or another one."""
    taken, insts, entries = 0, [], []
    for _ in range(draw(st.integers(0, 6))):
        p = draw(st.sampled_from([q for q in H200.profiles]))
        free = [pl for pl in p.placements if not slots(pl.start, pl.size) & taken]
        if not free:
            continue
        pl = draw(st.sampled_from(free))
        taken |= slots(pl.start, pl.size)
        gi = len(insts) + 1
        half = draw(st.integers(0, 4)) == 0
        i = InstanceState(gi, -1 if half else 0, p.id, p.name, pl.start, pl.size, "" if half else f"MIG-{gi}",
                          draw(st.booleans()))
        insts.append(i)
        who = draw(OWNERSHIPS)
        if who != "none":
            entries.append(owner("u" if who == "me" else f"other-{gi}", i))
    p = draw(st.sampled_from([q for q in H200.profiles]))
    pl = draw(st.sampled_from(p.placements))
    b = Binding("u", "node", 0, MODE_MIG, p.memory_mib * MiB, p.id, p.name, pl.start, pl.size)
    return insts, entries, b


@settings(max_examples=200, deadline=None)
@given(gpu_states())
def test_plan_mig_never_hands_out_or_destroys_what_another_slice_or_a_stranger_process_holds(state) -> None:
    insts, entries, b = state
    rec = OwnerRecord(BOOT, {e.uid: e for e in entries})
    owned_by = {e.gi_id: e.uid for e in rec.owners.values()}
    want = slots(b.start, b.size)
    touched = [i for i in insts if slots(i.start, i.size) & want]
    try:
        steps = plan_mig("u", b, insts, rec)
    except Blocked as blocked:
        others = [i for i in touched if owned_by.get(i.gi_id) not in (None, "u")]
        strangers = [i for i in touched if i.in_use and i.gi_id not in owned_by]
        assert others or strangers, "blocked without cause"
        if not strangers:
            assert blocked.transient is False
        if not others:
            assert blocked.transient is True
        return
    for i in ([steps.instance] if steps.instance else []) + list(steps.destroy):
        assert owned_by.get(i.gi_id) in (None, "u"), f"{i} belongs to {owned_by.get(i.gi_id)}"
        assert not (i.in_use and i.gi_id not in owned_by), f"{i} runs a process no slice owns"
    target = [i for i in insts if i.start == b.start and i.profile_id == b.profile_id]
    assert list(steps.destroy) == [i for i in touched if i not in target]
    if not target:
        assert steps.action == "create" and steps.instance is None
    else:
        (t,) = target
        complete = t.ci_id >= 0 and t.device_uuid != ""
        expected = "complete" if not complete else ("resume" if owned_by.get(t.gi_id) == "u" else "reuse")
        assert (steps.action, steps.instance) == (expected, t)


# --- adopt ------------------------------------------------------------------------------------------------


def test_adopt_keeps_record_owners_whose_slices_live_and_drops_the_others() -> None:
    a, g = inst("1g.18gb", 0, 1), inst("1g.18gb", 1, 2)
    rec = record(owner("alive", a), owner("gone", g), idle={"MIG-x": "t0"})
    result = adopt(rec, BOOT, {0: [a, g]}, {"alive": binding("alive", "1g.18gb", 0)})
    assert result.adopted == ("alive",)
    assert result.dropped == ("gone",)
    assert set(result.record.owners) == {"alive"}
    kept = result.record.owners["alive"]
    assert (kept.gi_id, kept.device_uuid, kept.state) == (1, "MIG-1", COMPLETED)
    assert result.record.owner_of(0, g) is None


def test_adopt_keeps_fraction_entries_of_live_slices() -> None:
    frac = OwnerEntry("f", "ns/f", MODE_FRACTION, 1, COMPLETED, 4 * 2**30, device_uuid="GPU-1")
    gone = OwnerEntry("g", "ns/g", MODE_FRACTION, 1, COMPLETED, 2**30, device_uuid="GPU-1")
    fb = Binding("f", "node", 1, MODE_FRACTION, 4 * 2**30)
    result = adopt(record(frac, gone), BOOT, {}, {"f": fb})
    assert result.record.owners == {"f": frac}
    assert result.dropped == ("g",)


def test_adopt_by_binding_when_the_record_is_lost() -> None:
    a = inst("2g.35gb", 2, 5)
    result = adopt(OwnerRecord(), BOOT, {0: [inst("1g.18gb", 0, 1), a]}, {"s": binding("s", "2g.35gb", 2)})
    assert result.adopted == ("s",)
    e = result.record.owners["s"]
    assert (e.mode, e.gpu, e.gi_id, e.ci_id, e.device_uuid, e.start, e.profile_id) == (
        MODE_MIG, 0, 5, a.ci_id, "MIG-5", 2, a.profile_id)
    assert result.record.boot_id == BOOT


def test_adopt_by_binding_matches_gpu_profile_and_start() -> None:
    # Same start, other profile; same profile, other GPU: neither is the slice's.
    insts = {0: [inst("1g.18gb", 2, 5)], 1: [inst("2g.35gb", 4, 6)]}
    result = adopt(OwnerRecord(), BOOT, insts, {"s": binding("s", "2g.35gb", 2), "t": binding("t", "2g.35gb", 4)})
    assert result.adopted == ()
    assert result.record.owners == {}


def test_adopt_never_gives_one_instance_to_two_slices() -> None:
    a = inst("1g.18gb", 0, 1)
    bindings = {"s": binding("s", "1g.18gb", 0), "t": binding("t", "1g.18gb", 0)}
    result = adopt(OwnerRecord(), BOOT, {0: [a]}, bindings)
    assert len(result.adopted) == 1
    holders = [u for u, e in result.record.owners.items() if e.holds(a, 0)]
    assert len(holders) == 1


def test_adopt_record_entry_wins_over_a_conflicting_binding_for_an_unrecorded_slice() -> None:
    a = inst("1g.18gb", 0, 1)
    rec = record(owner("recorded", a))
    bindings = {"stranger": binding("stranger", "1g.18gb", 0), "recorded": binding("recorded", "1g.18gb", 0)}
    result = adopt(rec, BOOT, {0: [a]}, bindings)
    assert result.adopted == ("recorded",)
    assert [u for u, e in result.record.owners.items() if e.holds(a, 0)] == ["recorded"]


def test_adopt_record_authority_holds_whatever_the_order_of_entries() -> None:
    a = inst("1g.18gb", 0, 3)
    lost = OwnerEntry("x", "ns/x", MODE_MIG, 0, COMPLETED, 0, a.profile_id, a.profile, 0, 1, 9, 0, "MIG-9")
    rec = OwnerRecord(BOOT, {"x": lost, "a": owner("a", a)})  # x is listed first
    bindings = {"x": binding("x", "1g.18gb", 0), "a": binding("a", "1g.18gb", 0)}
    result = adopt(rec, BOOT, {0: [a]}, bindings)
    assert result.record.owners["a"].gi_id == 3
    assert "a" in result.adopted and "x" not in result.adopted


def test_adopt_after_a_reboot_ignores_recorded_gi_ids_and_matches_by_binding() -> None:
    # The old record says GI 3 at slot 0; after the reboot GI 3 is someone else's 1g at slot 5, and the
    # slice's placement holds a new GI 7.
    old = owner("s", inst("1g.18gb", 0, 3, device="MIG-old"))
    now = [inst("1g.18gb", 5, 3, device="MIG-old"), inst("1g.18gb", 0, 7)]
    result = adopt(record(old, boot="boot-0"), BOOT, {0: now}, {"s": binding("s", "1g.18gb", 0)})
    e = result.record.owners["s"]
    assert (e.gi_id, e.start, e.device_uuid) == (7, 0, "MIG-7")
    assert result.record.boot_id == BOOT


def test_adopt_in_the_same_boot_follows_the_recorded_gi() -> None:
    recorded = inst("1g.18gb", 0, 3)
    entry = owner("s", recorded)
    result = adopt(record(entry), BOOT, {0: [recorded]}, {"s": binding("s", "1g.18gb", 0)})
    assert result.record.owners["s"] == entry
    assert result.adopted == ("s",)


def test_adopt_keeps_the_intent_when_the_instance_is_gone() -> None:
    entry = owner("s", inst("1g.18gb", 0, 3))
    result = adopt(record(entry, boot="boot-0"), BOOT, {0: []}, {"s": binding("s", "1g.18gb", 0)})
    e = result.record.owners["s"]
    assert (e.state, e.gi_id, e.ci_id, e.device_uuid) == (STARTED, -1, -1, "")
    assert result.adopted == ()


def test_adopt_leaves_a_half_made_instance_started_and_lists_it() -> None:
    half = inst("1g.18gb", 0, 3, ci=-1, device="")
    stray = inst("1g.18gb", 4, 4, ci=-1, device="")
    entry = owner("s", inst("1g.18gb", 0, 3))
    result = adopt(record(entry), BOOT, {0: [half], 2: [stray]}, {"s": binding("s", "1g.18gb", 0)})
    assert result.record.owners["s"].state == STARTED
    assert sorted(result.incomplete, key=lambda x: x[0]) == [(0, half), (2, stray)]


def test_adopt_by_binding_is_started_until_realise_confirms_it() -> None:
    result = adopt(OwnerRecord(), BOOT, {0: [inst("1g.18gb", 0, 3)]}, {"s": binding("s", "1g.18gb", 0)})
    assert result.record.owners["s"].state == STARTED
    assert agent_step(READY, False, True, result.record.owners["s"]) == REALISE


def test_adopt_destroys_nothing_and_unmatched_instances_are_idle() -> None:
    a, b = inst("1g.18gb", 0, 1), inst("1g.18gb", 1, 2)
    result = adopt(OwnerRecord(), BOOT, {0: [a, b]}, {"s": binding("s", "1g.18gb", 1)})
    assert idle_instances(result.record, 0, [a, b]) == [a]


@pytest.mark.parametrize(("boot", "kept"), [(BOOT, True), ("boot-0", False)])
def test_adopt_keeps_idle_since_only_in_the_same_boot(boot: str, kept: bool) -> None:
    idle = {"MIG-1": "2024-01-01T00:00:00.000Z"}
    result = adopt(record(boot=boot, idle=idle), BOOT, {0: [inst("1g.18gb", 0, 1)]}, {})
    assert result.record.idle_since == (idle if kept else {})


def test_adopt_does_not_change_its_input_record() -> None:
    entry = owner("s", inst("1g.18gb", 0, 3))
    rec = record(entry, owner("gone", inst("1g.18gb", 1, 4)), boot="boot-0", idle={"MIG-9": "t"})
    adopt(rec, BOOT, {0: []}, {"s": binding("s", "1g.18gb", 0)})
    assert rec.boot_id == "boot-0" and set(rec.owners) == {"s", "gone"} and rec.owners["s"] == entry
    assert rec.idle_since == {"MIG-9": "t"}


@st.composite
def adoption_inputs(draw):
    insts, taken = [], 0
    for _ in range(draw(st.integers(0, 7))):
        p = draw(st.sampled_from([q for q in H200.profiles]))
        free = [pl for pl in p.placements if not slots(pl.start, pl.size) & taken]
        if not free:
            continue
        pl = draw(st.sampled_from(free))
        taken |= slots(pl.start, pl.size)
        gi = len(insts) + 1
        insts.append(InstanceState(gi, 0, p.id, p.name, pl.start, pl.size, f"MIG-{gi}"))
    bindings, entries = {}, []
    for n in range(draw(st.integers(0, 5))):
        uid = f"s{n}"
        p = draw(st.sampled_from([q for q in H200.profiles]))
        pl = draw(st.sampled_from(p.placements))  # bindings may even collide: adopt must stay sane
        if draw(st.booleans()):
            bindings[uid] = Binding(uid, "node", 0, MODE_MIG, p.memory_mib * MiB, p.id, p.name, pl.start, pl.size)
        if draw(st.booleans()) and insts:
            entries.append(owner(uid, draw(st.sampled_from(insts))))
    return insts, bindings, entries, draw(st.sampled_from([BOOT, "boot-0"]))


@settings(max_examples=150, deadline=None)
@given(adoption_inputs())
def test_adopt_gives_each_instance_to_at_most_one_live_slice(state) -> None:
    insts, bindings, entries, boot = state
    rec = OwnerRecord(boot, {e.uid: e for e in entries})
    result = adopt(rec, BOOT, {0: insts}, bindings)
    assert set(result.record.owners) <= set(bindings)
    assert set(result.dropped) == set(rec.owners) - set(bindings)
    assert len(set(result.adopted)) == len(result.adopted)
    for i in insts:
        holders = [u for u, e in result.record.owners.items() if e.holds(i, 0)]
        assert len(holders) <= 1, f"{i} adopted by {holders}"
    for uid in result.adopted:
        e = result.record.owners[uid]
        b = bindings[uid]
        found = [i for i in insts if i.gi_id == e.gi_id]
        assert len(found) == 1
        # Matched by the record's GI (same boot) or by the binding's placement.
        assert (found[0].start, found[0].profile_id) == (b.start, b.profile_id) or (
            boot == BOOT and rec.owners.get(uid) is not None and rec.owners[uid].gi_id == e.gi_id)
