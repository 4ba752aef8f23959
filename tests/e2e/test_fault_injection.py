"""Fault injection: the controller talks to kube-apiserver through a proxy that, for a window in the
middle of a burst of slices and pods, answers about 30 % of its writes with 500, 409 or 429
(tests/e2e/faulty_proxy.py). Afterwards every slice is Ready with its claim allocated to its own
device, every pod Running on its slice's node, no device is bound twice (checked from the slices'
statuses and the simulator's state, not from the controller's books), and the controller's work
queue counted the retries it made.

The size is configurable: MIG_OPERATOR_FAULT_SLICES (default 200) slices made directly and
MIG_OPERATOR_FAULT_PODS (default 50) annotated pods (each gets a slice through the controller's webhook
and runs on a kwok node once ungated), MIG_OPERATOR_FAULT_WINDOW_S (default 60) seconds of faults; a
quarter of the burst is made before the window, half during it, the rest after.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from faulty_proxy import FaultyProxy
from harness import OperatorHarness, check_invariants, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import free_port

SLICES = int(os.environ.get("MIG_OPERATOR_FAULT_SLICES", "200"))
PODS = int(os.environ.get("MIG_OPERATOR_FAULT_PODS", "50"))
WINDOW_S = float(os.environ.get("MIG_OPERATOR_FAULT_WINDOW_S", "60"))
PER_GPU = 7  # 1g.10gb instances an H100-80GB holds
GPUS_PER_NODE = 16  # the most a GpuNode lists


def _retries(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.labels["kind"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "mig_operator_workqueue_retries_total"}


def _claims(operator: OperatorHarness, namespace: str) -> list[dict[str, Any]]:
    return operator.custom.list_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims")["items"]


def _pod(name: str) -> dict[str, Any]:
    """An annotated pod (the webhook gives it its gate, label and claim; kwok runs it)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {"cdmo.io/gpu-memory": "5Gi"}},
            "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                     "containers": [{"name": "main", "image": "busybox"}]}}


def test_a_burst_through_failing_writes_ends_with_every_slice_ready_once(operator: OperatorHarness,
                                                                         tmp_path: Path) -> None:
    total = SLICES + PODS
    nodes = [operator.add_node("h100-80gb", count=GPUS_PER_NODE)
             for _ in range(math.ceil(total / (PER_GPU * GPUS_PER_NODE)))]
    for node in nodes:
        operator.agent(node)
    for node in nodes:
        operator.wait_gpunode(node, timeout=60)
    admin = yaml.safe_load(operator.cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    own = yaml.safe_load(operator.kubeconfigs.get("controller", operator.cluster.kubeconfig).read_text())
    proxy = FaultyProxy(admin["server"], admin["certificate-authority"], rate=0.3)
    controller = None
    try:
        operator.kubeconfigs["controller"] = proxy.kubeconfig(tmp_path / "proxy.kubeconfig",
                                                              own["users"][0]["user"]["token"])
        port = free_port()
        controller = operator.controller_with_webhook(None, "--metrics-address", f"127.0.0.1:{port}")
        operator.wait_webhook()
        ns = operator.namespace()
        # Slices and pods interleaved: ("slice", name) or ("pod", name).
        work = [("pod" if PODS and i % max(1, total // PODS) == 0 and i // max(1, total // PODS) < PODS
                 else "slice", f"w{i:03d}") for i in range(total)]
        before, during, after = work[:total // 4], work[total // 4:3 * total // 4], work[3 * total // 4:]

        def make(item: tuple[str, str]) -> None:
            kind, name = item
            if kind == "pod":
                operator.core.create_namespaced_pod(ns, _pod(name))
            else:
                operator.create_slice(ns, name, {"memory": "5Gi"})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(make, before))
            proxy.faulty = True
            started = time.monotonic()
            for i, item in enumerate(during):  # spread over the window
                make(item)
                time.sleep(max(0.0, started + WINDOW_S * (i + 1) / max(1, len(during)) - time.monotonic()))
            proxy.faulty = False
            list(pool.map(make, after))
        pods = [name for kind, name in work if kind == "pod"]

        def not_ready() -> list[str]:
            slices = operator.slices(ns)
            waiting = [s["metadata"]["name"] for s in slices if (s.get("status") or {}).get("phase") != "Ready"]
            running = {p.metadata.name for p in operator.core.list_namespaced_pod(ns).items
                       if p.status.phase == "Running" and p.spec.node_name}
            missing = max(0, total - len(slices))
            return sorted(waiting) + [f"pod {p}" for p in pods if p not in running] + ["(slice)"] * missing

        wait_until(lambda: not not_ready(), 300, lambda: (
            f"every slice Ready and pod Running; not yet: {not_ready()[:10]} ({len(not_ready())}); "
            f"injected {dict(proxy.injected)}\n{operator.logs()}"), interval=1.0)
        injected = dict(proxy.injected)
        assert sum(injected.values()) > 0 and set(injected) == {500, 409, 429}, injected

        # No device twice: each Ready slice its own GPU instance (node, GPU, GI and device UUID), their
        # placements apart, and each instance there in the simulator (check_invariants reads its state).
        slices = operator.slices(ns)
        statuses = [s["status"] for s in slices]
        assert len(statuses) == total
        devices = Counter(st["deviceUUID"] for st in statuses)
        instances = Counter((st["node"], st["gpu"], st["giId"]) for st in statuses)
        assert max(devices.values()) == 1 and max(instances.values()) == 1, (devices.most_common(2),
                                                                             instances.most_common(2))
        check_invariants(operator)
        # Each pod on its own slice's node.
        by_name = {s["metadata"]["name"]: s for s in slices}
        for pod in operator.core.list_namespaced_pod(ns).items:
            own_slice = by_name[pod.metadata.labels["cdmo.io/gpu-slice"]]
            assert own_slice["status"]["node"] == pod.spec.node_name, pod.metadata.name
            assert [r["uid"] for r in own_slice["metadata"]["ownerReferences"]] == [pod.metadata.uid]

        # Each slice's claim allocated to its own device on its node; no device in two claims.
        def allocated() -> dict[str, tuple[str, str]]:
            found = {}
            for claim in _claims(operator, ns):
                results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
                           .get("results") or [])
                if results:
                    found[claim["metadata"]["name"]] = (results[0]["pool"], results[0]["device"])
            return found

        wait_until(lambda: len(allocated()) == total, 120, lambda: (
            f"every claim allocated: {len(allocated())} of {total}\n{operator.logs()}"), interval=1.0)
        claimed = allocated()
        assert len(set(claimed.values())) == total
        for name, (pool, device) in claimed.items():
            assert (pool, device) == (by_name[name]["status"]["node"], by_name[name]["metadata"]["uid"]), name
        for claim in _claims(operator, ns):
            owners = [r["uid"] for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "GpuSlice"]
            assert owners == [by_name[claim["metadata"]["name"]]["metadata"]["uid"]], claim["metadata"]

        retries = _retries(port)
        assert sum(retries.values()) > 0, (retries, injected)
    finally:
        if controller is not None:
            operator.stop(controller)
        proxy.close()
