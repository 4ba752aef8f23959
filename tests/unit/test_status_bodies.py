"""kube.common.status: GpuSlice status bodies, one per phase, as merge patches the CRD accepts."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from cluster_reference import build_view, plan_binding

from mig_operator.core.node.lifecycle import BOUND, CREATING, FAILED, PENDING, READY
from mig_operator.core.placement.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    Binding,
    NodeInventory,
    Refusal,
    binding_from_status,
)
from mig_operator.core.requests.request import SliceRequest
from mig_operator.kube.common import status

OLD = "2001-02-03T04:05:06.789Z"
MIG = Binding("", "node-a", 2, MODE_MIG, 16384 * 2**20, 19, "1g.18gb", 5, 1)
FRACTION = Binding("", "node-f", 0, MODE_FRACTION, 4 * 2**30)
REQUEST = SliceRequest(memory_bytes=4 * 2**30)
MESSAGE_LIMIT = 4096  # crds/gpuslice.yaml: status.message maxLength
CONDITION_MESSAGE_LIMIT = 32768  # metav1.Condition message maxLength
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def cond(body: dict, kind: str) -> dict:
    (c,) = [c for c in body["conditions"] if c["type"] == kind]
    return c


def previous(bound: str, ready: str, **extra) -> dict:
    return {
        "conditions": [
            {"type": "Bound", "status": bound, "reason": "x", "message": "x", "lastTransitionTime": OLD},
            {"type": "Ready", "status": ready, "reason": "x", "message": "x", "lastTransitionTime": OLD},
        ],
        **extra,
    }


def is_recent(stamp: str) -> bool:
    when = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    return abs(datetime.now(UTC) - when) < timedelta(minutes=5)


def test_now_is_rfc3339_utc_with_milliseconds() -> None:
    stamp = status.now()
    assert STAMP.match(stamp) and is_recent(stamp)


# --- conditions ---------------------------------------------------------------------------------------


def test_condition_keeps_its_transition_time_when_its_status_does_not_change() -> None:
    body = status.pending(previous("False", "False"), REQUEST, "NoCapacity", "waits")
    assert cond(body, "Bound")["lastTransitionTime"] == OLD
    assert cond(body, "Ready")["lastTransitionTime"] == OLD
    assert cond(body, "Bound")["message"] == "waits"  # the rest of the condition is new


def test_condition_gets_a_new_transition_time_when_its_status_changes() -> None:
    body = status.bound(previous("False", "False"), REQUEST, MIG, "GPU-2", [], "bound")
    bound, ready = cond(body, "Bound"), cond(body, "Ready")
    assert bound["status"] == "True" and bound["lastTransitionTime"] != OLD
    assert STAMP.match(bound["lastTransitionTime"]) and is_recent(bound["lastTransitionTime"])
    assert ready["status"] == "False" and ready["lastTransitionTime"] == OLD


def test_ready_flips_ready_and_keeps_bound() -> None:
    body = status.ready(previous("True", "False"), "MIG-1", 1, False, "made", gi_id=1, ci_id=0)
    assert cond(body, "Bound")["lastTransitionTime"] == OLD
    assert cond(body, "Ready")["status"] == "True" and cond(body, "Ready")["lastTransitionTime"] != OLD
    assert cond(body, "Ready")["reason"] == "Created"
    assert status.ready(None, "MIG-1", 1, True, "reused")["conditions"][1]["reason"] == "Reused"


def test_creating_keeps_both_transition_times_from_bound() -> None:
    body = status.creating(previous("True", "False"), "creating")
    assert body["phase"] == CREATING
    assert [c["lastTransitionTime"] for c in body["conditions"]] == [OLD, OLD]


def test_previous_condition_without_a_time_gets_one() -> None:
    prev = {"conditions": [{"type": "Bound", "status": "False"}]}
    body = status.pending(prev, REQUEST, "NoCapacity", "waits")
    assert STAMP.match(cond(body, "Bound")["lastTransitionTime"])


@pytest.mark.parametrize("prev", [None, {}, {"conditions": None}, {"conditions": []}])
def test_no_previous_conditions_means_new_times(prev) -> None:
    body = status.bound(prev, REQUEST, MIG, "GPU-2", [], "bound")
    assert all(STAMP.match(c["lastTransitionTime"]) for c in body["conditions"])
    assert [c["type"] for c in body["conditions"]] == ["Bound", "Ready"]


def test_failed_bound_condition_follows_whether_the_slice_had_a_node() -> None:
    assert cond(status.failed({"node": "a"}, "X", "m"), "Bound")["status"] == "True"
    assert cond(status.failed({}, "X", "m"), "Bound")["status"] == "False"
    assert cond(status.failed(None, "X", "m"), "Bound")["status"] == "False"
    assert status.failed(None, "X", "m")["phase"] == FAILED


# --- bound -------------------------------------------------------------------------------------------------


def test_bound_mig_carries_profile_and_placement() -> None:
    reclaim = [{"gpu": 2, "profile": "1g.18gb", "start": 5}]
    body = status.bound(None, REQUEST, MIG, "GPU-2", reclaim, "bound")
    assert body["phase"] == BOUND
    assert (body["mode"], body["node"], body["gpu"], body["gpuUUID"]) == (MODE_MIG, "node-a", 2, "GPU-2")
    assert (body["profile"], body["profileId"], body["placement"]) == ("1g.18gb", 19, {"start": 5, "size": 1})
    assert body["grantedBytes"] == 16384 * 2**20
    assert body["reclaim"] == reclaim
    assert set(body["phaseTimes"]) == {BOUND}


def test_bound_fraction_carries_no_profile_or_placement() -> None:
    body = status.bound(None, REQUEST, FRACTION, "GPU-0", [], "bound")
    assert body["mode"] == MODE_FRACTION and body["grantedBytes"] == 4 * 2**30
    assert not {"profile", "profileId", "placement", "reclaim"} & set(body)


@pytest.mark.parametrize("binding", [MIG, FRACTION])
@pytest.mark.parametrize("phase_body", ["bound", "creating", "ready"])
def test_bound_status_reads_back_as_the_same_binding(binding: Binding, phase_body: str) -> None:
    body = status.bound(None, REQUEST, binding, "GPU-x", [], "bound")
    if phase_body == "creating":
        body = {**body, **status.creating(body, "creating")}
    elif phase_body == "ready":
        body = {**body, **status.ready(body, "MIG-1", binding.granted_bytes, False, "ready")}
    uid = "uid-1"
    assert binding_from_status(uid, body) == Binding(uid, binding.node, binding.gpu, binding.mode,
                                                     binding.granted_bytes, binding.profile_id, binding.profile,
                                                     binding.start, binding.size)


def test_pending_and_failed_bodies_hold_no_binding() -> None:
    assert binding_from_status("u", status.pending(None, REQUEST, "NoCapacity", "m")) is None
    bound = status.bound(None, REQUEST, MIG, "GPU-2", [], "bound")
    assert binding_from_status("u", {**bound, **status.failed(bound, "X", "m")}) is None


# --- phase times -------------------------------------------------------------------------------------------


def test_pending_keeps_the_time_it_first_became_pending() -> None:
    body = status.pending({"phaseTimes": {PENDING: OLD}}, REQUEST, "NoCapacity", "m")
    assert body["phaseTimes"] == {PENDING: OLD}
    fresh = status.pending(None, REQUEST, "NoCapacity", "m")
    assert STAMP.match(fresh["phaseTimes"][PENDING])


def test_each_phase_adds_only_its_own_time() -> None:
    assert set(status.creating(None, "m")["phaseTimes"]) == {CREATING}
    assert set(status.ready(None, "MIG-1", 1, False, "m")["phaseTimes"]) == {READY}
    assert set(status.failed(None, "X", "m")["phaseTimes"]) == {FAILED}


def test_ready_mig_carries_gi_and_ci_and_fraction_does_not() -> None:
    mig = status.ready(None, "MIG-1", 5, False, "m", gi_id=3, ci_id=0)
    assert (mig["deviceUUID"], mig["giId"], mig["ciId"], mig["grantedBytes"]) == ("MIG-1", 3, 0, 5)
    frac = status.ready(None, "GPU-1", 5, False, "m")
    assert "giId" not in frac and "ciId" not in frac


# --- message caps --------------------------------------------------------------------------------------------


def test_failed_message_is_capped_to_the_crd_limit() -> None:
    body = status.failed(None, "X", "m" * (MESSAGE_LIMIT + 1))
    assert len(body["message"]) == MESSAGE_LIMIT
    assert len(status.failed(None, "X", "m" * MESSAGE_LIMIT)["message"]) == MESSAGE_LIMIT


def test_condition_messages_are_capped_to_the_condition_limit() -> None:
    long = "c" * (CONDITION_MESSAGE_LIMIT + 10)
    body = status.failed(None, "X", long)
    assert all(len(c["message"]) <= CONDITION_MESSAGE_LIMIT for c in body["conditions"])
    assert len(cond(body, "Ready")["message"]) == CONDITION_MESSAGE_LIMIT


def test_pending_body_from_a_refusal_on_a_huge_cluster_fits_the_crd() -> None:
    names = [f"node-{i:04d}-" + "y" * 240 for i in range(20)]
    inventories = [NodeInventory(n, ()) for n in names]
    with pytest.raises(Refusal) as info:
        plan_binding(REQUEST, build_view(inventories, set(names), []), node="z" * 5000)
    body = status.pending(None, REQUEST, info.value.code, info.value.message)
    assert len(body["message"]) <= MESSAGE_LIMIT
    assert len(body["reason"]) <= 128


@pytest.mark.parametrize("phase", ["pending", "bound", "creating", "ready"])
def test_every_phase_caps_its_message_to_the_crd_limit(phase: str) -> None:
    long = "m" * (MESSAGE_LIMIT + 100)
    body = {
        "pending": lambda: status.pending(None, REQUEST, "NoCapacity", long),
        "bound": lambda: status.bound(None, REQUEST, MIG, "GPU-2", [], long),
        "creating": lambda: status.creating(None, long),
        "ready": lambda: status.ready(None, "MIG-1", 1, False, long),
    }[phase]()
    assert len(body["message"]) <= MESSAGE_LIMIT
