"""core.placement.trace: parsing and replaying a trace, as mutation testing showed untested (docs/testing.md).

The expected decisions follow from the rule in docs/architecture.md on one H200: 7g.141gb has one
placement (start 0); an idle instance of the asked profile is reused; a 1g on a GPU with nothing in
use goes to the lowest start whose cost is least (0: slot 7 would strand nothing only at 0..5).
"""

from __future__ import annotations

import pytest

from mig_operator.core.placement.planner import InstanceSlot, MigGpu, PlannerSettings
from mig_operator.core.placement.planning_index import choose_mig
from mig_operator.core.placement.profiles import GpuModel, Placement, Profile, get_model
from mig_operator.core.placement.trace import TRACE_EXAMPLE, TraceError, TraceEvent, parse_trace, replay
from mig_operator.core.requests.request import SliceRequest

H200 = get_model("h200-141gb")
GiB = 2**30

TRACE = [
    {"op": "alloc", "id": "a1", "profile": "7g.141gb"},
    {"op": "alloc", "id": "a2", "memory": "1Gi"},  # the GPU is full: refused, and the replay goes on
    {"op": "free", "id": "a1"},
    {"op": "alloc", "id": "a3", "profile": "7g.141gb"},
    {"op": "free", "id": "a3"},
    {"op": "alloc", "id": "a4", "memory": "1Gi"},
]


def whole(ident: str, action: str) -> dict:
    return {"id": ident, "gpu": 0, "profile": "7g.141gb", "profile_id": 0, "start": 0, "size": 8, "action": action,
            "reclaimed": []}


def one_g(ident: str, reclaimed: list[dict]) -> dict:
    return {"id": ident, "gpu": 0, "profile": "1g.18gb", "profile_id": 19, "start": 0, "size": 1, "action": "create",
            "reclaimed": reclaimed}


def check_refusal(result: dict) -> None:
    assert set(result) == {"id", "error"} and result["id"] == "a2"
    assert result["error"].startswith("every GPU is held by slices in use: no room for memory 1Gi")
    assert result["error"].endswith("most room: 0/8 slots not in use on one GPU")


@pytest.mark.parametrize("choose", [None, choose_mig])
def test_a_lazy_replay_reuses_then_reclaims(choose) -> None:
    out = replay(parse_trace(TRACE), H200, choose=choose)  # one GPU, lazy reclaim: the defaults
    check_refusal(out.results[1])
    assert [out.results[0], *out.results[2:]] == [
        whole("a1", "create"), whole("a3", "reuse"),
        one_g("a4", [{"gpu": 0, "profile": "7g.141gb", "start": 0}]),
    ]
    assert (out.creates, out.destroys) == (2, 1)


@pytest.mark.parametrize("choose", [None, choose_mig])
def test_an_eager_replay_destroys_on_free(choose) -> None:
    out = replay(parse_trace(TRACE), H200, eager=True, choose=choose)
    check_refusal(out.results[1])
    assert [out.results[0], *out.results[2:]] == [whole("a1", "create"), whole("a3", "create"), one_g("a4", [])]
    assert (out.creates, out.destroys) == (3, 2)


def test_replay_starts_from_the_given_gpus() -> None:
    idle = MigGpu("node", 3, H200, (InstanceSlot(0, 0, 8, in_use=False),))
    events = parse_trace([{"op": "alloc", "id": "a", "profile": "7g.141gb"}])
    for choose in (None, choose_mig):
        out = replay(events, H200, initial=[idle], choose=choose)
        assert out.results == [dict(whole("a", "reuse"), gpu=3)] and (out.creates, out.destroys) == (0, 0)


def test_replay_asks_the_given_chooser() -> None:
    def last_gpu(request: SliceRequest, gpus: list[MigGpu]):
        return choose_mig(request, gpus[-1:])

    events = parse_trace([{"op": "alloc", "id": "a", "memory": "1Gi"}, {"op": "alloc", "id": "b", "memory": "1Gi"}])
    out = replay(events, H200, gpu_count=3, choose=last_gpu)
    assert [r["gpu"] for r in out.results] == [2, 2]
    assert out.results[1]["start"] != out.results[0]["start"]  # the first is in use: the chooser saw it


def test_replay_passes_its_settings_to_the_index() -> None:
    # A board whose one-slice profile allows a single instance, in use: 10Gi fits only the larger
    # profile, which allow_larger_profile=False refuses.
    small = Profile("1g.20gb", 19, 1, 20480, 16, 1, tuple(Placement(s, 1) for s in range(4)))
    large = Profile("2g.40gb", 14, 2, 40960, 32, 2, (Placement(0, 2), Placement(2, 2)))
    board = GpuModel("board", "Board", 4, 81920, (small, large))
    initial = [MigGpu("", 0, board, (InstanceSlot(19, 0, 1, in_use=True),))]
    events = parse_trace([{"op": "alloc", "id": "a", "memory": "10Gi"}])
    got = replay(events, board, initial=initial).results[0]
    assert (got["profile"], got["start"]) == ("2g.40gb", 2)
    strict = replay(events, board, initial=initial, settings=PlannerSettings(allow_larger_profile=False))
    assert "error" in strict.results[0]


def test_parse_trace_events() -> None:
    events = parse_trace([
        {"op": "alloc", "id": "a", "memory": "1Gi"}, {"op": "free", "id": "a"},
        {"op": "alloc", "id": "a", "fraction": 0.5},  # the same id again once freed
        {"op": "free", "id": "a"}, {"op": "free", "id": "a"},  # freeing twice is allowed
    ])
    assert events == [
        TraceEvent("alloc", "a", SliceRequest(memory_bytes=GiB)), TraceEvent("free", "a"),
        TraceEvent("alloc", "a", SliceRequest(fraction=0.5)), TraceEvent("free", "a"), TraceEvent("free", "a"),
    ]


@pytest.mark.parametrize(("trace", "message"), [
    ([5], f"event 0 is not an object: 5; e.g. {TRACE_EXAMPLE}"),
    ([{"op": "alloc", "id": 5, "memory": "1Gi"}],
     "event 0 needs a non-empty string 'id': {'op': 'alloc', 'id': 5, 'memory': '1Gi'}"),
    ([{"op": "free", "id": ""}], "event 0 needs a non-empty string 'id': {'op': 'free', 'id': ''}"),
    ([{"op": "alloc", "id": "a", "memory": "1Gi", "x": 1}],
     "event 0 has unknown fields ['x']: {'op': 'alloc', 'id': 'a', 'memory': '1Gi', 'x': 1}"),
    ([{"op": "alloc", "id": "a", "memory": "1Gi"}, {"op": "alloc", "id": "a", "memory": "1Gi"}],
     "event 1 allocates 'a' again before freeing it"),
    ([{"op": "free", "id": "b"}], "event 0 frees 'b', which was never allocated"),
    ([{"op": "alloc", "id": "a", "memory": "-1"}],
     "event 0 ('a'): memory '-1' must be greater than zero; use e.g. '4Gi'"),
])
def test_parse_trace_messages(trace, message: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(trace)
    assert str(info.value) == message
