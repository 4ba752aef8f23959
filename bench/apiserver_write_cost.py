"""kube-apiserver's CPU per write, by the kind of write an annotated pod costs.

    .venv/bin/python bench/apiserver_write_cost.py [--writes 100] [--json out.json]

Starts the local control plane (or reuses MIG_OPERATOR_RUN's), four agents on simulated H100s so
that a GpuNode has its real size, then stops them so that nothing else writes, and makes ``--writes``
writes of each kind one after the other. Figure: kube-apiserver's CPU time (user + system, from
/proc) over the writes, divided by their number; and the wall time per write as this client saw it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_scale import GROUP, VERSION, Cluster, Plane  # noqa: E402


def apiserver_cpu_s() -> float:
    """kube-apiserver's CPU seconds so far (the one on this machine)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode()).name == "kube-apiserver":
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, UnicodeDecodeError):
            continue
    raise SystemExit("no kube-apiserver process found")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=100)
    parser.add_argument("--json")
    args = parser.parse_args()
    plane = Plane("scheduler,controller-manager,kwok")
    cluster = Cluster(plane, 4, 0.0)
    custom = kubernetes.client.CustomObjectsApi(plane.api)
    core = cluster.core
    gpunode = custom.get_cluster_custom_object(GROUP, VERSION, "gpunodes", cluster.names[0])
    for proc in cluster.procs.values():
        proc.kill()  # nothing but this client writes from here on
    ns = f"write-cost-{os.getpid()}"
    core.create_namespace({"metadata": {"name": ns}})
    results: dict[str, dict[str, float]] = {}

    def measure(kind: str, write: Callable[[int], object]) -> None:
        time.sleep(1.0)  # let the previous kind's watch fan-out settle
        cpu, wall = apiserver_cpu_s(), time.perf_counter()
        for i in range(args.writes):
            write(i)
        results[kind] = {"apiserver_cpu_ms": round(1000 * (apiserver_cpu_s() - cpu) / args.writes, 2),
                         "wall_ms": round(1000 * (time.perf_counter() - wall) / args.writes, 2)}
        print(f"{kind}: {results[kind]}", flush=True)

    def gpunode_status(i: int) -> None:  # the agent's publish: the whole status, one field changed
        body = copy.deepcopy(gpunode["status"])
        body["observedAt"] = f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z"
        custom.patch_cluster_custom_object_status(GROUP, VERSION, "gpunodes", cluster.names[0], {"status": body})

    try:
        measure("GpuNode status (whole, as the agent publishes it)", gpunode_status)
        measure("GpuSlice create", lambda i: custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "gpuslices", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice",
                                              "metadata": {"name": f"s{i}"}, "spec": {"memory": "9Gi"}}))
        measure("GpuSlice status merge patch", lambda i: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, "gpuslices", f"s{i}", {"status": {"phase": "Pending", "reason": "NoCapacity",
                                                                  "message": "m" * 100}}))
        measure("GpuSlice metadata merge patch (a finalizer)", lambda i: custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, "gpuslices", f"s{i}", {"metadata": {"finalizers": ["cdmo.io/bench"]}}))
        measure("ResourceClaim create", lambda i: custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", ns, "resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": f"c{i}"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpuslice.cdmo.io", "allocationMode": "ExactCount", "count": 1,
                    "selectors": [{"cel": {"expression": f'device.attributes["gpu.cdmo.io"].slice == "u{i}"'}}]}}]}}}))
        measure("Pod create (gated; no webhook)", lambda i: core.create_namespaced_pod(ns, {
            "metadata": {"name": f"p{i}"},
            "spec": {"schedulingGates": [{"name": "bench"}], "containers": [{"name": "main", "image": "busybox"}]}}))
        measure("Event create", lambda i: core.create_namespaced_event(ns, {
            "metadata": {"name": f"e{i}"}, "involvedObject": {"kind": "Pod", "name": f"p{i}", "namespace": ns},
            "reason": "Bench", "message": "m", "type": "Normal"}))
    finally:
        for i in range(args.writes):
            try:
                custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices", f"s{i}",
                                                      {"metadata": {"finalizers": None}})
            except kubernetes.client.ApiException:
                pass
        cluster.stop()
        core.delete_namespace(ns)
        plane.down()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
