"""Playing the tenant: a user holding only the built-in ``edit`` ClusterRole in its namespace (a
RoleBinding), reached by impersonation from the session's admin kubeconfig, so every write the tests
try goes through the API server's RBAC and admission as that user's would.

The chart's user roles (templates/user-roles.yaml: GpuSlices for edit, GpuQuotas read-only for view,
edit and admin) are aggregated into the built-in roles by kube-controller-manager; ``user_roles``
applies them (idempotent, left in place: the built-in roles only gain the chart's rules)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes
from harness import wait_until
from kubernetes.client.rest import ApiException

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
GROUP, VERSION = "cdmo.io", "v1alpha1"
KubeCluster = Any


def impersonating(cluster: KubeCluster, user: str) -> kubernetes.client.ApiClient:
    """An API client that acts as ``user`` (plus system:authenticated), nothing more."""
    client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    client.set_default_header("Impersonate-User", user)
    return client


def grant(cluster: KubeCluster, namespace: str, user: str, role: str = "edit") -> None:
    """A RoleBinding of the built-in ClusterRole ``role`` to ``user`` in ``namespace``."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client)
    try:
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": f"{user.replace('@', '-').replace(':', '-')}-{role}"},
            "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def user_roles(cluster: KubeCluster) -> str:
    """Apply the chart's user roles; returns them as rendered."""
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", "user-roles", str(CHART_DIR), "--show-only",
         "templates/user-roles.yaml"], capture_output=True, text=True, timeout=120, check=True).stdout
    cluster.kubectl("apply", "-f", "-", input=rendered)
    return rendered


def edit_tenant(cluster: KubeCluster, namespace: str, user: str = "tenant") -> kubernetes.client.ApiClient:
    """``user`` with ``edit`` in ``namespace`` and the chart's roles aggregated, as an API client; it
    returns once the user may create GpuSlices there (tried with a dry run, the way a user would)."""
    user_roles(cluster)
    grant(cluster, namespace, user)
    client = impersonating(cluster, user)
    custom = kubernetes.client.CustomObjectsApi(client)
    probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "probe"},
             "spec": {"memory": "1Gi"}}

    def may_create() -> bool:
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "gpuslices", probe, dry_run="All")
        except ApiException as exc:
            if exc.status == 403:
                return False
            raise
        return True

    wait_until(may_create, 30, f"{user} to be allowed GpuSlices in {namespace} (edit, with the chart's roles)")
    return client


def forbidden(call: Any) -> str:
    """``call()`` is refused by RBAC (403 Forbidden naming the user); the message."""
    try:
        call()
    except ApiException as exc:
        assert exc.status == 403, exc.body
        assert "is forbidden: User" in str(exc.body), exc.body
        return str(exc.body)
    raise AssertionError("the write was allowed")
