"""An object that cannot be read is that object's problem only: a GpuSlice whose group size is not a
number, and a gated pod whose device count is not one, written in digits ``int()`` refuses or
``str.isdigit()`` takes ('²'). The odd slice is Failed, the odd pod gets a Warning Event and stays
gated, and after the controller restarts every other namespace is served."""

from __future__ import annotations

from typing import Any

from harness import GROUP, SLICES, VERSION, OperatorHarness, check_invariants, wait_until
from test_pods import GATE, pod_body, start

ODD_SLICE = {"cdmo.io/group": "x", "cdmo.io/group-size": "²"}


def test_an_odd_annotation_stops_only_its_own_object_across_a_controller_restart(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    controller = operator.process("controller")
    odd_ns, other_ns = operator.namespace(), operator.namespace()
    operator.custom.create_namespaced_custom_object(GROUP, VERSION, odd_ns, SLICES, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice",
        "metadata": {"name": "odd", "annotations": ODD_SLICE}, "spec": {"migProfile": "1g.10gb"}})
    # A pod labelled and gated by hand, annotated afterwards: no webhook sees the annotation.
    body = pod_body(None, name="odd-pod")
    body["metadata"]["labels"] = {"cdmo.io/gpu-slice": "odd-pod-gs-0"}
    body["spec"]["schedulingGates"] = [{"name": GATE}]
    operator.core.create_namespaced_pod(odd_ns, body)
    operator.core.patch_namespaced_pod("odd-pod", odd_ns, {"metadata": {"annotations": {
        "cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-count": "²"}}})

    def failed_naming_the_annotation() -> dict | None:
        st = (operator.get_slice(odd_ns, "odd") or {}).get("status") or {}
        return st if st.get("phase") == "Failed" and "cdmo.io/group-size" in st.get("message", "") else None

    failed = wait_until(failed_naming_the_annotation, 30, lambda: f"odd Failed\n{operator.logs()}")
    assert "'2'" in failed["message"]  # a valid example
    slice_events = operator.core.list_namespaced_event(odd_ns, field_selector="involvedObject.name=odd").items
    assert any(e.type == "Warning" and "cdmo.io/group-size" in e.message for e in slice_events)

    def pod_warning() -> list[Any]:
        events = operator.core.list_namespaced_event(odd_ns, field_selector="involvedObject.name=odd-pod").items
        return [e for e in events if e.type == "Warning" and "cdmo.io/gpu-count" in e.message]

    wait_until(pod_warning, 30, lambda: f"a Warning Event on odd-pod naming cdmo.io/gpu-count\n{operator.logs()}")

    # The controller stops (an upgrade, a standby taking over); meanwhile another tenant asks for a slice.
    operator.stop(controller)
    operator.create_slice(other_ns, "served", {"migProfile": "1g.10gb"})
    operator.start(controller)
    operator.wait_phase(other_ns, "served", "Ready", timeout=20)

    assert failed_naming_the_annotation() is not None
    pod = operator.core.read_namespaced_pod("odd-pod", odd_ns)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE] and pod.spec.node_name is None
    assert operator.get_slice(odd_ns, "odd-pod-gs-0") is None
    assert controller.alive
    check_invariants(operator)
