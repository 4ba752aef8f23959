"""The Helm chart against the real local API server: installed, upgraded and uninstalled with every object
accepted (pods included, on kwok nodes), the ServiceAccounts refused what they do not need, and the
controller's shared webhook certificate made and read through the chart's Secret rules.

Every other operator test already runs its controller and agents as the chart's ServiceAccounts (the
``operator`` fixture), which is what proves the chart grants enough."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from cluster import CHART_DIR, CHART_NAMESPACE, REPO_ROOT, ChartIdentities, KubeCluster
from harness import OperatorHarness, wait_until
from kubernetes.client.rest import ApiException

DEVICE_CLASS = REPO_ROOT / "crds" / "device-class.yaml"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def helm(cluster: KubeCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(cluster.bin_dir / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args],
                            capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def manifest(cluster: KubeCluster, release: str, namespace: str) -> list[dict[str, Any]]:
    out = helm(cluster, "get", "manifest", release, "--namespace", namespace).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def exists(cluster: KubeCluster, doc: dict[str, Any], namespace: str) -> bool:
    kind = f"{doc['kind'].lower()}.{doc['apiVersion'].split('/')[0]}" if "/" in doc["apiVersion"] else doc["kind"]
    args = ["get", kind, doc["metadata"]["name"], "--ignore-not-found", "-o", "name"]
    if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                           "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterKopfPeering"):
        args += ["--namespace", namespace]
    return bool(cluster.kubectl(*args).stdout.strip())


def pods(cluster: KubeCluster, namespace: str, component: str) -> list[Any]:
    return cluster.core_v1().list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/component={component}").items


def tolerate_kwok(tmp_path: Path) -> list[str]:
    """Values that let both parts' pods onto kwok nodes (which kwok then reports as running); the
    agents keep their default toleration (Helm replaces a list given in values, never merges it)."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    extra = {part: {"tolerations": [*values[part]["tolerations"], KWOK_TAINT]}
             for part in ("controller", "webhook", "agent")}
    path = tmp_path / "kwok-values.yaml"
    path.write_text(yaml.safe_dump(extra))
    return ["--values", str(path)]


@pytest.fixture
def nvidia_runtime_class(kube_cluster: KubeCluster) -> Any:
    """The RuntimeClass the agent pods name (GPU Operator makes it on real clusters); without one the
    API server refuses the pods."""
    node_api = kubernetes.client.NodeV1Api(kube_cluster.api_client)
    made = False
    try:
        node_api.create_runtime_class({"metadata": {"name": "nvidia"}, "handler": "nvidia"})
        made = True
    except ApiException as exc:
        if exc.status != 409:
            raise
    yield
    if made:
        node_api.delete_runtime_class("nvidia")


def service_account_kubeconfig(cluster: KubeCluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as ``account`` (a TokenRequest token), as its pods would."""
    answer = cluster.core_v1().create_namespaced_service_account_token(account, namespace, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": "sa", "user": {"token": answer.status.token}}],
        "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"], "user": "sa"}}],
        "current-context": "sa"}))
    return path


def controller_start_up_writes(kubeconfig: Path, namespace: str, service: str, config_name: str, peering: str,
                               ca: bytes) -> None:
    """What a controller replica of the release writes at start, with the controller's own code and
    identity: its peering object, then its CA into the webhook configuration (kwok runs no process)."""
    import asyncio

    from mig_operator.kube.common.client import KubeClient
    from mig_operator.kube.controller.main import ensure_peering
    from mig_operator.kube.webhook.server import WebhookOptions, upsert_configuration, webhook_configuration

    async def write() -> None:
        client = KubeClient.from_environment(str(kubeconfig))
        try:
            await ensure_peering(client, peering)
            options = WebhookOptions(listen="0.0.0.0:9443", namespace=namespace, service=f"{namespace}/{service}:443",
                                     config_name=config_name)
            await upsert_configuration(client, webhook_configuration(options, ca))
        finally:
            await client.close()

    asyncio.run(write())


def test_the_chart_installs_upgrades_and_uninstalls_with_every_object_accepted(
        kube_cluster: KubeCluster, operator: OperatorHarness, nvidia_runtime_class: None, tmp_path: Path) -> None:
    # A GPU node as GPU Feature Discovery labels it; kwok plays its kubelet.
    gpu_node = operator.add_node("h100-80gb", labels={"nvidia.com/gpu.present": "true"})
    namespace = f"chart-{uuid.uuid4().hex[:6]}"
    release = "gpu"
    # Cluster-wide objects named after this test: a kept control plane may hold the defaults' names.
    names = ["--set", f"webhook.configurationName={namespace}", "--set", f"controller.peering={namespace}"]
    admission = kubernetes.client.AdmissionregistrationV1Api(kube_cluster.api_client)
    # The DeviceClass is installed by the session (crds/); the chart must be able to install its own copy.
    kube_cluster.kubectl("delete", "-f", str(DEVICE_CLASS), "--ignore-not-found")
    try:
        # The session applied the CRDs with kubectl, as an earlier chart (CRDs in its crds/) left them: the
        # release takes them over (docs/operations.md, "Upgrade").
        helm(kube_cluster, "install", release, str(CHART_DIR), "--namespace", namespace, "--create-namespace",
             "--take-ownership", *names, *tolerate_kwok(tmp_path))
        docs = manifest(kube_cluster, release, namespace)
        kinds = sorted({d["kind"] for d in docs})
        assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                         "DaemonSet", "Deployment",
                         "DeviceClass", "MutatingWebhookConfiguration", "NetworkPolicy", "PodDisruptionBudget",
                         "ResourceQuota", "Role",
                         "RoleBinding", "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                         "ValidatingAdmissionPolicyBinding"]
        for doc in docs:
            assert exists(kube_cluster, doc, namespace), f"{doc['kind']} {doc['metadata']['name']} was not created"
        # The pods themselves are accepted (securityContext, RuntimeClass, hostPaths, downward API) and
        # placed: two controller replicas, two webhook replicas, one agent on the GPU node.
        wait_until(lambda: len(pods(kube_cluster, namespace, "controller")) == 2, 60, "two controller pods")
        wait_until(lambda: len(pods(kube_cluster, namespace, "webhook")) == 2, 60, "two webhook pods")
        hook, ctl = pods(kube_cluster, namespace, "webhook")[0], pods(kube_cluster, namespace, "controller")[0]
        assert hook.spec.containers[0].args[0] == "webhook" and ctl.spec.containers[0].args[0] == "controller"
        assert hook.spec.service_account_name == ctl.spec.service_account_name
        # A DaemonSet's pod is bound by kube-scheduler a moment after it is made.
        agent = wait_until(lambda: [p for p in pods(kube_cluster, namespace, "agent") if p.spec.node_name], 60,
                           "an agent pod bound to a node")
        assert [p.spec.node_name for p in agent] == [gpu_node.name]
        assert agent[0].spec.runtime_class_name == "nvidia"
        assert agent[0].spec.containers[0].security_context.privileged is True
        # The MPS host beside it, on the same node.
        host = wait_until(lambda: [p for p in pods(kube_cluster, namespace, "mps") if p.spec.node_name], 60,
                          "an MPS host pod bound to a node")
        assert [p.spec.node_name for p in host] == [gpu_node.name]
        assert host[0].spec.containers[0].args[0] == "mps-host"
        # The quota that clusters limiting critical classes ask for covers the agent and MPS host pods.
        quota = next(d for d in docs if d["kind"] == "ResourceQuota")["metadata"]["name"]

        def counted() -> bool:
            used = kube_cluster.core_v1().read_namespaced_resource_quota(quota, namespace).status.used or {}
            return used.get("pods") == "2"

        wait_until(counted, 60, f"ResourceQuota {quota} to count the agent and MPS host pods")

        # A controller replica starts: as the release's ServiceAccount it finds the chart's peering and
        # webhook configuration (create: 409) and patches its CA in (patch, by name).
        ctl_kubeconfig = service_account_kubeconfig(kube_cluster, namespace, pods(
            kube_cluster, namespace, "controller")[0].spec.service_account_name, tmp_path / "controller.kubeconfig")
        service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-webhook"))
        chart_webhook = admission.read_mutating_webhook_configuration(namespace).webhooks[0]
        assert chart_webhook.client_config.ca_bundle is None  # Helm never writes it
        controller_start_up_writes(ctl_kubeconfig, namespace, service["metadata"]["name"], namespace, namespace,
                                   b"ca of the controller")

        def ca_bundle() -> bytes:
            webhook = admission.read_mutating_webhook_configuration(namespace).webhooks[0]
            assert webhook.client_config.service.name == service["metadata"]["name"]
            assert webhook.match_conditions and webhook.namespace_selector == chart_webhook.namespace_selector
            return base64.b64decode(webhook.client_config.ca_bundle or "")

        assert ca_bundle() == b"ca of the controller"

        # An upgrade with other values is accepted too, and leaves the controller's CA in place; a chart whose
        # CRD changed (a printer column more) updates the CRD, and the next chart takes it back.
        newer = tmp_path / "newer-chart"
        shutil.copytree(CHART_DIR, newer)
        crd_file = newer / "files" / "crds" / "gpuslice.yaml"
        crd_file.write_text(crd_file.read_text().replace(
            "      additionalPrinterColumns:\n",
            "      additionalPrinterColumns:\n        - name: Upgraded\n          type: string\n"
            "          jsonPath: .status.phase\n", 1))

        def columns() -> list[str]:
            crd = yaml.safe_load(kube_cluster.kubectl("get", "crd", "gpuslices.cdmo.io", "-o", "yaml").stdout)
            return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]

        assert "Upgraded" not in columns()
        # The first upgrade after the takeover takes kubectl's share of the CRDs' fields (server-side apply).
        helm(kube_cluster, "upgrade", release, str(newer), "--namespace", namespace, "--force-conflicts", *names,
             "--set", "controller.replicas=1", "--set", "agent.idleTimeout=15m", "--set", "metrics.enabled=false",
             "--set", "logging.format=text", *tolerate_kwok(tmp_path))
        assert ca_bundle() == b"ca of the controller"
        assert columns()[0] == "Upgraded"
        # The upgrade docs/operations.md gives (the last release's values on the new chart's defaults).
        helm(kube_cluster, "upgrade", release, str(CHART_DIR), "--namespace", namespace,
             "--reset-then-reuse-values", "--set", "agent.nvmlAttempts=7")
        assert ca_bundle() == b"ca of the controller"
        assert "Upgraded" not in columns()
        upgraded = manifest(kube_cluster, release, namespace)
        daemonset = kube_cluster.kubectl("get", "daemonset", "-n", namespace, "-o", "json").stdout
        assert "--idle-timeout=15m" in daemonset and "--nvml-attempts=7" in daemonset
        assert not [d for d in upgraded if d["metadata"]["name"].endswith("-metrics")]
        assert not kube_cluster.kubectl("get", "service", "-n", namespace, "-o", "name",
                                        "-l", "mig-operator.cdmo.io/metrics").stdout.strip()

        helm(kube_cluster, "uninstall", release, "--namespace", namespace, "--wait")
        for doc in upgraded:
            if doc["kind"] == "CustomResourceDefinition":
                continue
            assert not exists(kube_cluster, doc, namespace), f"{doc['kind']} {doc['metadata']['name']} survived"
        # Nothing cluster-wide is left that would refuse annotated pods or hold a stale peering.
        assert not kube_cluster.kubectl("get", "mutatingwebhookconfiguration", namespace, "--ignore-not-found",
                                        "-o", "name").stdout.strip()
        assert not kube_cluster.kubectl("get", "clusterkopfpeering", namespace, "--ignore-not-found",
                                        "-o", "name").stdout.strip()
        # CRDs stay (helm.sh/resource-policy: keep): the slices and inventories in them stay too.
        for doc in upgraded:
            if doc["kind"] == "CustomResourceDefinition":
                assert exists(kube_cluster, doc, namespace), doc["metadata"]["name"]
        assert kube_cluster.kubectl("get", "crd", "gpuslices.cdmo.io", "-o", "name").stdout.strip()
    finally:
        helm(kube_cluster, "uninstall", release, "--namespace", namespace, check=False)
        kube_cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(DEVICE_CLASS))


def test_pod_security_the_controller_meets_restricted_and_the_agent_needs_privileged(
        kube_cluster: KubeCluster, nvidia_runtime_class: None) -> None:
    """What docs/operations.md tells admins about the namespace's Pod Security level, checked by the
    API server's own PodSecurity admission (server-side dry runs of the chart's pod templates)."""
    rendered = helm(kube_cluster, "template", "ps", str(CHART_DIR), "--namespace", "default").stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    templates = {(d["kind"], d["metadata"]["name"]): d["spec"]["template"] for d in docs
                 if d["kind"] in ("Deployment", "DaemonSet")}
    assert sorted(templates) == [("DaemonSet", "ps-mig-operator-agent"), ("DaemonSet", "ps-mig-operator-mps"),
                                 ("Deployment", "ps-mig-operator-controller"),
                                 ("Deployment", "ps-mig-operator-webhook")]
    core = kube_cluster.core_v1()
    names = []
    try:
        for level in ("restricted", "baseline", "privileged"):
            name = f"ps-{level}-{uuid.uuid4().hex[:6]}"
            names.append(name)
            core.create_namespace({"metadata": {"name": name, "labels": {
                "pod-security.kubernetes.io/enforce": level}}})
            for (kind, workload), template in templates.items():
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": workload, "namespace": name},
                       "spec": template["spec"]}
                result = kube_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod),
                                              check=False)
                accepted = result.returncode == 0
                expected = kind == "Deployment" or level == "privileged"
                assert accepted == expected, f"{kind} in a {level} namespace: {result.stdout}{result.stderr}"
                if kind == "DaemonSet" and not accepted:
                    assert "privileged" in result.stderr or "hostPath" in result.stderr, result.stderr
    finally:
        for name in names:
            core.delete_namespace(name)


# ---- least privilege, refused ----------------------------------------------------------------------


def can(kube_cluster: KubeCluster, identities: ChartIdentities, part: str, verb: str, resource: str,
        group: str = "", namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> bool:
    """A SubjectAccessReview: may ``part``'s ServiceAccount do this? (The API server's RBAC answers.)"""
    attributes = {"verb": verb, "resource": resource, "group": group}
    if namespace:
        attributes["namespace"] = namespace
    if name:
        attributes["name"] = name
    if subresource:
        attributes["subresource"] = subresource
    review = kubernetes.client.AuthorizationV1Api(kube_cluster.api_client).create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": identities.user(part), "resourceAttributes": attributes,
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{identities.namespace}",
                            "system:authenticated"]},
    })
    return bool(review.status.allowed)


def test_every_verb_the_chart_grants_is_granted(kube_cluster: KubeCluster, chart_identities: ChartIdentities) -> None:
    # The parts' roles (the metrics reader's is bound by the admin: tests/e2e/test_metrics_auth.py).
    roles = [d for d in yaml.safe_load_all(chart_identities.rendered) if d and d["kind"] in ("ClusterRole", "Role")
             and d["metadata"]["labels"]["app.kubernetes.io/component"] != "metrics"]
    assert len(roles) == 3
    for role in roles:
        part = role["metadata"]["labels"]["app.kubernetes.io/component"]
        namespace = role["metadata"].get("namespace") or "some-team"
        for rule in role["rules"]:
            for resource in rule["resources"]:
                base, _, sub = resource.partition("/")
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [None]:
                        assert can(kube_cluster, chart_identities, part, verb, base, rule["apiGroups"][0],
                                   namespace, name, sub or None), f"{part} cannot {verb} {resource} {name or ''}"


REFUSED: dict[str, list[tuple[str, str, str, str | None, str | None, str | None]]] = {
    # part: (verb, resource, group, namespace, name, subresource)
    "agent": [
        ("patch", "pods", "", "some-team", None, None),
        ("create", "gpuslices", "cdmo.io", "some-team", None, None),
        ("delete", "gpuslices", "cdmo.io", "some-team", None, None),
        ("get", "secrets", "", "kube-system", None, None),
        ("list", "secrets", "", None, None, None),
        ("get", "secrets", "", CHART_NAMESPACE, "e2e-mig-operator-webhook-cert", None),
        ("create", "configmaps", "", "some-team", None, None),
        ("create", "resourceclaims", "resource.k8s.io", "some-team", None, None),
        ("update", "resourceclaims", "resource.k8s.io", "some-team", "any", "status"),
        ("create", "deviceclasses", "resource.k8s.io", None, None, None),
        ("patch", "nodes", "", None, "gpu-1", None),
        ("patch", "gpunodes", "cdmo.io", None, "gpu-1", None),
        ("delete", "gpunodes", "cdmo.io", None, "gpu-1", None),
        ("list", "gpunodes", "cdmo.io", None, None, None),
        ("patch", "clusterkopfpeerings", "kopf.dev", None, "mig-operator", None),
        ("create", "mutatingwebhookconfigurations", "admissionregistration.k8s.io", None, None, None),
        ("create", "pods", "", "some-team", None, None),
    ],
    "controller": [
        ("get", "secrets", "", "kube-system", None, None),
        ("list", "secrets", "", None, None, None),
        ("list", "secrets", "", CHART_NAMESPACE, None, None),
        ("get", "secrets", "", CHART_NAMESPACE, "someone-elses-secret", None),
        ("create", "secrets", "", "some-team", None, None),
        ("patch", "mutatingwebhookconfigurations", "admissionregistration.k8s.io", None, "someone-elses", None),
        ("delete", "mutatingwebhookconfigurations", "admissionregistration.k8s.io", None, "e2e-mig-operator", None),
        ("patch", "validatingwebhookconfigurations", "admissionregistration.k8s.io", None, "any", None),
        # It deletes one finished pod's slice at a time (kube/controller/pods.py), never a collection.
        ("deletecollection", "gpuslices", "cdmo.io", "some-team", None, None),
        ("create", "gpunodes", "cdmo.io", None, None, None),
        ("patch", "gpunodes", "cdmo.io", None, "gpu-1", "status"),
        ("create", "pods", "", "some-team", None, None),
        ("delete", "pods", "", "some-team", None, None),
        ("patch", "nodes", "", None, "gpu-1", None),
        ("get", "configmaps", "", "kube-system", "any", None),
        ("create", "configmaps", "", "some-team", None, None),
        ("patch", "resourceclaims", "resource.k8s.io", "some-team", "any", None),
        ("update", "resourceclaims", "resource.k8s.io", "some-team", "any", "status"),
        ("list", "resourceclaims", "resource.k8s.io", None, None, None),
        ("create", "resourceslices", "resource.k8s.io", None, None, None),
        ("create", "deviceclasses", "resource.k8s.io", None, None, None),
        ("create", "clusterroles", "rbac.authorization.k8s.io", None, None, None),
        ("create", "serviceaccounts", "", None, None, "token"),
    ],
}


@pytest.mark.parametrize("part", sorted(REFUSED))
def test_each_service_account_is_refused_what_it_does_not_need(
        kube_cluster: KubeCluster, chart_identities: ChartIdentities, part: str) -> None:
    allowed = [case for case in REFUSED[part] if can(kube_cluster, chart_identities, part, *case[:2], *case[2:])]
    assert not allowed, f"{part} may: {allowed}"
    # And as kubectl puts it, impersonating the ServiceAccount.
    answer = kube_cluster.kubectl("auth", "can-i", "patch", "pods", "--all-namespaces",
                                  f"--as={chart_identities.user(part)}", check=False)
    assert answer.stdout.strip() == ("yes" if part == "controller" else "no")


# ---- a verb missing from the chart fails a real test -------------------------------------------------

# (part, API group, resource, verb): one verb each part's work cannot do without.
DROPPED = [("agent", "cdmo.io", "gpuslices/status", "patch"), ("controller", "cdmo.io", "gpuslices/status", "patch")]


@pytest.mark.parametrize(("part", "group", "resource", "verb"), DROPPED, ids=[f"{d[0]}-{d[2]}-{d[3]}" for d in DROPPED])
def test_a_verb_missing_from_the_charts_rbac_fails_the_operator(
        kube_cluster: KubeCluster, operator: OperatorHarness, chart_identities: ChartIdentities, tmp_path: Path,
        part: str, group: str, resource: str, verb: str) -> None:
    """The e2e suite runs every controller and agent as the chart's ServiceAccounts; this shows that
    doing so has teeth: the same part, under the chart's role less one verb, is refused by the API
    server (in its log, as the suite's teardown looks for) and its slice never becomes Ready."""
    roles = [d for d in yaml.safe_load_all(chart_identities.rendered) if d and d["kind"] == "ClusterRole"
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == part]
    [role] = roles
    name = f"rbac-probe-{part}-{uuid.uuid4().hex[:6]}"
    rules = []
    for rule in role["rules"]:
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            assert rule["resources"] == [resource] and rule["apiGroups"] == [group], rule
            rule = {**rule, "verbs": [v for v in rule["verbs"] if v != verb]}
        if rule["verbs"]:
            rules.append(rule)
    assert rules != role["rules"], f"the chart's {part} role has no {verb} on {resource}"
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": CHART_NAMESPACE}}
    reduced = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
               "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": CHART_NAMESPACE}]}
    objects = yaml.safe_dump_all([account, reduced, binding])
    kube_cluster.kubectl("apply", "-f", "-", input=objects)
    try:
        operator.kubeconfigs = {**operator.kubeconfigs, part: service_account_kubeconfig(
            kube_cluster, CHART_NAMESPACE, name, tmp_path / f"{name}.kubeconfig")}
        node = operator.add_node("h100-80gb")
        # The agent publishes its GpuNode either way (that needs no gpuslices/status).
        operator.start_operator(node)
        operator.wait_gpunode(node)
        ns = operator.namespace()
        operator.create_slice(ns, "s", {"memory": "4G"})
        [proc] = [p for p in operator.procs if p.args[3] == part]
        refusal = f'User "system:serviceaccount:{CHART_NAMESPACE}:{name}" cannot {verb} resource "{resource}"'
        wait_until(lambda: refusal in proc.log.read_text(errors="replace"), 30,
                   lambda: f"the API server's refusal of {verb} {resource} in the {part}'s log\n{operator.logs()}")
        # Where the slice stops: never bound without the controller's status write; bound but never
        # realised (not even Creating) without the agent's.
        phase = ((operator.get_slice(ns, "s") or {}).get("status") or {}).get("phase")
        assert phase == {"controller": None, "agent": "Bound"}[part], phase
    finally:
        # Stopped and forgotten here: the suite's teardown fails on any refusal in its processes' logs.
        for proc in [p for p in operator.procs if p.args[3] == part]:
            operator.stop(proc)
            operator.procs.remove(proc)
        kube_cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=objects)


# ---- the webhook certificate Secret -----------------------------------------------------------------


def _served_certificate(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        return tls.getpeercert(binary_form=True)


def test_webhook_replicas_share_the_certificate_through_the_charts_secret(
        operator: OperatorHarness, chart_identities: ChartIdentities) -> None:
    """The first replica makes the certificate and stores it (secrets: create), the second reads it
    (secrets: get, by name); both serve it, and the configuration trusts its CA (create, patch). The
    first is `mig-operator webhook`, as the chart runs it; the second a controller serving the same
    webhook in its own process (`controller --webhook`): one server, whichever process holds it."""
    secret = chart_identities.webhook_cert_secret
    core = operator.core
    try:
        core.delete_namespaced_secret(secret, CHART_NAMESPACE)
    except ApiException as exc:
        if exc.status != 404:
            raise
    first = operator.webhook(None, "--webhook-cert-secret", secret)
    operator.wait_webhook()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        second_port = sock.getsockname()[1]
    operator.controller(None, "--webhook", f"127.0.0.1:{second_port}", "--webhook-config", operator.webhook_config,
                        "--namespace", CHART_NAMESPACE, "--webhook-cert-secret", secret)

    def serving() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", second_port)) == 0

    wait_until(serving, 30, lambda: f"the second replica's webhook\n{operator.logs()}")
    try:
        data = core.read_namespaced_secret(secret, CHART_NAMESPACE).data
        served = {_served_certificate(operator.webhook_port), _served_certificate(second_port)}
        assert served == {ssl.PEM_cert_to_DER_cert(base64.b64decode(data["tls.crt"]).decode())}
        admission = kubernetes.client.AdmissionregistrationV1Api(operator.cluster.api_client)
        config = admission.read_mutating_webhook_configuration(operator.webhook_config)
        assert base64.b64decode(config.webhooks[0].client_config.ca_bundle) == base64.b64decode(data["ca.crt"])
        # The CA the configuration names is the one that signed what both replicas serve.
        with tempfile.NamedTemporaryFile("wb", suffix=".pem") as ca:
            ca.write(base64.b64decode(data["ca.crt"]))
            ca.flush()
            context = ssl.create_default_context(cafile=ca.name)
            with socket.create_connection(("127.0.0.1", second_port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1"):
                pass
        assert first.alive
    finally:
        for proc in operator.procs:
            operator.stop(proc)
        core.delete_namespaced_secret(secret, CHART_NAMESPACE)
