"""Who may write what, against the real API server (issue 19, items 2, 4 and 5).

- Each agent writes only its own node's GpuSlices and GpuNode: two agents' tokens, each bound by the
  TokenRequest API to an agent pod on its own kwok node, under the chart's admission policy.
- The controller refuses to hand on a Ready slice whose device its node's GpuNode does not have.
- The controller's ServiceAccount writes only what its code writes (the chart's controller policy).
- A user bound to ``view`` reads GpuSlices but not GpuNodes (the chart's aggregated roles).

The chart's templates are rendered with helm and applied under a release of this file's own (its own
ServiceAccounts, roles and policies), and removed at the end."""

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
from harness import GROUP, NODES, SLICES, VERSION, OperatorHarness, wait_until
from kubernetes.client.rest import ApiException

KubeCluster = Any
REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
RELEASE = "authz"
TEMPLATES = ("serviceaccounts.yaml", "rbac.yaml", "agent-node-policy.yaml", "controller-write-policy.yaml",
             "user-roles.yaml")
NODE_KEY = "authentication.kubernetes.io/node-name"
GATE = "cdmo.io/gpu-slice"
AT = "2026-11-27T11:40:05Z"  # an allocation's timestamp (core/books/slice_claim.allocation)


@dataclass
class Release:
    namespace: str
    docs: list[dict[str, Any]]
    rendered: str

    def account(self, component: str) -> str:
        return next(d["metadata"]["name"] for d in self.docs if d["kind"] == "ServiceAccount"
                    and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def render(cluster: KubeCluster, namespace: str, *args: str) -> str:
    shows = [a for t in TEMPLATES for a in ("--show-only", f"templates/{t}")]
    result = subprocess.run([str(cluster.bin_dir / "helm"), "template", RELEASE, str(CHART_DIR), "--namespace",
                             namespace, *shows, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def release(kube_cluster: KubeCluster, operator_crds: None) -> Iterator[Release]:
    namespace = f"authz-{uuid.uuid4().hex[:6]}"
    kube_cluster.core_v1().create_namespace({"metadata": {"name": namespace}})
    # Cluster-wide names of this release only, so nothing of the session's other tests is touched.
    text = render(kube_cluster, namespace, "--set", f"webhook.configurationName={namespace}",
                  "--set", f"controller.peering={namespace}")
    kube_cluster.kubectl("apply", "-f", "-", input=text)
    try:
        yield Release(namespace, [d for d in yaml.safe_load_all(text) if d], text)
    finally:
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=text)
        kube_cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


def client_for(cluster: KubeCluster, token: str) -> kubernetes.client.ApiClient:
    admin = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=admin)
    config = kubernetes.client.Configuration()
    config.host, config.ssl_ca_cert, config.verify_ssl = admin.host, admin.ssl_ca_cert, admin.verify_ssl
    config.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(config)


def token(cluster: KubeCluster, namespace: str, account: str, pod: dict[str, Any] | None = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    answer = cluster.core_v1().create_namespaced_service_account_token(
        account, namespace, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    return answer.status.token


def refused(call: Any, *words: str) -> str:
    """``call()`` is refused by admission (403 naming ``words``); its message."""
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value.body
    for word in words:
        assert word in caught.value.body, (word, caught.value.body)
    return str(caught.value.body)


def when_enforced(probe: Any) -> None:
    """A new policy takes the API server a moment to load: wait until ``probe()`` is refused."""
    def enforced() -> bool:
        try:
            probe()
        except ApiException as exc:
            if exc.status == 403 and "ValidatingAdmissionPolicy" in str(exc.body):
                return True
            raise
        return False

    wait_until(enforced, 30, "the chart's admission policy to be enforced", interval=0.3)


def slice_on(custom: Any, namespace: str, name: str, node: str) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, SLICES, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": name},
        "spec": {"memory": "4Gi"}})
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, SLICES, name, {"status": {
        "phase": "Bound", "node": node, "gpu": 0, "mode": "fraction", "grantedBytes": 4 * 2**30}})


def gpunode(name: str, node: str | None = None) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuNode", "metadata": {"name": name},
            "spec": {"nodeName": node or name}}


# ---- item 2: each agent writes only its own node's objects ------------------------------------------------


@pytest.mark.compat
def test_each_agents_token_writes_only_its_own_nodes_slices_and_gpunode(
        kube_cluster: KubeCluster, operator: OperatorHarness, release: Release) -> None:
    ns, core, admin = release.namespace, kube_cluster.core_v1(), kube_cluster.custom_objects()
    account = release.account("agent")
    a, b = operator.add_node("h100-80gb", labelled=False).name, operator.add_node("h100-80gb", labelled=False).name
    tokens = {}
    for node in (a, b):
        pod = core.create_namespaced_pod(ns, {"metadata": {"name": f"agent-{node}"}, "spec": {
            "serviceAccountName": account, "nodeName": node, "containers": [{"name": "agent", "image": "agent"}],
            "tolerations": [{"operator": "Exists"}]}})
        wait_until(lambda p=pod: core.read_namespaced_pod(p.metadata.name, ns).status.phase == "Running", 60,
                   f"kwok to run the agent pod on {node}")
        tokens[node] = token(kube_cluster, ns, account, kube_cluster.api_client.sanitize_for_serialization(pod))
    clients = {node: client_for(kube_cluster, t) for node, t in tokens.items()}
    # The API server puts each pod's node into its token's user (ServiceAccountTokenPodNodeInfo, GA 1.32).
    for node, client in clients.items():
        review = kubernetes.client.AuthenticationV1Api(client).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        user = review.status.user_info
        assert user.username == f"system:serviceaccount:{ns}:{account}"
        assert user.extra[NODE_KEY] == [node]
    slices = {a: "on-a", b: "on-b"}
    for node, name in slices.items():
        slice_on(admin, ns, name, node)
    admin.create_cluster_custom_object(GROUP, VERSION, NODES, gpunode(b))
    custom = {node: kubernetes.client.CustomObjectsApi(client) for node, client in clients.items()}
    message = {"status": {"message": "written by an agent"}}

    def patch_status(node: str, name: str, body: dict[str, Any] = message) -> Any:
        return custom[node].patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, name, body)

    when_enforced(lambda: patch_status(a, slices[b]))
    # Its own node's slice: status and the object itself (the finalizer it removes on release).
    assert patch_status(a, slices[a])["status"]["message"] == "written by an agent"
    custom[a].patch_namespaced_custom_object(GROUP, VERSION, ns, SLICES, slices[a],
                                             {"metadata": {"finalizers": ["cdmo.io/agent"]}})
    custom[a].patch_namespaced_custom_object(GROUP, VERSION, ns, SLICES, slices[a], {"metadata": {"finalizers": None}})
    # The other node's slice, object or status, and a slice bound to no node yet: refused. (Moving
    # its own slice to another node the CRD already refuses: status.node is write-once.)
    refused(lambda: patch_status(a, slices[b]), f"node '{a}'", f"bound to '{b}'")
    refused(lambda: custom[a].patch_namespaced_custom_object(GROUP, VERSION, ns, SLICES, slices[b],
                                                             {"metadata": {"finalizers": None}}), f"'{b}'")
    admin.create_namespaced_custom_object(GROUP, VERSION, ns, SLICES, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "unbound"},
        "spec": {"memory": "4Gi"}})
    refused(lambda: patch_status(a, "unbound", {"status": {"phase": "Ready", "node": a, "deviceUUID": "GPU-x"}}),
            f"node '{a}'")
    # The other node's GpuNode: neither its status nor a new one under its name; nor its own name
    # describing another node. Its own GpuNode: yes.
    refused(lambda: custom[a].patch_cluster_custom_object_status(GROUP, VERSION, NODES, b,
                                                                 {"status": {"gpuCount": 0}}), f"not '{b}'")
    refused(lambda: custom[a].create_cluster_custom_object(GROUP, VERSION, NODES, gpunode(f"{b}-x", b)))
    refused(lambda: custom[a].create_cluster_custom_object(GROUP, VERSION, NODES, gpunode(a, b)), "spec.nodeName")
    custom[a].create_cluster_custom_object(GROUP, VERSION, NODES, gpunode(a))
    custom[a].patch_cluster_custom_object_status(GROUP, VERSION, NODES, a, {"status": {"gpuCount": 1}})
    # And the other way round.
    assert patch_status(b, slices[b])["status"]["message"] == "written by an agent"
    refused(lambda: patch_status(b, slices[a]), f"node '{b}'", f"bound to '{a}'")
    refused(lambda: custom[b].patch_cluster_custom_object_status(GROUP, VERSION, NODES, a,
                                                                 {"status": {"gpuCount": 0}}))
    # ResourceSlices (issue 16): its own node's, of the operator's driver, only; create, update, delete.
    def resource_slice(name: str, node: str, driver: str = "gpu.cdmo.io") -> dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                       "resourceSliceCount": 1}, "devices": []}}

    dra = ("resource.k8s.io", "v1", "resourceslices")
    refused(lambda: custom[a].create_cluster_custom_object(*dra, resource_slice(f"{b}-gpu", b)),
            f"node '{a}'", "ResourceSlices of driver gpu.cdmo.io")
    refused(lambda: custom[a].create_cluster_custom_object(*dra, resource_slice(f"{a}-other", a, "gpu.nvidia.com")))
    custom[a].create_cluster_custom_object(*dra, resource_slice(f"{a}-gpu", a))
    admin.create_cluster_custom_object(*dra, resource_slice(f"{b}-gpu", b))
    refused(lambda: custom[a].delete_cluster_custom_object(*dra, f"{b}-gpu"))
    refused(lambda: custom[a].patch_cluster_custom_object(*dra, f"{b}-gpu", {"metadata": {"labels": {"x": "y"}}}))
    custom[a].delete_cluster_custom_object(*dra, f"{a}-gpu")
    admin.delete_cluster_custom_object(*dra, f"{b}-gpu")
    # A token of the agents' ServiceAccount bound to no pod names no node: refused everything.
    unbound = kubernetes.client.CustomObjectsApi(client_for(kube_cluster, token(kube_cluster, ns, account)))
    refused(lambda: unbound.patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, slices[a], message),
            "names no node")
    for client in clients.values():
        client.close()


# ---- item 2: the controller checks a Ready slice's device against the node's GpuNode ----------------------


def test_the_controller_never_hands_on_a_device_its_nodes_gpunode_does_not_have(
        kube_cluster: KubeCluster, operator: OperatorHarness) -> None:
    """No agent runs: the test writes what a (rogue) agent would. The pod stays gated while the slice
    names a device the node's GpuNode lacks, and is ungated once the slice names the node's GPU."""
    node = operator.add_node("l40s-48gb", labelled=False).name  # no GpuNode yet: the slice stays Pending
    operator.controller()
    ns = operator.namespace()
    core, custom = operator.core, operator.custom
    core.create_namespaced_pod(ns, {
        "metadata": {"name": "p", "labels": {GATE: "p-slice"}, "annotations": {"cdmo.io/gpu-memory": "2Gi"}},
        "spec": {"schedulingGates": [{"name": GATE}], "containers": [{"name": "c", "image": "c"}]}})
    wait_until(lambda: operator.get_slice(ns, "p-slice"), 30, lambda: f"the pod's slice\n{operator.logs()}")
    ready = {"phase": "Ready", "node": node, "gpu": 0, "mode": "fraction", "grantedBytes": 2 * 2**30,
             "deviceUUID": "GPU-of-another-node"}
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, "p-slice", {"status": ready})
    custom.create_cluster_custom_object(GROUP, VERSION, NODES, gpunode(node))
    custom.patch_cluster_custom_object_status(GROUP, VERSION, NODES, node, {"status": {"gpus": [
        {"index": 0, "uuid": "GPU-l40s-real", "migCapable": False, "migEnabled": False, "memoryMiB": 46068}]}})

    def reasons() -> set[str]:
        return {e.reason for e in core.list_namespaced_event(ns, field_selector="involvedObject.name=p").items}

    wait_until(lambda: "DeviceMismatch" in reasons(), 30, lambda: f"a DeviceMismatch Event\n{operator.logs()}")
    pod = core.read_namespaced_pod("p", ns)
    assert [g.name for g in pod.spec.scheduling_gates or []] == [GATE]
    assert pod.spec.affinity is None
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, "p-slice",
                                                 {"status": {"deviceUUID": "GPU-l40s-real"}})
    wait_until(lambda: not core.read_namespaced_pod("p", ns).spec.scheduling_gates, 30,
               lambda: f"the pod ungated once its slice names the node's GPU\n{operator.logs()}")
    claim = custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", "p-slice")
    uid = operator.get_slice(ns, "p-slice")["metadata"]["uid"]
    [request] = claim["spec"]["devices"]["requests"]
    expression = f'device.attributes["gpu.cdmo.io"].slice == "{uid}"'
    assert request["exactly"]["selectors"] == [{"cel": {"expression": expression}}]


# ---- item 4: the controller's ServiceAccount writes only what its code writes -----------------------------


@pytest.mark.compat
def test_the_controllers_writes_are_narrowed_to_what_its_code_writes(
        kube_cluster: KubeCluster, release: Release) -> None:
    from mig_operator.kube.controller.pods import ungate_ops

    ns, admin = release.namespace, kube_cluster.core_v1()
    client = client_for(kube_cluster, token(kube_cluster, ns, release.account("controller")))
    core = kubernetes.client.CoreV1Api(client)
    admission = kubernetes.client.AdmissionregistrationV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)

    def pod(name: str, gates: list[str]) -> dict[str, Any]:
        made = admin.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": {GATE: name}}, "spec": {
            "schedulingGates": [{"name": g} for g in gates], "containers": [{"name": "c", "image": "c"}]}})
        return kube_cluster.api_client.sanitize_for_serialization(made)

    gated, ungated, other = pod("gated", [GATE, "example.com/other"]), pod("ungated", []), pod("relabel", [GATE])
    when_enforced(lambda: core.patch_namespaced_pod("ungated", ns, {"metadata": {"labels": {"x": "y"}}}))
    # What the controller's code sends (pods.py's one JSON patch) passes; the other gate stays.
    answer = core.patch_namespaced_pod("gated", ns, ungate_ops(gated, "node-a"))
    assert [g.name for g in answer.spec.scheduling_gates] == ["example.com/other"]
    # Anything else is refused: another change beside the ungating, a pod without the gate.
    ops = [*ungate_ops(other, "node-a"), {"op": "add", "path": "/metadata/labels/extra", "value": "x"}]
    refused(lambda: core.patch_namespaced_pod("relabel", ns, ops), "scheduling gate")
    refused(lambda: core.patch_namespaced_pod("ungated", ns, {"spec": {"activeDeadlineSeconds": 5}}))
    assert ungated["spec"].get("schedulingGates") is None

    # ResourceClaims: a GpuSlice's own only (claims.py's body passes), deletes only of claims a GpuSlice owns.
    from mig_operator.kube.controller.claims import claim_body

    slice_body = kube_cluster.custom_objects().create_namespaced_custom_object(GROUP, VERSION, ns, SLICES, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "mine"},
        "spec": {"memory": "2Gi"}})
    uid = slice_body["metadata"]["uid"]
    claims = ("resource.k8s.io", "v1", ns, "resourceclaims")
    custom.create_namespaced_custom_object(*claims, claim_body(ns, "mine", uid))
    wider = claim_body(ns, "wider", uid)
    wider["metadata"]["ownerReferences"][0]["name"] = "mine"  # another name than its owner's
    refused(lambda: custom.create_namespaced_custom_object(*claims, wider), "GpuSlices' ResourceClaims")
    any_device = claim_body(ns, "mine2", uid)
    any_device["metadata"]["ownerReferences"][0]["name"] = "mine2"
    any_device["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": "true"}}]
    refused(lambda: custom.create_namespaced_custom_object(*claims, any_device))
    other_class = claim_body(ns, "mine3", uid)
    other_class["metadata"]["ownerReferences"][0]["name"] = "mine3"
    other_class["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    refused(lambda: custom.create_namespaced_custom_object(*claims, other_class))
    unowned = claim_body(ns, "users", uid)
    unowned["metadata"].pop("ownerReferences")
    kube_cluster.custom_objects().create_namespaced_custom_object(*claims, unowned)
    refused(lambda: custom.delete_namespaced_custom_object(*claims, "users"))
    # Its allocation: that slice's device in one node's pool, usable there only (core/books/slice_claim.py).
    from mig_operator.core.books.slice_claim import allocation_patch, pod_consumer

    def allocate(name: str, body: dict[str, Any]) -> Any:
        return custom.patch_namespaced_custom_object_status(*claims, name, body)

    another = str(uuid.uuid4())
    other_device, other_pool, any_node = (allocation_patch("node-a", uid, AT) for _ in range(3))
    other_device["status"]["allocation"]["devices"]["results"][0]["device"] = another
    other_pool["status"]["allocation"]["devices"]["results"][0]["pool"] = "node-b"  # selector: node-a
    any_node["status"]["allocation"].pop("nodeSelector")
    for body in (other_device, other_pool, any_node):
        refused(lambda body=body: allocate("mine", body), "allocates a GpuSlice's ResourceClaim only")
    refused(lambda: allocate("users", allocation_patch("node-a", uid, AT)))  # a claim no GpuSlice owns
    # Reserved in the allocating write for one pod only (claims.py), and afterwards only taken away.
    two_pods = allocation_patch("node-a", uid, AT)
    two_pods["status"]["reservedFor"] = [pod_consumer("a", str(uuid.uuid4())), pod_consumer("b", str(uuid.uuid4()))]
    refused(lambda: allocate("mine", two_pods), "reserves a GpuSlice's ResourceClaim only for one pod")
    not_a_pod = allocation_patch("node-a", uid, AT, {"resource": "deployments", "name": "d", "uid": str(uuid.uuid4())})
    refused(lambda: allocate("mine", not_a_pod), "reserves a GpuSlice's ResourceClaim only for one pod")
    first = pod_consumer("train-0", str(uuid.uuid4()))
    allocated = allocate("mine", allocation_patch("node-a", uid, AT, first))
    written = allocation_patch("node-a", uid, AT)["status"]["allocation"]
    if kube_cluster.minor < 36:  # allocationTimestamp is served from 1.36; older API servers drop it
        written.pop("allocationTimestamp")
    assert allocated["status"]["allocation"] == written
    assert allocated["status"]["reservedFor"] == [first]
    later = {"status": {"reservedFor": [first, pod_consumer("train-1", str(uuid.uuid4()))]}}
    refused(lambda: allocate("mine", later), "reserves a GpuSlice's ResourceClaim only for one pod")
    assert not allocate("mine", {"status": {"reservedFor": None}})["status"].get("reservedFor")
    refused(lambda: allocate("mine", {"status": {"reservedFor": [first]}}), "only for one pod")
    custom.delete_namespaced_custom_object(*claims, "mine")
    # The release's webhook configuration and peering object only (create cannot be named in RBAC).
    refused(lambda: admission.create_mutating_webhook_configuration({"metadata": {"name": f"{ns}-other"}}),
            f"not {ns}-other")
    admission.create_mutating_webhook_configuration({"metadata": {"name": ns}})
    refused(lambda: custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": f"{ns}-other"}}))
    custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": ns}})
    client.close()
    kube_cluster.kubectl("delete", "mutatingwebhookconfiguration", ns, "--ignore-not-found")
    kube_cluster.kubectl("delete", "clusterkopfpeering", ns, "--ignore-not-found")


# ---- item 5: `view` reads GpuSlices, not GpuNodes ---------------------------------------------------------


def _can(cluster: KubeCluster, user: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    attributes = {"verb": verb, "resource": resource, "group": GROUP, **({"namespace": namespace} if namespace else {})}
    review = kubernetes.client.AuthorizationV1Api(cluster.api_client).create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:authenticated"], "resourceAttributes": attributes}})
    return bool(review.status.allowed)


def test_a_user_bound_to_view_reads_gpuslices_but_not_gpunodes_unless_the_value_says(
        kube_cluster: KubeCluster, release: Release) -> None:
    user, rbac = f"viewer-{release.namespace}", kubernetes.client.RbacAuthorizationV1Api(kube_cluster.api_client)
    binding = {"metadata": {"name": user}, "subjects": [{"kind": "User", "name": user}],
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"}}
    rbac.create_cluster_role_binding(binding)
    try:
        # The aggregation controller folds the chart's role into view within moments.
        wait_until(lambda: _can(kube_cluster, user, "list", "gpuslices", "some-team"), 30,
                   "view to include the chart's GpuSlice read")
        assert _can(kube_cluster, user, "get", "gpuslices", "some-team")
        assert not _can(kube_cluster, user, "create", "gpuslices", "some-team")
        assert not _can(kube_cluster, user, "get", "gpunodes") and not _can(kube_cluster, user, "list", "gpunodes")
        # An admin who wants it: the value turns GpuNode read on for view.
        on = render(kube_cluster, release.namespace, "--set", "userRoles.gpuNodeRead=true",
                    "--set", f"webhook.configurationName={release.namespace}",
                    "--set", f"controller.peering={release.namespace}")
        kube_cluster.kubectl("apply", "-f", "-", input=on)
        wait_until(lambda: _can(kube_cluster, user, "list", "gpunodes"), 30, "view to include GpuNode read")
    finally:
        rbac.delete_cluster_role_binding(user)
