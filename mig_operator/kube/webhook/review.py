"""Serving the admission reviews the configuration sends: each straight to its handler.

kopf's admission engine would run every review through its handler machinery (a cause, a worker thread
for the handler, a patch found by diffing the whole pod with jsonpatch), on the path of every annotated
pod's creation. Here a review is decoded with orjson, the handler its URL path names checks the pod and
returns its change, and the patch is what that change did (``json_patch``). kopf runs the process
(log-in, start-up, signals), not the reviews.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import os
import re
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web

from ..common import wire
from ..common.supervise import Loops

log = logging.getLogger("mig_operator.webhook")

# The API server takes a request body of up to 3 MiB; the review it sends holds the object encoded
# again as JSON with its defaults added (and Go's encoder writes <, > and & as six bytes each), so the
# webhook reads reviews of up to four times that, and answers a larger one with a refusal saying why.
API_SERVER_BODY_BYTES = 3 * 2**20
MAX_REVIEW_BYTES = 4 * API_SERVER_BODY_BYTES
_HEAD_BYTES = 64 * 1024  # what is kept of a review too large to read: its uid comes first
_REVIEW_UID = re.compile(rb'"request"\s*:\s*\{\s*"uid"\s*:\s*"([^"\\]{1,128})"')
_CHUNK = 256 * 1024
SERVER_LOOP = "webhook-server"  # the server's name among the process's supervised loops

# What a handler returns for a pod it serves: the change, made to a copy of the pod.
Mutation = Callable[[dict[str, Any]], None]
# A handler: the pod being created (the review's object) to its change, None when it asks for nothing
# this handler serves; raises Refused to turn the pod down.
Handler = Callable[[dict[str, Any]], Mutation | None]


class Refused(Exception):
    """The pod is turned down: the API server answers its creator with ``code`` and the message."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def _pointer(path: tuple[str, ...]) -> str:
    # RFC 6901: "~" and "/" in a key (a label such as cdmo.io/gpu-slice) are escaped, "~" first.
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in path)


def json_patch(before: Any, after: Any, path: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """RFC 6902 operations that turn ``before`` into ``after``: objects key by key, lists of the same
    length item by item, anything else (a list that grew or shrank, a value) replaced whole."""
    if isinstance(before, dict) and isinstance(after, dict):
        ops: list[dict[str, Any]] = []
        for key in before:
            if key not in after:
                ops.append({"op": "remove", "path": _pointer((*path, key))})
        for key, value in after.items():
            if key not in before:
                ops.append({"op": "add", "path": _pointer((*path, key)), "value": value})
            else:
                ops.extend(json_patch(before[key], value, (*path, key)))
        return ops
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [op for i, (old, new) in enumerate(zip(before, after, strict=True))
                for op in json_patch(old, new, (*path, str(i)))]
    if type(before) is type(after) and before == after:  # True == 1 in Python, not in JSON
        return []
    return [{"op": "replace", "path": _pointer(path), "value": after}]


def _pod_ref(request: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    namespace = request.get("namespace") or meta.get("namespace") or "?"
    return f"{namespace}/{meta.get('name') or request.get('name') or '(name not yet generated)'}"


def review_response(review: Mapping[str, Any], handler: Handler | None) -> dict[str, Any]:
    """The AdmissionReview answering ``review`` (admission.k8s.io/v1) with ``handler`` (None: the path
    names none, so the pod passes unchanged). Only a pod's CREATE is served, as the configuration asks."""
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    pod = request.get("object")
    if handler is not None and request.get("operation") == "CREATE" and isinstance(pod, dict):
        try:
            change = handler(pod)
        except Refused as exc:
            # The user's request turned down, not an operator error: one INFO line.
            log.info("pod %s refused at admission: %s", _pod_ref(request, pod), exc)
            response.update(allowed=False, status={"code": exc.code, "message": str(exc)})
        except Exception as exc:
            log.exception("pod %s: the admission handler failed", _pod_ref(request, pod))
            response.update(allowed=False, status={"code": 500, "message": f"mig-operator's webhook failed: {exc!r}"})
        else:
            if change is not None:
                after = copy.deepcopy(pod)
                change(after)
                ops = json_patch(pod, after)
                if ops:
                    response.update(patchType="JSONPatch", patch=base64.b64encode(wire.dumps(ops)).decode("ascii"))
    return {"apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
            "kind": review.get("kind", "AdmissionReview"), "response": response}


def too_large_response(head: bytes, size: int) -> dict[str, Any] | None:
    """The answer to a review of ``size`` bytes, more than MAX_REVIEW_BYTES, of which ``head`` was kept:
    the pod refused with a message that says why; None when ``head`` holds no review uid to answer."""
    found = _REVIEW_UID.search(head)
    if found is None:
        return None
    message = (
        f"the pod is too large for mig-operator's webhook: the API server sent it for admission as "
        f"{size} bytes, and the webhook reads at most {MAX_REVIEW_BYTES} ({MAX_REVIEW_BYTES // 2**20} MiB, four "
        f"times the {API_SERVER_BODY_BYTES // 2**20} MiB the API server takes in a request); make the pod smaller, "
        f"e.g. move large annotations, environment values or command lines into a ConfigMap"
    )
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": found.group(1).decode("ascii", "replace"), "allowed": False,
                         "status": {"code": 413, "message": message}}}


class ReviewServer:
    """HTTPS on a socket bound beforehand (``server.bind``: a taken port is a start-up error, and a
    second process never shares it), POST /<handler id> per review. The server starts again with the
    certificate files when they change (cert-manager renewals); it runs as a supervised loop
    (``start``), so a failure (say, certificate files that cannot be read yet) starts it again after a
    back-off, and ``readiness`` names what keeps it from serving."""

    def __init__(self, sock: socket.socket, certfile: str, keyfile: str, handlers: Mapping[str, Handler],
                 file_check_interval: float = 60.0, loops: Loops | None = None) -> None:
        self.sock = sock
        self.certfile, self.keyfile = certfile, keyfile
        self.handlers = dict(handlers)
        self.file_check_interval = file_check_interval
        self.loops = loops or Loops("webhook")
        self.serving = False  # True while a site serves with a loaded certificate

    def start(self, base_delay_s: float = 0.5, max_delay_s: float = 30.0) -> asyncio.Task:
        """Serve until the task is cancelled, started again after each failure."""
        return self.loops.start(SERVER_LOOP, self.run, base_delay_s=base_delay_s, max_delay_s=max_delay_s)

    def readiness(self) -> list[str]:
        """Nothing while it serves; else why not (not started, or its last failure)."""
        if self.serving:
            return []
        state = self.loops.states.get(SERVER_LOOP)
        why = state.last_error if state is not None and state.last_error else "not serving yet"
        return [f"the webhook server does not serve on {self.sock.getsockname()}: {why}"]

    async def _serve(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        # Read here, not by request.read(), whose limit (aiohttp's client_max_size, 1 MiB) would answer
        # HTTP 413, which the API server reports to the pod's creator as an unexplained internal error.
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.read(_CHUNK):
            size += len(chunk)
            if size <= MAX_REVIEW_BYTES:  # beyond, only the head (the first chunks) is needed
                chunks.append(chunk)
        body = b"".join(chunks)
        if size > MAX_REVIEW_BYTES:
            log.info("an admission review of %d bytes refused: more than %d", size, MAX_REVIEW_BYTES)
            answer = too_large_response(body[:_HEAD_BYTES], size)
            if answer is None:
                return aiohttp.web.Response(status=413, text=f"an admission review of at most {MAX_REVIEW_BYTES} "
                                                             f"bytes is read; this one has {size}")
            return aiohttp.web.Response(body=wire.dumps(answer), content_type="application/json")
        try:
            review = wire.loads(body)
        except ValueError as exc:
            return aiohttp.web.Response(status=400, text=f"not an AdmissionReview in JSON: {exc}")
        if not isinstance(review, dict):
            return aiohttp.web.Response(status=400, text="not an AdmissionReview: a JSON object is expected")
        answer = review_response(review, self.handlers.get(request.match_info["id"]))
        return aiohttp.web.Response(body=wire.dumps(answer), content_type="application/json")

    def _files_stamp(self) -> tuple[tuple[float, int], ...]:
        stamps = []
        for path in (self.certfile, self.keyfile):
            try:
                st = os.stat(path)
                stamps.append((st.st_mtime, st.st_size))
            except OSError:
                stamps.append((0.0, -1))
        return tuple(stamps)

    async def run(self) -> None:
        """Serve until cancelled, with the certificate files as they are, again each time they change; a
        failure raises (``start`` runs it again)."""
        while True:
            stamp = self._files_stamp()
            runner: aiohttp.web.AppRunner | None = None
            try:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                try:
                    context.load_cert_chain(self.certfile, self.keyfile)
                except (OSError, ssl.SSLError) as exc:
                    raise OSError(f"certificate {self.certfile} with key {self.keyfile} cannot be loaded: "
                                  f"{exc}") from exc
                app = aiohttp.web.Application()
                app.add_routes([aiohttp.web.post("/{id:.*}", self._serve)])
                runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
                await runner.setup()
                # A duplicate: stopping the site closes the socket it was given, and ours must stay
                # bound across certificate renewals so that no other process can take the port.
                await aiohttp.web.SockSite(runner, self.sock.dup(), ssl_context=context).start()
                self.serving = True
                while self._files_stamp() == stamp:
                    await asyncio.sleep(self.file_check_interval)
                log.info("webhook certificate files changed: serving the new ones")
            finally:
                self.serving = False
                if runner is not None:
                    await runner.cleanup()
