"""The long-running parts: ``mig-operator controller`` (cluster-wide, peered replicas),
``mig-operator agent`` (one per GPU node) and ``mig-operator mps-host`` (one per GPU node, the MPS
control daemons' pod). Every flag is checked before kopf starts: inside kopf a bad
one is a start-up handler that fails and is retried every 2 s for ever."""

from __future__ import annotations

import argparse
import contextlib
import signal

import yaml

from ..core.autoscale.pools import BACKENDS, PLACEHOLDER_IMAGE, AutoscalingOptions, PoolError, read_pools
from ..core.node.runtime_trust import DEFAULT_CONFIG as TOOLKIT_CONFIG
from ..core.placement.compute import parse_default_compute
from ..core.requests.quantities import QuantityError
from ..gpu.mps import DEFAULT_MPS_ROOT
from .flags import (
    MAX_PEERING_LIFETIME_S,
    check_credentials,
    configure_logs,
    directory_flag,
    dns_subdomain,
    duration_flag,
    exit_on_sigterm,
    file_flag,
    interval_flag,
    peering_lifetime,
    shown,
)
from .webhook import add_webhook_command, add_webhook_flags, check_addresses, listen, webhook_options


def add_part_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    p.add_argument("--autoscaling-pools", metavar="FILE",
                   help="the GPU node pools a node autoscaler makes (JSON or YAML list; chart value "
                        "autoscaling.pools): new nodes are asked for when slices wait (default: off)")
    p.add_argument("--autoscaling-backend", default="auto", metavar="auto|capacitybuffer|placeholder",
                   help="how new nodes are asked for: CapacityBuffers, placeholder pods, or auto (CapacityBuffers "
                        "where the API server serves them) (default: %(default)s)")
    p.add_argument("--placeholder-priority-class", default="mig-operator-placeholder",
                   help="the PriorityClass of placeholder pods (negative value, preemptionPolicy Never)")
    p.add_argument("--placeholder-image", default=PLACEHOLDER_IMAGE,
                   help="the image of placeholder pods and of CapacityBuffer chunks (default: %(default)s)")
    add_webhook_flags(p, required=False)
    p.set_defaults(func=cmd_controller)

    add_webhook_command(sub, [common])

    p = sub.add_parser("agent", parents=[common], help="run the node agent (realises slices bound to this node)")
    p.add_argument("--node", required=True, help="the Kubernetes node this agent serves")
    p.add_argument("--backend", default="nvml", help="nvml, or sim:MODEL[xN] such as sim:h100-80gbx2")
    p.add_argument("--state-file", help="simulator state file; a restarted agent finds its instances there")
    p.add_argument("--record-file", help="owner record (default: STATE_FILE.owners.json, or "
                   "/var/lib/mig-operator/owners.json with nvml)")
    p.add_argument("--idle-timeout", help="destroy idle instances after this long, e.g. 10m (default: keep them)")
    p.add_argument("--usage-interval", default="10",
                   help="read each Ready slice's GPU memory, processes and activity this often, in seconds or as "
                   "a duration (e.g. 10, 30s); 0 reads none (default: %(default)s)")
    p.add_argument("--idle-after", default="1800",
                   help="a Ready slice with no process for this long, in seconds or as a duration (e.g. 1800, "
                   "30m), gets condition Active=False, reason NoProcess (default: %(default)s)")
    p.add_argument("--sim-latency", type=float, default=0.0, help="simulator: seconds each create/destroy takes")
    p.add_argument("--nvml-attempts", type=int, default=5, help="tries of a transiently failing GPU call")
    p.add_argument("--device-taint-effect", default="NoSchedule",
                   help="effect of the taint on an unhealthy GPU's devices: NoSchedule or NoExecute "
                   "(default: %(default)s)")
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

    p = sub.add_parser("mps-host", help="run the node's MPS control daemons for the agent (its own pod, so "
                       "that compute-share clients outlive the agent's)")
    p.add_argument("--backend", default="nvml", help="nvml (NVIDIA's nvidia-cuda-mps-control), or sim:MODEL[xN] "
                   "(the simulator's stand-in)")
    p.add_argument("--mps-dir", default=DEFAULT_MPS_ROOT,
                   help="the GPUs' MPS directories, shared with the agent (the agent's --state-file plus .mps "
                   "with the simulator)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="one JSON object per line with json")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="the least severe messages logged")
    p.set_defaults(func=cmd_mps_host)


def cmd_controller(args: argparse.Namespace) -> int:
    from ..kube.common.operator import run_operator
    from ..kube.common.probes import Probes
    from ..kube.common.supervise import Loops
    from ..kube.controller.main import ControllerOptions, build_registry, default_priority

    configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    check_credentials(args.kubeconfig)
    check_addresses(args)
    webhook = webhook_options(args)
    dns_subdomain("--peering", args.peering, "mig-operator", "peering name")
    lifetime = peering_lifetime(args.peering_lifetime)
    resync = duration_flag("--resync", args.resync)
    fair_hold = duration_flag("--fair-hold", args.fair_hold)
    default_compute = parse_default_compute(args.default_compute)
    autoscaling = autoscaling_options(args)
    options = ControllerOptions(
        kubeconfig=args.kubeconfig, priority=args.priority if args.priority is not None else default_priority(),
        peering=args.peering,
        peering_lifetime_s=lifetime, resync_s=resync, fair_hold_s=fair_hold, quota_required=args.quota_required,
        default_compute=default_compute, autoscaling=autoscaling,
    )
    loops, probes = Loops("controller"), Probes()
    registry = build_registry(options, probes, loops)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with contextlib.ExitStack() as stack:
        listen(stack, registry, args.metrics_address, webhook if args.webhook else None, args.kubeconfig,
               args.health_address, probes, loops)
        run_operator(registry, standalone=False, priority=options.priority or 0, peering_name=options.peering)
    return 0


MAX_POOLS_FILE = 1 << 20


class _PoolsLoader(yaml.SafeLoader):
    """YAML without aliases: a few lines of nested aliases stand for billions of values, which an error
    message's ``repr`` would spell out; a pools file has no need of them."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "an alias (*name) is not taken in a pools file",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def autoscaling_options(args: argparse.Namespace) -> AutoscalingOptions | None:
    """The controller's autoscaling flags, the pools file read and checked; None when no pools file is given."""
    if args.autoscaling_backend not in BACKENDS:
        raise QuantityError(f"--autoscaling-backend {shown(args.autoscaling_backend)} is not one of "
                            f"{', '.join(BACKENDS)}; use e.g. --autoscaling-backend auto")
    dns_subdomain("--placeholder-priority-class", args.placeholder_priority_class, "mig-operator-placeholder",
                  "PriorityClass name")
    if not 0 < len(args.placeholder_image) <= 512 or not args.placeholder_image.isprintable() or (
            " " in args.placeholder_image) or not args.placeholder_image.isascii():
        raise QuantityError(f"--placeholder-image {shown(args.placeholder_image)} is not an image reference; use "
                            f"e.g. --placeholder-image {PLACEHOLDER_IMAGE}")
    if args.autoscaling_pools is None:
        return None
    path = file_flag("--autoscaling-pools", args.autoscaling_pools, "/etc/mig-operator/autoscaling/pools.yaml")
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_POOLS_FILE + 1)
    except OSError as exc:
        raise QuantityError(f"--autoscaling-pools {shown(path)} cannot be read: {exc.strerror}") from None
    if len(raw) > MAX_POOLS_FILE:
        raise QuantityError(f"--autoscaling-pools {shown(path)} is larger than {MAX_POOLS_FILE} bytes")
    try:
        data = yaml.load(raw.decode("ascii"), Loader=_PoolsLoader)  # a SafeLoader
        pools = read_pools(data)
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise QuantityError(f"--autoscaling-pools {shown(path)} is not ASCII JSON or YAML: "
                            f"{str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise QuantityError(f"--autoscaling-pools {shown(path)} is nested too deeply to be a pools file") from None
    except PoolError as exc:
        raise QuantityError(f"--autoscaling-pools {shown(path)}: {exc}") from None
    return AutoscalingOptions(pools, args.namespace, args.autoscaling_backend, args.placeholder_priority_class,
                              args.placeholder_image)


def cmd_agent(args: argparse.Namespace) -> int:
    from ..gpu import open_backend
    from ..gpu.mps import HostedMps, mps_for_backend
    from ..kube.agent.context import AgentSettings
    from ..kube.agent.kubelet.settings import MAX_SOCKET_PATH, PluginSettings, socket_paths_fit
    from ..kube.agent.main import AgentOptions, node_exists, run_agent
    from ..kube.agent.record import RecordError, RecordStore
    from ..kube.agent.resource_slice import TAINT_EFFECTS
    from ..kube.common import metrics
    from ..kube.common import probes as probing
    from ..kube.common.listen import ListenError

    configure_logs(args)  # first: with json, even an error that stops it at start is a JSON line
    dns_subdomain("--node", args.node, "gpu-node-1", "node name")
    check_credentials(args.kubeconfig)
    check_addresses(args)
    if not 1 <= args.nvml_attempts <= 100:
        raise QuantityError(f"--nvml-attempts {args.nvml_attempts} must be 1..100; e.g. --nvml-attempts 5")
    if not 0 <= args.sim_latency <= 600:
        raise QuantityError(f"--sim-latency {args.sim_latency} must be 0..600 seconds; e.g. --sim-latency 1.5")
    if args.device_taint_effect not in TAINT_EFFECTS:
        raise QuantityError(f"--device-taint-effect {args.device_taint_effect!r} is not one of "
                            f"{', '.join(TAINT_EFFECTS)}; e.g. --device-taint-effect NoExecute")
    idle = duration_flag("--idle-timeout", args.idle_timeout) if args.idle_timeout is not None else None
    usage_interval = interval_flag("--usage-interval", args.usage_interval)
    idle_after = duration_flag("--idle-after", args.idle_after)
    registry_dir = (directory_flag("--kubelet-registry-dir", args.kubelet_registry_dir,
                                    "/var/lib/kubelet/plugins_registry") if args.kubelet_registry_dir else "")
    plugin = PluginSettings(
        registry_dir=registry_dir,
        plugin_dir=directory_flag("--kubelet-plugin-dir", args.kubelet_plugin_dir,
                                   "/var/lib/kubelet/plugins/gpu.cdmo.io"),
        cdi_dir=directory_flag("--cdi-dir", args.cdi_dir, "/var/run/cdi"),
        shim_host_dir=directory_flag("--shim-host-dir", args.shim_host_dir, "/var/lib/mig-operator/shim"),
    )
    for path in socket_paths_fit(plugin):
        flag = "--kubelet-plugin-dir" if path == plugin.dra_socket else "--kubelet-registry-dir"
        raise QuantityError(f"{flag}: socket {shown(path)} is longer than a unix socket path may be "
                            f"({MAX_SOCKET_PATH} bytes); use a shorter directory, e.g. {flag} "
                            + ("/var/lib/kubelet/plugins/gpu.cdmo.io" if flag == "--kubelet-plugin-dir"
                               else "/var/lib/kubelet/plugins_registry"))
    toolkit_config = file_flag("--toolkit-config", args.toolkit_config, TOOLKIT_CONFIG) if args.toolkit_config else ""
    record_file = args.record_file or (
        f"{args.state_file}.owners.json" if args.state_file else "/var/lib/mig-operator/owners.json")
    try:
        RecordStore(record_file)  # refuse a bad record before anything starts
    except RecordError as exc:
        raise QuantityError(str(exc)) from None
    try:
        metrics_socket = metrics.bind(args.metrics_address) if args.metrics_address else None
        health_socket = probing.bind(args.health_address) if args.health_address else None
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
                             toolkit_config=toolkit_config, device_taint_effect=args.device_taint_effect,
                             usage_interval_s=usage_interval, idle_after_s=idle_after,
                             ledger_host_dir=plugin.ledger_host_dir)
    # The simulator's MPS stand-ins keep their directories beside its state, as its GPUs do.
    simulated = args.backend.startswith("sim:") and args.state_file
    # The node's MPS host (mig-operator mps-host, a pod of its own) starts the MPS control daemons, so
    # they and their clients outlive this agent; the agent asks it through each GPU's directory.
    mps = HostedMps(mps_for_backend(args.backend, f"{args.state_file}.mps" if simulated else plugin.mps_host_dir))
    probes = probing.Probes()
    if health_socket is not None:
        probing.serve(health_socket, probes)
    run_agent(AgentOptions(settings, record_file, args.kubeconfig, args.metrics_address, metrics_socket, plugin,
                           mps), backend, probes)
    return 0


def cmd_mps_host(args: argparse.Namespace) -> int:
    import threading

    from ..gpu.mps import mps_for_backend, serve_starts

    configure_logs(args)
    if args.backend != "nvml" and not args.backend.startswith("sim:"):
        raise QuantityError(f"--backend {shown(args.backend)} is neither nvml nor sim:MODEL; e.g. --backend nvml")
    root = directory_flag("--mps-dir", args.mps_dir, DEFAULT_MPS_ROOT)
    stop = threading.Event()
    # The daemons it started stay with the container (a pod's end ends them); outside one they outlive it.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve_starts(mps_for_backend(args.backend, root), stop)
    return 0
