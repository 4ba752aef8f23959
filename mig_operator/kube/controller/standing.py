"""Whether this controller replica acts: its work queue runs only while it does.

kopf's peering pauses a replica's watches when a peer of a higher priority is live, but not the work
this replica's queue already holds (a retry, a requeue, the line's pass), and two replicas started in
the same moment both act until each has seen the other's entry. This loop reads the ClusterKopfPeering
once a second and keeps the queue paused unless ``core.leadership`` says this replica acts. An API
server that cannot be read leaves the queue as it was: nothing is written meanwhile anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mig_operator.core.leadership import Settling, read_standing

from ..common.client import ApiError, KubeClient
from ..common.workqueue import WorkQueue

log = logging.getLogger("mig_operator.controller")
READ_EVERY_S = 1.0
PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"


class Standing:
    def __init__(self, client: KubeClient, queue: WorkQueue, peering: str, own_id: str, priority: int,
                 every_s: float = READ_EVERY_S) -> None:
        self.client = client
        self.queue = queue
        self.peering = peering
        self.own_id = own_id
        self.priority = priority
        self.every_s = every_s
        self.settling = Settling()
        self._said = ""  # the last read's error, said once
        queue.pause()  # until this replica is seen to act

    async def run(self) -> None:
        """Read the peering once every ``every_s`` for ever (a supervised loop)."""
        while True:
            try:
                # A list of the one object: the verbs kopf's peering needs (list, watch, patch) are enough.
                found = await self.client.list(PEERINGS, field_selector=f"metadata.name={self.peering}")
            except ApiError as exc:
                if str(exc) != self._said:
                    log.warning("the peering %s cannot be read (%s): this replica's work queue stays %s",
                                self.peering, exc, "paused" if self.queue.paused else "running")
                self._said = str(exc)
            else:
                self._said = ""
                self.take(found[0].get("status") if found else None, time.time())
            await asyncio.sleep(self.every_s)

    def take(self, status: object, now: float) -> None:
        acts = self.settling.acts(read_standing(status, self.own_id, self.priority, now), now)
        if acts and self.queue.paused:
            log.info("this replica acts: its work queue runs")
            self.queue.resume()
        elif not acts and not self.queue.paused:
            log.info("another replica acts: this one's work queue waits")
            self.queue.pause()
