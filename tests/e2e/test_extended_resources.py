"""A pod asking for the slices' DeviceClass as an extended resource, played by a tenant holding the built-in
`edit` role (kubectl --as), against the chart's extended-resource policy on the real API server.

Where DRA extended resources are served (1.36 and later; the plane's default is 1.37) every DeviceClass is
also the extended resource deviceclass.resource.kubernetes.io/<class>. For such a pod kube-scheduler writes
a ResourceClaim of class gpuslice.cdmo.io, which the chart's claim policy refuses (only the controller
writes those), so without more the pod is admitted and stays Pending for ever. The policy
(templates/extended-resource-policy.yaml, rendered under a name of this module's own and removed at the
end) refuses it at creation instead, naming the container and the resource and showing what to write.
First the API server is shown to admit such a pod without the policy, so the refusals below are the
policy's. It is bound in every namespace, as the chart binds it; no other test asks for the resource."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import wait_until

# Its tests share a module-scoped fixture: one pytest-xdist worker runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_extended_resources")

KubeCluster = Any
REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
TEMPLATE = "templates/extended-resource-policy.yaml"
TENANT = "tenant-extended-resources"
CLASS = "gpuslice.cdmo.io"
# Kubernetes' ResourceDeviceClassPrefix (pkg/apis/resource/types.go) and the chart's class.
RESOURCE = f"deviceclass.resource.kubernetes.io/{CLASS}"
WHY = (f" (DeviceClass {CLASS} as an extended resource): the pod would never start, since only the mig-operator "
       "controller writes claims of that class (one per GpuSlice), not kube-scheduler; remove it and use a GpuSlice "
       "instead: annotate the pod (e.g. cdmo.io/gpu-memory: 4G, ")
# What the message shows to write instead (each a request form: tests/helm checks them with core's parsers).
INSTEAD = ("cdmo.io/gpu-memory: 4G", "cdmo.io/gpu-fraction: '0.5'", "cdmo.io/mig-profile: 1g.10gb",
           "nvidia.com/mig-1g.10gb: 1", "resourceClaimName")


@dataclass
class Setup:
    policy: str
    namespace: str


def pod(name: str, containers: dict[str, dict[str, Any]] | None = None, init: dict[str, dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod whose containers (name -> resources) are ``containers`` (one plain 'main' by default)."""
    def made(resources_of: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"name": n, "image": "busybox", **({"resources": r} if r else {})} for n, r in resources_of.items()]

    spec: dict[str, Any] = {"containers": made(containers or {"main": {}})}
    if init:
        spec["initContainers"] = made(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}},
            "spec": spec}


def limits(resources: dict[str, Any]) -> dict[str, Any]:
    return {"limits": resources}


def as_tenant(cluster: KubeCluster, namespace: str, body: dict[str, Any], *args: str) -> subprocess.CompletedProcess:
    """``kubectl create`` of ``body`` in ``namespace`` as the tenant (a server-side dry run unless args say)."""
    return cluster.kubectl("create", "-n", namespace, "-f", "-", "-o", "json", f"--as={TENANT}",
                           *(args or ("--dry-run=server",)), input=json.dumps(body), check=False)


def refusal(answer: subprocess.CompletedProcess, policy: str) -> str:
    """The policy's message in a refused ``kubectl create``."""
    assert answer.returncode != 0, answer.stdout
    assert "(Forbidden)" in answer.stderr and f"ValidatingAdmissionPolicy '{policy}'" in answer.stderr, answer.stderr
    return answer.stderr.strip().split(" denied request: ", 1)[1]


def refused_by_policy(cluster: KubeCluster, namespace: str, policy: str) -> bool:
    answer = as_tenant(cluster, namespace, pod("probe", {"main": limits({RESOURCE: 1})}))
    if answer.returncode == 0:
        return False
    assert f"ValidatingAdmissionPolicy '{policy}'" in answer.stderr, answer.stderr
    return True


@pytest.fixture(scope="module")
def setup(kube_cluster: KubeCluster) -> Iterator[Setup]:
    run = "r" + uuid.uuid4().hex[:5]
    namespace = f"xr-{run}"
    rendered = subprocess.run([str(kube_cluster.bin_dir / "helm"), "template", "xr", str(CHART_DIR), "--namespace",
                               "xr-release", "--show-only", TEMPLATE, "--set", f"fullnameOverride=xr-{run}"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    policy = docs[0]["metadata"]["name"]
    try:
        kube_cluster.kubectl("create", "namespace", namespace)
        kube_cluster.kubectl("create", "rolebinding", f"{TENANT}-edit", "--clusterrole=edit", f"--user={TENANT}",
                             "-n", namespace)
        wait_until(lambda: kube_cluster.kubectl("auth", "can-i", "create", "pods", "-n", namespace, f"--as={TENANT}",
                                                check=False).stdout.strip() == "yes", 30, f"{TENANT} may create pods")
        # Without the policy the API server admits it: the name is a valid extended resource on this plane.
        assert not refused_by_policy(kube_cluster, namespace, policy)
        kube_cluster.kubectl("apply", "-f", "-", input=rendered.stdout)
        wait_until(lambda: refused_by_policy(kube_cluster, namespace, policy), 60,
                   "the extended-resource policy to be in force")
        yield Setup(policy, namespace)
    finally:
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=rendered.stdout,
                             check=False)
        kube_cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)


def test_the_api_server_type_checks_the_policy_without_a_warning(kube_cluster: KubeCluster, setup: Setup) -> None:
    def checked() -> Any:
        status = yaml.safe_load(kube_cluster.kubectl("get", "validatingadmissionpolicy", setup.policy, "-o",
                                                     "yaml").stdout).get("status") or {}
        return status if status.get("observedGeneration") == 1 else None

    status = wait_until(checked, 30, "the API server to type-check the policy")
    assert (status.get("typeChecking") or {}).get("expressionWarnings") in (None, []), status


@pytest.mark.parametrize("resources", [limits({RESOURCE: 1}), {"limits": {RESOURCE: 2}, "requests": {RESOURCE: 2}},
                                       limits({"cpu": "100m", RESOURCE: "1", "example.com/dongle": 1})],
                         ids=["limits", "limits-and-requests", "among-others"])
def test_a_container_asking_for_it_is_refused_with_what_to_write_instead(kube_cluster: KubeCluster, setup: Setup,
                                                                         resources: dict[str, Any]) -> None:
    body = pod("train", {"sidecar": {}, "main": resources})
    message = refusal(as_tenant(kube_cluster, setup.namespace, body, "--dry-run=none"), setup.policy)
    assert message.startswith(f"container 'main' asks for {RESOURCE}{WHY}"), message
    for text in INSTEAD:
        assert text in message, text
    # Refused at creation: nothing was made that could wait.
    assert kube_cluster.kubectl("get", "pod", "train", "-n", setup.namespace, check=False).returncode != 0


def test_init_containers_too_and_every_asking_container_is_named(kube_cluster: KubeCluster, setup: Setup) -> None:
    body = pod("prepare", init={"fetch": limits({RESOURCE: 1})})
    assert refusal(as_tenant(kube_cluster, setup.namespace, body), setup.policy).startswith(
        f"init container 'fetch' asks for {RESOURCE}{WHY}")
    body = pod("both", {"a": limits({RESOURCE: 1}), "b": {}, "c": limits({RESOURCE: 1})},
               init={"fetch": limits({RESOURCE: 1})})
    assert refusal(as_tenant(kube_cluster, setup.namespace, body), setup.policy).startswith(
        f"container 'a' asks for {RESOURCE}; container 'c' asks for {RESOURCE}; "
        f"init container 'fetch' asks for {RESOURCE}{WHY}")


def test_requests_alone_are_refused_too(kube_cluster: KubeCluster, setup: Setup) -> None:
    """An extended resource needs a limit (the API server's own rule), so requests alone never get this far;
    either way the pod is refused at creation with a word."""
    answer = as_tenant(kube_cluster, setup.namespace, pod("asks", {"main": {"requests": {RESOURCE: 1}}}))
    assert answer.returncode != 0 and RESOURCE in answer.stderr, answer.stderr


def test_an_ephemeral_container_cannot_ask_for_it(kube_cluster: KubeCluster, setup: Setup) -> None:
    """`edit` may not add ephemeral containers at all; whoever may (here cluster-admin) is refused resources on
    one by the API server itself."""
    assert as_tenant(kube_cluster, setup.namespace, pod("debugged"), "--dry-run=none").returncode == 0
    body = json.loads(kube_cluster.kubectl("get", "pod", "debugged", "-n", setup.namespace, "-o", "json").stdout)
    body["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox", "targetContainerName": "main",
                                            "resources": limits({RESOURCE: 1})}]
    path = f"/api/v1/namespaces/{setup.namespace}/pods/debugged/ephemeralcontainers"
    answer = kube_cluster.kubectl("replace", "--raw", path, "-f", "-", f"--as={TENANT}", input=json.dumps(body),
                                  check=False)
    assert answer.returncode != 0 and 'cannot update resource "pods/ephemeralcontainers"' in answer.stderr, (
        answer.stderr)
    answer = kube_cluster.kubectl("replace", "--raw", path, "-f", "-", input=json.dumps(body), check=False)
    assert answer.returncode != 0, answer.stdout
    assert "resources" in answer.stderr and "Ephemeral Container" in answer.stderr, answer.stderr
    got = json.loads(kube_cluster.kubectl("get", "pod", "debugged", "-n", setup.namespace, "-o", "json").stdout)
    assert not got["spec"].get("ephemeralContainers")


def test_pods_asking_otherwise_are_admitted_as_they_are(kube_cluster: KubeCluster, setup: Setup) -> None:
    bodies = [
        pod("plain"),
        pod("annotated", annotations={"cdmo.io/gpu-memory": "4G"}),
        pod("mig", {"main": limits({"nvidia.com/mig-1g.10gb": 1})}),
        # Another class's implicit resource, and other extended resources, are not the chart's.
        pod("other-class", {"main": limits({"deviceclass.resource.kubernetes.io/other.example.com": 1})}),
        pod("near", {"main": limits({"example.com/gpuslice.cdmo.io": 1, "nvidia.com/gpu": 1})},
            init={"fetch": {"requests": {"cpu": "100m"}}}),
    ]
    for body in bodies:
        answer = as_tenant(kube_cluster, setup.namespace, body)
        assert answer.returncode == 0, (body["metadata"]["name"], answer.stderr)
        made = json.loads(answer.stdout)
        assert (made["metadata"].get("annotations") or {}) == body["metadata"]["annotations"]
        for made_container, sent in zip(made["spec"]["containers"], body["spec"]["containers"], strict=True):
            assert (made_container.get("resources") or {}).get("limits", {}).keys() == (
                sent.get("resources") or {}).get("limits", {}).keys()
