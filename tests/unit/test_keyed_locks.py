"""KeyedLocks: one holder at a time per key, even for a caller that comes while the first holder
lets go with another waiting (the lock dropped then let the newcomer run beside the waiter: two
allocations of one claim at once, one of them refused)."""

from __future__ import annotations

import asyncio

from mig_operator.kube.common.workqueue import KeyedLocks


def test_a_newcomer_waits_for_the_waiter_not_beside_it() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    most = [0]

    async def work(name: str, started: asyncio.Event | None = None) -> None:
        async with locks.hold("claim"):
            inside.append(name)
            most[0] = max(most[0], len(inside))
            if started is not None:
                started.set()
            await asyncio.sleep(0.01)
            inside.remove(name)

    async def main() -> None:
        a_in = asyncio.Event()
        a = asyncio.create_task(work("a", a_in))
        await a_in.wait()
        b = asyncio.create_task(work("b"))  # waits for a
        await asyncio.sleep(0)
        await a  # a lets go; b has not run yet
        c = asyncio.create_task(work("c"))  # comes now: must wait for b
        await asyncio.gather(b, c)

    asyncio.run(main())
    assert most[0] == 1
    assert len(locks) == 0  # nothing kept once every holder let go


def test_other_keys_do_not_wait() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def main() -> None:
        async with locks.hold("a"):
            async with locks.hold("b"):
                order.append("b inside a")

    asyncio.run(main())
    assert order == ["b inside a"]
