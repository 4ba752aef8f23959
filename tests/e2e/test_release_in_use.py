"""Nothing is released while in use (issue 24, item 2), played by a tenant holding the built-in `edit`
role in its namespace, on the real control plane (kube-scheduler allocates and reserves each pod's
claim, kube-controller-manager drops the reservation when the pod goes), kwok nodes and agents on
simulated GPUs running as the chart's ServiceAccounts.

The attack: with a GpuQuota of one slice, an annotated pod runs, then the tenant deletes its slice
with `kubectl delete gs --wait=false`; the pod keeps its device. Before, the agent let the slice go at
once, its quota charge with it, and a second pod ran beside the first: a GPU outside the quota. On a
fraction GPU the planner then put a new slice where the deleted one still was, and the agent failed
it with Conflict. Expected figures come from the catalog (an H200's 1g.18gb holds 16384 MiB, an L4
has 23034 MiB), not from the code under test."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import GROUP, REPO_ROOT, VERSION, OperatorHarness, check_invariants, log_end, wait_for_log, wait_until
from kubernetes.client.rest import ApiException

# The hollow node's fixture: a real kubelet prepares and unprepares claims through the agent.
from test_hollow_node import NAMESPACE as HOLLOW_NAMESPACE  # isort: skip
from test_hollow_node import NODE as HOLLOW_NODE  # isort: skip
from test_hollow_node import HollowSetup, claimed_pod, hollow  # noqa: F401  # isort: skip

MIB = 2**20
H200_1G = 16384 * MIB
L4_MIB = 23034
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists"}
GATE = "cdmo.io/gpu-slice"
TENANT = "tenant-b"


@pytest.fixture
def tenant_roles(operator: OperatorHarness) -> Iterator[None]:
    """The chart's user roles, which kube-controller-manager aggregates into `edit`."""
    rendered = subprocess.run(
        [str(operator.cluster.bin_dir / "helm"), "template", "release-in-use", str(REPO_ROOT / "helm" / "mig-operator"),
         "--show-only", "templates/user-roles.yaml"], capture_output=True, text=True, timeout=120, check=True).stdout
    operator.cluster.kubectl("apply", "-f", "-", input=rendered)
    yield
    operator.cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered, check=False)


def tenant_namespace(op: OperatorHarness) -> str:
    ns = op.namespace()
    op.cluster.kubectl("create", "rolebinding", f"{TENANT}-edit", "--clusterrole=edit", f"--user={TENANT}", "-n", ns)
    wait_until(lambda: op.cluster.kubectl("auth", "can-i", "delete", "gpuslices.cdmo.io", "-n", ns, f"--as={TENANT}",
                                          check=False).stdout.strip() == "yes", 30,
               f"{TENANT} may delete GpuSlices in {ns} (edit, aggregated)")
    return ns


def as_tenant(op: OperatorHarness, *args: str) -> subprocess.CompletedProcess:
    return op.cluster.kubectl(*args, f"--as={TENANT}", check=False)


def put_quota(op: OperatorHarness, ns: str, memory: str, slices: int) -> None:
    wait_until(lambda: op.cluster.kubectl("get", "gq", "-A", check=False).returncode == 0, 60, "gpuquotas served")
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": "quota"},
            "spec": {"memory": memory, "slices": slices}}
    op.custom.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuquotas", body)


def quota_used(op: OperatorHarness, ns: str) -> dict:
    body = op.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "gpuquotas", "quota")
    return (body.get("status") or {}).get("used") or {}


def create_pod(op: OperatorHarness, ns: str, name: str, annotations: dict[str, str]) -> None:
    op.core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations},
        "spec": {"tolerations": [KWOK_TOLERATION], "containers": [{"name": "main", "image": "busybox"}]}})


def running(op: OperatorHarness, ns: str, name: str, timeout: float = 60) -> Any:
    def check() -> Any:
        pod = op.core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase == "Running" and pod.spec.node_name else None

    return wait_until(check, timeout, lambda: f"pod {ns}/{name} Running: {op.core.read_namespaced_pod(name, ns).status}"
                      f"\n{op.logs()}")


def slice_name(op: OperatorHarness, ns: str, pod: str) -> str:
    return wait_until(lambda: (op.core.read_namespaced_pod(pod, ns).metadata.labels or {}).get(GATE), 30,
                      f"pod {ns}/{pod}'s slice")


def released_condition(body: dict | None) -> dict | None:
    return next((c for c in ((body or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Released"),
                None)


def still_kept(ns: str, name: str) -> str:
    """The agent's log line when a look at a deleted slice finds its claim still in use."""
    return rf"slice {ns}/{name} is deleted and still in use, kept"


def delete_in_use(op: OperatorHarness, ns: str, name: str, pod: str) -> dict:
    """The tenant deletes a running pod's slice without waiting; returns the slice as it is then kept."""
    answer = as_tenant(op, "delete", "gs", name, "-n", ns, "--wait=false")
    assert answer.returncode == 0, answer.stderr

    def kept() -> dict | None:
        body = op.get_slice(ns, name)
        cond = released_condition(body)
        return body if cond is not None and (cond["status"], cond["reason"]) == ("False", "InUse") else None

    body = wait_until(kept, 20, lambda: f"{ns}/{name} kept with Released=False InUse: {op.get_slice(ns, name)}"
                      f"\n{op.logs()}")
    assert body["metadata"].get("deletionTimestamp") and "cdmo.io/agent" in body["metadata"]["finalizers"]
    assert f"pod {ns}/{pod}" in released_condition(body)["message"]
    assert (body["status"]["phase"], body["status"]["reason"]) == ("Ready", "InUse")
    shown = op.cluster.kubectl("get", "gs", name, "-n", ns, "--no-headers").stdout.split()
    assert shown[3:5] == ["Ready", "InUse"], shown  # NAME, REQUEST (two words), PHASE, REASON, ...
    return body


@pytest.mark.compat
def test_a_tenant_deleting_its_running_pods_slice_keeps_the_quota_charge_until_the_pod_ends(
        operator: OperatorHarness, tenant_roles: None) -> None:
    node = operator.add_node("h200-141gb")
    operator.start_operator(node, webhook=True)
    ns = tenant_namespace(operator)
    put_quota(operator, ns, "1Ti", slices=1)
    create_pod(operator, ns, "first", {"cdmo.io/gpu-memory": "10G"})
    running(operator, ns, "first")
    first = slice_name(operator, ns, "first")
    uid = operator.get_slice(ns, first)["metadata"]["uid"]
    kept = delete_in_use(operator, ns, first, "first")
    device = kept["status"]["deviceUUID"]

    create_pod(operator, ns, "second", {"cdmo.io/gpu-memory": "10G"})
    second = slice_name(operator, ns, "second")
    st = operator.wait_phase(ns, second, "Pending", reason="QuotaExceeded")["status"]
    looked = log_end(operator.process(f"agent-{node.name}").log)
    assert "0 of its 1 slices" not in st["message"] and "1 of its 1 slices" in st["message"], st["message"]
    # The agent's next look at the held slice finds the pod running: nothing changes.
    agent = operator.process(f"agent-{node.name}")
    wait_for_log(agent.log, still_kept(ns, first), after=looked)
    assert running(operator, ns, "first", timeout=1)
    assert [g.name for g in operator.core.read_namespaced_pod("second", ns).spec.scheduling_gates or []] == [GATE]
    assert (operator.get_slice(ns, second) or {})["status"]["phase"] == "Pending"
    assert operator.get_slice(ns, first) is not None
    wait_until(lambda: quota_used(operator, ns) == {"memory": str(H200_1G), "slices": 1, "wholeGpus": 0}, 10,
               lambda: f"the quota still charged for {first}: {quota_used(operator, ns)}")
    # The agent still holds the instance for the deleted slice: not idle, not offered.
    gpu = operator.gpunode(node)["status"]["gpus"][0]
    assert [i["sliceUID"] for i in gpu["instances"] if i.get("deviceUUID") == device] == [uid]

    # The pod ends: the claim's reservation goes, the slice is released at once and the second runs.
    operator.core.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    operator.wait_gone(ns, first, timeout=30)
    running(operator, ns, "second")
    check_invariants(operator)


def test_a_deleted_fraction_in_use_still_occupies_its_gpu_and_no_slice_fails_with_conflict(
        operator: OperatorHarness, tenant_roles: None) -> None:
    node = operator.add_node("l4-24gb", labelled=False)
    operator.start_operator(node, webhook=True)
    ns = tenant_namespace(operator)
    create_pod(operator, ns, "first", {"cdmo.io/gpu-fraction": "0.75"})
    running(operator, ns, "first")
    first = slice_name(operator, ns, "first")
    delete_in_use(operator, ns, first, "first")
    # Its agent still lists the fraction on the GPU (the controller counts its room from there too).
    wait_until(lambda: [f["slice"] for f in operator.gpunode(node)["status"]["gpus"][0]["fractions"]]
               == [f"{ns}/{first}"], 10, lambda: f"the fraction listed: {operator.gpunode(node)}\n{operator.logs()}")

    # A quarter of the L4 is free, half is asked for: it waits for room, it is never bound and failed.
    create_pod(operator, ns, "second", {"cdmo.io/gpu-fraction": "0.5"})
    second = slice_name(operator, ns, "second")
    operator.wait_phase(ns, second, "Pending", reason="NoCapacity")
    # The agent's next look at the held fraction finds the pod running: nothing is freed or failed.
    agent = operator.process(f"agent-{node.name}")
    wait_for_log(agent.log, still_kept(ns, first), after=log_end(agent.log))
    phases = {s["metadata"]["name"]: (s.get("status") or {}).get("phase") for s in operator.slices(ns)}
    assert "Failed" not in phases.values() and phases.get(second) == "Pending", phases
    events = operator.core.list_namespaced_event(ns).items
    assert not [e.message for e in events if e.reason == "Conflict"]

    operator.core.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    operator.wait_gone(ns, first, timeout=30)
    running(operator, ns, "second")
    granted = operator.get_slice(ns, second)["status"]["grantedBytes"]
    assert granted == int(L4_MIB * MIB * 0.5) // MIB * MIB
    check_invariants(operator)


def test_a_slice_is_released_once_its_pod_ends_and_a_slice_no_pod_uses_at_once(
        operator: OperatorHarness, tenant_roles: None) -> None:
    """The positive control: holding a slice needs a pod that holds its claim."""
    node = operator.add_node("h100-80gb")
    operator.start_operator(node, webhook=True)
    ns = tenant_namespace(operator)
    put_quota(operator, ns, "1Ti", slices=1)
    create_pod(operator, ns, "done", {"cdmo.io/gpu-memory": "4G"})
    running(operator, ns, "done")
    name = slice_name(operator, ns, "done")
    operator.core.delete_namespaced_pod("done", ns, grace_period_seconds=0)
    operator.wait_gone(ns, name, timeout=30)
    wait_until(lambda: quota_used(operator, ns) == {"memory": "0", "slices": 0, "wholeGpus": 0}, 10,
               lambda: f"the quota freed: {quota_used(operator, ns)}")
    wait_until(lambda: all(not i["sliceUID"] for i in operator.gpunode(node)["status"]["gpus"][0]["instances"]), 10,
               lambda: f"the instance idle on the GpuNode: {operator.gpunode(node)['status']['gpus'][0]['instances']}")

    # A slice made directly, its claim written and reserved by no pod: the tenant's delete releases it.
    operator.create_slice(ns, "notebook", {"memory": "4G"})
    operator.wait_phase(ns, "notebook", "Ready")
    wait_until(lambda: _claim_exists(operator, ns, "notebook"), 20, "the notebook's ResourceClaim")
    started = time.monotonic()
    assert as_tenant(operator, "delete", "gs", "notebook", "-n", ns, "--wait=false").returncode == 0
    operator.wait_gone(ns, "notebook", timeout=10)
    assert time.monotonic() - started < 10
    check_invariants(operator)


def _claim_exists(op: OperatorHarness, ns: str, name: str) -> bool:
    try:
        op.custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.mark.compat
def test_a_slice_the_kubelet_prepared_is_kept_until_the_kubelet_unprepares_it(hollow: HollowSetup) -> None:  # noqa: F811
    """The prepared half, with the real kubelet code: the notebook's pod runs on a slice made directly,
    the slice is deleted; it is kept, naming the pod and the node that prepared its claim, until the
    pod is deleted and the kubelet calls NodeUnprepareResources."""
    core = hollow.cluster.core_v1()
    kubectl = hollow.cluster.kubectl
    ns = HOLLOW_NAMESPACE
    kubectl("create", "namespace", ns)
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "nb", "namespace": ns},
        "spec": {"migProfile": "2g.10gb"}}))
    wait_until(lambda: kubectl("get", "resourceclaim", "nb", "-n", ns, check=False).returncode == 0, 60,
               lambda: f"the slice's ResourceClaim\n{hollow.logs()}")
    kubectl("apply", "-f", "-", input=json.dumps(claimed_pod("nb-0", "nb")))
    wait_until(lambda: core.read_namespaced_pod("nb-0", ns).status.phase == "Running", 60,
               lambda: f"pod nb-0 to run on {HOLLOW_NODE}\n{hollow.logs()}")
    assert len(list(hollow.cdi_dir.glob("*"))) == 1

    def get_slice() -> dict | None:
        answer = kubectl("get", "gs", "nb", "-n", ns, "-o", "json", check=False)
        return json.loads(answer.stdout) if answer.returncode == 0 else None

    assert kubectl("delete", "gs", "nb", "-n", ns, "--wait=false").returncode == 0

    def kept() -> dict | None:
        cond = released_condition(get_slice())
        return cond if cond is not None and (cond["status"], cond["reason"]) == ("False", "InUse") else None

    cond = wait_until(kept, 30, lambda: f"nb kept with Released=False InUse: {get_slice()}\n{hollow.logs()}")
    assert f"pod {ns}/nb-0" in cond["message"] and f"prepared on node {HOLLOW_NODE}" in cond["message"]
    agent_log = hollow.workdir / "agent.log"
    wait_for_log(agent_log, still_kept(ns, "nb"), after=log_end(agent_log))  # the agent's next look: kept
    assert get_slice() is not None and len(list(hollow.cdi_dir.glob("*"))) == 1

    core.delete_namespaced_pod("nb-0", ns)
    wait_until(lambda: get_slice() is None, 60, lambda: f"nb released once its pod is gone\n{hollow.logs()}")
    assert list(hollow.cdi_dir.glob("*")) == []


def test_a_tenant_removing_the_finalizer_frees_no_quota_while_the_kubelet_holds_the_device(
        hollow: HollowSetup) -> None:  # noqa: F811
    """The `edit` role may patch a slice's metadata, finalizers included. A tenant that strips the
    agent's finalizer makes the slice vanish, but the agent still holds the prepared device (offered
    to nobody, `inUse` on its GpuNode) and the controller keeps charging the namespace for it from
    there, so a second slice still waits for the quota until the pod ends."""
    kubectl = hollow.cluster.kubectl
    core = hollow.cluster.core_v1()
    ns = HOLLOW_NAMESPACE
    kubectl("create", "namespace", ns)
    roles = subprocess.run(
        [str(hollow.cluster.bin_dir / "helm"), "template", "release-in-use", str(REPO_ROOT / "helm" / "mig-operator"),
         "--show-only", "templates/user-roles.yaml"], capture_output=True, text=True, timeout=120, check=True).stdout
    kubectl("apply", "-f", "-", input=roles)
    kubectl("create", "rolebinding", f"{TENANT}-edit", "--clusterrole=edit", f"--user={TENANT}", "-n", ns)
    wait_until(lambda: kubectl("auth", "can-i", "patch", "gpuslices.cdmo.io", "-n", ns, f"--as={TENANT}",
                               check=False).stdout.strip() == "yes", 30, f"{TENANT} may patch GpuSlices")
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuQuota", "metadata": {"name": "quota", "namespace": ns},
        "spec": {"memory": "1Ti", "slices": 1}}))
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "nb", "namespace": ns},
        "spec": {"migProfile": "2g.10gb"}}))
    wait_until(lambda: kubectl("get", "resourceclaim", "nb", "-n", ns, check=False).returncode == 0, 60,
               lambda: f"the slice's ResourceClaim\n{hollow.logs()}")
    uid = json.loads(kubectl("get", "gs", "nb", "-n", ns, "-o", "json").stdout)["metadata"]["uid"]
    kubectl("apply", "-f", "-", input=json.dumps(claimed_pod("nb-0", "nb")))
    wait_until(lambda: core.read_namespaced_pod("nb-0", ns).status.phase == "Running", 60,
               lambda: f"pod nb-0 to run on {HOLLOW_NODE}\n{hollow.logs()}")

    # (Stripped before the delete, the controller puts the finalizer back on a bound slice: so after.)
    assert kubectl("delete", "gs", "nb", "-n", ns, "--wait=false", f"--as={TENANT}", check=False).returncode == 0
    patched = kubectl("patch", "gs", "nb", "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                      f"--as={TENANT}", check=False)
    assert patched.returncode == 0 or "NotFound" in patched.stderr, patched.stderr
    wait_until(lambda: kubectl("get", "gs", "nb", "-n", ns, check=False).returncode != 0, 30, "nb gone")

    def instances() -> list[dict]:
        gpunode = json.loads(kubectl("get", "gn", HOLLOW_NODE, "-o", "json").stdout)
        return [i for g in gpunode["status"]["gpus"] for i in g["instances"]]

    # The agent took the slice's deletion in and keeps the prepared device (not released).
    wait_for_log(hollow.workdir / "agent.log", rf"slice {ns}/nb is gone while its claim is prepared")
    wait_until(lambda: [i["inUse"] for i in instances() if i["sliceUID"] == uid] == [True], 10,
               lambda: f"the agent still holds nb's instance: {instances()}")
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "metadata": {"name": "nb2", "namespace": ns},
        "spec": {"migProfile": "2g.10gb"}}))

    def status_of(name: str) -> dict:
        answer = kubectl("get", "gs", name, "-n", ns, "-o", "json", check=False)
        return (json.loads(answer.stdout).get("status") or {}) if answer.returncode == 0 else {}

    wait_until(lambda: status_of("nb2").get("reason") == "QuotaExceeded", 30,
               lambda: f"nb2 waits for the quota: {status_of('nb2')}\n{hollow.logs()}")
    assert status_of("nb2").get("phase") == "Pending"

    core.delete_namespaced_pod("nb-0", ns)
    wait_until(lambda: status_of("nb2").get("phase") == "Ready", 60,
               lambda: f"nb2 Ready once the pod is gone: {status_of('nb2')}\n{hollow.logs()}")
