"""Autoscaling: how long waiting slices take to get GPU nodes from a real Karpenter, and idle nodes to go.

    .venv/bin/python bench/autoscaling.py [--slices 8] [--backend capacitybuffer|placeholder]
                                          [--consolidate-after 5s] [--json out.json]

Everything runs for real on this machine: the local control plane with Karpenter's kwok provider
(``scripts/control-plane up --with ...,karpenter``; its GPU node shapes in scripts/karpenter/), one
controller with an autoscaling pool of two-GPU H200 nodes (``gpu-h200-2``), and an agent on simulated
GPUs started on each node Karpenter makes, as the chart's DaemonSet would. The slices ask for 4g.71gb:
a 4g takes 4 of an H200's 7 compute slots, so each GPU holds one and ``--slices N`` needs N/2 nodes.

Measured, from just before the first create (one machine, one clock; polled every 0.2 s):
- every slice Pending with reason WaitingForNode;
- the CapacityBuffer at the node count (or that many placeholder pods made);
- that many NodeClaims; that many Nodes Ready; their GpuNodes published; every slice Ready;
then, from just before the deletes: every slice gone, and every node and NodeClaim gone (Karpenter's
consolidation, ``consolidateAfter`` of the NodePool, one node at a time).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_scale import GROUP, REPO, SLICES, VERSION, Plane  # noqa: E402

POOL = "bench-h200"
NAMESPACE = "bench-autoscaling"
OPERATOR_NAMESPACE = "mig-operator-system"
MIG_LABEL = "cdmo.clear.ml/gpu-partitioning"
COMPONENTS = "scheduler,controller-manager,kwok,karpenter"


def wait(what: str, done: Callable[[], object], timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--backend", choices=("capacitybuffer", "placeholder"), default="capacitybuffer")
    parser.add_argument("--consolidate-after", default="5s")
    parser.add_argument("--json")
    args = parser.parse_args()
    nodes_needed = (args.slices + 1) // 2
    plane = Plane(COMPONENTS)
    procs: dict[str, subprocess.Popen] = {}
    try:
        core = kubernetes.client.CoreV1Api(plane.api)
        custom = kubernetes.client.CustomObjectsApi(plane.api)

        def apply(*docs: dict) -> None:
            subprocess.run([plane.kubectl, "apply", "--server-side", "--force-conflicts", "-f", "-"],
                           input=yaml.safe_dump_all(list(docs)), text=True, env=plane.env, check=True,
                           capture_output=True)

        def spawn(name: str, *argv: str) -> None:
            log = open(plane.dir / f"{name}.log", "w")  # noqa: SIM115 (open for the process's life)
            procs[name] = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", *argv], env=plane.env,
                                           stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

        for crd in sorted((REPO / "crds").glob("*.yaml")):
            subprocess.run([plane.kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(crd)],
                           env=plane.env, check=True, capture_output=True)
        apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
              {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
              {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "bench-placeholder"},
               "value": -10, "preemptionPolicy": "Never"},
              {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": POOL}},
              {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": POOL}, "spec": {
                  "template": {"metadata": {"labels": {MIG_LABEL: "mig"}}, "spec": {
                      "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": POOL},
                      "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                        "values": ["gpu-h200-2"]}],
                      "expireAfter": "Never"}},
                  "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": args.consolidate_after}}})
        pools = plane.dir / "pools.json"
        pools.write_text(json.dumps([{"name": POOL, "nodeLabels": {"karpenter.sh/nodepool": POOL, MIG_LABEL: "mig"},
                                      "gpuModel": "h200-141gb", "gpusPerNode": 2, "cpu": "32", "memory": "128Gi"}]))
        spawn("controller", "controller", "--peering", "bench-autoscaling", "--namespace", OPERATOR_NAMESPACE,
              "--autoscaling-pools", str(pools), "--autoscaling-backend", args.backend,
              "--placeholder-priority-class", "bench-placeholder")
        time.sleep(3)  # the controller's first full read (nothing to poll for on an empty cluster)
        names = [f"s{i:03d}" for i in range(args.slices)]

        def statuses() -> list[dict]:
            items = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, SLICES)["items"]
            return [i.get("status") or {} for i in items]

        def karpenter_nodes() -> list:
            return [n for n in core.list_node(label_selector=f"karpenter.sh/nodepool={POOL}").items
                    if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())]

        def start_agents() -> int:
            ready = karpenter_nodes()
            for node in ready:
                name = node.metadata.name
                if f"agent-{name}" not in procs:
                    spawn(f"agent-{name}", "agent", "--node", name, "--backend", "sim:h200-141gbx2",
                          "--state-file", str(plane.dir / f"{name}.json"))
            return len(ready)

        def asked() -> bool:
            if args.backend == "capacitybuffer":
                try:
                    buffer = custom.get_namespaced_custom_object("autoscaling.x-k8s.io", "v1beta1", OPERATOR_NAMESPACE,
                                                                 "capacitybuffers", f"mig-operator-{POOL}")
                except kubernetes.client.ApiException:
                    return False
                return buffer["spec"].get("replicas") == nodes_needed
            log = (plane.dir / "controller.log").read_text()
            return f"pool {POOL} asks for {nodes_needed} new node(s) (placeholder pods)" in log

        def claims() -> int:
            return len(custom.list_cluster_custom_object("karpenter.sh", "v1", "nodeclaims",
                                                         label_selector=f"karpenter.sh/nodepool={POOL}")["items"])

        t0 = time.monotonic()
        for name in names:
            custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, SLICES, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name},
                "spec": {"migProfile": "4g.71gb"}})
        marks = {}
        marks["waiting_for_node"] = wait("WaitingForNode", lambda: (s := statuses()) and len(s) == args.slices and all(
            x.get("reason") == "WaitingForNode" for x in s)) - t0
        marks["asked"] = wait("the ask", asked) - t0
        marks["node_claims"] = wait("NodeClaims", lambda: claims() >= nodes_needed) - t0
        marks["nodes_ready"] = wait("Nodes Ready", lambda: start_agents() >= nodes_needed) - t0
        marks["gpunodes"] = wait("GpuNodes", lambda: len(custom.list_cluster_custom_object(
            GROUP, VERSION, "gpunodes")["items"]) >= nodes_needed) - t0
        marks["slices_ready"] = wait("slices Ready", lambda: all(x.get("phase") == "Ready" for x in statuses())) - t0
        extra_nodes = claims() - nodes_needed
        t1 = time.monotonic()
        for name in names:
            custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, SLICES, name)
        marks["slices_gone"] = wait("slices gone", lambda: not statuses()) - t1

        def nodes_gone() -> bool:
            ready = {n.metadata.name for n in karpenter_nodes()}
            for name in [p.removeprefix("agent-") for p in procs if p.startswith("agent-")]:
                if name not in ready and procs[f"agent-{name}"].poll() is None:
                    procs[f"agent-{name}"].send_signal(signal.SIGTERM)
            return not ready and not claims()
        marks["nodes_gone"] = wait("nodes consolidated", nodes_gone, timeout=900) - t1
        result = {"slices": args.slices, "nodes": nodes_needed, "extra_nodes": extra_nodes, "backend": args.backend,
                  "consolidate_after": args.consolidate_after, "seconds": {k: round(v, 1) for k, v in marks.items()}}
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        plane.down()


if __name__ == "__main__":
    raise SystemExit(main())
