"""A slice a new node would take names its pool in a field: ``Autoscaling.shown`` gives the pool beside
the refusal, and the status bodies write ``status.pool`` while it waits for a node and take it off (a
merge patch's null) when it waits for anything else or is bound."""

from __future__ import annotations

from typing import Any

from test_scale_up import P4G, full_cluster, h200, pools, record, refuse_all

from mig_operator.core.autoscale.pools import AutoscalingOptions
from mig_operator.core.books.quota import QUOTA_EXCEEDED, QUOTA_NAME
from mig_operator.core.placement.cluster import MODE_MIG, Binding, Refusal
from mig_operator.core.requests.request import slice_request
from mig_operator.kube.common import status
from mig_operator.kube.controller.capacity import Autoscaling


class Queue:
    """Records the keys asked for; runs nothing."""

    def __init__(self) -> None:
        self.keys: list[Any] = []

    def add(self, key: Any, work: Any, after_s: float = 0.0) -> None:
        self.keys.append(key)


def autoscaling(ledger: Any) -> Autoscaling:
    options = AutoscalingOptions(pools(h200("gpu-h200")), "mig-operator", backend="capacitybuffer")
    return Autoscaling(client=None, ledger=ledger, queue=Queue(), options=options,  # type: ignore[arg-type]
                       replan=lambda: None)


def test_a_slice_a_new_node_would_take_shows_waiting_for_node_and_its_pool() -> None:
    ledger = full_cluster()
    ledger.put_slice(record("s0", "team-a", P4G, second=10))
    code = refuse_all(ledger)["s0"]
    shown, pool = autoscaling(ledger).shown(ledger.slices["s0"], Refusal(code, "no GPU has room"))
    assert (shown.code, pool) == ("WaitingForNode", "gpu-h200")
    assert "pool gpu-h200" in shown.message


def test_a_slice_no_node_can_help_keeps_its_refusal_and_names_no_pool() -> None:
    ledger = full_cluster()
    ledger.put_quota({"metadata": {"namespace": "small", "name": QUOTA_NAME}, "spec": {"memory": "10Gi"}})
    ledger.put_slice(record("over", "small", slice_request(memory="20Gi"), second=10))
    refusal = Refusal(QUOTA_EXCEEDED, "past its quota")
    assert autoscaling(ledger).shown(ledger.slices["over"], refusal) == (refusal, None)


def test_pending_writes_the_pool_and_takes_it_off_otherwise() -> None:
    request = slice_request(profile="4g.71gb")
    assert status.pending(None, request, "WaitingForNode", "m", pool="gpu-h200")["pool"] == "gpu-h200"
    # None in a merge patch removes the field: waiting for something else, or bound, names no pool.
    assert status.pending(None, request, "NoCapacity", "m")["pool"] is None
    binding = Binding("u", "n", 0, MODE_MIG, 71 * 2**30, 5, "4g.71gb", 0, 4)
    assert status.bound({"pool": "gpu-h200"}, request, binding, "GPU-0", [], "bound")["pool"] is None
