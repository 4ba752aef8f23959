"""Fault injection: the controller talks to kube-apiserver through a proxy that, for a window in the
middle of a burst of slices, answers about 30 % of its writes with 500, 409 or 429 (tests/e2e/faulty_proxy.py).
Afterwards every slice is Ready with its claim allocated to its own device, no device is bound twice
(checked from the slices' statuses and the simulator's state, not from the controller's books), and the
controller's work queue counted the retries it made.

The size is configurable: MIG_OPERATOR_FAULT_SLICES (default 200) slices, MIG_OPERATOR_FAULT_WINDOW_S
(default 60) seconds of faults; a quarter of the slices are made before the window, half during it,
the rest after.
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


def test_a_burst_through_failing_writes_ends_with_every_slice_ready_once(operator: OperatorHarness,
                                                                         tmp_path: Path) -> None:
    nodes = [operator.add_node("h100-80gb", count=GPUS_PER_NODE)
             for _ in range(math.ceil(SLICES / (PER_GPU * GPUS_PER_NODE)))]
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
        controller = operator.controller(None, "--metrics-address", f"127.0.0.1:{port}")
        ns = operator.namespace()
        names = [f"s{i:03d}" for i in range(SLICES)]
        before, during, after = names[:SLICES // 4], names[SLICES // 4:3 * SLICES // 4], names[3 * SLICES // 4:]

        def make(name: str) -> None:
            operator.create_slice(ns, name, {"memory": "5Gi"})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(make, before))
            proxy.faulty = True
            started = time.monotonic()
            for i, name in enumerate(during):  # spread over the window
                make(name)
                time.sleep(max(0.0, started + WINDOW_S * (i + 1) / max(1, len(during)) - time.monotonic()))
            proxy.faulty = False
            list(pool.map(make, after))

        def not_ready() -> list[str]:
            return sorted(s["metadata"]["name"] for s in operator.slices(ns)
                          if (s.get("status") or {}).get("phase") != "Ready")

        wait_until(lambda: not not_ready(), 240, lambda: (
            f"every slice Ready; not yet: {not_ready()[:10]} ({len(not_ready())}); injected {dict(proxy.injected)}\n"
            f"{operator.logs()}"), interval=1.0)
        injected = dict(proxy.injected)
        assert sum(injected.values()) > 0 and set(injected) == {500, 409, 429}, injected

        # No device twice: each Ready slice its own GPU instance (node, GPU, GI and device UUID), their
        # placements apart, and each instance there in the simulator (check_invariants reads its state).
        statuses = [s["status"] for s in operator.slices(ns)]
        assert len(statuses) == SLICES
        devices = Counter(st["deviceUUID"] for st in statuses)
        instances = Counter((st["node"], st["gpu"], st["giId"]) for st in statuses)
        assert max(devices.values()) == 1 and max(instances.values()) == 1, (devices.most_common(2),
                                                                             instances.most_common(2))
        check_invariants(operator)

        # Each slice's claim allocated to its own device on its node; no device in two claims.
        uids = {s["metadata"]["name"]: s["metadata"]["uid"] for s in operator.slices(ns)}

        def allocated() -> dict[str, tuple[str, str]]:
            found = {}
            for claim in _claims(operator, ns):
                results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
                           .get("results") or [])
                if results:
                    found[claim["metadata"]["name"]] = (results[0]["pool"], results[0]["device"])
            return found

        wait_until(lambda: len(allocated()) == SLICES, 120, lambda: (
            f"every claim allocated: {len(allocated())} of {SLICES}\n{operator.logs()}"), interval=1.0)
        claimed = allocated()
        assert len(set(claimed.values())) == SLICES
        by_name = {s["metadata"]["name"]: s["status"] for s in operator.slices(ns)}
        for name, (pool, _device) in claimed.items():
            assert pool == by_name[name]["node"], (name, pool)
        for claim in _claims(operator, ns):
            owners = [r["uid"] for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "GpuSlice"]
            assert owners == [uids[claim["metadata"]["name"]]], claim["metadata"]

        retries = _retries(port)
        assert sum(retries.values()) > 0, (retries, injected)
    finally:
        if controller is not None:
            operator.stop(controller)
        proxy.close()
