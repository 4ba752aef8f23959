"""``mig-operator webhook`` and the admission webhook's flags, which ``controller --webhook`` takes too:
one set of flags, one check of them, one way to start the server in either process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import tempfile
from typing import TYPE_CHECKING

from ..core.requests.compat import UnknownDialect, check_dialects
from ..core.requests.quantities import QuantityError
from .flags import (
    address,
    check_credentials,
    configure_logs,
    dns_label,
    dns_subdomain,
    exit_on_sigterm,
    shown,
    webhook_service,
)

if TYPE_CHECKING:
    import kopf

    from ..kube.common.probes import Probes
    from ..kube.common.supervise import Loops
    from ..kube.webhook.server import WebhookOptions


def add_webhook_command(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("webhook", parents=parents, help="serve only the pod admission webhook (stateless: run "
                       "several replicas behind one Service)")
    add_webhook_flags(p, required=True)
    p.set_defaults(func=cmd_webhook)


def add_webhook_flags(p: argparse.ArgumentParser, required: bool) -> None:
    """The admission webhook's flags: the same for ``webhook`` and for ``controller --webhook``."""
    p.add_argument("--webhook", metavar="HOST:PORT", required=required,
                   help="serve the pod admission webhook there (TLS)")
    p.add_argument("--webhook-cert", help="serving certificate (PEM); default: one made at start")
    p.add_argument("--webhook-key", help="its private key (PEM)")
    p.add_argument("--webhook-cert-secret", help="Secret (in --namespace) holding the made certificate, shared "
                   "by replicas; made by the first one to start")
    p.add_argument("--webhook-url", help="URL the API server calls (default https://HOST:PORT/gpu-slice)")
    p.add_argument("--webhook-service", metavar="NAMESPACE/NAME[:PORT]",
                   help="point the webhook configuration at this Service instead of a URL (in a cluster)")
    p.add_argument("--mig-request-namespaces", default=None, metavar="NS[,NS...]",
                   help="namespaces whose nvidia.com/mig-* requests the webhook serves (default: every one it "
                        "serves; a namespace labelled cdmo.io/mig-requests=off is always left out)")
    p.add_argument("--whole-gpus-everywhere", action="store_true",
                   help="serve nvidia.com/gpu requests as whole-GPU slices in every namespace the webhook serves "
                        "(default: only in namespaces labelled cdmo.io/whole-gpus=on)")
    p.add_argument("--compat", default=None, metavar="DIALECT[,DIALECT...]",
                   help="also serve the seed platforms' request forms: runai, clearml (default: none)")
    p.add_argument("--webhook-config", default="mig-operator",
                   help="MutatingWebhookConfiguration to create or update with the CA bundle ('' to leave it alone)")
    p.add_argument("--namespace", default="mig-operator",
                   help="the operator's own namespace: its pods are never sent to the webhook")


def webhook_options(args: argparse.Namespace) -> WebhookOptions:
    """The webhook's flags checked, each error one line naming the flag (``listen`` is empty without
    ``--webhook``: the controller then serves none)."""
    from ..kube.webhook.certs import CertificateFileError, check_pem_pair
    from ..kube.webhook.server import WebhookOptions

    if args.webhook:
        address("--webhook", args.webhook, "127.0.0.1:9443")
    dns_label("--namespace", args.namespace, "mig-operator", "namespace")
    if args.webhook_config:
        dns_subdomain("--webhook-config", args.webhook_config, "mig-operator", "MutatingWebhookConfiguration name")
    if args.webhook_service:
        webhook_service(args.webhook_service)
    mig_namespaces = tuple(n.strip() for n in (args.mig_request_namespaces or "").split(",") if n.strip())
    for namespace in mig_namespaces:
        dns_label("--mig-request-namespaces", namespace, "team-a,team-b", "namespace")
    try:
        compat = check_dialects(args.compat or "")
    except UnknownDialect as exc:
        raise QuantityError(f"--compat {shown(args.compat)}: {exc}") from None
    if bool(args.webhook_cert) != bool(args.webhook_key):
        raise QuantityError("--webhook-cert and --webhook-key go together; e.g. --webhook-cert tls.crt "
                            "--webhook-key tls.key")
    if args.webhook_cert:
        try:
            check_pem_pair(args.webhook_cert, args.webhook_key)
        except CertificateFileError as exc:
            raise QuantityError(str(exc)) from None
    return WebhookOptions(
        listen=args.webhook or "", namespace=args.namespace, cert_file=args.webhook_cert,
        key_file=args.webhook_key, cert_secret=args.webhook_cert_secret, url=args.webhook_url,
        service=args.webhook_service, config_name=args.webhook_config or None,
        mig_request_namespaces=mig_namespaces, compat=compat, whole_gpus_everywhere=args.whole_gpus_everywhere,
    )


def serve_webhook(stack: contextlib.ExitStack, registry: kopf.OperatorRegistry, webhook: WebhookOptions,
                  kubeconfig: str | None, loops: Loops | None = None, probes: Probes | None = None) -> None:
    """Bind the webhook's socket now (a taken port is a start-up error) and add the server to ``registry``
    (one of ``loops``; ready in ``probes`` once it serves)."""
    from ..kube.webhook.server import bind, register

    webhook_socket = stack.enter_context(bind(webhook))
    if not webhook.cert_file:
        # The made certificate's key lives only as long as this process.
        key_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mig-operator-webhook-"))
        webhook = dataclasses.replace(webhook, key_dir=key_dir)
    register(registry, webhook, kubeconfig, webhook_socket, loops, probes)


def check_addresses(args: argparse.Namespace) -> None:
    """The metrics and probe addresses as given, each error one line naming the flag."""
    if args.metrics_address:
        address("--metrics-address", args.metrics_address, ":9090")
    if args.health_address:
        address("--health-address", args.health_address, ":8081")


def listen(stack: contextlib.ExitStack, registry: kopf.OperatorRegistry, metrics_address: str | None,
           webhook: WebhookOptions | None, kubeconfig: str | None, health_address: str | None = None,
           probes: Probes | None = None, loops: Loops | None = None) -> None:
    """Bind the metrics, probe and webhook sockets before anything starts (a taken port is a start-up
    error, one line, exit 2), then serve metrics and the probes; the webhook's server runs in
    ``registry``, one of ``loops``."""
    from ..kube.common import metrics
    from ..kube.common import probes as probing
    from ..kube.common.listen import ListenError

    try:
        metrics_socket = metrics.bind(metrics_address) if metrics_address else None
        if metrics_socket is not None:
            stack.callback(metrics_socket.close)
        health_socket = probing.bind(health_address) if health_address and probes is not None else None
        if health_socket is not None:
            stack.callback(health_socket.close)
        if webhook is not None:
            serve_webhook(stack, registry, webhook, kubeconfig, loops, probes)
    except ListenError as exc:
        raise QuantityError(str(exc)) from None
    if metrics_socket is not None:
        metrics.serve(metrics_socket, kubeconfig)
    if health_socket is not None and probes is not None:
        stack.callback(probing.serve(health_socket, probes).shutdown)


def cmd_webhook(args: argparse.Namespace) -> int:
    """The admission webhook alone: the same server as ``controller --webhook``, in a process of its own
    that keeps no state (no peering, no watch), so any number of replicas serve one Service."""
    from ..kube.common.operator import run_operator
    from ..kube.common.probes import Probes, watch_operator
    from ..kube.common.supervise import Loops
    from ..kube.webhook.server import webhook_registry

    configure_logs(args)
    check_credentials(args.kubeconfig)
    check_addresses(args)
    webhook = webhook_options(args)
    registry = webhook_registry(args.kubeconfig)
    loops, probes = Loops("webhook"), Probes()
    probes.add(live=loops.unhealthy)  # ready: once its server serves (``register``)
    watch_operator(registry, probes)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with contextlib.ExitStack() as stack:
        listen(stack, registry, args.metrics_address, webhook, args.kubeconfig, args.health_address, probes, loops)
        run_operator(registry, standalone=True)
    return 0
