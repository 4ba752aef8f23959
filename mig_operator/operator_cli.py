"""The command line of the running parts: ``mig-operator controller`` and ``mig-operator agent``.

``cli.py`` adds these subcommands to its parser; they live here because they start long-running
processes (kopf operators) rather than printing an answer.
"""

from __future__ import annotations

import argparse
import re

from .core.quantities import QuantityError

DURATION_EXAMPLE = "10m"
_DURATION = re.compile(r"^(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>ms|s|m|h|d)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_MAX_DURATION_S = 365 * 86400.0


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``10m``, ``1.5h``, ``2d`` or a plain number of seconds; positive, under a year."""
    match = _DURATION.match(text.strip()) if isinstance(text, str) and len(text) <= 32 else None
    if match is None:
        shown = text if len(str(text)) <= 40 else str(text)[:40] + "…"
        raise QuantityError(f"duration {shown!r} is not a duration; use e.g. {DURATION_EXAMPLE!r} or '30s'")
    seconds = float(match["number"]) * _UNIT_SECONDS[match["unit"]]
    if not 0 < seconds <= _MAX_DURATION_S:
        raise QuantityError(f"duration {text!r} must be more than 0 and at most a year; use e.g. {DURATION_EXAMPLE!r}")
    return seconds


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise QuantityError(f"address {text[:60]!r} is not HOST:PORT; use e.g. '127.0.0.1:9443' or ':9090'")
    return text


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG, ~/.kube/config)")
    common.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="one JSON object per line with json")
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    common.add_argument("--metrics-address", help="serve Prometheus metrics on HOST:PORT (e.g. :9090); off by default")

    p = sub.add_parser("controller", parents=[common], help="run the cluster-wide controller (binds GpuSlices)")
    p.add_argument("--priority", type=int, help="peering priority of this replica (default: derived, distinct)")
    p.add_argument("--peering", default="mig-operator", help="name of the ClusterKopfPeering the replicas share")
    p.add_argument("--peering-lifetime", type=int, default=10,
                   help="seconds before a silent active replica is replaced")
    p.add_argument("--resync", default="30s", help="how often the full state is read again (driven by events)")
    p.add_argument("--webhook", metavar="HOST:PORT", help="serve the pod admission webhook there (TLS)")
    p.add_argument("--webhook-cert", help="serving certificate (PEM); default: one made at start")
    p.add_argument("--webhook-key", help="its private key (PEM)")
    p.add_argument("--webhook-cert-secret", help="Secret (in --namespace) holding the made certificate, shared "
                   "by replicas; made by the first one to start")
    p.add_argument("--webhook-url", help="URL the API server calls (default https://HOST:PORT/gpu-slice)")
    p.add_argument("--webhook-service", metavar="NAMESPACE/NAME[:PORT]",
                   help="point the webhook configuration at this Service instead of a URL (in a cluster)")
    p.add_argument("--webhook-config", default="mig-operator",
                   help="MutatingWebhookConfiguration to create or update with the CA bundle ('' to leave it alone)")
    p.add_argument("--namespace", default="mig-operator",
                   help="the operator's own namespace: its pods are never sent to the webhook")
    p.add_argument("--shim-host-dir", default="/var/lib/mig-operator/shim",
                   help="host directory holding libgpuslice.so, mounted read-only into sliced pods")
    p.set_defaults(func=cmd_controller)

    p = sub.add_parser("agent", parents=[common], help="run the node agent (realises slices bound to this node)")
    p.add_argument("--node", required=True, help="the Kubernetes node this agent serves")
    p.add_argument("--backend", default="nvml", help="nvml, or sim:MODEL[xN] such as sim:h100-80gbx2")
    p.add_argument("--state-file", help="simulator state file; a restarted agent finds its instances there")
    p.add_argument("--record-file", help="owner record (default: STATE_FILE.owners.json, or "
                   "/var/lib/mig-operator/owners.json with nvml)")
    p.add_argument("--idle-timeout", help="destroy idle instances after this long, e.g. 10m (default: keep them)")
    p.add_argument("--sim-latency", type=float, default=0.0, help="simulator: seconds each create/destroy takes")
    p.add_argument("--nvml-attempts", type=int, default=5, help="tries of a transiently failing GPU call")
    p.set_defaults(func=cmd_agent)


def _configure_logs(args: argparse.Namespace) -> None:
    from .kube.common.logs import configure

    configure(args.log_format, args.log_level)


def _check_credentials(kubeconfig: str | None) -> None:
    from .kube.common.client import CredentialsError, check_credentials

    try:
        check_credentials(kubeconfig)
    except CredentialsError as exc:
        raise QuantityError(str(exc)) from None


def cmd_controller(args: argparse.Namespace) -> int:
    from .kube.common import metrics
    from .kube.common.operator import run_operator
    from .kube.controller.main import ControllerOptions, build_registry, default_priority
    from .kube.webhook.admission import ShimMount
    from .kube.webhook.server import WebhookOptions, register

    _configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    _check_credentials(args.kubeconfig)
    for address in (args.metrics_address, args.webhook):
        if address:
            _address(address)
    if bool(args.webhook_cert) != bool(args.webhook_key):
        raise QuantityError("--webhook-cert and --webhook-key go together; e.g. --webhook-cert tls.crt "
                            "--webhook-key tls.key")
    options = ControllerOptions(
        kubeconfig=args.kubeconfig, priority=args.priority, peering=args.peering,
        peering_lifetime_s=args.peering_lifetime, resync_s=parse_duration(args.resync),
    )
    registry = build_registry(options)
    if args.webhook:
        register(registry, WebhookOptions(
            listen=args.webhook, namespace=args.namespace, cert_file=args.webhook_cert, key_file=args.webhook_key,
            cert_secret=args.webhook_cert_secret, url=args.webhook_url, service=args.webhook_service,
            config_name=args.webhook_config or None, shim=ShimMount(host_dir=args.shim_host_dir),
        ), args.kubeconfig)
    if args.metrics_address:
        metrics.serve(args.metrics_address)
    priority = options.priority if options.priority is not None else default_priority()
    run_operator(registry, standalone=False, priority=priority, peering_name=options.peering)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .gpu import open_backend
    from .kube.agent.agent import AgentSettings
    from .kube.agent.main import AgentOptions, run_agent
    from .kube.agent.record import RecordError, RecordStore

    _configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    _check_credentials(args.kubeconfig)
    if args.metrics_address:
        _address(args.metrics_address)
    if not 1 <= args.nvml_attempts <= 100:
        raise QuantityError(f"--nvml-attempts {args.nvml_attempts} must be 1..100; e.g. --nvml-attempts 5")
    if not 0 <= args.sim_latency <= 600:
        raise QuantityError(f"--sim-latency {args.sim_latency} must be 0..600 seconds; e.g. --sim-latency 1.5")
    idle = parse_duration(args.idle_timeout) if args.idle_timeout else None
    record_file = args.record_file or (
        f"{args.state_file}.owners.json" if args.state_file else "/var/lib/mig-operator/owners.json")
    try:
        RecordStore(record_file)  # refuse a bad record before anything starts
    except RecordError as exc:
        raise QuantityError(str(exc)) from None
    try:
        backend = open_backend(args.backend, state_file=args.state_file,
                               latency_s=args.sim_latency if args.sim_latency else None, host=args.node)
    except ValueError as exc:
        raise QuantityError(str(exc)) from None
    settings = AgentSettings(node=args.node, idle_timeout_s=idle, nvml_attempts=args.nvml_attempts)
    run_agent(AgentOptions(settings, record_file, args.kubeconfig, args.metrics_address), backend)
    return 0
