"""EventPoster under a flood: bounded posts in flight, a bounded line, drops counted, nothing stranded."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from mig_operator.kube.common import events as events_module
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.events import EventPoster
from mig_operator.kube.common.supervise import Loops


class SlowApi:
    """Takes each POST after a pause; records the most posts it ever had in flight."""

    def __init__(self, fail_every: int = 0) -> None:
        self.in_flight = 0
        self.most = 0
        self.posted: list[dict] = []
        self.fail_every = fail_every
        self.calls = 0

    async def create(self, path: str, body: dict) -> dict:
        self.calls += 1
        fail = self.fail_every and self.calls % self.fail_every == 0
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if fail:
                raise ApiError(500, "Internal", f"POST {path}: boom")
            assert path == f"/api/v1/namespaces/{body['metadata']['namespace']}/events"
            self.posted.append(body)
            return body
        finally:
            self.in_flight -= 1


def slice_obj(i: int) -> dict:
    return {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
            "metadata": {"name": f"s-{i}", "namespace": "flood", "uid": f"uid-{i}"}}


def dropped(component: str) -> float:
    return REGISTRY.get_sample_value("mig_operator_events_dropped_total", {"component": component}) or 0.0


def test_a_flood_of_events_keeps_posts_and_waiting_bounded_and_counts_what_it_drops() -> None:
    api = SlowApi()
    poster = EventPoster(api, "flood-test")  # type: ignore[arg-type]
    flood = events_module.PENDING_LIMIT * 3

    async def go() -> int:
        for i in range(flood):
            poster.post(slice_obj(i), "Warning", "NoSuchNode", "node x does not exist")
        waiting = len(poster._pending)
        await poster.drain()
        return waiting

    before = dropped("flood-test")
    waiting = asyncio.run(go())
    # Posting never yields to the senders, so the line filled to its limit and the rest was dropped.
    assert waiting == events_module.PENDING_LIMIT
    assert api.most == events_module.SENDERS
    assert len(api.posted) == events_module.PENDING_LIMIT
    assert dropped("flood-test") - before == flood - events_module.PENDING_LIMIT
    assert {b["involvedObject"]["name"] for b in api.posted} == {f"s-{i}" for i in range(events_module.PENDING_LIMIT)}


def test_an_event_after_the_senders_finished_is_posted_and_a_failed_post_does_not_stop_the_others() -> None:
    api = SlowApi(fail_every=3)
    poster = EventPoster(api, "later-test")  # type: ignore[arg-type]

    async def go() -> None:
        for i in range(10):
            poster.post(slice_obj(i), "Warning", "NoCapacity", "no room")
        await poster.drain()
        assert not poster._senders
        poster.post(slice_obj(99), "Warning", "NoCapacity", "no room")
        poster.post(slice_obj(99), "Warning", "NoCapacity", "no room")  # a repeat: not posted
        await poster.drain()

    asyncio.run(go())
    names = [b["involvedObject"]["name"] for b in api.posted]
    assert api.calls == 11
    assert len(names) == 11 - 11 // 3  # every third post failed (logged, not retried)
    assert names[-1] == "s-99"


def test_a_sender_that_fails_unexpectedly_is_started_again_and_the_later_events_are_posted() -> None:
    """The senders are supervised loops: an error other than the API's (a bug, say) ends that run of the
    sender, which starts again after its back-off, counted, and every sender keeps serving the line."""

    class Breaks(SlowApi):
        async def create(self, path: str, body: dict) -> dict:
            if body["involvedObject"]["name"] == "s-0":
                raise RuntimeError("unexpected")
            return await super().create(path, body)

    api = Breaks()
    loops = Loops("sender-test")
    poster = EventPoster(api, "sender-test", loops=loops)  # type: ignore[arg-type]

    def restarts() -> float:
        return sum(REGISTRY.get_sample_value("mig_operator_loop_restarts_total",
                                             {"component": "sender-test", "loop": f"event-sender-{i}"}) or 0.0
                   for i in range(events_module.SENDERS))

    async def go() -> tuple[float, int]:
        before = restarts()
        poster.post(slice_obj(0), "Warning", "NoCapacity", "no room")
        for _ in range(200):
            if restarts() > before:
                break
            await asyncio.sleep(0.005)
        for i in range(1, 4 * events_module.SENDERS):
            poster.post(slice_obj(i), "Warning", "NoCapacity", "no room")
        running = sum(not t.done() for t in poster._senders)
        await poster.drain()
        return restarts() - before, running

    counted, running = asyncio.run(go())
    assert counted == 1 and running == events_module.SENDERS
    assert sorted(b["involvedObject"]["name"] for b in api.posted) == sorted(
        f"s-{i}" for i in range(1, 4 * events_module.SENDERS))
