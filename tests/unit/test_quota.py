"""core/books/quota.py: admission at the quota's edge, shares, the hold rule, and the fair order, each
checked against a computation written here (sums of bytes, a brute-force simulation of the order)."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.books.ledger import Ledger
from mig_operator.core.books.quota import (
    QUOTA_EXCEEDED,
    QUOTA_NAME,
    FairQueue,
    Quota,
    Usage,
    admit,
    agent_holdings,
    held_behind,
    holds_back,
    quota_from_spec,
    share,
)
from mig_operator.core.placement.cluster import (
    NO_CAPACITY,
    NO_GPU,
    NO_SUCH_PROFILE,
    TOO_LARGE,
    Binding,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.tenancy import SHARING_LABEL, SHARING_VALUE
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.request import SliceRequest

GIB = 2**30
MIB = 2**20
H200_1G = 16384 * MIB  # what a 1g.18gb grants, whatever was asked (10G, say)


# ---- the spec -------------------------------------------------------------------------------------


def test_spec_memory_has_the_slice_grammar_and_slices_is_optional() -> None:
    assert quota_from_spec("a", {"memory": "40Gi"}) == Quota("a", 40 * GIB, None)
    assert quota_from_spec("a", {"memory": "160GB", "slices": 8}) == Quota("a", 160 * 10**9, 8)
    assert quota_from_spec("a", {"memory": "1", "slices": 0}).slices == 0


@pytest.mark.parametrize("spec, names", [
    ({"memory": "40X"}, ["'40X'", "4Gi"]),
    ({"memory": "0"}, ["'0'", "greater than zero"]),
    ({"memory": "-1Gi"}, ["'-1Gi'"]),
    ({"memory": 40}, ["40", "quantity string"]),
    ({}, ["None", "4Gi"]),
    ({"memory": "4Gi", "slices": -1}, ["-1", "slices: 8"]),
    ({"memory": "4Gi", "slices": True}, ["True"]),
    ({"memory": "4Gi", "slices": 1.5}, ["1.5"]),
])
def test_a_bad_spec_is_refused_naming_the_value_and_an_example(spec: dict, names: list[str]) -> None:
    with pytest.raises(QuantityError) as raised:
        quota_from_spec("a", spec)
    for name in names:
        assert name in str(raised.value)


# ---- admission ------------------------------------------------------------------------------------


def test_no_quota_no_limit() -> None:
    assert admit(None, Usage(10**18, 10**6), 10**18).allowed


@pytest.mark.parametrize("used", [0, 1, 40 * GIB - H200_1G - 1, 40 * GIB - H200_1G, 40 * GIB - H200_1G + 1, 40 * GIB])
def test_memory_admission_is_exact_to_the_byte(used: int) -> None:
    quota = Quota("a", 40 * GIB)
    verdict = admit(quota, Usage(used, 3), H200_1G)
    # Independent: the binding fits when what is held plus the grant does not exceed the quota.
    assert verdict.allowed == (used + H200_1G <= 40 * GIB)
    if not verdict.allowed:
        assert verdict.could_fit
        assert "GpuQuota a/quota" in verdict.message and "16Gi" in verdict.message and "40Gi" in verdict.message


def test_the_quota_one_byte_either_side() -> None:
    grant = H200_1G
    assert admit(Quota("a", grant), Usage(), grant).allowed
    assert not admit(Quota("a", grant - 1), Usage(), grant).allowed
    assert admit(Quota("a", grant + 1), Usage(1, 1), grant).allowed
    assert not admit(Quota("a", grant + 1), Usage(2, 1), grant).allowed


def test_the_grant_counts_not_the_request() -> None:
    # A 10G request (9537 MiB) granted a 1g.18gb counts 16384 MiB: 2 fit in 32Gi, not 3.
    quota = Quota("a", 32 * GIB)
    used = Usage()
    admitted = 0
    while admit(quota, used, H200_1G).allowed:
        used = used.plus(H200_1G)
        admitted += 1
    assert admitted == 32 * GIB // H200_1G == 2
    assert used == Usage(2 * H200_1G, 2)


@pytest.mark.parametrize("held, hard, allowed", [
    (0, 1, True), (1, 1, False), (2, 3, True), (3, 3, False), (0, 0, False)])
def test_slice_count_admission(held: int, hard: int, allowed: bool) -> None:
    verdict = admit(Quota("a", 10**15, hard), Usage(held * GIB, held), GIB)
    assert verdict.allowed == allowed
    if not allowed:
        assert f"{held} of its {hard} slices" in verdict.message and "slices" in verdict.message
        assert verdict.could_fit == (hard >= 1)


def test_the_message_says_used_hard_and_what_it_would_add() -> None:
    verdict = admit(Quota("team-a", 40 * GIB, 4), Usage(32 * GIB, 2), H200_1G)
    assert not verdict.allowed
    assert "namespace team-a holds 32Gi of its 40Gi GPU memory and 2 of its 4 slices" in verdict.message
    assert "would add 16Gi" in verdict.message and "memory" in verdict.message
    unknown = admit(Quota("team-a", 40 * GIB), Usage(40 * GIB, 1), 4 * GIB, at_least=True)
    assert "at least 4Gi" in unknown.message


def test_a_grant_larger_than_the_quota_could_never_fit() -> None:
    verdict = admit(Quota("a", 10 * GIB), Usage(), H200_1G)
    assert not verdict.allowed and not verdict.could_fit and "raise spec.memory" in verdict.message


def test_lowering_a_quota_below_what_is_held_refuses_only_new_bindings() -> None:
    held = Usage(48 * GIB, 3)
    # Nothing in admit takes back what is held; any new binding is refused, even the smallest.
    assert not admit(Quota("a", 16 * GIB), held, 1).allowed
    assert admit(Quota("a", 48 * GIB + GIB), held, GIB).allowed


# ---- shares ---------------------------------------------------------------------------------------


def test_shares() -> None:
    assert share(Quota("a", 40 * GIB), Usage(10 * GIB, 1), 0) == Fraction(1, 4)
    assert share(Quota("a", 40 * GIB, 2), Usage(10 * GIB, 1), 0) == Fraction(1, 2)  # the larger share
    assert share(None, Usage(10 * GIB, 1), 80 * GIB) == Fraction(1, 8)  # of the cluster
    assert share(None, Usage(), 0) == 0
    assert share(Quota("a", 40 * GIB, 0), Usage(), 0) == 0
    assert share(Quota("a", 40 * GIB, 0), Usage(GIB, 2), 0) > 1  # held past a quota of none
    assert share(Quota("a", 16 * GIB), Usage(32 * GIB, 2), 0) == 2  # lowered below what is held


# ---- the hold --------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, could_fit, waited, held", [
    (NO_CAPACITY, True, 0.0, True),
    (NO_CAPACITY, True, 59.999, True),
    (NO_CAPACITY, True, 60.0, False),  # the bound
    (QUOTA_EXCEEDED, True, 10.0, True),
    (QUOTA_EXCEEDED, False, 10.0, False),  # its quota can never hold it: it holds nobody back
    (TOO_LARGE, True, 1.0, False),  # no room can ever free for it
    (NO_CAPACITY, True, -5.0, False),  # a clock skewed into the future holds nothing
])
def test_holds_back(code: str, could_fit: bool, waited: float, held: bool) -> None:
    assert holds_back(code, could_fit, waited, 60.0) == held


@pytest.mark.parametrize("own, held", [
    (None, True),  # it could be placed now: the head has the first call on the room
    (NO_CAPACITY, True),  # it waits for room too: behind the head
    (NO_GPU, False),  # no GPU of its kind at all: no freed room serves it, it says so
    (TOO_LARGE, False),
    (NO_SUCH_PROFILE, False),
])
def test_a_younger_slice_is_held_only_when_room_is_what_it_waits_for(own: str | None, held: bool) -> None:
    assert held_behind(own) == held


# ---- the fair order -------------------------------------------------------------------------------


def serve(items: list[tuple[str, int, str]], quotas: dict[str, Quota], grant: dict[str, int], room: int,
          cluster_bytes: int) -> list[str]:
    """Drive a FairQueue as the binder does: each slice binds if its grant fits the room left and its
    namespace's quota, else it is refused (no hold). Returns the bound items in order."""
    used: dict[str, Usage] = {}
    shares = {ns: share(quotas.get(ns), Usage(), cluster_bytes) for ns, _a, _i in items}
    line: FairQueue[str] = FairQueue(items, shares)
    bound = []
    while (step := line.next()) is not None:
        ns, item = step
        u = used.get(ns, Usage())
        if grant[item] <= room and admit(quotas.get(ns), u, grant[item]).allowed:
            room -= grant[item]
            used[ns] = u.plus(grant[item])
            bound.append(item)
        line.settle(ns, share(quotas.get(ns), used.get(ns, Usage()), cluster_bytes))
    return bound


def test_b_gets_its_10_before_a_gets_its_41st() -> None:
    # A made 100 slices, then B 10, all waiting; room for 40.
    items = [("a", i, f"a{i}") for i in range(100)] + [("b", 100 + i, f"b{i}") for i in range(10)]
    grant = {item: GIB for _ns, _age, item in items}
    bound = serve(items, {}, grant, 40 * GIB, 40 * GIB)
    assert len(bound) == 40
    assert {f"b{i}" for i in range(10)} <= set(bound)
    assert [i for i in bound if i.startswith("a")] == [f"a{i}" for i in range(30)]  # A's oldest, in order


def test_the_namespace_with_the_smaller_share_of_its_quota_goes_first() -> None:
    # a holds 3 of its 4, b 1 of its 8 slices: b's slices go first though a's are older.
    items = [("a", 0, "a0"), ("a", 1, "a1"), ("b", 2, "b0"), ("b", 3, "b1")]
    line: FairQueue[str] = FairQueue(items, {"a": Fraction(3, 4), "b": Fraction(1, 8)})
    order = []
    shares = {"a": Fraction(3, 4), "b": Fraction(1, 8)}
    while (step := line.next()) is not None:
        order.append(step[1])
        shares[step[0]] += Fraction(1, 8)
        line.settle(step[0], shares[step[0]])
    # b: 1/8 -> 2/8 -> 3/8, then a (3/4) is the smallest only once b's line is empty.
    assert order == ["b0", "b1", "a0", "a1"]


def test_equal_shares_serve_the_oldest_head_first() -> None:
    items = [("b", 5, "b5"), ("a", 7, "a7"), ("a", 3, "a3"), ("c", 4, "c4")]
    line: FairQueue[str] = FairQueue(items, {})
    first = line.next()
    assert first == ("a", "a3")


def test_hold_takes_the_rest_of_a_namespace_out_of_the_pass() -> None:
    items = [("a", 0, "big"), ("a", 1, "small1"), ("a", 2, "small2"), ("b", 3, "b0")]
    line: FairQueue[str] = FairQueue(items, {})
    assert line.next() == ("a", "big")
    assert line.settle("a", Fraction(0), hold=True) == ["small1", "small2"]  # oldest first
    assert line.next() == ("b", "b0")
    assert line.settle("b", Fraction(0)) == []
    assert line.next() is None


def test_settle_must_name_the_namespace_given() -> None:
    line: FairQueue[str] = FairQueue([("a", 0, "x"), ("b", 1, "y")], {})
    assert line.next() == ("a", "x")
    with pytest.raises(AssertionError):
        line.next()
    with pytest.raises(AssertionError):
        line.settle("b", Fraction(0))


def test_fair_order_matches_a_brute_force_simulation() -> None:
    """Random namespaces, quotas, ages and grants: the queue's order equals picking, at every step,
    the minimum (share, oldest age, namespace) over every namespace scanned from scratch."""
    rng = random.Random(18)
    for _ in range(200):
        namespaces = [f"n{i}" for i in range(rng.randint(1, 5))]
        quotas = {ns: Quota(ns, rng.choice([4, 8, 16, 40]) * GIB, rng.choice([None, 2, 5]))
                  for ns in namespaces if rng.random() < 0.7}
        items = [(rng.choice(namespaces), rng.randint(0, 50), f"s{k}") for k in range(rng.randint(1, 30))]
        grant = {item: rng.choice([1, 2, 4, 8]) * GIB for _ns, _age, item in items}
        room, cluster = rng.randint(0, 60) * GIB, 64 * GIB
        got = serve(items, quotas, grant, room, cluster)

        # Brute force: lines per namespace by (age, position), pick the minimum key each step.
        lines = {ns: sorted([(age, k, item) for k, (n, age, item) in enumerate(items) if n == ns]) for ns in namespaces}
        used = {ns: Usage() for ns in namespaces}
        left, expected = room, []
        while any(lines.values()):
            ns = min((n for n in namespaces if lines[n]),
                     key=lambda n: (share(quotas.get(n), used[n], cluster), lines[n][0][0], n))
            _age, _k, item = lines[ns].pop(0)
            q = quotas.get(ns)
            fits_quota = q is None or (used[ns].memory_bytes + grant[item] <= q.memory_bytes
                                       and (q.slices is None or used[ns].slices < q.slices))
            if grant[item] <= left and fits_quota:
                left -= grant[item]
                used[ns] = used[ns].plus(grant[item])
                expected.append(item)
        assert got == expected


# ---- the controller's bookkeeping (core/books/ledger.py) ------------------------------------

def slice_body(uid: str, ns: str, phase: str | None, granted: int = 0, deleting: bool = False,
               version: int = 1) -> dict:
    meta = {"uid": uid, "namespace": ns, "name": uid, "resourceVersion": str(version),
            "creationTimestamp": "2026-11-24T15:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-24T15:01:00Z"
    status = {} if phase is None else {"phase": phase}
    if phase in ("Bound", "Creating", "Ready"):
        status.update(node="n1", gpu=0, mode="fraction", grantedBytes=granted)
    return {"metadata": meta, "spec": {"fraction": 0.5}, "status": status}


def test_the_controller_counts_grants_from_bound_on_until_the_slice_is_gone() -> None:
    from books import BodyLedger

    state = BodyLedger()
    # A sharing node: each fraction is charged its grant (a GPU held whole is test_fraction_charges.py's).
    sharing = {SHARING_LABEL: SHARING_VALUE}
    state.set_node_labels("n1", sharing)
    state.put_slice(slice_body("p", "a", "Pending"))
    state.put_slice(slice_body("f", "a", "Failed"))
    for uid, phase in (("b", "Bound"), ("c", "Creating"), ("r", "Ready")):
        state.put_slice(slice_body(uid, "a", phase, granted=3 * GIB))
    state.put_slice(slice_body("o", "other", "Ready", granted=GIB))
    assert state.used("a") == Usage(9 * GIB, 3) and state.used("other") == Usage(GIB, 1)
    state.put_slice(slice_body("r", "a", "Ready", granted=3 * GIB, deleting=True, version=2))
    # Being deleted is not gone: its agent may keep it while its claim is in use (issue 24).
    assert state.used("a") == Usage(9 * GIB, 3)
    assert "r" in {b.uid for b in state.bindings()}
    state.remove_slice("r")
    assert state.used("a") == Usage(6 * GIB, 2)
    state.remove_slice("b")
    assert state.used("a") == Usage(3 * GIB, 1)
    state.remove_slice("c")
    assert state.used("a") == Usage() and "a" not in state.usage
    # A full list recomputes from scratch: the same sums as a sum written here.
    bodies = [slice_body(f"s{i}", f"n{i % 3}", "Ready", granted=(i + 1) * GIB) for i in range(9)]
    state.replace_all(bodies, [], [{"metadata": {"name": "n1", "labels": sharing}}])
    for ns in ("n0", "n1", "n2"):
        mine = [(i + 1) * GIB for i in range(9) if f"n{i % 3}" == ns]
        assert state.used(ns) == Usage(sum(mine), len(mine))
    assert state.used("other") == Usage()


def test_the_controller_takes_only_the_quota_named_quota_and_a_valid_spec() -> None:
    from books import BodyLedger

    state = BodyLedger()
    assert state.put_quota({"metadata": {"namespace": "a", "name": "quota"}, "spec": {"memory": "40Gi"}})
    assert not state.put_quota({"metadata": {"namespace": "a", "name": "other"}, "spec": {"memory": "1Gi"}})
    assert state.quotas["a"] == Quota("a", 40 * GIB)
    assert not state.put_quota({"metadata": {"namespace": "a", "name": "quota"}, "spec": {"memory": "40X"}})
    assert "a" not in state.quotas and "'40X'" in state.quota_errors["a"]  # ignored: no limit, and why
    state.put_quota({"metadata": {"namespace": "a", "name": "quota"}, "spec": {"memory": "8Gi", "slices": 2}})
    state.put_slice(slice_body("x", "a", "Ready", granted=2 * GIB))
    assert state.share("a") == Fraction(1, 2)  # 1 of 2 slices is more than 2Gi of 8Gi
    state.remove_quota({"metadata": {"namespace": "a", "name": "quota"}})
    assert "a" not in state.quotas and state.share("a") == 0  # no inventories: the cluster has no memory


def test_a_namespace_without_a_quota_is_ranked_by_its_share_of_every_gpu() -> None:
    from books import BodyLedger

    def gpunode(name: str, *mib: int) -> dict:
        gpus = [{"index": i, "uuid": f"GPU-{name}-{i}", "memoryMiB": m} for i, m in enumerate(mib)]
        return {"metadata": {"name": name}, "spec": {"nodeName": name}, "status": {"gpus": gpus}}

    state = BodyLedger()
    state.put_inventory(gpunode("n1", 81559, 81559))
    state.put_inventory(gpunode("n2", 23034))
    assert state.cluster_bytes == (2 * 81559 + 23034) * MIB
    state.put_inventory(gpunode("n1", 81559))  # a GPU fewer
    assert state.cluster_bytes == (81559 + 23034) * MIB
    state.put_slice(slice_body("x", "a", "Ready", granted=23034 * MIB))
    # A fraction on GPU 0 of n1, which does not share: charged that GPU's whole memory.
    assert state.share("a") == Fraction(81559, 81559 + 23034)
    state.remove_inventory(gpunode("n2"))
    assert state.cluster_bytes == 81559 * MIB


def test_a_group_is_admitted_as_a_whole_by_memory_and_by_count() -> None:
    quota = Quota("a", 40 * GIB, 4)
    # Three slices held; a group of two would make five: refused as a whole, even though one would fit.
    verdict = admit(quota, Usage(3 * GIB, 3), 2 * GIB, slices=2)
    assert not verdict.allowed and verdict.could_fit
    assert "this group would add 2Gi and 2 slices, past the quota's slices" in verdict.message
    assert admit(quota, Usage(3 * GIB, 2), 2 * GIB, slices=2).allowed
    # A group larger than the quota's count can never fit, even alone.
    alone = admit(quota, Usage(), 5 * GIB, slices=5)
    assert not alone.allowed and not alone.could_fit and "raise spec.slices" in alone.message
    # Memory: 37 GiB held, two grants of 1.5 GiB pass 40 GiB by 1 GiB.
    assert not admit(Quota("a", 40 * GIB), Usage(37 * GIB, 2), 3 * GIB + 1, slices=2).allowed
    assert admit(Quota("a", 40 * GIB), Usage(37 * GIB, 2), 3 * GIB, slices=2).allowed


def gpunode_holding(name: str, fractions: list[tuple[str, str, int]] = (), instances: list[dict] = ()) -> dict:
    """A GpuNode as an agent publishes it: one L4 for fractions and one H200 in MIG mode with 1g.18gb."""
    return {"metadata": {"name": name}, "spec": {"nodeName": name}, "status": {
        "models": [{"name": "h200-141gb", "profiles": [
            {"name": "1g.18gb", "id": 19, "memoryMiB": 16384, "placements": [{"start": 0, "size": 1}]}]}],
        "gpus": [
            {"index": 0, "uuid": "GPU-l4", "memoryMiB": 23034,
             "fractions": [{"sliceUID": u, "slice": s, "bytes": b} for u, s, b in fractions]},
            {"index": 1, "uuid": "GPU-h200", "model": "h200-141gb", "memoryMiB": 143771, "migCapable": True,
             "migEnabled": True, "instances": list(instances)}]}}


@pytest.mark.parametrize(("what", "fractions", "instances", "expected"), [
    ("nothing held", [], [], {}),
    ("a fraction", [("u1", "a/x", 5 * GIB)], [], {"u1": ("a", 5 * GIB)}),
    ("an instance owned and in use (a claim prepared on it)", [],
     [{"profileId": 19, "start": 0, "size": 1, "sliceUID": "u2", "slice": "b/y", "inUse": True}],
     {"u2": ("b", 16384 * MIB)}),
    ("an owned instance not in use: the slice's own charge governs", [],
     [{"profileId": 19, "start": 0, "size": 1, "sliceUID": "u3", "slice": "b/y", "inUse": False}], {}),
    ("an idle instance a process uses (no slice)", [],
     [{"profileId": 19, "start": 0, "size": 1, "sliceUID": "", "inUse": True}], {}),
])
def test_what_an_agent_holds_by_slice(what: str, fractions: list, instances: list, expected: dict) -> None:
    node = gpunode_holding("n1", fractions, instances)
    assert agent_holdings(inventory_from_status("n1", node["status"])) == expected, what


@pytest.mark.parametrize("sharing", [False, True])
def test_a_device_an_agent_holds_for_a_slice_that_is_gone_stays_charged(sharing: bool) -> None:
    """Its finalizer removed by hand while its claim is prepared: the slice is gone, its agent still holds
    its device (the GpuNode says so), and its namespace is charged for it until the agent lets it go: the
    L4's whole memory (23034 MiB) where the node does not share its fraction GPUs, else the grant."""
    from books import BodyLedger

    state = BodyLedger()
    labels = {SHARING_LABEL: SHARING_VALUE} if sharing else {}
    state.set_node_labels("n1", labels)
    held = Usage(5 * GIB, 1) if sharing else Usage(23034 * MIB, 1, 1)
    state.put_slice(slice_body("u1", "a", "Ready", granted=5 * GIB))
    # Once the GPU's memory is known, a GPU held whole is charged it.
    assert state.put_inventory(gpunode_holding("n1", [("u1", "a/u1", 5 * GIB)])) == (set() if sharing else {"a"})
    assert state.used("a") == held
    state.remove_slice("u1")
    assert state.used("a") == held  # the agent still holds it
    assert state.put_inventory(gpunode_holding("n1", [])) == {"a"}
    assert state.used("a") == Usage()
    # A full list sees the same: a held device of a slice no longer listed is charged.
    node = {"metadata": {"name": "n1", "labels": labels}}
    state.replace_all([], [gpunode_holding("n1", [("u9", "c/z", GIB)])], [node])
    assert state.used("c") == (Usage(GIB, 1) if sharing else Usage(23034 * MIB, 1, 1))
    assert state.remove_inventory(gpunode_holding("n1")) == {"c"} and state.used("c") == Usage()


def test_a_fraction_gpu_is_occupied_by_what_its_agent_holds_not_only_by_bindings() -> None:
    """Without the GpuNode's fractions the planner placed a new slice on a GPU still occupied, and the
    agent failed it with Conflict. Room is counted once per slice, binding or not."""
    l4 = 23034 * MIB
    held = [("gone", "a/gone", l4 // 2)]
    inventory = inventory_from_status("n1", gpunode_holding("n1", held)["status"])
    inventory = type(inventory)("n1", inventory.gpus[:1])  # the L4 only
    planner = ClusterPlanner()
    planner.reset([inventory], [], [])
    half, most = SliceRequest(memory_bytes=l4 // 2), SliceRequest(memory_bytes=l4 // 2 + MIB)
    # exactly the half its agent does not hold (namespace a: the held slice's, so tenancy lets it in)
    assert planner.plan(half, namespace="a").granted_bytes == l4 // 2
    for decide in (lambda r: planner.plan(r, namespace="a"),
                   lambda r: plan_binding(r, build_view([inventory], [], []), namespace="a")):
        with pytest.raises(Refusal):
            decide(most)
    # A binding of the held slice itself does not count twice.
    planner.put_binding(Binding("gone", "n1", 0, "fraction", l4 // 2, namespace="a"))
    assert planner.plan(half, namespace="a").granted_bytes == l4 // 2


def test_the_ledger_keeps_what_was_written_to_each_gpuquotas_status_while_the_object_is_known() -> None:
    """The GpuQuota status book is the ledger's: the status read from the object (after a restart: no
    write when equal), then as written; a quota with an invalid spec still has its object's generation
    (its status is written); a removed quota, or one never seen, keeps nothing."""
    ledger = Ledger()
    written = {"used": {"memory": "0", "slices": 0, "wholeGpus": 0}, "waiting": 0, "observedGeneration": 3}
    assert ledger.put_quota({"metadata": {"namespace": "a", "name": QUOTA_NAME, "generation": 3},
                             "spec": {"memory": "8Gi"}, "status": written})
    assert ledger.quota_generation("a") == 3 and ledger.quota_status_written("a") == written
    assert not ledger.put_quota({"metadata": {"namespace": "b", "name": QUOTA_NAME, "generation": 1},
                                 "spec": {"memory": "lots"}})
    assert ledger.quota_generation("b") == 1 and "b" in ledger.quota_errors and set(ledger.quota_objects) == {"a", "b"}
    ledger.quota_status_wrote("b", {"waiting": 0})
    assert ledger.quota_status_written("b") == {"waiting": 0}
    ledger.remove_quota({"metadata": {"namespace": "a", "name": QUOTA_NAME}})
    assert ledger.quota_generation("a") is None and ledger.quota_status_written("a") is None
    ledger.quota_status_wrote("c", {"waiting": 0})  # no GpuQuota object in c
    assert ledger.quota_status_written("c") is None and set(ledger.quota_objects) == {"b"}
