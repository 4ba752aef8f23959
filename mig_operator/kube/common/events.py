"""Kubernetes Events about slices and pods, posted in the background and never twice in a row.

A Pending slice is planned again whenever inventory changes; posting an Event each time would
flood the namespace, so an Event is posted only when its reason or message changes for that object.
Posting never blocks a handler and a failed post is only logged: Events are for people.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping

from .client import ApiError, KubeClient
from .status import now

log = logging.getLogger("mig_operator.events")
_MAX_REMEMBERED = 10000


class EventPoster:
    def __init__(self, client: KubeClient, component: str, host: str = "") -> None:
        self.client = client
        self.component = component
        self.host = host
        self._last: dict[str, tuple[str, str]] = {}
        self._tasks: set[asyncio.Task] = set()

    def post(self, obj: Mapping, kind: str, reason: str, message: str) -> None:
        """Post a ``Normal`` or ``Warning`` Event about ``obj`` unless it repeats the last one."""
        meta = obj["metadata"]
        key = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
        if self._last.get(key) == (reason, message):
            return
        if len(self._last) > _MAX_REMEMBERED:
            self._last.clear()
        self._last[key] = (reason, message)
        task = asyncio.create_task(self._post(obj, kind, reason, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)

    async def _post(self, obj: Mapping, kind: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        namespace = meta.get("namespace") or "default"
        when = now()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
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
        try:
            await self.client.create(f"/api/v1/namespaces/{namespace}/events", body)
        except ApiError as exc:
            log.info("event %s on %s/%s not posted: %s", reason, namespace, meta["name"], exc)

    async def drain(self) -> None:
        """Wait for the Events in flight (on shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
