"""The Helm chart, offline: lint, Kubernetes 1.34 schemas, least-privilege RBAC, pod privileges, and the
places where the chart must say exactly what the code says (CRDs, webhook configuration, flags)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_chart import CHART_DIR, REPO_ROOT, container, find, workload

from mig_operator.cli import build_parser
from mig_operator.cli.flags import parse_duration
from mig_operator.core.requests.compat import check_dialects
from mig_operator.kube.common.names import WEBHOOK_NAME
from mig_operator.kube.webhook.server import WebhookOptions, webhook_configuration

K8S_SCHEMA_VERSION = "1.34.0"
# Kinds from other projects' CRDs: no 1.34 schema exists for them; checked field by field below.
FOREIGN_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
                 ("monitoring.coreos.com/v1", "ServiceMonitor")}
# Kinds of the chart's own CRDs (crds/): checked against those CRDs below.
OWN_KINDS = {("kopf.dev/v1", "ClusterKopfPeering")}
SHA = "sha256:" + "ab" * 32

VARIANTS: dict[str, list[str]] = {
    "default": [],
    "cert-manager, ServiceMonitor": [
        "--set", "webhook.certManager.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.serviceMonitor.labels.release=prometheus",
    ],
    "cert-manager with a ClusterIssuer": [
        "--set", "webhook.certManager.enabled=true", "--set", "webhook.certManager.issuerRef.kind=ClusterIssuer",
        "--set", "webhook.certManager.issuerRef.name=company-ca",
        "--set", "webhook.certManager.issuerRef.group=cert-manager.io",
    ],
    "everything else changed": [
        "--set", "fullnameOverride=gpu-slices", "--set", "image.repository=registry.example/mig-operator",
        "--set", f"image.digest={SHA}", "--set", "imagePullSecrets[0].name=pull",
        "--set", "logging.level=debug", "--set", "logging.format=text", "--set", "metrics.enabled=false",
        "--set", "health.port=18081",
        "--set", "controller.replicas=3", "--set", "webhook.replicas=3", "--set", "controller.resync=2m",
        "--set", "controller.peering=gpu-peers",
        "--set", "controller.fairHold=90s", "--set", "compat={runai}", "--set", "webhook.wholeGpusEverywhere=true",
        "--set", "controller.priorityClassName=system-cluster-critical",
        "--set", "controller.podDisruptionBudget.enabled=false", "--set", "webhook.port=8443",
        "--set", "webhook.configurationName=gpu-slices", "--set", "webhook.selfSigned.secretName=gpu-slices-tls",
        "--set", "agent.idleTimeout=10m", "--set", "agent.nvmlAttempts=9", "--set", "agent.stateDir=/opt/cdmo/state",
        "--set", "agent.runtimeClassName=", "--set", "agent.backend=sim:h100-80gbx2",
        "--set", "agent.nodeSelector.gpu=yes", "--set", "agent.priorityClassName=",
        "--set", "shim.hostDir=/opt/cdmo/shim", "--set", "serviceAccount.controller.name=ctl",
        "--set", "serviceAccount.agent.name=agt",
        "--set", "agent.toolkitConfig=/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml",
    ],
}
VARIANT_IDS = list(VARIANTS)


@pytest.fixture(params=VARIANT_IDS)
def variant(request: pytest.FixtureRequest) -> list[str]:
    return VARIANTS[request.param]


# ---- lint and schemas ------------------------------------------------------------------------------


def test_helm_lint_passes_strict_with_default_and_other_values(helm: Any, variant: list[str]) -> None:
    result = helm("lint", "--strict", str(CHART_DIR), *variant)
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("namespace", ["mig-operator", "gpu-system"])
def test_every_object_validates_against_the_kubernetes_1_34_schemas(render: Any, variant: list[str],
                                                                     namespace: str) -> None:
    docs = render("--include-crds", *variant, namespace=namespace)
    crds = {(f"{d['spec']['group']}/{v['name']}", d["spec"]["names"]["kind"]): d for d in docs
            if d["kind"] == "CustomResourceDefinition" for v in d["spec"]["versions"] if v["served"]}
    checked = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if doc["metadata"].get("namespace") is not None:
            assert doc["metadata"]["namespace"] == namespace, (key, doc["metadata"])
        if key in FOREIGN_KINDS:
            _check_foreign(doc)
            continue
        if key in OWN_KINDS:
            # A kind of one of the chart's CRDs, cluster-scoped, with nothing the CRD's schema lacks.
            crd = crds[key]
            assert crd["spec"]["scope"] == "Cluster" and "namespace" not in doc["metadata"]
            [version] = [v for v in crd["spec"]["versions"] if doc["apiVersion"].endswith("/" + v["name"])]
            assert set(doc) - {"apiVersion", "kind", "metadata"} <= set(
                version["schema"]["openAPIV3Schema"].get("properties") or {}), doc
            checked.add(doc["kind"])
            continue
        try:
            kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
        checked.add(doc["kind"])
    assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "Service", "ServiceAccount", "ClusterRole",
            "ClusterRoleBinding", "MutatingWebhookConfiguration", "ClusterKopfPeering", "NetworkPolicy"} <= checked


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    """The offline check is not vacuous: a field Kubernetes does not know fails, as does a wrong type."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replica": 2, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_SCHEMA_VERSION, strict=True)
    bad["spec"]["replicas"] = "two"
    del bad["spec"]["replica"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_SCHEMA_VERSION, strict=True)


def _check_foreign(doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    if doc["kind"] == "Certificate":
        assert spec["secretName"] and spec["dnsNames"] and spec["issuerRef"]["name"], spec
        assert set(spec) <= {"secretName", "dnsNames", "issuerRef", "duration", "renewBefore", "privateKey"}
    elif doc["kind"] == "Issuer":
        assert spec == {"selfSigned": {}}
    else:
        assert spec["selector"]["matchLabels"] and spec["endpoints"][0]["port"] == "metrics", spec
        # /metrics answers only allowed callers: Prometheus sends its ServiceAccount's token.
        assert spec["endpoints"][0]["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
        assert spec["endpoints"][0]["scheme"] == "http"


# ---- one source of truth ---------------------------------------------------------------------------


def test_the_chart_crds_are_copies_of_the_crds_directory() -> None:
    """crds/ at the repo root is the source; `make chart-crds` copies it into the chart: the operator's
    own CRDs to files/crds/ (templates), the peering CRD to crds/. The DeviceClass (device-class.yaml)
    is not a CRD, so it is a template (compared below)."""
    source = {p.name: p.read_bytes() for p in (REPO_ROOT / "crds").glob("*.yaml")
              if p.name != "device-class.yaml"}
    chart = {p.name: p.read_bytes() for p in (CHART_DIR / "files" / "crds").glob("*.yaml")}
    installed_once = {p.name: p.read_bytes() for p in (CHART_DIR / "crds").glob("*.yaml")}
    assert sorted(installed_once) == ["peering.yaml"], "run `make chart-crds`"
    assert sorted({**chart, **installed_once}) == sorted(source), "run `make chart-crds`"
    for name, text in source.items():
        copy = installed_once[name] if name == "peering.yaml" else chart[name]
        assert copy == text, f"the chart's {name} differs from crds/{name}: run `make chart-crds`"


def test_the_operators_crds_are_templates_kept_on_uninstall_and_the_peering_crd_is_installed_once(
        render: Any) -> None:
    """Templates, so that `helm upgrade` updates them; kept on uninstall (their deletion would delete every
    GpuSlice and GpuNode); the same objects as crds/. The peering CRDs (kopf.dev, maybe another kopf
    operator's) only from the chart's crds/: installed when missing, never taken over."""
    docs = render(release="mo")
    rendered = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    source = {}
    for path in (REPO_ROOT / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "CustomResourceDefinition":
                source[doc["metadata"]["name"]] = doc
    assert sorted(rendered) == ["gpunodes.cdmo.io", "gpuquotas.cdmo.io", "gpuslices.cdmo.io"]
    for name, crd in rendered.items():
        meta = crd["metadata"]
        assert meta.pop("annotations") == {"helm.sh/resource-policy": "keep"}
        labels = meta.pop("labels")
        assert labels["app.kubernetes.io/instance"] == "mo" and labels["app.kubernetes.io/managed-by"] == "Helm"
        assert crd == source[name], name  # nothing else changed on the way
    with_crds = {d["metadata"]["name"] for d in render("--include-crds", release="mo")
                 if d["kind"] == "CustomResourceDefinition"}
    assert with_crds - set(rendered) == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_agents_select_their_slices_by_status_node_and_no_label_policy_is_left() -> None:
    """The agents' field selector needs status.node selectable; the write-once label and its policy
    it replaced are gone from crds/ and the chart."""
    crd = yaml.safe_load((REPO_ROOT / "crds" / "gpuslice.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert version["selectableFields"] == [{"jsonPath": ".status.node"}]
    assert not (REPO_ROOT / "crds" / "slice-node-label.yaml").exists()
    assert not list((CHART_DIR / "templates").glob("slice-node-label*"))


def test_the_device_class_template_is_the_one_in_crds_and_selects_the_driver(render: Any) -> None:
    from mig_operator.kube.common.names import DEVICE_CLASS, DRA_DRIVER

    rendered = [d for d in render() if d["kind"] == "DeviceClass"]
    source = [d for d in yaml.safe_load_all((REPO_ROOT / "crds" / "device-class.yaml").read_text()) if d]
    for doc in rendered:
        assert doc["metadata"].pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered == source
    assert source[0]["metadata"]["name"] == DEVICE_CLASS
    assert source[0]["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]


@pytest.mark.parametrize("cert_manager", [False, True], ids=["self-signed", "cert-manager"])
def test_the_chart_ships_the_webhook_configuration_the_controller_would_write(render: Any,
                                                                              cert_manager: bool) -> None:
    """In both certificate modes the configuration is the chart's (so `helm uninstall` removes it) and is
    the body the controller writes, less the caBundle that Helm must never set: the controller patches
    its own CA in (default mode), or cert-manager's CA injector does."""
    docs = render("--set", f"webhook.certManager.enabled={str(cert_manager).lower()}",
                  "--set", "webhook.configurationName=gpu-webhook", release="gs", namespace="gpu-system")
    rendered = find(docs, "MutatingWebhookConfiguration")
    service = find(docs, "Service", "gs-mig-operator-webhook")
    options = WebhookOptions(listen="0.0.0.0:9443", namespace="gpu-system",
                             service=f"gpu-system/{service['metadata']['name']}:443", config_name="gpu-webhook")
    expected = webhook_configuration(options, b"")
    for entry in expected["webhooks"]:
        del entry["clientConfig"]["caBundle"]
    labels = rendered["metadata"].pop("labels")
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "gs"
    del expected["metadata"]["labels"]  # the controller patches webhooks only, never the chart's labels
    annotations = rendered["metadata"].pop("annotations", None)
    assert rendered == expected
    ctl = _args(container(docs, "Deployment", "webhook"))
    if cert_manager:
        certificate = find(docs, "Certificate")
        assert annotations == {"cert-manager.io/inject-ca-from": f"gpu-system/{certificate['metadata']['name']}"}
        assert ctl.webhook_config == ""  # the controller leaves the configuration to the chart and cert-manager
        assert certificate["spec"]["secretName"] == _volume(docs, "webhook", "webhook-tls")["secret"]["secretName"]
        # The certificate names the Service the way the controller's own certificate would.
        assert certificate["spec"]["dnsNames"] == [f"{service['metadata']['name']}.gpu-system.svc",
                                                   f"{service['metadata']['name']}.gpu-system.svc.cluster.local"]
    else:
        assert annotations is None
        # The controller patches its CA into exactly this object, which its RBAC lets it patch.
        assert ctl.webhook_config == rendered["metadata"]["name"]
        role = find(docs, "ClusterRole", "gs-mig-operator-controller")
        mwc = ("admissionregistration.k8s.io", "mutatingwebhookconfigurations")
        assert (*mwc, "patch", "gpu-webhook") in _grants(role)
        assert ctl.webhook_service == f"gpu-system/{service['metadata']['name']}:443"


def test_the_default_webhook_configuration_name_is_the_code_default(render: Any) -> None:
    args = _args(container(render(), "Deployment", "webhook"))
    assert args.webhook_config == WEBHOOK_NAME


@pytest.mark.parametrize("name", ["default", "everything else changed"])
def test_the_chart_owns_the_peering_object_the_controller_replicas_use(render: Any, name: str) -> None:
    docs = render(*VARIANTS[name])
    peering = find(docs, "ClusterKopfPeering")
    ctl = _args(container(docs, "Deployment", "controller"))
    assert peering["metadata"]["name"] == ctl.peering
    assert peering["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    role = next(d for d in docs if d["kind"] == "ClusterRole"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == "controller")
    assert {("kopf.dev", "clusterkopfpeerings", verb, "") for verb in ("list", "watch", "patch")} <= _grants(role)


# ---- the chart's flags are the command line's ----------------------------------------------------


def test_the_mig_request_namespaces_reach_the_configuration_and_the_controller_alike(render: Any) -> None:
    """The chart's webhook entry for nvidia.com/mig-* requests and the one the controller writes from its
    --mig-request-namespaces flag select the same namespaces (the controller's patch must not widen it)."""
    docs = render("--set", "webhook.migRequestNamespaces={team-a,team-b}", release="gs", namespace="gpu-system")
    ctl = _args(container(docs, "Deployment", "webhook"))
    assert ctl.mig_request_namespaces == "team-a,team-b"
    rendered = find(docs, "MutatingWebhookConfiguration")["webhooks"][1]
    options = WebhookOptions(listen="0.0.0.0:9443", namespace="gpu-system", service=ctl.webhook_service,
                             mig_request_namespaces=("team-a", "team-b"))
    expected = webhook_configuration(options, b"")["webhooks"][1]
    assert rendered["namespaceSelector"] == expected["namespaceSelector"]
    assert rendered["namespaceSelector"]["matchExpressions"][-1]["values"] == ["team-a", "team-b"]
    assert rendered["matchConditions"] == expected["matchConditions"]
    default = _args(container(render(release="gs", namespace="gpu-system"), "Deployment", "webhook"))
    assert default.mig_request_namespaces is None


@pytest.mark.parametrize("compat", [["runai"], ["clearml"], ["clearml", "runai"]])
def test_the_compat_entry_is_the_one_the_controller_writes(render: Any, compat: list[str]) -> None:
    """The chart's third webhook entry (value compat) is the controller's, CEL included, and the
    controller gets the same dialects."""
    docs = render("--set", f"compat={{{','.join(compat)}}}", release="gs", namespace="gpu-system")
    ctl = _args(container(docs, "Deployment", "webhook"))
    assert ctl.compat == ",".join(compat)
    options = WebhookOptions(listen="0.0.0.0:9443", namespace="gpu-system", service=ctl.webhook_service,
                             compat=check_dialects(ctl.compat))
    expected = webhook_configuration(options, b"")["webhooks"][2]
    del expected["clientConfig"]["caBundle"]
    rendered = find(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert len(rendered) == 4 and rendered[2] == expected and rendered[3]["name"] == "whole-gpus.cdmo.io"
    assert [w["name"] for w in find(render(release="gs", namespace="gpu-system"),
                                    "MutatingWebhookConfiguration")["webhooks"]] == [
        "pods.cdmo.io", "mig-requests.cdmo.io", "whole-gpus.cdmo.io"]


@pytest.mark.parametrize("everywhere", [False, True])
def test_the_whole_gpu_entry_is_the_one_the_controller_writes(render: Any, everywhere: bool) -> None:
    docs = render("--set", f"webhook.wholeGpusEverywhere={str(everywhere).lower()}", release="gs",
                  namespace="gpu-system")
    ctl = _args(container(docs, "Deployment", "webhook"))
    assert ctl.whole_gpus_everywhere is everywhere
    options = WebhookOptions(listen="0.0.0.0:9443", namespace="gpu-system", service=ctl.webhook_service,
                             whole_gpus_everywhere=everywhere)
    expected = webhook_configuration(options, b"")["webhooks"][-1]
    del expected["clientConfig"]["caBundle"]
    assert find(docs, "MutatingWebhookConfiguration")["webhooks"][-1] == expected


@pytest.mark.parametrize("required", [False, True])
def test_quota_required_reaches_the_controller(render: Any, required: bool) -> None:
    docs = render("--set", f"quota.required={str(required).lower()}")
    assert _args(container(docs, "Deployment", "controller")).quota_required is required


def test_an_unknown_compat_dialect_stops_the_render(helm: Any) -> None:
    with pytest.raises(AssertionError, match="compat: \"kai\" is not a dialect"):
        helm("template", "gs", str(CHART_DIR), "--set", "compat={kai}")


def _args(c: dict[str, Any]) -> Any:
    env = {e["name"]: "node-a" for e in c.get("env") or [] if e.get("valueFrom")}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    return build_parser().parse_args(argv)


def _volume(docs: list[dict[str, Any]], part: str, name: str) -> dict[str, Any]:
    """Volume ``name`` of the workload running container ``part`` (controller, webhook, agent, mps-host)."""
    kind = "DaemonSet" if part in ("agent", "mps-host") else "Deployment"
    return next(v for v in workload(docs, kind, part)["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


@pytest.mark.parametrize("name", ["default", "everything else changed", "cert-manager, ServiceMonitor"])
def test_the_rendered_arguments_parse_and_agree_with_each_other(render: Any, name: str) -> None:
    docs = render(*VARIANTS[name], namespace="gpu-system")
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    ctl_container = container(docs, "Deployment", "controller")
    hook_container = container(docs, "Deployment", "webhook")
    agent_container = container(docs, "DaemonSet", "agent")
    ctl, hook, agent = _args(ctl_container), _args(hook_container), _args(agent_container)
    assert (ctl.command, hook.command, agent.command) == ("controller", "webhook", "agent")
    # The controller serves no webhook: its own Deployment does.
    assert ctl.webhook is None and "webhook" not in {p["name"] for p in ctl_container.get("ports") or []}
    # The webhook: the Service in front of its replicas is the one they name in their configuration,
    # on the port they listen on.
    service_ns, _, rest = hook.webhook_service.partition("/")
    service_name, _, service_port = rest.partition(":")
    service = find(docs, "Service", service_name)
    assert service_ns == hook.namespace == ctl.namespace == "gpu-system"
    assert service["spec"]["ports"] == [{"name": "webhook", "port": int(service_port), "targetPort": "webhook",
                                         "protocol": "TCP"}]
    ports = {p["name"]: p["containerPort"] for p in hook_container["ports"]}
    assert ports["webhook"] == int(hook.webhook.rpartition(":")[2])
    hook_labels = workload(docs, "Deployment", "webhook")["spec"]["template"]["metadata"]["labels"]
    ctl_labels = workload(docs, "Deployment", "controller")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= hook_labels.items()
    assert not service["spec"]["selector"].items() <= ctl_labels.items()
    assert workload(docs, "Deployment", "webhook")["metadata"]["name"] == service_name  # <fullname>-webhook
    # The shim: installed by the agents' init container.
    assert container(docs, "DaemonSet", "install-shim", init=True)["volumeMounts"] == [
        {"name": "shim", "mountPath": "/host-shim"}]
    # The slices' ledger directories: the agent makes them where its kubelet plugin derives them from
    # --shim-host-dir, at the host's own path (the CDI specs name host paths).
    from mig_operator.kube.agent.kubelet.settings import PluginSettings

    ledgers = PluginSettings(shim_host_dir=agent.shim_host_dir).ledger_host_dir
    assert _volume(docs, "agent", "ledgers")["hostPath"] == {"path": ledgers, "type": "DirectoryOrCreate"}
    assert {"name": "ledgers", "mountPath": ledgers} in agent_container["volumeMounts"]
    # The slices' limit files and ld.so.preload, likewise.
    limits = PluginSettings(shim_host_dir=agent.shim_host_dir).limits_host_dir
    assert _volume(docs, "agent", "limits")["hostPath"] == {"path": limits, "type": "DirectoryOrCreate"}
    assert {"name": "limits", "mountPath": limits} in agent_container["volumeMounts"]
    mps = PluginSettings(shim_host_dir=agent.shim_host_dir).mps_host_dir
    assert _volume(docs, "agent", "mps")["hostPath"] == {"path": mps, "type": "DirectoryOrCreate"}
    assert {"name": "mps", "mountPath": mps} in agent_container["volumeMounts"]
    # The agent's node comes from the downward API; its record lives in the host state directory.
    assert agent.node == "node-a"
    assert next(e for e in agent_container["env"] if e["name"] == "NODE_NAME")["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}}
    state = _volume(docs, "agent", "state")["hostPath"]["path"]
    assert Path(agent.record_file).parent == Path(state)
    assert {"name": "state", "mountPath": state} in agent_container["volumeMounts"]
    if agent.idle_timeout:
        assert parse_duration(agent.idle_timeout) > 0
    # Logs and metrics as the values say, on a named port when on.
    for part, c in ((ctl, ctl_container), (hook, hook_container), (agent, agent_container)):
        assert part.log_format in ("json", "text") and part.log_level in ("debug", "info", "warning", "error")
        if part.metrics_address:
            assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == int(
                part.metrics_address.rpartition(":")[2])
    # The kubelet's probes: /healthz (liveness) and /readyz (readiness) on the port each part serves them on.
    for part, c in ((ctl, ctl_container), (hook, hook_container), (agent, agent_container)):
        health_port = int(part.health_address.rpartition(":")[2])
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == health_port
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert health_port != (int(part.metrics_address.rpartition(":")[2]) if part.metrics_address else None)
    assert int(hook.health_address.rpartition(":")[2]) != int(hook.webhook.rpartition(":")[2])
    if name == "default":
        assert ctl.health_address == hook.health_address == agent.health_address == ":8081"
        assert (ctl.log_format, ctl.log_level, agent.backend) == ("json", "info", "nvml")
        assert ctl.metrics_address == hook.metrics_address == agent.metrics_address == f":{values['metrics']['port']}"
        assert agent.idle_timeout is None and agent.nvml_attempts == 5
        assert workload(docs, "Deployment", "controller")["spec"]["replicas"] == 2
        assert workload(docs, "Deployment", "webhook")["spec"]["replicas"] == values["webhook"]["replicas"] == 2
    if name == "everything else changed":
        assert (ctl.log_format, ctl.log_level, agent.idle_timeout, agent.nvml_attempts) == ("text", "debug", "10m", 9)
        assert ctl.metrics_address is None and hook.metrics_address is None and agent.metrics_address is None
        assert ctl.health_address == hook.health_address == agent.health_address == ":18081"
        assert workload(docs, "Deployment", "webhook")["spec"]["replicas"] == 3
        assert agent.state_file == "/opt/cdmo/state/simulated-gpus.json"
        assert ctl_container["image"] == f"registry.example/mig-operator@{SHA}"


# ---- least privilege ----------------------------------------------------------------------------------

Rule = tuple[str, str, str, str]  # (API group, resource, verb, resource name or "")


def _grants(role: dict[str, Any]) -> set[Rule]:
    """Each grant of ``role``; a non-resource URL as ("", URL, verb, "")."""
    out = set()
    for rule in role["rules"]:
        for url in rule.get("nonResourceURLs") or []:
            out |= {("", url, verb, "") for verb in rule["verbs"]}
        for group in rule.get("apiGroups") or []:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        out.add((group, resource, verb, name))
    return out


def _table(rows: dict[tuple[str, str], str], names: dict[tuple[str, str], str] | None = None) -> set[Rule]:
    return {(g, r, v, (names or {}).get((g, r, v), "")) for (g, r), verbs in rows.items() for v in verbs.split()}


# Every part serving /metrics checks its callers (kube/common/metrics_auth.py): the caller's token, then
# whether that user may get /metrics.
METRICS_REVIEW_RULES = {
    ("authentication.k8s.io", "tokenreviews"): "create",
    ("authorization.k8s.io", "subjectaccessreviews"): "create",
}
# What each part's code calls (mig_operator/kube/), plus what kopf needs: CRD list/watch for its
# resource observer. docs/operations.md holds the same table; tests/e2e runs every part under it.
CONTROLLER_RULES = {
    ("cdmo.io", "gpuslices"): "get list watch create patch delete",
    ("cdmo.io", "gpuslices/status"): "patch",
    ("cdmo.io", "gpunodes"): "list watch",
    ("cdmo.io", "gpuquotas"): "list watch",
    ("cdmo.io", "gpuquotas/status"): "patch",
    ("", "nodes"): "list watch",
    ("", "pods"): "get list watch patch",
    ("", "pods/eviction"): "create",  # a pod idle past its GpuQuota's idlePodTimeout (idle_pods.py)
    ("resource.k8s.io", "resourceclaims"): "get create delete",
    ("resource.k8s.io", "resourceclaims/status"): "patch",  # the claim's allocation (claims.py)
    ("resource.k8s.io", "resourceclaims/binding"): "patch",  # the same write, authorized again on 1.36+
    ("", "events"): "create",
    ("kopf.dev", "clusterkopfpeerings"): "list watch create patch",
    **METRICS_REVIEW_RULES,
}
CONTROLLER_WEBHOOK_RULES = {("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): "create patch"}
AGENT_RULES = {
    ("cdmo.io", "gpuslices"): "get list watch patch",
    ("cdmo.io", "gpuslices/status"): "patch",
    ("cdmo.io", "gpunodes"): "create",
    ("cdmo.io", "gpunodes/status"): "patch",
    ("", "nodes"): "get list watch",  # its own Node's label, watched by a metadata.name field selector
    ("resource.k8s.io", "resourceslices"): "list create update delete",  # its node's devices (DRA)
    ("resource.k8s.io", "resourceclaims"): "get",  # a claim's allocation, at NodePrepareResources
    ("", "events"): "create",
    **METRICS_REVIEW_RULES,
}


def test_each_part_gets_exactly_the_verbs_its_code_uses(render: Any) -> None:
    docs = render(release="mo", namespace="gpu-system")
    mwc = ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch")
    assert _grants(find(docs, "ClusterRole", "mo-mig-operator-controller")) == (
        _table(CONTROLLER_RULES) | _table(CONTROLLER_WEBHOOK_RULES, {mwc: WEBHOOK_NAME}))
    assert _grants(find(docs, "ClusterRole", "mo-mig-operator-agent")) == _table(AGENT_RULES)
    secrets = find(docs, "Role")
    assert secrets["metadata"]["namespace"] == "gpu-system"
    assert _grants(secrets) == {("", "secrets", "create", ""), ("", "secrets", "get", "mo-mig-operator-webhook-cert")}
    controller, agent = "mo-mig-operator-controller", "mo-mig-operator-agent"
    for kind, binding_name, account in (("RoleBinding", secrets["metadata"]["name"], controller),
                                        ("ClusterRoleBinding", controller, controller),
                                        ("ClusterRoleBinding", agent, agent)):
        binding = find(docs, kind, binding_name)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "gpu-system"}]
        assert binding["roleRef"]["name"] == binding_name
    daemonset = workload(docs, "DaemonSet", "agent")
    for part in ("controller", "webhook"):  # the webhook writes its certificate and CA as the controller's account
        deployment = workload(docs, "Deployment", part)
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mo-mig-operator-controller"
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "mo-mig-operator-agent"


def test_with_cert_manager_the_controller_gets_no_secrets_and_no_webhook_configurations(render: Any) -> None:
    docs = render("--set", "webhook.certManager.enabled=true", release="mo")
    assert _grants(find(docs, "ClusterRole", "mo-mig-operator-controller")) == _table(CONTROLLER_RULES)
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_metrics_reader_may_get_metrics_only_and_the_parts_may_check_their_callers(render: Any,
                                                                                     enabled: bool) -> None:
    """The chart's reader role is what a scraper is bound to (nothing binds it: the admin does); the parts
    ask TokenReviews and SubjectAccessReviews only when they serve /metrics."""
    docs = render("--set", f"metrics.enabled={str(enabled).lower()}", release="mo")
    reviews = _table(METRICS_REVIEW_RULES)
    for part in ("controller", "agent"):
        grants = _grants(find(docs, "ClusterRole", f"mo-mig-operator-{part}"))
        assert grants & reviews == (reviews if enabled else set()), part
    reader = "mo-mig-operator-metrics-reader"
    readers = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == reader]
    assert len(readers) == (1 if enabled else 0)
    if enabled:
        assert _grants(readers[0]) == {("", "/metrics", "get", "")}
        assert not [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                    and d["roleRef"]["name"] == reader]


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", ["default", "everything else changed"])
def test_network_policies_open_the_probe_and_metrics_ports_to_monitoring_only_and_the_webhook_to_all(
        render: Any, name: str) -> None:
    docs = render(*VARIANTS[name], "--set", "networkPolicy.monitoringNamespace=prom", release="mo")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    for policy in policies:  # each selects the pods of one workload, no other's
        assert sum(_selects(policy, pod["metadata"]["labels"]) for pod in pods) == 1, policy["metadata"]["name"]
    for kind, part in (("Deployment", "controller"), ("Deployment", "webhook"), ("DaemonSet", "agent")):
        pod = workload(docs, kind, part)["spec"]["template"]
        listening = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []}
        [policy] = [p for p in policies if _selects(p, pod["metadata"]["labels"])]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        monitoring: set[int] = set()
        anywhere: set[int] = set()
        for rule in policy["spec"]["ingress"]:
            assert {p["protocol"] for p in rule["ports"]} == {"TCP"}
            if "from" in rule:
                assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}}]
                monitoring |= {p["port"] for p in rule["ports"]}
            else:
                anywhere |= {p["port"] for p in rule["ports"]}
        # The webhook's port from anywhere (the API server's address is not known); every other port the
        # part listens on (health, and metrics when on) from the monitoring namespace only.
        assert anywhere == {port for port_name, port in listening.items() if port_name == "webhook"}, part
        assert monitoring == {port for port_name, port in listening.items() if port_name != "webhook"}, part
        assert "health" in listening and ("metrics" in listening) == (name == "default")
    assert not [d for d in render("--set", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


ALLOWED_DELETES_AND_UPDATES = {
    ("controller", "cdmo.io", "gpuslices", "delete"),
    ("controller", "resource.k8s.io", "resourceclaims", "delete"),
    ("agent", "resource.k8s.io", "resourceslices", "update"),
    ("agent", "resource.k8s.io", "resourceslices", "delete"),
}


def test_no_rule_uses_a_wildcard_or_reaches_secrets_cluster_wide(render: Any, variant: list[str]) -> None:
    for role in (d for d in render(*variant) if d["kind"] in ("ClusterRole", "Role")):
        for group, resource, verb, _ in _grants(role):
            assert "*" not in (group, resource, verb), role["metadata"]["name"]
            # The deletes and updates the code makes: the controller releases a finished pod's GpuSlice
            # (kube/controller/pods.py) and deletes a claim an earlier slice of the same name left
            # (claims.py, narrowed by its write policy); the agent keeps its node's ResourceSlice.
            # Users (the roles aggregated into edit and admin) create, change and delete their GpuSlices.
            user = role["metadata"]["labels"]["app.kubernetes.io/component"] == "user"
            part = role["metadata"]["name"].rpartition("-")[2]
            if user and (group, resource) == ("cdmo.io", "gpuslices"):
                assert verb not in ("escalate", "bind", "impersonate")
            elif (part, group, resource, verb) not in ALLOWED_DELETES_AND_UPDATES:
                assert verb not in ("delete", "deletecollection", "update", "escalate", "bind", "impersonate")
            assert resource != "secrets" or role["kind"] == "Role", role["metadata"]["name"]


def test_the_operations_guide_lists_the_same_verbs() -> None:
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    rows = set()
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("controller", "agent"):  # part, group, resource, verbs, why
            group = "" if cells[1] in ("core", '""') else cells[1]
            rows.add((cells[0], group, cells[2], " ".join(v.strip() for v in cells[3].split(","))))
    expected = {("controller", g, r, v) for (g, r), v in {**CONTROLLER_RULES, **CONTROLLER_WEBHOOK_RULES}.items()}
    expected |= {("agent", g, r, v) for (g, r), v in AGENT_RULES.items()}
    expected |= {("controller", "", "secrets", "create get")}
    assert rows == expected


# ---- pod privileges ------------------------------------------------------------------------------


def test_the_controller_runs_unprivileged_and_the_agent_privileged_in_no_host_namespace(
        render: Any, variant: list[str]) -> None:
    """The agent is privileged (as NVIDIA's DRA kubelet plugin): the toolkit gives it its GPUs even with
    accept-nvidia-visible-devices-envvar-when-unprivileged = false, the setting nodes need (issue 24)."""
    docs = render(*variant)
    for part in ("controller", "webhook"):
        ctl_pod = workload(docs, "Deployment", part)["spec"]["template"]["spec"]
        ctl = container(docs, "Deployment", part)
        assert ctl_pod["securityContext"]["runAsNonRoot"] is True and ctl_pod["securityContext"]["runAsUser"] != 0
        assert ctl["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                          "capabilities": {"drop": ["ALL"]}}
        assert not [v for v in ctl_pod.get("volumes") or [] if "hostPath" in v]

    agent_pod = workload(docs, "DaemonSet", "agent")["spec"]["template"]["spec"]
    agent = container(docs, "DaemonSet", "agent")
    for key in ("hostPID", "hostIPC", "hostNetwork", "shareProcessNamespace"):
        assert key not in agent_pod
    assert agent["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsNonRoot": False,
                                        "readOnlyRootFilesystem": True}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert {k: env[k] for k in env if k.startswith("NVIDIA_")} == {
        "NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}
    assert "resources" not in agent or "nvidia.com/gpu" not in str(agent["resources"])
    init = container(docs, "DaemonSet", "install-shim", init=True)
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    host_paths = sorted(v["hostPath"]["path"] for v in agent_pod["volumes"] if "hostPath" in v)
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    if not variant:
        kubelet = values["agent"]["kubeletDir"]
        assert host_paths == sorted([values["agent"]["stateDir"], values["shim"]["hostDir"],
                                     "/var/lib/mig-operator/ledgers",  # the slices' ledgers, beside the shim's
                                     "/var/lib/mig-operator/limits",  # their limit files and ld.so.preload
                                     "/var/lib/mig-operator/mps",  # the GPUs' MPS daemon directories
                                     f"{kubelet}/plugins_registry", f"{kubelet}/plugins/gpu.cdmo.io",
                                     values["agent"]["cdiDir"], "/etc/cdi", "/etc/nvidia-container-runtime"])
        assert agent_pod["runtimeClassName"] == "nvidia"
        assert agent_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert len(host_paths) == 10
    # The agent serves the kubelet where the kubelet looks (its flags), and writes CDI specs where it mounts them.
    args = _args(agent)
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in agent["volumeMounts"]}
    for directory in (args.kubelet_registry_dir, args.kubelet_plugin_dir, args.cdi_dir):
        assert directory in host_paths and mounts[directory] is False
    assert mounts["/etc/cdi"] is True
    # The toolkit's configuration, read-only, where the flag reads it (RuntimeTrusted).
    toolkit_dir = args.toolkit_config.rsplit("/", 1)[0]
    assert toolkit_dir in host_paths and mounts[toolkit_dir] is True
    assert args.shim_host_dir == _volume(docs, "agent", "shim")["hostPath"]["path"]


@pytest.mark.parametrize("name", ["default", "everything else changed"])
def test_the_mps_host_runs_the_daemons_where_the_agent_looks_for_them_and_outlives_an_upgrade(
        render: Any, name: str) -> None:
    """The MPS host pod (mig-operator mps-host) shares the agent's MPS directory (as the agent derives it
    from its flags), runs on the agent's nodes and is not replaced by an upgrade (OnDelete)."""
    from mig_operator.kube.agent.kubelet.settings import PluginSettings

    docs = render(*VARIANTS[name], namespace="gpu-system")
    agent_set, host_set = workload(docs, "DaemonSet", "agent"), workload(docs, "DaemonSet", "mps-host")
    agent, host = _args(container(docs, "DaemonSet", "agent")), _args(container(docs, "DaemonSet", "mps-host"))
    assert (agent.command, host.command) == ("agent", "mps-host")
    assert host.backend == agent.backend
    expected = (f"{agent.state_file}.mps" if agent.backend.startswith("sim:")
                else PluginSettings(shim_host_dir=agent.shim_host_dir).mps_host_dir)
    assert host.mps_dir == expected
    assert _volume(docs, "mps-host", "mps")["hostPath"] == {"path": expected, "type": "DirectoryOrCreate"}
    assert {"name": "mps", "mountPath": expected} in container(docs, "DaemonSet", "mps-host")["volumeMounts"]
    assert host_set["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert agent_set["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert host_set["metadata"]["name"] == agent_set["metadata"]["name"].removesuffix("-agent") + "-mps"
    agent_pod, host_pod = agent_set["spec"]["template"]["spec"], host_set["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "runtimeClassName", "priorityClassName"):
        assert agent_pod.get(key) == host_pod.get(key), key
    for key in ("hostPID", "hostIPC", "hostNetwork", "shareProcessNamespace"):
        assert key not in host_pod
    assert host_pod["automountServiceAccountToken"] is False  # it talks to no API server
    assert [v["name"] for v in host_pod["volumes"] if "hostPath" in v] == ["mps"]
    host_env = {e["name"]: e["value"] for e in container(docs, "DaemonSet", "mps-host")["env"]}
    agent_env = {e["name"]: e.get("value") for e in container(docs, "DaemonSet", "agent")["env"]}
    assert host_env == {k: v for k, v in agent_env.items() if k.startswith("NVIDIA_")}
    selector = host_set["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= agent_set["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(("agent_class", "controller_class", "quota"), [
    ("system-node-critical", "", ["system-node-critical"]),  # the default
    ("system-node-critical", "system-cluster-critical", ["system-node-critical", "system-cluster-critical"]),
    ("system-cluster-critical", "system-cluster-critical", ["system-cluster-critical"]),
    ("gpu-agents", "", None),  # the admin's own class: no quota needed
    ("", "", None),
])
def test_a_critical_priority_class_comes_with_the_quota_that_admits_it(
        render: Any, agent_class: str, controller_class: str, quota: list[str] | None) -> None:
    """Clusters that limit the built-in critical classes to namespaces with a ResourceQuota naming them
    (GKE) refuse the agents otherwise; the quota's scope must cover every pod of the chart that uses one."""
    docs = render("--set", f"agent.priorityClassName={agent_class}",
                  "--set", f"controller.priorityClassName={controller_class}", namespace="gpu-system")
    quotas = [d for d in docs if d["kind"] == "ResourceQuota"]
    if quota is None:
        assert not quotas
        return
    [found] = quotas
    assert found["metadata"]["namespace"] == "gpu-system"
    [scope] = found["spec"]["scopeSelector"]["matchExpressions"]
    assert (scope["scopeName"], scope["operator"], scope["values"]) == ("PriorityClass", "In", quota)
    assert int(float(found["spec"]["hard"]["pods"].rstrip("G")) * 1e9) >= 10**6  # limits nothing in practice
    for kind, part in (("Deployment", "controller"), ("Deployment", "webhook"), ("DaemonSet", "agent"),
                       ("DaemonSet", "mps-host")):
        pod = workload(docs, kind, part)["spec"]["template"]["spec"]
        if pod.get("priorityClassName", "").startswith("system-"):
            assert pod["priorityClassName"] in scope["values"], kind


# ---- values.yaml -------------------------------------------------------------------------------------

# Maps whose entries are data, documented by the comment on the map itself.
FREE_FORM = {"resources", "requests", "limits", "nodeSelector", "nvidiaEnv", "labels", "annotations", "podAnnotations",
             "affinity", "issuerRef", "tolerations"}


def test_every_value_has_a_comment() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    missing = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parents = [k for _, k in stack]
        stack.append((indent, key))
        if set(parents) & FREE_FORM:
            continue
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not previous.strip().startswith("#"):
            missing.append(".".join([*parents, key]))
    assert not missing, f"values without a comment right above them: {missing}"


def _leaves(values: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every value an admin can set: scalars, and free-form maps and lists as a whole."""
    out = []
    for key, value in values.items():
        path = (*prefix, key)
        if isinstance(value, dict) and value and key not in FREE_FORM:
            out.extend(_leaves(value, path))
        else:
            out.append((path, value))
    return out


def _changed(value: Any) -> Any:
    """Another value of the same shape."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-probe" if value else "probe"
    if isinstance(value, list):
        return [*value, {"key": "probe", "name": "probe"}]
    return {**value, "probe": "probe"}


# Values whose every other value is refused by the chart are changed to one it takes.
VALID_CHANGES: dict[tuple[str, ...], Any] = {("compat",): ["clearml"], ("fractions", "defaultCompute"): "proportional",
                                             ("autoscaling", "backend"): "placeholder"}

# A value that only matters in another mode is changed on top of that mode.
MODES = {("webhook", "certManager"): {"webhook": {"certManager": {"enabled": True}}},
         ("metrics", "serviceMonitor"): {"metrics": {"serviceMonitor": {"enabled": True}}},
         ("grafana", "dashboard"): {"grafana": {"dashboard": {"enabled": True}}},
         ("autoscaling",): {"autoscaling": {"enabled": True, "pools": [{
             "name": "h200", "nodeLabels": {"karpenter.sh/nodepool": "gpu-h200"}, "gpuModel": "h200-141gb",
             "cpu": "16", "memory": "64Gi"}]}}}


def test_every_value_is_used_by_the_templates(render: Any, tmp_path: Path) -> None:
    """Changing any one value changes what the chart renders: values.yaml documents nothing that does
    nothing (and a template that stopped reading a value fails here)."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    leaves = _leaves(values)
    assert len(leaves) > 40 and (("agent", "idleTimeout"), "") in leaves

    def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        out: dict[str, Any] = value
        for key in reversed(path):
            out = {key: out}
        return out

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) and k not in FREE_FORM
                        else v for k, v in b.items()}}

    def rendered(overrides: dict[str, Any]) -> str:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(overrides))
        return yaml.safe_dump_all(render("--include-crds", "--values", str(path)))

    unused = []
    baselines: dict[tuple[tuple[str, ...], bool], str] = {}
    for path, value in leaves:
        mode = next((m for m in MODES if path[:len(m)] == m), ())
        base = MODES.get(mode, {})
        switch = path == (*mode, "enabled")
        if switch:  # the mode's own switch: its other values as the mode needs them, the switch as by default
            base = merge(base, nested(path, value))
        if (mode, switch) not in baselines:
            baselines[(mode, switch)] = rendered(base)
        changed = VALID_CHANGES.get(path, _changed(value))
        if rendered(merge(base, nested(path, changed))) == baselines[(mode, switch)]:
            unused.append(".".join(path))
    assert not unused, f"values that change nothing the chart renders: {unused}"


# ---- who may write and read what (issue 19, items 2, 4, 5) ----------------------------------------------


def _policy(docs: list[dict[str, Any]], suffix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith(suffix)]
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["metadata"]["name"] == policy["metadata"]["name"]]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy, binding


@pytest.mark.parametrize("name", ["default", "everything else changed"])
def test_the_agent_node_policy_binds_the_releases_agent_to_its_node(render: Any, name: str) -> None:
    docs = render(*VARIANTS[name], release="mo", namespace="gpu-system")
    policy, _ = _policy(docs, "-agent-node.cdmo.io")
    account = find(docs, "ServiceAccount",
                   workload(docs, "DaemonSet", "agent")["spec"]["template"]["spec"]["serviceAccountName"])
    [condition] = policy["spec"]["matchConditions"]
    assert condition["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:gpu-system:{account["metadata"]["name"]}"')
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    # Every object the agents' ClusterRole lets them write, the status subresources included.
    agent_role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-agent"))
    # (A review, TokenReview or SubjectAccessReview, is an answer to a question: nothing is stored.)
    written = {(g, r) for g, r, v, _ in _grants(agent_role) if v in ("create", "patch", "update", "delete")
               and (g, r) != ("", "events") and (g, r) not in METRICS_REVIEW_RULES}
    covered = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               if {"CREATE", "UPDATE", "DELETE"} <= set(rule["operations"])}
    assert written <= covered, written - covered
    text = yaml.safe_dump(policy)
    assert "authentication.kubernetes.io/node-name" in text and "status.node" in text and "spec.nodeName" in text
    assert not [d for d in render("--set", "agentNodePolicy.enabled=false") if "agent-node" in d["metadata"]["name"]]


def test_the_controller_write_policy_names_the_releases_configuration_peering_and_claim_shape(
        render: Any) -> None:
    from mig_operator.core.books.slice_claim import device_selector
    from mig_operator.kube.common.names import DEVICE_CLASS, DRA_DRIVER

    docs = render(*VARIANTS["everything else changed"], release="mo", namespace="gpu-system")
    policy, _ = _policy(docs, "-controller-writes.cdmo.io")
    [condition] = policy["spec"]["matchConditions"]
    assert condition["expression"] == 'request.userInfo.username == "system:serviceaccount:gpu-system:ctl"'
    expressions = [v["expression"] for v in policy["spec"]["validations"]]
    assert any('request.name == "gpu-slices"' in e for e in expressions)  # webhook.configurationName
    assert any('request.name == "gpu-peers"' in e for e in expressions)  # controller.peering
    # The claim it may write is the one claims.py writes: the class and the selector, up to the slice's UID.
    [claims] = [e for e in expressions if "'resourceclaims'" in e and "variables.status" not in e]
    # The allocation it may write is the one core/books/slice_claim.py builds: the driver, the slice's device.
    [allocation] = [e for e in expressions if "'resourceclaims'" in e and "variables.status" in e
                    and "reservedFor" not in e]
    assert f"x.driver == '{DRA_DRIVER}'" in allocation and "x.device == r.uid" in allocation
    # Its reservations: one pod, in the allocating write (core/books/slice_claim.py's pod_consumer), then only fewer.
    [reservations] = [e for e in expressions if "'resourceclaims'" in e and "reservedFor" in e]
    assert "reservedFor.size() == 1" in reservations and "c.resource == 'pods'" in reservations
    assert f"q.exactly.deviceClassName == '{DEVICE_CLASS}'" in claims
    prefix, suffix = device_selector("UID").split("UID")
    assert f"== '{prefix}' + r.uid + '{suffix}'" in claims
    resources = {(r["apiGroups"][0], res) for r in policy["spec"]["matchConstraints"]["resourceRules"]
                 for res in r["resources"]}
    assert resources == {("", "pods"), ("resource.k8s.io", "resourceclaims"),
                         ("resource.k8s.io", "resourceclaims/status"),
                         ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"),
                         ("kopf.dev", "clusterkopfpeerings")}
    assert not [d for d in render("--set", "controllerWritePolicy.enabled=false") if "controller-writes" in
                d["metadata"]["name"] or "claim-allocation" in d["metadata"]["name"]]


def test_only_the_releases_controller_allocates_claims_of_the_class(render: Any) -> None:
    from mig_operator.core.books.slice_claim import DELETE_PROTECTION, DEVICE_CLASS

    docs = render(*VARIANTS["everything else changed"], release="mo", namespace="gpu-system")
    policy, _ = _policy(docs, "-claim-allocation.cdmo.io")
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    assert conditions["not-the-controller"] == 'request.userInfo.username != "system:serviceaccount:gpu-system:ctl"'
    assert f"deviceClassName == '{DEVICE_CLASS}'" in conditions["a-gpuslice-claim"]
    assert any(DELETE_PROTECTION in v["expression"] for v in policy["spec"]["validations"])
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert [(r["operations"], r["resources"]) for r in rules] == [
        (["UPDATE"], ["resourceclaims", "resourceclaims/status"])]


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


@pytest.mark.parametrize("gpunode_read", [False, True])
def test_users_get_gpuslices_through_view_edit_admin_and_gpunodes_only_when_asked(render: Any,
                                                                                  gpunode_read: bool) -> None:
    docs = render("--set", f"userRoles.gpuNodeRead={str(gpunode_read).lower()}", release="mo")
    user_roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"
                  and d["metadata"]["labels"]["app.kubernetes.io/component"] == "user"}
    by_target: dict[str, set[Rule]] = {"view": set(), "edit": set(), "admin": set()}
    for role in user_roles.values():
        for target in by_target:
            if role["metadata"]["labels"].get(AGGREGATE + target) == "true":
                by_target[target] |= _grants(role)
    read = {("cdmo.io", "gpuslices", v, "") for v in ("get", "list", "watch")}
    write = {("cdmo.io", "gpuslices", v, "") for v in ("create", "update", "patch", "delete")}
    assert read <= by_target["view"] and not write & by_target["view"]
    assert read | write <= by_target["edit"] and read | write <= by_target["admin"]
    quota_read = {("cdmo.io", r, v, "") for r in ("gpuquotas", "gpuquotas/status") for v in ("get", "list", "watch")}
    for target, grants in by_target.items():
        # Every user role reads GpuQuotas; none writes one (only cluster-admin does).
        assert {g for g in grants if g[1].startswith("gpuquotas")} == quota_read, target
        # Never the status (the operator's), never a GpuNode unless the value asks for it.
        assert not {g for g in grants if g[1] == "gpuslices/status" and g[2] != "get"
                    and g[2] not in ("list", "watch")}, target
        nodes = {g for g in grants if g[1].startswith("gpunodes")}
        assert bool(nodes) == gpunode_read, (target, nodes)
        if gpunode_read:
            assert {g[2] for g in nodes} == {"get", "list", "watch"}
    assert not [d for d in render("--set", "userRoles.enabled=false") if d["kind"] == "ClusterRole"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == "user"]


@pytest.mark.parametrize(("version", "installs"), [
    ("1.33.9", False),  # resource.k8s.io/v1 is served from 1.34
    ("1.34.0", True),
    ("1.37.2", True),
])
def test_the_chart_installs_only_where_dra_v1_is_served(helm: Any, version: str, installs: bool) -> None:
    result = helm("template", "mo", str(CHART_DIR), "--kube-version", version, check=False)
    assert (result.returncode == 0) == installs, result.stderr
    if not installs:
        assert "kubeVersion" in result.stderr and version in result.stderr, result.stderr
