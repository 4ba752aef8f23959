"""The active controller replica killed (SIGKILL, no cleanup) in the middle of a burst of slices and
annotated pods: the standby takes over through kopf peering, every slice ends Ready, every pod
Running, and no device is bound twice. The time to take over is measured with a probe slice made
right after the kill (docs/operations.md, "Day two")."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes
from harness import OperatorHarness, check_invariants, wait_until
from test_pods import create_pod, handed_device

BURST = 200  # half slices, half pods
LIFETIME_S = 3  # --peering-lifetime of both replicas: a silent active one is replaced after this


def test_the_standby_takes_over_a_burst_when_the_active_controller_is_killed(operator: OperatorHarness) -> None:
    # 4 nodes x 8 H100s x 7 one-slice instances: 224 places for 200 slices (100 made by hand, 100 made
    # for the pods) and the two probes.
    nodes = [operator.add_node("h100-80gb", count=8) for _ in range(4)]
    for node in nodes:
        operator.agent(node)
    for node in nodes:
        operator.wait_gpunode(node)
    operator.webhook()  # the chart's layout: admission does not depend on which controller leads
    operator.wait_webhook()
    args = ("--peering-lifetime", str(LIFETIME_S))
    active = operator.controller(None, "--priority", "200", *args)
    operator.controller(None, "--priority", "100", *args)

    def met() -> bool:
        """Both replicas' keep-alives in the peering: from then on the standby's peering watch has the active
        one and keeps it paused (before that, two replicas started together may both bind for a moment)."""
        try:
            body = operator.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", operator.peering)
        except kubernetes.client.ApiException:
            return False
        return len(body.get("status") or {}) >= 2

    wait_until(met, 60, lambda: f"both replicas in peering {operator.peering}\n{operator.logs()}")
    ns, probe_ns = operator.namespace(), operator.namespace()
    operator.create_slice(probe_ns, "before", {"migProfile": "1g.10gb"})
    operator.wait_phase(probe_ns, "before", "Ready", timeout=60)

    half = BURST // 2

    def make(i: int) -> None:
        if i % 2:
            create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name=f"p{i // 2:03d}")
        else:
            operator.create_slice(ns, f"s{i // 2:03d}", {"migProfile": "1g.10gb"})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(make, range(BURST // 2)))  # list: an error in a thread fails the test
        operator.kill(active)  # mid-burst: bindings, claims and ungates in flight
        killed_at = time.monotonic()
        operator.create_slice(probe_ns, "after", {"migProfile": "1g.10gb"})
        list(pool.map(make, range(BURST // 2, BURST)))
    operator.wait_phase(probe_ns, "after", "Ready", timeout=120)
    takeover_s = time.monotonic() - killed_at
    print(f"takeover: the probe slice made at the kill was Ready {takeover_s:.1f} s after it "
          f"(--peering-lifetime {LIFETIME_S})")

    def all_ready() -> list[dict] | None:
        slices = operator.slices(ns)
        ready = [s for s in slices if (s.get("status") or {}).get("phase") == "Ready"]
        return slices if len(slices) == BURST and len(ready) == BURST else None

    slices = wait_until(all_ready, 300, lambda: f"{BURST} slices Ready: "
                        f"{sorted({(s.get('status') or {}).get('phase') for s in operator.slices(ns)}, key=str)}"
                        f"\n{operator.logs()}", interval=2)

    def all_running() -> list[Any] | None:
        pods = operator.core.list_namespaced_pod(ns).items
        up = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
        return up if len(pods) == half and len(up) == half else None

    pods = wait_until(all_running, 300, lambda: f"{half} pods Running\n{operator.logs()}", interval=2)
    # No device bound twice: every slice names its own instance (independently of the operator's books:
    # the device UUIDs the agents wrote), and every pod's claim is allocated its own slice's device.
    uuids = [s["status"]["deviceUUID"] for s in slices]
    assert len(uuids) == len(set(uuids)), "a MIG instance serves two slices"
    handed = [handed_device(operator, p)["uuid"] for p in pods]
    assert len(handed) == len(set(handed)), "a device handed to two pods"
    assert set(handed) <= set(uuids), "a pod got a device no slice of its namespace holds"
    check_invariants(operator)
