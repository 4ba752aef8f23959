"""The usage rules of core/usage: folding readings, when a status write is worth it, the status body and its
tolerant reading back, the Active condition and which idle pods a quota's idlePodTimeout evicts. Expected
values are worked out by hand in each test."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from mig_operator.core.usage.figures import (
    SliceUsage,
    UsageSample,
    next_usage,
    parse_usage,
    usage_status,
    worth_writing,
)
from mig_operator.core.usage.idle import (
    IDLE_REASON,
    PodSlices,
    active_condition,
    idle_deadline,
    idle_since,
    pods_to_evict,
    short_duration,
)

GIB = 2**30
MIB = 2**20
T0 = datetime(2026, 11, 29, 6, 0, 0, tzinfo=UTC)


def usage(used: int = 0, peak: int = 0, processes: int = 0, last_active: datetime | None = None,
          refusals: int = 0, active: int | None = None) -> SliceUsage:
    return SliceUsage(used, max(peak, used), processes, active, refusals, last_active, T0)


# ---- next_usage ------------------------------------------------------------------------------------


def test_the_peak_stays_when_use_drops_and_last_active_is_the_last_reading_with_a_process() -> None:
    first = next_usage(None, UsageSample(3 * GIB, 1, 37), T0)
    assert (first.memory_used, first.memory_peak, first.processes, first.last_active) == (3 * GIB, 3 * GIB, 1, T0)
    later = T0 + timedelta(seconds=10)
    second = next_usage(first, UsageSample(0, 0, None), later)
    assert (second.memory_used, second.memory_peak, second.processes) == (0, 3 * GIB, 0)
    assert second.last_active == T0  # no process now: when one was last seen
    assert (second.observed_at, second.active_percent) == (later, None)


def test_the_ledgers_own_peak_counts_and_refusals_never_go_down() -> None:
    # Between two readings a process held 6 GiB and freed it: only the ledger's high-water mark saw it.
    after = next_usage(usage(1 * GIB, 2 * GIB), UsageSample(1 * GIB, 1, 10, refusals=3, ledger_peak=6 * GIB), T0)
    assert (after.memory_peak, after.refusals) == (6 * GIB, 3)
    # A ledger made anew (all processes gone, region recreated) starts counting at 0 again.
    again = next_usage(after, UsageSample(0, 0, 0, refusals=0, ledger_peak=0), T0)
    assert (again.memory_peak, again.refusals) == (6 * GIB, 3)


# ---- worth_writing ---------------------------------------------------------------------------------

SLICE = 10 * GIB  # 5 % of it: 512 MiB


def test_nothing_written_yet_is_worth_a_write() -> None:
    assert worth_writing(None, usage(), SLICE)


@pytest.mark.parametrize("moved, expected", [(512 * MIB, False), (513 * MIB, True), (-513 * MIB, True)])
def test_memory_in_use_is_written_when_it_moves_by_more_than_five_percent(moved: int, expected: bool) -> None:
    base = 4 * GIB
    written = usage(base, 8 * GIB)
    assert worth_writing(written, usage(base + moved, 8 * GIB), SLICE) is expected


def test_the_peak_alone_moving_past_five_percent_is_written() -> None:
    assert not worth_writing(usage(1 * GIB, 2 * GIB), usage(1 * GIB, 2 * GIB + 512 * MIB), SLICE)
    assert worth_writing(usage(1 * GIB, 2 * GIB), usage(1 * GIB, 2 * GIB + 513 * MIB), SLICE)


def test_processes_going_to_none_or_from_none_are_written_other_counts_not() -> None:
    assert worth_writing(usage(processes=0), usage(processes=1, last_active=T0), SLICE)
    assert worth_writing(usage(processes=2, last_active=T0), usage(processes=0, last_active=T0), SLICE)
    assert not worth_writing(usage(processes=2, last_active=T0), usage(processes=3, last_active=T0), SLICE)


def test_last_active_alone_is_not_worth_a_write_while_processes_run() -> None:
    written = usage(processes=1, last_active=T0)
    assert not worth_writing(written, usage(processes=1, last_active=T0 + timedelta(hours=5)), SLICE)
    # The write that shows every process gone carries when one was last seen.
    assert worth_writing(written, usage(processes=0, last_active=T0 + timedelta(hours=5)), SLICE)


def test_the_first_refusal_is_written() -> None:
    assert worth_writing(usage(), usage(refusals=1), SLICE)
    assert not worth_writing(usage(refusals=1), usage(refusals=5), SLICE)


# ---- the status body and reading it back ---------------------------------------------------------


def test_the_status_body_has_the_documented_keys_and_reads_back_the_same() -> None:
    u = SliceUsage(3 * GIB, 3 * GIB + 512 * MIB, 1, 37, 0, T0, T0 + timedelta(seconds=10))
    body = usage_status(u, None)
    assert body == {"memoryUsed": 3221225472, "memoryPeak": 3758096384, "processes": 1, "activePercent": 37,
                    "refusals": 0, "lastActive": "2026-11-29T06:00:00Z", "observedAt": "2026-11-29T06:00:10Z",
                    "used": "3.0Gi", "peak": "3.5Gi"}
    assert parse_usage({"phase": "Ready", "usage": body}) == u


def test_absent_figures_are_absent_keys() -> None:
    body = usage_status(SliceUsage(0, 0, 0, None, 0, None, T0), None)
    assert "activePercent" not in body and "lastActive" not in body and "advice" not in body
    assert (body["used"], body["peak"]) == ("0", "0")


GOOD = {"memoryUsed": 1024, "memoryPeak": 2048, "processes": 1, "observedAt": "2026-11-29T06:00:10Z"}


@pytest.mark.parametrize("status", [
    None, "usage", [], {}, {"usage": None}, {"usage": []}, {"usage": "x" * 100},
    {"usage": {**GOOD, "memoryUsed": "１０２４"}},  # Unicode digits: text, never a number
    {"usage": {**GOOD, "memoryUsed": "1024"}},
    {"usage": {**GOOD, "memoryUsed": True}},
    {"usage": {**GOOD, "memoryUsed": -1}},
    {"usage": {**GOOD, "memoryUsed": 2**64}},
    {"usage": {**GOOD, "memoryUsed": 1.5}},
    {"usage": {**GOOD, "memoryPeak": {"nested": [1, {"deeper": 2}]}}},
    {"usage": {**GOOD, "processes": None}},
    {"usage": {**GOOD, "processes": False}},
    {"usage": {**GOOD, "observedAt": "7" * (12 * MIB)}},  # 12 MiB of digits
    {"usage": {**GOOD, "observedAt": "２０２６-11-29T06:00:10Z"}},
    {"usage": {**GOOD, "observedAt": "2026-11-29T06:00:10"}},  # no zone
    {"usage": {**GOOD, "observedAt": 1764396010}},
    {"usage": {k: v for k, v in GOOD.items() if k != "processes"}},
])
def test_a_usage_that_lacks_a_needed_figure_or_is_not_well_formed_reads_as_none(status: object) -> None:
    assert parse_usage(status) is None  # type: ignore[arg-type]


def test_malformed_optional_figures_are_dropped_not_fatal() -> None:
    status = {"usage": {**GOOD, "activePercent": 101, "refusals": "３", "lastActive": "x" * (12 * MIB),
                        "advice": {"verdict": ["junk"]}, "extra": {"a": [1] * 1000}}}
    u = parse_usage(status)
    assert u == SliceUsage(1024, 2048, 1, None, 0, None, datetime(2026, 11, 29, 6, 0, 10, tzinfo=UTC))


def test_a_peak_below_the_memory_in_use_reads_as_the_memory_in_use() -> None:
    u = parse_usage({"usage": {**GOOD, "memoryUsed": 4096, "memoryPeak": 10}})
    assert u is not None and u.memory_peak == 4096


# ---- idle ------------------------------------------------------------------------------------------

READY_AT = T0 - timedelta(hours=2)
IDLE_AFTER = 1800.0


def test_idle_time_begins_at_the_last_process_or_at_ready() -> None:
    assert idle_since(None, READY_AT) == READY_AT
    assert idle_since(usage(), READY_AT) == READY_AT
    assert idle_since(usage(last_active=T0), READY_AT) == T0


def test_a_slice_with_a_process_is_active_running() -> None:
    cond = active_condition(usage(processes=2, last_active=T0), READY_AT, T0, IDLE_AFTER)
    assert (cond["type"], cond["status"], cond["reason"], cond["lastTransitionTime"]) == (
        "Active", "True", "Running", "2026-11-29T06:00:00Z")
    assert cond["message"] == "2 processes using the slice"


def test_no_process_for_less_than_the_idle_time_is_still_active() -> None:
    last = T0 - timedelta(minutes=29, seconds=59)
    cond = active_condition(usage(last_active=last), READY_AT, T0, IDLE_AFTER)
    assert (cond["status"], cond["reason"]) == ("True", "Running")
    assert cond["message"] == "no process for 29m59s (idle after 30m)"


def test_no_process_for_the_idle_time_is_inactive_since_the_idle_time_began() -> None:
    last = T0 - timedelta(minutes=31)
    cond = active_condition(usage(last_active=last), READY_AT, T0, IDLE_AFTER)
    assert cond == {"type": "Active", "status": "False", "reason": IDLE_REASON,
                    "lastTransitionTime": "2026-11-29T05:29:00Z", "message": "no process for 31m (idle after 30m)"}


def test_never_active_counts_from_ready() -> None:
    cond = active_condition(None, READY_AT, T0, IDLE_AFTER)
    assert (cond["status"], cond["lastTransitionTime"]) == ("False", "2026-11-29T04:00:00Z")
    assert cond["message"] == "no process for 2h (idle after 30m)"


def test_a_true_condition_keeps_its_transition_time() -> None:
    previous = {"type": "Active", "status": "True", "lastTransitionTime": "2026-11-29T04:00:00Z"}
    cond = active_condition(usage(processes=1, last_active=T0), READY_AT, T0, IDLE_AFTER, previous)
    assert cond["lastTransitionTime"] == "2026-11-29T04:00:00Z"
    was_false = {**previous, "status": "False"}
    assert active_condition(usage(processes=1, last_active=T0), READY_AT, T0, IDLE_AFTER,
                            was_false)["lastTransitionTime"] == "2026-11-29T06:00:00Z"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (45, "45s"), (1860, "31m"), (7505, "2h5m"), (7205, "2h"),
                                           (3 * 86400 + 4 * 3600 + 5, "3d4h")])
def test_short_durations(seconds: float, text: str) -> None:
    assert short_duration(seconds) == text


def inactive(since: datetime) -> dict:
    return {"type": "Active", "status": "False", "reason": "NoProcess",
            "lastTransitionTime": since.isoformat().replace("+00:00", "Z")}


def test_a_pod_is_evicted_when_every_slice_has_been_idle_for_the_timeout() -> None:
    both = PodSlices("team-a", "nb", ("s1", "s2"))
    one_active = PodSlices("team-a", "train", ("s3", "s4"))
    one_unknown = PodSlices("team-a", "new", ("s1", "missing"))
    other_ns = PodSlices("team-b", "nb", ("s1",))
    conditions = {
        ("team-a", "s1"): inactive(T0 - timedelta(hours=3)),
        ("team-a", "s2"): inactive(T0 - timedelta(hours=2)),  # the later one decides: exactly 2 h ago
        ("team-a", "s3"): inactive(T0 - timedelta(hours=5)),
        ("team-a", "s4"): {"type": "Active", "status": "True", "lastTransitionTime": "2026-11-29T00:00:00Z"},
        ("team-b", "s1"): inactive(T0 - timedelta(days=3)),
    }
    timeouts = {"team-a": 7200.0}  # team-b has no idlePodTimeout
    assert pods_to_evict([both, one_active, one_unknown, other_ns], conditions, timeouts, T0) == [both]
    # One second earlier, nothing is due yet; the deadline says when.
    assert pods_to_evict([both], conditions, timeouts, T0 - timedelta(seconds=1)) == []
    assert idle_deadline(both, conditions, 7200.0) == T0


def test_a_pod_without_slices_or_with_unreadable_conditions_is_never_evicted() -> None:
    conditions = {("ns", "s"): {"type": "Active", "status": "False", "lastTransitionTime": "not a time"}}
    assert pods_to_evict([PodSlices("ns", "p", ()), PodSlices("ns", "q", ("s",))], conditions, {"ns": 1.0},
                         T0) == []
