"""Fault injection: the controller (with its webhook) and every node agent talk to kube-apiserver through
a proxy that, for a window in the middle of a burst of slices and pods, answers about 30 % of their writes
with 500, 409 or 429 (tests/e2e/faulty_proxy.py). During the window some of the slices and pods made
before it are deleted. Within 60 s after the window every slice left is Ready with its claim allocated
to its own device, every pod Running on its slice's node, every deleted slice gone, no device is bound
twice and no instance is held for a slice that is gone (checked from the slices' statuses, the agents'
records and the simulator's state, not from the controller's books), and the work queues of the
controller and of the agents counted the retries they made.

The size is configurable: MIG_OPERATOR_FAULT_SLICES (default 200) slices made directly and
MIG_OPERATOR_FAULT_PODS (default 50) annotated pods (each gets a slice through the controller's webhook
and runs on a kwok node once ungated), MIG_OPERATOR_FAULT_WINDOW_S (default 60) seconds of faults; a
quarter of the burst is made before the window, half during it, the rest after; an eighth of the slices
and of the pods made before it are deleted during it.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from faulty_proxy import FaultyProxy
from harness import OperatorHarness, check_invariants, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import free_port, metrics_text

SLICES = int(os.environ.get("MIG_OPERATOR_FAULT_SLICES", "200"))
PODS = int(os.environ.get("MIG_OPERATOR_FAULT_PODS", "50"))
WINDOW_S = float(os.environ.get("MIG_OPERATOR_FAULT_WINDOW_S", "60"))
PER_GPU = 7  # 1g.10gb instances an H100-80GB holds
GPUS_PER_NODE = 16  # the most a GpuNode lists
SETTLE_S = 60.0  # after the window, until every slice is Ready and every pod Running


def _retries(port: int) -> dict[str, float]:
    return {sample.labels["kind"]: sample.value for family in text_string_to_metric_families(metrics_text(port))
            for sample in family.samples if sample.name == "mig_operator_workqueue_retries_total"}


def _token(kubeconfig: Path) -> str:
    return yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]


def _claims(operator: OperatorHarness, namespace: str) -> list[dict[str, Any]]:
    return operator.custom.list_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims")["items"]


def _pod(name: str) -> dict[str, Any]:
    """An annotated pod (the webhook gives it its gate, label and claim; kwok runs it)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {"cdmo.io/gpu-memory": "5Gi"}},
            "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                     "containers": [{"name": "main", "image": "busybox"}]}}


@pytest.fixture(name="proxy")
def proxy_fixture(kube_cluster: Any) -> Iterator[FaultyProxy]:
    """The faulty proxy in front of the session's API server. Set up before ``operator`` (name it first),
    so it is closed after the operator's teardown, whose parts still talk through it to release slices."""
    admin = yaml.safe_load(kube_cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    proxy = FaultyProxy(admin["server"], admin["certificate-authority"], rate=0.3)
    yield proxy
    proxy.close()


def test_a_burst_through_failing_writes_ends_with_every_slice_ready_once(proxy: FaultyProxy, operator: OperatorHarness,
                                                                         tmp_path: Path) -> None:
    total = SLICES + PODS
    # Each part through the proxy, as its chart ServiceAccount (tests/e2e/conftest.py); the webhook runs
    # in the controller's process.
    for part in ("agent", "controller"):
        operator.kubeconfigs[part] = proxy.kubeconfig(tmp_path / f"{part}-proxy.kubeconfig",
                                                      _token(operator.kubeconfigs[part]))
    nodes = [operator.add_node("h100-80gb", count=GPUS_PER_NODE)
             for _ in range(math.ceil(total / (PER_GPU * GPUS_PER_NODE)))]
    agent_ports = {node.name: free_port() for node in nodes}
    for node in nodes:
        operator.agent(node, None, "--metrics-address", f"127.0.0.1:{agent_ports[node.name]}")
    for node in nodes:
        operator.wait_gpunode(node, timeout=60)
    port = free_port()
    operator.controller_with_webhook(None, "--metrics-address", f"127.0.0.1:{port}")
    operator.wait_webhook()
    ns = operator.namespace()
    # Slices and pods interleaved: ("slice", name) or ("pod", name).
    work = [("pod" if PODS and i % max(1, total // PODS) == 0 and i // max(1, total // PODS) < PODS
             else "slice", f"w{i:03d}") for i in range(total)]
    before, during, after = work[:total // 4], work[total // 4:3 * total // 4], work[3 * total // 4:]
    # Deleted during the window: every eighth slice and every eighth pod of those made before it.
    doomed = [item for kind in ("slice", "pod") for item in [w for w in before if w[0] == kind][::8]]

    def make(item: tuple[str, str]) -> None:
        kind, name = item
        if kind == "pod":
            operator.core.create_namespaced_pod(ns, _pod(name))
        else:
            operator.create_slice(ns, name, {"memory": "5Gi"})

    def delete(item: tuple[str, str]) -> None:
        kind, name = item
        if kind == "pod":
            operator.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        else:
            operator.delete_slice(ns, name)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(make, before))
        proxy.faulty = True
        started = time.monotonic()
        # Spread over the window, the deletes among the new ones.
        steps: list[tuple[str, tuple[str, str]]] = [("make", item) for item in during]
        for i, item in enumerate(doomed):
            steps.insert((i + 1) * len(steps) // (len(doomed) + 1), ("delete", item))
        for i, (what, item) in enumerate(steps):
            (make if what == "make" else delete)(item)
            time.sleep(max(0.0, started + WINDOW_S * (i + 1) / max(1, len(steps)) - time.monotonic()))
        proxy.faulty = False
        settled_by = time.monotonic() + SETTLE_S
        list(pool.map(make, after))
    gone = {name for _, name in doomed}
    pods = [name for kind, name in work if kind == "pod" and name not in gone]
    kept = total - len(doomed)

    def not_ready() -> list[str]:
        slices = operator.slices(ns)
        waiting = [s["metadata"]["name"] for s in slices if (s.get("status") or {}).get("phase") != "Ready"]
        left = [f"deleted {s['metadata']['name']}" for s in slices if s["metadata"]["name"] in gone
                or {r["name"] for r in s["metadata"].get("ownerReferences") or [] if r["kind"] == "Pod"} & gone]
        running = {p.metadata.name for p in operator.core.list_namespaced_pod(ns).items
                   if p.status.phase == "Running" and p.spec.node_name}
        missing = max(0, kept - len(slices))
        return sorted(waiting) + left + [f"pod {p}" for p in pods if p not in running] + ["(slice)"] * missing

    wait_until(lambda: not not_ready(), max(1.0, settled_by - time.monotonic()), lambda: (
        f"every slice Ready and pod Running within {SETTLE_S:.0f} s of the window; not yet: {not_ready()[:10]} "
        f"({len(not_ready())}); injected {dict(proxy.injected)}\n{operator.logs()}"), interval=1.0)
    injected = dict(proxy.injected)
    assert sum(injected.values()) > 0 and set(injected) == {500, 409, 429}, injected

    # No device twice: each Ready slice its own GPU instance (node, GPU, GI and device UUID), their
    # placements apart, and each instance there in the simulator (check_invariants reads its state).
    slices = operator.slices(ns)
    statuses = [s["status"] for s in slices]
    assert len(statuses) == kept
    devices = Counter(st["deviceUUID"] for st in statuses)
    instances = Counter((st["node"], st["gpu"], st["giId"]) for st in statuses)
    assert max(devices.values()) == 1 and max(instances.values()) == 1, (devices.most_common(2),
                                                                         instances.most_common(2))
    check_invariants(operator)
    # No instance leaked: each agent's record gives instances to exactly the slices bound to its node,
    # so the instances of the deleted slices are idle again (reusable), none held for the gone.
    for node in nodes:
        bound_here = {s["metadata"]["uid"] for s in slices if s["status"]["node"] == node.name}
        assert set(node.record().get("owners") or {}) == bound_here, node.name
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
            if claim["metadata"]["name"] not in by_name:
                continue  # a deleted slice's claim, going with it (owner reference)
            results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
                       .get("results") or [])
            if results:
                found[claim["metadata"]["name"]] = (results[0]["pool"], results[0]["device"])
        return found

    wait_until(lambda: len(allocated()) == kept, 120, lambda: (
        f"every claim allocated: {len(allocated())} of {kept}\n{operator.logs()}"), interval=1.0)
    claimed = allocated()
    assert len(set(claimed.values())) == kept
    for name, (pool, device) in claimed.items():
        assert (pool, device) == (by_name[name]["status"]["node"], by_name[name]["metadata"]["uid"]), name
    for claim in _claims(operator, ns):
        if claim["metadata"]["name"] not in by_name:
            continue
        owners = [r["uid"] for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "GpuSlice"]
        assert owners == [by_name[claim["metadata"]["name"]]["metadata"]["uid"]], claim["metadata"]

    retries = _retries(port)
    assert sum(retries.values()) > 0, (retries, injected)
    agent_retries = {name: _retries(p) for name, p in agent_ports.items()}
    assert sum(sum(r.values()) for r in agent_retries.values()) > 0, (agent_retries, injected)
