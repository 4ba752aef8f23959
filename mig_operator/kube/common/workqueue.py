"""The controller's one work queue: coalescing, de-duplicating, by key.

``add(key, work, after_s)`` asks for ``work`` to run once ``after_s`` has passed: a key already due
keeps its earlier time (a burst of requests coalesces into one run), and a key added while its work
runs is run once more afterwards. Different keys run concurrently; one key never runs twice at once.
``NodeWaits`` keeps what waits for a node's GpuNode to change (a device not yet listed there).
``KeyedLocks`` lets one holder at a time work on a key (a slice's claim, a slice's release).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

log = logging.getLogger("mig_operator.workqueue")

Work = Callable[[], Awaitable[None] | None]


class WorkQueue:
    def __init__(self) -> None:
        self._due: dict[Hashable, tuple[float, Work]] = {}  # key -> (loop time due, its work)
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._running: set[Hashable] = set()

    def add(self, key: Hashable, work: Work, after_s: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + max(0.0, after_s)
        known = self._due.get(key)
        if known is not None and known[0] <= due:
            self._due[key] = (known[0], work)
            return
        self._due[key] = (due, work)
        if key not in self._running:
            self._arm(key)

    def pending(self, key: Hashable) -> bool:
        return key in self._due or key in self._running

    def _arm(self, key: Hashable) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(self._due[key][0], lambda: loop.create_task(self._run(key)))

    async def _run(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        entry = self._due.pop(key, None)
        if entry is None:
            return
        self._running.add(key)
        try:
            result = entry[1]()
            if result is not None:
                await result
        except Exception:  # one key's failure never stops the others
            log.exception("work %r failed", key)
        finally:
            self._running.discard(key)
            if key in self._due:
                self._arm(key)


class NodeWaits(dict[str, set[tuple[str, str]]]):
    """Keys (namespace, name) by node, waiting for that node's GpuNode to change: looked at again when
    it does."""

    def wait(self, node: str, key: tuple[str, str]) -> None:
        self.setdefault(node, set()).add(key)

    def done(self, node: str, key: tuple[str, str]) -> None:
        self.get(node, set()).discard(key)

    def take(self, node: str) -> list[tuple[str, str]]:
        """Every key waiting on ``node``, in order; they wait no more."""
        return sorted(self.pop(node, set()))


class KeyedLocks:
    """One holder at a time per key. A key's lock lives while someone holds it or waits for it: a lock
    dropped when its holder let go, with another waiting on it, let a third caller make a new lock
    and run beside the waiter (two allocations of one claim at once, one refused)."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}  # key -> (lock, holders and waiters)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            _, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
