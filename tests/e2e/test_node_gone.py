"""A node that goes (a node autoscaler removed it, or an admin deleted it) takes its agent, its GpuNode
and its devices with it: the slices bound there are not left waiting for an agent that will never come.
A slice being deleted is released (its finalizer taken off); a live one fails with reason NodeGone.
"""

from __future__ import annotations

from harness import AGENT_FINALIZER, GROUP, NODES, VERSION, OperatorHarness
from kubernetes.client.rest import ApiException


def test_the_slices_of_a_node_that_goes_are_released_or_failed(operator: OperatorHarness) -> None:
    op = operator
    node = op.add_node("h100-80gb")
    op.start_operator(node)
    ns = op.namespace()
    for name in ("kept", "released"):
        op.create_slice(ns, name, {"migProfile": "1g.10gb"})
        op.wait_phase(ns, name, "Ready")
    # The node goes while its slices are bound: its agent first, as a DaemonSet's pod goes with its node.
    op.stop(op.process(f"agent-{node.name}"))
    op.delete_slice(ns, "released")
    assert AGENT_FINALIZER in op.get_slice(ns, "released")["metadata"]["finalizers"]  # no agent releases it
    op.core.delete_node(node.name)
    # Its GpuNode goes with it (owned by the Node): kube-controller-manager's garbage collector, or here.
    try:
        op.custom.delete_cluster_custom_object(GROUP, VERSION, NODES, node.name)
    except ApiException as exc:
        if exc.status != 404:
            raise
    op.wait_gone(ns, "released", timeout=30)
    failed = op.wait_phase(ns, "kept", "Failed", timeout=30)
    assert failed["status"]["reason"] == "NodeGone" and node.name in failed["status"]["message"]
    events = op.core.list_namespaced_event(ns, field_selector="involvedObject.name=kept").items
    assert any(e.reason == "NodeGone" for e in events)
