"""A GPU that fails under a Ready slice (the simulator's injected Xid, then a GPU lost): the GpuNode says
so per GPU with an Event, the slice's DeviceHealthy turns False, a new slice goes to the healthy GPU and,
with none left, waits naming the GPUs and why; after a reset every condition is healthy again and the
waiting slice binds; a later Xid is cleared by the admin's mark on the Node."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from harness import OperatorHarness, check_invariants, wait_until

# Also run on the oldest supported Kubernetes release (make compat): there the API server drops device
# taints, and the devices stay untainted while everything else holds.
pytestmark = pytest.mark.compat


def gpu_health(operator: OperatorHarness, node: Any, index: int) -> dict:
    gpus = ((operator.gpunode(node) or {}).get("status") or {}).get("gpus") or []
    gpu = next((g for g in gpus if g["index"] == index), {})
    return next((c for c in gpu.get("conditions") or () if c["type"] == "Healthy"), {})


def device_healthy(operator: OperatorHarness, ns: str, name: str) -> dict:
    status = (operator.get_slice(ns, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "DeviceHealthy"), {})


def device_taints(operator: OperatorHarness, node: Any, uid: str) -> list[tuple[str, str, str]]:
    """The taints (key, value, effect) of a slice's device in the node's ResourceSlices."""
    listed = operator.custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices",
                                                         field_selector=f"spec.nodeName={node.name}")["items"]
    for item in listed:
        for device in (item.get("spec") or {}).get("devices") or ():
            if device["name"] == uid:
                return [(t["key"], t.get("value", ""), t["effect"]) for t in device.get("taints") or ()]
    return []


def test_a_failing_gpu_is_published_shunned_and_healthy_again_after_a_reset(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    operator.start_operator(node)
    ns = operator.namespace()
    operator.create_slice(ns, "held", {"migProfile": "1g.10gb"})
    held_body = operator.wait_phase(ns, "held", "Ready")
    held, held_uid = held_body["status"], held_body["metadata"]["uid"]
    sick, other = held["gpu"], 1 - held["gpu"]
    assert gpu_health(operator, node, sick)["status"] == "True"

    node.backend().inject_xid(sick, 79)
    cond = wait_until(lambda: (c := gpu_health(operator, node, sick)).get("status") == "False" and c, 20,
                      lambda: f"GPU {sick} Healthy=False: {operator.gpunode(node)}\n{operator.logs()}")
    assert cond["reason"] == "Xid79" and "Xid 79" in cond["message"]
    assert gpu_health(operator, node, other)["status"] == "True"
    slice_cond = wait_until(lambda: (c := device_healthy(operator, ns, "held")).get("status") == "False" and c, 20,
                            lambda: f"DeviceHealthy=False on held: {operator.get_slice(ns, 'held')}")
    assert slice_cond["reason"] == "Xid79"
    assert operator.get_slice(ns, "held")["status"]["phase"] == "Ready"  # its workload decides, not us
    # Device taints are GA in 1.37; an older API server drops the field, and the device stays untainted.
    if operator.cluster.minor >= 37:
        taint = ("gpu.cdmo.io/unhealthy", "Xid79", "NoSchedule")
        wait_until(lambda: device_taints(operator, node, held_uid) == [taint], 20,
                   lambda: f"the device of held tainted: {device_taints(operator, node, held_uid)}")

    def events() -> list[Any]:
        listed = operator.core.list_namespaced_event("default", field_selector=f"involvedObject.name={node.name}")
        return [e for e in listed.items if e.involved_object.kind == "GpuNode"]

    warning = wait_until(lambda: [e for e in events() if e.reason == "GpuUnhealthy"], 20,
                         lambda: f"a GpuUnhealthy Event: {events()}")
    assert warning[0].type == "Warning" and "Xid 79" in warning[0].message

    # A new slice goes to the healthy GPU, however well the sick one would have packed it.
    operator.create_slice(ns, "next", {"migProfile": "1g.10gb"})
    assert operator.wait_phase(ns, "next", "Ready")["status"]["gpu"] == other

    # The other GPU falls off the bus: nothing healthy is left, a new slice waits naming both.
    node.backend().lose_gpu(other)
    wait_until(lambda: gpu_health(operator, node, other).get("reason") == "GpuLost", 20,
               lambda: f"GPU {other} GpuLost: {operator.gpunode(node)}")
    operator.create_slice(ns, "waits", {"migProfile": "1g.10gb"})
    pending = operator.wait_phase(ns, "waits", "Pending", reason="GpuUnhealthy")["status"]
    for part in (f"GPU {sick} of node {node.name} (Xid79)", f"GPU {other} of node {node.name} (GpuLost)"):
        assert part in pending["message"], pending["message"]

    # Both GPUs are reset: healthy again, the slices say so, and the waiting slice binds.
    node.backend().reset_gpu(sick)
    node.backend().reset_gpu(other)
    for index in (sick, other):
        wait_until(lambda i=index: gpu_health(operator, node, i).get("status") == "True", 20,
                   lambda i=index: f"GPU {i} Healthy=True: {operator.gpunode(node)}")
    for name in ("held", "next"):
        wait_until(lambda n=name: device_healthy(operator, ns, n).get("status") == "True", 20,
                   lambda n=name: f"DeviceHealthy=True on {n}: {operator.get_slice(ns, n)}")
    operator.wait_phase(ns, "waits", "Ready")
    wait_until(lambda: device_taints(operator, node, held_uid) == [], 20,
               lambda: f"the taint gone: {device_taints(operator, node, held_uid)}")
    wait_until(lambda: [e for e in events() if e.reason == "GpuHealthy"], 20, lambda: f"GpuHealthy: {events()}")

    # Another Xid, not followed by a reset: the admin's clear mark on the Node (docs/operations.md) makes
    # the agent forget it; the GPU and the slice on it are healthy again.
    node.backend().inject_xid(sick, 48)
    wait_until(lambda: device_healthy(operator, ns, "held").get("reason") == "Xid48", 20,
               lambda: f"DeviceHealthy Xid48 on held: {operator.get_slice(ns, 'held')}\n{operator.logs()}")
    mark = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    operator.core.patch_node(node.name, {"metadata": {"annotations": {"cdmo.io/gpu-health-cleared": mark}}})
    wait_until(lambda: gpu_health(operator, node, sick).get("status") == "True", 20,
               lambda: f"GPU {sick} cleared: {operator.gpunode(node)}\n{operator.logs()}")
    wait_until(lambda: device_healthy(operator, ns, "held").get("status") == "True", 20,
               lambda: f"DeviceHealthy=True on held after the mark: {operator.get_slice(ns, 'held')}")
    assert node.backend().health(sick).healthy  # forgotten by the backend, not only hidden
    check_invariants(operator)
