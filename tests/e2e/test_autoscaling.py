"""GPU nodes come when slices wait and go when only idle instances are left, with a real Karpenter.

The plane (``karpenter_plane``) has no GPU node: Karpenter's kwok provider makes Nodes of the NodePool's
GPU shapes (scripts/karpenter/gpu-instance-types.json), and the test starts an agent on simulated GPUs
on each new node, as the chart's DaemonSet would. The controller runs with the chart's RBAC rendered
with autoscaling enabled, so a verb the chart lacks fails here.

Two slices of 4g.71gb need two new one-GPU H200 nodes: a 4g.71gb takes 4 of an H200's 7 compute slots
(NVIDIA's MIG user guide), so two never share one GPU. That is the count the CapacityBuffer (or the
placeholder pods) must ask for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from autoscaler import (
    NODE_POOL_LABEL,
    apply_node_pool,
    capacity_buffer,
    karpenter_nodes,
    node_claims,
    node_ready,
)
from cluster import CHART_NAMESPACE, KubeCluster, apply_chart_identities
from faulty_proxy import FaultyProxy
from harness import MIG_LABEL, OperatorHarness, apply_crds, wait_for_log, wait_until
from kubernetes.client.rest import ApiException
from test_top_picture import top

pytestmark = pytest.mark.xdist_group("karpenter")

POOL = "gpu-h200"
PRIORITY_CLASS = "e2e-placeholder"
POOLS = [{
    "name": POOL, "nodeLabels": {NODE_POOL_LABEL: POOL, MIG_LABEL: "mig"}, "gpuModel": "h200-141gb",
    "gpusPerNode": 1, "cpu": "16", "memory": "64Gi", "maxNodes": 4,
}]
KEEP = "karpenter.sh/do-not-disrupt"
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def autoscaled(karpenter_plane: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The plane with the operator's CRDs, the chart's identities with autoscaling on, a NodePool of
    one-GPU H200 nodes (MIG label, empty nodes consolidated after 5 s) and the placeholders' PriorityClass."""
    cluster = karpenter_plane
    apply_crds(cluster)
    identities = apply_chart_identities(cluster, tmp_path_factory.mktemp("identities"),
                                        "--set", "autoscaling.enabled=true",
                                        "--set-json", f"autoscaling.pools={json.dumps(POOLS)}")
    apply_node_pool(cluster, POOL, ["gpu-h200-1"], labels={MIG_LABEL: "mig"}, consolidate_after="5s")
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PRIORITY_CLASS},
        "value": -10, "preemptionPolicy": "Never"}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        yield cluster, identities


@pytest.fixture(name="proxy")
def proxy_fixture(autoscaled: Any) -> Iterator[FaultyProxy]:
    """The faulty proxy in front of the plane's API server; named before ``operator`` so that it outlives
    the operator's teardown."""
    cluster, _ = autoscaled
    admin = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    proxy = FaultyProxy(admin["server"], admin["certificate-authority"], rate=0.3)
    yield proxy
    proxy.close()


@pytest.fixture
def operator(autoscaled: Any, tmp_path: Path) -> Iterator[OperatorHarness]:
    cluster, identities = autoscaled
    harness = OperatorHarness(cluster, tmp_path)
    harness.kubeconfigs = dict(identities.kubeconfigs)
    harness.webhook_config = identities.webhook_config
    yield harness
    harness.close()


class Agents:
    """An agent per Node Karpenter made, started when the node appears and stopped when it goes."""

    def __init__(self, op: OperatorHarness) -> None:
        self.op = op
        self.running: dict[str, Any] = {}

    def sync(self) -> list[str]:
        names = {n.metadata.name for n in karpenter_nodes(self.op.cluster, POOL) if node_ready(n)}
        for name in sorted(names - set(self.running)):
            self.op.attach_node(name, "h200-141gb")
            self.running[name] = self.op.process(f"agent-{name}")
        for name in sorted(set(self.running) - names):
            self.op.stop(self.running.pop(name))
        return sorted(names)


def slice_status(op: OperatorHarness, ns: str, name: str) -> dict:
    body = op.get_slice(ns, name)
    return (body or {}).get("status") or {}


@pytest.mark.parametrize("backend", [pytest.param("capacitybuffer", marks=pytest.mark.compat), "placeholder"])
def test_waiting_slices_bring_two_nodes_and_the_idle_nodes_go(proxy: FaultyProxy, operator: OperatorHarness,
                                                              backend: str,
                                                              tmp_path: Path) -> None:
    op = operator
    cluster = op.cluster
    pools_file = tmp_path / "pools.json"
    pools_file.write_text(json.dumps(POOLS))
    # With placeholders the controller writes through the faulty proxy: 30 % of its writes fail (500, 409,
    # 429) from its start until its nodes are gone; every write it makes must be retried to the end.
    if backend == "placeholder":
        token = yaml.safe_load(op.kubeconfigs["controller"].read_text())["users"][0]["user"]["token"]
        op.kubeconfigs["controller"] = proxy.kubeconfig(tmp_path / "controller-proxy.kubeconfig", token)
        proxy.faulty = True
    op.controller_with_webhook(None, "--autoscaling-pools", str(pools_file), "--autoscaling-backend", backend,
                               "--placeholder-priority-class", PRIORITY_CLASS)
    op.wait_webhook()
    agents = Agents(op)
    ns = op.namespace()
    op.create_slice(ns, "notebook", {"migProfile": "4g.71gb"})
    op.core.create_namespaced_pod(ns, {
        "metadata": {"name": "trainer", "annotations": {"cdmo.io/mig-profile": "4g.71gb"}},
        "spec": {"tolerations": [KWOK_TOLERATION], "containers": [{"name": "main", "image": "busybox"}]}})
    pod_slice = wait_until(lambda: next((s["metadata"]["name"] for s in op.slices(ns)
                                         if s["metadata"]["name"] != "notebook"), None), 30, "the pod's slice")

    def waiting_for_node() -> bool:
        states = [slice_status(op, ns, n) for n in ("notebook", pod_slice)]
        return all(s.get("phase") == "Pending" and s.get("reason") == "WaitingForNode" and POOL in s.get("message", "")
                   and s.get("pool") == POOL for s in states)

    # Both wait for a node of the pool (its name in status.pool too), and exactly two nodes are asked for
    # (see the module's docstring). No agent runs yet, so both still wait when top looks.
    wait_until(waiting_for_node, 30, lambda: f"both slices WaitingForNode\n{op.logs()}")
    assert json.loads(top(op, "--json").stdout)["waitingForNode"] == {POOL: 2}
    if backend == "capacitybuffer":
        wait_until(lambda: ((capacity_buffer(cluster, CHART_NAMESPACE, f"mig-operator-{POOL}") or {})
                            .get("spec", {}).get("replicas") == 2), 30, lambda: f"the buffer at 2\n{op.logs()}")
    else:
        wait_for_log(op.process("controller").log, rf"pool {POOL} asks for 2 new node\(s\) \(placeholder pods\)")
        placeholders = op.core.list_namespaced_pod(CHART_NAMESPACE, label_selector=f"cdmo.io/autoscaling-pool={POOL}")
        assert all(p.spec.priority == -10 for p in placeholders.items)

    # Karpenter makes two nodes; an agent starts on each; the slices are placed and the pod runs.
    wait_until(lambda: len(agents.sync()) == 2, 120, lambda: f"two Karpenter nodes\n{node_claims(cluster)}")
    wait_until(lambda: (agents.sync() and all(slice_status(op, ns, n).get("phase") == "Ready"
                                              for n in ("notebook", pod_slice))), 60,
               lambda: f"both slices Ready\n{op.logs()}")
    nodes = {slice_status(op, ns, n)["node"] for n in ("notebook", pod_slice)}
    assert not [n for n in ("notebook", pod_slice) if "pool" in slice_status(op, ns, n)]  # placed: no pool named
    assert nodes == set(agents.running), (nodes, agents.running)
    wait_until(lambda: op.core.read_namespaced_pod("trainer", ns).status.phase == "Running", 60,
               lambda: f"the pod Running\n{op.logs()}")
    assert len(node_claims(cluster, POOL)) == 2  # no third node asked for meanwhile
    if backend == "capacitybuffer":
        wait_until(lambda: capacity_buffer(cluster, CHART_NAMESPACE, f"mig-operator-{POOL}")["spec"]["replicas"] == 0,
                   30, "the buffer back at 0")
    else:
        wait_until(lambda: not op.core.list_namespaced_pod(
            CHART_NAMESPACE, label_selector=f"cdmo.io/autoscaling-pool={POOL}").items, 60, "no placeholder left")

    # The direct slice has no pod of its own: its node is kept; the running pod's node is not annotated.
    notebook_node = slice_status(op, ns, "notebook")["node"]
    trainer_node = slice_status(op, ns, pod_slice)["node"]
    wait_until(lambda: (op.core.read_node(notebook_node).metadata.annotations or {}).get(KEEP) == "true", 60,
               lambda: f"{KEEP} on {notebook_node}\n{op.logs()}")
    # The pod's leaving the controller's pod watch (it watches pods not Running) is what lets its node go.
    wait_until(lambda: KEEP not in (op.core.read_node(trainer_node).metadata.annotations or {}), 60,
               lambda: f"no {KEEP} on {trainer_node} once its pod runs\n{op.logs()}")
    # The notebook's node has no pod (empty to Karpenter) and is still there, its slice Ready.
    assert slice_status(op, ns, "notebook")["phase"] == "Ready" and len(node_claims(cluster, POOL)) == 2

    # Released: the instances stay idle on their GPUs, and both nodes are consolidated away.
    op.core.delete_namespaced_pod("trainer", ns, grace_period_seconds=0)
    op.delete_slice(ns, "notebook")
    wait_until(lambda: not op.slices(ns), 60, lambda: f"both slices gone\n{op.logs()}")
    for name in (notebook_node, trainer_node):
        assert op.nodes[name].backend().instances(0), f"the instance on {name} is kept idle"
    wait_until(lambda: not agents.sync() and not node_claims(cluster, POOL), 180,
               lambda: f"the nodes consolidated\n{node_claims(cluster, POOL)}")

    # Nothing is left in the books: no GpuNode, no ResourceSlice, nothing asked for.
    def books_empty() -> bool:
        gpunodes = op.custom.list_cluster_custom_object("cdmo.io", "v1alpha1", "gpunodes")["items"]
        slices = cluster.kubectl("get", "resourceslices", "-o", "name").stdout.split()
        return not gpunodes and not slices
    wait_until(books_empty, 60, "GpuNodes and ResourceSlices of the gone nodes deleted")
    if backend == "capacitybuffer":
        assert capacity_buffer(cluster, CHART_NAMESPACE, f"mig-operator-{POOL}")["spec"]["replicas"] == 0
    assert not op.core.list_namespaced_pod(CHART_NAMESPACE, label_selector=f"cdmo.io/autoscaling-pool={POOL}").items
    refused = [line for proc in op.procs for line in proc.log.read_text(errors="replace").splitlines()
               if "is forbidden" in line]
    assert not refused, refused[:5]
    if backend == "placeholder":
        assert sum(proxy.injected.values()) > 0, "the proxy failed none of the controller's writes"


def test_a_slice_no_pool_can_hold_keeps_its_own_reason_and_asks_for_nothing(operator: OperatorHarness,
                                                                            tmp_path: Path) -> None:
    op = operator
    pools_file = tmp_path / "pools.json"
    pools_file.write_text(json.dumps(POOLS))
    op.controller(None, "--autoscaling-pools", str(pools_file), "--autoscaling-backend", "capacitybuffer",
                  "--namespace", CHART_NAMESPACE)
    ns = op.namespace()
    # 200Gi is more than an H200's 143771 MiB (140.4 GiB): no GPU of any pool takes it.
    op.create_slice(ns, "huge", {"memory": "200Gi"})
    status = wait_until(lambda: (s := slice_status(op, ns, "huge")).get("reason") and s, 30,
                        lambda: f"the slice refused\n{op.logs()}")
    assert status["phase"] == "Pending" and status["reason"] != "WaitingForNode", status
    try:
        buffer = capacity_buffer(op.cluster, CHART_NAMESPACE, f"mig-operator-{POOL}")
    except ApiException:
        buffer = None
    assert buffer is None or buffer["spec"]["replicas"] == 0
    assert not node_claims(op.cluster, POOL)
