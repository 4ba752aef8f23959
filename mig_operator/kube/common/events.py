"""Kubernetes Events about slices and pods, posted in the background and never twice in a row.

A Pending slice is planned again whenever inventory changes; posting an Event each time would
flood the namespace, so an Event is posted only when its reason or message changes for that object.
Posting never blocks a handler and a failed post is only logged: Events are for people.

Events wait in one bounded line and a few senders post them, as client-go's broadcaster does: a
tenant's flood of objects, each worth an Event (thousands at a controller's start), costs at most
``PENDING_LIMIT`` small bodies in memory and ``SENDERS`` requests in flight; past the limit an Event
is dropped and counted (``mig_operator_events_dropped_total``), never queued without bound. The
senders are supervised loops (``supervise.Loops``): one that fails unexpectedly starts again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Mapping

from . import metrics
from .client import ApiError, KubeClient
from .status import now
from .supervise import Loops

log = logging.getLogger("mig_operator.events")
_MAX_REMEMBERED = 10000
SENDERS = 4  # Event posts in flight at once
PENDING_LIMIT = 1000  # Events waiting for a sender; a newer one is dropped past it


class EventPoster:
    def __init__(self, client: KubeClient, component: str, host: str = "", loops: Loops | None = None) -> None:
        self.client = client
        self.component = component
        self.host = host
        self.loops = loops or Loops(component)  # where its senders run (the part's, for its liveness)
        self._last: dict[str, tuple[str, str]] = {}
        self._pending: deque[dict] = deque()
        self._senders: list[asyncio.Task] = []
        self._wake = asyncio.Event()  # set while Events wait for a sender
        self._posting = 0  # posts in flight

    def post(self, obj: Mapping, kind: str, reason: str, message: str) -> None:
        """Post a ``Normal`` or ``Warning`` Event about ``obj`` unless it repeats the last one."""
        meta = obj["metadata"]
        key = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
        if self._last.get(key) == (reason, message):
            return
        if len(self._pending) >= PENDING_LIMIT:
            metrics.EVENTS_DROPPED.labels(self.component).inc()
            log.debug("event %s on %s/%s dropped: %d Events wait to be posted", reason, meta.get("namespace", ""),
                      meta.get("name"), len(self._pending))
            return
        if len(self._last) > _MAX_REMEMBERED:
            self._last.clear()
        self._last[key] = (reason, message)
        self._pending.append(self._body(obj, kind, reason, message))
        if not self._senders:  # started at the first Event: a running loop is needed
            self._senders = [self.loops.start(f"event-sender-{i}", self._send) for i in range(SENDERS)]
        self._wake.set()

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)

    def _body(self, obj: Mapping, kind: str, reason: str, message: str) -> dict:
        meta = obj["metadata"]
        when = now()
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": meta.get("namespace") or "default"},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": meta["name"],
                "namespace": meta.get("namespace", ""), "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "reason": reason[:128], "message": message[:1024], "type": kind,
            "source": {"component": self.component, "host": self.host},
            "reportingComponent": self.component, "reportingInstance": self.host or self.component,
            "firstTimestamp": when, "lastTimestamp": when, "count": 1,
        }

    async def _send(self) -> None:
        """One sender: post waiting Events as long as there are any, then wait for the next."""
        while True:
            while self._pending:
                body = self._pending.popleft()
                self._posting += 1
                try:
                    await self._post(body)
                finally:
                    self._posting -= 1
            self._wake.clear()  # no await since the line was found empty: nothing was added since
            await self._wake.wait()

    async def _post(self, body: dict) -> None:
        namespace = body["metadata"]["namespace"]
        try:
            await self.client.create(f"/api/v1/namespaces/{namespace}/events", body)
        except ApiError as exc:  # the client has retried what may pass; an Event is for people, not state
            log.info("event %s on %s/%s not posted: %s", body["reason"], namespace, body["involvedObject"]["name"],
                     exc)

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) for the Events waiting or in flight, then stop the senders (on shutdown)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while (self._pending or self._posting) and loop.time() < until:
            await asyncio.sleep(0.01)
        senders, self._senders = self._senders, []
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
