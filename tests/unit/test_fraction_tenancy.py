"""A GPU serving fractions serves one namespace at a time (issue 24) unless its node is labelled
cdmo.io/fraction-sharing=cross-namespace; MIG instances are isolated in hardware and not concerned.

Every case is decided twice, by plan_binding on build_view and by ClusterPlanner, which must agree.
Expected GPUs come from the tables here (free memory worked out by hand), never from the planner;
the property test replays random bindings and releases and checks each decision against a best fit
written out plainly below.
"""

from __future__ import annotations

import pytest
from cluster_reference import build_view, plan_binding
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    OTHER_NAMESPACE,
    TOO_LARGE,
    Binding,
    FractionState,
    GpuState,
    NodeInventory,
    Refusal,
    inventory_from_status,
)
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.placement.tenancy import SHARING_LABEL, SHARING_VALUE, shares_across_namespaces
from mig_operator.core.requests.request import MIN_SLICE_BYTES, SliceRequest, slice_request

GIB = 2**30
MIB = 2**20
L40S = get_model("l40s-48gb")
H100 = get_model("h100-80gb")
L40S_BYTES = L40S.memory_mib * MIB


def l40s(index: int, fractions: tuple[FractionState, ...] = ()) -> GpuState:
    return GpuState(index=index, uuid=f"GPU-l40s-{index}", product=L40S.product, model=L40S.name,
                    memory_mib=L40S.memory_mib, fractions=fractions)


def h100_mig(index: int = 0) -> GpuState:
    return GpuState(index=index, uuid=f"GPU-h100-{index}", product=H100.product, model=H100.name,
                    memory_mib=H100.memory_mib, mig_capable=True, mig_enabled=True, profiles=H100.profiles)


def frac(uid: str, node: str, gpu: int, gib: int, namespace: str) -> Binding:
    return Binding(uid, node, gpu, MODE_FRACTION, gib * GIB, namespace=namespace)


def decide(inventories: list[NodeInventory], request: SliceRequest, namespace: str, bindings=(), sharing=(),
           node: str | None = None, labelled=()) -> Binding | Refusal:
    """Both planners on the same inputs; they must agree."""
    try:
        first: Binding | Refusal = plan_binding(request, build_view(inventories, labelled, bindings, sharing), node,
                                                namespace=namespace)
    except Refusal as refusal:
        first = refusal
    planner = ClusterPlanner()
    planner.reset(inventories, labelled, bindings, sharing=sharing)
    try:
        second: Binding | Refusal = planner.plan(request, node, namespace=namespace)
    except Refusal as refusal:
        second = refusal
    assert first == second
    return first


TWO = [NodeInventory("a", (l40s(0), l40s(1)))]
ONE = [NodeInventory("a", (l40s(0),))]


# (case, inventories, bindings, sharing nodes, namespace, request, expected GPU (node, index) or code)
CASES = [
    ("another namespace's GPU is passed over for a free one, though best fit would take it",
     TWO, [frac("x", "a", 0, 10, "team-a")], (), "team-b", "10Gi", ("a", 1)),
    ("the same namespace packs onto its own GPU (best fit)",
     TWO, [frac("x", "a", 0, 10, "team-a")], (), "team-a", "10Gi", ("a", 0)),
    ("the only GPU with room serves another namespace: OtherNamespace",
     ONE, [frac("x", "a", 0, 10, "team-a")], (), "team-b", "10Gi", OTHER_NAMESPACE),
    ("labelled cross-namespace: it shares",
     ONE, [frac("x", "a", 0, 10, "team-a")], ("a",), "team-b", "10Gi", ("a", 0)),
    ("a GPU holding two namespaces (label since removed) takes neither's new fractions",
     ONE, [frac("x", "a", 0, 10, "team-a"), frac("y", "a", 0, 10, "team-b")], (), "team-a", "10Gi", OTHER_NAMESPACE),
    ("nothing fits even ignoring tenancy: NoCapacity, as before",
     ONE, [frac("x", "a", 0, 40, "team-a")], (), "team-b", "10Gi", NO_CAPACITY),
    ("too large for any GPU: TooLarge, not OtherNamespace",
     ONE, [frac("x", "a", 0, 10, "team-a")], (), "team-b", "60Gi", TOO_LARGE),
    ("best fit among the GPUs allowed: team-a's tighter GPU, not the empty one",
     [NodeInventory("a", (l40s(0), l40s(1), l40s(2)))],
     [frac("x", "a", 0, 40, "team-b"), frac("y", "a", 1, 20, "team-a")], (), "team-a", "10Gi", ("a", 1)),
    ("a fraction of the GPU goes to the GPU nobody holds",
     TWO, [frac("x", "a", 0, 1, "team-a")], (), "team-b", 0.5, ("a", 1)),
]


@pytest.mark.parametrize(("case", "inventories", "bindings", "sharing", "namespace", "asked", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_fraction_tenancy(case, inventories, bindings, sharing, namespace, asked, expected) -> None:
    request = slice_request(memory=asked) if isinstance(asked, str) else slice_request(fraction=asked)
    got = decide(inventories, request, namespace, bindings, sharing)
    if isinstance(expected, str):
        assert isinstance(got, Refusal) and got.code == expected, got
    else:
        assert isinstance(got, Binding) and (got.node, got.gpu) == expected, got
        assert got.mode == MODE_FRACTION and got.namespace == namespace


def test_the_refusal_names_the_rule_and_the_label_but_not_the_other_namespace_its_node_or_gpu() -> None:
    got = decide(ONE, slice_request(memory="10Gi"), "team-b", [frac("x", "a", 0, 10, "team-a")])
    assert isinstance(got, Refusal) and got.code == OTHER_NAMESPACE
    for part in ("every fraction GPU with room", "held by another namespace", "team-b", "MIG",
                 f"{SHARING_LABEL}={SHARING_VALUE}"):
        assert part in got.message, got.message
    for secret in ("team-a", "node a", "GPU 0"):
        assert secret not in got.message, got.message


def test_a_no_capacity_refusal_is_the_same_for_every_namespace() -> None:
    # The binder reuses a NoCapacity refusal within a pass for an equal request of any namespace.
    held = [frac("x", "a", 0, 40, "team-a"), frac("y", "a", 1, 40, "team-b")]
    refusals = {ns: decide(TWO, slice_request(memory="10Gi"), ns, held) for ns in ("team-a", "team-b", "team-c")}
    assert {r.code for r in refusals.values() if isinstance(r, Refusal)} == {NO_CAPACITY}
    assert len({r.message for r in refusals.values() if isinstance(r, Refusal)}) == 1


def test_mig_instances_are_not_concerned() -> None:
    mig = [NodeInventory("m", (h100_mig(),))]
    held = Binding("x", "m", 0, MODE_MIG, 10 * GIB, H100.profile("1g.10gb").id, "1g.10gb", 0, 1, namespace="team-a")
    got = decide(mig, slice_request(memory="9Gi"), "team-b", [held], labelled=("m",))
    assert isinstance(got, Binding) and got.mode == MODE_MIG and (got.node, got.gpu) == ("m", 0)


def test_a_fraction_the_agent_still_reports_holds_the_gpu_for_its_namespace() -> None:
    # No binding left (the slice is gone from the controller's books), but the agent still has it there.
    reported = [NodeInventory("a", (l40s(0, (FractionState("u1", "team-a/nb", 10 * GIB),)),))]
    got = decide(reported, slice_request(memory="10Gi"), "team-b")
    assert isinstance(got, Refusal) and got.code == OTHER_NAMESPACE and "team-a" not in got.message
    assert isinstance(decide(reported, slice_request(memory="10Gi"), "team-a"), Binding)


def test_reported_fractions_are_read_from_the_gpunode_status() -> None:
    status = {"gpus": [{"index": 0, "uuid": "GPU-0", "memoryMiB": L40S.memory_mib,
                        "fractions": [{"slice": "team-a/nb", "sliceUID": "u1", "bytes": GIB}]}]}
    inventory = inventory_from_status("a", status)
    assert inventory.gpus[0].fractions == (FractionState("u1", "team-a/nb", GIB),)


def test_the_gpu_is_free_for_any_namespace_once_its_last_fraction_is_released() -> None:
    planner = ClusterPlanner()
    planner.reset(ONE, [], [frac("x", "a", 0, 10, "team-a")])
    with pytest.raises(Refusal) as refused:
        planner.plan(slice_request(memory="10Gi"), namespace="team-b")
    assert refused.value.code == OTHER_NAMESPACE
    planner.drop_binding("x")
    assert planner.plan(slice_request(memory="10Gi"), namespace="team-b").gpu == 0


def test_the_label_given_and_taken_away() -> None:
    planner = ClusterPlanner()
    planner.reset(ONE, [], [frac("x", "a", 0, 10, "team-a")])
    planner.set_fraction_sharing("a", True)
    assert planner.plan(slice_request(memory="10Gi"), namespace="team-b").gpu == 0
    planner.set_fraction_sharing("a", False)
    with pytest.raises(Refusal):
        planner.plan(slice_request(memory="10Gi"), namespace="team-b")


def test_a_group_goes_only_where_its_namespace_may_use_the_gpus() -> None:
    planner = ClusterPlanner()
    planner.reset([NodeInventory("a", (l40s(0),)), NodeInventory("b", (l40s(0),))], [],
                  [frac("x", "a", 0, 1, "team-a")])
    members = [("g1", slice_request(memory="10Gi")), ("g2", slice_request(memory="10Gi"))]
    placed = planner.plan_group(members, namespace="team-b")
    assert {(b.node, b.namespace) for b in placed} == {("b", "team-b")}


@pytest.mark.parametrize(("labels", "expected"), [
    ({SHARING_LABEL: "cross-namespace"}, True), ({SHARING_LABEL: "true"}, False), ({}, False), (None, False)])
def test_the_label_value_is_exact(labels, expected) -> None:
    assert shares_across_namespaces(labels) is expected


# ---- property: no fraction GPU ever holds two namespaces unless labelled, and best fit among allowed ---

NAMESPACES = ["team-a", "team-b", "team-c"]
NODES = {"a": 2, "b": 1}
ASKS = [slice_request(memory=m) for m in ("4Gi", "10Gi", "20Gi", "45Gi")] + [slice_request(fraction=0.25)]

step = st.one_of(
    st.tuples(st.just("bind"), st.sampled_from(range(len(ASKS))), st.sampled_from(NAMESPACES)),
    st.tuples(st.just("bind"), st.sampled_from(range(len(ASKS))), st.sampled_from(NAMESPACES)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("share"), st.sampled_from(sorted(NODES)), st.booleans()),
)


def _need(request: SliceRequest) -> int:
    if request.memory_bytes is not None:
        return request.memory_bytes
    assert request.fraction is not None
    return int(request.fraction * L40S_BYTES) // MIB * MIB


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=40))
def test_no_fraction_gpu_ever_holds_two_namespaces_unless_labelled(steps) -> None:
    inventories = [NodeInventory(n, tuple(l40s(i) for i in range(count))) for n, count in NODES.items()]
    planner = ClusterPlanner()
    planner.reset(inventories, [], [])
    bindings: dict[str, Binding] = {}
    sharing: set[str] = set()
    serial = 0
    for s in steps:
        if s[0] == "share":
            (sharing.add if s[2] else sharing.discard)(s[1])
            planner.set_fraction_sharing(s[1], s[2])
            continue
        if s[0] == "release":
            if bindings:
                uid = sorted(bindings)[s[1] % len(bindings)]
                planner.drop_binding(uid)
                del bindings[uid]
            continue
        request, namespace = ASKS[s[1]], s[2]
        # The rule written out: every GPU this namespace may use, with its free bytes; best fit wins.
        gpus = [(n, i) for n, count in NODES.items() for i in range(count)]
        on = {g: [b for b in bindings.values() if (b.node, b.gpu) == g] for g in gpus}
        free = {g: L40S_BYTES - sum(b.granted_bytes for b in on[g]) for g in gpus}
        allowed = [g for g in gpus if g[0] in sharing or {b.namespace for b in on[g]} <= {namespace}]
        need = _need(request)
        # A GPU it holds already adds nothing to its charge, a sharing node's adds the grant, any other
        # the GPU's whole memory: least added charge first, then best fit.
        added = {g: need if g[0] in sharing else 0 if namespace in {b.namespace for b in on[g]} else L40S_BYTES
                 for g in gpus}
        fits = sorted((added[g], free[g] - need, g) for g in allowed if free[g] >= need)
        elsewhere = [g for g in gpus if g not in allowed and free[g] >= need]
        view = build_view(inventories, [], bindings.values(), sharing)
        try:
            reference: Binding | str = plan_binding(request, view, namespace=namespace)
        except Refusal as refusal:
            reference = refusal.code
        try:
            got: Binding | str = planner.plan(request, namespace=namespace)
        except Refusal as refusal:
            got = refusal.code
        assert got == reference
        if fits:
            assert isinstance(got, Binding) and (got.node, got.gpu) == fits[0][2], (got, fits)
        elif elsewhere:
            assert got == OTHER_NAMESPACE
        else:
            assert got in (NO_CAPACITY, TOO_LARGE)
        if isinstance(got, Binding):
            serial += 1
            bound = Binding(f"u{serial}", got.node, got.gpu, got.mode, got.granted_bytes, namespace=namespace)
            assert bound.granted_bytes >= MIN_SLICE_BYTES
            bindings[bound.uid] = bound
            planner.put_binding(bound)
        for g in gpus:
            held = {b.namespace for b in bindings.values() if (b.node, b.gpu) == g}
            # Two namespaces on one GPU only where the node was labelled when the second came.
            if len(held) > 1 and isinstance(got, Binding) and (got.node, got.gpu) == g:
                assert g[0] in sharing


# ---- the controller's feed: slices' namespaces and the Node labels reach the planner ----------------


def _gpunode_body(node: str) -> dict:
    return {"metadata": {"name": node}, "spec": {"nodeName": node},
            "status": {"gpus": [{"index": 0, "uuid": f"GPU-{node}", "memoryMiB": L40S.memory_mib}]}}


def _slice_body(uid: str, namespace: str, node: str) -> dict:
    return {"metadata": {"uid": uid, "namespace": namespace, "name": uid, "resourceVersion": "1",
                         "creationTimestamp": "2026-11-24T15:00:00Z"},
            "spec": {"memory": "10Gi"},
            "status": {"phase": "Ready", "node": node, "gpu": 0, "mode": "fraction", "grantedBytes": 10 * GIB}}


def test_the_controller_state_feeds_namespaces_and_the_sharing_label() -> None:
    from books import BodyLedger

    state = BodyLedger()
    state.replace_all([_slice_body("x", "team-a", "a")], [_gpunode_body("a")], [])
    assert state.slices["x"].binding is not None and state.slices["x"].binding.namespace == "team-a"
    with pytest.raises(Refusal) as refused:
        state.planner.plan(slice_request(memory="10Gi"), namespace="team-b")
    assert refused.value.code == OTHER_NAMESPACE
    assert state.set_node_labels("a", {SHARING_LABEL: SHARING_VALUE, "other": "x"})
    assert not state.set_node_labels("a", {SHARING_LABEL: SHARING_VALUE})  # nothing placement reads changed
    assert state.planner.plan(slice_request(memory="10Gi"), namespace="team-b").node == "a"
    assert state.set_node_labels("a", None)  # the Node is gone: its labels with it
    with pytest.raises(Refusal):
        state.planner.plan(slice_request(memory="10Gi"), namespace="team-b")
    # A full list reads the labels of the Nodes it is given.
    state.replace_all([_slice_body("x", "team-a", "a")], [_gpunode_body("a")],
                      [{"metadata": {"name": "a", "labels": {SHARING_LABEL: SHARING_VALUE}}}])
    assert state.planner.plan(slice_request(memory="10Gi"), namespace="team-b").node == "a"
