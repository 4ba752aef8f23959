"""Annotated pods, created to Running: 100 pods on kwok nodes, with new instances and then reused
ones, against plain pods (no annotation) and DRA-native pods in the same run.

    .venv/bin/python bench/pod_latency.py [--pods 100] [--nodes 4] [--latency 0] [--gap 0] [--json out.json]
                                          [--scheduler-qps N] [--scheduler-burst N]
                                          [--controller-manager-qps N] [--controller-manager-burst N]
                                          [--rounds plain,dra_native,new,reused] [--webhook-process]
                                          [--profile FILE] [--warm-up PODS]

The whole path runs for real: the admission webhook (served by the controller, or with --webhook-process
by `mig-operator webhook` as the chart runs it), the pod's GpuSlice,
binding, the agent (simulated GPUs) and its ResourceSlice, the slice's ResourceClaim and its allocation
(the controller's), ungating, kube-scheduler reserving the claim and binding the pod, kwok starting it.
Created-to-Running is measured from just before the client's create call to the moment a watch on the
pods first shows the pod Running (this machine's clock for both). First round: plain pods, the
baseline. Second, DRA-native pods: each names a ResourceClaimTemplate of a stand-in DeviceClass whose
devices a stand-in ResourceSlice per node published in advance (no operator in their path: what a user
of a static DRA driver pays on the same plane). Then every annotated pod needs a new MIG instance; then
all pods are deleted, and the last round finds the instances idle and reuses them. Writes per pod:
kube-apiserver's own count of non-GET requests during a round (every client: operator, scheduler,
controller-manager, kwok), over the pods. CPU per pod: each part's CPU time over the round, over the
pods (where the CPUs go in a burst).

Before the rounds, a warm-up of 100 plain pods (--warm-up) runs unmeasured: on a fresh plane the
first round ran up to four times slower than the same round later (bench/results/benchmark-history.md, run L).

The client rate limiters of kube-scheduler and kube-controller-manager (--scheduler-qps/-burst,
--controller-manager-qps/-burst, passed to the plane this run starts) are reported as the running
programs have them, read from their command lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_parts  # noqa: E402
from operator_scale import Cluster, Plane, pct, stamp  # noqa: E402

from mig_operator.kube.common.operator import event_loop_factory  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PLANE_PROGRAMS = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok")
# The programs' clientConnection defaults (KubeSchedulerConfiguration v1; kube-controller-manager's
# --kube-api-qps/--kube-api-burst), in force without the flags.
LIMITER_DEFAULTS = {"kube-scheduler": {"qps": 50.0, "burst": 100},
                    "kube-controller-manager": {"qps": 20.0, "burst": 30}}
# The DRA-native round's stand-in driver: a DeviceClass of this name selects its devices.
STANDIN_DRIVER = "standin.example.com"
STANDIN_TEMPLATE = "standin"
# The rounds, in the order they run by default: what each pod asks (annotation, claim template) and
# the prefix of its pods' names.
ROUNDS = ("plain", "dra_native", "new", "reused")
ANNOTATED = ("new", "reused")
ROUND_ASKS: dict[str, tuple[str | None, str | None]] = {
    "plain": (None, None), "dra_native": (None, STANDIN_TEMPLATE), "new": ("9Gi", None), "reused": ("9Gi", None)}
TAGS = {"plain": "plain", "dra_native": "dra", "new": "new", "reused": "again"}


def warm_up_pods(text: str) -> int:
    """argparse type: a whole number of pods from 0 to 1000."""
    if not text.isdigit() or int(text) > 1000:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of pods from 0 to 1000 (e.g. 100)")
    return int(text)


def positive(kind: type, most: int) -> Callable[[str], float | int]:
    """argparse type: a number of ``kind`` in (0, most], as scripts/control-plane takes it; anything
    else is a usage error naming it."""
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value <= most or (kind is float and round(value, 6) != value):
            example = "1000" if kind is float else "2000"
            what = "number from 0.000001" if kind is float else "whole number from 1"
            raise argparse.ArgumentTypeError(f"'{text}' is not a {what} to {most} (e.g. {example})")
        return value
    return parse


def client_limiter(plane: Plane, program: str) -> dict:
    """A running program's client limiter, from its command line (the plane may be one this run did
    not start): qps, burst, and the flags that set them (none: the program's defaults)."""
    pid = (plane.state_dir / "pids" / program).read_text().split()[0]
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    flags = [a for a in args if a.startswith(("--kube-api-qps=", "--kube-api-burst="))]
    got = dict(a.removeprefix("--kube-api-").split("=", 1) for a in flags)
    return {"qps": float(got.get("qps", LIMITER_DEFAULTS[program]["qps"])),
            "burst": int(got.get("burst", LIMITER_DEFAULTS[program]["burst"])), "flags": flags}


def rounds_list(text: str) -> list[str]:
    """argparse type: rounds by name, comma-separated, each at most once; reused only after new."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROUNDS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of distinct rounds from {', '.join(ROUNDS)} "
                                         "(e.g. new,reused)")
    if "reused" in names and ("new" not in names or names.index("new") > names.index("reused")):
        raise argparse.ArgumentTypeError(f"'{text}': reused needs new before it (e.g. new,reused)")
    return names


class Profiler:
    """py-spy attached to the controller from the first annotated round to the end of the last: its
    samples (collapsed stacks) in a file, and the controller's CPU over the same time."""

    def __init__(self, cluster: Cluster, path: str) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(spy).exists():
            raise SystemExit("--profile needs py-spy: pip install '.[bench]'")
        self.cluster, self.path = cluster, path
        self.pid = cluster.procs["controller"].pid
        # --nonblocking: the controller is never stopped to be sampled, so its latencies stay its own.
        self.proc = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--rate", "200", "--format", "raw",
                                      "--nonblocking", "--output", path], stdout=subprocess.DEVNULL,
                                     stderr=open(cluster.plane.dir / "py-spy.log", "w"))  # noqa: SIM115
        self.cpu_before = cpu_seconds(cluster)["controller"]
        time.sleep(1)  # attached before the round's first pod

    def stop(self) -> dict:
        cpu_s = cpu_seconds(self.cluster)["controller"] - self.cpu_before
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file and ends
        try:
            self.proc.wait(60)
            return {"file": self.path, "controller_cpu_s": round(cpu_s, 3), **profile_parts.shares(Path(self.path))}
        except (OSError, subprocess.TimeoutExpired) as exc:  # no profile (py-spy could not attach): the rest stands
            log = (self.cluster.plane.dir / "py-spy.log").read_text(errors="replace")[-300:]
            return {"file": self.path, "controller_cpu_s": round(cpu_s, 3), "error": f"{exc}; py-spy: {log}"}


def standin_driver(custom: kubernetes.client.CustomObjectsApi, nodes: list[str], ns: str, per_node: int) -> None:
    """What a static DRA driver has published before any pod comes: a DeviceClass, one ResourceSlice
    of ``per_node`` devices on each node, and a ResourceClaimTemplate that asks for one device."""
    group, version = "resource.k8s.io", "v1"
    custom.create_cluster_custom_object(group, version, "deviceclasses", {
        "apiVersion": f"{group}/{version}", "kind": "DeviceClass", "metadata": {"name": STANDIN_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{STANDIN_DRIVER}"'}}]}})
    for node in nodes:
        custom.create_cluster_custom_object(group, version, "resourceslices", {
            "apiVersion": f"{group}/{version}", "kind": "ResourceSlice", "metadata": {"name": f"standin-{node}"},
            "spec": {"driver": STANDIN_DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": f"dev-{i}"} for i in range(per_node)]}})
    custom.create_namespaced_custom_object(group, version, ns, "resourceclaimtemplates", {
        "apiVersion": f"{group}/{version}", "kind": "ResourceClaimTemplate", "metadata": {"name": STANDIN_TEMPLATE},
        "spec": {"spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": STANDIN_DRIVER}}]}}}})


def remove_standin_driver(custom: kubernetes.client.CustomObjectsApi, nodes: list[str]) -> None:
    for plural, name in [("deviceclasses", STANDIN_DRIVER), *(("resourceslices", f"standin-{n}") for n in nodes)]:
        try:
            custom.delete_cluster_custom_object("resource.k8s.io", "v1", plural, name)
        except kubernetes.client.ApiException:
            pass


def wait_webhook(plane: Plane, listen: str, config: str, timeout_s: float = 60) -> None:
    """Until the webhook's configuration exists and its server accepts connections."""
    admission = kubernetes.client.AdmissionregistrationV1Api(plane.api)
    host, _, port = listen.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            admission.read_mutating_webhook_configuration(config)
            with socket.create_connection((host, int(port)), timeout=1):
                time.sleep(0.5)  # the API server's webhook client may lag its informer
                return
        except (kubernetes.client.ApiException, OSError):
            time.sleep(0.2)
    raise SystemExit(f"the webhook on {listen} did not serve in {timeout_s:g} s")


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each part: the operator's processes (the agents
    summed) and the control plane's programs, found by name in /proc (one plane on this machine)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}

    def add(part: str, pid: int) -> None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        used[part] = used.get(part, 0.0) + (int(fields[11]) + int(fields[12])) / tick

    add("bench", os.getpid())  # this client: its creates and its watch compete for the same vCPUs
    for name, proc in cluster.procs.items():
        add("agents" if name.startswith("agent-") else name, proc.pid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                program = Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode()).name
            except (OSError, UnicodeDecodeError):
                continue
            if program in PLANE_PROGRAMS:
                add(program, int(entry.name))
    return used


def round_trip(core: kubernetes.client.CoreV1Api, ns: str, pods: int, memory: str | None, tag: str,
               gap_s: float = 0.0, claim_template: str | None = None) -> dict[str, list[float]]:
    """Create ``pods`` pods (annotated for ``memory``; plain when None; with a claim from
    ``claim_template`` when given) at once: seconds from create to first seen Running, each; and the
    two halves, create to the slice's Ready (its status.phaseTimes) and from there to Running."""
    created: dict[str, float] = {}
    running: dict[str, float] = {}
    ungated: dict[str, float] = {}  # an annotated pod first seen without the operator's gate
    bound: dict[str, float] = {}  # first seen with spec.nodeName (kube-scheduler bound it)
    done = threading.Event()

    reopened = [0]  # watches that ended early and were opened again

    def watch() -> None:
        deadline = time.monotonic() + 300
        while len(running) < pods and time.monotonic() < deadline:
            # The API server may end a watch at any time; a new one starts with every pod as it is now
            # (a pod that changed in between is seen late, never lost).
            stream = kubernetes.watch.Watch()
            for event in stream.stream(core.list_namespaced_pod, ns,
                                       timeout_seconds=max(1, int(deadline - time.monotonic()))):
                pod = event["object"]
                name = pod.metadata.name
                now = time.time()
                if name.startswith(tag) and name not in ungated and memory and not any(
                        g.name == "cdmo.io/gpu-slice" for g in pod.spec.scheduling_gates or []):
                    ungated[name] = now
                if name.startswith(tag) and name not in bound and pod.spec.node_name:
                    bound[name] = now
                if pod.status.phase == "Running" and name.startswith(tag) and name not in running:
                    running[name] = time.time()
                    if len(running) == pods:
                        stream.stop()
            if len(running) < pods:
                reopened[0] += 1
        done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)  # the watch is open before the first create

    def create(i: int) -> None:
        name = f"{tag}-{i:03d}"
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "annotations": {"cdmo.io/gpu-memory": memory} if memory else {}},
                "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                         "containers": [{"name": "main", "image": "busybox"}]}}
        if claim_template:
            body["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": claim_template}]
            body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "dev"}]}
        created[name] = time.time()
        core.create_namespaced_pod(ns, body)

    if gap_s > 0:
        for i in range(pods):  # a steady arrival rate instead of one burst
            create(i)
            time.sleep(gap_s)
    else:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, range(pods)))
    done.wait(300)
    missing = sorted(set(created) - set(running))
    if missing:
        raise SystemExit(f"{len(missing)} pods never ran, e.g. {missing[:3]}")
    custom = kubernetes.client.CustomObjectsApi(core.api_client)
    ready: dict[str, float] = {}
    slice_bound: dict[str, float] = {}  # the binding's stamp (the controller's clock, this machine's)
    for body in custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]:
        owner = (body["metadata"].get("labels") or {}).get("cdmo.io/pod", "")
        times = body["status"].get("phaseTimes", {})
        if owner in created and "Ready" in times:
            ready[owner] = stamp(times["Ready"])
            if "Bound" in times:
                slice_bound[owner] = stamp(times["Bound"])
    return {
        "total": [running[n] - created[n] for n in created],
        "to_slice_ready": [ready[n] - created[n] for n in ready],
        # Where create to Ready goes: admission, the controller (slice made, planned, bound), the agent.
        "to_slice_bound": [slice_bound[n] - created[n] for n in slice_bound],
        "slice_bound_to_ready": [ready[n] - slice_bound[n] for n in slice_bound],
        "slice_ready_to_running": [running[n] - ready[n] for n in ready],
        # Where Ready to Running goes: the controller (device check, claim, ungate), kube-scheduler
        # (claim allocation, binding), kwok (Running).
        "slice_ready_to_ungated": [ungated[n] - ready[n] for n in ready if n in ungated],
        "ungated_to_bound": [bound[n] - ungated[n] for n in ungated if n in bound],
        "bound_to_running": [running[n] - bound[n] for n in bound if n in running],
        "created_to_bound": [bound[n] - created[n] for n in bound],
        "send_s": [max(created.values()) - min(created.values())],
        "watches_reopened": [float(reopened[0])],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.0, help="simulated seconds per NVML create/destroy")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds between two creates (default 0: all at once, from 16 threads)")
    for part, default in (("scheduler", "50/100"), ("controller-manager", "20/30")):
        parser.add_argument(f"--{part}-qps", type=positive(float, 999_999_999),
                            help=f"kube-{part}'s client QPS (control-plane up --{part}-qps; default {default})")
        parser.add_argument(f"--{part}-burst", type=positive(int, 2**31 - 1),
                            help=f"kube-{part}'s client burst (control-plane up --{part}-burst)")
    parser.add_argument("--webhook-process", action="store_true",
                        help="serve the webhook from its own process (mig-operator webhook), not the controller's")
    parser.add_argument("--warm-up", type=warm_up_pods, default=100, metavar="PODS",
                        help="plain pods created, run and deleted before the measured rounds, unmeasured "
                        "(default 100; 0: none): the first round on a fresh plane ran up to 4 times slower")
    parser.add_argument("--rounds", default=",".join(ROUNDS), type=rounds_list,
                        help="the rounds to run, in this order (reused needs new before it)")
    parser.add_argument("--profile", metavar="FILE",
                        help="record the controller with py-spy during the annotated rounds (pip install "
                        "'.[bench]'): collapsed stacks to FILE, each part's share in the JSON")
    parser.add_argument("--log-level", default="info",
                        help="of the controller, the webhook and the agents (their logs are in the plane's directory)")
    parser.add_argument("--json")
    args = parser.parse_args()
    up_args: tuple[str, ...] = ()
    for flag, value in (("scheduler-qps", args.scheduler_qps), ("scheduler-burst", args.scheduler_burst),
                        ("controller-manager-qps", args.controller_manager_qps),
                        ("controller-manager-burst", args.controller_manager_burst)):
        if value:  # a QPS as scripts/control-plane takes it: at most 6 decimals, no exponent
            text = f"{value:.6f}".rstrip("0").rstrip(".") if flag.endswith("qps") else str(value)
            up_args += (f"--{flag}={text}",)
    # Pods need binding; deleted pods' slices need GC; template claims need the resourceclaim controller.
    plane = Plane("scheduler,controller-manager,kwok", up_args)
    limiters = {key: client_limiter(plane, program) for key, program in
                (("scheduler_limiter", "kube-scheduler"), ("controller_manager_limiter", "kube-controller-manager"))}
    if up_args and not plane.own:
        print(f"note: MIG_OPERATOR_RUN names a running plane, whose limits are {limiters}", file=sys.stderr)
    webhook_args = ("--webhook", f"127.0.0.1:{free_port()}", "--webhook-config", f"bench-{os.getpid()}",
                    "--namespace", "kube-system")
    cluster = Cluster(plane, args.nodes, args.latency, args.log_level,
                      controller_args=() if args.webhook_process else webhook_args)
    if args.webhook_process:  # as the chart runs it: its own process (`mig-operator webhook`), the controller none
        cluster.spawn("webhook", "webhook", *webhook_args)
    core = cluster.core
    ns = f"pods-{os.getpid()}"
    core.create_namespace({"metadata": {"name": ns}})
    custom = kubernetes.client.CustomObjectsApi(plane.api)
    standin_driver(custom, cluster.names, ns, per_node=min(128, args.pods))  # 128: a ResourceSlice's most
    wait_webhook(plane, webhook_args[1], webhook_args[3])
    writes: dict[str, float] = {}
    by_resource: dict[str, dict[str, float]] = {}
    write_ms: dict[str, dict[str, float]] = {}  # kube-apiserver's mean time per write, by resource
    cpu: dict[str, dict[str, float]] = {}
    events: dict[str, dict[str, int]] = {}  # component/reason -> Events (counts included) on the round's pods

    def measured(memory: str | None, tag: str, claim_template: str | None = None) -> dict[str, list[float]]:
        before, seconds_before = plane.apiserver_writes(), plane.apiserver_write_seconds()
        cpu_before = cpu_seconds(cluster)
        times = round_trip(core, ns, args.pods, memory, tag, args.gap, claim_template)
        after, seconds_after = plane.apiserver_writes(), plane.apiserver_write_seconds()
        cpu_after = cpu_seconds(cluster)
        cpu[tag] = {part: round(1000 * (cpu_after[part] - cpu_before.get(part, 0.0)) / args.pods, 2)
                    for part in sorted(cpu_after)}
        delta = {key: (after[key] - before.get(key, 0.0)) / args.pods for key in after}
        writes[tag] = sum(delta.values())
        by_resource[tag] = {key: round(value, 2) for key, value in sorted(delta.items()) if value >= 0.01}
        write_ms[tag] = {key: round(1000 * (seconds_after.get(key, 0.0) - seconds_before.get(key, 0.0))
                                    / (delta[key] * args.pods), 2) for key in by_resource[tag]}
        reasons: dict[str, int] = {}
        for event in core.list_namespaced_event(ns).items:
            if (event.involved_object.name or "").startswith(tag):
                key = f"{event.source.component or event.reporting_component}/{event.reason}"
                reasons[key] = reasons.get(key, 0) + (event.count or 1)
        events[tag] = dict(sorted(reasons.items()))
        cleared()
        return times

    def cleared() -> None:
        """Delete the round's pods; return once they, their slices and their claims are gone (the
        garbage collector deletes a claim after its slice or its pod), so no clean-up is counted."""
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        deadline = time.monotonic() + 120
        while (custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]
               or custom.list_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims")["items"]
               or core.list_namespaced_pod(ns).items):
            if time.monotonic() > deadline:
                raise SystemExit("the deleted pods' slices and claims were not gone in 120 s")
            time.sleep(0.5)

    spy: Profiler | None = None
    rounds: dict[str, dict[str, list[float]]] = {}
    try:
        if args.warm_up:
            round_trip(core, ns, args.warm_up, None, "warm-up")
            cleared()
        for name in args.rounds:
            if name in ANNOTATED and args.profile and spy is None:
                spy = Profiler(cluster, args.profile)
            memory, template = ROUND_ASKS[name]
            rounds[name] = measured(memory, TAGS[name], template)
    finally:
        parts = spy.stop() if spy is not None else None
        cluster.stop()
        remove_standin_driver(custom, cluster.names)
        core.delete_namespace(ns)
        plane.down()

    def summary(times: dict[str, list[float]]) -> dict:
        out = {part: {"p50_ms": 1000 * pct(v, 0.5), "p99_ms": 1000 * pct(v, 0.99)}
               for part, v in times.items() if part not in ("send_s", "watches_reopened") and v}
        out["send_s"] = times["send_s"][0]  # how long the benchmark took to send its creates
        out["watches_reopened"] = int(times["watches_reopened"][0])
        return out

    tags = {name: TAGS[name] for name in rounds}
    result = {"pods": args.pods, "nodes": args.nodes, "gpus": args.nodes * 8, "latency_s": args.latency,
              "gap_s": args.gap, "warm_up_pods": args.warm_up, "cpus": len(os.sched_getaffinity(0)), **limiters,
              "webhook": "own process" if args.webhook_process else "in the controller",
              # The operator's processes run with this interpreter and path: uvloop's loop where installed.
              "event_loop": "asyncio" if event_loop_factory() is None else "uvloop",
              **{name: summary(times) for name, times in rounds.items()},
              "writes_per_pod": {name: writes[tag] for name, tag in tags.items()},
              "writes_per_pod_by_resource": {name: by_resource[tag] for name, tag in tags.items()},
              # kube-apiserver's mean milliseconds per write (from arrival to answer, admission included).
              "apiserver_ms_per_write_by_resource": {name: write_ms[tag] for name, tag in tags.items()},
              # CPU milliseconds per pod by part, from the round's start to its last pod Running.
              "cpu_ms_per_pod": {name: cpu[tag] for name, tag in tags.items()},
              "events": {name: events[tag] for name, tag in tags.items()}}
    if parts is not None:
        result["controller_profile"] = parts
    p50 = {name: pct(times["total"], 0.5) for name, times in rounds.items()}
    ratios = {"dra_native": ("dra_native", "plain"), "new": ("new", "plain"), "reused": ("reused", "plain"),
              "reused_over_dra_native": ("reused", "dra_native")}
    result["ratio_p50"] = {key: p50[a] / p50[b] for key, (a, b) in ratios.items() if a in p50 and b in p50}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(text_summary(result), file=sys.stderr)
    return 0


def text_summary(result: dict) -> str:
    """The figures a reader compares, one round a line (the JSON has the rest)."""
    def limits(key: str) -> str:
        limiter = result[key]
        return f"qps {limiter['qps']:g}, burst {limiter['burst']}" + ("" if limiter["flags"] else " (defaults)")

    lines = [f"{result['pods']} pods, gap {result['gap_s']} s, {result['cpus']} CPUs; client limiters: kube-scheduler "
             f"{limits('scheduler_limiter')}; kube-controller-manager {limits('controller_manager_limiter')}; "
             f"event loop {result.get('event_loop', 'asyncio')}",
             "round        total p50/p99 ms   ->Ready   Ready->ungated  ungated->bound  ->bound  writes/pod  p50/plain"]
    for name in (n for n in ROUNDS if n in result):
        r = result[name]
        split = [f"{r[part]['p50_ms']:.0f}" if part in r else "-"
                 for part in ("to_slice_ready", "slice_ready_to_ungated", "ungated_to_bound", "created_to_bound")]
        ratio = result["ratio_p50"].get(name, 1.0 if name == "plain" else float("nan"))
        lines.append(f"{name:<12} {r['total']['p50_ms']:>7.0f}/{r['total']['p99_ms']:<8.0f} {split[0]:>9} "
                     f"{split[1]:>15} {split[2]:>15} {split[3]:>8} "
                     f"{result['writes_per_pod'][name]:>11.1f} {ratio:>10.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
