"""The local control plane itself: the version it reports, basic API round trips, and the
optional components (scheduler, controller-manager, kwok) doing their part."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import kubernetes
import pytest
from kubernetes.client.rest import ApiException


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll predicate every 0.2 s until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def unique(prefix: str) -> str:
    """Names are unique per run, so a cluster kept between sessions never collides."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def namespace(kube_cluster):
    name = unique("e2e-cp")
    core = kube_cluster.core_v1()
    core.create_namespace(kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def test_version_is_the_pinned_release(kube_cluster):
    info = kubernetes.client.VersionApi(kube_cluster.api_client).get_code()
    assert info.git_version == kube_cluster.k8s_version
    assert kube_cluster.k8s_version.startswith("v1.34.")
    assert (info.major, info.minor) == ("1", "34")


def test_namespace_and_configmap_round_trip(kube_cluster, namespace):
    core = kube_cluster.core_v1()
    body = kubernetes.client.V1ConfigMap(
        metadata=kubernetes.client.V1ObjectMeta(name="settings"), data={"gpu-memory": "4G"}
    )
    core.create_namespaced_config_map(namespace, body)
    assert core.read_namespaced_config_map("settings", namespace).data == {"gpu-memory": "4G"}
    with pytest.raises(ApiException) as conflict:
        core.create_namespaced_config_map(namespace, body)
    assert conflict.value.status == 409

    core.delete_namespaced_config_map("settings", namespace)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("settings", namespace)
    assert missing.value.status == 404


def test_kubectl_sees_the_cluster(kubectl, namespace):
    names = kubectl("get", "namespaces", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()
    assert {"default", "kube-system", namespace} <= set(names)
    client_version = json.loads(kubectl("version", "-o", "json").stdout)["clientVersion"]
    assert client_version["minor"] == "34"


def test_namespace_deletion_completes(kube_cluster):
    """Only the controller-manager's namespace controller can finish a namespace deletion."""
    if "kube-controller-manager" not in kube_cluster.running:
        pytest.skip("kube-controller-manager is not running in this (reused) control plane")
    core = kube_cluster.core_v1()
    name = unique("e2e-gone")
    core.create_namespace(kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name)))
    core.create_namespaced_config_map(
        name, kubernetes.client.V1ConfigMap(metadata=kubernetes.client.V1ObjectMeta(name="content"))
    )
    core.delete_namespace(name)

    def namespace_gone() -> bool:
        try:
            core.read_namespace(name)
        except ApiException as error:
            return error.status == 404
        return False

    wait_until(namespace_gone, 60, f"namespace {name} to be deleted")


def fake_gpu_node(name: str) -> kubernetes.client.V1Node:
    """A node kwok manages, advertising 8 GPUs the way a device plugin would."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return kubernetes.client.V1Node(
        metadata=kubernetes.client.V1ObjectMeta(
            name=name,
            annotations={"kwok.x-k8s.io/node": "fake"},
            labels={"type": "kwok", "cdmo.clear.ml/gpu-partitioning": "mig"},
        ),
        status=kubernetes.client.V1NodeStatus(capacity=resources, allocatable=resources),
    )


def test_kwok_node_becomes_ready_and_runs_pods(kube_cluster, namespace):
    if "kwok" not in kube_cluster.running:
        pytest.skip("kwok is not running in this (reused) control plane")
    core = kube_cluster.core_v1()
    node_name = unique("kwok-gpu")
    core.create_node(fake_gpu_node(node_name))
    try:

        def node_ready() -> bool:
            conditions = core.read_node(node_name).status.conditions or []
            return any(c.type == "Ready" and c.status == "True" for c in conditions)

        wait_until(node_ready, 30, f"kwok node {node_name} to become Ready")
        assert core.read_node(node_name).status.allocatable["nvidia.com/gpu"] == "8"

        container = kubernetes.client.V1Container(
            name="main",
            image="fake",
            resources=kubernetes.client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}),
        )
        pinned = kubernetes.client.V1Pod(
            metadata=kubernetes.client.V1ObjectMeta(name="pinned"),
            spec=kubernetes.client.V1PodSpec(node_name=node_name, containers=[container]),
        )
        core.create_namespaced_pod(namespace, pinned)
        wait_until(
            lambda: core.read_namespaced_pod("pinned", namespace).status.phase == "Running",
            30,
            "pod with spec.nodeName to be Running",
        )

        if "kube-scheduler" in kube_cluster.running:
            scheduled = kubernetes.client.V1Pod(
                metadata=kubernetes.client.V1ObjectMeta(name="scheduled"),
                spec=kubernetes.client.V1PodSpec(node_selector={"type": "kwok"}, containers=[container]),
            )
            core.create_namespaced_pod(namespace, scheduled)
            wait_until(
                lambda: core.read_namespaced_pod("scheduled", namespace).status.phase == "Running",
                30,
                "pod placed by kube-scheduler to be Running",
            )
            assert core.read_namespaced_pod("scheduled", namespace).spec.node_name == node_name
    finally:
        core.delete_node(node_name)
