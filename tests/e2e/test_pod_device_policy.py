"""The chart's pod device policy against the real API server (issue 16, item 6): no pod names a device.

The policy and its binding are rendered from the chart (templates/pod-device-policy.yaml) under a release
of this module's own, with a unique name, and bound only to namespaces carrying this run's label
(``podDevicePolicy.namespaceLabels``), so the session's other tests never meet it; both are deleted at
the end. Every refusal is checked for its message: the container (or annotation) and what it sets.

Every pod is written as the tenant: a user holding the built-in ``edit`` role in the namespaces
(tests/e2e/tenants.py), so what is refused is refused to the user the policy is for, and what is let
through is let through to it; the namespaces and the pod made before labelling are the admin's. ``edit``
does not add ephemeral containers (``kubectl debug``); the tenant also holds a Role that does, as an admin
grants for debugging, so that the policy, not RBAC, is what refuses them.

Namespaces, made in this order (the policy's namespace informer sees them in order, so once the policy
is in force in the last one, the earlier ones' labels are known to it too):
  release   the release's namespace: never checked, labelled or not
  skipped   listed in podDevicePolicy.excludeNamespaces: not checked although labelled
  old       holds a pod with NVIDIA_VISIBLE_DEVICES made before the namespace was labelled
  checked   checked
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from harness import wait_until
from kubernetes.client.rest import ApiException
from tenants import grant, impersonating

# Also run on the oldest supported Kubernetes release (make compat).
# Its tests share a module-scoped fixture: one pytest-xdist worker runs them all, in order.
pytestmark = [pytest.mark.compat, pytest.mark.xdist_group("test_pod_device_policy")]

KubeCluster = Any
REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
TEMPLATE = "templates/pod-device-policy.yaml"
RUN_LABEL = "pod-device-policy.e2e.cdmo.io/run"
DEVICES = ": devices reach containers only through a ResourceClaim (gpu.cdmo.io); remove the variable"
SLICE = ": a slice's variables come only from its ResourceClaim (gpu.cdmo.io, through CDI); remove the variable"
SHIM = " to the memory-limit shim (libgpuslice): only a fraction's ResourceClaim (gpu.cdmo.io) preloads it; remove it"
MOUNT = (": the NVIDIA runtime reads mounts there as device requests; devices reach containers only through a"
         " ResourceClaim (gpu.cdmo.io); remove the mount")
ANNOTATION = ": devices reach containers only through a ResourceClaim (gpu.cdmo.io); remove the annotation"
# Written out here, not read from the chart: the variables by which the NVIDIA container toolkit hands out
# devices (internal/config/image/envvars.go, internal/modifier/gated.go, swarm-resource's default), and CUDA's.
DEVICE_VARIABLES = ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES",
                    "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_NVSWITCH", "NVIDIA_GDRCOPY",
                    "DOCKER_RESOURCE_GPU", "CUDA_VISIBLE_DEVICES"]
SHIM_PATH = "/usr/local/lib/cdmo/libgpuslice.so"
TENANT = "pod-device-tenant"  # holds edit in this module's namespaces, nothing else


def tenant(cluster: KubeCluster) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(impersonating(cluster, TENANT))


@dataclass
class Policy:
    name: str
    release: str
    skipped: str
    old: str
    checked: str
    old_pod: str


def pod(name: str = "p", env: list[dict[str, Any]] | None = None, init_env: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None, mounts: tuple[str, ...] = ()) -> dict[str, Any]:
    """A pod with container 'main' (and init container 'setup' when ``init_env`` is given)."""
    main: dict[str, Any] = {"name": "main", "image": "busybox", "env": env or []}
    spec: dict[str, Any] = {"containers": [main]}
    if mounts:
        main["volumeMounts"] = [{"name": f"v{i}", "mountPath": path} for i, path in enumerate(mounts)]
        spec["volumes"] = [{"name": f"v{i}", "emptyDir": {}} for i in range(len(mounts))]
    if init_env is not None:
        spec["initContainers"] = [{"name": "setup", "image": "busybox", "env": init_env}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}},
            "spec": spec}


def var(name: str, value: str = "all") -> dict[str, str]:
    return {"name": name, "value": value}


def refusal(call: Any) -> str:
    """``call()`` is refused by this module's policy; the API server's message."""
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value.body
    message = yaml.safe_load(caught.value.body)["message"]
    assert "ValidatingAdmissionPolicy" in message and "-pod-devices.cdmo.io" in message, message
    return message.split(" denied request: ", 1)[1]


def dry_create(cluster: KubeCluster, namespace: str, body: dict[str, Any]) -> Any:
    """Create the pod as the tenant, a dry run (admission and RBAC run; nothing is stored)."""
    return tenant(cluster).create_namespaced_pod(namespace, body, dry_run="All")


@pytest.fixture(scope="module")
def policy(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Policy]:
    core = kube_cluster.core_v1()
    # A letter first: a value such as "691e05" is a number to YAML, and a label value must be a string.
    run = "r" + uuid.uuid4().hex[:5]
    names = {part: f"pdp-{run}-{part}" for part in ("release", "skipped", "old", "checked")}
    values = tmp_path_factory.mktemp("pod-device-policy") / "values.yaml"
    values.write_text(yaml.safe_dump({"fullnameOverride": f"pdp-{run}", "podDevicePolicy": {
        "excludeNamespaces": [names["skipped"]], "namespaceLabels": {RUN_LABEL: run}}}))
    rendered = subprocess.run([str(kube_cluster.bin_dir / "helm"), "template", "pdp", str(CHART_DIR), "--namespace",
                               names["release"], "--show-only", TEMPLATE, "--values", str(values)],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    labelled = {RUN_LABEL: run}
    try:
        core.create_namespace({"metadata": {"name": names["release"], "labels": labelled}})
        core.create_namespace({"metadata": {"name": names["skipped"], "labels": labelled}})
        core.create_namespace({"metadata": {"name": names["old"]}})
        # Made before its namespace is checked: the policy must not lock it (labels, finalizers).
        core.create_namespaced_pod(names["old"], pod("before", [var("NVIDIA_VISIBLE_DEVICES")]))
        core.patch_namespace(names["old"], {"metadata": {"labels": labelled}})
        core.create_namespace({"metadata": {"name": names["checked"], "labels": labelled}})
        rbac = kubernetes.client.RbacAuthorizationV1Api(kube_cluster.api_client)
        for namespace in names.values():
            grant(kube_cluster, namespace, TENANT)
            rbac.create_namespaced_role(namespace, {"metadata": {"name": "debug"}, "rules": [
                {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["update", "patch"]}]})
            rbac.create_namespaced_role_binding(namespace, {
                "metadata": {"name": "tenant-debug"},
                "subjects": [{"kind": "User", "name": TENANT, "apiGroup": "rbac.authorization.k8s.io"}],
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "debug"}})
        kube_cluster.kubectl("apply", "-f", "-", input=rendered.stdout)
        probe = pod("probe", [var("NVIDIA_VISIBLE_DEVICES")])
        for namespace in (names["checked"], names["old"]):
            wait_until(lambda ns=namespace: in_force(kube_cluster, ns, probe), 60,
                       f"the pod device policy to be in force in {namespace}")
        yield Policy(docs[0]["metadata"]["name"], names["release"], names["skipped"], names["old"], names["checked"],
                     "before")
    finally:
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=rendered.stdout)
        for namespace in names.values():
            kube_cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


def current_pod(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    """The pod as a dict to replace with, unconditionally: kube-scheduler and kwok write it meanwhile."""
    body = cluster.api_client.sanitize_for_serialization(cluster.core_v1().read_namespaced_pod(name, namespace))
    del body["metadata"]["resourceVersion"]
    return body


def in_force(cluster: KubeCluster, namespace: str, probe: dict[str, Any]) -> bool:
    try:
        dry_create(cluster, namespace, probe)
    except ApiException as exc:
        if exc.status == 403 and "-pod-devices.cdmo.io" in str(exc.body):
            return True
        raise
    return False


# ---- the policy itself ------------------------------------------------------------------------------------


def test_the_api_server_type_checks_every_expression_without_a_warning(kube_cluster: KubeCluster,
                                                                          policy: Policy) -> None:
    def checked() -> Any:
        status = yaml.safe_load(kube_cluster.kubectl("get", "validatingadmissionpolicy", policy.name, "-o",
                                                     "yaml").stdout).get("status") or {}
        return status if status.get("observedGeneration") == 1 else None

    status = wait_until(checked, 30, "the API server to type-check the policy")
    assert (status.get("typeChecking") or {}).get("expressionWarnings") in (None, []), status


# ---- CREATE: each forbidden field is refused, naming the container and the field ---------------------------


@pytest.mark.parametrize("variable", DEVICE_VARIABLES)
def test_each_device_variable_is_refused_in_a_container(kube_cluster: KubeCluster, policy: Policy,
                                                         variable: str) -> None:
    message = refusal(lambda: dry_create(kube_cluster, policy.checked, pod(env=[var("HOME", "/"), var(variable)])))
    assert message == f"container 'main' sets {variable}{DEVICES}"


def test_a_device_variable_from_a_configmap_key_is_refused_by_its_name(kube_cluster: KubeCluster,
                                                                        policy: Policy) -> None:
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, pod(env=env))) == (
        f"container 'main' sets NVIDIA_VISIBLE_DEVICES{DEVICES}")


def test_an_init_container_is_named_as_one_and_every_variable_is_listed(kube_cluster: KubeCluster,
                                                                         policy: Policy) -> None:
    body = pod(init_env=[var("NVIDIA_VISIBLE_DEVICES", "GPU-0"), var("PATH", "/bin"), var("NVIDIA_IMEX_CHANNELS", "0")])
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)) == (
        f"init container 'setup' sets NVIDIA_VISIBLE_DEVICES, NVIDIA_IMEX_CHANNELS{DEVICES}")
    body = pod(env=[var("CUDA_VISIBLE_DEVICES", "0")], init_env=[var("NVIDIA_MIG_CONFIG_DEVICES")])
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)) == (
        f"container 'main' sets CUDA_VISIBLE_DEVICES; init container 'setup' sets NVIDIA_MIG_CONFIG_DEVICES{DEVICES}")


@pytest.mark.parametrize("variable", ["CDMO_SLICE", "CDMO_GPU_MEMORY_LIMIT", "CDMO_ANY_FUTURE_ONE", "GPU_MEM_LIMIT_GB"])
@pytest.mark.parametrize("where", ["container", "init container"])
def test_the_slice_variables_are_refused(kube_cluster: KubeCluster, policy: Policy, variable: str, where: str) -> None:
    env = [var(variable, "1")]
    body = pod(env=env) if where == "container" else pod(init_env=env)
    name = "main" if where == "container" else "setup"
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)) == f"{where} '{name}' sets {variable}{SLICE}"


@pytest.mark.parametrize("value", [SHIM_PATH, f"/opt/lib/libjemalloc.so:{SHIM_PATH}", "libgpuslice.so"])
def test_ld_preload_of_the_shim_is_refused(kube_cluster: KubeCluster, policy: Policy, value: str) -> None:
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, pod(env=[var("LD_PRELOAD", value)]))) == (
        f"container 'main' sets LD_PRELOAD{SHIM}")


@pytest.mark.parametrize("path", ["/var/run/nvidia-container-devices/all", "/run/nvidia-container-devices/GPU-0",
                                  "/var/run/nvidia-container-devices"])
def test_a_mount_where_the_runtime_reads_device_requests_is_refused(kube_cluster: KubeCluster, policy: Policy,
                                                                    path: str) -> None:
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, pod(mounts=("/data", path)))) == (
        f"container 'main' mounts a volume at {path}{MOUNT}")


@pytest.mark.parametrize("key", ["cdi.k8s.io/gpu", "cdi.k8s.io", "nvidia.cdi.k8s.io/container.main",
                                 "nvidia.cdi.k8s.io"])
def test_a_cdi_annotation_is_refused(kube_cluster: KubeCluster, policy: Policy, key: str) -> None:
    body = pod(annotations={"team": "a", key: "nvidia.com/gpu=all"})
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)) == f"pod sets annotation {key}{ANNOTATION}"


def test_a_pod_without_them_is_admitted_as_it_is(kube_cluster: KubeCluster, policy: Policy) -> None:
    near_misses = [var("NVIDIA_DRIVER_CAPABILITIES", "compute,utility"), var("MY_NVIDIA_VISIBLE_DEVICES"),
                   var("CDMO", "x"), var("cdmo_slice", "x"), var("XCDMO_SLICE", "x"),
                   var("LD_PRELOAD", "/usr/lib/libjemalloc.so"), var("GPU_MEM_LIMIT", "4")]
    plain = pod("plain")
    near = pod("near", env=near_misses, init_env=[var("PATH", "/bin")], mounts=("/data",),
               annotations={"example.com/cdi.k8s.io": "x", "notcdi.k8s.io/x": "y", "cdmo.io/gpu-memory": "4Gi"})
    # What the operator's webhook makes of an annotated pod: a claim, the gate, nothing else.
    claimed = pod("claimed", annotations={"cdmo.io/gpu-memory": "4Gi"})
    claimed["spec"]["resourceClaims"] = [{"name": "gpu-slice", "resourceClaimName": "claimed-gs-0a1b2c3d"}]
    claimed["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu-slice"}]}
    claimed["spec"]["schedulingGates"] = [{"name": "cdmo.io/gpu-slice"}]
    for body in (plain, near, claimed):
        made = dry_create(kube_cluster, policy.checked, body)
        sent = kube_cluster.api_client.sanitize_for_serialization(made)
        assert (sent["spec"]["containers"][0].get("env") or []) == body["spec"]["containers"][0]["env"]
        assert (sent["metadata"].get("annotations") or {}) == body["metadata"]["annotations"]


def test_a_large_pod_stays_within_the_cel_cost_limits(kube_cluster: KubeCluster, policy: Policy) -> None:
    """10 containers of 1,000 variables each: evaluated (not a cost error), refused only for the one."""
    body = pod("large")
    body["spec"]["containers"] = [{"name": f"c{i}", "image": "busybox",
                                   "env": [var(f"VARIABLE_{i}_{j:04d}", "x") for j in range(1000)]} for i in range(10)]
    dry_create(kube_cluster, policy.checked, body)
    body["spec"]["containers"][9]["env"].append(var("NVIDIA_VISIBLE_DEVICES"))
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)) == (
        f"container 'c9' sets NVIDIA_VISIBLE_DEVICES{DEVICES}")


# ---- UPDATE and ephemeral containers ----------------------------------------------------------------------


def test_an_ephemeral_container_added_later_is_checked_and_the_pods_own_updates_refused_only_for_what_they_add(
        kube_cluster: KubeCluster, policy: Policy) -> None:
    core, ns = tenant(kube_cluster), policy.checked
    core.create_namespaced_pod(ns, pod("debugged", env=[var("HOME", "/")]))

    def with_ephemeral(name: str, env: list[dict[str, str]]) -> dict[str, Any]:
        body = current_pod(kube_cluster, ns, "debugged")
        body["spec"].setdefault("ephemeralContainers", []).append(
            {"name": name, "image": "busybox", "env": env, "targetContainerName": "main"})
        return body

    def add(name: str, env: list[dict[str, str]]) -> Any:
        return core.replace_namespaced_pod_ephemeralcontainers("debugged", ns, with_ephemeral(name, env))

    assert refusal(lambda: add("debug", [var("NVIDIA_VISIBLE_DEVICES", "GPU-0")])) == (
        f"ephemeral container 'debug' sets NVIDIA_VISIBLE_DEVICES{DEVICES}")
    assert refusal(lambda: add("debug", [var("CDMO_SLICE", "other/slice")])) == (
        f"ephemeral container 'debug' sets CDMO_SLICE{SLICE}")
    assert refusal(lambda: add("debug", [var("LD_PRELOAD", SHIM_PATH)])) == (
        f"ephemeral container 'debug' sets LD_PRELOAD{SHIM}")
    add("debug", [var("HOME", "/")])
    got = core.read_namespaced_pod("debugged", ns).spec.ephemeral_containers
    assert [c.name for c in got] == ["debug"]
    # An UPDATE of the pod may not add a CDI annotation, nor change one's value; other changes pass.
    assert refusal(lambda: core.patch_namespaced_pod("debugged", ns, {"metadata": {
        "annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}}})) == f"pod sets annotation cdi.k8s.io/gpu{ANNOTATION}"
    core.patch_namespaced_pod("debugged", ns, {"metadata": {"labels": {"checked": "yes"}}})
    assert core.read_namespaced_pod("debugged", ns).metadata.labels == {"checked": "yes"}


def test_a_pod_made_before_its_namespace_was_checked_stays_updatable(kube_cluster: KubeCluster,
                                                                     policy: Policy) -> None:
    core, ns = tenant(kube_cluster), policy.old
    core.patch_namespaced_pod(policy.old_pod, ns, {"metadata": {"labels": {"still": "updatable"},
                                                                "finalizers": ["example.com/keep"]}})
    core.patch_namespaced_pod(policy.old_pod, ns, {"metadata": {"finalizers": None}})
    got = core.read_namespaced_pod(policy.old_pod, ns)
    assert got.metadata.labels == {"still": "updatable"} and not got.metadata.finalizers
    assert [e.name for e in got.spec.containers[0].env] == ["NVIDIA_VISIBLE_DEVICES"]
    # What an UPDATE adds is still checked: a CDI annotation, an ephemeral container with a device.
    assert refusal(lambda: core.patch_namespaced_pod(policy.old_pod, ns, {"metadata": {
        "annotations": {"nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0"}}})) == (
        f"pod sets annotation nvidia.cdi.k8s.io/pod{ANNOTATION}")
    body = current_pod(kube_cluster, ns, policy.old_pod)
    body["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox",
                                            "env": [var("NVIDIA_MOFED", "enabled")]}]
    assert refusal(lambda: core.replace_namespaced_pod_ephemeralcontainers(policy.old_pod, ns, body)) == (
        f"ephemeral container 'debug' sets NVIDIA_MOFED{DEVICES}")


# ---- namespaces -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["release", "skipped"])
def test_the_releases_namespace_and_an_excluded_one_are_not_checked(kube_cluster: KubeCluster, policy: Policy,
                                                                     which: str) -> None:
    body = pod(env=[var("NVIDIA_VISIBLE_DEVICES"), var("CDMO_SLICE", "a/b")],
               mounts=("/var/run/nvidia-container-devices/all",), annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})
    namespace = getattr(policy, which)
    # Labelled like the checked namespace (the policy knows its label: the checked one was made later).
    assert kube_cluster.core_v1().read_namespace(namespace).metadata.labels[RUN_LABEL]
    dry_create(kube_cluster, namespace, body)
    assert refusal(lambda: dry_create(kube_cluster, policy.checked, body)).startswith("container 'main' sets ")
