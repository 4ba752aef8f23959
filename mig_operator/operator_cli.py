"""The command line of the running parts: ``mig-operator controller`` and ``mig-operator agent``.

``cli.py`` adds these subcommands to its parser; they live here because they start long-running
processes (kopf operators) rather than printing an answer.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
from types import FrameType

from .core.compute import parse_default_compute
from .core.quantities import QuantityError
from .core.runtime_trust import DEFAULT_CONFIG as TOOLKIT_CONFIG
from .core.slice_spec import MAX_NODE_NAME_LENGTH, NODE_NAME

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


# Kubernetes' own name rules: a DNS-1123 label (namespaces), a DNS-1035 label (Services).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL_LENGTH = 63
MAX_PEERING_LIFETIME_S = 3600
SERVICE_EXAMPLE = "mig-operator/mig-operator-webhook:443"


def _shown(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:60] + "…")


def _address(flag: str, text: str, example: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise QuantityError(f"{flag} {_shown(text)} is not HOST:PORT (a port from 1 to 65535); use e.g. "
                            f"{flag} {example}")
    return text


def _duration_flag(flag: str, text: str) -> float:
    """A duration flag's value in seconds; an error names the flag and the value as given."""
    if text.strip().startswith("-"):
        raise QuantityError(f"{flag} {_shown(text)} is negative; a duration is more than 0, "
                            f"e.g. {flag} {DURATION_EXAMPLE}")
    try:
        return parse_duration(text)
    except QuantityError as exc:
        raise QuantityError(f"{flag}: {exc}") from None


def _dns_subdomain(flag: str, text: str, example: str, what: str) -> str:
    """A name Kubernetes takes as a DNS subdomain (nodes, cluster-scoped objects such as the peering)."""
    if len(text) > MAX_NODE_NAME_LENGTH or NODE_NAME.fullmatch(text) is None:
        raise QuantityError(f"{flag} {_shown(text)} is not a {what} (a lower-case DNS subdomain: a-z, 0-9, "
                            f"'-' and '.', at most {MAX_NODE_NAME_LENGTH} characters); use e.g. {flag} {example}")
    return text


def _dns_label(flag: str, text: str, example: str, what: str) -> str:
    if len(text) > MAX_LABEL_LENGTH or _DNS_LABEL.fullmatch(text) is None:
        raise QuantityError(f"{flag} {_shown(text)} is not a {what} (a lower-case DNS label: a-z, 0-9 and '-', "
                            f"at most {MAX_LABEL_LENGTH} characters); use e.g. {flag} {example}")
    return text


def _webhook_service(text: str) -> str:
    """``NAMESPACE/NAME[:PORT]``: a namespace, a Service name and a port the API server can call."""
    namespace, slash, rest = text.partition("/")
    name, colon, port = rest.partition(":")
    valid = (bool(slash) and len(namespace) <= MAX_LABEL_LENGTH and _DNS_LABEL.fullmatch(namespace) is not None
             and len(name) <= MAX_LABEL_LENGTH and _SERVICE_NAME.fullmatch(name) is not None
             and (not colon or (re.fullmatch(r"[0-9]{1,5}", port, re.ASCII) is not None and 0 < int(port) < 65536)))
    if not valid:
        raise QuantityError(f"--webhook-service {_shown(text)} is not NAMESPACE/NAME[:PORT] (a namespace, a Service "
                            f"name and a port from 1 to 65535); use e.g. --webhook-service {SERVICE_EXAMPLE}")
    return text


def _peering_lifetime(text: str) -> int:
    if re.fullmatch(r"[0-9]{1,5}", text, re.ASCII) is None or not 1 <= int(text) <= MAX_PEERING_LIFETIME_S:
        raise QuantityError(f"--peering-lifetime {_shown(text)} must be a whole number of seconds from 1 to "
                            f"{MAX_PEERING_LIFETIME_S}; use e.g. --peering-lifetime 10")
    return int(text)


DEFAULT_WATCH_S = 2
MIN_WATCH_S = 0.5
MAX_WATCH_S = 3600


def _watch_seconds(text: str) -> float:
    """``top --watch``'s interval: seconds (``2``, ``0.5``) or a duration (``10s``, ``1m``)."""
    try:
        seconds = None if text.strip().startswith("-") else parse_duration(text)
    except QuantityError:
        seconds = None
    if seconds is None or not MIN_WATCH_S <= seconds <= MAX_WATCH_S:
        raise QuantityError(f"--watch {_shown(text)} is not a number of seconds from {MIN_WATCH_S} to "
                            f"{MAX_WATCH_S}; use e.g. --watch {DEFAULT_WATCH_S}")
    return seconds


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds the ``with`` blocks, so temporary files go even when the process is stopped.
    # kopf installs its own handler while it runs (it stops gracefully, and the blocks unwind then).
    sys.exit(128 + signum)


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    from .webhook_cli import add_webhook_flags, cmd_webhook

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG, ~/.kube/config)")
    common.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="one JSON object per line with json")
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="the least severe messages logged")
    common.add_argument("--metrics-address", help="serve Prometheus metrics on HOST:PORT (e.g. :9090); off by default")

    p = sub.add_parser("controller", parents=[common], help="run the cluster-wide controller (binds GpuSlices)")
    p.add_argument("--priority", type=int, help="peering priority of this replica (default: derived, distinct)")
    p.add_argument("--peering", default="mig-operator", help="name of the ClusterKopfPeering the replicas share")
    p.add_argument("--peering-lifetime", default="10",
                   help=f"seconds before a silent active replica is replaced, 1 to {MAX_PEERING_LIFETIME_S}")
    p.add_argument("--resync", default="30s", help="how often the full state is read again (driven by events)")
    p.add_argument("--fair-hold", default="60s",
                   help="how long a waiting slice may hold back its namespace's smaller ones (fair order)")
    p.add_argument("--quota-required", action="store_true",
                   help="a namespace without a GpuQuota gets no slice (reason NoQuota); default: no limit")
    p.add_argument("--default-compute", default="shared", metavar="shared|proportional",
                   help="the compute of a fraction without spec.compute: shared (time-sliced) or proportional "
                        "(a share equal to its memory share of the GPU, served by MPS) (default: shared)")
    add_webhook_flags(p, required=False)
    p.set_defaults(func=cmd_controller)

    p = sub.add_parser("webhook", parents=[common], help="serve only the pod admission webhook (stateless: run "
                       "several replicas behind one Service)")
    add_webhook_flags(p, required=True)
    p.set_defaults(func=cmd_webhook)

    p = sub.add_parser("agent", parents=[common], help="run the node agent (realises slices bound to this node)")
    p.add_argument("--node", required=True, help="the Kubernetes node this agent serves")
    p.add_argument("--backend", default="nvml", help="nvml, or sim:MODEL[xN] such as sim:h100-80gbx2")
    p.add_argument("--state-file", help="simulator state file; a restarted agent finds its instances there")
    p.add_argument("--record-file", help="owner record (default: STATE_FILE.owners.json, or "
                   "/var/lib/mig-operator/owners.json with nvml)")
    p.add_argument("--idle-timeout", help="destroy idle instances after this long, e.g. 10m (default: keep them)")
    p.add_argument("--sim-latency", type=float, default=0.0, help="simulator: seconds each create/destroy takes")
    p.add_argument("--nvml-attempts", type=int, default=5, help="tries of a transiently failing GPU call")
    p.add_argument("--kubelet-registry-dir", default="/var/lib/kubelet/plugins_registry",
                   help="the kubelet's plugin registry: the DRA driver's registration socket goes there "
                   "('' serves no kubelet plugin)")
    p.add_argument("--kubelet-plugin-dir", default="/var/lib/kubelet/plugins/gpu.cdmo.io",
                   help="directory of the DRA gRPC socket the kubelet calls (dra.sock)")
    p.add_argument("--cdi-dir", default="/var/run/cdi", help="where the CDI specs of prepared slices are written")
    p.add_argument("--shim-host-dir", default="/var/lib/mig-operator/shim",
                   help="host directory holding libgpuslice.so, mounted read-only into fraction containers")
    p.add_argument("--toolkit-config", default=TOOLKIT_CONFIG,
                   help="the node's NVIDIA container toolkit config.toml, read for the GpuNode's RuntimeTrusted "
                   "condition ('' publishes none)")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("top", help="who holds which GPU slots and memory, what waits, and the namespaces' quotas")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG, ~/.kube/config)")
    p.add_argument("--watch", nargs="?", const=str(DEFAULT_WATCH_S), metavar="SECONDS",
                   help=f"draw again every SECONDS ({MIN_WATCH_S} to {MAX_WATCH_S}, default {DEFAULT_WATCH_S}) "
                   "until Ctrl-C")
    p.add_argument("--json", action="store_true",
                   help="one JSON object for scripts (with --watch: one per line)")
    p.set_defaults(func=cmd_top)


def _directory_flag(flag: str, text: str, example: str) -> str:
    """An absolute directory path (it may not exist yet); refused when something else is there."""
    import os

    if not text.startswith("/") or "\0" in text or "\n" in text or len(text) > 4000:
        raise QuantityError(f"{flag} {_shown(text)} is not an absolute directory path; use e.g. {flag} {example}")
    if os.path.exists(text) and not os.path.isdir(text):
        raise QuantityError(f"{flag} {_shown(text)} exists and is not a directory; use e.g. {flag} {example}")
    return text.rstrip("/") or "/"


def _file_flag(flag: str, text: str, example: str) -> str:
    """An absolute file path (it may not exist: what it says then is reported, not refused)."""
    import os

    if not text.startswith("/") or text.endswith("/") or "\0" in text or "\n" in text or len(text) > 4000:
        raise QuantityError(f"{flag} {_shown(text)} is not an absolute file path; use e.g. {flag} {example}")
    if os.path.isdir(text):
        raise QuantityError(f"{flag} {_shown(text)} is a directory, not a file; use e.g. {flag} {example}")
    return text


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
    from .kube.common.operator import run_operator
    from .kube.controller.main import ControllerOptions, build_registry, default_priority
    from .webhook_cli import listen, webhook_options

    _configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    _check_credentials(args.kubeconfig)
    # Every value is checked here, before kopf starts: inside kopf a bad one is a start-up handler
    # that fails and is retried every 2 s for ever.
    if args.metrics_address:
        _address("--metrics-address", args.metrics_address, ":9090")
    webhook = webhook_options(args)
    _dns_subdomain("--peering", args.peering, "mig-operator", "peering name")
    lifetime = _peering_lifetime(args.peering_lifetime)
    resync = _duration_flag("--resync", args.resync)
    fair_hold = _duration_flag("--fair-hold", args.fair_hold)
    default_compute = parse_default_compute(args.default_compute)
    options = ControllerOptions(
        kubeconfig=args.kubeconfig, priority=args.priority, peering=args.peering,
        peering_lifetime_s=lifetime, resync_s=resync, fair_hold_s=fair_hold, quota_required=args.quota_required,
        default_compute=default_compute,
    )
    registry = build_registry(options)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with contextlib.ExitStack() as stack:
        listen(stack, registry, args.metrics_address, webhook if args.webhook else None, args.kubeconfig)
        priority = options.priority if options.priority is not None else default_priority()
        run_operator(registry, standalone=False, priority=priority, peering_name=options.peering)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .gpu import open_backend
    from .gpu.mps import mps_for_backend
    from .kube.agent.agent import AgentSettings
    from .kube.agent.kubelet_plugin import MAX_SOCKET_PATH, PluginSettings, socket_paths_fit
    from .kube.agent.main import AgentOptions, node_exists, run_agent
    from .kube.agent.record import RecordError, RecordStore
    from .kube.common import metrics
    from .kube.common.listen import ListenError

    _configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    _dns_subdomain("--node", args.node, "gpu-node-1", "node name")
    _check_credentials(args.kubeconfig)
    if args.metrics_address:
        _address("--metrics-address", args.metrics_address, ":9090")
    if not 1 <= args.nvml_attempts <= 100:
        raise QuantityError(f"--nvml-attempts {args.nvml_attempts} must be 1..100; e.g. --nvml-attempts 5")
    if not 0 <= args.sim_latency <= 600:
        raise QuantityError(f"--sim-latency {args.sim_latency} must be 0..600 seconds; e.g. --sim-latency 1.5")
    idle = _duration_flag("--idle-timeout", args.idle_timeout) if args.idle_timeout is not None else None
    registry_dir = (_directory_flag("--kubelet-registry-dir", args.kubelet_registry_dir,
                                    "/var/lib/kubelet/plugins_registry") if args.kubelet_registry_dir else "")
    plugin = PluginSettings(
        registry_dir=registry_dir,
        plugin_dir=_directory_flag("--kubelet-plugin-dir", args.kubelet_plugin_dir,
                                   "/var/lib/kubelet/plugins/gpu.cdmo.io"),
        cdi_dir=_directory_flag("--cdi-dir", args.cdi_dir, "/var/run/cdi"),
        shim_host_dir=_directory_flag("--shim-host-dir", args.shim_host_dir, "/var/lib/mig-operator/shim"),
    )
    for path in socket_paths_fit(plugin):
        flag = "--kubelet-plugin-dir" if path == plugin.dra_socket else "--kubelet-registry-dir"
        raise QuantityError(f"{flag}: socket {_shown(path)} is longer than a unix socket path may be "
                            f"({MAX_SOCKET_PATH} bytes); use a shorter directory, e.g. {flag} "
                            + ("/var/lib/kubelet/plugins/gpu.cdmo.io" if flag == "--kubelet-plugin-dir"
                               else "/var/lib/kubelet/plugins_registry"))
    toolkit_config = _file_flag("--toolkit-config", args.toolkit_config, TOOLKIT_CONFIG) if args.toolkit_config else ""
    record_file = args.record_file or (
        f"{args.state_file}.owners.json" if args.state_file else "/var/lib/mig-operator/owners.json")
    try:
        RecordStore(record_file)  # refuse a bad record before anything starts
    except RecordError as exc:
        raise QuantityError(str(exc)) from None
    try:
        metrics_socket = metrics.bind(args.metrics_address) if args.metrics_address else None
    except ListenError as exc:
        raise QuantityError(str(exc)) from None
    try:
        backend = open_backend(args.backend, state_file=args.state_file,
                               latency_s=args.sim_latency if args.sim_latency else None, host=args.node)
    except ValueError as exc:
        raise QuantityError(str(exc)) from None
    # Last, after every local check: the one that asks the API server.
    if node_exists(args.kubeconfig, args.node) is False:
        backend.close()
        # Started anyway, it would publish a GpuNode for a node that no pod can ever run on.
        raise QuantityError(f"--node {args.node!r}: the API server has no such Node (kubectl get node "
                            f"{args.node}); give this node's name, e.g. --node \"$(hostname)\" or from the "
                            "downward API's spec.nodeName")
    settings = AgentSettings(node=args.node, idle_timeout_s=idle, nvml_attempts=args.nvml_attempts,
                             toolkit_config=toolkit_config)
    # The simulator's MPS stand-ins keep their directories beside its state, as its GPUs do.
    simulated = args.backend.startswith("sim:") and args.state_file
    mps = mps_for_backend(args.backend, f"{args.state_file}.mps" if simulated else plugin.mps_host_dir)
    run_agent(AgentOptions(settings, record_file, args.kubeconfig, args.metrics_address, metrics_socket, plugin,
                           mps), backend)
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """Draw the cluster's GPUs once, or again every ``--watch`` seconds until Ctrl-C."""
    import asyncio
    import json
    import time

    from .core.top_json import view_json
    from .core.top_view import render_text
    from .kube.top import TopError, client_for, read_view

    interval = _watch_seconds(args.watch) if args.watch is not None else None
    _check_credentials(args.kubeconfig)
    # On a terminal each picture replaces the last; in a pipe or a log they follow each other.
    clear = "\x1b[H\x1b[2J" if interval is not None and not args.json and sys.stdout.isatty() else ""

    async def draw() -> int:
        client = client_for(args.kubeconfig)
        try:
            while True:
                try:
                    view = await read_view(client)
                except TopError as exc:
                    line = "mig-operator: " + " ".join(str(exc).split())
                    if interval is None:
                        print(line, file=sys.stderr)
                        return 1
                    print(f"{line}; trying again in {interval:g} s", file=sys.stderr, flush=True)
                    await asyncio.sleep(interval)
                    continue
                if args.json:
                    print(json.dumps(view_json(view), indent=None if interval is not None else 2), flush=True)
                elif interval is None:
                    print(render_text(view), end="", flush=True)
                else:
                    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                    print(f"{clear}--- mig-operator top at {stamp}, every {interval:g} s (Ctrl-C stops)\n"
                          + render_text(view), end="" if clear else "\n", flush=True)
                if interval is None:
                    return 0
                await asyncio.sleep(interval)
        finally:
            await client.close()

    try:
        return asyncio.run(draw())
    except KeyboardInterrupt:
        return 0  # how a watch is meant to end
