"""Health probes as controller-runtime serves them: unauthenticated ``GET /healthz`` (liveness) and
``GET /readyz`` (readiness) on a port of their own (``--health-address``), each answering 200 ``ok``, or
500 with one problem a line.

A check is a callable returning the problems it sees (empty: none). The server runs in a thread on a
socket bound before the part starts, so it answers from the first moment; the checks run on the part's
event loop once it is known (``Probes.attach``), so they read its state as the loop's own code does, and
a loop that does not run them within ``loop_timeout_s`` is itself a liveness problem: a wedged process is
restarted by the kubelet. Before ``attach`` the part is starting: live, not ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf

from .listen import listen

log = logging.getLogger("mig_operator.probes")

Check = Callable[[], list[str]]
LIVE, READY = "/healthz", "/readyz"
LOOP_TIMEOUT_S = 5.0
# kopf's tasks that run as long as the operator does (kopf/_core/reactor/running.py): one that has ended
# means the operator has stopped watching (its watchers gave up) or is stopping.
KOPF_ROOT_TASKS = ("multidimensional multitasker", "startup/cleanup activities", "stop-flag checker")


class Probes:
    """The liveness and readiness checks of one process."""

    def __init__(self, loop_timeout_s: float = LOOP_TIMEOUT_S) -> None:
        self.loop_timeout_s = loop_timeout_s
        self.checks: dict[str, list[Check]] = {LIVE: [], READY: []}
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, live: Check | None = None, ready: Check | None = None) -> None:
        if live is not None:
            self.checks[LIVE].append(live)
        if ready is not None:
            self.checks[READY].append(ready)

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run the checks on ``loop`` (the running one by default) from now on."""
        self._loop = loop or asyncio.get_running_loop()

    def problems(self, path: str) -> list[str]:
        """The problems of ``path`` (LIVE or READY), asked from any thread but the loop's."""
        loop = self._loop
        if loop is None:
            return [] if path == LIVE else ["starting: the event loop is not running yet"]
        answer: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(lambda: answer.set_result(self.run(path)))
        except RuntimeError:  # the loop is closed: the process is ending
            return ["the event loop has stopped"]
        try:
            return answer.result(self.loop_timeout_s)
        except concurrent.futures.TimeoutError:
            return [f"the event loop did not run the checks within {self.loop_timeout_s:g} s"]

    def run(self, path: str) -> list[str]:
        """Every check of ``path``, here and now; a check that raises is a problem of its own."""
        found: list[str] = []
        for check in self.checks[path]:
            try:
                found.extend(check())
            except Exception as exc:  # a broken check says so rather than hiding the others
                found.append(f"{getattr(check, '__name__', 'check')} failed: {type(exc).__name__}: {exc}")
        return found


def tasks_alive(names: Iterable[str] = KOPF_ROOT_TASKS) -> Check:
    """A liveness check of the running loop's tasks named ``names`` as they are now (call it from the loop,
    e.g. in a start-up handler): each of them that ends later is a problem."""
    wanted = set(names)
    tasks = [t for t in asyncio.all_tasks() if t.get_name() in wanted]

    def alive() -> list[str]:
        return [f"{t.get_name()} has ended" for t in tasks if t.done()]

    return alive


def watch_operator(registry: kopf.OperatorRegistry, probes: Probes) -> None:
    """Run ``probes`` on the operator's loop from its start, with kopf's own tasks alive as a liveness check
    (a start-up handler of ``registry``; kopf runs start-up handlers together, so it waits for no other)."""

    @kopf.on.startup(registry=registry)
    async def probes_attach(**_: Any) -> None:
        probes.add(live=tasks_alive())
        probes.attach()


class _Handler(BaseHTTPRequestHandler):
    server: _ProbeServer

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        path = self.path.split("?", 1)[0]
        if path not in (LIVE, READY):
            self._answer(404, f"not found: {path[:100]}; ask {LIVE} or {READY}\n")
            return
        found = self.server.probes.problems(path)
        if found:
            self._answer(500, "".join(f"{problem}\n" for problem in found))
        else:
            self._answer(200, "ok")

    def _answer(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """A probe every few seconds is not worth a line each."""


class _ProbeServer(ThreadingHTTPServer):
    """Serves on a socket bound beforehand (``bind``), so it neither binds nor shares a port itself."""

    daemon_threads = True

    def __init__(self, sock: socket.socket, probes: Probes) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made; ours is already bound and listening
        self.socket = sock
        self.address_family = sock.family
        self.server_address = sock.getsockname()[:2]
        self.probes = probes


def bind(address: str) -> socket.socket:
    """The probes' socket, bound and listening; a port in use or an address not of this host raises
    ListenError (one line at start, before kopf runs)."""
    return listen("--health-address", address, ":8081")


def serve(sock: socket.socket, probes: Probes) -> ThreadingHTTPServer:
    """Serve ``probes`` on ``sock`` (from ``bind``) in a background thread; ``shutdown()`` stops it."""
    server = _ProbeServer(sock, probes)
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
