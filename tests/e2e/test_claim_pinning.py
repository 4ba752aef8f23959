"""The controller allocates each slice's ResourceClaim itself, pinned to the slice's node (issue 24, "The
controller's claims are pinned"), on a real control plane with kube-scheduler, kube-controller-manager
and kwok nodes: kube-scheduler only reserves the claim, a device that another node publishes under the
slice's UID (a compromised agent) never gets the slice's pods, and a directly made slice's claim stays
allocated to its node across its pods."""

from __future__ import annotations

from typing import Any

from harness import OperatorHarness, SimNode, wait_until
from test_pods import KWOK_TOLERATION, create_pod, handed_device, running

DRA = ("resource.k8s.io", "v1")
SCHEDULER = "kube-scheduler"


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


def _assert_the_controllers_allocation(claim: dict[str, Any], node: str, uid: str) -> None:
    assert claim["status"]["allocation"] == _pinned(node, uid)
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


def test_an_annotated_pods_claim_is_allocated_by_the_controller_and_only_reserved_by_the_scheduler(
        operator: OperatorHarness) -> None:
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
    _assert_the_controllers_allocation(claim, node.name, uid)
    assert SCHEDULER in _writers(claim, "status", "reservedFor")
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod.metadata.uid]


def test_a_device_another_node_publishes_under_a_slices_uid_never_gets_its_pods(operator: OperatorHarness) -> None:
    victim = operator.add_node("l40s-48gb", labelled=False)
    thief = operator.add_node("l40s-48gb", labelled=False)  # a GPU node whose agent is compromised
    operator.start_operator(victim)
    ns = operator.namespace()
    made = operator.create_slice(ns, "notebook", {"memory": "4G"})
    uid = made["metadata"]["uid"]
    stolen = _publish_stolen(operator, thief, uid, ns, "notebook")
    try:
        operator.wait_phase(ns, "notebook", "Ready")
        wait_until(lambda: (_claim_or_none(operator, ns, "notebook") or {}).get("status", {}).get("allocation"), 30,
                   lambda: f"the notebook's claim allocated\n{operator.logs()}")
        # Ten pods of the claim, each preferring the thief's node: kube-scheduler would choose it for
        # every one of them if the claim let it (a claim it allocates takes the device of any pool).
        names = [f"nb-{i}" for i in range(10)]
        for pod_name in names:
            operator.core.create_namespaced_pod(ns, _notebook_pod(pod_name, "notebook", prefer=thief.name))
        for pod_name in names:
            assert running(operator, ns, pod_name).spec.node_name == victim.name
        claim = _claim(operator, ns, "notebook")
        _assert_the_controllers_allocation(claim, victim.name, uid)
        assert len(claim["status"]["reservedFor"]) == len(names)
    finally:
        operator.custom.delete_cluster_custom_object(*DRA, "resourceslices", stolen)


def _claim_or_none(op: OperatorHarness, ns: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.rest import ApiException

    try:
        return _claim(op, ns, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_a_directly_made_slices_claim_stays_allocated_to_its_node_across_its_pods(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node)
    ns = operator.namespace()
    uid = operator.create_slice(ns, "notebook", {"migProfile": "1g.10gb"})["metadata"]["uid"]
    # The pod comes first, as `kubectl apply -f` of a slice and its pod does: it waits for the claim.
    operator.core.create_namespaced_pod(ns, _notebook_pod("first", "notebook"))
    assert running(operator, ns, "first").spec.node_name == node.name
    _assert_the_controllers_allocation(_claim(operator, ns, "notebook"), node.name, uid)
    operator.core.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    # kube-controller-manager drops the gone pod's reservation; the allocation stays (no finalizer of
    # kube-scheduler's, so nothing deallocates it and no later pod's claim is allocated anew).
    wait_until(lambda: not _claim(operator, ns, "notebook")["status"].get("reservedFor"), 30,
               "the first pod's reservation to go")
    _assert_the_controllers_allocation(_claim(operator, ns, "notebook"), node.name, uid)
    operator.core.create_namespaced_pod(ns, _notebook_pod("second", "notebook"))
    pod = running(operator, ns, "second")
    assert pod.spec.node_name == node.name
    claim = _claim(operator, ns, "notebook")
    _assert_the_controllers_allocation(claim, node.name, uid)
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod.metadata.uid]
