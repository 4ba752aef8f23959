"""The work queue as controller-runtime's: a failed key comes back after a per-key exponential back-off
(doubling, capped, forgotten on success), work asks to be run again later (``Requeue``), due keys are
served by a bounded number of workers taking namespaces in turn, and one key never runs twice at once.

Times are measured on the loop's clock; the expected waits are computed here from the rule (base
doubling, capped), not read from the queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable

import pytest
from prometheus_client import REGISTRY

from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.workqueue import Requeue, WorkQueue, key_kind, key_namespace
from mig_operator.kube.controller.binder import assemble

BASE, CAP = 0.05, 0.2
EARLY = 0.003  # a timer may fire up to the clock's resolution early
LATE = 0.15  # how late a loaded machine may run a timer


async def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``check`` (the loop keeps running the queue meanwhile)."""
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)


def _retries(kind: str) -> float:
    labels = {"component": "controller", "kind": kind}
    return REGISTRY.get_sample_value("mig_operator_workqueue_retries_total", labels) or 0.0


def test_a_failing_key_backs_off_doubling_up_to_the_cap_and_forgets_on_success() -> None:
    times: list[float] = []
    before = _retries("flaky")

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        queue = WorkQueue(base_delay_s=BASE, max_delay_s=CAP)
        done = asyncio.Event()
        seen: list[int] = []

        def work() -> None:
            times.append(loop.time())
            seen.append(queue.failures(("flaky", "ns", "a")))
            if len(times) in (6, 7):  # the 6th run succeeds; the 7th (added after) fails once more
                if len(times) == 7:
                    raise RuntimeError("again")
                return
            if len(times) == 8:
                done.set()
                return
            raise RuntimeError("boom")

        queue.add(("flaky", "ns", "a"), work)
        while len(times) < 6:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        assert queue.failures(("flaky", "ns", "a")) == 0 and not queue.pending(("flaky", "ns", "a"))
        queue.add(("flaky", "ns", "a"), work)
        await asyncio.wait_for(done.wait(), 5)
        return seen

    seen = asyncio.run(main())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Model: the wait after the n-th failure in a row is min(BASE * 2**(n-1), CAP).
    expected = [min(BASE * 2 ** (n - 1), CAP) for n in range(1, 6)]  # 0.05 0.1 0.2 0.2 0.2 (uncapped: 0.4, 0.8)
    for gap, want in zip(gaps[:5], expected, strict=True):
        assert want - EARLY <= gap < want + LATE, (gaps, expected)
    assert BASE - EARLY <= gaps[6] < BASE + LATE, gaps  # forgotten: the first wait again
    assert seen == [0, 1, 2, 3, 4, 5, 0, 1]
    assert _retries("flaky") - before == 6


def test_requeue_after_runs_the_key_again_then_and_is_no_failure() -> None:
    times: list[float] = []
    before = _retries("later")

    async def main() -> WorkQueue:
        loop = asyncio.get_running_loop()
        queue = WorkQueue()

        async def work() -> Requeue | None:
            times.append(loop.time())
            return Requeue(0.05) if len(times) < 3 else None

        queue.add(("later", "ns", "x"), work)
        await _until(lambda: not queue.pending(("later", "ns", "x")))
        return queue

    queue = asyncio.run(main())
    assert len(times) == 3
    assert all(b - a >= 0.05 - EARLY for a, b in zip(times, times[1:], strict=False)), times
    assert queue.failures(("later", "ns", "x")) == 0 and _retries("later") == before


def test_a_key_added_while_it_fails_runs_again_at_once_with_the_newer_work() -> None:
    runs: list[str] = []

    async def main() -> None:
        queue = WorkQueue(base_delay_s=10.0, max_delay_s=10.0)
        release = asyncio.Event()

        async def failing() -> None:
            runs.append("old")
            await release.wait()
            raise RuntimeError("fails")

        queue.add("k", failing)
        await _until(lambda: runs == ["old"])
        queue.add("k", lambda: runs.append("new"))
        release.set()
        await _until(lambda: len(runs) == 2, 2.0)  # far less than the 10 s back-off: the newer request was due now

    asyncio.run(main())
    assert runs == ["old", "new"]


def _round_robin(arrivals: list[Hashable]) -> list[Hashable]:
    """The order one worker serves keys that are all due at once, namespaces in turn in the order they
    first came, each namespace's keys oldest first (an independent model of the rule)."""
    by_ns: dict[str, list[Hashable]] = {}
    for key in arrivals:
        by_ns.setdefault(key_namespace(key), []).append(key)
    order: list[Hashable] = []
    while any(by_ns.values()):
        for keys in by_ns.values():
            if keys:
                order.append(keys.pop(0))
    return order


def test_one_worker_serves_namespaces_in_turn() -> None:
    started: list[Hashable] = []
    arrivals: list[Hashable] = [("bind", "a", f"a{i}") for i in range(6)] + [("bind", "b", "b0")]
    arrivals += [("bind", "c", "c0"), ("bind", "b", "b1"), "replan"]

    async def main() -> None:
        queue = WorkQueue(workers=1)
        gate = asyncio.Event()

        async def blocker() -> None:
            await gate.wait()

        queue.add(("hold", "z", "first"), blocker)  # takes the only worker while the rest arrive
        await asyncio.sleep(0.01)
        for key in arrivals:
            queue.add(key, lambda key=key: started.append(key))
        assert REGISTRY.get_sample_value("mig_operator_workqueue_depth", {"component": "controller"}) == len(arrivals)
        gate.set()
        await _until(lambda: len(started) == len(arrivals))
        assert REGISTRY.get_sample_value("mig_operator_workqueue_depth", {"component": "controller"}) == 0

    asyncio.run(main())
    assert started == _round_robin(arrivals)
    assert started.index(("bind", "b", "b0")) == 1  # a flood of "a" delays "b" by one key, not six


def test_a_flood_of_one_namespace_takes_one_turn_per_worker_from_another() -> None:
    started: list[str] = []

    async def main() -> None:
        queue = WorkQueue(workers=4)

        async def work(name: str) -> None:
            started.append(name)
            await asyncio.sleep(0.005)

        for i in range(400):
            queue.add(("bind", "flood", str(i)), lambda i=i: work(f"flood-{i}"))
        await asyncio.sleep(0.02)
        before = len(started)
        queue.add(("bind", "quiet", "one"), lambda: work("quiet"))
        for _ in range(100):
            if "quiet" in started:
                break
            await asyncio.sleep(0.01)
        # Before it start at most the 4 flood keys the workers held when it came (a key's work starts on
        # the loop's next turn, so those may not have started when ``before`` was read) and the one flood
        # key whose turn came before the quiet namespace's: one round of the workers (all 400 take 0.5 s).
        assert started.index("quiet") <= before + 4 + 1, (started.index("quiet"), before)

    asyncio.run(main())


def test_a_key_never_runs_twice_at_once_and_a_burst_coalesces() -> None:
    active: dict[str, int] = {"now": 0, "most": 0}
    runs: list[int] = []

    async def main() -> None:
        queue = WorkQueue(workers=8, base_delay_s=0.001, max_delay_s=0.004)

        async def work() -> None:
            active["now"] += 1
            active["most"] = max(active["most"], active["now"])
            runs.append(1)
            await asyncio.sleep(0.01)
            active["now"] -= 1
            if len(runs) % 3 == 0:
                raise RuntimeError("now and then")

        for _ in range(30):
            queue.add(("k", "ns", "one"), work)
            queue.wake(("k", "ns", "one"))
            await asyncio.sleep(0.002)
        while queue.pending(("k", "ns", "one")):
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert active["most"] == 1
    assert len(runs) < 30  # adds while it ran coalesced into one more run each time


def test_keys_kind_and_namespace() -> None:
    assert key_kind("replan") == "replan" and key_namespace("replan") == ""
    assert key_kind(("bind", "ns", "uid")) == "bind" and key_namespace(("bind", "ns", "uid")) == "ns"
    assert key_namespace(("hold-ends", 12.5)) == ""
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        WorkQueue(workers=0)


class _FlakyStatusClient:
    """Answers the first ``fail`` status writes with HTTP 500, then writes them (the answer is the slice)."""

    def __init__(self, body: dict, fail: int) -> None:
        self.body, self.fail, self.writes = body, fail, 0

    async def merge_patch(self, path: str, patch: dict) -> dict:
        self.writes += 1
        if self.fail:
            self.fail -= 1
            raise ApiError(500, "InternalError", "injected")
        version = int(self.body["metadata"]["resourceVersion"]) + 1
        self.body = {**self.body, "metadata": {**self.body["metadata"], "resourceVersion": str(version)},
                     "status": patch["status"]}
        return self.body


class _Events:
    def __init__(self) -> None:
        self.posted: list[str] = []

    def post(self, obj: dict, kind: str, reason: str, message: str) -> None:
        self.posted.append(reason)

    def forget(self, uid: str) -> None:
        pass


def test_an_invalid_specs_failed_status_write_is_retried_on_its_key_until_written() -> None:
    """The watch handler only queues the InvalidSpec write: a write refused twice comes back on its key,
    after its back-off, and the slice ends Failed with one Event (not one per try)."""
    body = {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
            "metadata": {"name": "bad", "namespace": "ns", "uid": "u-bad", "resourceVersion": "7",
                         "creationTimestamp": "2026-11-27T10:00:00Z"},
            "spec": {"memory": "lots"}}
    client, events = _FlakyStatusClient(body, fail=2), _Events()
    before = _retries("slice")

    async def main() -> None:
        binder = assemble(client, events, resync_s=3600,  # type: ignore[arg-type]
                          queue=WorkQueue(base_delay_s=0.01, max_delay_s=0.05))
        binder._last_resync = time.monotonic()  # no full list in this test: the client answers status writes only
        await binder.slice_event(body, deleted=False)
        assert client.writes == 0, "the watch handler writes nothing itself"
        await _until(lambda: binder.ledger.slices["u-bad"].phase == "Failed")
        await _until(lambda: not len(binder.queue))
        assert not len(binder.queue)

    asyncio.run(main())
    assert client.writes == 3
    assert client.body["status"]["reason"] == "InvalidSpec"
    assert events.posted == ["InvalidSpec"]
    assert _retries("slice") - before == 2


def test_retry_failed_now_runs_a_failing_key_at_once_rather_than_after_its_back_off() -> None:
    """A key whose back-off has grown long (the API server was away) runs as soon as it is asked to, and a key
    that did not fail keeps its time."""
    async def main() -> None:
        runs: list[str] = []

        def failing() -> None:
            runs.append("failing")
            if runs.count("failing") == 1:
                raise RuntimeError("away")

        queue = WorkQueue(base_delay_s=3600.0, max_delay_s=3600.0)
        queue.add("failing", failing)
        queue.add("later", lambda: runs.append("later"), after_s=3600.0)
        for _ in range(100):
            if queue.failures("failing") == 1:
                break
            await asyncio.sleep(0.001)
        assert queue.failures("failing") == 1 and runs == ["failing"]
        queue.retry_failed_now()
        for _ in range(100):
            if runs.count("failing") == 2:
                break
            await asyncio.sleep(0.001)
        assert runs == ["failing", "failing"]  # "later" did not fail: its time stays an hour away
        assert queue.failures("failing") == 0 and queue.pending("later")

    asyncio.run(main())
