"""The controller allocates each slice's ResourceClaim itself, pinned to the slice's node (issue 24, "The
controller's claims are pinned"), on a real control plane with kube-scheduler, kube-controller-manager
and kwok nodes: an annotated pod's claim is reserved for it by the controller too (kube-scheduler
writes nothing to it), a device that another node publishes under the slice's UID (a compromised
agent) never gets the slice's pods, and a directly made slice's claim stays allocated to its node
across its pods. The chart's claim allocation policy
(templates/claim-allocation-policy.yaml, for the controller of the session's chart identities) is
applied for these tests: without it, a pod that names a claim before the controller allocates it can
have kube-scheduler allocate it first (without the policy, in 4 runs of the two tests that play it,
pods waiting for the claim ran on the thief's node twice, and kube-scheduler's finalizer reached the
claim the other two times)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from cluster import CHART_NAMESPACE, CHART_RELEASE, ChartIdentities, KubeCluster, render_chart
from harness import OperatorHarness, SimNode, wait_until
from kubernetes.client.rest import ApiException
from test_pods import KWOK_TOLERATION, create_pod, handed_device, running

# Also run on the oldest supported Kubernetes release (make compat).
# Its tests share a module-scoped fixture: one pytest-xdist worker runs them all, in order.
pytestmark = [pytest.mark.compat, pytest.mark.xdist_group("test_claim_pinning")]

DRA = ("resource.k8s.io", "v1")
SCHEDULER = "kube-scheduler"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
POLICY_TEMPLATE = "templates/claim-allocation-policy.yaml"


@pytest.fixture(scope="module")
def allocation_policy(kube_cluster: KubeCluster, chart_identities: ChartIdentities) -> Iterator[str]:
    """The chart's claim allocation policy, enforced; yields a namespace with an unallocated claim of
    class gpuslice.cdmo.io that the controller made (impersonated), named "probe"."""
    rendered = render_chart(kube_cluster, CHART_RELEASE, CHART_NAMESPACE, "--show-only", POLICY_TEMPLATE)
    assert [d["kind"] for d in yaml.safe_load_all(rendered) if d] == [
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    ns = f"pin-{uuid.uuid4().hex[:6]}"
    kube_cluster.core_v1().create_namespace({"metadata": {"name": ns}})
    probe = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "probe"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuslice.cdmo.io"}}]}}}
    kube_cluster.kubectl("create", "-n", ns, "-f", "-", "--as", chart_identities.user("controller"),
                         input=yaml.safe_dump(probe))
    kube_cluster.kubectl("apply", "-f", "-", input=rendered)

    def enforced() -> bool:
        try:
            _allocate_as_admin(kube_cluster, ns, "probe", dry_run=True)
        except ApiException as exc:
            if exc.status == 403 and "only the mig-operator controller allocates" in str(exc.body):
                return True
            raise
        return False

    try:
        wait_until(enforced, 30, "the claim allocation policy to be enforced", interval=0.3)
        yield ns
    finally:
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered)
        kube_cluster.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false")


def _allocate_as_admin(cluster: KubeCluster, ns: str, name: str, dry_run: bool = False) -> Any:
    """What kube-scheduler writes when it allocates a claim itself (here: a device of node-a's pool)."""
    body = {"status": {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": "node-a", "device": "d"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]}}}}
    return cluster.custom_objects().patch_namespaced_custom_object_status(
        *DRA, ns, "resourceclaims", name, body, **({"dry_run": "All"} if dry_run else {}))


def test_nobody_but_the_controller_allocates_its_claims_or_gives_them_the_schedulers_finalizer(
        kube_cluster: KubeCluster, allocation_policy: str) -> None:
    ns, custom = allocation_policy, kube_cluster.custom_objects()
    with pytest.raises(ApiException) as caught:
        _allocate_as_admin(kube_cluster, ns, "probe")
    assert caught.value.status == 403 and "only the mig-operator controller allocates" in caught.value.body
    with pytest.raises(ApiException) as caught:
        custom.patch_namespaced_custom_object(*DRA, ns, "resourceclaims", "probe",
                                              {"metadata": {"finalizers": [DELETE_PROTECTION]}})
    assert caught.value.status == 403 and "takes no" in caught.value.body, caught.value.body
    # A claim of another class is none of its business.
    other = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "other"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "other.example.com"}}]}}}
    custom.create_namespaced_custom_object(*DRA, ns, "resourceclaims", other)
    custom.patch_namespaced_custom_object(*DRA, ns, "resourceclaims", "other",
                                          {"metadata": {"finalizers": [DELETE_PROTECTION]}})
    assert _allocate_as_admin(kube_cluster, ns, "other")["status"]["allocation"]["devices"]["results"][0]["pool"] \
        == "node-a"


def _claim(op: OperatorHarness, ns: str, name: str) -> dict[str, Any]:
    return op.custom.get_namespaced_custom_object(*DRA, ns, "resourceclaims", name)


def _writers(claim: dict[str, Any], *path: str) -> set[str]:
    """The field managers that own ``path`` (e.g. "status", "allocation") of the claim."""
    owners = set()
    for entry in claim["metadata"].get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        for step in path:
            fields = fields.get(f"f:{step}")
            if fields is None:
                break
        else:
            owners.add(entry["manager"])
    return owners


def _pinned(node: str, uid: str) -> dict[str, Any]:
    """The allocation written out by hand from resource.k8s.io/v1: the slice's device in the node's pool."""
    return {"devices": {"results": [{"request": "gpu", "driver": "gpu.cdmo.io", "pool": node, "device": uid}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}


def _assert_the_controllers_allocation(claim: dict[str, Any], node: str, uid: str, minor: int) -> None:
    allocation = dict(claim["status"]["allocation"])
    # Stamped by the controller where the API serves the field (1.36+), so kube-scheduler never
    # rewrites the immutable allocation when it reserves the claim.
    stamp = allocation.pop("allocationTimestamp", None)
    assert (stamp is not None) == (minor >= 36), claim["status"]["allocation"]
    assert allocation == _pinned(node, uid)
    # Written by the manager that created the claim (the controller), not by kube-scheduler, which only
    # reserved it; and without kube-scheduler's finalizer, so nothing ever deallocates it.
    creators = _writers(claim, "spec")
    assert _writers(claim, "status", "allocation") == creators and SCHEDULER not in creators, \
        claim["metadata"]["managedFields"]
    assert "resource.kubernetes.io/delete-protection" not in (claim["metadata"].get("finalizers") or [])


def _publish_stolen(op: OperatorHarness, node: SimNode, uid: str, ns: str, name: str) -> str:
    """What a compromised agent on ``node`` publishes: a device named and attributed as slice ``uid``."""
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"generateName": "stolen-"},
            "spec": {"driver": "gpu.cdmo.io", "nodeName": node.name,
                     "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": uid, "attributes": {
                         "slice": {"string": uid}, "sliceName": {"string": name}, "sliceNamespace": {"string": ns},
                         "mode": {"string": "fraction"}, "uuid": {"string": "GPU-stolen"}},
                         "capacity": {"memory": {"value": "48Gi"}}}]}}
    made = op.custom.create_cluster_custom_object(*DRA, "resourceslices", body)
    return made["metadata"]["name"]


def _notebook_pod(name: str, claim: str, prefer: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "tolerations": [KWOK_TOLERATION], "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [{"name": "main", "image": "jupyter", "resources": {"claims": [{"name": "gpu"}]}}]}
    if prefer:
        spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "preference": {"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [prefer]}]}}]}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_an_annotated_pods_claim_is_allocated_and_reserved_by_the_controller_and_not_written_by_the_scheduler(
        operator: OperatorHarness, allocation_policy: str) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node, webhook=True)
    ns = operator.namespace()
    name = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"})["metadata"]["name"]
    pod = running(operator, ns, name)
    handed_device(operator, pod)  # the claim's device is the slice's, in the pod's node's pool
    slice_name = pod.metadata.labels["cdmo.io/gpu-slice"]
    uid = operator.get_slice(ns, slice_name)["metadata"]["uid"]
    claim = _claim(operator, ns, slice_name)
    assert pod.spec.node_name == node.name
    _assert_the_controllers_allocation(claim, node.name, uid, operator.cluster.minor)
    # Reserved for the pod in the allocating write, so kube-scheduler, which reserves a claim only for
    # a pod it is not reserved for yet, never wrote to it: one write less per pod.
    assert _writers(claim, "status", "reservedFor") == _writers(claim, "spec"), claim["metadata"]["managedFields"]
    assert SCHEDULER not in {entry["manager"] for entry in claim["metadata"]["managedFields"]}
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": pod.metadata.name,
                                               "uid": pod.metadata.uid}]


def test_a_device_another_node_publishes_under_a_slices_uid_never_gets_its_pods(
        operator: OperatorHarness, allocation_policy: str) -> None:
    victim = operator.add_node("l40s-48gb", labelled=False)
    thief = operator.add_node("l40s-48gb", labelled=False)  # a GPU node whose agent is compromised
    operator.start_operator(victim)
    ns = operator.namespace()
    made = operator.create_slice(ns, "notebook", {"memory": "4G"})
    uid = made["metadata"]["uid"]
    stolen = _publish_stolen(operator, thief, uid, ns, "notebook")
    try:
        # Ten pods of the claim, each preferring the thief's node: kube-scheduler would choose it for
        # every one of them if the claim let it (a claim it allocates takes the device of any pool).
        # Five wait for the claim (made with the slice, as `kubectl apply -f` of both does), five come
        # once the slice's status names it (written and allocated).
        names = [f"nb-{i}" for i in range(10)]
        for pod_name in names[:5]:
            operator.core.create_namespaced_pod(ns, _notebook_pod(pod_name, "notebook", prefer=thief.name))
        operator.wait_phase(ns, "notebook", "Ready")
        wait_until(lambda: (operator.get_slice(ns, "notebook") or {}).get("status", {}).get("claim"), 30,
                   lambda: f"the notebook's claim\n{operator.logs()}")
        for pod_name in names[5:]:
            operator.core.create_namespaced_pod(ns, _notebook_pod(pod_name, "notebook", prefer=thief.name))
        for pod_name in names:
            assert running(operator, ns, pod_name).spec.node_name == victim.name
        claim = _claim(operator, ns, "notebook")
        _assert_the_controllers_allocation(claim, victim.name, uid, operator.cluster.minor)
        assert len(claim["status"]["reservedFor"]) == len(names)
    finally:
        operator.custom.delete_cluster_custom_object(*DRA, "resourceslices", stolen)


def test_a_directly_made_slices_claim_stays_allocated_to_its_node_across_its_pods(
        operator: OperatorHarness, allocation_policy: str) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node)
    ns = operator.namespace()
    uid = operator.create_slice(ns, "notebook", {"migProfile": "1g.10gb"})["metadata"]["uid"]
    # The pods come first, as `kubectl apply -f` of a slice and its pod does: they wait for the claim,
    # and kube-scheduler tries them as soon as it sees the claim, before or after its allocation.
    first = [f"first-{i}" for i in range(3)]
    for pod_name in first:
        operator.core.create_namespaced_pod(ns, _notebook_pod(pod_name, "notebook"))
    for pod_name in first:
        assert running(operator, ns, pod_name).spec.node_name == node.name
    _assert_the_controllers_allocation(_claim(operator, ns, "notebook"), node.name, uid, operator.cluster.minor)
    for pod_name in first:
        operator.core.delete_namespaced_pod(pod_name, ns, grace_period_seconds=0)
    # kube-controller-manager drops the gone pods' reservations; the allocation stays (no finalizer of
    # kube-scheduler's, so nothing deallocates it and no later pod's claim is allocated anew).
    wait_until(lambda: not _claim(operator, ns, "notebook")["status"].get("reservedFor"), 30,
               "the first pods' reservations to go")
    _assert_the_controllers_allocation(_claim(operator, ns, "notebook"), node.name, uid, operator.cluster.minor)
    operator.core.create_namespaced_pod(ns, _notebook_pod("second", "notebook"))
    pod = running(operator, ns, "second")
    assert pod.spec.node_name == node.name
    claim = _claim(operator, ns, "notebook")
    _assert_the_controllers_allocation(claim, node.name, uid, operator.cluster.minor)
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod.metadata.uid]
