"""The local control plane itself: the version it reports, basic API round trips, and the
optional components (scheduler, controller-manager, kwok, hollow node) doing their part."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

CONTROL_PLANE = Path(__file__).resolve().parents[2] / "scripts" / "control-plane"


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


def script_version(name: str) -> str:
    """A release the script names: K8S_DEFAULT_VERSION or K8S_OLDEST_VERSION."""
    found = re.search(rf"^{name}=(v\d+\.\d+\.\d+)\s", CONTROL_PLANE.read_text(), re.MULTILINE)
    assert found, f"no {name}=vX.Y.Z line in {CONTROL_PLANE}"
    return found.group(1)


def requested_k8s_version() -> str:
    """The release the plane was asked for: MIG_OPERATOR_K8S_VERSION, else the script's default."""
    return os.environ.get("MIG_OPERATOR_K8S_VERSION") or script_version("K8S_DEFAULT_VERSION")


@pytest.mark.compat
def test_version_is_the_pinned_release(kube_cluster):
    info = kubernetes.client.VersionApi(kube_cluster.api_client).get_code()
    assert kube_cluster.k8s_version == requested_k8s_version()
    assert info.git_version == kube_cluster.k8s_version
    major, minor, _patch = kube_cluster.k8s_version.removeprefix("v").split(".")
    assert (info.major, info.minor) == (major, minor)


def test_up_refuses_a_running_plane_of_another_release(kube_cluster):
    """`up` on a state dir whose plane runs another release fails at once, naming both (it builds
    nothing: the other release need not be built), and leaves the plane running."""
    other = next(v for v in (script_version("K8S_OLDEST_VERSION"), script_version("K8S_DEFAULT_VERSION"))
                 if v != kube_cluster.k8s_version)
    env = dict(os.environ, MIG_OPERATOR_RUN=str(kube_cluster.kubeconfig.parent), MIG_OPERATOR_K8S_VERSION=other)
    up = subprocess.run([str(CONTROL_PLANE), "up"], env=env, capture_output=True, text=True, timeout=60)
    assert up.returncode == 1, up.stderr
    assert f"k8s/{kube_cluster.k8s_version}/bin/kube-apiserver, not k8s {other}'s" in up.stderr
    assert kubernetes.client.VersionApi(kube_cluster.api_client).get_code().git_version == kube_cluster.k8s_version


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


def test_kubectl_sees_the_cluster(kube_cluster, kubectl, namespace):
    names = kubectl("get", "namespaces", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()
    assert {"default", "kube-system", namespace} <= set(names)
    # kubectl is built with the plane: the same release as the server.
    client_version = json.loads(kubectl("version", "-o", "json").stdout)["clientVersion"]
    assert client_version["gitVersion"] == kube_cluster.k8s_version


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


# ---- the hollow node ---------------------------------------------------------------------------------


@pytest.fixture
def hollow_plane() -> Iterator[tuple[dict[str, str], kubernetes.client.ApiClient]]:
    """A control plane of its own (the session's has no hollow node) with the scheduler, the
    controller-manager and a hollow node named, labelled and given 8 GPUs through the script's
    environment; stopped at the end. Its state dir is short: the kubelet's sockets go under it, and a
    unix socket path has 107 bytes (a pytest-xdist worker's tmp_path is longer)."""
    parent = tempfile.mkdtemp(prefix="mo-hp-")
    env = dict(os.environ, MIG_OPERATOR_RUN=os.path.join(parent, "s"), MIG_OPERATOR_HOLLOW_NODE="hollow-e2e",
               MIG_OPERATOR_HOLLOW_NODE_LABELS="cdmo.test/role=hollow,cdmo.test/zone=a",
               MIG_OPERATOR_HOLLOW_NODE_RESOURCES="nvidia.com/gpu=8")

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(CONTROL_PLANE), *args], env=env, capture_output=True, text=True, timeout=600)

    # The controller-manager's node lifecycle controller lifts the not-ready taint the kubelet
    # registers its Node with; without it nothing is scheduled there.
    up = script("up", "--with", "scheduler,controller-manager,hollow-node")
    try:
        assert up.returncode == 0, f"up failed:\n{up.stderr[-4000:]}"
        settings = dict(line.split("=", 1) for line in script("env").stdout.splitlines() if "=" in line)
        settings["KUBECONFIG"] = up.stdout.strip().splitlines()[-1].removeprefix("KUBECONFIG=")
        settings["status"] = script("status").stdout
        client = kubernetes.config.new_client_from_config(config_file=settings["KUBECONFIG"])
        try:
            yield settings, client
        finally:
            client.close()
    finally:
        down = script("down")
        shutil.rmtree(parent, ignore_errors=True)
        assert down.returncode == 0, down.stderr


@pytest.mark.compat
def test_hollow_node_registers_a_ready_node_and_calls_dra(hollow_plane):
    """`up --with hollow-node`: the real kubelet code registers a Ready Node, runs a plain pod on its
    fake runtime, and for a pod whose claim is allocated on it asks the claim's DRA driver to
    prepare it (here no driver is registered, so the pod waits and the kubelet says why)."""
    settings, client = hollow_plane
    core = kubernetes.client.CoreV1Api(client)
    state = Path(settings["STATE_DIR"])
    assert settings["HOLLOW_NODE"] == "hollow-e2e"
    assert "hollow-node running" in settings["status"]
    # The kubelet's files are under the state dir, the plugin registry where `env` says.
    assert Path(settings["KUBELET_DIR"]) == state / "kubelet"
    assert Path(settings["PLUGIN_REGISTRY_DIR"]) == state / "kubelet" / "plugins_registry"
    assert Path(settings["PLUGIN_REGISTRY_DIR"]).is_dir()
    assert (state / "kubelet" / "dra_manager_state").is_file()  # the kubelet's DRA checkpoint

    node = core.read_node("hollow-e2e")  # `up` returned only once it was Ready
    assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"]
    assert node.status.node_info.kubelet_version == settings["K8S_VERSION"]
    assert node.metadata.labels["cdmo.test/role"] == "hollow"
    assert node.metadata.labels["cdmo.test/zone"] == "a"
    assert node.status.capacity["nvidia.com/gpu"] == node.status.allocatable["nvidia.com/gpu"] == "8"

    namespace = "default"
    plain = kubernetes.client.V1Pod(
        metadata=kubernetes.client.V1ObjectMeta(name="plain"),
        spec=kubernetes.client.V1PodSpec(containers=[kubernetes.client.V1Container(name="main", image="fake")]),
    )
    core.create_namespaced_pod(namespace, plain)
    wait_until(lambda: core.read_namespaced_pod("plain", namespace).status.phase == "Running", 60,
               "a plain pod to run on the hollow node")
    assert core.read_namespaced_pod("plain", namespace).spec.node_name == "hollow-e2e"

    driver = "probe.cdmo.test"
    resource_objects = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "hollow-e2e-probe"},
         "spec": {"driver": driver, "nodeName": "hollow-e2e", "devices": [{"name": "dev0"}],
                  "pool": {"name": "hollow-e2e", "generation": 1, "resourceSliceCount": 1}}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": "probe", "namespace": namespace},
         "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": driver}}]}}},
    ]
    kubectl = [str(Path(settings["BIN_DIR"]) / "kubectl"), f"--kubeconfig={settings['KUBECONFIG']}"]
    subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List",
                   "items": resource_objects}), text=True, check=True, capture_output=True, timeout=60)
    claimed = kubernetes.client.V1Pod(
        metadata=kubernetes.client.V1ObjectMeta(name="claimed"),
        spec=kubernetes.client.V1PodSpec(
            resource_claims=[kubernetes.client.V1PodResourceClaim(name="dev", resource_claim_name="probe")],
            containers=[kubernetes.client.V1Container(
                name="main", image="fake",
                resources=kubernetes.client.V1ResourceRequirements(claims=[{"name": "dev"}]))],
        ),
    )
    core.create_namespaced_pod(namespace, claimed)

    def prepare_refused() -> list[str]:
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=claimed").items
        return [e.message for e in events if e.reason == "FailedPrepareDynamicResources"]

    messages = wait_until(prepare_refused, 60, "the kubelet's FailedPrepareDynamicResources event")
    assert f"DRA driver {driver} is not registered" in messages[0]
    pod = core.read_namespaced_pod("claimed", namespace)
    assert pod.spec.node_name == "hollow-e2e" and pod.status.phase == "Pending"
    claim = json.loads(subprocess.run([*kubectl, "get", "resourceclaim", "probe", "-n", namespace, "-o", "json"],
                                      capture_output=True, text=True, check=True, timeout=60).stdout)
    assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["dev0"]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["claimed"]
