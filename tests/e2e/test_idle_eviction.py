"""GpuQuota spec.idlePodTimeout end to end: an annotated pod whose slice has been idle (condition Active=False,
written here through the status subresource as the node's agent writes it) past its namespace's timeout is
evicted through the Eviction API, with IdleEvicted Events on the pod and the slice; a PodDisruptionBudget
keeps another from eviction, and an Event says why; a namespace whose GpuQuota has no idlePodTimeout keeps
its idle pod. The controller's per-namespace gauges show the idle slice and what the slices use."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
from harness import GROUP, SLICES, VERSION, OperatorHarness, unique, wait_until
from kubernetes.client.rest import ApiException
from test_metrics import free_port, settle, value
from test_pods import pod_body, running, slice_of

GIB = 2**30
QUOTAS = "gpuquotas"


def _quota(op: OperatorHarness, ns: str, timeout: str | None) -> None:
    spec: dict[str, Any] = {"memory": "80Gi"}
    if timeout is not None:
        spec["idlePodTimeout"] = timeout
    op.custom.create_namespaced_custom_object(GROUP, VERSION, ns, QUOTAS, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuQuota", "metadata": {"name": "quota"}, "spec": spec})


def _pod(op: OperatorHarness, ns: str, app: str) -> Any:
    body = pod_body({"cdmo.io/gpu-memory": "4G"}, name="work")
    body["metadata"]["labels"] = {"app": app}
    op.core.create_namespaced_pod(ns, body)
    return running(op, ns, "work")


def _idle(op: OperatorHarness, ns: str, name: str, since: datetime, used: int = 0) -> None:
    """Write the slice's usage and Active=False (NoProcess, idle since ``since``) as its agent would."""
    body = op.get_slice(ns, name)
    assert body is not None
    when = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [c for c in body["status"].get("conditions") or [] if c["type"] != "Active"]
    conditions.append({"type": "Active", "status": "False", "reason": "NoProcess", "lastTransitionTime": when,
                       "message": "no process for 1h (idle after 30m)"})
    usage = {"memoryUsed": used, "memoryPeak": used, "processes": 0, "refusals": 0, "lastActive": when,
             "observedAt": now}
    op.custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, name,
                                                    {"status": {"conditions": conditions, "usage": usage}})


def _events(op: OperatorHarness, ns: str, reason: str) -> list[Any]:
    return [e for e in op.core.list_namespaced_event(ns).items if e.reason == reason]


def _going(op: OperatorHarness, ns: str, name: str) -> bool:
    try:
        pod = op.core.read_namespaced_pod(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return pod.metadata.deletion_timestamp is not None


def test_idle_pods_are_evicted_by_quota_unless_a_budget_holds_them_or_no_timeout_is_set(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    port = free_port()
    # The agent writes no usage of its own here: the test writes what it would.
    operator.agent(node, None, "--usage-interval", "0")
    operator.wait_gpunode(node)
    operator.controller_with_webhook(None, "--metrics-address", f"127.0.0.1:{port}")
    operator.wait_webhook()
    evicted, held, kept = operator.namespace(), operator.namespace(), operator.namespace()
    for wrong in ("1h30m", "2", "soon"):  # the CRD takes the controller's grammar only
        try:
            _quota(operator, kept, wrong)
        except ApiException as exc:
            assert exc.status == 422 and "idlePodTimeout" in exc.body, exc.body
        else:
            raise AssertionError(f"idlePodTimeout {wrong!r} was accepted")
    _quota(operator, evicted, "2s")
    _quota(operator, held, "2s")
    _quota(operator, kept, None)
    app = unique("idle")
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep"},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}}}
    kubernetes.client.PolicyV1Api(operator.cluster.api_client).create_namespaced_pod_disruption_budget(held, budget)
    pods = {ns: _pod(operator, ns, app) for ns in (kept, held, evicted)}
    slices = {ns: slice_of(operator, pod) for ns, pod in pods.items()}
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    # The namespace without a timeout first: its slice's event reaches the controller before the others'.
    for ns in (kept, held, evicted):
        _idle(operator, ns, slices[ns]["metadata"]["name"], hour_ago, used=GIB if ns == kept else 0)

    # Evicted: the pod goes, and Events on the pod and on its slice say why.
    wait_until(lambda: _going(operator, evicted, "work"), 30,
               lambda: f"pod {evicted}/work evicted\n{operator.logs()}")
    told = wait_until(lambda: {(e.involved_object.kind, e.involved_object.name)
                               for e in _events(operator, evicted, "IdleEvicted")} or None, 20,
                      lambda: f"IdleEvicted Events in {evicted}\n{operator.logs()}")
    assert told == {("Pod", "work"), ("GpuSlice", slices[evicted]["metadata"]["name"])}
    [pod_event] = [e for e in _events(operator, evicted, "IdleEvicted") if e.involved_object.kind == "Pod"]
    assert pod_event.type == "Normal" and "idlePodTimeout (2s)" in pod_event.message
    assert pod_event.involved_object.uid == pods[evicted].metadata.uid

    # Held by its PodDisruptionBudget: not evicted, and an Event on the pod says why.
    [refusal] = wait_until(lambda: _events(operator, held, "IdleEvictionRefused"), 30,
                           lambda: f"IdleEvictionRefused Event in {held}\n{operator.logs()}")
    assert refusal.type == "Warning" and "disruption budget" in refusal.message
    assert not _going(operator, held, "work")
    assert not _events(operator, held, "IdleEvicted")

    # No idlePodTimeout: the controller saw the slice idle (its gauges say so) and evicted nothing.
    grant = slices[kept]["status"]["grantedBytes"]
    samples = settle(port, lambda s: value(s, "mig_operator_idle_slices", namespace=kept) == 1,
                     f"the idle slice of {kept} counted", operator)
    assert value(samples, "mig_operator_idle_memory_bytes", namespace=kept) == grant
    assert value(samples, "mig_operator_used_memory_bytes", namespace=kept) == GIB
    assert value(samples, "mig_operator_idle_slices", namespace=held) == 1
    assert not _going(operator, kept, "work")
    assert not _events(operator, kept, "IdleEvicted") and not _events(operator, kept, "IdleEvictionRefused")
