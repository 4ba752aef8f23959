"""Annotated pods, created to Running: 100 pods on kwok nodes, with new instances and then reused
ones, against plain pods (no annotation) in the same run.

    .venv/bin/python bench/pod_latency.py [--pods 100] [--nodes 4] [--latency 0] [--gap 0] [--json out.json]

The whole path runs for real: the admission webhook (served by the controller), the pod's GpuSlice,
binding, the agent (simulated GPUs) and its ResourceSlice, the slice's ResourceClaim and its allocation
(the controller's), ungating, kube-scheduler reserving the claim and binding the pod, kwok starting it.
Created-to-Running is measured from just before the client's create call to the moment a watch on the pods first shows
the pod Running (this machine's clock for both). First round: plain pods, the baseline. Then every
annotated pod needs a new MIG instance; then all pods are deleted, and the last round finds the
instances idle and reuses them. Writes per pod: kube-apiserver's own count of non-GET requests
during a round (every client: operator, scheduler, controller-manager, kwok), over the pods. CPU
per pod: each part's CPU time over the round, over the pods (where two vCPUs go in a burst).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_scale import Cluster, Plane, pct, stamp  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PLANE_PROGRAMS = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok")


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
               gap_s: float = 0.0) -> dict[str, list[float]]:
    """Create ``pods`` pods (annotated for ``memory``; plain when None) at once: seconds from create
    to first seen Running, each; and the two halves, create to the slice's Ready (its
    status.phaseTimes) and from there to Running."""
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
    ready = {}
    for body in custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]:
        owner = (body["metadata"].get("labels") or {}).get("cdmo.io/pod", "")
        if owner in created and "Ready" in body["status"].get("phaseTimes", {}):
            ready[owner] = stamp(body["status"]["phaseTimes"]["Ready"])
    return {
        "total": [running[n] - created[n] for n in created],
        "to_slice_ready": [ready[n] - created[n] for n in ready],
        "slice_ready_to_running": [running[n] - ready[n] for n in ready],
        # Where Ready to Running goes: the controller (device check, claim, ungate), kube-scheduler
        # (claim allocation, binding), kwok (Running).
        "slice_ready_to_ungated": [ungated[n] - ready[n] for n in ready if n in ungated],
        "ungated_to_bound": [bound[n] - ungated[n] for n in ungated if n in bound],
        "bound_to_running": [running[n] - bound[n] for n in bound if n in running],
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
    parser.add_argument("--json")
    args = parser.parse_args()
    plane = Plane("scheduler,controller-manager,kwok")  # pods need binding; deleted pods' slices need GC
    port = free_port()
    cluster = Cluster(plane, args.nodes, args.latency, controller_args=(
        "--webhook", f"127.0.0.1:{port}", "--webhook-config", f"bench-{os.getpid()}", "--namespace", "kube-system"))
    core = cluster.core
    ns = f"pods-{os.getpid()}"
    core.create_namespace({"metadata": {"name": ns}})
    time.sleep(2)  # the webhook configuration is in place
    custom = kubernetes.client.CustomObjectsApi(plane.api)
    writes: dict[str, float] = {}
    by_resource: dict[str, dict[str, float]] = {}
    cpu: dict[str, dict[str, float]] = {}
    events: dict[str, dict[str, int]] = {}  # component/reason -> Events (counts included) on the round's pods

    def measured(memory: str | None, tag: str) -> dict[str, list[float]]:
        before, cpu_before = plane.apiserver_writes(), cpu_seconds(cluster)
        times = round_trip(core, ns, args.pods, memory, tag, args.gap)
        after, cpu_after = plane.apiserver_writes(), cpu_seconds(cluster)
        cpu[tag] = {part: round(1000 * (cpu_after[part] - cpu_before.get(part, 0.0)) / args.pods, 2)
                    for part in sorted(cpu_after)}
        delta = {key: (after[key] - before.get(key, 0.0)) / args.pods for key in after}
        writes[tag] = sum(delta.values())
        by_resource[tag] = {key: round(value, 2) for key, value in sorted(delta.items()) if value >= 0.01}
        reasons: dict[str, int] = {}
        for event in core.list_namespaced_event(ns).items:
            if (event.involved_object.name or "").startswith(tag):
                key = f"{event.source.component or event.reporting_component}/{event.reason}"
                reasons[key] = reasons.get(key, 0) + (event.count or 1)
        events[tag] = dict(sorted(reasons.items()))
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        # The next round starts once this one's objects are gone: pods, slices and their claims (the
        # garbage collector deletes a claim after its slice), so no clean-up is counted in it.
        deadline = time.monotonic() + 120
        while (custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]
               or custom.list_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims")["items"]
               or core.list_namespaced_pod(ns).items):
            if time.monotonic() > deadline:
                raise SystemExit("the deleted pods' slices and claims were not gone in 120 s")
            time.sleep(0.5)
        return times

    try:
        plain = measured(None, "plain")
        new = measured("9Gi", "new")
        reused = measured("9Gi", "again")
    finally:
        cluster.stop()
        core.delete_namespace(ns)
        plane.down()
    def summary(times: dict[str, list[float]]) -> dict:
        out = {part: {"p50_ms": 1000 * pct(v, 0.5), "p99_ms": 1000 * pct(v, 0.99)}
               for part, v in times.items() if part not in ("send_s", "watches_reopened") and v}
        out["send_s"] = times["send_s"][0]  # how long the benchmark took to send its creates
        out["watches_reopened"] = int(times["watches_reopened"][0])
        return out

    result = {"pods": args.pods, "nodes": args.nodes, "gpus": args.nodes * 8, "latency_s": args.latency,
              "gap_s": args.gap, "plain": {key: summary(plain)[key] for key in ("total", "send_s", "watches_reopened")},
              "new": summary(new), "reused": summary(reused),
              "writes_per_pod": {"plain": writes["plain"], "new": writes["new"], "reused": writes["again"]},
              "writes_per_pod_by_resource": {"plain": by_resource["plain"], "new": by_resource["new"],
                                             "reused": by_resource["again"]},
              # CPU milliseconds per pod by part, from the round's start to its last pod Running.
              "cpu_ms_per_pod": {"plain": cpu["plain"], "new": cpu["new"], "reused": cpu["again"]},
              "events": {"plain": events["plain"], "new": events["new"], "reused": events["again"]}}
    baseline = pct(plain["total"], 0.5)
    result["ratio_p50"] = {"new": pct(new["total"], 0.5) / baseline, "reused": pct(reused["total"], 0.5) / baseline}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
