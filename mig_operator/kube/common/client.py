"""A small asynchronous Kubernetes client: JSON in, JSON out, over one aiohttp session.

The handlers sit on the hot path of every slice (create to Ready in tens of milliseconds), so they
talk to the API server directly instead of through the generated client's models and its thread
pool. Credentials come from the ``kubernetes`` package's loaders (in-cluster service account, or
KUBECONFIG / ~/.kube/config), so every way of authenticating that kubectl's config allows with a
token or a client certificate works, and a rotated service-account token is picked up.

Transient failures (HTTP 429, 500, 502, 503 and 504, connection errors, timeouts) are retried with backoff
(tenacity); everything else raises :class:`ApiError` at once.

A call that finds the API server away (no answer, or 503 while it starts) makes the client ask its
``/readyz`` once a second until it answers; then each of ``on_back`` is called, so that work that failed
meanwhile runs at once rather than at the end of its back-off (``WorkQueue.retry_failed_now``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDict
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from . import wire
from .impersonation import Impersonation, ImpersonationError, kubeconfig_impersonation
from .names import API_VERSION

if TYPE_CHECKING:
    import kubernetes

log = logging.getLogger("mig_operator.api")
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"  # built-in kinds only, not CRDs
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TOKEN_TTL_S = 1.0
# Items per page of a list (the client's and kopf's, ``operator.tune``): a page of whole objects is
# what a list holds at once before its transform keeps what is read.
LIST_PAGE = 10
# How long an idle connection to the API server is kept: aiohttp's default is 15 s; kube-apiserver
# closes one idle for 90 s, and a connection it closed first costs a failed request and a retry.
KEEPALIVE_S = 60.0
# How often a client that found the API server away asks whether it is back.
AWAY_POLL_S = 1.0


class ApiError(Exception):
    """A refused or failed API call: ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{message} (HTTP {status} {reason})" if status else message)
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status in _TRANSIENT_STATUS

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def cannot_list(what: str, exc: ApiError) -> str:
    """Why a command could not list ``what`` (``GpuSlices in namespace a``), for its one-line error."""
    if exc.not_found:
        return f"cannot list {what}: the API server does not know them (is the CRD installed? kubectl apply -f crds/)"
    return f"cannot list {what}: {exc}"


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.transient


@dataclass(frozen=True)
class Retry:
    """How API calls are retried: attempts in all, and the exponential wait between them."""

    attempts: int = 6
    first_wait_s: float = 0.1
    max_wait_s: float = 3.0


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster credentials inside a pod, else the kubeconfig (``kubeconfig``, KUBECONFIG, ~/.kube)."""
    return load_credentials(kubeconfig)[0]


def load_credentials(kubeconfig: str | None = None) -> tuple[kubernetes.client.Configuration, Impersonation]:
    """``load_configuration``'s credentials and whom the kubeconfig's user impersonates (``as:``; none
    in-cluster), which the ``kubernetes`` loaders leave out."""
    import kubernetes  # only its credential loaders are used, and only here

    config = kubernetes.client.Configuration()
    try:
        if kubeconfig is None:
            kubernetes.config.load_incluster_config(client_configuration=config)
            return config, Impersonation()
    except kubernetes.config.ConfigException:
        pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    return config, kubeconfig_impersonation(kubeconfig, kubernetes.config.KUBE_CONFIG_DEFAULT_LOCATION)


def ssl_context(config: kubernetes.client.Configuration) -> ssl.SSLContext:
    """TLS to the API server as ``config`` says: its CA, and its client certificate where it has one."""
    context = ssl.create_default_context(cafile=config.ssl_ca_cert)
    if config.cert_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return context


class CredentialsError(ValueError):
    """No usable Kubernetes credentials: the message says where they were looked for."""


def check_credentials(kubeconfig: str | None = None, impersonation: bool = False, as_user: str | None = None,
                      as_groups: Sequence[str] | None = None) -> Impersonation:
    """Load the credentials once before starting, so a missing or broken kubeconfig is one clear line
    and exit, not a start-up handler retried for ever (an unreachable API server is still retried).

    Whom the client acts as: the kubeconfig user's ``as:``, overridden by ``as_user``/``as_groups``
    (kubectl's ``--as``/``--as-group``). Without ``impersonation`` (the long-running parts, whose kopf
    connection cannot send impersonation headers) a kubeconfig that impersonates is refused, so a part
    never runs as two identities."""
    try:
        _, acting = load_credentials(kubeconfig)
        acting = acting.overridden(as_user, as_groups).check()
    except ImpersonationError as exc:
        raise CredentialsError(str(exc)) from None
    except Exception as exc:  # the loaders raise ConfigException, OSError, YAML and type errors alike
        where = (f"--kubeconfig {kubeconfig!r}" if kubeconfig is not None else
                 "in-cluster credentials, $KUBECONFIG and ~/.kube/config")
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise CredentialsError(
            f"no usable Kubernetes credentials from {where}: {reason}; run it in a pod with a ServiceAccount, "
            "or give a kubeconfig, e.g. --kubeconfig ~/.kube/config") from None
    if acting and not impersonation:
        raise CredentialsError(
            f"the kubeconfig's user impersonates {acting.describe()} ('as:'), which this long-running part cannot "
            "do (its watches would run as the kubeconfig's own user); give it a kubeconfig of its own identity")
    return acting


def bearer_token(config: kubernetes.client.Configuration) -> str | None:
    """``Bearer <token>`` from a loaded configuration; the key's name differs between client versions."""
    for key in ("BearerToken", "authorization"):
        value = config.get_api_key_with_prefix(key)
        if value:
            return value if " " in value else f"Bearer {value}"
    return None


class KubeClient:
    """Asynchronous JSON access to the API server, sharing one connection pool."""

    def __init__(self, config: kubernetes.client.Configuration, retry: Retry = Retry(),
                 timeout_s: float = 30.0, connections: int = 16, acting: Impersonation | None = None) -> None:
        self._config = config
        self._acting = acting.headers() if acting else []  # every request acts as this user (kubectl's --as)
        self._retry = retry
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None
        self.host = config.host.rstrip("/")
        self._token: str | None = None
        self._token_at = -float("inf")
        self.on_back: list[Callable[[], None]] = []  # called when the API server answers again after an absence
        self._away: asyncio.Task | None = None

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, as_user: str | None = None,
                         as_groups: Sequence[str] | None = None, **kwargs: Any) -> KubeClient:
        """A client with the environment's credentials, acting as the kubeconfig's user's ``as:`` (or
        ``as_user``/``as_groups``, kubectl's ``--as``/``--as-group``) when it impersonates."""
        config, acting = load_credentials(kubeconfig)
        return cls(config, acting=acting.overridden(as_user, as_groups).check(), **kwargs)

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.host.startswith("https"):
            return False
        if not self._config.verify_ssl:
            return False
        return ssl_context(self._config)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Few connections, kept open between bursts: each new one costs a TLS handshake, and
            # opening 64 of them at the start of every burst took a tenth of the controller's CPU
            # (bench/results/benchmark-history.md); 16 requests in flight keep one core busy.
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=self._connections,
                                             keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._away is not None:
            self._away.cancel()
            self._away = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None) -> CIMultiDict[str]:
        # Uncompressed answers: kube-apiserver gzips an answer over 128 kB when asked (aiohttp asks by
        # default), which costs its CPU and ours on every write answer and list page of a big object (a
        # tenant's 200 kB annotations), to spare bandwidth a controller beside the API server has.
        headers = CIMultiDict([("Accept", "application/json"), ("Accept-Encoding", "identity"), *self._acting])
        # Read at most once a second: the loaders re-read a rotated token, but not on every call.
        now = time.monotonic()
        if now - self._token_at > TOKEN_TTL_S:
            self._token, self._token_at = bearer_token(self._config), now
        token = self._token
        if token:
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self, method: str, path: str, body: Any = None, params: Mapping[str, str] | None = None,
        content_type: str | None = None, retry: bool = True,
    ) -> dict:
        """One API call, retried while it fails transiently; the decoded JSON answer."""
        if method != "GET":
            log.debug("%s %s", method, path)
        try:
            return await self._once(method, path, body, params, content_type)
        except ApiError as exc:
            if not retry or not exc.transient or self._retry.attempts <= 1:
                raise
        # Failed transiently: retried with back-off (tenacity only here, off the hot path).
        await asyncio.sleep(self._retry.first_wait_s)
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self._retry.attempts - 1),
            wait=wait_exponential(multiplier=2 * self._retry.first_wait_s, max=self._retry.max_wait_s),
            retry=retry_if_exception(_is_transient),
            reraise=True,
        ):
            with attempt:
                return await self._once(method, path, body, params, content_type)
        raise AssertionError("unreachable: tenacity reraises")

    async def _once(self, method: str, path: str, body: Any, params: Mapping[str, str] | None,
                    content_type: str | None) -> dict:
        data = None if body is None else wire.dumps(body)
        if data is not None and content_type is None:
            content_type = "application/json"
        try:
            async with self._get_session().request(
                method, self.host + path, data=data, params=params, headers=self._headers(content_type)
            ) as response:
                raw = await response.read()
                if response.status >= 400:
                    if response.status == 503:
                        self._went_away()
                    raise _error(response.status, response.reason or "", raw.decode(errors="replace"), method,
                                 path)
                return wire.loads(raw) if raw else {}
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._went_away()
            raise ApiError(0, "", f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    @property
    def away(self) -> bool:
        """Whether the last call found the API server away and it has not answered since."""
        return self._away is not None

    def _went_away(self) -> None:
        if self._away is None:
            log.warning("kube-apiserver at %s does not answer; asking it every %g s until it does", self.host,
                        AWAY_POLL_S)
            self._away = asyncio.get_running_loop().create_task(self._until_back(), name="api-server-back")

    async def _until_back(self) -> None:
        while True:
            await asyncio.sleep(AWAY_POLL_S)
            try:
                async with self._get_session().get(self.host + "/readyz", headers=self._headers(None)) as response:
                    if response.status == 200:
                        break
            except Exception as exc:  # any failure to ask is "not yet": the client never stays away for good
                log.debug("kube-apiserver at %s not back yet: %s", self.host, exc)
        self._away = None
        log.warning("kube-apiserver at %s answers again", self.host)
        for back in list(self.on_back):
            try:
                back()
            except Exception:
                log.exception("a callback for kube-apiserver's return failed")

    # ---- conveniences --------------------------------------------------------------------------

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict:
        return await self.request("GET", path, params=params)

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: Callable[[dict], dict] | None = None) -> list[dict]:
        """Every item at a collection path, following continue tokens (``keep``: see ``list_at``)."""
        return (await self.list_at(path, label_selector, field_selector, keep))[0]

    async def list_at(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                      keep: Callable[[dict], dict] | None = None) -> tuple[list[dict], int]:
        """Every item at a collection path, and the resourceVersion it was read at (every page of one
        list comes from the first page's snapshot): what is not in it was made after that version.
        Read in pages of LIST_PAGE items; ``keep`` (``trim``'s transforms) is applied to each page's
        items before the next page is read, so at most one page of whole objects is held."""
        version = 0
        params: dict[str, str] = {"limit": str(LIST_PAGE)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        items: list[dict] = []
        while True:
            page = await self.get(path, params)
            got = page.get("items") or []
            items.extend(got if keep is None else map(keep, got))
            version = version or resource_version(page.get("metadata") or {})
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, version
            params["continue"] = token
            del page, got

    async def merge_patch(self, path: str, body: Mapping) -> dict:
        return await self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    async def json_patch(self, path: str, ops: list[dict]) -> dict:
        return await self.request("PATCH", path, body=ops, content_type=JSON_PATCH)

    async def strategic_patch(self, path: str, body: Mapping) -> dict:
        return await self.request("PATCH", path, body=body, content_type=STRATEGIC_MERGE_PATCH)

    async def create(self, path: str, body: Mapping) -> dict:
        return await self.request("POST", path, body=body)

    async def delete(self, path: str, resource_version: str | None = None) -> dict:
        """Delete; with ``resource_version``, only that version of the object (else 409 Conflict)."""
        body = None if resource_version is None else {
            "apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": resource_version}}
        return await self.request("DELETE", path, body=body)


def _error(status: int, reason: str, text: str, method: str, path: str) -> ApiError:
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    return ApiError(status, reason, f"{method} {path}: {message.strip()[:500]}")


def resource_version(meta: Mapping) -> int:
    """An object's resourceVersion as a number (etcd's revision), used only to skip watch events
    older than what a part already knows or wrote itself; 0 when absent."""
    try:
        return int(meta.get("resourceVersion") or 0)
    except ValueError:
        return 0


# ---- paths -----------------------------------------------------------------------------------------


def _q(part: str) -> str:
    return quote(part, safe="")


def slices_path(namespace: str | None = None) -> str:
    if namespace is None:
        return f"/apis/{API_VERSION}/gpuslices"
    return f"/apis/{API_VERSION}/namespaces/{_q(namespace)}/gpuslices"


def slice_path(namespace: str, name: str, status: bool = False) -> str:
    return slices_path(namespace) + "/" + _q(name) + ("/status" if status else "")


def gpunodes_path() -> str:
    return f"/apis/{API_VERSION}/gpunodes"


def gpunode_path(name: str, status: bool = False) -> str:
    return gpunodes_path() + "/" + _q(name) + ("/status" if status else "")


def core_path(kind_plural: str, namespace: str | None = None, name: str | None = None) -> str:
    base = "/api/v1" + (f"/namespaces/{_q(namespace)}" if namespace else "") + f"/{kind_plural}"
    return base + (f"/{_q(name)}" if name else "")
