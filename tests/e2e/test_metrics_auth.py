"""/metrics only for those allowed, against the real kube-apiserver: the controller and an agent, running
as the chart's ServiceAccounts with the chart's RBAC, check each caller's token (TokenReview) and its
right to get /metrics (SubjectAccessReview). No token or a forged one: 401; a tenant's ServiceAccount
(the built-in ``edit`` role in its namespace): 403; a ServiceAccount bound to the chart's
metrics-reader ClusterRole: 200 with the metrics; a 12 MiB Authorization header: refused, and the part
keeps serving."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import yaml
from cluster import ChartIdentities, KubeCluster
from harness import OperatorHarness, unique, wait_until
from kubernetes.client.rest import ApiException
from test_metrics import free_port

RBAC = "rbac.authorization.k8s.io"


def get(port: int, token: str | None = None) -> tuple[int, str]:
    """The status and body /metrics on the port answers; 0 while nothing listens there yet."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        response = connection.getresponse()
        return response.status, response.read().decode()
    except ConnectionRefusedError:
        return 0, ""
    finally:
        connection.close()


def account_token(cluster: KubeCluster, namespace: str, name: str) -> str:
    """A new ServiceAccount's token from the TokenRequest API (what a projected token volume holds)."""
    core = cluster.core_v1()
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    answer = core.create_namespaced_service_account_token(name, namespace, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
    return answer.status.token


def may_get_metrics(cluster: KubeCluster, user: str) -> bool:
    """What the API server's authorizer says now (RBAC sees a new binding a moment after it is made)."""
    review = kubernetes.client.AuthorizationV1Api(cluster.api_client).create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "nonResourceAttributes": {"path": "/metrics", "verb": "get"}}})
    return bool(review.status.allowed)


@pytest.fixture
def tokens(operator: OperatorHarness, chart_identities: ChartIdentities) -> Iterator[dict[str, str]]:
    """A reader's and a tenant's token, each of a ServiceAccount of its own namespace."""
    cluster = operator.cluster
    [reader_role] = [doc["metadata"]["name"] for doc in yaml.safe_load_all(chart_identities.rendered)
                     if doc and doc["kind"] == "ClusterRole" and doc["metadata"]["name"].endswith("-metrics-reader")]
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client)
    monitoring, tenant_ns = operator.namespace(), operator.namespace()
    reader, tenant = account_token(cluster, monitoring, "prometheus"), account_token(cluster, tenant_ns, "tenant")
    binding = unique("metrics-reader")
    rbac.create_cluster_role_binding({
        "metadata": {"name": binding},
        "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": monitoring}],
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": reader_role}})
    rbac.create_namespaced_role_binding(tenant_ns, {
        "metadata": {"name": "tenant-edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": tenant_ns}],
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "edit"}})
    reader_user = f"system:serviceaccount:{monitoring}:prometheus"
    wait_until(lambda: may_get_metrics(cluster, reader_user), 30, f"RBAC to let {reader_user} get /metrics")
    assert not may_get_metrics(cluster, f"system:serviceaccount:{tenant_ns}:tenant")
    try:
        yield {"reader": reader, "tenant": tenant}
    finally:
        try:
            rbac.delete_cluster_role_binding(binding)
        except ApiException as exc:
            if exc.status != 404:
                raise


def hostile(port: int, header: bytes) -> bytes:
    """Send a request carrying ``header``; the first bytes of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
        return sock.recv(4096)


def test_metrics_answer_the_reader_refuse_a_tenant_and_a_caller_without_a_token(
        operator: OperatorHarness, tokens: dict[str, str]) -> None:
    node = operator.add_node("h100-80gb")
    ports = {"controller": free_port(), "agent": free_port()}
    procs: dict[str, Any] = {
        "agent": operator.agent(node, None, "--metrics-address", f"127.0.0.1:{ports['agent']}"),
        "controller": operator.controller(None, "--metrics-address", f"127.0.0.1:{ports['controller']}"),
    }
    for part, port in ports.items():
        wait_until(lambda port=port: get(port)[0], 30, lambda part=part: f"the {part}'s /metrics\n{operator.logs()}")

    for part, port in ports.items():
        status, body = get(port)
        assert status == 401 and "mig_operator_" not in body, (part, status, body)
        assert get(port, "forged.token.value")[0] == 401, part
        status, body = get(port, tokens["tenant"])
        assert status == 403 and "mig_operator_" not in body, (part, status, body)
        assert ":tenant" in body, body  # the refusal names the user the API server saw
        status, body = get(port, tokens["reader"])
        assert status == 200 and "# TYPE mig_operator_workqueue_depth gauge" in body, (part, status, body[:300])

    # A header of hostile size: refused before any review (431, the line is over what a header may hold),
    # and the part keeps serving.
    port = ports["controller"]
    answer = hostile(port, b"Authorization: Bearer " + b"A" * (12 << 20))
    assert answer.split(b" ")[1:2] in ([b"431"], [b"401"]), answer[:200]
    odd = hostile(port, b"Authorization: Bearer \xff\xfe\x01" + b"A" * 100)
    assert odd.split(b" ")[1:2] == [b"401"], odd[:200]
    assert procs["controller"].alive, procs["controller"].tail()
    assert get(port, tokens["reader"])[0] == 200
