"""core/autoscale/scale_up.py and demand.py: how many new nodes of which pool the waiting slices need.

Every expected count is worked out by hand from the hardware (core/placement/profiles.py's CATALOG):
an H200 has 7 compute slots and 8 memory slots; a 4g.71gb takes 4 compute slots, so two never share a
GPU; a 2g.35gb takes 2 (at most 3 per GPU); a 1g.18gb takes 1 (at most 7 per GPU, 16384 MiB each); an
L40S has no MIG and 46068 MiB, shared as fractions."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import pytest

from mig_operator.core.autoscale.demand import plan_scale_up, scalable
from mig_operator.core.autoscale.nodes import pool_allows
from mig_operator.core.autoscale.pools import MIG_LABEL, NodePool, read_pools
from mig_operator.core.autoscale.scale_up import ScaleUp, Waiting
from mig_operator.core.books.ledger import Ledger, NodeLabels, NodeRecord, SliceRecord
from mig_operator.core.books.quota import QUOTA_EXCEEDED, QUOTA_NAME
from mig_operator.core.placement.cluster import NO_CAPACITY, GpuState, NodeInventory
from mig_operator.core.placement.node_blocks import NODE_LEAVING
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import SliceRequest, slice_request
from mig_operator.kube.controller.observe import pod_record

P4G = slice_request(profile="4g.71gb")
P2G = slice_request(profile="2g.35gb")
P1G = slice_request(profile="1g.18gb")


def pools(*entries: dict) -> tuple[NodePool, ...]:
    return read_pools(list(entries))


def h200(name: str = "h200", gpus: int = 1, max_nodes: int = 10, mig: bool = True, **more: Any) -> dict:
    labels = {"pool": name, **({MIG_LABEL: "mig"} if mig else {})}
    return {"name": name, "nodeLabels": labels, "gpuModel": "h200-141gb", "gpusPerNode": gpus, "cpu": "32",
            "memory": "256Gi", "maxNodes": max_nodes, **more}


def l40s(name: str = "l40s", gpus: int = 1, max_nodes: int = 10, **more: Any) -> dict:
    return {"name": name, "nodeLabels": {"pool": name}, "gpuModel": "l40s-48gb", "gpusPerNode": gpus,
            "cpu": "32", "memory": "256Gi", "maxNodes": max_nodes, **more}


def waiting(key: str, *requests: SliceRequest, spec: Mapping[str, Any] | None = None,
            namespace: str = "team-a") -> Waiting:
    """A waiting slice (one request) or a pod's group (several), its pod's spec deciding the pools."""
    members = [(f"{key}-{i}" if len(requests) > 1 else key, r) for i, r in enumerate(requests)]
    return Waiting(key, namespace, members, lambda pool: pool_allows(pool, spec))


def plan(pool_list: tuple[NodePool, ...], items: list[Waiting]) -> ScaleUp:
    up = ScaleUp(pool_list)
    for item in items:
        up.place(item)
    return up


# ---- counting nodes ---------------------------------------------------------------------------------


def test_two_4g_slices_need_two_one_gpu_h200_nodes() -> None:
    # 4 + 4 compute slots > 7: one GPU each, one GPU per node.
    up = plan(pools(h200()), [waiting("a", P4G), waiting("b", P4G)])
    assert up.nodes == {"h200": 2}
    assert up.pool_of("a") == up.pool_of("b") == "h200"


def test_two_4g_slices_share_a_two_gpu_node() -> None:
    up = plan(pools(h200(gpus=2)), [waiting("a", P4G), waiting("b", P4G)])
    assert up.nodes == {"h200": 1}


def test_seven_1g_slices_fit_one_gpu_and_the_eighth_opens_a_node() -> None:
    # 7 compute slots of 1 each; at most 7 1g.18gb per GPU.
    assert plan(pools(h200()), [waiting(f"s{i}", P1G) for i in range(7)]).nodes == {"h200": 1}
    assert plan(pools(h200()), [waiting(f"s{i}", P1G) for i in range(8)]).nodes == {"h200": 2}


def test_three_2g_fit_one_gpu_a_fourth_does_not() -> None:
    # 2g.35gb starts at memory slot 0, 2 or 4 (2 slots each): three per GPU.
    assert plan(pools(h200()), [waiting(f"s{i}", P2G) for i in range(3)]).nodes == {"h200": 1}
    assert plan(pools(h200()), [waiting(f"s{i}", P2G) for i in range(4)]).nodes == {"h200": 2}


def test_a_memory_request_takes_the_smallest_profile_that_holds_it() -> None:
    # 17Gi = 17408 MiB > 16384 MiB of a 1g.18gb, so each takes a 1g.35gb or 2g.35gb (2 memory slots):
    # at most 4 per 8-slot GPU, so 5 need a second node; 16Gi = 16384 MiB fits a 1g.18gb, 7 per GPU.
    big = slice_request(memory="17Gi")
    assert plan(pools(h200()), [waiting(f"s{i}", big) for i in range(4)]).nodes == {"h200": 1}
    assert plan(pools(h200()), [waiting(f"s{i}", big) for i in range(5)]).nodes == {"h200": 2}
    small = slice_request(memory="16Gi")
    assert plan(pools(h200()), [waiting(f"s{i}", small) for i in range(7)]).nodes == {"h200": 1}


def test_a_slice_too_large_for_every_pool_opens_no_node() -> None:
    # 150Gi = 153600 MiB: more than a whole H200 (143771 MiB) and a whole L40S (46068 MiB).
    up = plan(pools(h200(), l40s()), [waiting("huge", slice_request(memory="150Gi"))])
    assert up.nodes == {"h200": 0, "l40s": 0} and up.pool_of("huge") is None


def test_max_nodes_is_respected_and_the_next_pool_takes_the_rest() -> None:
    # Five 4g: one per node; the first pool stops at 3, the second takes the other 2.
    up = plan(pools(h200("a", max_nodes=3), h200("b")), [waiting(f"s{i}", P4G) for i in range(5)])
    assert up.nodes == {"a": 3, "b": 2}
    assert [up.pool_of(f"s{i}") for i in range(5)] == ["a", "a", "a", "b", "b"]


def test_max_nodes_leaves_the_rest_unplaced() -> None:
    up = plan(pools(h200(max_nodes=2)), [waiting(f"s{i}", P4G) for i in range(5)])
    assert up.nodes == {"h200": 2}
    assert [up.pool_of(f"s{i}") for i in range(5)] == ["h200", "h200", None, None, None]


def test_a_node_selector_matching_only_pool_b_goes_to_b() -> None:
    spec = {"nodeSelector": {"pool": "b"}}
    up = plan(pools(h200("a"), h200("b")), [waiting("x", P4G, spec=spec)])
    assert up.nodes == {"a": 0, "b": 1} and up.pool_of("x") == "b"


def test_required_node_affinity_picks_the_pool_too() -> None:
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["a"]}]}]}}}}
    up = plan(pools(h200("a"), h200("b")), [waiting("x", P4G, spec=spec)])
    assert up.nodes == {"a": 0, "b": 1}


def test_a_node_selector_no_pool_matches_opens_no_node() -> None:
    up = plan(pools(h200("a"), h200("b")), [waiting("x", P4G, spec={"nodeSelector": {"pool": "c"}})])
    assert up.nodes == {"a": 0, "b": 0} and up.pool_of("x") is None


def test_a_pool_tainted_against_the_pod_is_skipped() -> None:
    taint = {"key": "reserved", "value": "batch", "effect": "NoSchedule"}
    both = pools(h200("a", taints=[taint]), h200("b"))
    up = plan(both, [waiting("x", P4G, spec={})])
    assert up.nodes == {"a": 0, "b": 1}
    tolerates = {"tolerations": [{"key": "reserved", "operator": "Equal", "value": "batch", "effect": "NoSchedule"}]}
    up = plan(both, [waiting("y", P4G, spec=tolerates)])
    assert up.nodes == {"a": 1, "b": 0}
    # A PreferNoSchedule taint keeps no pod off.
    soft = pools(h200("a", taints=[{**taint, "effect": "PreferNoSchedule"}]), h200("b"))
    assert plan(soft, [waiting("z", P4G, spec={})]).nodes == {"a": 1, "b": 0}


def test_a_slice_made_directly_goes_to_any_pool() -> None:
    taint = {"key": "reserved", "effect": "NoSchedule"}
    up = plan(pools(h200("a", taints=[taint])), [waiting("x", P4G, spec=None)])
    assert up.nodes == {"a": 1}


def test_a_group_lands_on_one_node() -> None:
    # Two 4g of one pod need two GPUs of one node: a 2-GPU pool gives one node for them.
    up = plan(pools(h200(gpus=2)), [waiting("pod", P4G, P4G)])
    assert up.nodes == {"h200": 1} and up.pool_of("pod") == "h200"
    # On 1-GPU nodes no one node holds both: none is opened (apart, they would need two).
    up = plan(pools(h200(gpus=1)), [waiting("pod", P4G, P4G)])
    assert up.nodes == {"h200": 0} and up.pool_of("pod") is None
    # The first pool cannot hold the pair, the second can.
    up = plan(pools(h200("one", gpus=1), h200("two", gpus=2)), [waiting("pod", P4G, P4G)])
    assert up.nodes == {"one": 0, "two": 1} and up.pool_of("pod") == "two"


def test_a_group_fills_the_node_opened_before_it_where_it_fits() -> None:
    # A 4g opens a 2-GPU node; the group of a 2g and a 1g (3 slots) fits beside it on GPU 0's other 3
    # slots or on GPU 1; a second group of two 4g fits neither (one GPU free at most): a second node.
    up = plan(pools(h200(gpus=2)), [waiting("a", P4G), waiting("g1", P2G, P1G), waiting("g2", P4G, P4G)])
    assert up.nodes == {"h200": 2}


def test_fractions_on_a_pool_without_mig() -> None:
    # Half an L40S each: two per GPU, so five halves need three 1-GPU nodes.
    half = slice_request(fraction=0.5)
    up = plan(pools(l40s()), [waiting(f"s{i}", half) for i in range(5)])
    assert up.nodes == {"l40s": 3}
    # 20Gi = 20480 MiB: two fit 46068 MiB (40960), a third does not.
    mem = slice_request(memory="20Gi")
    assert plan(pools(l40s()), [waiting(f"s{i}", mem) for i in range(3)]).nodes == {"l40s": 2}
    # A MIG profile is never served by a GPU without MIG.
    assert plan(pools(l40s()), [waiting("p", P1G)]).nodes == {"l40s": 0}


def test_a_mig_labelled_pool_of_a_gpu_without_mig_serves_fractions() -> None:
    (pool,) = pools(l40s(nodeLabels={"pool": "l40s", MIG_LABEL: "mig"}))
    assert not pool.mig
    half = slice_request(fraction=0.5)
    up = plan((pool,), [waiting(f"s{i}", half) for i in range(4)] + [waiting("p", P1G)])
    assert up.nodes == {"l40s": 2} and up.pool_of("p") is None


def test_a_fraction_on_a_mig_pool_is_its_share_of_memory_slots() -> None:
    # Half of 8 memory slots is 4, a 3g.71gb (placements at slot 0 and 4): two per GPU, so three halves
    # need two 1-GPU nodes of whichever pool comes first; on MIG mode off, half the memory, two per GPU.
    half = slice_request(fraction=0.5)
    items = [waiting(f"s{i}", half) for i in range(3)]
    assert plan(pools(h200("mig"), h200("whole", mig=False)), items).nodes == {"mig": 2, "whole": 0}
    assert plan(pools(h200("whole", mig=False), h200("mig")), items).nodes == {"whole": 2, "mig": 0}
    # A MIG profile goes only to the MIG pool, even when it comes second.
    assert plan(pools(h200("whole", mig=False), h200("mig")), [waiting("p", P1G)]).nodes == {"whole": 0, "mig": 1}


def test_the_same_waiting_set_gives_the_same_answer() -> None:
    requests = [P4G, P2G, P1G, slice_request(memory="30Gi"), slice_request(fraction=0.25), P2G, P4G, P1G]
    items = [waiting(f"s{i}", r, namespace=f"ns{i % 3}") for i, r in enumerate(requests * 6)]
    both = pools(h200("a", gpus=2, max_nodes=4), h200("b", gpus=1, mig=False), l40s())
    first, second = plan(both, items), plan(both, items)
    assert first.nodes == second.nodes
    assert [first.pool_of(w.key) for w in items] == [second.pool_of(w.key) for w in items]
    assert sum(first.nodes.values()) > 0


def test_placing_the_same_key_twice_counts_it_once() -> None:
    up = ScaleUp(pools(h200()))
    assert up.place(waiting("a", P4G)) == "h200" and up.place(waiting("a", P4G)) == "h200"
    assert up.nodes == {"h200": 1}


def test_a_flood_of_waiting_slices_finishes_capped_by_max_nodes() -> None:
    shapes = itertools.cycle([P1G, P2G, P4G, slice_request(memory="30Gi"), slice_request(fraction=0.5)])
    items = [waiting(f"s{i}", next(shapes), namespace=f"ns{i % 50}") for i in range(5000)]
    caps = {"a": 40, "b": 30, "c": 20}
    flood = pools(h200("a", gpus=8, max_nodes=caps["a"]), h200("b", gpus=4, max_nodes=caps["b"], mig=False),
                  l40s("c", gpus=2, max_nodes=caps["c"]))
    up = plan(flood, items)
    assert all(up.nodes[name] <= cap for name, cap in caps.items())
    placed = sum(1 for w in items if up.pool_of(w.key) is not None)
    # 5000 slices of at least a 1g each cannot fit 40 x 8 + 30 x 4 + 20 x 2 = 480 GPUs: every pool is full.
    assert up.nodes == caps and 0 < placed < 5000


# ---- through the controller's books ---------------------------------------------------------------


def record(uid: str, namespace: str, request: SliceRequest, *, second: int, pinned: str | None = None,
           pod: str | None = None, group: str | None = None, size: int = 1) -> SliceRecord:
    return SliceRecord(uid=uid, namespace=namespace, name=uid, created=f"2026-11-26T00:00:{second:02d}Z", version=1,
                       body={"metadata": {"uid": uid}}, request=request, invalid="", pinned=pinned, phase=None,
                       binding=None, deleting=False, marked=False, group=group, group_size=size,
                       pod_owner=None if pod is None else f"uid-{pod}")


def h200_node(name: str) -> NodeInventory:
    model = get_model("h200-141gb")
    return NodeInventory(name, (GpuState(0, f"GPU-{name}", model.product, model.name, model.memory_mib, True, True,
                                         model.profiles),))


def full_cluster() -> Ledger:
    """One 1-GPU H200 node, MIG, already holding a 7g: every new slice is refused NoCapacity."""
    ledger = Ledger()
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_inventory(h200_node("n0"))
    ledger.put_slice(record("full", "other", slice_request(profile="7g.141gb"), second=0))
    assert ledger.decide("full").kind == "bind"
    ledger.commit("full")
    return ledger


def refuse_all(ledger: Ledger) -> dict[str, str]:
    for info in ledger.pending():
        ledger.decide(info.uid)
    return {uid: code for uid, (_, code) in ledger.waiting.items()}


def test_the_waiting_line_asks_for_nodes_oldest_first() -> None:
    ledger = full_cluster()
    for i in range(3):
        ledger.put_slice(record(f"s{i}", "team-a", P4G, second=10 + i))
    assert refuse_all(ledger) == {"s0": NO_CAPACITY, "s1": NO_CAPACITY, "s2": NO_CAPACITY}
    up = plan_scale_up(ledger, pools(h200("a", max_nodes=2), h200("b")))
    # Oldest first: s0, s1 fill pool a's two nodes, s2 goes to b.
    assert up.nodes == {"a": 2, "b": 1}
    assert [up.pool_of(f"s{i}") for i in range(3)] == ["a", "a", "b"]


def test_quota_exceeded_and_pinned_slices_ask_for_no_node() -> None:
    ledger = full_cluster()
    ledger.put_quota({"metadata": {"namespace": "small", "name": QUOTA_NAME}, "spec": {"memory": "10Gi"}})
    ledger.put_slice(record("over", "small", slice_request(memory="20Gi"), second=10))
    ledger.put_slice(record("pinned", "team-a", P4G, second=11, pinned="n0"))
    ledger.put_slice(record("nowhere", "team-a", P4G, second=12, pinned="n9"))
    ledger.put_slice(record("free", "team-a", P1G, second=13))
    codes = refuse_all(ledger)
    assert codes["over"] == QUOTA_EXCEEDED and codes["pinned"] == NO_CAPACITY and codes["free"] == NO_CAPACITY
    assert not scalable(codes["over"]) and not scalable(codes["nowhere"])
    up = plan_scale_up(ledger, pools(h200()))
    # Only "free" (a 1g) needs a node.
    assert up.nodes == {"h200": 1}
    assert {u: up.pool_of(u) for u in ("over", "pinned", "nowhere", "free")} == {
        "over": None, "pinned": None, "nowhere": None, "free": "h200"}


def test_a_slice_its_quota_cannot_admit_asks_for_no_node_even_with_no_gpu_at_all() -> None:
    # No GPU node yet (scale from zero): the refusal is NoGpu, not QuotaExceeded, but 50Gi is past a
    # 40Gi quota whatever node comes, so no node is asked for it. 8Gi gets a 1g.18gb (16 GiB), within.
    ledger = Ledger()
    ledger.put_quota({"metadata": {"namespace": "small", "name": QUOTA_NAME}, "spec": {"memory": "40Gi"}})
    ledger.put_slice(record("over", "small", slice_request(memory="50Gi"), second=10))
    ledger.put_slice(record("within", "small", slice_request(memory="8Gi"), second=11))
    refuse_all(ledger)
    up = plan_scale_up(ledger, pools(h200()))
    assert up.pool_of("over") is None and up.pool_of("within") == "h200" and up.nodes == {"h200": 1}


def test_a_slice_whose_grant_its_quota_cannot_admit_asks_for_no_node() -> None:
    # 8Gi is within a 10Gi quota, but an H200's smallest profile that holds it is 1g.18gb: 16384 MiB
    # granted, past 10 GiB. The binding would be refused QuotaExceeded on the new node, so none is asked.
    ledger = Ledger()
    ledger.put_quota({"metadata": {"namespace": "small", "name": QUOTA_NAME}, "spec": {"memory": "10Gi"}})
    ledger.put_slice(record("grant", "small", slice_request(memory="8Gi"), second=10))
    refuse_all(ledger)
    up = plan_scale_up(ledger, pools(h200()))
    assert up.pool_of("grant") is None and up.nodes == {"h200": 0}


def test_a_pods_node_selector_in_the_books_picks_the_pool() -> None:
    ledger = full_cluster()
    body = {"metadata": {"name": "p", "namespace": "team-a", "uid": "uid-p", "resourceVersion": "1",
                         "labels": {"cdmo.io/gpu-slice": "p"}, "annotations": {"cdmo.io/gpu-memory": "4Gi"}},
            "spec": {"nodeSelector": {"pool": "b"}, "containers": [{"name": "c"}]}, "status": {"phase": "Pending"}}
    ledger.put_pod("team-a", "p", pod_record(body))
    ledger.put_slice(record("x", "team-a", P4G, second=10, pod="p", group="p", size=2))
    ledger.put_slice(record("y", "team-a", P4G, second=10, pod="p", group="p", size=2))
    refuse_all(ledger)
    up = plan_scale_up(ledger, pools(h200("a", gpus=2), h200("b", gpus=2)))
    # The group (two 4g) goes whole onto one 2-GPU node of pool b.
    assert up.nodes == {"a": 0, "b": 1}
    assert up.pool_of("x") == "b"


def test_a_pods_slice_whose_pod_is_not_in_the_books_asks_for_no_node() -> None:
    ledger = full_cluster()
    ledger.put_slice(record("x", "team-a", P4G, second=10, pod="gone"))
    refuse_all(ledger)
    assert plan_scale_up(ledger, pools(h200())).nodes == {"h200": 0}


# ---- a node being removed ---------------------------------------------------------------------------


@pytest.mark.parametrize("taint", ["karpenter.sh/disrupted", "ToBeDeletedByClusterAutoscaler"])
def test_a_slice_offered_only_a_leaving_node_is_refused_then_placed_once_it_stays(taint: str) -> None:
    ledger = Ledger()
    ledger.put_inventory(h200_node("n0"))
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True, leaving=taint)))
    ledger.put_slice(record("s", "team-a", P1G, second=1))
    decision = ledger.decide("s")
    assert decision.kind == "refuse" and decision.refusal is not None
    assert decision.refusal.code == NODE_LEAVING and taint in decision.refusal.message
    assert scalable(NODE_LEAVING)  # a new node can end it
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    decision = ledger.decide("s")
    assert decision.kind == "bind" and [(b.node, b.profile) for b in decision.bindings] == [("n0", "1g.18gb")]


def test_a_leaving_node_survives_a_full_list() -> None:
    ledger = Ledger()
    ledger.replace_all([record("s", "team-a", P1G, second=1)], [h200_node("n0")],
                       {"n0": NodeRecord(flags=NodeLabels(mig=True, leaving="karpenter.sh/disrupted"))})
    decision = ledger.decide("s")
    assert decision.kind == "refuse" and decision.refusal is not None and decision.refusal.code == NODE_LEAVING
