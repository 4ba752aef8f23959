"""One allocator per GPU (issue 17, item 5), end to end: a kwok node whose capacity gains
``nvidia.com/gpu`` (as when NVIDIA's device plugin runs there) raises the DevicePluginConflict
condition on its GpuNode, with an Event and the agent's gauge; a new slice pinned there stays Pending
with the reason while the slice bound before keeps its instance; labelling the node
``cdmo.io/device-plugin-shared=true``, or the capacity going away, lets new slices bind again.

kwok leaves a Node's capacity alone once the node is initialised (its node-initialize stage copies
what is there, its heartbeat writes only conditions), so patching the Node's status subresource is
what a kubelet with a device plugin would have written; the test checks the value is still there.
"""

from __future__ import annotations

import socket
from typing import Any

from harness import OperatorHarness, SimNode, check_invariants, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import metrics_text

from mig_operator.core.node.device_plugin import (
    CONDITION_TYPE,
    GPU_OPERATOR_PLUGIN_LABEL,
    REASON_CONFLICT,
    REASON_NONE,
    REASON_SHARED,
    SHARED_LABEL,
)

PLUGIN = {"nvidia.com/gpu": "8"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def conflict_gauge(port: int, node: str) -> float | None:
    for family in text_string_to_metric_families(metrics_text(port)):
        for sample in family.samples:
            if sample.name == "mig_operator_device_plugin_conflict" and sample.labels.get("node") == node:
                return sample.value
    return None


def condition(op: OperatorHarness, node: SimNode) -> dict[str, Any] | None:
    status = (op.gpunode(node) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c.get("type") == CONDITION_TYPE), None)


def wait_condition(op: OperatorHarness, node: SimNode, status: str, reason: str) -> dict[str, Any]:
    return wait_until(
        lambda: (c := condition(op, node)) and c["status"] == status and c["reason"] == reason and c, 30,
        lambda: f"GpuNode {node.name} condition {CONDITION_TYPE}={status} ({reason}), now {condition(op, node)}"
                f"\n{op.logs()}")


def set_capacity(op: OperatorHarness, node: SimNode, resources: dict[str, str | None]) -> None:
    """What the kubelet writes when a device plugin registers (or, with None, when it is gone)."""
    op.core.patch_node_status(node.name, {"status": {"capacity": resources, "allocatable": resources}})


def wait_pending(op: OperatorHarness, namespace: str, name: str, reason: str) -> dict[str, Any]:
    def pending() -> dict | None:
        body = op.get_slice(namespace, name) or {}
        status = body.get("status") or {}
        return status if status.get("phase") == "Pending" and status.get("reason") == reason else None

    return wait_until(pending, 30, lambda: f"slice {namespace}/{name} Pending ({reason}), now "
                                           f"{(op.get_slice(namespace, name) or {}).get('status')}\n{op.logs()}")


def test_a_device_plugin_on_a_node_stops_new_slices_until_resolved_or_shared(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    port = free_port()
    operator.agent(node, None, "--metrics-address", f"127.0.0.1:{port}")
    operator.wait_gpunode(node)
    operator.controller()
    ns = operator.namespace()
    wait_condition(operator, node, "False", REASON_NONE)
    operator.create_slice(ns, "before", {"memory": "9Gi", "nodeName": node.name})
    before = operator.wait_phase(ns, "before", "Ready")["status"]

    # The device plugin registers: the node advertises nvidia.com/gpu.
    set_capacity(operator, node, PLUGIN)
    raised = wait_condition(operator, node, "True", REASON_CONFLICT)
    for part in (node.name, "nvidia.com/gpu", f"{GPU_OPERATOR_PLUGIN_LABEL}=false", f"{SHARED_LABEL}=true"):
        assert part in raised["message"]
    assert operator.gpunode(node)["status"]["devicePluginResources"] == ["nvidia.com/gpu"]
    wait_until(lambda: conflict_gauge(port, node.name) == 1, 20, "mig_operator_device_plugin_conflict 1")

    def events() -> list[Any]:
        listed = operator.core.list_namespaced_event("default", field_selector=f"involvedObject.name={node.name}")
        return [e for e in listed.items if e.involved_object.kind == "GpuNode"]

    warning = wait_until(lambda: [e for e in events() if e.reason == CONDITION_TYPE], 20,
                         lambda: f"a {CONDITION_TYPE} Event on GpuNode {node.name}: {events()}")
    assert warning[0].type == "Warning" and "nvidia.com/gpu" in warning[0].message

    # A new slice that can only go there waits, naming the node and the resource; the old one is kept.
    operator.create_slice(ns, "after", {"memory": "9Gi", "nodeName": node.name})
    waiting = wait_pending(operator, ns, "after", "DevicePluginConflict")
    assert node.name in waiting["message"] and "nvidia.com/gpu" in waiting["message"]
    kept = operator.get_slice(ns, "before")["status"]
    assert kept["phase"] == "Ready" and kept["deviceUUID"] == before["deviceUUID"]
    # kwok did not put the node's capacity back: the conflict is still what the node says.
    assert operator.core.read_node(node.name).status.capacity.get("nvidia.com/gpu") == "8"

    # The admin marks the node as shared deliberately: the slice binds.
    operator.core.patch_node(node.name, {"metadata": {"labels": {SHARED_LABEL: "true"}}})
    shared = wait_condition(operator, node, "False", REASON_SHARED)
    assert "nvidia.com/gpu" in shared["message"]
    operator.wait_phase(ns, "after", "Ready")
    wait_until(lambda: conflict_gauge(port, node.name) == 0, 20, "mig_operator_device_plugin_conflict 0")

    # Label gone, plugin still there: the conflict is back; then the plugin goes and a slice binds.
    operator.core.patch_node(node.name, {"metadata": {"labels": {SHARED_LABEL: None}}})
    wait_condition(operator, node, "True", REASON_CONFLICT)
    operator.create_slice(ns, "last", {"memory": "9Gi", "nodeName": node.name})
    wait_pending(operator, ns, "last", "DevicePluginConflict")
    set_capacity(operator, node, {"nvidia.com/gpu": None})
    wait_condition(operator, node, "False", REASON_NONE)
    assert operator.gpunode(node)["status"]["devicePluginResources"] == []
    operator.wait_phase(ns, "last", "Ready")
    check_invariants(operator)
