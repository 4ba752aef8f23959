"""Serving the webhook, in a process of its own (``mig-operator webhook``) or inside the controller's
(``controller --webhook``): one server, one registration, and its MutatingWebhookConfiguration.

Only pods that ask are ever sent to it: the configuration selects them with ``matchConditions`` (CEL
on the annotations, and in a second entry on the containers' ``nvidia.com/mig-*`` resources) and
leaves the operator's own namespace out, so any other pod is never changed and never waits for the
webhook, even while it is down. kopf's managed configuration can do
neither (it filters annotations client-side), so the controller writes the configuration itself.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import kopf

from mig_operator.core.requests.compat import dialect_match_expression, dialect_request
from mig_operator.core.requests.pod_admission import PodRefused, check_pod_devices
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.core.requests.request_forms import (
    MIG_REQUESTS_LABEL,
    MIG_REQUESTS_OFF,
    MIG_RESOURCE_PREFIX,
    WHOLE_GPU_RESOURCE,
    WHOLE_GPUS_LABEL,
    WHOLE_GPUS_ON,
    mig_resource_request,
)
from mig_operator.core.requests.slice_spec import ANNOTATION_PREFIX

from ..common.client import ApiError, KubeClient
from ..common.listen import listen
from ..common.names import WEBHOOK_NAME, WEBHOOK_PREFIX
from ..common.operator import register_login, tune
from ..common.probes import Probes
from ..common.supervise import Loops
from .admission import (
    mutate_pod,
    serve_dialect_request,
    serve_mig_request,
    slice_name_for,
    with_dialect_request,
    with_mig_request,
)
from .certs import CertBundle, make_certificate
from .review import Handler, Mutation, Refused, ReviewServer

log = logging.getLogger("mig_operator.webhook")

HANDLER_ID = "gpu-slice"  # each handler is served at /<id> (review.ReviewServer)
WEBHOOK_ENTRY = "pods.cdmo.io"
# Any cdmo.io/* annotation, in any case, is sent (core.requests.slice_spec.looks_like_request), so a misspelt or
# guessed one is refused, not ignored.
MATCH_EXPRESSION = (
    "has(object.metadata.annotations) && object.metadata.annotations.exists(k, "
    f"k.lowerAscii().startsWith('{ANNOTATION_PREFIX}'))"
)
# The second entry: pods whose containers ask for nvidia.com/mig-* devices (core/requests/request_forms.py), in
# the namespaces that did not opt out. It comes after the first, which sees the pod as it was created.
MIG_HANDLER_ID = "mig-resources"
MIG_WEBHOOK_ENTRY = "mig-requests.cdmo.io"
_ASKS_FOR_MIG = (
    "has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, "
    f"k.startsWith('{MIG_RESOURCE_PREFIX}'))) || (has(c.resources.requests) && c.resources.requests.exists(k, "
    f"k.startsWith('{MIG_RESOURCE_PREFIX}'))))"
)
# The third, only with ``compat``: pods asking in a seed platform's form (core/requests/compat.py), after the
# first two, so that a pod they served is not served twice.
COMPAT_HANDLER_ID = "compat"
COMPAT_WEBHOOK_ENTRY = "compat.cdmo.io"
# The last: whole GPUs (nvidia.com/gpu) in namespaces that opt in; after compat, which takes ClearML's
# nvidia.com/gpu out of the pods it serves.
WHOLE_HANDLER_ID = "whole-gpus"
WHOLE_WEBHOOK_ENTRY = "whole-gpus.cdmo.io"
_ASKS_FOR_WHOLE = (
    f"has(c.resources) && ((has(c.resources.limits) && '{WHOLE_GPU_RESOURCE}' in c.resources.limits) || "
    f"(has(c.resources.requests) && '{WHOLE_GPU_RESOURCE}' in c.resources.requests))"
)
WHOLE_MATCH_EXPRESSION = (
    f"object.spec.containers.exists(c, {_ASKS_FOR_WHOLE}) || "
    f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {_ASKS_FOR_WHOLE}))"
)
MIG_MATCH_EXPRESSION = (
    f"object.spec.containers.exists(c, {_ASKS_FOR_MIG}) || "
    f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {_ASKS_FOR_MIG}))"
)


@dataclass(frozen=True)
class WebhookOptions:
    listen: str  # HOST:PORT the server binds
    namespace: str  # the operator's namespace: its pods are never sent to the webhook
    cert_file: str | None = None  # given certificate (e.g. from cert-manager) ...
    key_file: str | None = None
    cert_secret: str | None = None  # ... or one generated once and shared by replicas through this Secret
    url: str | None = None  # where the API server calls; default https://HOST:PORT/gpu-slice
    service: str | None = None  # or NAMESPACE/NAME[:PORT] of the Service in front of the replicas
    config_name: str | None = WEBHOOK_NAME  # the configuration to create/update; None: managed elsewhere
    failure_policy: str = "Fail"
    key_dir: str | None = None  # where a made certificate's files go; the caller removes it at exit
    # Namespaces whose nvidia.com/mig-* requests are served; empty: every one the webhook serves.
    mig_request_namespaces: tuple[str, ...] = ()
    # The seed platforms' request forms served (core/requests/compat.py): runai, clearml; none by default.
    compat: tuple[str, ...] = ()
    # Whole GPUs (nvidia.com/gpu) in every namespace the webhook serves, not only those labelled
    # cdmo.io/whole-gpus=on.
    whole_gpus_everywhere: bool = False

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "0.0.0.0", int(port)


def bind(options: WebhookOptions) -> socket.socket:
    """The webhook's socket, bound and listening before kopf starts (see kube.common.listen)."""
    return listen("--webhook", options.listen, "127.0.0.1:9443")


def certificate_hosts(options: WebhookOptions) -> list[str]:
    """The names the serving certificate must hold: the Service's DNS names, or the listen host."""
    if options.service:
        ns, _, rest = options.service.partition("/")
        name = rest.partition(":")[0]
        return [f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}", name]
    if options.url:
        from urllib.parse import urlsplit

        return [urlsplit(options.url).hostname or "localhost"]
    host = options.host_port[0]
    return ["127.0.0.1" if host in ("0.0.0.0", "") else host]


def webhook_configuration(options: WebhookOptions, ca_bundle: bytes) -> dict[str, Any]:
    def client_config(handler: str) -> dict[str, Any]:
        if options.service:
            ns, _, rest = options.service.partition("/")
            name, _, port = rest.partition(":")
            config: dict[str, Any] = {"service": {"namespace": ns, "name": name, "port": int(port or 443),
                                                  "path": f"/{handler}"}}
        else:
            host, port = options.host_port
            base = options.url.rsplit("/", 1)[0] if options.url else \
                f"https://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
            config = {"url": f"{base}/{handler}"}
        config["caBundle"] = base64.b64encode(ca_bundle).decode()
        return config

    def entry(name: str, handler: str, selector: list[dict[str, Any]], condition: str, expression: str) -> dict:
        return {
            "name": name,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": options.failure_policy,
            "reinvocationPolicy": "Never",
            "timeoutSeconds": 10,
            "clientConfig": client_config(handler),
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
                       "scope": "Namespaced"}],
            "namespaceSelector": {"matchExpressions": selector},
            "matchConditions": [{"name": condition, "expression": expression}],
        }

    not_ours = {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [options.namespace]}
    mig_selector = [not_ours, {"key": MIG_REQUESTS_LABEL, "operator": "NotIn", "values": [MIG_REQUESTS_OFF]}]
    if options.mig_request_namespaces:
        mig_selector.append({"key": "kubernetes.io/metadata.name", "operator": "In",
                             "values": list(options.mig_request_namespaces)})
    webhooks = [
        entry(WEBHOOK_ENTRY, HANDLER_ID, [not_ours], "asks-for-a-gpu-slice", MATCH_EXPRESSION),
        entry(MIG_WEBHOOK_ENTRY, MIG_HANDLER_ID, mig_selector, "asks-for-a-mig-device", MIG_MATCH_EXPRESSION),
    ]
    if options.compat:
        webhooks.append(entry(COMPAT_WEBHOOK_ENTRY, COMPAT_HANDLER_ID, [not_ours], "asks-in-a-compat-form",
                              dialect_match_expression(options.compat)))
    whole_selector = [not_ours] if options.whole_gpus_everywhere else [
        not_ours, {"key": WHOLE_GPUS_LABEL, "operator": "In", "values": [WHOLE_GPUS_ON]}]
    webhooks.append(entry(WHOLE_WEBHOOK_ENTRY, WHOLE_HANDLER_ID, whole_selector, "asks-for-whole-gpus",
                          WHOLE_MATCH_EXPRESSION))
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": options.config_name, "labels": {"app.kubernetes.io/name": "mig-operator"}},
        "webhooks": webhooks,
    }


async def upsert_configuration(client: KubeClient, body: dict[str, Any]) -> None:
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    try:
        await client.create(path, body)
    except ApiError as exc:
        if not exc.conflict:
            raise
        await client.merge_patch(f"{path}/{body['metadata']['name']}", {"webhooks": body["webhooks"]})


async def shared_certificate(client: KubeClient, namespace: str, name: str, hosts: list[str]) -> CertBundle:
    """The certificate in Secret ``namespace/name``, made and stored by the first replica to start."""
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    try:
        data = (await client.get(path)).get("data") or {}
    except ApiError as exc:
        if not exc.not_found:
            raise
        bundle = make_certificate(hosts)
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                  "metadata": {"name": name, "namespace": namespace},
                  "data": {"ca.crt": base64.b64encode(bundle.ca_pem).decode(),
                           "tls.crt": base64.b64encode(bundle.cert_pem).decode(),
                           "tls.key": base64.b64encode(bundle.key_pem).decode()}}
        try:
            await client.create(f"/api/v1/namespaces/{namespace}/secrets", secret)
            return bundle
        except ApiError as exc2:
            if not exc2.conflict:
                raise
            data = (await client.get(path)).get("data") or {}  # another replica made it first
    return CertBundle(*(base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt", "tls.key")))


async def prepare(options: WebhookOptions, client: KubeClient) -> tuple[str, str, bytes]:
    """Certificate and key files for the server, and the CA bundle for the configuration."""
    if options.cert_file and options.key_file:
        with open(options.cert_file, "rb") as fh:
            ca = fh.read()  # a given chain is its own bundle unless a CA file sits beside it
        ca_path = os.path.join(os.path.dirname(options.cert_file), "ca.crt")
        if os.path.exists(ca_path):
            with open(ca_path, "rb") as fh:
                ca = fh.read()
        return options.cert_file, options.key_file, ca
    hosts = certificate_hosts(options)
    if options.cert_secret:
        bundle = await shared_certificate(client, options.namespace, options.cert_secret, hosts)
    else:
        bundle = make_certificate(hosts)
    directory = options.key_dir or tempfile.mkdtemp(prefix="mig-operator-webhook-")
    cert_path, key_path = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
    with open(cert_path, "wb") as fh:
        fh.write(bundle.cert_pem + bundle.ca_pem)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(bundle.key_pem)
    return cert_path, key_path, bundle.ca_pem


def webhook_registry(kubeconfig: str | None) -> kopf.OperatorRegistry:
    """A registry for a process that serves only the webhook (``register`` adds the server): it
    watches nothing and keeps no state, so replicas need no peering."""
    registry = kopf.OperatorRegistry()
    register_login(registry, kubeconfig)

    @kopf.on.startup(registry=registry)
    async def settings(settings: kopf.OperatorSettings, **_: Any) -> None:
        tune(settings, WEBHOOK_PREFIX)

    return registry


def refusing(serve: Handler) -> Handler:
    """``serve``, with core's refusals of the pod (a bad quantity, a rule it breaks) turning the pod
    down with their message."""
    def handler(body: dict[str, Any]) -> Mutation | None:
        try:
            return serve(body)
        except (QuantityError, PodRefused) as exc:
            raise Refused(str(exc)) from None
    return handler


def pod_handlers(options: WebhookOptions) -> dict[str, Handler]:
    """The handler of each entry of the configuration, by the id its URL path ends with."""

    def slice_annotations(body: dict[str, Any]) -> Mutation | None:
        devices = check_pod_devices(body)
        if not devices:
            return None
        name = slice_name_for(body)
        return lambda pod: mutate_pod(pod, name, devices)

    def resource_handler(whole_gpus: bool) -> Handler:
        """The handler of one extended-resource form: nvidia.com/mig-* or (``whole_gpus``) nvidia.com/gpu."""
        def serve(body: dict[str, Any]) -> Mutation | None:
            asked = mig_resource_request(body, whole_gpus=whole_gpus)
            if asked is None:
                return None
            # Every other rule of an annotated pod applies to the pod as it will go on.
            devices = check_pod_devices(with_mig_request(body, asked, whole_gpus=whole_gpus))
            name = slice_name_for(body)
            return lambda pod: serve_mig_request(pod, asked, name, devices, whole_gpus=whole_gpus)
        return serve

    def compat_request(body: dict[str, Any]) -> Mutation | None:
        asked = dialect_request(body, options.compat)
        if asked is None:
            return None
        devices = check_pod_devices(with_dialect_request(body, asked))
        # The device reaches the containers the dialect names (Run:ai: the first, or the one named).
        devices = tuple(dataclasses.replace(d, containers=asked.containers) for d in devices)
        name = slice_name_for(body)
        return lambda pod: serve_dialect_request(pod, asked, name, devices)

    handlers = {HANDLER_ID: slice_annotations, MIG_HANDLER_ID: resource_handler(False),
                WHOLE_HANDLER_ID: resource_handler(True), COMPAT_HANDLER_ID: compat_request}
    return {handler_id: refusing(serve) for handler_id, serve in handlers.items()}


def register(registry: kopf.OperatorRegistry, options: WebhookOptions, kubeconfig: str | None,
             sock: socket.socket | None = None, loops: Loops | None = None, probes: Probes | None = None) -> None:
    """Add the webhook to a kopf registry: at start its certificate and configuration are set up and
    its server (``review.ReviewServer``) starts as one of ``loops`` (the process's supervised loops),
    serving the pods the configuration sends; it stops at clean-up. ``sock`` is from ``bind`` (bound at
    start when not given). ``probes``: the process is ready once the server serves."""
    served: list[asyncio.Task] = []
    servers: list[ReviewServer] = []

    def ready() -> list[str]:
        if not servers:
            return ["the webhook is not set up yet (its certificate and configuration)"]
        return servers[0].readiness()

    if probes is not None:
        probes.add(ready=ready)

    @kopf.on.startup(registry=registry, backoff=2)
    async def start_webhook(**_: Any) -> None:
        client = KubeClient.from_environment(kubeconfig)
        try:
            cert, key, ca = await prepare(options, client)
            server = ReviewServer(sock or bind(options), cert, key, pod_handlers(options), loops=loops)
            if options.config_name:
                await upsert_configuration(client, webhook_configuration(options, ca))
        finally:
            await client.close()
        servers.append(server)
        served.append(server.start())
        log.info("webhook serving on %s", options.listen)

    @kopf.on.cleanup(registry=registry)
    async def stop_webhook(**_: Any) -> None:
        for task in served:
            task.cancel()
        await asyncio.gather(*served, return_exceptions=True)
