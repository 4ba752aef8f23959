"""The controller's watch events, from kopf's watch stream straight to their handlers.

kopf watches each resource (its list, watch, reconnects and pauses with its peering are kept) and,
for every event, feeds a per-object queue served by a per-object worker that runs its processor:
cause detection, progress storage, object loggers and handler bookkeeping. The controller's handlers
(``operator.on_event``) need none of that, and in a burst of pods kopf's dispatch was a sixth of the
controller's CPU after its processing was bypassed (docs/benchmarks.md). ``watcher`` keeps what
matters of kopf's: one object's events are handled one at a time, in order; other objects' are
handled concurrently. It costs one task per object while the object has events waiting, and no
timer or queue per event.

It replaces ``kopf._core.reactor.queueing.watcher`` for the resources that ``on_event`` registered,
and only where kopf is the version it was written against (1.45); everything else (kopf's peering
watch, other handlers) goes through kopf's own watcher.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("mig_operator.events")

# A watch event handler: the object as the watch gave it (a plain dict) and the event's type (None
# when the object was seen in the initial list, else ADDED, MODIFIED or DELETED).
EventFn = Callable[[dict[str, Any], str | None], Awaitable[None]]
HANDLERS = "_mig_operator_direct"  # a registry's attribute: {(group, plural): EventFn}
_PATCHED = "_mig_operator_direct"  # marks the watcher installed here


class ObjectQueues:
    """Each object's events in order, one handler call at a time per object, objects concurrently."""

    def __init__(self, fn: EventFn, what: str) -> None:
        self.fn = fn
        self.what = what
        self.waiting: dict[str, deque[dict[str, Any]]] = {}
        self.tasks: set[asyncio.Task] = set()

    def put(self, key: str, event: dict[str, Any]) -> None:
        queue = self.waiting.get(key)
        if queue is not None:
            queue.append(event)  # its task takes it after the events before it
            return
        self.waiting[key] = deque((event,))
        task = asyncio.create_task(self._drain(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, key: str) -> None:
        queue = self.waiting[key]
        try:
            while queue:
                event = queue.popleft()
                body = event["object"]
                try:
                    await self.fn(body, event.get("type"))
                except Exception:  # as kopf does for an on.event handler: logged, the next event comes anyway
                    meta = body.get("metadata") or {}
                    log.exception("%s %s/%s: the event handler failed", self.what, meta.get("namespace", ""),
                                  meta.get("name", ""))
        finally:
            del self.waiting[key]  # no await since the queue was found empty: nothing was added since

    async def close(self, timeout_s: float) -> None:
        """Let the handlers under way finish (at most ``timeout_s``), then cancel what is left."""
        if self.tasks:
            _done, left = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in left:
                task.cancel()


def install() -> bool:
    """Serve ``on_event`` resources with ``watcher``; False where kopf's watcher is not the one this
    was written against (then kopf's own processing runs the handlers, as ``kopf.on.event``)."""
    try:
        from kopf._cogs.clients import watching
        from kopf._core.reactor import queueing
    except ImportError:
        return False
    kopf_watcher = queueing.watcher
    if getattr(kopf_watcher, _PATCHED, False):
        return True
    if not all(hasattr(watching, name) for name in ("infinite_watch", "Bookmark")) or not hasattr(queueing,
                                                                                                    "get_uid"):
        return False

    @functools.wraps(kopf_watcher)
    async def watcher(*, settings: Any, resource: Any, processor: Any, namespace: Any = None,
                      operator_paused: Any = None, **kwargs: Any) -> None:
        registry = (getattr(processor, "keywords", None) or {}).get("registry")
        fn = (getattr(registry, HANDLERS, None) or {}).get((resource.group, resource.plural))
        if fn is None:
            await kopf_watcher(settings=settings, resource=resource, processor=processor, namespace=namespace,
                               operator_paused=operator_paused, **kwargs)
            return
        queues = ObjectQueues(fn, resource.plural)
        try:
            async for event in watching.infinite_watch(settings=settings, resource=resource, namespace=namespace,
                                                       operator_paused=operator_paused):
                if isinstance(event, watching.Bookmark) or event.get("type") == "BOOKMARK":
                    continue  # the end of the initial list, or a resourceVersion only
                queues.put(queueing.get_uid(event), event)
        finally:
            await asyncio.shield(queues.close(settings.queueing.exit_timeout))

    setattr(watcher, _PATCHED, True)
    queueing.watcher = watcher
    return True
