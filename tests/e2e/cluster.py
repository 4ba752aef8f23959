"""The session's control plane and the chart's identities in it, as the e2e tests see them.

conftest.py's fixtures make them (``kube_cluster``, ``chart_identities``); test modules import the
types and names from here, never from conftest: every test folder has a conftest.py, so a module
of that name is whichever folder's was loaded last.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
# The namespace OperatorHarness.controller_with_webhook passes as --namespace, and the release name.
CHART_NAMESPACE = "mig-operator-system"
CHART_RELEASE = "e2e"


@dataclass
class KubeCluster:
    """A running control plane, as the tests see it."""

    kubeconfig: Path
    bin_dir: Path
    k8s_version: str
    running: frozenset[str]  # names of the running processes, e.g. "kwok", "kube-scheduler"
    _api_client: kubernetes.client.ApiClient | None = field(default=None, repr=False)

    @property
    def api_client(self) -> kubernetes.client.ApiClient:
        """A `kubernetes` client bound to this cluster (not to ~/.kube/config)."""
        if self._api_client is None:
            self._api_client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    @property
    def minor(self) -> int:
        """The plane's Kubernetes minor version: 37 for v1.37.2."""
        return int(self.k8s_version.split(".")[1])

    def core_v1(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api_client)

    def custom_objects(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api_client)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run the cached kubectl against this cluster; with check, a failure shows its stderr."""
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result


@dataclass(frozen=True)
class ChartIdentities:
    """The chart's ServiceAccounts in the session's cluster, and a kubeconfig per part that
    authenticates as each (a TokenRequest token)."""

    namespace: str
    service_accounts: dict[str, str]  # part ("controller", "agent") -> ServiceAccount name
    kubeconfigs: dict[str, Path]  # part -> kubeconfig file
    webhook_config: str  # the MutatingWebhookConfiguration the controller's RBAC may patch
    webhook_cert_secret: str  # the one Secret (in ``namespace``) the controller's RBAC may read
    rendered: str  # the applied manifests (helm template of IDENTITY_TEMPLATES)

    def user(self, part: str) -> str:
        """The user name the API server sees for ``part`` (for ``kubectl --as`` and SubjectAccessReview)."""
        return f"system:serviceaccount:{self.namespace}:{self.service_accounts[part]}"


def render_chart(cluster: KubeCluster, release: str, namespace: str, *args: str) -> str:
    """``helm template`` of the chart (the cached helm binary), failing with helm's stderr."""
    result = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", release, str(CHART_DIR), "--namespace", namespace, *args],
        capture_output=True, text=True, timeout=120,
    )
    if result.returncode != 0:
        raise AssertionError(f"helm template exited {result.returncode}:\n{result.stderr}")
    return result.stdout


CHART_WEBHOOK_CONFIG = "e2e-mig-operator"
# The chart's templates that hold the identities; nothing else of the chart is applied here.
IDENTITY_TEMPLATES = ("templates/serviceaccounts.yaml", "templates/rbac.yaml")
TOKEN_SECONDS = 12 * 3600


def token_kubeconfig(cluster: KubeCluster, token: str, path: Path) -> Path:
    """A kubeconfig for the cluster's API server (its address and CA from the admin's) with ``token``."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    config = {
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"], "user": "sa"}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def apply_chart_identities(cluster: KubeCluster, directory: Path, *helm_args: str) -> ChartIdentities:
    """The chart's ServiceAccounts and RBAC (``helm template`` of its identity templates with
    ``helm_args``, applied with kubectl into CHART_NAMESPACE), and a kubeconfig per part in ``directory``
    holding a token of its ServiceAccount made through the TokenRequest API."""
    rendered = render_chart(
        cluster, CHART_RELEASE, CHART_NAMESPACE, "--set", f"webhook.configurationName={CHART_WEBHOOK_CONFIG}",
        *helm_args, *(arg for template in IDENTITY_TEMPLATES for arg in ("--show-only", template)),
    )
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CHART_NAMESPACE}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(namespace))
    cluster.kubectl("apply", "-f", "-", input=rendered)
    accounts = {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["metadata"]["name"]
        for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "ServiceAccount"
    }
    assert set(accounts) == {"controller", "agent"}, f"the chart's ServiceAccounts: {accounts}"
    kubeconfigs = {}
    for part, account in accounts.items():
        answer = cluster.core_v1().create_namespaced_service_account_token(account, CHART_NAMESPACE, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        })
        kubeconfigs[part] = token_kubeconfig(cluster, answer.status.token, directory / f"{part}.kubeconfig")
    secret_rules = [rule for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "Role"
                    for rule in doc["rules"] if rule["resources"] == ["secrets"] and rule.get("resourceNames")]
    assert len(secret_rules) == 1 and len(secret_rules[0]["resourceNames"]) == 1, secret_rules
    return ChartIdentities(CHART_NAMESPACE, accounts, kubeconfigs, CHART_WEBHOOK_CONFIG,
                           secret_rules[0]["resourceNames"][0], rendered)
