"""Starting a kopf operator the way every part of mig-operator does: credentials, settings, run.

Each part builds its own ``kopf.OperatorRegistry`` (no global handlers, so controller and agent
code can share a process in tests) and calls ``run_operator``. kopf logs in with the same
credentials as ``KubeClient``, so a part never talks to the API server as two identities.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import kopf

from . import metrics
from .client import LIST_PAGE, bearer_token, load_configuration
from .workqueue import backoff_s

log = logging.getLogger("mig_operator.events")

# A watch event handler: the object as its kind's transform kept it (a plain dict) and the event's
# type (None when the object was seen in the initial list, else ADDED, MODIFIED or DELETED).
EventFn = Callable[[dict[str, Any], str | None], Awaitable[None]]
# A kind's transform (kube/common/trim.py): what is kept of an object.
Keep = Callable[[Mapping[str, Any]], dict[str, Any]]
# How long kopf keeps an object's worker, and with it the object's last event, after its last event.
WORKER_IDLE_S = 0.1


def register_login(registry: kopf.OperatorRegistry, kubeconfig: str | None) -> None:
    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        config = load_configuration(kubeconfig)
        token = bearer_token(config)
        scheme, _, value = (token or "").partition(" ")
        return kopf.ConnectionInfo(
            server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
            scheme=scheme or None, token=value or None, certificate_path=config.cert_file,
            private_key_path=config.key_file, username=config.username or None,
            password=config.password or None,
        )


class NoDiffBase(kopf.DiffBaseStorage):
    """Keeps no essence of objects. kopf builds one (a deep copy of the body) on every watch event to
    detect changes for on.create/update/resume handlers and daemons; mig-operator registers none of
    those (only on.event, which gets every event as it is), so the copy was pure cost: about an
    eighth of the controller's CPU in a burst of pods (py-spy, bench/results/benchmark-history.md)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class RetryForever:
    """kopf's back-offs between tries of a failed API call: 0.5, 1, then 2 s for ever. Iterable but not
    sized, so kopf never reaches a last try; each call gets a fresh sequence."""

    FIRST = (0.5, 1.0)
    THEN_S = 2.0

    def __iter__(self) -> Iterator[float]:
        yield from self.FIRST
        yield from itertools.repeat(self.THEN_S)


def tune(settings: kopf.OperatorSettings, prefix: str) -> None:
    """The kopf settings every part shares: kopf's own finalizer, progress and diff-base storage under
    the part's prefix; a short wait for kopf's own writes to show on the watch (``consistency_timeout``,
    5 s by default, delays handlers after each of kopf's patches); no Events from log lines; short
    reconnect back-offs, and API calls retried for as long as kube-apiserver is away.

    kopf's own finalizer gets a name of its own: kopf removes its finalizer from every object no
    handler of its needs it for (none here: the parts manage their finalizers themselves), so sharing
    a name with the agent's finalizer would have kopf strip it as soon as it was added.
    """
    settings.persistence.finalizer = f"{prefix}/kopf"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.persistence.consistency_timeout = 1.0
    settings.execution.max_workers = 16
    settings.posting.enabled = False  # Events are posted by EventPoster, once per change
    # kopf's API calls (watches, peering) are retried for as long as kube-apiserver is away: kopf ends a
    # watcher, and with it the operator, once a finite list of back-offs runs out (an upgrade, a restart).
    settings.networking.error_backoffs = RetryForever()
    settings.watching.reconnect_backoff = 0.5
    settings.watching.server_timeout = 300
    # The resources are known at start (the CRDs are installed before the parts run): no watching of
    # CRDs and namespaces for changes at run time, so no grant to list them either.
    settings.scanning.disabled = True
    settings.watching.client_timeout = 330
    # Memory: the initial list in pages (kopf holds one page of whole objects at a time), and an idle
    # object's worker (which holds its last event's whole body) gone soon after the event.
    settings.watching.chunk_size = LIST_PAGE
    settings.queueing.idle_timeout = WORKER_IDLE_S


class KeptEvents:
    """Each object's kept events, handed to ``fn`` in order, one call at a time per object, objects
    concurrently. kopf runs an object's event handler while it holds the event's whole body; queued
    here, the kept body is all that waits for ``fn``, however far behind ``fn`` is (a flood of big
    objects, or the initial list of every object at a start).

    An event whose ``fn`` raises is never dropped: it is handed to ``fn`` again after a per-object
    back-off (the work queue's, 5 ms doubling up to 60 s), as the newest event of that object known by
    then (a newer event says at least as much of the object as the one that failed), and each retry is
    counted in ``mig_operator_reconcile_errors_total{part="watch",kind=<plural>}``."""

    def __init__(self, fn: EventFn, what: str) -> None:
        self.fn = fn
        self.what = what
        self.waiting: dict[str, deque[tuple[dict[str, Any], str | None]]] = {}
        self.tasks: set[asyncio.Task] = set()
        self.failed = metrics.RECONCILE_ERRORS.labels("watch", what)

    def put(self, key: str, body: dict[str, Any], type: str | None) -> None:
        queue = self.waiting.get(key)
        if queue is not None:
            queue.append((body, type))  # its task takes it after the events before it
            return
        self.waiting[key] = deque(((body, type),))
        task = asyncio.create_task(self._drain(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, key: str) -> None:
        queue = self.waiting[key]
        failures = 0
        try:
            while queue:
                body, type = queue[0]
                try:
                    await self.fn(body, type)
                except Exception as exc:  # tried again after a back-off, as the newest event known then
                    failures += 1
                    self.failed.inc()
                    delay = backoff_s(failures)
                    meta = body.get("metadata") or {}
                    log.warning("%s %s/%s: the event handler failed (%d in a row), tried again in %.3g s: %s",
                                self.what, meta.get("namespace", ""), meta.get("name", ""), failures, delay, exc,
                                exc_info=failures == 1)
                    await asyncio.sleep(delay)
                    newest = queue[-1]
                    queue.clear()
                    queue.append(newest)
                    continue
                failures = 0
                queue.popleft()
        finally:
            del self.waiting[key]  # no await since the queue was found empty: nothing was added since


def on_event(registry: kopf.OperatorRegistry, group: str, version: str, plural: str, fn: EventFn,
             keep: Keep) -> KeptEvents:
    """Call ``fn`` with every watch event of a resource (``group`` "" for the core group) through
    ``kopf.on.event`` (kopf lists, watches and pauses with its peering): ``keep(body)``, the fields its
    decisions read, never kopf's whole body; one object's events in order, objects concurrently
    (``KeptEvents``: kopf's handler returns as soon as the kept body is queued)."""
    events = KeptEvents(fn, plural)
    counted = metrics.WATCH_EVENTS.labels(plural)

    async def handler(body: kopf.Body, type: str | None, **_: Any) -> None:
        counted.inc()
        meta = body.get("metadata") or {}
        events.put(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}", keep(body), type)

    where = (group, version, plural) if group else (version, plural)  # "" is the core group
    kopf.on.event(*where, registry=registry)(handler)
    return events


def run_operator(registry: kopf.OperatorRegistry, *, standalone: bool, priority: int = 0,
                 peering_name: str | None = None) -> None:
    """Run kopf in this thread until it stops (SIGTERM/SIGINT) or fails."""
    logging.getLogger("kopf.activities.startup").setLevel(logging.WARNING)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(kopf.operator(
            registry=registry, standalone=standalone, priority=priority, peering_name=peering_name,
            clusterwide=True, identity=own_identity(),
        ))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency, wherever it has a build): its loop, TLS
    and sockets take less CPU per API call and watch line than asyncio's (bench/results/benchmark-history.md).
    None (asyncio's own loop) where it is not."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def own_identity() -> str:
    """This process's name among the peers. kopf's default asks the passwd file for the user's name,
    which fails for a uid the image has no entry for (the chart's 65532, an OpenShift random uid)."""
    return f"{socket.gethostname()}/{os.getpid()}"
