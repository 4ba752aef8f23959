"""A cluster upgraded in place: slices, claims and pods made on the oldest supported release keep
working after kube-apiserver, kube-scheduler and kube-controller-manager are replaced by the current
release's on the same etcd with the same flags (scripts/control-plane upgrade), as an admin upgrades
a cluster.

From 1.36 kube-scheduler stamps ``allocationTimestamp`` onto an allocation that has none when it
reserves a claim for a pod, and the API server refuses that as a change of the allocation; 1.34 drops
the field. So a claim the controller allocated on 1.34 is allocated again, stamped, once the API server
keeps the field (core/books/slice_claim.py's ``restamp``), and a pod naming it then runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import CHART_NAMESPACE
from harness import OperatorHarness, apply_crds, wait_until
from kubernetes.client.rest import ApiException
from test_claim_pinning import _notebook_pod
from test_pods import create_pod, running

# Its tests share a module-scoped fixture: one pytest-xdist worker runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_cluster_upgrade")

DRA = ("resource.k8s.io", "v1")


@pytest.fixture
def upgrade_operator(upgradable_plane: Any, tmp_path: Path) -> Iterator[OperatorHarness]:
    """An OperatorHarness on the private plane (the admin's credentials; the chart's RBAC is proved on
    the session's plane)."""
    cluster = upgradable_plane.cluster
    apply_crds(cluster)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CHART_NAMESPACE}}))
    harness = OperatorHarness(cluster, tmp_path)
    yield harness
    harness.close()


def _claim(op: OperatorHarness, ns: str, name: str) -> dict:
    return op.custom.get_namespaced_custom_object(*DRA, ns, "resourceclaims", name)


def _allocated_claim(op: OperatorHarness, ns: str, name: str) -> dict | None:
    try:
        claim = _claim(op, ns, name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None
    return claim if (claim.get("status") or {}).get("allocation") else None


def _device(claim: dict) -> tuple[str, str, str]:
    [result] = claim["status"]["allocation"]["devices"]["results"]
    return result["driver"], result["pool"], result["device"]


def test_claims_made_on_the_oldest_release_serve_new_pods_after_an_in_place_upgrade(
        upgradable_plane: Any, upgrade_operator: OperatorHarness) -> None:
    op = upgrade_operator
    node = op.add_node("h100-80gb")
    op.start_operator(node, webhook=True)
    ns = op.namespace()
    # On the oldest release: a notebook's slice, its claim allocated by the controller, no pod yet; and an
    # annotated pod running on a slice of its own.
    notebook_uid = op.create_slice(ns, "notebook", {"migProfile": "1g.10gb"})["metadata"]["uid"]
    op.wait_phase(ns, "notebook", "Ready")
    before = wait_until(lambda: _allocated_claim(op, ns, "notebook"), 30,
                        lambda: f"the notebook's claim allocated\n{op.logs()}")
    assert _device(before) == ("gpu.cdmo.io", node.name, notebook_uid)
    assert "allocationTimestamp" not in before["status"]["allocation"]  # 1.34 drops it
    annotated = create_pod(op, ns, {"cdmo.io/gpu-memory": "4G"})["metadata"]["name"]
    first = running(op, ns, annotated)
    first_claim = first.metadata.labels["cdmo.io/gpu-slice"]
    assert "allocationTimestamp" not in _claim(op, ns, first_claim)["status"]["allocation"]

    upgradable_plane.upgrade()
    assert op.cluster.k8s_version == upgradable_plane.to_version
    served = json.loads(op.cluster.kubectl("get", "--raw", "/version").stdout)
    assert served["gitVersion"] == upgradable_plane.to_version

    # A new pod naming the old claim runs on the slice's node, its claim still the slice's device there.
    op.core.create_namespaced_pod(ns, _notebook_pod("after-upgrade", "notebook"))
    pod = running(op, ns, "after-upgrade", timeout=120)
    assert pod.spec.node_name == node.name
    after = _claim(op, ns, "notebook")
    assert _device(after) == _device(before) and after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["allocation"].get("allocationTimestamp")
    assert [r["uid"] for r in after["status"]["reservedFor"]] == [pod.metadata.uid]
    # The annotated pod's claim, reserved for it, is left as it was: that pod runs on.
    kept = _claim(op, ns, first_claim)
    assert "allocationTimestamp" not in kept["status"]["allocation"]
    assert [r["uid"] for r in kept["status"]["reservedFor"]] == [first.metadata.uid]
    assert running(op, ns, annotated).metadata.uid == first.metadata.uid
    # A new annotated pod runs, and a new slice is Ready: their claims stamped by the controller.
    second = running(op, ns, create_pod(op, ns, {"cdmo.io/gpu-memory": "4G"})["metadata"]["name"], timeout=60)
    assert _claim(op, ns, second.metadata.labels["cdmo.io/gpu-slice"])["status"]["allocation"].get(
        "allocationTimestamp")
    op.create_slice(ns, "later", {"migProfile": "1g.10gb"})
    op.wait_phase(ns, "later", "Ready", timeout=60)
