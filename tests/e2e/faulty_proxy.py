"""A proxy between one process and the real kube-apiserver that fails some of its writes on purpose.

Everything is forwarded (watches stream through as the API server sends them) except, while
``faulty`` is set, a share (``rate``) of writes (POST, PUT, PATCH, DELETE), which are answered
instead with 500, 409 or 429 and a ``Status`` body as kube-apiserver writes them; the write never
reaches the API server. The proxy serves plain HTTP on 127.0.0.1 (the client's bearer token is
passed on unchanged) and speaks TLS to the API server, trusting its CA.

``kubeconfig(path)`` writes a kubeconfig that points a process at the proxy.
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Hop-by-hop and length headers aiohttp sets itself on either side (a body's encoding passes through as is).
_SKIP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


def status_body(code: int, method: str, path: str) -> dict[str, Any]:
    """The Status kube-apiserver answers a refused write with (reason and message as it words them)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    name = parts[-1] if method != "POST" and parts else ""
    resource = parts[-2] if method != "POST" and len(parts) > 1 else (parts[-1] if parts else "")
    if parts and parts[-1] == "status" and len(parts) > 2:
        name, resource = parts[-2], parts[-3]
    if code == 409 and method == "POST":
        reason, message = "AlreadyExists", f'{resource} "{name or "object"}" already exists'
    elif code == 409:
        reason, message = "Conflict", (f'Operation cannot be fulfilled on {resource} "{name}": the object has been '
                                       "modified; please apply your changes to the latest version and try again")
    elif code == 429:
        reason, message = "TooManyRequests", "Too many requests, please try again later."
    else:
        reason, message = "InternalError", "Internal error occurred: injected by the test's proxy"
    details: dict[str, Any] = {"name": name, "kind": resource}
    if code == 429:
        details["retryAfterSeconds"] = 1
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


class FaultyProxy:
    """Runs in a thread of its own (its own event loop) until ``close``."""

    def __init__(self, upstream: str, ca_file: str, rate: float = 0.3, seed: int = 37,
                 codes: tuple[int, ...] = (500, 409, 429), spare: tuple[str, ...] = ("kopfpeerings",)) -> None:
        self.upstream = upstream.rstrip("/")
        self.ca_file = ca_file
        self.rate = rate
        self.codes = codes
        self.spare = spare  # path parts whose writes are never failed (kopf's peering: not the controller's work)
        self.faulty = False
        self.injected: Counter[int] = Counter()
        self.forwarded_writes = 0
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._serve, name="faulty-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the faulty proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, token: str) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
            "users": [{"name": "proxy", "user": {"token": token}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
        }))
        return path

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        context = ssl.create_default_context(cafile=self.ca_file)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=64),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              auto_decompress=False)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    def _fail(self, request: web.Request) -> int | None:
        if not self.faulty or request.method not in WRITES or any(p in request.path for p in self.spare):
            return None
        if self._random.random() >= self.rate:
            return None
        return self._random.choice(self.codes)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        code = self._fail(request)
        if code is not None:
            self.injected[code] += 1
            headers = {"Retry-After": "1"} if code == 429 else {}
            return web.json_response(status_body(code, request.method, request.path_qs), status=code,
                                     headers=headers)
        if request.method in WRITES:
            self.forwarded_writes += 1
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _SKIP:
                    response.headers[key] = value
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ConnectionResetError, aiohttp.ClientError):
                return response  # the client went away (a watch it closed): nothing more to pass on
            await response.write_eof()
            return response

    def close(self) -> None:
        """Stop serving (stop its clients first: a watch still open is cut after a second)."""
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
