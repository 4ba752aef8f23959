"""Who may read ``/metrics``: authentication and authorization as controller-runtime's metrics server does
it (``filters.WithAuthenticationAndAuthorization``).

The caller's bearer token is checked with a TokenReview (``authentication.k8s.io/v1``), then the user it
names is asked about with a SubjectAccessReview (``authorization.k8s.io/v1``) for verb ``get`` on the
non-resource URL ``/metrics``. No token or one the API server does not know: 401; a user not allowed:
403; allowed: the metrics. When the API server cannot be asked, 503 (or 500 when it refused the part
itself, e.g. its ServiceAccount lacks ``create`` on the reviews): never the metrics.

The metrics server runs in a thread of its own, so the reviews are asked with a small synchronous
client on the part's own credentials (``load_configuration``), not through the part's asynchronous
``KubeClient``: a scrape then needs nothing from the part's event loop (it still answers while the loop
is busy or wedged, when metrics matter most), and is asked once, with a short time-out, instead of
being retried for seconds as the part's own writes are.

Verdicts are kept ``VERDICT_TTL_S`` per token (a hash of it), at most ``VERDICT_CACHE_SIZE`` of them,
so a scrape every few seconds costs the API server two reviews per ``VERDICT_TTL_S``; failures are not
kept. At most ``REVIEWS_IN_FLIGHT`` reviews are asked at once, however many callers come.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .client import bearer_token, ssl_context

if TYPE_CHECKING:
    import kubernetes

log = logging.getLogger("mig_operator.metrics")

METRICS_PATH = "/metrics"
VERDICT_TTL_S = 10.0
VERDICT_CACHE_SIZE = 1024
REVIEWS_IN_FLIGHT = 4
REVIEW_TIMEOUT_S = 5.0
# A Kubernetes ServiceAccount token is about 1 KiB; OIDC tokens with many groups reach a few KiB.
MAX_TOKEN_CHARS = 16 * 1024
_TRANSIENT = frozenset({0, 429, 500, 502, 503, 504})


def bearer_from_header(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None when there is none usable: no
    header, another scheme, an empty token, one over ``MAX_TOKEN_CHARS``, or one with a character that is
    not visible ASCII (spaces, controls, non-ASCII: no token Kubernetes issues has them)."""
    if not value or len(value) > MAX_TOKEN_CHARS + 16:
        return None
    scheme, _, token = value.partition(" ")
    token = token.lstrip(" ")
    if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
        return None
    if not all("!" <= char <= "~" for char in token):
        return None
    return token


@dataclass(frozen=True)
class Verdict:
    """What the API server said of a token: ``status`` 200 (allowed), 401 (not authenticated) or 403 (not
    allowed to get /metrics); ``user`` as the API server names it ("" when unknown)."""

    status: int
    user: str = ""
    reason: str = ""


class ReviewError(Exception):
    """The API server could not be asked, or refused to answer; ``status`` its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status in _TRANSIENT


class Reviewer(Protocol):
    def review(self, token: str) -> Verdict: ...


class ApiReviewer:
    """TokenReview, then SubjectAccessReview, asked of the API server with ``config``'s credentials."""

    def __init__(self, config: kubernetes.client.Configuration, timeout_s: float = REVIEW_TIMEOUT_S) -> None:
        self._config = config
        self._host = config.host.rstrip("/")
        self._timeout_s = timeout_s
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # as KubeClient: no proxy
        if self._host.startswith("https"):
            context = ssl_context(config)
            if not config.verify_ssl:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE  # the kubeconfig says insecure-skip-tls-verify
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    def review(self, token: str) -> Verdict:
        authn = self._create("/apis/authentication.k8s.io/v1/tokenreviews", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})
        status = authn.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return Verdict(401, reason=str(status.get("error") or "the token is not valid"))
        name = str(user["username"])
        spec: dict[str, Any] = {"user": name, "groups": list(user.get("groups") or []),
                                "nonResourceAttributes": {"path": METRICS_PATH, "verb": "get"}}
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        authz = self._create("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
        answer = authz.get("status") or {}
        if answer.get("allowed"):
            return Verdict(200, name)
        return Verdict(403, name, str(answer.get("reason") or answer.get("evaluationError") or ""))

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        own = bearer_token(self._config)  # read each time: a rotated ServiceAccount token is picked up
        if own:
            headers["Authorization"] = own
        request = urllib.request.Request(self._host + path, data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        try:
            with self._opener.open(request, timeout=self._timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            text = exc.read(2048).decode(errors="replace")
            raise ReviewError(exc.code, f"POST {path}: HTTP {exc.code}: {' '.join(text.split())[:300]}") from None
        except (OSError, ValueError) as exc:  # no answer, a time-out, a broken TLS handshake, not JSON
            raise ReviewError(0, f"POST {path}: {type(exc).__name__}: {exc}") from None


class VerdictCache:
    """Verdicts by token hash, each for ``ttl_s``, the least recently used dropped beyond ``size``."""

    def __init__(self, ttl_s: float = VERDICT_TTL_S, size: int = VERDICT_CACHE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.size, self._clock = ttl_s, size, clock
        self._items: OrderedDict[bytes, tuple[float, Verdict]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()  # the token itself is never kept

    def get(self, token: str) -> Verdict | None:
        key, now = self.key(token), self._clock()
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            if found[0] <= now:
                del self._items[key]
                return None
            self._items.move_to_end(key)
            return found[1]

    def put(self, token: str, verdict: Verdict) -> None:
        with self._lock:
            self._items[self.key(token)] = (self._clock() + self.ttl_s, verdict)
            self._items.move_to_end(self.key(token))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class Gate:
    """The verdict on an ``Authorization`` header: from the cache, else from ``reviewer``."""

    def __init__(self, reviewer: Reviewer, cache: VerdictCache | None = None,
                 in_flight: int = REVIEWS_IN_FLIGHT) -> None:
        self.reviewer = reviewer
        self.cache = cache if cache is not None else VerdictCache()
        self._slots = threading.BoundedSemaphore(in_flight)

    def check(self, authorization: str | None) -> Verdict:
        """The verdict; raises ReviewError when the API server cannot tell."""
        token = bearer_from_header(authorization)
        if token is None:
            return Verdict(401, reason="no bearer token")
        known = self.cache.get(token)
        if known is not None:
            return known
        if not self._slots.acquire(timeout=REVIEW_TIMEOUT_S):
            raise ReviewError(429, f"more than {REVIEWS_IN_FLIGHT} callers are being checked at once")
        try:
            verdict = self.reviewer.review(token)
        finally:
            self._slots.release()
        self.cache.put(token, verdict)
        return verdict


_MESSAGES = {401: "401 Unauthorized", 403: "403 Forbidden", 404: "404 Not Found", 405: "405 Method Not Allowed",
             500: "500 Internal Server Error", 503: "503 Service Unavailable"}

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def authorized(app: Wsgi, gate: Gate) -> Wsgi:
    """``app`` served at ``/metrics`` only, and only to callers the gate allows."""

    def refuse(start_response: Callable[..., Any], status: int, text: str) -> list[bytes]:
        body = (text + "\n").encode()
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        if status == 401:
            headers.append(("WWW-Authenticate", 'Bearer realm="mig-operator metrics"'))
        start_response(_MESSAGES[status], headers)
        return [body]

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            return refuse(start_response, 404, f"only {METRICS_PATH} is served here")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return refuse(start_response, 405, f"{METRICS_PATH} is read with GET")
        try:
            verdict = gate.check(environ.get("HTTP_AUTHORIZATION"))
        except ReviewError as exc:
            log.warning("cannot check a caller of %s: %s", METRICS_PATH, exc)
            status = 503 if exc.transient else 500
            return refuse(start_response, status, f"cannot check the caller with the API server: {exc}")
        if verdict.status == 401:
            return refuse(start_response, 401, "Unauthorized: send a Kubernetes bearer token "
                                               "(Authorization: Bearer <token>)")
        if verdict.status != 200:
            return refuse(start_response, 403, f"Forbidden: user {verdict.user!r} may not get {METRICS_PATH} "
                                               "(bind it to the chart's metrics-reader ClusterRole)")
        return app(environ, start_response)

    return guarded
