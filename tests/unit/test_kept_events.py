"""A watch event whose handler fails is never dropped: it is handed to the handler again after a back-off,
as the newest event of that object known by then; other objects' events are not held up by it."""

from __future__ import annotations

import asyncio
import collections.abc
import itertools

from prometheus_client import REGISTRY

from mig_operator.kube.common.operator import KeptEvents, RetryForever


def _body(uid: str, version: int) -> dict:
    return {"metadata": {"uid": uid, "namespace": "team", "name": uid, "resourceVersion": str(version)}}


def _retries(kind: str) -> float:
    return REGISTRY.get_sample_value("mig_operator_reconcile_errors_total", {"part": "watch", "kind": kind}) or 0.0


def test_a_failed_event_is_handed_again_until_it_succeeds_and_others_go_on_meanwhile() -> None:
    seen: list[tuple[str, str]] = []
    fail_left = {"a": 3}

    async def handler(body: dict, type: str | None) -> None:
        meta = body["metadata"]
        seen.append((meta["uid"], meta["resourceVersion"]))
        if fail_left.get(meta["uid"], 0) > 0:
            fail_left[meta["uid"]] -= 1
            raise RuntimeError("409 Conflict")

    async def main() -> None:
        before = _retries("things")
        events = KeptEvents(handler, "things")
        events.put("a", _body("a", 1), "MODIFIED")
        events.put("b", _body("b", 1), "MODIFIED")
        for _ in range(1000):
            if not events.waiting:
                break
            await asyncio.sleep(0.005)
        assert not events.waiting
        assert seen.count(("a", "1")) == 4  # three failures, then it succeeded
        assert ("b", "1") in seen[:2]  # b was not held behind a's retries
        assert _retries("things") - before == 3

    asyncio.run(main())


def test_a_retry_takes_the_newest_event_that_came_while_it_waited() -> None:
    seen: list[str] = []
    first = [True]

    async def handler(body: dict, type: str | None) -> None:
        seen.append(body["metadata"]["resourceVersion"])
        if first[0]:
            first[0] = False
            events.put("a", _body("a", 2), "MODIFIED")
            events.put("a", _body("a", 3), "MODIFIED")
            raise RuntimeError("500")

    events = KeptEvents(handler, "newest")

    async def main() -> None:
        events.put("a", _body("a", 1), "MODIFIED")
        for _ in range(1000):
            if not events.waiting:
                break
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert seen == ["1", "3"]  # 2 said less than 3, which came before the retry


def test_kopfs_back_offs_never_run_out_and_start_afresh_for_each_call() -> None:
    backoffs = RetryForever()
    assert not isinstance(backoffs, collections.abc.Sized)  # kopf counts a last try only for a sized one
    first = list(itertools.islice(backoffs, 1000))
    assert first[:2] == [0.5, 1.0] and set(first[2:]) == {2.0}
    assert list(itertools.islice(backoffs, 3)) == [0.5, 1.0, 2.0]
