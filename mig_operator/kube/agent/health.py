"""Each GPU's health as the agent watches it (``core.node.health``): read from the backend every
``health_poll_s`` (NVML's Xid events drained without waiting, and whether the GPU answers), published on
the GpuNode (``gpus[].conditions``, type ``Healthy``) with an Event when it changes, and on each Ready
slice realised on the GPU (condition ``DeviceHealthy``). An admin's clear mark on the Node (``NodeWatch``)
makes the backend forget the Xids seen until its time (``core.node.health.xids_to_clear``). The kubelet
plugin's health stream waits on ``next_change``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime

from mig_operator.core.node.health import (
    DEVICE_HEALTHY_CONDITION,
    HEALTHY,
    HEALTHY_CONDITION,
    GpuHealth,
    condition,
    xids_to_clear,
)
from mig_operator.gpu.protocol import GpuError

from ..common import status
from ..common.client import ApiError, KubeClient, slice_path
from .gpus import Gpus
from .record import RecordStore

log = logging.getLogger("mig_operator.agent")

UNHEALTHY_EVENT = "GpuUnhealthy"
HEALTHY_EVENT = "GpuHealthy"


class HealthWatch:
    """The node's GPUs' health, the Events still to post about it, and the ``DeviceHealthy`` status each
    Ready slice shows (as its last event or this agent's last write says)."""

    def __init__(self, gpus: Gpus, store: RecordStore, client: KubeClient) -> None:
        self.gpus = gpus
        self.store = store
        self.client = client
        self.health: dict[int, GpuHealth] = {}
        self.since: dict[int, str] = {}  # when each GPU's Healthy status last changed
        self.seen: dict[int, str] = {}  # when each GPU's current reading (its reason) was first seen
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message) to post on the GpuNode
        self.shown: dict[str, bool] = {}  # slice UID -> the DeviceHealthy status its status carries
        self._changed = asyncio.Event()  # set and replaced at each change: every waiter wakes once

    async def next_change(self) -> None:
        """Returns once a GPU's health (or its message) changes."""
        await self._changed.wait()

    def of(self, gpu: int) -> GpuHealth:
        return self.health.get(gpu, HEALTHY)

    def conditions(self) -> dict[int, list[dict[str, str]]]:
        """Each GPU's ``conditions`` for its GpuNode entry."""
        now = status.seconds_now()
        return {gpu.index: [condition(HEALTHY_CONDITION, self.of(gpu.index), self.since.get(gpu.index, now))]
                for gpu in self.gpus.all}

    def saw_slice(self, uid: str, body: Mapping) -> None:
        """A slice's event: the DeviceHealthy status it carries (none: nothing to take back)."""
        found = next((c for c in (body.get("status") or {}).get("conditions") or ()
                      if c.get("type") == DEVICE_HEALTHY_CONDITION), None)
        if found is None:
            self.shown.pop(uid, None)
        else:
            self.shown[uid] = found.get("status") == "True"

    def forget(self, uid: str) -> None:
        """The slice is gone: nothing of it is shown any more."""
        self.shown.pop(uid, None)

    async def poll(self, cleared: datetime | None = None) -> bool:
        """Read every GPU's health once; True when one changed: the caller publishes the GpuNode again (an
        Event waits for that write). Nothing is published from here: during the agent's start a publish
        would run before the node's label and the slices were read (``serves: none``, Ready slices unknown
        to the MPS keeper). ``cleared``: the admin's clear mark; the Xids seen until then are forgotten first."""
        if cleared is not None:
            await self._clear(cleared)
        changed = False
        for gpu in self.gpus.all:
            try:
                now = await self.gpus.call("health", self.gpus.backend.health, gpu.index)
            except GpuError as exc:
                log.warning("cannot read the health of GPU %s: %s", gpu.index, exc)
                continue
            before = self.health.get(gpu.index)
            if now == before:
                continue
            self.health[gpu.index] = now
            self.seen[gpu.index] = status.seconds_now()
            changed = True
            if before is None or before.healthy != now.healthy:
                self.since[gpu.index] = status.seconds_now()
            if before is None and now.healthy:
                continue  # the first reading of a healthy GPU is no news
            if now.healthy:
                log.info("GPU %s is healthy again", gpu.index)
                self.events.append(("Normal", HEALTHY_EVENT, f"GPU {gpu.index} ({gpu.uuid}) is healthy again"))
            else:
                log.warning("GPU %s is unhealthy: %s", gpu.index, now.message)
                self.events.append(("Warning", UNHEALTHY_EVENT, f"{now.message} ({gpu.uuid})"))
        if changed:
            self._changed.set()
            self._changed = asyncio.Event()
        return changed

    async def _clear(self, cleared: datetime) -> None:
        for index in xids_to_clear(self.health, self.seen, cleared):
            try:
                await self.gpus.call("clear_xid", self.gpus.backend.clear_xid, index)
            except GpuError as exc:
                log.warning("cannot clear the Xid of GPU %s: %s", index, exc)
                continue
            log.info("GPU %s: %s cleared by the node's clear mark (%s)", index, self.of(index).reason,
                     cleared.isoformat())

    def slices_to_mark(self, ready: set[str]) -> list[tuple[str, str, GpuHealth]]:
        """The Ready slices whose ``DeviceHealthy`` must be written: (UID, namespace/name, health) for each
        slice on an unhealthy GPU not shown False, and each on a healthy GPU still shown False."""
        marks = []
        for entry in self.store.record.owners.values():
            if entry.uid not in ready:
                continue
            health = self.of(entry.gpu)
            shown = self.shown.get(entry.uid)
            if (not health.healthy and shown is not False) or (health.healthy and shown is False):
                marks.append((entry.uid, entry.slice, health))
        return marks

    async def mark(self, uid: str, ref: str, health: GpuHealth,
                   write: Callable[[Mapping, dict], Awaitable[None]]) -> None:
        """Write one slice's ``DeviceHealthy`` through ``write`` (the realiser's status write)."""
        namespace, _, name = ref.partition("/")
        try:
            body = await self.client.get(slice_path(namespace, name))
            if body["metadata"]["uid"] != uid:
                return
            await write(body, status.device_healthy(body.get("status"), health))
        except ApiError as exc:
            log.warning("cannot write DeviceHealthy on slice %s: %s", ref, exc)
            return
        self.shown[uid] = health.healthy
