"""Which controller replica acts (core.leadership) and the standby's paused work queue (kube/controller/standing)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from mig_operator.core.leadership import Settling, Standing, read_standing
from mig_operator.kube.common.workqueue import WorkQueue
from mig_operator.kube.controller.standing import Standing as QueueStanding

NOW = datetime(2026, 11, 29, 3, 0, 0, tzinfo=UTC).timestamp()


def _entry(priority: object, age_s: float = 1.0, lifetime: object = 10) -> dict:
    seen = datetime.fromtimestamp(NOW - age_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")
    return {"priority": priority, "lastseen": seen, "lifetime": lifetime}


def test_a_replica_acts_alone_and_yields_to_a_live_peer_of_a_higher_or_equal_priority() -> None:
    assert read_standing({"me": _entry(5)}, "me", 5, NOW) == Standing(own=True, outranked=False)
    assert read_standing({"me": _entry(5), "other": _entry(9)}, "me", 5, NOW).outranked
    assert read_standing({"me": _entry(5), "other": _entry(5)}, "me", 5, NOW).outranked  # kopf pauses both
    assert not read_standing({"me": _entry(5), "other": _entry(4)}, "me", 5, NOW).outranked
    # A peer whose lastseen plus lifetime is past is dead: it outranks nobody; nor is a dead own entry seen.
    assert not read_standing({"me": _entry(5), "other": _entry(9, age_s=11)}, "me", 5, NOW).outranked
    assert not read_standing({"me": _entry(5, age_s=30)}, "me", 5, NOW).own


def test_entries_that_cannot_be_read_count_as_absent() -> None:
    odd = {"me": _entry(5), "a": "x", "b": _entry("9"), "c": _entry(True), "d": _entry(9, lifetime="10"),
           "e": {"priority": 9, "lastseen": "٢٠٢٦-11-29T03:00:00+00:00", "lifetime": 10},
           "f": {"priority": 9, "lastseen": "2026-11-29T03:00:00" + " " * 100, "lifetime": 10},
           "g": {"priority": 9, "lastseen": "2026-11-29T03:00:00", "lifetime": 10}}  # no zone
    assert read_standing(odd, "me", 5, NOW) == Standing(own=True, outranked=False)
    assert read_standing(None, "me", 5, NOW) == Standing(own=False, outranked=False)
    assert read_standing(["me"], "me", 5, NOW) == Standing(own=False, outranked=False)


def test_a_starting_replica_acts_only_once_its_own_entry_was_seen_a_settle_apart() -> None:
    settling = Settling(settle_s=1.0)
    alone = Standing(own=True, outranked=False)
    assert not settling.acts(Standing(own=False, outranked=False), 0.0)
    assert not settling.acts(alone, 0.2)  # first seen: a peer started beside it may not have written yet
    assert not settling.acts(alone, 0.9)
    assert settling.acts(alone, 1.2)
    assert not settling.acts(Standing(own=True, outranked=True), 1.5)  # a peer of a higher priority came
    assert settling.acts(alone, 2.0)  # it went: this one had settled already
    assert not settling.acts(Standing(own=False, outranked=False), 2.5)  # its own entry gone (expired)
    assert not settling.acts(alone, 2.6)  # and seen again: settles anew
    assert settling.acts(alone, 3.7)


def test_two_replicas_started_together_never_both_act() -> None:
    """A writes its entry at 0 s and reads every second from then; B writes at 0.35 s and reads every second
    from 0.3 s (so A's first read sees only A). B's priority is higher: only B ever acts."""
    a, b = Settling(), Settling()
    acted: set[str] = set()
    for tick in range(60):
        t = tick / 10
        status = {name: _entry(priority, age_s=0.0) for name, priority, written in (("a", 7, 0.0), ("b", 9, 0.35))
                  if t >= written}
        if tick % 10 == 0 and a.acts(read_standing(status, "a", 7, NOW), t):
            acted.add("a")
        if tick % 10 == 3 and b.acts(read_standing(status, "b", 9, NOW), t):
            acted.add("b")
    assert acted == {"b"}


def test_the_standby_queue_starts_no_key_and_runs_them_once_it_acts() -> None:
    class Client:
        pass

    async def main() -> list[str]:
        queue, ran = WorkQueue(), []
        standing = QueueStanding(Client(), queue, "p", "me", 5)  # type: ignore[arg-type]
        queue.add("k", lambda: ran.append("k"))
        await asyncio.sleep(0.05)
        assert ran == [] and queue.paused
        standing.take({"me": _entry(5)}, NOW)  # seen once: not settled yet
        standing.take({"me": _entry(5)}, NOW + 1.5)
        await asyncio.sleep(0.05)
        assert ran == ["k"]
        standing.take({"me": _entry(5), "other": _entry(9)}, NOW + 2.0)
        queue.add("j", lambda: ran.append("j"))
        await asyncio.sleep(0.05)
        return ran

    assert asyncio.run(main()) == ["k"]
