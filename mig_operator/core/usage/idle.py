"""Idle slices and idle pods.

A Ready slice is idle once no process has used it for the idle time (the agent's ``--idle-after``): its
condition ``Active`` is then False, reason ``NoProcess``, with ``lastTransitionTime`` the moment the idle
time began (its ``lastActive``, or when it became Ready if it never was active). A namespace's GpuQuota
may set ``spec.idlePodTimeout``: a pod whose every slice has been Active=False that long (counted from
that ``lastTransitionTime``) is evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from ..times import read_time, rfc3339
from .figures import SliceUsage

ACTIVE_CONDITION = "Active"
IDLE_REASON = "NoProcess"
ACTIVE_REASON = "Running"
MAX_CONDITION_MESSAGE = 32768


def short_duration(seconds: float) -> str:
    """``45s``, ``31m``, ``2h5m``, ``3d4h``: the two largest units, whole, rounded down."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    first = next((i for i, (n, _) in enumerate(parts) if n), len(parts) - 1)
    shown = [f"{n}{unit}" for n, unit in parts[first:first + 2] if n]
    return "".join(shown) or "0s"


def idle_since(usage: SliceUsage | None, ready_at: datetime) -> datetime:
    """When the slice's idle time began: the last time a process was seen on it, or ``ready_at`` when none
    was (nor since it became Ready)."""
    if usage is None or usage.last_active is None:
        return ready_at
    return max(usage.last_active, ready_at)


def active_condition(usage: SliceUsage | None, ready_at: datetime, now: datetime, idle_after_s: float,
                     previous: Mapping | None = None) -> dict:
    """The ``Active`` condition body: True (reason Running) while a process uses the slice or it has been
    idle for less than ``idle_after_s``; False (reason NoProcess) after, ``lastTransitionTime`` the moment
    the idle time began. ``previous`` (the Active condition written before) keeps a True's transition time."""
    since = idle_since(usage, ready_at)
    idle_s = (now - since).total_seconds()
    after = short_duration(idle_after_s)
    if usage is not None and usage.processes > 0:
        status, reason = "True", ACTIVE_REASON
        count = usage.processes
        message = f"{count} process{'es' if count != 1 else ''} using the slice"
    elif idle_s < idle_after_s:
        status, reason = "True", ACTIVE_REASON
        message = f"no process for {short_duration(idle_s)} (idle after {after})"
    else:
        return {"type": ACTIVE_CONDITION, "status": "False", "reason": IDLE_REASON,
                "lastTransitionTime": rfc3339(since),
                "message": f"no process for {short_duration(idle_s)} (idle after {after})"}
    same = isinstance(previous, Mapping) and previous.get("status") == status
    kept = read_time(previous.get("lastTransitionTime")) if same and previous is not None else None
    when = rfc3339(kept or now)
    return {"type": ACTIVE_CONDITION, "status": status, "reason": reason, "lastTransitionTime": when,
            "message": message[:MAX_CONDITION_MESSAGE]}


def active_of(conditions: object) -> Mapping | None:
    """The ``Active`` condition in a status's ``conditions``; None when there is none (or they are not a list)."""
    if not isinstance(conditions, list):
        return None
    return next((c for c in conditions if isinstance(c, Mapping) and c.get("type") == ACTIVE_CONDITION), None)


def inactive_since(condition: Mapping | None) -> datetime | None:
    """Since when an ``Active`` condition says the slice is idle: its ``lastTransitionTime`` while it is
    False; None when it is True, Unknown, absent or not well formed."""
    if not isinstance(condition, Mapping) or condition.get("status") != "False":
        return None
    return read_time(condition.get("lastTransitionTime"))


@dataclass(frozen=True)
class PodSlices:
    """A pod and the GpuSlices (names, in its namespace) it uses."""

    namespace: str
    name: str
    slices: tuple[str, ...]


def pod_idle_since(pod: PodSlices, conditions: Mapping[tuple[str, str], Mapping | None]) -> datetime | None:
    """Since when every slice of ``pod`` has been idle (the latest of their ``inactive_since``); None when it
    uses no slice, or one of them is not Active=False. ``conditions``: (namespace, slice) -> its Active
    condition."""
    if not pod.slices:
        return None
    times = [inactive_since(conditions.get((pod.namespace, name))) for name in pod.slices]
    if any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def idle_deadline(pod: PodSlices, conditions: Mapping[tuple[str, str], Mapping | None],
                  timeout_s: float) -> datetime | None:
    """When ``pod`` is to be evicted, all its slices staying idle: ``pod_idle_since`` plus ``timeout_s``."""
    since = pod_idle_since(pod, conditions)
    return None if since is None else since + timedelta(seconds=timeout_s)


def pods_to_evict(pods: Iterable[PodSlices], conditions: Mapping[tuple[str, str], Mapping | None],
                  timeouts: Mapping[str, float], now: datetime) -> list[PodSlices]:
    """The pods whose every slice has been Active=False for at least their namespace's idle-pod timeout
    (``timeouts``: namespace -> seconds; a namespace not in it evicts nothing), in the order given."""
    due = []
    for pod in pods:
        timeout = timeouts.get(pod.namespace)
        if timeout is None:
            continue
        deadline = idle_deadline(pod, conditions, timeout)
        if deadline is not None and deadline <= now:
            due.append(pod)
    return due
