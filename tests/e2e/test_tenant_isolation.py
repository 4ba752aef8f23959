"""A tenant who does not trust its neighbours, against the chart's policies on the real API server (issue 24).

The tenant is a ServiceAccount of team-b holding only the built-in ``edit`` ClusterRole there (a
RoleBinding), authenticated by its own token. Each claim it could use to reach team-a's device (the
slice's class with a selector on team-a's sliceNamespace, a firstAvailable subrequest, allocationMode All,
a selector on the driver under another class, opaque configuration, a ResourceClaimTemplate, an update)
is first shown admitted without the chart's claim policies (dry run), then refused with them; the
controller, whose ServiceAccount the policies spare, still writes its claims and team-a's own pod runs.

The claim policies are rendered for the session's chart identities (tests/e2e/conftest.py: release
``e2e`` in mig-operator-system), so they spare exactly the controller the ``operator`` fixture runs, and
are removed at the end, waiting until the API server admits such a claim again: the session's other
tests write claims of the class as cluster-admin.

The controller's webhook configuration: under a release of this module's own (ServiceAccounts, RBAC, the
controller's write policy, the chart's MutatingWebhookConfiguration), the controller's token may change
the caBundle (through the controller's own code) and nothing else."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from harness import OperatorHarness, wait_until
from kubernetes.client.rest import ApiException

# Also run on the oldest supported Kubernetes release (make compat).
pytestmark = pytest.mark.compat

KubeCluster = ChartIdentities = Any
REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
# tests/e2e/conftest.py's CHART_RELEASE and CHART_NAMESPACE: the identities the operator fixture runs as.
SESSION_RELEASE, SESSION_NAMESPACE = "e2e", "mig-operator-system"
CLASS, DRIVER = "gpuslice.cdmo.io", "gpu.cdmo.io"
CLAIMS = ("resource.k8s.io", "v1", "resourceclaims")
TEMPLATES = ("resource.k8s.io", "v1", "resourceclaimtemplates")
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists"}
USE_A_SLICE = "use a GpuSlice instead: annotate the pod with cdmo.io/gpu-memory"


def helm_template(cluster: KubeCluster, release: str, namespace: str, templates: list[str], *args: str) -> str:
    shows = [a for t in templates for a in ("--show-only", f"templates/{t}")]
    result = subprocess.run([str(cluster.bin_dir / "helm"), "template", release, str(CHART_DIR), "--namespace",
                             namespace, *shows, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def client_for(cluster: KubeCluster, token: str) -> kubernetes.client.ApiClient:
    admin = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=admin)
    config = kubernetes.client.Configuration()
    config.host, config.ssl_ca_cert, config.verify_ssl = admin.host, admin.ssl_ca_cert, admin.verify_ssl
    config.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(config)


def token(cluster: KubeCluster, namespace: str, account: str) -> str:
    answer = cluster.core_v1().create_namespaced_service_account_token(account, namespace, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
    return answer.status.token


def refused(call: Callable[[], Any], *words: str) -> str:
    """``call()`` is refused by a ValidatingAdmissionPolicy (403 naming ``words``); its message."""
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value.body
    message = yaml.safe_load(caught.value.body)["message"]
    assert "ValidatingAdmissionPolicy" in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def selector(expression: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": expression}}]


def claim(name: str, requests: list[dict[str, Any]], **devices: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": requests, **devices}}}


def template(name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": requests}}}}


@contextmanager
def claim_policies(cluster: KubeCluster, controller: str) -> Iterator[list[str]]:
    """The chart's claim policies, for the session's release, in force until the block ends."""
    text = helm_template(cluster, SESSION_RELEASE, SESSION_NAMESPACE, ["claim-policy.yaml"])
    docs = [d for d in yaml.safe_load_all(text) if d]
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    for doc in docs:
        if doc["kind"] == "ValidatingAdmissionPolicy":
            conditions = {c["name"]: c["expression"] for c in doc["spec"]["matchConditions"]}
            assert conditions["not-the-controller"] == f'request.userInfo.username != "{controller}"'
    admin = cluster.custom_objects()
    probe_ns = "default"
    probes = [lambda: admin.create_namespaced_custom_object(*CLAIMS[:2], probe_ns, CLAIMS[2], claim(
                  "probe", [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]), dry_run="All"),
              lambda: admin.create_namespaced_custom_object(*TEMPLATES[:2], probe_ns, TEMPLATES[2], template(
                  "probe", [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]), dry_run="All")]

    def enforced(probe: Callable[[], Any]) -> bool:
        try:
            probe()
        except ApiException as exc:
            if exc.status == 403 and "ValidatingAdmissionPolicy" in str(exc.body):
                return True
            raise
        return False

    cluster.kubectl("apply", "-f", "-", input=text)
    try:
        for probe in probes:
            wait_until(lambda p=probe: enforced(p), 30, "the chart's claim policies to be enforced", interval=0.3)
        yield names
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=text)
        for probe in probes:
            wait_until(lambda p=probe: not enforced(p), 30, "the claim policies to be gone", interval=0.3)


def type_checked(cluster: KubeCluster, name: str) -> dict[str, Any]:
    def checked() -> Any:
        status = yaml.safe_load(cluster.kubectl("get", "validatingadmissionpolicy", name, "-o",
                                                "yaml").stdout).get("status") or {}
        return status if status.get("observedGeneration") == 1 else None

    return wait_until(checked, 30, f"the API server to type-check {name}")


# ---- claims belong to the controller ----------------------------------------------------------------------


def test_a_tenant_with_edit_cannot_claim_another_namespaces_device_and_the_owner_still_gets_it(
        kube_cluster: KubeCluster, operator: OperatorHarness, chart_identities: ChartIdentities) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node, webhook=True)
    team_a, team_b = operator.namespace(), operator.namespace()
    core, admin = operator.core, operator.custom
    # The tenant: team-b's ServiceAccount with the built-in edit role in team-b, nothing else.
    core.create_namespaced_service_account(team_b, {"metadata": {"name": "tenant"}})
    kubernetes.client.RbacAuthorizationV1Api(kube_cluster.api_client).create_namespaced_role_binding(team_b, {
        "metadata": {"name": "tenant-edit"}, "subjects": [{"kind": "ServiceAccount", "name": "tenant",
                                                           "namespace": team_b}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"}})
    tenant_client = client_for(kube_cluster, token(kube_cluster, team_b, "tenant"))
    tenant = kubernetes.client.CustomObjectsApi(tenant_client)
    # Another class, of another driver: what a tenant may still ask for.
    other = f"other-{uuid.uuid4().hex[:6]}.example.com"
    admin.create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": other},
        "spec": {"selectors": selector('device.driver == "other.example.com"')}})
    # team-a's notebook slice (made directly: free whenever no pod holds it), Ready with its claim.
    operator.create_slice(team_a, "notebook", {"memory": "4Gi"})
    victim = operator.wait_phase(team_a, "notebook", "Ready")
    victim_claim = wait_until(lambda: _get(admin, team_a, "notebook"), 30,
                              lambda: f"the controller to write team-a's claim\n{operator.logs()}")
    theirs = f'device.attributes["{DRIVER}"].sliceNamespace == "{team_a}"'
    attacks: dict[str, tuple[tuple[str, str, str], dict[str, Any], str]] = {
        "the class, selecting team-a's device": (CLAIMS, claim("steal", [
            {"name": "gpu", "exactly": {"deviceClassName": CLASS, "selectors": selector(theirs)}}]),
            f"request 'gpu' asks for DeviceClass {CLASS}"),
        "a firstAvailable subrequest of the class": (CLAIMS, claim("fallback", [
            {"name": "gpu", "firstAvailable": [{"name": "first", "deviceClassName": other},
                                               {"name": "then", "deviceClassName": CLASS}]}]),
            f"request 'gpu' asks for DeviceClass {CLASS}"),
        "allocationMode All": (CLAIMS, claim("every", [
            {"name": "all", "exactly": {"deviceClassName": CLASS, "allocationMode": "All"}}]),
            f"request 'all' asks for DeviceClass {CLASS}"),
        "the driver's attribute under another class": (CLAIMS, claim("sideways", [
            {"name": "gpu", "exactly": {"deviceClassName": other, "selectors": selector(theirs)}}]),
            f"request 'gpu' has a selector naming driver {DRIVER}"),
        "a subrequest selecting on the driver": (CLAIMS, claim("sideways2", [
            {"name": "gpu", "firstAvailable": [{"name": "s", "deviceClassName": other,
                                                "selectors": selector(theirs)}]}]),
            f"request 'gpu' has a selector naming driver {DRIVER}"),
        "configuration for the driver": (CLAIMS, claim("configured", [
            {"name": "gpu", "exactly": {"deviceClassName": other}}],
            config=[{"opaque": {"driver": DRIVER, "parameters": {"slice": team_a}}}]),
            f"configuration for driver {DRIVER}"),
        "a ResourceClaimTemplate of the class": (TEMPLATES, template("stamp", [
            {"name": "gpu", "exactly": {"deviceClassName": CLASS, "selectors": selector(theirs)}}]),
            f"ResourceClaimTemplate {team_b}/stamp: request 'gpu' asks for DeviceClass {CLASS}"),
        "a template with a subrequest of the class": (TEMPLATES, template("stamp2", [
            {"name": "gpu", "firstAvailable": [{"name": "s", "deviceClassName": CLASS}]}]),
            f"request 'gpu' asks for DeviceClass {CLASS}"),
    }

    def create(kind: tuple[str, str, str], body: dict[str, Any], dry_run: str | None = None) -> Any:
        return tenant.create_namespaced_custom_object(kind[0], kind[1], team_b, kind[2], body, dry_run=dry_run)

    try:
        # Without the policies the tenant's role admits every one of them (what issue 24 found).
        for what, (kind, body, _) in attacks.items():
            assert create(kind, body, dry_run="All")["metadata"]["name"] == body["metadata"]["name"], what
        with claim_policies(kube_cluster, chart_identities.user("controller")) as names:
            for name in names:
                assert (type_checked(kube_cluster, name).get("typeChecking") or {}).get("expressionWarnings") in (
                    None, []), name
            for what, (kind, body, words) in attacks.items():
                message = refused(lambda k=kind, b=body: create(k, b), words, USE_A_SLICE)
                assert message.count(CLASS) >= 1, (what, message)
            # An update: a claim of another class is admitted, its spec turned to the class is not
            # (the API server's immutability answers first, 422; the policy would answer 403).
            mine = create(CLAIMS, claim("mine", [{"name": "gpu", "exactly": {"deviceClassName": other}}]))
            turned = {**mine, "spec": claim("mine", [{"name": "gpu", "exactly": {
                "deviceClassName": CLASS, "selectors": selector(theirs)}}])["spec"]}
            with pytest.raises(ApiException) as caught:
                tenant.replace_namespaced_custom_object(*CLAIMS[:2], team_b, CLAIMS[2], "mine", turned)
            assert caught.value.status in (403, 422), caught.value.body
            # Its metadata it may still change (the policy is about the spec).
            tenant.patch_namespaced_custom_object(*CLAIMS[:2], team_b, CLAIMS[2], "mine",
                                                  {"metadata": {"labels": {"team": "b"}}})
            got = _get(admin, team_b, "mine")
            assert got["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == other
            # Nobody but the controller: cluster-admin is refused too (dry run).
            refused(lambda: admin.create_namespaced_custom_object(*CLAIMS[:2], team_b, CLAIMS[2], claim(
                "admin", [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]), dry_run="All"), CLASS)

            # The owner's own: team-a's annotated pod gets its slice, whose claim the controller writes
            # under the policies, and runs on it.
            core.create_namespaced_pod(team_a, {"metadata": {"name": "owner", "annotations": {
                "cdmo.io/gpu-memory": "4G"}}, "spec": {"tolerations": [KWOK_TOLERATION],
                                                      "containers": [{"name": "main", "image": "busybox"}]}})

            def running() -> Any:
                pod = core.read_namespaced_pod("owner", team_a)
                return pod if pod.status.phase == "Running" else None

            pod = wait_until(running, 60, lambda: f"team-a's pod to run\n{operator.logs()}")
            slice_name = pod.metadata.labels["cdmo.io/gpu-slice"]
            owned = operator.get_slice(team_a, slice_name)
            owner_claim = _get(admin, team_a, slice_name)
            assert [r["uid"] for r in owner_claim["metadata"]["ownerReferences"]] == [owned["metadata"]["uid"]]
            [result] = owner_claim["status"]["allocation"]["devices"]["results"]
            assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node.name, owned["metadata"]["uid"])
        # team-b holds nothing of the class, and team-a's notebook claim is untouched: allocated (by the
        # controller) to the notebook's own device on its own node and reserved for nobody.
        held = admin.list_namespaced_custom_object(*CLAIMS[:2], team_b, CLAIMS[2])["items"]
        assert [c["metadata"]["name"] for c in held] == ["mine"]
        assert not admin.list_namespaced_custom_object(*TEMPLATES[:2], team_b, TEMPLATES[2])["items"]
        notebook = _get(admin, team_a, "notebook")
        assert notebook["metadata"]["uid"] == victim_claim["metadata"]["uid"]
        [result] = notebook["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node.name, victim["metadata"]["uid"])
        assert not notebook["status"].get("reservedFor")
        assert victim["metadata"]["uid"] in notebook["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0][
            "cel"]["expression"]
    finally:
        tenant_client.close()
        admin.delete_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", other)


def _get(api: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api.get_namespaced_custom_object(*CLAIMS[:2], namespace, CLAIMS[2], name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


# ---- the controller's webhook configuration: its CA, nothing else -----------------------------------------


@pytest.fixture
def webhook_release(kube_cluster: KubeCluster, operator_crds: None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """This module's release: its ServiceAccounts, RBAC, controller write policy and webhook configuration
    (named after its namespace), applied; removed at the end (the configuration fails closed for
    annotated pods, so it goes at once)."""
    namespace = f"wh-{uuid.uuid4().hex[:6]}"
    kube_cluster.core_v1().create_namespace({"metadata": {"name": namespace}})
    text = helm_template(kube_cluster, "wh", namespace, ["serviceaccounts.yaml", "rbac.yaml",
                                                         "controller-write-policy.yaml", "webhook-configuration.yaml"],
                         "--set", f"webhook.configurationName={namespace}", "--set", f"controller.peering={namespace}")
    kube_cluster.kubectl("apply", "-f", "-", input=text)
    try:
        yield namespace, [d for d in yaml.safe_load_all(text) if d]
    finally:
        kube_cluster.kubectl("delete", "mutatingwebhookconfiguration", namespace, "--ignore-not-found")
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=text)
        kube_cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


def test_the_controller_may_change_its_webhook_configurations_ca_and_nothing_else(
        kube_cluster: KubeCluster, webhook_release: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    from mig_operator.kube.common.client import KubeClient
    from mig_operator.kube.webhook.server import WebhookOptions, upsert_configuration, webhook_configuration

    namespace, docs = webhook_release
    name = namespace
    account = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"
                   and d["metadata"]["labels"]["app.kubernetes.io/component"] == "controller")
    service = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")[
        "webhooks"][0]["clientConfig"]["service"]["name"]
    secret = token(kube_cluster, namespace, account)
    client = client_for(kube_cluster, secret)
    mine = kubernetes.client.AdmissionregistrationV1Api(client)
    admin = kubernetes.client.AdmissionregistrationV1Api(kube_cluster.api_client)
    kubeconfig = tmp_path / "controller.kubeconfig"
    config = yaml.safe_load(kube_cluster.kubeconfig.read_text())
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": config["clusters"],
        "users": [{"name": "sa", "user": {"token": secret}}],
        "contexts": [{"name": "sa", "context": {"cluster": config["clusters"][0]["name"], "user": "sa"}}],
        "current-context": "sa"}))
    options = WebhookOptions(listen="0.0.0.0:9443", namespace=namespace, service=f"{namespace}/{service}:443",
                             config_name=name)
    only_ca = "may change only the caBundle of webhook configuration"

    def patch(ops: list[dict[str, Any]], api: Any = mine, dry_run: str | None = None) -> Any:
        return api.patch_mutating_webhook_configuration(name, ops, dry_run=dry_run)

    wider = [{"op": "replace", "path": "/webhooks/0/namespaceSelector", "value": {}}]

    def enforced() -> bool:
        try:
            patch(wider, dry_run="All")
        except ApiException as exc:
            if exc.status == 403 and only_ca in str(exc.body):
                return True
            raise
        return False

    wait_until(enforced, 30, "the controller write policy to be enforced", interval=0.3)

    def ca_bundles() -> set[bytes]:
        return {base64.b64decode(w.client_config.ca_bundle or "")
                for w in admin.read_mutating_webhook_configuration(name).webhooks}

    async def start_up(ca: bytes) -> None:
        kube = KubeClient.from_environment(str(kubeconfig))
        try:
            await upsert_configuration(kube, webhook_configuration(options, ca))
        finally:
            await kube.close()

    # The controller's own start-up write (create: 409, then the whole webhooks list with its CA) passes,
    # twice, each time changing only the CA.
    before = admin.read_mutating_webhook_configuration(name)
    asyncio.run(start_up(b"first ca"))
    assert ca_bundles() == {b"first ca"}
    asyncio.run(start_up(b"second ca"))
    assert ca_bundles() == {b"second ca"}
    after = admin.read_mutating_webhook_configuration(name)
    for old, new in zip(before.webhooks, after.webhooks, strict=True):
        new.client_config.ca_bundle = None
        assert new == old
    # So does a patch of the caBundle alone.
    patch([{"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": base64.b64encode(b"x").decode()}])
    # Anything else is refused: wider namespaces, other operations or resources, another endpoint, failing
    # open, no match conditions, an object selector, a webhook more or less, its labels.
    webhook = admin.read_mutating_webhook_configuration(name).webhooks[0]
    changes = {
        "namespaceSelector": wider,
        "rules": [{"op": "replace", "path": "/webhooks/0/rules/0/resources", "value": ["*"]}],
        "operations": [{"op": "add", "path": "/webhooks/0/rules/0/operations/-", "value": "UPDATE"}],
        "clientConfig": [{"op": "replace", "path": "/webhooks/0/clientConfig/service/name", "value": "elsewhere"}],
        "failurePolicy": [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}],
        "matchConditions": [{"op": "remove", "path": "/webhooks/0/matchConditions"}],
        "objectSelector": [{"op": "replace", "path": "/webhooks/0/objectSelector",
                            "value": {"matchLabels": {"a": "b"}}}],
        "timeoutSeconds": [{"op": "replace", "path": "/webhooks/0/timeoutSeconds", "value": 30}],
        "a webhook less": [{"op": "remove", "path": "/webhooks/1"}],
        "a webhook more": [{"op": "add", "path": "/webhooks/-", "value": {
            **kube_cluster.api_client.sanitize_for_serialization(webhook), "name": "more.cdmo.io"}}],
        "labels": [{"op": "add", "path": "/metadata/labels/extra", "value": "x"}],
    }
    for what, ops in changes.items():
        refused(lambda o=ops: patch(o), only_ca, name)
        assert ca_bundles() == {b"second ca", b"x"}, what
    # The policy binds the controller only: an admin may change the rules (dry run).
    patch(wider, api=admin, dry_run="All")
    # RBAC: no other configuration, no delete.
    with pytest.raises(ApiException) as caught:
        mine.delete_mutating_webhook_configuration(name)
    assert caught.value.status == 403 and "cannot delete" in caught.value.body
    # Where the configuration is gone, the controller may make it again only as its code does: webhooks for
    # pods, served by the release's Service; not one calling a URL of its choosing.
    admin.delete_mutating_webhook_configuration(name)
    elsewhere = webhook_configuration(WebhookOptions(listen="0.0.0.0:9443", namespace=namespace,
                                                     url="https://attacker.example:443/x", config_name=name), b"ca")
    refused(lambda: mine.create_mutating_webhook_configuration(elsewhere, dry_run="All"),
            "only with webhooks for pod CREATE served by Service")
    asyncio.run(start_up(b"third ca"))
    assert ca_bundles() == {b"third ca"}
    client.close()
