"""The controller's work queue: a burst coalesces into one run, a key added while it runs runs once
more afterwards, distinct keys run side by side."""

from __future__ import annotations

import asyncio

from mig_operator.kube.common.workqueue import WorkQueue


def test_a_burst_of_adds_is_one_run_and_an_add_while_running_is_one_more() -> None:
    runs: list[str] = []

    async def main() -> None:
        queue = WorkQueue()
        started = asyncio.Event()
        release = asyncio.Event()

        async def slow() -> None:
            runs.append("slow")
            started.set()
            await release.wait()

        for _ in range(5):
            queue.add("a", lambda: runs.append("a"), 0.02)
        queue.add("b", slow)
        await started.wait()
        for _ in range(3):  # while "b" runs: one more run afterwards, not three
            queue.add("b", lambda: runs.append("b-again"))
        await asyncio.sleep(0.05)
        assert runs.count("a") == 1 and "b-again" not in runs  # "a" ran beside the running "b"
        release.set()
        await asyncio.sleep(0.05)
        assert not queue.pending("a") and not queue.pending("b")

    asyncio.run(main())
    assert runs.count("a") == 1 and runs.count("slow") == 1 and runs.count("b-again") == 1


def test_the_earlier_due_time_wins_and_a_failure_stops_nothing() -> None:
    runs: list[str] = []

    async def main() -> None:
        queue = WorkQueue()
        queue.add("late", lambda: runs.append("late"), 10.0)
        queue.add("late", lambda: runs.append("late-soon"), 0.01)  # sooner: it runs then, the latest work
        queue.add("boom", lambda: 1 / 0)
        await asyncio.sleep(0.05)
        queue.add("soon", lambda: runs.append("soon-first"), 0.01)
        queue.add("soon", lambda: runs.append("soon-latest"), 10.0)  # the earlier time stays, the latest work
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert runs == ["late-soon", "soon-latest"]
