"""Long-lived loops that never end silently: ``supervised`` runs a loop and starts it again after an
unexpected error, with back-off, counting each restart in ``mig_operator_loop_restarts_total``.

A loop is an async function that runs until cancelled. If it returns or raises, it is started again
after ``backoff_s(failures in a row)`` (the work queue's back-off, 0.5 s doubling up to 30 s by
default); a run that lasted longer than ``healthy_after_s`` resets the count. ``Loops`` keeps each
loop's last state for the liveness probe: a loop that keeps failing for longer than its ``stale_s``
makes the process unhealthy, so the kubelet restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from . import metrics
from .workqueue import backoff_s

log = logging.getLogger("mig_operator.loops")

Loop = Callable[[], Awaitable[object]]
BASE_DELAY_S = 0.5
MAX_DELAY_S = 30.0
HEALTHY_AFTER_S = 60.0


@dataclass
class LoopState:
    """What the liveness probe reads of one loop. A loop is failing from its first error until a run of it
    lasts ``healthy_after_s``."""

    name: str
    failing_since: float | None = None  # the first failure of the current run of failures
    running_since: float = 0.0  # when the current run of the loop started
    failures: int = 0
    last_error: str = ""


class Loops:
    """The supervised loops of one process (one per component), and whether they are all alive."""

    def __init__(self, component: str, stale_s: float = 300.0, healthy_after_s: float = HEALTHY_AFTER_S) -> None:
        self.component = component
        self.stale_s = stale_s
        self.healthy_after_s = healthy_after_s
        self.states: dict[str, LoopState] = {}

    def start(self, name: str, loop: Loop, *, base_delay_s: float = BASE_DELAY_S,
              max_delay_s: float = MAX_DELAY_S) -> asyncio.Task:
        """Run ``loop`` as a task that starts it again after each error or return, until cancelled."""
        state = self.states.setdefault(name, LoopState(name))
        return asyncio.create_task(
            supervised(self.component, name, loop, state, base_delay_s, max_delay_s, self.healthy_after_s), name=name)

    def unhealthy(self, now: float | None = None) -> list[str]:
        """The loops failing in a row for longer than ``stale_s``, each as ``name: last error``."""
        now = time.monotonic() if now is None else now
        return [f"{s.name}: {s.last_error}" for s in self.states.values()
                if s.failing_since is not None and now - s.failing_since > self.stale_s
                and now - s.running_since < self.healthy_after_s]


async def supervised(component: str, name: str, loop: Loop, state: LoopState | None = None,
                     base_delay_s: float = BASE_DELAY_S, max_delay_s: float = MAX_DELAY_S,
                     healthy_after_s: float = HEALTHY_AFTER_S) -> None:
    """Run ``loop`` for ever: after it raises (or returns) it runs again after a back-off."""
    state = state or LoopState(name)
    restarts = metrics.LOOP_RESTARTS.labels(component, name)
    while True:
        started = state.running_since = time.monotonic()
        try:
            await loop()
            error = "returned"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any error: the loop is started again, never left ended
            error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("%s loop %s failed, started again: %s", component, name, error, exc_info=state.failures == 0)
        ended = time.monotonic()
        if ended - started > healthy_after_s:
            state.failures, state.failing_since = 0, None
        state.failures += 1
        state.last_error = error
        if state.failing_since is None:
            state.failing_since = ended
        restarts.inc()
        await asyncio.sleep(backoff_s(state.failures, base_delay_s, max_delay_s))
