"""The chart's autoscaling values (docs/operations.md "Autoscaling"), offline: off by default nothing of it
renders; on, the pools file is one the controller accepts, the placeholders' PriorityClass yields to every
real pod, the RBAC is exactly what the controller's autoscaling code calls (recorded by running that code
against a fake API server), and bad values stop the render with a message naming the value."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
import yaml
from helm_chart import CHART_DIR, REPO_ROOT, find, workload
from test_chart_render import CONTROLLER_RULES, CONTROLLER_WEBHOOK_RULES, _args, _grants, _table

from mig_operator.core.autoscale.nodes import KEEP_ANNOTATIONS, KEPT_MARK
from mig_operator.core.autoscale.pools import AutoscalingOptions, read_pools
from mig_operator.core.books.ledger import Ledger, NodeLabels, NodeRecord, SliceRecord
from mig_operator.core.placement.cluster import GpuState, NodeInventory
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request
from mig_operator.kube.common.client import ApiError
from mig_operator.kube.common.names import WEBHOOK_NAME
from mig_operator.kube.controller.capacity import Autoscaling

RELEASE, NAMESPACE = "mo", "gpu-system"
FULLNAME = f"{RELEASE}-mig-operator"
POOLS = [{
    "name": "gpu-h200", "nodeLabels": {"karpenter.sh/nodepool": "gpu-h200", "cdmo.clear.ml/gpu-partitioning": "mig"},
    "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}], "gpuModel": "h200-141gb", "gpusPerNode": 8,
    "cpu": "190", "memory": "1900Gi", "maxNodes": 4,
}]
ENABLED = ("--set", "autoscaling.enabled=true", "--set-json", f"autoscaling.pools={json.dumps(POOLS)}")
FLAGS = ("--autoscaling-pools", "--autoscaling-backend", "--placeholder-priority-class", "--placeholder-image")


def controller_args(docs: list[dict[str, Any]]) -> list[str]:
    return next(c for c in workload(docs, "Deployment", "controller")["spec"]["template"]["spec"]["containers"]
                if c["name"] == "controller")["args"]


def test_off_by_default_nothing_of_autoscaling_renders(render: Any) -> None:
    docs = render(release=RELEASE, namespace=NAMESPACE)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("ConfigMap", f"{FULLNAME}-autoscaling") not in names
    assert ("PriorityClass", f"{FULLNAME}-placeholder") not in {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Role", f"{FULLNAME}-controller-autoscaling") not in names
    assert ("RoleBinding", f"{FULLNAME}-controller-autoscaling") not in names
    assert ("", "nodes", "patch", "") not in _grants(find(docs, "ClusterRole", f"{FULLNAME}-controller"))
    assert not [a for a in controller_args(docs) if a.startswith(FLAGS)]
    spec = workload(docs, "Deployment", "controller")["spec"]["template"]["spec"]
    assert "autoscaling" not in {v["name"] for v in spec.get("volumes") or []}


def test_on_the_controller_reads_the_pools_the_chart_renders(render: Any) -> None:
    docs = render(*ENABLED, release=RELEASE, namespace=NAMESPACE)
    config = find(docs, "ConfigMap", f"{FULLNAME}-autoscaling")
    assert config["metadata"]["namespace"] == NAMESPACE
    rendered = json.loads(config["data"]["pools.json"])
    assert rendered == POOLS
    (pool,) = read_pools(rendered)  # what the controller does with the file: no PoolError
    assert (pool.name, pool.gpus, pool.max_nodes, pool.mig) == ("gpu-h200", 8, 4, True)

    # The flags: the file where the ConfigMap is mounted, the values' backend, class and image.
    args = _args(container_of(docs))
    assert (args.command, args.namespace) == ("controller", NAMESPACE)
    mount = next(m for m in container_of(docs)["volumeMounts"] if m["name"] == "autoscaling")
    assert args.autoscaling_pools == f"{mount['mountPath']}/pools.json" and mount["readOnly"] is True
    volume = next(v for v in workload(docs, "Deployment", "controller")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "autoscaling")
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    assert (args.autoscaling_backend, args.placeholder_image) == ("auto", "registry.k8s.io/pause:3.10")

    # The placeholders' PriorityClass: below every real pod (default 0), and it never evicts one.
    klass = find(docs, "PriorityClass", args.placeholder_priority_class)
    assert klass["value"] < 0 and klass["preemptionPolicy"] == "Never" and klass["globalDefault"] is False


def container_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = workload(docs, "Deployment", "controller")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "controller")


# ---- RBAC: what the code calls ---------------------------------------------------------------------


_PATH = re.compile(r"^/apis?/(?:(?P<group>[^/]+)/)?v[^/]+(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/.*)?$")
_VERBS = {"get": "get", "list": "list", "create": "create", "delete": "delete", "merge_patch": "patch",
          "json_patch": "patch"}


class Recorder:
    """A fake API server that records each call as an RBAC grant (group, resource, verb, namespace) and
    answers with what is in ``have``; a discovery path (``/apis/<group>/<version>``) needs no grant."""

    def __init__(self, have: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.have = have
        self.pods = pods
        self.calls: set[tuple[str, str, str, str]] = set()

    def _record(self, method: str, path: str) -> None:
        if path.count("/") <= 3 and path.startswith("/apis/"):
            return
        found = _PATH.match(path)
        assert found is not None, path
        group = found["group"] if path.startswith("/apis/") else ""
        self.calls.add((group, found["resource"], _VERBS[method], found["ns"] or ""))

    async def get(self, path: str, **_: Any) -> dict[str, Any]:
        self._record("get", path)
        if path not in self.have:
            raise ApiError(404, "NotFound", f"{path} not found")
        return self.have[path]

    async def list(self, path: str, **_: Any) -> list[dict[str, Any]]:
        self._record("list", path)
        return self.pods

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self._record("create", path)
        return body

    async def merge_patch(self, path: str, patch: dict[str, Any], **_: Any) -> dict[str, Any]:
        self._record("merge_patch", path)
        return {"metadata": {"name": path.rsplit("/", 1)[1], **patch.get("metadata", {})}}

    async def json_patch(self, path: str, ops: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
        self._record("json_patch", path)
        return {}

    async def delete(self, path: str, **_: Any) -> None:
        self._record("delete", path)


class Queue:
    def add(self, *_: Any, **__: Any) -> None:
        pass


def _waiting_ledger() -> Ledger:
    """One H200 node full with a slice made directly (a 7g.141gb: its node is to be kept) and one 4g.71gb
    slice that waits for room; node n1 carries the operator's keep annotations and holds no slice (to be
    let go)."""
    ledger = Ledger()
    model = get_model("h200-141gb")
    ledger.put_node("n0", NodeRecord(flags=NodeLabels(mig=True)))
    ledger.put_node("n1", NodeRecord(annotations={**KEEP_ANNOTATIONS, KEPT_MARK: ",".join(KEEP_ANNOTATIONS)}))
    ledger.put_inventory(NodeInventory("n0", (GpuState(0, "GPU-n0", model.product, model.name, model.memory_mib, True,
                                                       True, model.profiles),)))
    for uid, profile, second in (("full", "7g.141gb", 0), ("wait", "4g.71gb", 1)):
        ledger.put_slice(SliceRecord(uid=uid, namespace="team-a", name=uid, created=f"2026-11-26T00:00:0{second}Z",
                                     version=1, body={"metadata": {"uid": uid}}, request=slice_request(profile=profile),
                                     invalid="", pinned=None, phase=None, binding=None, deleting=False, marked=False))
    assert ledger.decide("full").kind == "bind"
    ledger.commit("full")
    ledger.decide("wait")
    return ledger


def recorded_grants(namespace: str) -> set[tuple[str, str, str, str]]:
    """Every call the controller's autoscaling keys make, through both backends: a buffer and its template
    made, then changed; placeholders made, one that brought its node deleted, a surplus one deleted; the
    keep annotations put on one node and taken off another."""
    pools = read_pools(POOLS)
    calls: set[tuple[str, str, str, str]] = set()
    for backend, have, pods in (
        ("capacitybuffer", {}, []),
        ("capacitybuffer", {
            f"/api/v1/namespaces/{namespace}/podtemplates/mig-operator-gpu-h200": {"template": {}},
            f"/apis/autoscaling.x-k8s.io/v1beta1/namespaces/{namespace}/capacitybuffers/mig-operator-gpu-h200":
                {"spec": {"replicas": 7}}}, []),
        ("placeholder", {}, [{"metadata": {"name": "p0"}, "spec": {"nodeName": "n9"}}]),
        ("placeholder", {}, [{"metadata": {"name": f"p{i}", "creationTimestamp": f"2026-11-26T00:00:0{i}Z"},
                              "spec": {}} for i in range(3)]),
        ("auto", {}, []),
    ):
        client = Recorder(have, pods)
        keys = Autoscaling(client, _waiting_ledger(), Queue(),  # type: ignore[arg-type]
                           AutoscalingOptions(pools, namespace, backend), replan=lambda: None)

        async def run(keys: Autoscaling = keys) -> None:
            await keys.reconcile()
            await keys.keep_nodes()

        asyncio.run(run())
        calls |= client.calls
    return calls


def test_the_rbac_is_exactly_what_the_autoscaling_code_calls(render: Any) -> None:
    recorded = recorded_grants(NAMESPACE)
    docs = render(*ENABLED, release=RELEASE, namespace=NAMESPACE)
    role = find(docs, "Role", f"{FULLNAME}-controller-autoscaling")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _grants(role) == {(g, r, v, "") for g, r, v, ns in recorded if ns == NAMESPACE}
    binding = find(docs, "RoleBinding", f"{FULLNAME}-controller-autoscaling")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULLNAME}-controller",
                                    "namespace": NAMESPACE}]
    # Cluster-wide: only the nodes' annotations, beside the controller's usual rules.
    cluster_wide = {(g, r, v, "") for g, r, v, ns in recorded if not ns}
    assert cluster_wide == {("", "nodes", "patch", "")}
    mwc = ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch")
    assert _grants(find(docs, "ClusterRole", f"{FULLNAME}-controller")) == (
        _table(CONTROLLER_RULES) | _table(CONTROLLER_WEBHOOK_RULES, {mwc: WEBHOOK_NAME}) | cluster_wide)


# ---- values refused, and an admin's own PriorityClass ----------------------------------------------


@pytest.mark.parametrize(("values", "words"), [
    (("--set", "autoscaling.enabled=true"), ["autoscaling.pools", "e.g. {name: h200", "gpuModel: h200-141gb"]),
    ((*ENABLED, "--set", "autoscaling.backend=karpenter"),
     ['autoscaling.backend "karpenter"', "auto, capacitybuffer or placeholder", "e.g. auto"]),
])
def test_enabled_with_bad_values_fails_the_render_naming_the_value(helm: Any, values: tuple[str, ...],
                                                                   words: list[str]) -> None:
    result = helm("template", RELEASE, str(CHART_DIR), *values, check=False)
    assert result.returncode != 0
    for word in words:
        assert word in result.stderr, result.stderr


def test_an_admins_priority_class_is_named_and_none_is_made(render: Any) -> None:
    docs = render(*ENABLED, "--set", "autoscaling.placeholder.priorityClassName=batch-low",
                  "--set", "autoscaling.backend=placeholder", release=RELEASE, namespace=NAMESPACE)
    assert ("PriorityClass", f"{FULLNAME}-placeholder") not in {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert find(docs, "ConfigMap", f"{FULLNAME}-autoscaling")
    args = _args(container_of(docs))
    assert (args.placeholder_priority_class, args.autoscaling_backend) == ("batch-low", "placeholder")


def test_the_operations_guides_example_renders_and_the_controller_reads_its_pools(render: Any, tmp_path: Any) -> None:
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Autoscaling\n", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"^```yaml\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert example is not None, "no yaml block under ## Autoscaling"
    values = tmp_path / "values.yaml"
    values.write_text(example[1])
    docs = render("-f", str(values), release=RELEASE, namespace=NAMESPACE)
    pools = read_pools(json.loads(find(docs, "ConfigMap", f"{FULLNAME}-autoscaling")["data"]["pools.json"]))
    assert [p.name for p in pools] == [entry["name"] for entry in yaml.safe_load(example[1])["autoscaling"]["pools"]]
