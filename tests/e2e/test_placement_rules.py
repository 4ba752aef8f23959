"""The controller's placement rules of issue 24, on the real API server with the chart's RBAC:

- a GPU serving fractions serves one namespace at a time unless its Node is labelled
  cdmo.io/fraction-sharing=cross-namespace (reason OtherNamespace); MIG instances are not concerned;
- a node whose GpuNode has RuntimeTrusted=False (its agent read the toolkit configuration the test
  writes) gets no new slice until the Node is labelled cdmo.io/runtime-trust=accepted (reason
  RuntimeUntrusted); slices bound before stay; Unknown and True place;
- with --quota-required a namespace without a GpuQuota gets nothing (reason NoQuota) and binds once
  the GpuQuota its message shows exists.

Expected GPUs come from the catalog's numbers (an L40S holds 46068 MiB), not from the planner.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from harness import GROUP, NODES, REPO_ROOT, VERSION, OperatorHarness, check_invariants, wait_until

from mig_operator.core.node.runtime_trust import CONDITION_TYPE, TRUST_LABEL, TRUST_VALUE
from mig_operator.core.placement.tenancy import SHARING_LABEL, SHARING_VALUE

L40S_MIB = 46068  # catalog: what one L40S holds
GIB_MIB = 1024
BOUND = ("Bound", "Creating", "Ready")


def status(op: OperatorHarness, ns: str, name: str) -> dict[str, Any]:
    return (op.get_slice(ns, name) or {}).get("status") or {}


def as_tenant(op: OperatorHarness, ns: str, user: str) -> None:
    """``user`` holds the built-in edit role in ``ns`` (with the chart's user roles aggregated into it)."""
    rendered = subprocess.run(
        [str(op.cluster.bin_dir / "helm"), "template", "placement-roles", str(REPO_ROOT / "helm" / "mig-operator"),
         "--show-only", "templates/user-roles.yaml"], capture_output=True, text=True, timeout=120, check=True).stdout
    op.cluster.kubectl("apply", "-f", "-", input=rendered)
    op.cluster.kubectl("create", "rolebinding", f"{user}-edit", "--clusterrole=edit", f"--user={user}", "-n", ns)
    wait_until(lambda: op.cluster.kubectl("auth", "can-i", "create", "gpuslices.cdmo.io", "-n", ns, f"--as={user}",
                                          check=False).stdout.strip() == "yes", 30, f"{user} may create GpuSlices")


def test_a_fraction_gpu_serves_one_namespace_unless_its_node_shares(operator: OperatorHarness) -> None:
    frac = operator.add_node("l40s-48gb", count=2, labelled=False)
    mig = operator.add_node("h100-80gb")
    operator.start_operator(frac, mig)
    team_a, team_b, team_c = operator.namespace(), operator.namespace(), operator.namespace()

    operator.create_slice(team_a, "a1", {"memory": "10Gi", "nodeName": frac.name})
    x = operator.wait_phase(team_a, "a1", "Ready")["status"]["gpu"]
    # Best fit alone would put b1 beside a1 (the GPU with less free memory); tenancy sends it to the other.
    operator.create_slice(team_b, "b1", {"memory": "10Gi", "nodeName": frac.name})
    y = operator.wait_phase(team_b, "b1", "Ready")["status"]["gpu"]
    assert {x, y} == {0, 1}, (x, y)
    # Its own namespace's GPU still packs: a2 goes beside a1.
    operator.create_slice(team_a, "a2", {"memory": "30Gi", "nodeName": frac.name})
    assert operator.wait_phase(team_a, "a2", "Ready")["status"]["gpu"] == x
    # GPU x has 46068 - 40960 = 5108 MiB free, GPU y 35828: only y has room for 10Gi, and it is team-b's.
    assert L40S_MIB - 40 * GIB_MIB < 10 * GIB_MIB <= L40S_MIB - 10 * GIB_MIB
    # team-c's tenant (edit in its namespace) asks for that GPU by pinning the node: it waits.
    tenant = "tenant-c"
    as_tenant(operator, team_c, tenant)
    c1 = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "c1", "namespace": team_c},
          "spec": {"memory": "10Gi", "nodeName": frac.name}}
    operator.cluster.kubectl("apply", "-f", "-", f"--as={tenant}", input=yaml.safe_dump(c1))
    waiting = operator.wait_phase(team_c, "c1", "Pending", reason="OtherNamespace")["status"]
    for part in ("held by another namespace", team_c, f"{SHARING_LABEL}={SHARING_VALUE}"):
        assert part in waiting["message"], waiting["message"]
    for secret in (team_b, frac.name, f"GPU {y}"):  # nothing of the namespace that holds it
        assert secret not in waiting["message"], waiting["message"]
    # Nor can the tenant lift the rule: the label is the admin's, the GpuNode its agent's.
    label = operator.cluster.kubectl("label", "node", frac.name, f"{SHARING_LABEL}={SHARING_VALUE}",
                                     f"--as={tenant}", check=False)
    assert label.returncode != 0 and "forbidden" in label.stderr, label.stderr
    patch = operator.cluster.kubectl("patch", "gn", frac.name, "--subresource=status", "--type=merge", "-p",
                                     '{"status": {"gpus": []}}', f"--as={tenant}", check=False)
    assert patch.returncode != 0 and "forbidden" in patch.stderr, patch.stderr
    assert status(operator, team_c, "c1")["reason"] == "OtherNamespace"

    # MIG instances are isolated in hardware: two namespaces on one H100, as before.
    operator.create_slice(team_a, "m1", {"memory": "9Gi", "nodeName": mig.name})
    operator.create_slice(team_b, "m2", {"memory": "9Gi", "nodeName": mig.name})
    m1 = operator.wait_phase(team_a, "m1", "Ready")["status"]
    m2 = operator.wait_phase(team_b, "m2", "Ready")["status"]
    assert m1["mode"] == m2["mode"] == "mig" and m1["gpu"] == m2["gpu"] == 0

    # The admin lets the node's GPUs be shared: c1 binds, beside team-b's b1 (the GPU with room).
    operator.core.patch_node(frac.name, {"metadata": {"labels": {SHARING_LABEL: SHARING_VALUE}}})
    assert operator.wait_phase(team_c, "c1", "Ready")["status"]["gpu"] == y
    check_invariants(operator)


KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"


def runtime_trusted(op: OperatorHarness, node: str) -> dict[str, Any] | None:
    conditions = (op.custom.get_cluster_custom_object(GROUP, VERSION, NODES, node).get("status") or {}).get(
        "conditions") or []
    return next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)


def wait_trusted(op: OperatorHarness, node: str, value: str) -> dict[str, Any]:
    # The agent reads its toolkit configuration at start and every 30 s.
    return wait_until(lambda: (c := runtime_trusted(op, node)) and c["status"] == value and c, 45,
                      lambda: f"{node}'s {CONDITION_TYPE}={value}, now {runtime_trusted(op, node)}\n{op.logs()}")


def test_an_untrusted_runtime_takes_no_new_slice_until_accepted(operator: OperatorHarness, tmp_path: Path) -> None:
    node = operator.add_node("h100-80gb")
    config = tmp_path / "toolkit" / "config.toml"
    config.parent.mkdir()
    # No configuration to read (a node whose runtime knows only CDI): Unknown, and slices are placed.
    operator.agent(node, None, "--toolkit-config", str(config))
    operator.wait_gpunode(node)
    wait_trusted(operator, node.name, "Unknown")
    operator.controller()
    ns = operator.namespace()
    operator.create_slice(ns, "before", {"memory": "9Gi", "nodeName": node.name})
    before = operator.wait_phase(ns, "before", "Ready")["status"]

    # The toolkit hands GPUs to any container that names them: False, and no new slice goes there.
    config.write_text(f"{KEY} = true\n")
    why = wait_trusted(operator, node.name, "False")["message"]
    operator.create_slice(ns, "after", {"memory": "9Gi", "nodeName": node.name})
    waiting = operator.wait_phase(ns, "after", "Pending", reason="RuntimeUntrusted")["status"]
    for part in (f"node {node.name}", why, f"kubectl label node {node.name} {TRUST_LABEL}={TRUST_VALUE}"):
        assert part in waiting["message"], waiting["message"]
    kept = status(operator, ns, "before")
    assert kept["phase"] == "Ready" and kept["deviceUUID"] == before["deviceUUID"]

    # The admin accepts it: the slice binds and is made; label gone, the next one waits again.
    operator.core.patch_node(node.name, {"metadata": {"labels": {TRUST_LABEL: TRUST_VALUE}}})
    operator.wait_phase(ns, "after", "Ready")
    operator.core.patch_node(node.name, {"metadata": {"labels": {TRUST_LABEL: None}}})
    wait_until(lambda: TRUST_LABEL not in (operator.core.read_node(node.name).metadata.labels or {}), 10,
               "the label removed")
    operator.create_slice(ns, "third", {"memory": "9Gi", "nodeName": node.name})
    operator.wait_phase(ns, "third", "Pending", reason="RuntimeUntrusted")
    # The toolkit fixed: True, and the slice is placed.
    config.write_text(f"{KEY} = false\n")
    wait_trusted(operator, node.name, "True")
    operator.wait_phase(ns, "third", "Ready")
    check_invariants(operator)


def test_quota_required_refuses_a_namespace_without_a_gpuquota_until_it_has_one(operator: OperatorHarness) -> None:
    node = operator.add_node("h200-141gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    wait_until(lambda: operator.cluster.kubectl("get", "gq", "-A", check=False).returncode == 0, 60,
               "gpuquotas to be served")
    operator.controller(None, "--quota-required")
    ns, other = operator.namespace(), operator.namespace()
    operator.create_slice(ns, "s1", {"memory": "10G"})
    operator.create_slice(other, "s1", {"memory": "10G"})
    waiting = operator.wait_phase(ns, "s1", "Pending", reason="NoQuota")["status"]
    assert f"namespace {ns}" in waiting["message"] and "quota.required" in waiting["message"]
    # The example in the message is a GpuQuota the API server takes as it is.
    example = re.search(r"<<< '(\{.*\})'", waiting["message"])
    assert example is not None, waiting["message"]
    operator.cluster.kubectl("apply", "-f", "-", input=example.group(1))
    assert operator.wait_phase(ns, "s1", "Ready")["status"]["profile"] == "1g.18gb"
    # The namespace still without one keeps waiting.
    assert status(operator, other, "s1").get("reason") == "NoQuota"
    assert status(operator, other, "s1").get("phase") == "Pending"
