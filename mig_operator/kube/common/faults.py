"""Crash points: named places where a process kills itself, for the crash-recovery tests.

``MIG_OPERATOR_CRASHPOINT=agent:after-intent`` (a comma-separated list) makes the process SIGKILL
itself the first time it reaches that point, exactly as a node losing power or an OOM kill would
stop it there. Unset (always, outside those tests) a crash point is one set lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "MIG_OPERATOR_CRASHPOINT"
POINTS = frozenset({
    "controller:after-bind",  # status written (phase Bound); a hand-made slice has no agent finalizer yet
    "agent:after-intent",  # record says started and status says Creating; no NVML call yet
    "agent:during-reclaim",  # the first idle instance of the reclaim set destroyed, the rest not
    "agent:after-create",  # the instance exists; the record and status do not say so yet
    "agent:during-release",  # the record says idle; the finalizer is still on the slice
})
_armed = frozenset(p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip())
unknown = _armed - POINTS
if unknown:
    raise SystemExit(f"{ENV} names unknown crash point(s) {sorted(unknown)}; known: {sorted(POINTS)}")


def crashpoint(name: str) -> None:
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
