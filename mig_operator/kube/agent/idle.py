"""The idle time-out (``--idle-timeout``): idle instances idle for longer are destroyed, never one in
use. Without it an idle instance stays until its space is needed for another profile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from mig_operator.core.node.lifecycle import idle_instances
from mig_operator.gpu.protocol import GpuError

from ..common.client import ApiError
from .gpus import Gpus, describe_instance
from .inventory import instance_state
from .record import RecordStore

log = logging.getLogger("mig_operator.agent")


class IdleReaper:
    def __init__(self, node: str, timeout_s: float, gpus: Gpus, store: RecordStore,
                 changed: Callable[[], None]) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.gpus = gpus
        self.store = store
        self.changed = changed  # told when instances were destroyed (the GpuNode says so)

    async def run(self) -> None:
        period = max(0.5, min(30.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap_once()
            except (GpuError, ApiError, OSError) as exc:
                log.warning("idle time-out pass failed: %s", exc)

    async def reap_once(self) -> int:
        """Destroy idle instances idle for longer than the time-out; never one in use. Returns how many."""
        limit = datetime.now(UTC) - timedelta(seconds=self.timeout_s)
        destroyed = 0
        for gpu in self.gpus.all:
            if not gpu.mig_enabled:
                continue
            async with self.gpus.lock(gpu.index):
                insts = [instance_state(i) for i in await self.gpus.instances(gpu)]
                for inst in idle_instances(self.store.record, gpu.index, insts):
                    since = self.store.record.idle_since.get(inst.device_uuid)
                    if inst.in_use or not since or _parse_time(since) > limit:
                        continue
                    await self.gpus.call("destroy_instance", self.gpus.backend.destroy_instance, gpu.index,
                                         inst.gi_id)
                    log.info("reclaimed idle %s (%s): idle since %s, longer than the idle time-out",
                             describe_instance(self.node, gpu.index, inst), inst.device_uuid, since)
                    await asyncio.to_thread(self.store.update, lambda r, u=inst.device_uuid: replace(
                        r, idle_since={k: v for k, v in r.idle_since.items() if k != u}))
                    destroyed += 1
        if destroyed:
            log.info("idle time-out destroyed %d instance(s)", destroyed)
            self.changed()
        return destroyed


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
