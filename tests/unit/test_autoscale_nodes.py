"""core/autoscale/nodes.py and Ledger.nodes_to_keep: which nodes are leaving, the annotations that keep a
node from a node autoscaler (only the operator's own ever removed), where a pod may go among the pools,
and which nodes a slice still needs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mig_operator.core.autoscale.demand import coming_nodes, placeholders_wanted
from mig_operator.core.autoscale.nodes import KEEP_ANNOTATIONS, KEPT_MARK, keep_patch, leaving, of_pool, pool_allows
from mig_operator.core.autoscale.pools import MIG_LABEL, read_pools
from mig_operator.core.books.ledger import Ledger, NodeLabels, NodeRecord, SliceRecord
from mig_operator.core.placement.cluster import GpuState, NodeInventory
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request
from mig_operator.kube.controller.observe import node_record, pod_record

DND = "karpenter.sh/do-not-disrupt"
CA = "cluster-autoscaler.kubernetes.io/scale-down-disabled"


def apply(annotations: dict[str, str], patch: dict[str, str | None] | None) -> dict[str, str]:
    """A JSON merge patch of metadata.annotations as the API server applies it."""
    out = dict(annotations)
    for key, value in (patch or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


# ---- leaving ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("taints", "expected"), [
    ([], None),
    ([{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}], "karpenter.sh/disrupted"),
    ([{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}],
     "ToBeDeletedByClusterAutoscaler"),
    ([{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}], None),
    ([{"key": "karpenter.sh/disrupted-not"}], None),
    ([{"value": "karpenter.sh/disrupted"}], None),  # no key
    ([{}], None),
    (["karpenter.sh/disrupted", None, 7, ["karpenter.sh/disrupted"]], None),  # not maps
    ([None, "x", {"key": ["karpenter.sh/disrupted"]}, {"key": "ToBeDeletedByClusterAutoscaler"}],
     "ToBeDeletedByClusterAutoscaler"),  # junk, an unhashable key, then a real taint without an effect
])
def test_leaving_reads_odd_taints_without_failing(taints: list, expected: str | None) -> None:
    assert leaving(taints) == expected


def test_a_node_bodys_removal_taint_reaches_placement() -> None:
    body = {"metadata": {"name": "n0", "labels": {MIG_LABEL: "mig"}},
            "spec": {"taints": ["junk", {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}}
    assert node_record(body).flags.leaving == "karpenter.sh/disrupted"
    assert node_record({"metadata": {"name": "n0"}, "spec": {"taints": None}}).flags.leaving is None


# ---- keep_patch -------------------------------------------------------------------------------------


def test_keeping_adds_both_annotations_and_a_mark_naming_them() -> None:
    patch = keep_patch(True, {"team": "ml"})
    assert patch == {DND: "true", CA: "true", KEPT_MARK: f"{DND},{CA}"}
    kept = apply({"team": "ml"}, patch)
    assert keep_patch(True, kept) is None  # already kept: nothing to write
    assert apply(kept, keep_patch(False, kept)) == {"team": "ml"}
    assert keep_patch(False, {"team": "ml"}) is None  # never kept: nothing to write


def test_an_admins_own_do_not_disrupt_is_never_removed() -> None:
    admin = {DND: "true"}
    patch = keep_patch(True, admin)
    assert patch == {CA: "true", KEPT_MARK: CA}
    kept = apply(admin, patch)
    assert apply(kept, keep_patch(False, kept)) == {DND: "true"}


def test_an_admin_who_set_both_keeps_both() -> None:
    admin = {DND: "true", CA: "true"}
    kept = apply(admin, keep_patch(True, admin))
    assert kept[KEPT_MARK] == "-"
    assert apply(kept, keep_patch(False, kept)) == admin


@pytest.mark.parametrize("mark", [
    "kubernetes.io/hostname,node.kubernetes.io/exclude-from-external-load-balancers",
    ("x" * 1000 + ",") * 12 + DND,  # about 12 KiB of junk, then one of ours
    f"{DND},{DND},{DND},metadata.name,,,",
    "\u202e\x00,;--",
])
def test_a_mark_with_junk_removes_only_known_annotations(mark: str) -> None:
    before = {KEPT_MARK: mark, DND: "true", CA: "true", "kubernetes.io/hostname": "n0",
              "node.kubernetes.io/exclude-from-external-load-balancers": "true", "metadata.name": "x"}
    after = apply(before, keep_patch(False, before))
    removed = set(before) - set(after)
    # Of the keys the mark names, only those of KEEP_ANNOTATIONS go, and the mark itself.
    named = set(mark.split(","))
    assert removed == {KEPT_MARK} | (named & {DND, CA})
    assert after["kubernetes.io/hostname"] == "n0"


def test_an_admins_value_is_left_alone_whatever_it_says() -> None:
    # An admin's "false" is the admin's word on that node: the operator adds only the other annotation.
    patch = keep_patch(True, {DND: "false"})
    assert patch == {CA: "true", KEPT_MARK: CA}
    assert set(KEEP_ANNOTATIONS) == {DND, CA}


# ---- pools and nodes ----------------------------------------------------------------------------------


POOLS = read_pools([
    {"name": "a", "nodeLabels": {"pool": "a", MIG_LABEL: "mig"}, "gpuModel": "h200-141gb", "cpu": "8",
     "memory": "64Gi", "taints": [{"key": "gpu", "value": "h200", "effect": "NoSchedule"}]},
    {"name": "b", "nodeLabels": {"pool": "b"}, "gpuModel": "l40s-48gb", "cpu": "8", "memory": "64Gi"},
])


@pytest.mark.parametrize(("spec", "allowed"), [
    (None, {"a", "b"}),  # a GpuSlice made directly
    ({}, {"b"}),  # a tolerates nothing: pool a's taint keeps it off
    ({"tolerations": [{"key": "gpu", "operator": "Exists"}]}, {"a", "b"}),
    ({"tolerations": [{"key": "gpu", "operator": "Equal", "value": "l40s", "effect": "NoSchedule"}]}, {"b"}),
    ({"tolerations": [{"operator": "Exists"}], "nodeSelector": {"pool": "a"}}, {"a"}),
    ({"tolerations": [{"operator": "Exists"}], "nodeSelector": {"pool": "c"}}, set()),
    ({"tolerations": [{"operator": "Exists"}], "nodeSelector": {MIG_LABEL: "mig", "pool": "b"}}, set()),
    ({"tolerations": [{"operator": "Exists"}], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": MIG_LABEL, "operator": "DoesNotExist"}]}]}}}}, {"b"}),
])
def test_pool_allows_reads_selector_affinity_and_tolerations(spec: dict | None, allowed: set[str]) -> None:
    assert {p.name for p in POOLS if pool_allows(p, spec)} == allowed


def test_a_node_is_of_a_pool_when_it_carries_every_pool_label() -> None:
    a, b = POOLS
    assert of_pool(a, {"pool": "a", MIG_LABEL: "mig", "zone": "z1"})
    assert not of_pool(a, {"pool": "a"})  # the MIG label is missing
    assert of_pool(b, {"pool": "b"}) and not of_pool(b, {"pool": "B"}) and not of_pool(b, {})


def test_coming_nodes_are_registered_without_a_gpunode_yet() -> None:
    a, b = POOLS
    nodes = {"a-1": {"pool": "a", MIG_LABEL: "mig"}, "a-2": {"pool": "a", MIG_LABEL: "mig"},
             "b-1": {"pool": "b"}, "cpu-1": {}}
    inventories = {"a-1": NodeInventory("a-1", ())}
    # a-2 and b-1 have no GpuNode yet; cpu-1 is of no pool.
    assert coming_nodes(a, nodes, inventories) == 1 and coming_nodes(b, nodes, inventories) == 1
    assert [placeholders_wanted(n, c) for n, c in [(3, 1), (1, 3), (0, 0), (2, 2)]] == [2, 0, 0, 0]


# ---- Ledger.nodes_to_keep ----------------------------------------------------------------------------


def h200_node(name: str) -> NodeInventory:
    model = get_model("h200-141gb")
    return NodeInventory(name, (GpuState(0, f"GPU-{name}", model.product, model.name, model.memory_mib, True, True,
                                         model.profiles),))


def slice_of(uid: str, pod: str | None) -> SliceRecord:
    return SliceRecord(uid=uid, namespace="team-a", name=uid, created="2026-11-26T00:00:01Z", version=1,
                       body={"metadata": {"uid": uid}}, request=slice_request(profile="1g.18gb"), invalid="",
                       pinned=None, phase=None, binding=None, deleting=False, marked=False,
                       group=pod, group_size=1, pod_owner=None if pod is None else f"uid-{pod}")


def gated_pod(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "resourceVersion": "1",
                         "labels": {"cdmo.io/gpu-slice": name}, "annotations": {"cdmo.io/mig-profile": "1g.18gb"}},
            "spec": {"schedulingGates": [{"name": "cdmo.io/gpu-slice"}], "containers": [{"name": "c"}]},
            "status": {"phase": "Pending"}}


def bound_ledger(pod: str | None, node: str = "n0") -> Ledger:
    """One H200 node with slice "s" bound on it (its binding written), for pod ``pod`` or made directly."""
    ledger = Ledger()
    ledger.put_node(node, NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(h200_node(node))
    if pod is not None:
        ledger.put_pod("team-a", pod, pod_record(gated_pod(pod)))
    ledger.put_slice(slice_of("s", pod))
    decision = ledger.decide("s")
    assert decision.kind == "bind"
    return ledger


def test_a_slice_whose_binding_is_being_written_keeps_its_node() -> None:
    assert bound_ledger("p").nodes_to_keep() == {"n0"}


def test_a_bound_slice_with_a_gated_pod_keeps_its_node_until_the_pod_leaves_the_books() -> None:
    ledger = bound_ledger("p")
    binding = ledger.reserved("s")
    assert binding is not None
    ledger.put_slice(replace(ledger.slices["s"], version=2, phase="Bound", binding=binding))
    ledger.commit("s")
    assert ledger.nodes_to_keep() == {"n0"}
    ledger.remove_pod("team-a", "p")  # the pod runs: the scheduler has it, nothing waits for the node
    assert ledger.nodes_to_keep() == set()


def test_a_slice_made_directly_keeps_its_node_until_it_is_deleted() -> None:
    ledger = bound_ledger(None)
    binding = ledger.reserved("s")
    ledger.put_slice(replace(ledger.slices["s"], version=2, phase="Ready", binding=binding))
    ledger.commit("s")
    assert ledger.nodes_to_keep() == {"n0"}
    ledger.put_slice(replace(ledger.slices["s"], version=3, deleting=True))
    assert ledger.nodes_to_keep() == set()


def test_a_waiting_slice_keeps_no_node() -> None:
    ledger = Ledger()
    ledger.put_slice(slice_of("s", None))
    assert ledger.decide("s").kind == "refuse" and ledger.nodes_to_keep() == set()
