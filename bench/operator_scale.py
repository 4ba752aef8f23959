"""Operator scale: 20 nodes x 8 simulated H100-80GB, 500 slices at once, then a minute of churn.

    .venv/bin/python bench/operator_scale.py [--latency 0] [--nodes 20] [--slices 500] [--churn 60]
                                             [--flood 0] [--sizes 5Gi:0.6,15Gi:0.25,30Gi:0.15]
                                             [--usage [--usage-seconds 120]] [--json out.json]

Everything runs for real on this machine: the local control plane (scripts/control-plane, reused
when MIG_OPERATOR_RUN points at a running one), one controller and one agent process per kwok node,
simulated GPUs with ``--sim-latency`` seconds per NVML create or destroy.

Measured:
- create-to-Ready, p50 and p99: for the burst (every slice a new instance), and during the churn for
  slices that got a new instance and for those that reused an
  idle one: from just before the client's create call to the Ready time the agent wrote
  (status.phaseTimes.Ready; one machine, one clock);
- slices bound per second during the burst (Bound times in status.phaseTimes);
- API writes per slice, counted by kube-apiserver itself (apiserver_request_total, non-GET verbs
  on gpuslices and their status, minus the benchmark's own creates and deletes and, with ``--usage``,
  the writes from its devices made busy to its window's end); the agents run with their default
  ``--usage-interval``, so each Ready slice's first usage write counts; GpuNode and Event writes are
  reported apart;
- CPU time (user + system) and peak RSS (VmHWM) of the controller and of the agents (total, max);
- the controller's peak RSS again for a new controller process started once all is settled, which
  lists everything as it starts (``controller_restart``).

``--usage`` measures the agents' status writes of slices' usage (``status.usage``, agents reading every
10 s, ``--usage-interval``): once the burst's slices are Ready, each one's MIG device gets one process
holding 40 % of the slice (through the agents' simulator state files), then every 10 s for
``--usage-seconds`` every slice's memory moves by a random amount that keeps any two readings within
5 % of the slice (no write is due), and 2 % of the slices move by 10 % (one write each is due).
Reported: kube-apiserver's count of ``gpuslices/status`` writes in that window, per second, beside the
expected (2 % of the slices per 10 s), and the slices whose status does not show what their device
holds at the end (none when the agents' loop ran). The churn follows it, as without ``--usage``.

``--flood N`` first makes N slices in a namespace of their own, each with a 200 kB annotation and pinned
to a node that does not exist (Pending for good), as a tenant flooding the API would.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mig_operator.core.requests.quantities import parse_memory  # noqa: E402
from mig_operator.gpu.sim_state import save_state  # noqa: E402
from mig_operator.kube.common.client import KubeClient, load_configuration, slice_path, slices_path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTROL_PLANE = REPO / "scripts" / "control-plane"
GROUP, VERSION, SLICES = "cdmo.io", "v1alpha1", "gpuslices"
# The burst's mix (memory asked -> the H100 profile it gets): 1g.10gb, 1g.20gb, 3g.40gb.
SIZES = [("5Gi", 0.6), ("15Gi", 0.25), ("30Gi", 0.15)]
FLOOD_BLOB = 200_000  # bytes of annotation on each flood slice
# --usage: the agents' reading interval, a round of the benchmark's changes; the share of its slice a
# device's process holds; every round's move of each slice around that (any two readings differ by less
# than the 5 % that is worth a write); a big move (more than 5 %: one write) and the share of slices making
# one each round.
USAGE_INTERVAL_S = 10.0
USAGE_BASE = 0.40
USAGE_JITTER = 0.024
USAGE_BIG = 0.10
USAGE_BIG_SHARE = 0.02
USAGE_FIRST_WRITES_S = 180.0  # for every slice's first reading of its process to be written


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Plane:
    """The control plane: started for this run unless MIG_OPERATOR_RUN names a running one."""

    def __init__(self, components: str = "kwok", up_args: tuple[str, ...] = ()) -> None:
        self.own = "MIG_OPERATOR_RUN" not in os.environ
        self.dir = Path(tempfile.mkdtemp(prefix="mig-bench-"))
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.own:
            self.env["MIG_OPERATOR_RUN"] = str(self.dir / "plane")
        subprocess.run([str(CONTROL_PLANE), "build"], check=True, env=self.env)
        up = subprocess.run([str(CONTROL_PLANE), "up", "--with", components, *up_args], env=self.env,
                            capture_output=True, text=True, check=True)
        self.kubeconfig = up.stdout.strip().splitlines()[-1].removeprefix("KUBECONFIG=")
        self.env["KUBECONFIG"] = self.kubeconfig
        env = dict(line.split("=", 1) for line in subprocess.run(
            [str(CONTROL_PLANE), "env"], env=self.env, capture_output=True, text=True).stdout.splitlines())
        self.kubectl = str(Path(env["BIN_DIR"]) / "kubectl")
        self.state_dir = Path(env["STATE_DIR"])
        self.api = kubernetes.config.new_client_from_config(config_file=self.kubeconfig)

    def down(self) -> None:
        if self.own:
            subprocess.run([str(CONTROL_PLANE), "down"], env=self.env, capture_output=True)

    def apiserver_writes(self) -> dict[str, float]:
        """kube-apiserver's own count of non-GET requests, by resource[/subresource]."""
        return self.apiserver_write_metric("apiserver_request_total")

    def apiserver_write_seconds(self) -> dict[str, float]:
        """kube-apiserver's own time in non-GET requests (admission and storage included, from the
        request's arrival to its answer), in seconds, by resource[/subresource]."""
        return self.apiserver_write_metric("apiserver_request_duration_seconds_sum")

    def apiserver_write_metric(self, metric: str) -> dict[str, float]:
        """A counter of kube-apiserver's requests, summed over the non-GET ones, by resource[/subresource]."""
        text = subprocess.run([self.kubectl, "get", "--raw", "/metrics"], env=self.env, capture_output=True,
                              text=True, check=True).stdout
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(metric + "{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("verb") in ("GET", "LIST", "WATCH", "CONNECT"):
                continue
            key = labels.get("resource", "") + ("/" + labels["subresource"] if labels.get("subresource") else "")
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts


class Cluster:
    def __init__(self, plane: Plane, nodes: int, latency: float, log_level: str = "info",
                 controller_args: tuple[str, ...] = (), agent_args: tuple[str, ...] = ()) -> None:
        self.plane = plane
        self.log_level = log_level
        self.custom = kubernetes.client.CustomObjectsApi(plane.api)
        self.core = kubernetes.client.CoreV1Api(plane.api)
        self.procs: dict[str, subprocess.Popen] = {}
        self.stats: dict[str, tuple[float, int]] = {}
        self.names = [f"bench-{i:02d}" for i in range(nodes)]
        for crd in sorted((REPO / "crds").glob("*.yaml")):
            subprocess.run([plane.kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(crd)],
                           env=plane.env, check=True, capture_output=True)
        for body in self.custom.list_cluster_custom_object(GROUP, VERSION, "gpunodes")["items"]:
            self.custom.delete_cluster_custom_object(GROUP, VERSION, "gpunodes", body["metadata"]["name"])
        for name in self.names:
            try:
                self.core.create_node({"metadata": {
                    "name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"kubernetes.io/hostname": name, "cdmo.clear.ml/gpu-partitioning": "mig"}}})
            except kubernetes.client.ApiException as exc:
                if exc.status != 409:
                    raise
            self.spawn(f"agent-{name}", "agent", "--node", name, "--backend", "sim:h100-80gbx8",
                       "--state-file", str(self.state_file(name)), "--sim-latency", str(latency), *agent_args)
        deadline = time.monotonic() + 120
        while len(self.custom.list_cluster_custom_object(GROUP, VERSION, "gpunodes")["items"]) < nodes:
            if time.monotonic() > deadline:
                raise SystemExit("agents did not publish their GpuNodes in 120 s")
            time.sleep(0.5)
        self.spawn("controller", "controller", "--peering", f"bench-{os.getpid()}", *controller_args)
        time.sleep(3)

    def state_file(self, node: str) -> Path:
        """The simulator state file of the node's agent."""
        return self.plane.dir / f"{node}.json"

    def spawn(self, name: str, *args: str) -> None:
        log = open(self.plane.dir / f"{name}.log", "w")  # noqa: SIM115 (open for the process's life)
        args = (*args, "--log-level", self.log_level)
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", *args], env=self.plane.env,
                                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def usage(self, name: str) -> tuple[float, int]:
        """CPU seconds (user + system) and peak RSS in bytes, read from /proc before it stops."""
        pid = self.procs[name].pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        hwm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        return cpu, hwm

    def wait_idle(self, name: str, timeout: float = 300) -> None:
        """Until the process used under a tenth of a core over two seconds (it has handled what came)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = self.usage(name)[0]
            time.sleep(2)
            if self.usage(name)[0] - before < 0.2:
                return

    def restart_controller(self, namespace: str) -> tuple[float, int]:
        """Stop the controller, start a new one and let it list everything: its CPU and peak RSS. A
        probe slice made before the start (pinned to no node: Pending with a reason once handled)
        shows the new one has finished its start and reached the watch's initial list."""
        proc = self.procs["controller"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "restart-probe"},
                 "spec": {"memory": "1Gi", "nodeName": "no-such-node"}}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, probe)
        self.spawn("controller", "controller", "--peering", f"bench-{os.getpid()}")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            body = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, "restart-probe")
            if (body.get("status") or {}).get("reason"):
                break
            time.sleep(1)
        self.wait_idle("controller")
        return self.usage("controller")

    def stop(self) -> None:
        for name in self.procs:
            if self.procs[name].poll() is None:
                self.stats[name] = self.usage(name)
                self.procs[name].send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run([self.plane.kubectl, "delete", "mutatingwebhookconfiguration", "--ignore-not-found",
                        f"bench-{os.getpid()}"], env=self.plane.env, capture_output=True)
        for name in self.names:
            for delete in (lambda n: self.custom.delete_cluster_custom_object(GROUP, VERSION, "gpunodes", n),
                           self.core.delete_node):
                try:
                    delete(name)
                except kubernetes.client.ApiException:
                    pass


@dataclass
class Busy:
    """A Ready slice's device with one process, as the benchmark sets it."""

    name: str
    node: str
    device: str  # MIG device UUID
    size: int  # bytes granted
    pid: int
    base: float  # the share of the slice held, around which every round moves it
    used: int = 0  # bytes held now

    def shows(self, usage: object) -> bool:
        """Whether the slice's status.usage shows this device's process and its memory within the round's
        moves (a write is due otherwise)."""
        return (isinstance(usage, dict) and usage.get("processes") == 1
                and abs(int(usage.get("memoryUsed", -1)) - self.base * self.size) <= USAGE_JITTER * self.size + 1)


def set_node_usage(state_file: Path, devices: list[Busy]) -> None:
    """The node's simulated devices' usage, written into its agent's state file in one go, under the
    simulator's own file lock (gpu/simulated.py), as ``SimulatedBackend.set_usage`` would one by one."""
    with open(f"{state_file}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(state_file.read_bytes())
            data["usage"] = {b.device: {"memoryUsed": b.used, "pids": [b.pid], "activePercent": None}
                             for b in devices}
            save_state(str(state_file), data)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def measure_usage(args: argparse.Namespace, cluster: Cluster, slices: Callable[[], list[dict]],
                  rng: random.Random) -> dict:
    """The --usage window (module docstring): kube-apiserver's count of the slices' status writes while
    every slice's process moves, against the writes its big moves make due."""
    busy = [Busy(b["metadata"]["name"], st["node"], st["deviceUUID"], int(st["grantedBytes"]), 10_000 + i,
                 USAGE_BASE)
            for i, b in enumerate(slices()) for st in [b.get("status") or {}]
            if st.get("phase") == "Ready" and st.get("mode") == "mig" and st.get("deviceUUID")]
    by_node: dict[str, list[Busy]] = {}
    for b in busy:
        by_node.setdefault(b.node, []).append(b)

    def move_all() -> None:
        for b in busy:
            b.used = int(b.size * (b.base + rng.uniform(-USAGE_JITTER, USAGE_JITTER)))
        for node, devices in by_node.items():
            set_node_usage(cluster.state_file(node), devices)

    def missing() -> list[str]:
        shown = {body["metadata"]["name"]: (body.get("status") or {}).get("usage") for body in slices()}
        return [b.name for b in busy if not b.shows(shown.get(b.name))]

    def wait_shown(seconds: float) -> list[str]:
        deadline = time.monotonic() + seconds
        while (left := missing()) and time.monotonic() < deadline:
            time.sleep(1)
        return left

    print(f"usage: {len(busy)} slices busy, {USAGE_BASE:.0%} of each held", flush=True)
    phase_before = cluster.plane.apiserver_writes()
    move_all()
    left = wait_shown(USAGE_FIRST_WRITES_S)
    if left:
        print(f"usage: {len(left)} slices do not show their process after {USAGE_FIRST_WRITES_S:.0f} s "
              f"(e.g. {left[:3]})", flush=True)
    rounds = max(1, int(args.usage_seconds // USAGE_INTERVAL_S))
    big = max(1, round(USAGE_BIG_SHARE * len(busy)))
    agents = [name for name in cluster.procs if name.startswith("agent-")]
    cpu_before = sum(cluster.usage(name)[0] for name in agents)
    before = cluster.plane.apiserver_writes()
    started = time.monotonic()
    for r in range(rounds):
        time.sleep(max(0.0, started + r * USAGE_INTERVAL_S - time.monotonic()))
        for b in rng.sample(busy, big):
            b.base += USAGE_BIG if b.base <= USAGE_BASE else -USAGE_BIG
        move_all()
    time.sleep(max(0.0, started + rounds * USAGE_INTERVAL_S - time.monotonic()))
    left = wait_shown(USAGE_INTERVAL_S * 3)  # the last round's big moves, written late on a loaded machine
    elapsed = time.monotonic() - started
    after = cluster.plane.apiserver_writes()
    cpu = sum(cluster.usage(name)[0] for name in agents) - cpu_before
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    window = rounds * USAGE_INTERVAL_S
    writes = delta.get("gpuslices/status", 0)
    print(f"usage: {writes:.0f} status writes in {window:.0f} s ({writes / window:.2f}/s; "
          f"{big * rounds} due to big moves)", flush=True)
    return {
        "slices_busy": len(busy), "interval_s": USAGE_INTERVAL_S, "rounds": rounds, "window_s": window,
        "window_measured_s": elapsed, "big_moves_per_round": big,
        "usage_writes": writes, "usage_writes_expected": big * rounds,
        "usage_writes_per_s": writes / window, "usage_writes_per_s_expected": big / USAGE_INTERVAL_S,
        "other_slice_writes": delta.get("gpuslices", 0), "event_writes": delta.get("events", 0),
        "agents_cpu_s_per_s": cpu / elapsed,
        "not_shown": left,  # slices whose status does not show what their device holds at the end
        # Every slice write from the devices made busy to the window's end: left out of slice_writes_per_slice.
        "phase_slice_writes": sum(after.get(k, 0) - phase_before.get(k, 0) for k in ("gpuslices", "gpuslices/status")),
    }


def size_mix(text: str) -> list[tuple[str, float]]:
    """``--sizes``: ``5Gi`` or ``5Gi:0.6,15Gi:0.25,30Gi:0.15`` (memory asked, weight)."""
    mix = []
    for item in text.split(","):
        size, _, weight = item.strip().partition(":")
        parse_memory(size)  # a bad size stops the run before anything starts
        mix.append((size, float(weight) if weight else 1.0))
    return mix


def run(args: argparse.Namespace) -> dict:
    plane = Plane()
    agent_args = ("--usage-interval", f"{USAGE_INTERVAL_S:g}") if args.usage else ()
    cluster = Cluster(plane, args.nodes, args.latency, args.log_level, agent_args=agent_args)
    ns = f"bench-{os.getpid()}"
    cluster.core.create_namespace({"metadata": {"name": ns}})
    rng = random.Random(args.seed)
    created: dict[str, float] = {}

    # The benchmark's own API calls go through the operator's light asynchronous client: the
    # generated client's models cost more CPU than the operator itself on a 2-core machine.
    fast = KubeClient(load_configuration(plane.kubeconfig), connections=32)
    loop = asyncio.new_event_loop()

    def create(name: str, memory: str) -> None:
        create_many([(name, memory)])

    def create_many(pairs: list[tuple[str, str]]) -> None:
        async def one(name: str, memory: str, gate: asyncio.Semaphore) -> None:
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name},
                    "spec": {"memory": memory}}
            async with gate:
                created[name] = time.time()
                await fast.create(slices_path(ns), body)

        async def all_of() -> None:
            gate = asyncio.Semaphore(32)
            await asyncio.gather(*(one(n, m, gate) for n, m in pairs))

        loop.run_until_complete(all_of())

    def sizes(n: int) -> list[str]:
        return rng.choices([s for s, _ in args.sizes], weights=[w for _, w in args.sizes], k=n)

    def slices() -> list[dict]:
        return loop.run_until_complete(fast.list(slices_path(ns)))

    if args.flood:
        flood_ns = f"flood-{os.getpid()}"
        cluster.core.create_namespace({"metadata": {"name": flood_ns}})
        blob = {"tenant.example.com/blob": "x" * FLOOD_BLOB}

        async def flood() -> None:
            gate = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with gate:
                    await fast.create(slices_path(flood_ns), {
                        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice",
                        "metadata": {"name": f"f-{i:05d}", "annotations": blob},
                        "spec": {"migProfile": "7g.80gb", "nodeName": "no-such-node"}})

            await asyncio.gather(*(one(i) for i in range(args.flood)))

        started = time.monotonic()
        loop.run_until_complete(flood())
        print(f"flood: {args.flood} slices of {FLOOD_BLOB} bytes made in {time.monotonic() - started:.0f} s",
              flush=True)
        cluster.wait_idle("controller")

    before = plane.apiserver_writes()
    print(f"burst: {args.slices} slices on {args.nodes} nodes x 8 H100, NVML latency {args.latency} s", flush=True)
    create_many([(f"s-{i:04d}", m) for i, m in enumerate(sizes(args.slices))])
    create_s = time.time() - min(created.values())
    deadline = time.monotonic() + 300
    while True:
        phases = [(b.get("status") or {}).get("phase") for b in slices()]
        if sum(p in ("Ready", "Pending", "Failed") for p in phases) == args.slices:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    burst = slices()
    bound_times = sorted(stamp(b["status"]["phaseTimes"]["Bound"]) for b in burst
                         if "Bound" in (b.get("status") or {}).get("phaseTimes", {}))
    first_create = min(created.values())
    bound_per_s = len(bound_times) / (bound_times[-1] - first_create) if bound_times else 0.0
    print(f"burst settled: {sum(p == 'Ready' for p in phases)} Ready, bound {bound_per_s:.0f}/s", flush=True)

    burst_latency = [stamp(b["status"]["phaseTimes"]["Ready"]) - created[b["metadata"]["name"]] for b in burst
                     if (b.get("status") or {}).get("phase") == "Ready"]
    usage = measure_usage(args, cluster, slices, rng) if args.usage else None

    # Churn: replace one Ready slice at a time with a new one of a size drawn from the same mix, for
    # args.churn s: most find an idle instance of their size, the others need a new one.
    churned = 0
    ends = time.monotonic() + args.churn
    ready = [b for b in burst if (b.get("status") or {}).get("phase") == "Ready"]
    rng.shuffle(ready)
    while time.monotonic() < ends and ready:
        victim = ready.pop()
        loop.run_until_complete(fast.delete(slice_path(ns, victim["metadata"]["name"])))
        create(f"c-{churned:04d}", sizes(1)[0])
        churned += 1
        time.sleep(args.churn_gap)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        items = slices()
        if all((b.get("status") or {}).get("phase") in ("Ready", "Pending", "Failed") for b in items):
            break
        time.sleep(0.5)
    items = slices()
    after = plane.apiserver_writes()
    cluster.wait_idle("controller")
    first_controller = cluster.usage("controller")
    restarted = cluster.restart_controller(ns)
    loop.run_until_complete(fast.close())
    loop.close()
    cluster.stop()
    cluster.stats["controller"] = first_controller
    plane_dir = plane.dir
    cluster.core.delete_namespace(ns)

    new, reused, left = [], [], []
    for body in items:
        st = body.get("status") or {}
        name = body["metadata"]["name"]
        if st.get("phase") != "Ready":
            left.append(f"{name}: {st.get('phase')} {st.get('reason', '')}")
            continue
        if not name.startswith("c-"):
            continue  # the burst's are reported apart
        took = stamp(st["phaseTimes"]["Ready"]) - created[name]
        (reused if st.get("reused") else new).append(took)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    total_slices = args.slices + churned
    # The benchmark itself created every slice once and deleted `churned` of them.
    slice_writes = delta.get("gpuslices", 0) + delta.get("gpuslices/status", 0) - total_slices - churned
    slice_writes -= usage["phase_slice_writes"] if usage is not None else 0
    agents = [v for k, v in cluster.stats.items() if k.startswith("agent-")]
    result = {
        "nodes": args.nodes, "gpus": args.nodes * 8, "slices": args.slices, "churned": churned,
        "flood_slices": args.flood, "flood_annotation_bytes": FLOOD_BLOB if args.flood else 0,
        "latency_s": args.latency,
        "burst_all_new": {"n": len(burst_latency), "p50_ms": 1000 * pct(burst_latency, 0.5),
                          "p99_ms": 1000 * pct(burst_latency, 0.99)},
        "churn_new": {"n": len(new), "p50_ms": 1000 * pct(new, 0.5), "p99_ms": 1000 * pct(new, 0.99)},
        "churn_reused": {"n": len(reused), "p50_ms": 1000 * pct(reused, 0.5), "p99_ms": 1000 * pct(reused, 0.99)},
        "bound_per_s": bound_per_s,
        "burst_create_s": create_s,  # how long the benchmark itself took to send the burst's creates
        "slice_writes_per_slice": slice_writes / total_slices,
        "gpunode_writes": delta.get("gpunodes", 0) + delta.get("gpunodes/status", 0),
        "event_writes": delta.get("events", 0),
        "not_ready": left,
        "controller": {"cpu_s": cluster.stats["controller"][0], "peak_rss_mib": cluster.stats["controller"][1] / 2**20},
        "controller_restart": {"cpu_s": restarted[0], "peak_rss_mib": restarted[1] / 2**20},
        "agents": {"cpu_s_total": sum(a[0] for a in agents), "cpu_s_max": max(a[0] for a in agents),
                   "peak_rss_mib_max": max(a[1] for a in agents) / 2**20},
        "logs": str(plane_dir),
    }
    if usage is not None:
        result["usage"] = usage
    plane.down()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.0, help="simulated seconds per NVML create/destroy")
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--slices", type=int, default=500)
    parser.add_argument("--churn", type=float, default=60.0, help="seconds of churn after the burst")
    parser.add_argument("--churn-gap", type=float, default=0.2, help="seconds between churn replacements")
    parser.add_argument("--flood", type=int, default=0, help="Pending slices with a 200 kB annotation, made first")
    parser.add_argument("--sizes", type=size_mix, default=SIZES,
                        help="the burst's mix: SIZE[:WEIGHT],... (default 5Gi:0.6,15Gi:0.25,30Gi:0.15)")
    parser.add_argument("--usage", action="store_true", help="measure the agents' status writes of usage")
    parser.add_argument("--usage-seconds", type=float, default=120.0, help="with --usage: the window, seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--log-level", default="info", help="of the controller and agents (logs kept with --keep)")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if not result["not_ready"] and not result.get("usage", {}).get("not_shown") else 1


if __name__ == "__main__":
    sys.exit(main())
