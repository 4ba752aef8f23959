"""The work queue of the controller and of each agent: coalescing, rate-limited, serving namespaces in turn.

``add(key, work, after_s)`` asks for ``work`` to run once ``after_s`` has passed. A key already
waiting keeps its earlier time and takes the latest work (a burst of requests coalesces into one
run); a key added while its work runs runs once more afterwards, at the time asked. One key never
runs twice at once.

What work says when it ends (as controller-runtime's reconcile result does):

* it returns (anything but ``Requeue``): done; the key's failure count is forgotten;
* it returns ``Requeue(after_s)``: "not yet", run it again after ``after_s`` (failures forgotten);
* it raises: it runs again after a per-key exponential back-off, ``base_delay_s`` doubling with each
  failure in a row up to ``max_delay_s`` (5 ms to 60 s by default), and
  ``mig_operator_workqueue_retries_total`` counts the retry by the key's kind. Work never fails
  silently: a key is dropped only when its work ends without raising.

Keys are strings (cluster-wide work, the string is its kind) or tuples ``(kind, namespace, ...)``.
Due keys wait for one of ``workers`` workers; each free worker takes the next due key of the next
namespace in turn (round robin; cluster-wide keys count as one namespace, ""), so one namespace's
thousands of keys delay another namespace's key by at most one key each, never by all of them.
``mig_operator_workqueue_depth`` is the number of due keys waiting for a worker.

A kind of key may have its reconcile registered (``register(kind, reconcile)``): ``enqueue(key)`` then asks
for ``reconcile(*key[1:])``, so a part asks for another part's key by name, with no function handed over.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from . import metrics

log = logging.getLogger("mig_operator.workqueue")

Work = Callable[[], Awaitable[object] | object]
# Most work waits on the API server: 64 keys at once kept a reused pod's burst at 1.1-1.2x DRA-native
# on the 16-core device machine, where 16 gave 1.35-1.9x (bench/results/benchmark-history.md).
DEFAULT_WORKERS = 64
BASE_DELAY_S = 0.005
MAX_DELAY_S = 60.0


@dataclass(frozen=True)
class Requeue:
    """What work returns to be run again after ``after_s`` seconds (it is not done yet)."""

    after_s: float


def key_kind(key: Hashable) -> str:
    """A key's kind: the string itself, or a tuple's first element."""
    return str(key[0]) if isinstance(key, tuple) and key else str(key)


def key_namespace(key: Hashable) -> str:
    """A key's namespace: a tuple's second element when it is a string, else "" (cluster-wide)."""
    if isinstance(key, tuple) and len(key) > 1 and isinstance(key[1], str):
        return key[1]
    return ""


def backoff_s(failures: int, base_s: float = BASE_DELAY_S, max_s: float = MAX_DELAY_S) -> float:
    """The wait before a key's next try after ``failures`` failures in a row (1 for the first)."""
    return min(max_s, base_s * 2 ** min(max(0, failures - 1), 64))


class WorkQueue:
    def __init__(self, workers: int = DEFAULT_WORKERS, base_delay_s: float = BASE_DELAY_S,
                 max_delay_s: float = MAX_DELAY_S, component: str = "controller") -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers} (e.g. 16)")
        self.workers = workers
        self.component = component  # the part whose queue it is: the metrics' label
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self._wanted: dict[Hashable, tuple[float, Work]] = {}  # key -> (loop time due, its work), not started
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._ready: dict[str, deque[Hashable]] = {}  # namespace -> its due keys, oldest first
        self._turns: deque[str] = deque()  # namespaces with due keys, in the order they are served
        self._due: set[Hashable] = set()  # keys in ``_ready``
        self._running: dict[Hashable, Work] = {}
        self._failures: dict[Hashable, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._reconcilers: dict[str, Callable[..., Awaitable[object]]] = {}
        self.paused = False  # while paused, keys wait, due or not, and none starts

    def pause(self) -> None:
        """Start no key until ``resume`` (keys running go on to their end): a standby controller replica."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._pump()

    # ---- asking ------------------------------------------------------------------------------

    def add(self, key: Hashable, work: Work, after_s: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + max(0.0, after_s)
        known = self._wanted.get(key)
        if known is not None and known[0] <= due:
            self._wanted[key] = (known[0], work)
            return
        self._wanted[key] = (due, work)
        if key not in self._running and key not in self._due:
            self._arm(key)

    def register(self, kind: str, reconcile: Callable[..., Awaitable[object]]) -> None:
        """``reconcile(*key[1:])`` is the work of every key of ``kind`` asked for with ``enqueue``."""
        self._reconcilers[kind] = reconcile

    def enqueue(self, key: tuple[str, ...], after_s: float = 0.0) -> None:
        """Ask for a key of a registered kind (``register``): its reconcile runs with the key's parts."""
        reconcile = self._reconcilers[key[0]]
        self.add(key, lambda: reconcile(*key[1:]), after_s)

    def pending(self, key: Hashable) -> bool:
        """Whether the key waits to run or runs."""
        return key in self._wanted or key in self._running

    def wake(self, key: Hashable) -> None:
        """Run a key that waits (or runs: once more) now rather than at its time; nothing if neither."""
        entry = self._wanted.get(key)
        work = entry[1] if entry is not None else self._running.get(key)
        if work is not None:
            self.add(key, work)

    def retry_failed_now(self) -> None:
        """Run every key that waits after a failure now rather than at the end of its back-off (the API
        server it failed on is back)."""
        for key in list(self._failures):
            entry = self._wanted.get(key)
            if entry is not None:
                self.add(key, entry[1])

    def __len__(self) -> int:
        """Keys that wait to run or run."""
        return len(self._wanted.keys() | self._running.keys())

    def failures(self, key: Hashable) -> int:
        """How many times in a row the key's work failed (0 once it succeeds)."""
        return self._failures.get(key, 0)

    # ---- running -----------------------------------------------------------------------------

    def _arm(self, key: Hashable) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        due = self._wanted[key][0]
        if due <= loop.time():
            self._make_due(key)
        else:
            self._timers[key] = loop.call_at(due, self._make_due, key)

    def _make_due(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        if key not in self._wanted or key in self._running or key in self._due:
            return
        namespace = key_namespace(key)
        if namespace not in self._ready:
            self._ready[namespace] = deque()
            self._turns.append(namespace)
        self._ready[namespace].append(key)
        self._due.add(key)
        self._pump()

    def _pump(self) -> None:
        """Start due keys while a worker is free: the next namespace's oldest due key each time."""
        while not self.paused and len(self._running) < self.workers and self._turns:
            namespace = self._turns.popleft()
            keys = self._ready[namespace]
            key = keys.popleft()
            if keys:
                self._turns.append(namespace)
            else:
                del self._ready[namespace]
            self._due.discard(key)
            _, work = self._wanted.pop(key)
            self._running[key] = work
            task = asyncio.get_running_loop().create_task(self._run(key, work))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        metrics.WORKQUEUE_DEPTH.labels(self.component).set(len(self._due))

    async def _run(self, key: Hashable, work: Work) -> None:
        try:
            result = work()
            if inspect.isawaitable(result):
                result = await result
        except (asyncio.CancelledError, GeneratorExit):  # the loop stops: nothing more starts
            self._running.pop(key, None)
            raise
        except Exception as exc:  # one key's failure never stops the others: it is tried again later
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            delay = backoff_s(failures, self.base_delay_s, self.max_delay_s)
            metrics.WORKQUEUE_RETRIES.labels(self.component, key_kind(key)).inc()
            log.warning("work %r failed (%d in a row), tried again in %.3g s: %s", key, failures, delay, exc,
                        exc_info=failures == 1)
            self._again(key, work, delay)
        else:
            self._failures.pop(key, None)
            if isinstance(result, Requeue):
                self._again(key, work, result.after_s)
        del self._running[key]
        if key in self._wanted:
            self._arm(key)
        self._pump()

    def _again(self, key: Hashable, work: Work, after_s: float) -> None:
        """Run the key again after ``after_s``; work added while it ran is newer and wins, at the
        earlier of the two times."""
        known = self._wanted.get(key)
        if known is None:
            self.add(key, work, after_s)
        else:
            self.add(key, known[1], after_s)
