"""Karpenter's objects in an e2e test's plane (the ``karpenter_plane`` fixture): a NodePool of GPU node
shapes (scripts/karpenter/gpu-instance-types.json) and its KWOKNodeClass, the NodeClaims and Nodes
Karpenter makes, and CapacityBuffers. Karpenter's kwok provider creates each Node itself (providerID
``kwok://<name>``, label and annotation ``kwok.x-k8s.io/node=fake``); the plane's kwok makes it Ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes
import yaml
from cluster import REPO_ROOT, KubeCluster
from kubernetes.client.rest import ApiException

INSTANCE_TYPES_FILE = REPO_ROOT / "scripts" / "karpenter" / "gpu-instance-types.json"
KARPENTER = ("karpenter.sh", "v1")
KWOK_NODE_CLASS = ("karpenter.kwok.sh", "v1alpha1", "kwoknodeclasses")
BUFFERS = ("autoscaling.x-k8s.io", "v1beta1", "capacitybuffers")
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
NODE_POOL_LABEL = "karpenter.sh/nodepool"
KWOK_PROVIDER_PREFIX = "kwok://"
# CapacityBuffer spec.provisioningStrategy: Karpenter provisions nodes for the buffer's virtual pods.
ACTIVE_CAPACITY = "buffer.x-k8s.io/active-capacity"


def apply_node_pool(cluster: KubeCluster, name: str, instance_types: Sequence[str],
                    labels: Mapping[str, str] | None = None, taints: Sequence[Mapping[str, str]] = (),
                    consolidate_after: str = "5s", limits: Mapping[str, str] | None = None) -> None:
    """A KWOKNodeClass and a NodePool, both called ``name``, whose nodes are of ``instance_types`` and carry
    ``labels`` and ``taints`` (``{"key", "value", "effect"}``); empty nodes go after ``consolidate_after``
    (policy WhenEmpty); ``limits`` caps the pool's total resources (e.g. ``{"cpu": "64"}``)."""
    node_class = {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": name}}
    pool: dict[str, Any] = {
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name},
        "spec": {
            "template": {
                "metadata": {"labels": dict(labels or {})},
                "spec": {
                    "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": name},
                    "requirements": [{"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": list(instance_types)}],
                    "taints": [dict(taint) for taint in taints],
                    "expireAfter": "Never",
                },
            },
            "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": consolidate_after},
            **({"limits": dict(limits)} if limits else {}),
        },
    }
    cluster.kubectl("apply", "--server-side", "-f", "-", input=_yaml_stream(node_class, pool))


def delete_node_pool(cluster: KubeCluster, name: str) -> None:
    """The NodePool and its KWOKNodeClass; Karpenter then removes the pool's NodeClaims and Nodes."""
    cluster.kubectl("delete", "--ignore-not-found", "--wait=false", f"nodepools.karpenter.sh/{name}",
                    f"kwoknodeclasses.karpenter.kwok.sh/{name}")


def node_claims(cluster: KubeCluster, pool: str | None = None) -> list[dict]:
    """Karpenter's NodeClaims, of ``pool`` only when given."""
    selector = f"{NODE_POOL_LABEL}={pool}" if pool else ""
    return cluster.custom_objects().list_cluster_custom_object(*KARPENTER, "nodeclaims",
                                                               label_selector=selector)["items"]


def karpenter_nodes(cluster: KubeCluster, pool: str | None = None) -> list[kubernetes.client.V1Node]:
    """The Nodes Karpenter's kwok provider made (providerID ``kwok://``), of ``pool`` only when given."""
    selector = f"{NODE_POOL_LABEL}={pool}" if pool else NODE_POOL_LABEL
    return [node for node in cluster.core_v1().list_node(label_selector=selector).items
            if (node.spec.provider_id or "").startswith(KWOK_PROVIDER_PREFIX)]


def node_ready(node: kubernetes.client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or ())


def condition(obj: Mapping[str, Any], kind: str) -> dict | None:
    """The status condition of type ``kind`` of a custom object (NodeClaim, CapacityBuffer), or None."""
    return next((c for c in obj.get("status", {}).get("conditions", ()) if c["type"] == kind), None)


def apply_capacity_buffer(cluster: KubeCluster, namespace: str, name: str, pod_spec: Mapping[str, Any],
                          replicas: int) -> None:
    """A PodTemplate ``name`` holding ``pod_spec`` (one chunk of the buffer) and a CapacityBuffer ``name``
    that asks Karpenter for room for ``replicas`` such pods (strategy active-capacity)."""
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name, "namespace": namespace},
                "template": {"spec": dict(pod_spec)}}
    buffer = {"apiVersion": "/".join(BUFFERS[:2]), "kind": "CapacityBuffer",
              "metadata": {"name": name, "namespace": namespace},
              "spec": {"podTemplateRef": {"name": name}, "replicas": replicas,
                       "provisioningStrategy": ACTIVE_CAPACITY}}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=_yaml_stream(template, buffer))


def capacity_buffer(cluster: KubeCluster, namespace: str, name: str) -> dict | None:
    try:
        return cluster.custom_objects().get_namespaced_custom_object(BUFFERS[0], BUFFERS[1], namespace, BUFFERS[2],
                                                                     name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def scale_capacity_buffer(cluster: KubeCluster, namespace: str, name: str, replicas: int) -> None:
    cluster.custom_objects().patch_namespaced_custom_object(BUFFERS[0], BUFFERS[1], namespace, BUFFERS[2], name,
                                                            {"spec": {"replicas": replicas}})


def _yaml_stream(*docs: Mapping[str, Any]) -> str:
    return yaml.safe_dump_all([dict(doc) for doc in docs])
