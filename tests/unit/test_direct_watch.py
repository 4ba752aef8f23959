"""The controller's events from kopf's watch stream straight to its handlers (kube/common/direct_watch):
one object's events in order and one at a time, other objects' meanwhile, a failing handler logged
and the next event handled."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mig_operator.kube.common.direct_watch import ObjectQueues


def _event(uid: str, n: int, type_: str | None = "MODIFIED") -> dict:
    return {"type": type_, "object": {"metadata": {"uid": uid, "name": uid, "namespace": "ns"}, "n": n}}


def test_one_objects_events_run_in_order_and_one_at_a_time_while_others_run() -> None:
    seen: list[tuple[str, int]] = []
    running: dict[str, int] = {}
    most_at_once = {"a": 0, "b": 0}
    both = asyncio.Event()

    async def handler(body: dict, type_: str | None) -> None:
        uid = body["metadata"]["uid"]
        running[uid] = running.get(uid, 0) + 1
        most_at_once[uid] = max(most_at_once[uid], running[uid])
        if running.get("a") and running.get("b"):
            both.set()
        await asyncio.sleep(0.01)
        seen.append((uid, body["n"]))
        running[uid] -= 1

    async def main() -> None:
        queues = ObjectQueues(handler, "pods")
        for n in range(5):
            queues.put("a", _event("a", n))
            queues.put("b", _event("b", n))
        await asyncio.wait_for(both.wait(), 1)  # a's and b's handlers overlapped
        while queues.tasks:
            await asyncio.sleep(0.01)
        assert queues.waiting == {}

    asyncio.run(main())
    assert [n for uid, n in seen if uid == "a"] == list(range(5))
    assert [n for uid, n in seen if uid == "b"] == list(range(5))
    assert most_at_once == {"a": 1, "b": 1}


def test_an_event_that_comes_after_the_queue_drained_gets_a_new_task() -> None:
    seen: list[int] = []

    async def handler(body: dict, type_: str | None) -> None:
        seen.append(body["n"])

    async def main() -> None:
        queues = ObjectQueues(handler, "pods")
        queues.put("a", _event("a", 1))
        await asyncio.sleep(0.01)
        assert queues.waiting == {} and not queues.tasks
        queues.put("a", _event("a", 2, None))
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert seen == [1, 2]


def test_a_failing_handler_is_logged_and_the_objects_next_event_still_handled(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    async def handler(body: dict, type_: str | None) -> None:
        if body["n"] == 1:
            raise RuntimeError("boom")
        seen.append(body["n"])

    async def main() -> None:
        queues = ObjectQueues(handler, "gpuslices")
        for n in range(3):
            queues.put("a", _event("a", n))
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.ERROR, logger="mig_operator.events"):
        asyncio.run(main())
    assert seen == [0, 2]
    assert "gpuslices ns/a: the event handler failed" in caplog.text


def test_close_lets_a_handler_finish_then_cancels_one_that_outlasts_the_timeout() -> None:
    finished: list[str] = []

    async def handler(body: dict, type_: str | None) -> None:
        await asyncio.sleep(0.02 if body["metadata"]["uid"] == "quick" else 10)
        finished.append(body["metadata"]["uid"])

    async def main() -> None:
        queues = ObjectQueues(handler, "pods")
        queues.put("quick", _event("quick", 0))
        queues.put("slow", _event("slow", 0))
        await asyncio.sleep(0)
        await queues.close(0.2)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert finished == ["quick"]
