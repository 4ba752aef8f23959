"""A pod's slice goes only to a node the pod's requests fit, as kube-scheduler's NodeResourcesFit counts
them, on a real control plane (kube-scheduler binds the pods) with kwok nodes whose allocatable CPU the
test sets: an annotated pod asking 8 CPUs runs on the 16-CPU MIG node, not on the 2-CPU one that best fit
would pick, and with the 2-CPU node alone its slice is not made and the pod is told why."""

from __future__ import annotations

from typing import Any

from harness import OperatorHarness, SimNode, wait_until
from test_pods import create_pod, running, slice_of, start

CONTAINERS = [{"name": "main", "image": "busybox", "resources": {"requests": {"cpu": "8"}}}]


def mig_node(op: OperatorHarness, cpu: str) -> SimNode:
    """An H100 MIG node with ``cpu`` CPUs allocatable."""
    return op.add_node("h100-80gb", allocatable={"cpu": cpu, "memory": "64Gi", "pods": "110"})


def insufficient(op: OperatorHarness, ns: str, name: str) -> list[Any]:
    events = op.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    return [e for e in events if e.reason == "InsufficientResources" and e.type == "Warning"]


def test_an_8_cpu_pods_slice_goes_to_the_node_with_the_cpus_not_the_one_best_fit_picks(
        operator: OperatorHarness) -> None:
    small, big = mig_node(operator, "2"), mig_node(operator, "16")
    start(operator, small, big)
    ns = operator.namespace()
    # A slice on the small node's GPU: best fit packs the next slice beside it, on the small node.
    operator.create_slice(ns, "held", {"memory": "9Gi", "nodeName": small.name})
    operator.wait_phase(ns, "held", "Ready")

    name = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, containers=CONTAINERS)["metadata"]["name"]
    pod = running(operator, ns, name, timeout=60)
    assert pod.spec.node_name == big.name
    assert slice_of(operator, pod)["status"]["node"] == big.name
    assert insufficient(operator, ns, name) == []


def test_an_8_cpu_pod_with_only_a_2_cpu_mig_node_gets_no_slice_and_a_warning_naming_cpu(
        operator: OperatorHarness) -> None:
    small = mig_node(operator, "2")
    start(operator, small)
    ns = operator.namespace()
    name = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, containers=CONTAINERS)["metadata"]["name"]
    [event] = wait_until(lambda: insufficient(operator, ns, name), 30,
                         lambda: f"an InsufficientResources Event on pod {name}\n{operator.logs()}")
    assert f"cpu: the pod asks 8, node {small.name} has 2 free of 2 allocatable" in event.message, event.message
    # The controller decided before the Event: no slice was made for the pod, and it stays gated.
    assert operator.slices(ns) == []
    pod = operator.core.read_namespaced_pod(name, ns)
    assert pod.spec.node_name is None and [g.name for g in pod.spec.scheduling_gates] == ["cdmo.io/gpu-slice"]

    # Room made (the node's allocatable raised, as a kubelet writes it): the pod's slice is made there at
    # the pod's next look, and it runs.
    amounts = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    operator.core.patch_node_status(small.name, {"status": {"allocatable": amounts, "capacity": amounts}})
    assert running(operator, ns, name, timeout=60).spec.node_name == small.name
