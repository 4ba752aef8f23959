"""`scripts/control-plane up --with karpenter`: a real node autoscaler in the test plane, with no operator.

Karpenter's kwok provider turns unschedulable demand (a pending pod, a CapacityBuffer) into NodeClaims and
Nodes of the GPU shapes in scripts/karpenter/gpu-instance-types.json, which the plane's kwok makes Ready,
and removes them again once empty (``consolidateAfter`` 5 s). Measured on 2 cores: a node Ready and its
pod Running about 2 s after the pod is created; an empty node gone 20-30 s after its last pod, one node
at a time (Karpenter's disruption loop, not consolidateAfter, sets the pace). The bounds below leave room.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from decimal import Decimal

import kubernetes
import pytest
from autoscaler import (
    INSTANCE_TYPE_LABEL,
    INSTANCE_TYPES_FILE,
    KWOK_PROVIDER_PREFIX,
    apply_capacity_buffer,
    apply_node_pool,
    capacity_buffer,
    condition,
    delete_node_pool,
    karpenter_nodes,
    node_claims,
    node_ready,
    scale_capacity_buffer,
)
from cluster import KubeCluster
from harness import unique, wait_until

pytestmark = pytest.mark.xdist_group("karpenter")

SCALE_UP_BOUND_S = 60
# Per node: empty nodes go one after the other.
CONSOLIDATION_BOUND_S = 90
SHAPES = {shape["name"]: shape for shape in json.loads(INSTANCE_TYPES_FILE.read_text())}


@pytest.fixture
def pool(karpenter_plane: KubeCluster) -> Iterator[str]:
    """A NodePool of every GPU shape, removed (with whatever nodes it still has) at the end."""
    name = unique("gpu")
    apply_node_pool(karpenter_plane, name, list(SHAPES), labels={"pool": name}, limits={"cpu": "256"})
    yield name
    delete_node_pool(karpenter_plane, name)
    wait_until(lambda: not karpenter_nodes(karpenter_plane, name), CONSOLIDATION_BOUND_S,
               f"pool {name}'s nodes to go after the pool")


@pytest.fixture
def namespace(karpenter_plane: KubeCluster) -> Iterator[str]:
    name = unique("karpenter")
    karpenter_plane.core_v1().create_namespace({"metadata": {"name": name}})
    yield name
    karpenter_plane.core_v1().delete_namespace(name)


def pod_spec(instance_type: str, cpu: str) -> dict:
    return {"nodeSelector": {INSTANCE_TYPE_LABEL: instance_type},
            "containers": [{"name": "main", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}]}


def describe(cluster: KubeCluster, pool: str) -> str:
    claims = [(c["metadata"]["name"], c.get("status", {}).get("conditions")) for c in node_claims(cluster, pool)]
    nodes = [(n.metadata.name, node_ready(n)) for n in karpenter_nodes(cluster, pool)]
    return f"NodeClaims {claims}, Nodes {nodes}"


def test_a_pending_pod_brings_a_node_that_goes_when_the_pod_does(karpenter_plane: KubeCluster, pool: str,
                                                                namespace: str) -> None:
    core = karpenter_plane.core_v1()
    assert not karpenter_nodes(karpenter_plane, pool)
    started = time.monotonic()
    core.create_namespaced_pod(namespace, {"metadata": {"name": "wants-h200"}, "spec": pod_spec("gpu-h200-1", "10")})

    # kube-scheduler found no node: the pod was Unschedulable, the only signal Karpenter acts on.
    wait_until(lambda: [e for e in core.list_namespaced_event(namespace).items
                        if e.involved_object.name == "wants-h200" and e.reason == "FailedScheduling"],
               SCALE_UP_BOUND_S, "kube-scheduler's FailedScheduling Event for the pod")
    pod = wait_until(lambda: (p := core.read_namespaced_pod("wants-h200", namespace)).status.phase == "Running" and p,
                     SCALE_UP_BOUND_S, lambda: f"the pod Running; {describe(karpenter_plane, pool)}")
    scale_up_s = time.monotonic() - started

    # Karpenter writes the NodeClaim's status (its node, Initialized) on its own pace, not the pod's.
    [claim] = wait_until(lambda: [c for c in node_claims(karpenter_plane, pool)
                                  if c.get("status", {}).get("nodeName") and condition(c, "Initialized")
                                  and condition(c, "Initialized")["status"] == "True"],
                         SCALE_UP_BOUND_S, lambda: f"the NodeClaim initialized; {describe(karpenter_plane, pool)}")
    [node] = karpenter_nodes(karpenter_plane, pool)
    assert pod.spec.node_name == node.metadata.name == claim["status"]["nodeName"]
    assert node.spec.provider_id == claim["status"]["providerID"]
    assert node.spec.provider_id.startswith(KWOK_PROVIDER_PREFIX) and node_ready(node)
    assert condition(claim, "Initialized")["status"] == "True"
    # The shape from the instance-type file: its labels stamped on the Node, its CPU (less Karpenter's
    # kube-reserved), and no nvidia.com/gpu (no device plugin registers one on the operator's nodes).
    shape = SHAPES["gpu-h200-1"]
    assert node.metadata.labels[INSTANCE_TYPE_LABEL] == "gpu-h200-1" and node.metadata.labels["pool"] == pool
    for offering_requirement in shape["offerings"][0]["Requirements"]:
        assert node.metadata.labels[offering_requirement["key"]] == offering_requirement["values"][0]
    allocatable_cpu = Decimal(kubernetes.utils.parse_quantity(node.status.allocatable["cpu"]))
    assert Decimal(shape["resources"]["cpu"]) - 1 < allocatable_cpu <= Decimal(shape["resources"]["cpu"])
    assert "nvidia.com/gpu" not in node.status.allocatable

    core.delete_namespaced_pod("wants-h200", namespace, grace_period_seconds=0)
    deleted = time.monotonic()
    wait_until(lambda: not node_claims(karpenter_plane, pool) and not karpenter_nodes(karpenter_plane, pool),
               CONSOLIDATION_BOUND_S, lambda: f"the empty node consolidated; {describe(karpenter_plane, pool)}")
    print(f"scale-up {scale_up_s:.1f} s, consolidation {time.monotonic() - deleted:.1f} s")


def test_a_capacity_buffer_brings_nodes_until_it_is_scaled_to_zero(karpenter_plane: KubeCluster, pool: str,
                                                                   namespace: str) -> None:
    replicas, shape = 2, SHAPES["gpu-h200-1"]
    node_cpu = int(shape["resources"]["cpu"])
    cpu = node_cpu // 2 + 1  # over half a node: one chunk per node
    wanted_nodes = math.ceil(replicas / (node_cpu // cpu))
    started = time.monotonic()
    apply_capacity_buffer(karpenter_plane, namespace, "gpu-buffer", pod_spec("gpu-h200-1", str(cpu)), replicas)

    def provisioned() -> bool:
        buffer = capacity_buffer(karpenter_plane, namespace, "gpu-buffer") or {}
        state = condition(buffer, "Provisioning") or {}
        return state.get("status") == "True" and state.get("reason") == "FitsExistingCapacity"

    wait_until(provisioned, SCALE_UP_BOUND_S,
               lambda: f"Provisioning=True/FitsExistingCapacity; buffer status "
                       f"{(capacity_buffer(karpenter_plane, namespace, 'gpu-buffer') or {}).get('status')}; "
                       f"{describe(karpenter_plane, pool)}")
    scale_up_s = time.monotonic() - started
    # Karpenter counts a node it launched as capacity before kwok has made it Ready.
    nodes = wait_until(lambda: len(ns := karpenter_nodes(karpenter_plane, pool)) == wanted_nodes
                       and all(node_ready(n) for n in ns) and ns, SCALE_UP_BOUND_S,
                       lambda: f"{wanted_nodes} nodes Ready; {describe(karpenter_plane, pool)}")
    assert len(node_claims(karpenter_plane, pool)) == wanted_nodes
    assert all(n.metadata.labels[INSTANCE_TYPE_LABEL] == "gpu-h200-1" for n in nodes)
    assert capacity_buffer(karpenter_plane, namespace, "gpu-buffer")["status"]["replicas"] == replicas
    # The buffer's pods are Karpenter's virtual pods: none exists in the API.
    assert not karpenter_plane.core_v1().list_namespaced_pod(namespace).items

    scale_capacity_buffer(karpenter_plane, namespace, "gpu-buffer", 0)
    scaled = time.monotonic()
    wait_until(lambda: not node_claims(karpenter_plane, pool) and not karpenter_nodes(karpenter_plane, pool),
               CONSOLIDATION_BOUND_S * wanted_nodes,
               lambda: f"the buffer's nodes consolidated; {describe(karpenter_plane, pool)}")
    state = condition(capacity_buffer(karpenter_plane, namespace, "gpu-buffer"), "Provisioning")
    assert (state["status"], state["reason"]) == ("False", "BufferEmpty")
    print(f"buffer scale-up {scale_up_s:.1f} s, consolidation of {wanted_nodes} {time.monotonic() - scaled:.1f} s")
