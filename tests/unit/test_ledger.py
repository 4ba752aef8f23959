"""The ledger's invariants through any sequence of slices, groups, quotas, decisions, writes that
succeed or fail, deletions and removals: no two bindings overlap, each namespace's usage is the sum
of what its slices hold, a refused group holds nothing, a rollback restores the books exactly."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.books.ledger import (
    CLAIM_ALLOCATED,
    CLAIM_WRITTEN,
    Ledger,
    NodeLabels,
    NodeRecord,
    SliceRecord,
)
from mig_operator.core.books.quota import QUOTA_NAME, Usage
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, GpuState, NodeInventory
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.quantities import MIB
from mig_operator.core.requests.request import slice_request

REQUESTS = [slice_request(memory=m) for m in ("4G", "9Gi", "17Gi", "30Gi", "70Gi")] + [
    slice_request(fraction=f) for f in (0.25, 0.5, 1.0)] + [slice_request(profile=p) for p in ("1g.10gb", "3g.40gb")]
# Compute shares (fractions only), chosen so that floats would drift: 0.34 + 0.56 + 0.1 is 1 exactly.
REQUESTS += [slice_request(memory="4G", compute=c) for c in (0.34, 0.56, 0.1)] + [
    slice_request(fraction=0.25, compute=0.5)]
NAMESPACES = ["team-a", "team-b"]


def gpu(model_name: str, index: int, mig: bool) -> GpuState:
    model = get_model(model_name)
    return GpuState(index, f"GPU-{model_name}-{index}", model.product, model.name, model.memory_mib,
                    model.mig_capable, mig and model.mig_capable, model.profiles if model.mig_capable else ())


INVENTORIES = [
    NodeInventory("n0", (gpu("h100-80gb", 0, True), gpu("h100-80gb", 1, True))),
    NodeInventory("n1", (gpu("l40s-48gb", 0, False), gpu("h100-80gb", 1, False))),
]
MEMORY = {(inv.node, g.index): g.memory_mib * MIB for inv in INVENTORIES for g in inv.gpus}


def books(ledger: Ledger) -> tuple:
    """Everything a decision may change, comparable."""
    return (sorted(ledger.bindings(), key=lambda b: b.uid), dict(ledger.usage), dict(ledger.charges()),
            dict(ledger.waiting), sorted(u for u in ledger.slices if ledger.reserved(u) is not None))


def record(uid: str, namespace: str, request: int, group: str | None = None, size: int = 1) -> SliceRecord:
    return SliceRecord(uid=uid, namespace=namespace, name=uid, created=f"2026-11-26T00:00:{len(uid):02d}Z", version=1,
                       body={"metadata": {"uid": uid}}, request=REQUESTS[request], invalid="", pinned=None,
                       phase=None, binding=None, deleting=False, marked=False, group=group, group_size=size)


def check_invariants(ledger: Ledger, sharing: set[str] = frozenset()) -> None:
    by_gpu: dict[tuple[str, int], list] = {}
    for b in ledger.bindings():
        by_gpu.setdefault((b.node, b.gpu), []).append(b)
    for where, bound in by_gpu.items():
        assert len({b.mode for b in bound}) == 1, f"MIG and fraction bindings on one GPU {where}"
        if bound[0].mode == MODE_MIG:
            for i, a in enumerate(bound):
                for b in bound[i + 1:]:
                    assert not a.mask & b.mask, f"{a} overlaps {b}"
        else:
            assert sum(b.granted_bytes for b in bound) <= MEMORY[where]
            # Compute: shares (as written) sum to at most 1, and shares and shared fractions never meet.
            shares = [b.compute for b in bound]
            assert all(c is None for c in shares) or all(c is not None for c in shares), f"mixed on {where}"
            assert sum(Decimal(repr(c)) for c in shares if c is not None) <= 1, f"compute over 1 on {where}"
    # Usage from first principles: every known slice holding a binding (written, or reserved) is charged,
    # a MIG slice or a fraction on a sharing node its grant, a fraction elsewhere its GPU's memory once per
    # namespace and GPU.
    expected_usage(ledger, sharing)


def expected_usage(ledger: Ledger, sharing: set[str]) -> None:
    memory: dict[str, int] = {}
    slices: dict[str, int] = {}
    whole: dict[str, set[tuple[str, int]]] = {}
    for info in ledger.slices.values():
        held = info.binding or ledger.reserved(info.uid)
        if held is None:
            continue
        slices[info.namespace] = slices.get(info.namespace, 0) + 1
        if held.mode == MODE_FRACTION and held.node not in sharing:
            whole.setdefault(info.namespace, set()).add((held.node, held.gpu))
        else:
            memory[info.namespace] = memory.get(info.namespace, 0) + held.granted_bytes
    expected = {
        ns: Usage(memory.get(ns, 0) + sum(MEMORY[g] for g in whole.get(ns, ())), n, len(whole.get(ns, ())))
        for ns, n in slices.items()
    }
    assert ledger.usage == expected
    for ns in NAMESPACES:
        assert ledger.held_whole(ns) == {g: MEMORY[g] for g in sorted(whole.get(ns, ()))}


step = st.one_of(
    st.tuples(st.just("new"), st.sampled_from(NAMESPACES), st.integers(0, len(REQUESTS) - 1), st.integers(1, 3)),
    st.tuples(st.just("decide"), st.integers(0, 40), st.booleans()),
    st.tuples(st.just("decide"), st.integers(0, 40), st.booleans()),
    st.tuples(st.just("quota"), st.sampled_from(NAMESPACES), st.sampled_from([None, "10Gi", "40Gi", "200Gi"])),
    st.tuples(st.just("delete"), st.integers(0, 40)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("share"), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=40), st.booleans())
def test_the_books_keep_their_invariants(steps, quota_required) -> None:
    ledger = Ledger(quota_required=quota_required)
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    for inv in INVENTORIES:
        ledger.put_inventory(inv)
    made: list[str] = []
    sharing: set[str] = set()
    for op in steps:
        if op[0] == "new":
            _, namespace, request, size = op
            uid = f"s{len(made)}"
            group = None if size == 1 else f"g{len(made)}"
            for i in range(size):
                ledger.put_slice(record(f"{uid}-{i}", namespace, request, group, size))
                made.append(f"{uid}-{i}")
        elif op[0] == "decide" and made:
            uid, write_ok = made[op[1] % len(made)], op[2]
            before = books(ledger)
            decision = ledger.decide(uid)
            if decision.kind == "skip":
                assert books(ledger) == before
            elif decision.kind == "refuse":
                after = books(ledger)
                assert after[0] == before[0] and after[1:3] == before[1:3] and after[4] == before[4]
                assert all(ledger.waiting[m.uid][1] == decision.refusal.code for m in decision.todo)
            elif write_ok:
                quota = ledger.quotas.get(decision.todo[0].namespace)
                if quota is not None:  # the charge admitted, computed by hand, stays within the quota
                    expected_usage(ledger, sharing)
                    assert ledger.used(quota.namespace).memory_bytes <= quota.memory_bytes
                for member, binding in zip(decision.todo, decision.bindings, strict=True):
                    ledger.put_slice(replace(member, version=2, phase="Bound", binding=binding))
                    ledger.commit(member.uid)
            else:
                for member in decision.todo:
                    ledger.rollback(member.uid)
                assert books(ledger) == before
        elif op[0] == "quota":
            _, namespace, memory = op
            body = {"metadata": {"namespace": namespace, "name": QUOTA_NAME}, "spec": {"memory": memory}}
            (ledger.remove_quota if memory is None else ledger.put_quota)(body)
        elif op[0] == "delete" and made:
            known = ledger.slices.get(made[op[1] % len(made)])
            if known is not None:
                ledger.put_slice(replace(known, version=known.version + 1, deleting=True))
        elif op[0] == "remove" and made:
            ledger.remove_slice(made[op[1] % len(made)])
        elif op[0] == "share":
            (sharing.add if op[1] else sharing.discard)("n1")
            ledger.put_node("n1", NodeRecord(flags=NodeLabels(sharing=op[1])))
        check_invariants(ledger, sharing)


def test_a_deleting_slice_keeps_its_binding_and_charge_until_it_is_gone() -> None:
    ledger = Ledger()
    ledger.put_inventory(INVENTORIES[1])
    ledger.put_slice(record("x", "team-a", 5))
    decision = ledger.decide("x")
    assert decision.kind == "bind" and decision.bindings[0].mode == MODE_FRACTION
    ledger.put_slice(replace(decision.todo[0], version=2, phase="Bound", binding=decision.bindings[0]))
    ledger.commit("x")
    charged = ledger.used("team-a")
    ledger.put_slice(replace(ledger.slices["x"], version=3, deleting=True))
    assert ledger.used("team-a") == charged and [b.uid for b in ledger.bindings()] == ["x"]
    ledger.remove_slice("x")
    assert ledger.used("team-a") == Usage() and ledger.bindings() == []


def quota(namespace: str, memory: str) -> dict:
    return {"metadata": {"namespace": namespace, "name": QUOTA_NAME}, "spec": {"memory": memory}}


def test_a_group_its_quota_refuses_holds_nothing() -> None:
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(INVENTORIES[0])
    ledger.put_quota(quota("team-a", "10Gi"))
    for i in range(2):
        ledger.put_slice(record(f"g-{i}", "team-a", 1, "g", 2))  # 2 x 9Gi: placeable, over the quota
    before = books(ledger)
    decision = ledger.decide("g-0")
    assert decision.kind == "refuse" and decision.refusal.code == "QuotaExceeded"
    assert ledger.bindings() == [] and books(ledger)[:3] == before[:3]
    ledger.put_quota(quota("team-a", "40Gi"))
    assert ledger.decide("g-1").kind == "bind" and len(ledger.bindings()) == 2
    check_invariants(ledger)


def test_a_rollback_puts_a_waiting_slice_back_in_line() -> None:
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(INVENTORIES[0])
    ledger.put_quota(quota("team-a", "10Gi"))
    ledger.put_slice(record("x", "team-a", 2))  # 17Gi
    assert ledger.decide("x").refusal.code == "QuotaExceeded" and ledger.line.in_line("team-a")
    ledger.put_quota(quota("team-a", "40Gi"))
    before = books(ledger)
    assert ledger.decide("x").kind == "bind" and ledger.writing("x") and not ledger.line.in_line("team-a")
    ledger.rollback("x")
    assert books(ledger) == before and ledger.line.in_line("team-a") and not ledger.writing("x")


def test_a_claim_allocated_beside_a_binding_whose_write_failed_counts_as_written_only() -> None:
    # A pod's slice's claim is allocated while its binding is written: should that write fail, the next
    # binding may be elsewhere, so the allocation it holds must be checked again, not taken as done.
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(INVENTORIES[0])
    ledger.put_slice(record("x", "team-a", 2))
    ledger.set_claim_state("x", CLAIM_WRITTEN)
    assert ledger.decide("x").kind == "bind" and ledger.reserved("x") is not None
    ledger.set_claim_state("x", CLAIM_ALLOCATED)
    ledger.rollback("x")
    assert ledger.claim_state("x") == CLAIM_WRITTEN and ledger.reserved("x") is None


def test_a_full_list_older_than_what_the_watch_brought_keeps_the_newer_inventories() -> None:
    # The watch runs on while the full list is read: a GpuNode the watch brought at version 12 (a new
    # instance's GPU listed) must not go back to the list's version 10, nor one made after the list
    # (version 15, the list read at 11) go missing; nothing would bring them back until the next change.
    ledger = Ledger()
    older = NodeInventory("n0", ())
    newer, made = INVENTORIES[0], INVENTORIES[1]
    ledger.put_inventory(newer, 12)
    ledger.put_inventory(made, 15)
    ledger.replace_all([], [older], {}, 11, ({"n0": 10}, 11))
    assert ledger.inventories["n0"] == newer and ledger.inventories["n1"] == made
    # A list newer than the watch's event is taken, and one without versions replaces everything.
    ledger.replace_all([], [older], {}, 20, ({"n0": 20}, 20))
    assert ledger.inventories["n0"] == older and "n1" not in ledger.inventories
    ledger.put_inventory(newer, 30)
    ledger.replace_all([], [older], {})
    assert ledger.inventories["n0"] == older


def _bound(ledger: Ledger, uid: str, version: int, written: dict) -> None:
    """Decide slice ``uid`` and write its binding, as the binder does; ``written``: every binding
    the API server holds (uid -> binding), kept here apart from the ledger's own books."""
    decision = ledger.decide(uid)
    if decision.kind != "bind":
        return
    binding = decision.bindings[0]
    ledger.put_slice(replace(decision.todo[0], version=version, phase="Bound", binding=binding))
    ledger.commit(uid)
    written[uid] = binding


def _overlapping(written: dict) -> list[tuple[str, str]]:
    pairs = sorted(written.items())
    return [(a, b) for i, (a, x) in enumerate(pairs) for b, y in pairs[i + 1:]
            if (x.node, x.gpu) == (y.node, y.gpu) and x.mask & y.mask]


def test_a_full_list_keeps_the_slices_the_watch_showed_after_it() -> None:
    # The controller lists slices every resync_s while its watch runs on: a slice made and bound
    # after the list's snapshot (resourceVersion 100) is not in it. Dropping it freed its placement,
    # and the next slice was bound to the same instance (its agent refused it: Conflict).
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(INVENTORIES[0])
    written: dict = {}
    ledger.put_slice(replace(record("early", "team-a", 1), version=10))
    _bound(ledger, "early", 11, written)
    listed = [ledger.slices["early"]]  # the list, read at resourceVersion 100
    ledger.put_slice(replace(record("late", "team-a", 1), version=101))
    _bound(ledger, "late", 102, written)
    ledger.put_slice(replace(record("missed", "team-a", 1), version=60))  # deleted before the list
    ledger.replace_all(listed, INVENTORIES[:1], {"n0": NodeRecord(flags=NodeLabels(mig=True))}, listed_at=100)
    for i in range(13):  # two H100s hold 14 1g.10gb instances: 12 more fit
        ledger.put_slice(replace(record(f"next-{i:02d}", "team-a", 1), version=103 + 2 * i))
        _bound(ledger, f"next-{i:02d}", 104 + 2 * i, written)
    assert _overlapping(written) == []
    assert len(written) == 14 and "late" in ledger.slices and "missed" not in ledger.slices
    check_invariants(ledger)


def test_a_full_list_does_not_bring_back_a_slice_deleted_after_it() -> None:
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(INVENTORIES[0])
    written: dict = {}
    ledger.put_slice(replace(record("old", "team-a", 1), version=50))
    _bound(ledger, "old", 51, written)
    listed = [ledger.slices["old"]]  # read at 100; the slice is gone at 105
    assert ledger.remove_slice("old", 105) is not None
    del written["old"]
    ledger.replace_all(listed, INVENTORIES[:1], {"n0": NodeRecord(flags=NodeLabels(mig=True))}, listed_at=100)
    assert "old" not in ledger.slices and ledger.bindings() == [] and ledger.used("team-a") == Usage()
    # A later list that no longer has it settles it: nothing is remembered past it.
    ledger.replace_all([], INVENTORIES[:1], {"n0": NodeRecord(flags=NodeLabels(mig=True))}, listed_at=110)
    assert ledger.slices == {} and ledger._gone == {}


def test_a_version_seen_again_keeps_the_record_already_held() -> None:
    # A restart's listing brings every slice its first full read already has, at the same version: the
    # ledger keeps one record (and one body) of each, not a copy per read; a newer version replaces it.
    ledger = Ledger()
    first = replace(record("a", "team-a", 1), version=7)
    assert ledger.put_slice(first) is first
    again = replace(record("a", "team-a", 1), version=7, body={"metadata": {"uid": "a"}})
    assert again is not first and again == first
    assert ledger.put_slice(again) is first and ledger.slices["a"] is first
    ledger.replace_all([replace(first, body={"metadata": {"uid": "a"}})], INVENTORIES[:1], {}, listed_at=8)
    assert ledger.slices["a"] is first
    newer = replace(first, version=9, phase="Pending")
    assert ledger.put_slice(newer) is newer and ledger.slices["a"] is newer
    ledger.replace_all([replace(first, version=10)], INVENTORIES[:1], {}, listed_at=10)
    assert ledger.slices["a"].version == 10 and ledger.slices["a"] is not newer
