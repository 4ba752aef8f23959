"""`mig-operator advise` against the real API server: MIG slices made Ready by an agent on a simulated H100 and
the controller, their ``status.usage`` written by the TEST through the status subresource as the agent
would (the agent's own usage loop is off), then ``advise --json`` read back; a tenant with ``edit`` in one
namespace sees that namespace's slices only, and is refused another's. Expected figures are worked by hand
from the H100 80GB's profile table (1g.10gb 9984 MiB, 3g.40gb 40448 MiB, GPU 81559 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from harness import GROUP, REPO_ROOT, SLICES, VERSION, OperatorHarness
from tenants import edit_tenant

GIB = 2**30
MIB = 2**20


def advise(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", "advise", "--kubeconfig", str(kubeconfig),
                           *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def write_usage(op: OperatorHarness, namespace: str, name: str, used: int, peak: int) -> None:
    """``status.usage`` as the node's agent writes it: a merge patch through the status subresource."""
    usage = {"memoryUsed": used, "memoryPeak": peak, "processes": 1, "refusals": 0,
             "lastActive": "2026-11-29T06:00:00Z", "observedAt": "2026-11-29T06:00:00Z"}
    op.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, SLICES, name,
                                                    {"status": {"usage": usage}})


def tenant_kubeconfig(op: OperatorHarness, path: Path, user: str, namespace: str) -> Path:
    """The admin's kubeconfig acting as ``user`` (``as:``), its context in ``namespace``."""
    config = yaml.safe_load(op.cluster.kubeconfig.read_text())
    current = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    current["context"]["namespace"] = namespace
    next(u for u in config["users"] if u["name"] == current["context"]["user"])["user"]["as"] = user
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def rows(out: dict[str, Any], *namespaces: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(s["namespace"], s["name"]): s for s in out["slices"] if s["namespace"] in namespaces}


def test_advise_reads_the_measured_peaks_and_a_tenant_sees_its_namespace_only(operator: OperatorHarness,
                                                                             tmp_path: Path) -> None:
    node = operator.add_node("h100-80gb")
    operator.agent(node, None, "--usage-interval", "0")
    operator.wait_gpunode(node)
    operator.controller()
    team_a, team_b = operator.namespace(), operator.namespace()
    operator.create_slice(team_a, "notebook", {"migProfile": "3g.40gb", "nodeName": node.name})
    operator.create_slice(team_b, "train", {"migProfile": "1g.10gb", "nodeName": node.name})
    operator.create_slice(team_b, "fresh", {"migProfile": "1g.10gb", "nodeName": node.name})
    for ns, name in ((team_a, "notebook"), (team_b, "train"), (team_b, "fresh")):
        operator.wait_phase(ns, name, "Ready")
    # notebook: 3 GiB + 10 % fits 1g.10gb, back 40448 - 9984 = 30464 MiB; train: its peak is its whole
    # 9984 MiB, too small; fresh: no usage yet, not listed.
    write_usage(operator, team_a, "notebook", GIB, 3 * GIB)
    write_usage(operator, team_b, "train", 9984 * MIB, 9984 * MIB)

    admin = advise(operator.cluster.kubeconfig, "-A", "--json")
    assert admin.returncode == 0, admin.stderr
    found = rows(json.loads(admin.stdout), team_a, team_b)
    assert found == {
        (team_a, "notebook"): {"namespace": team_a, "name": "notebook", "node": node.name, "mode": "mig",
                               "current": "3g.40gb", "peak": 3 * GIB, "verdict": "Smaller", "suggested": "1g.10gb",
                               "memoryBack": 30464 * MIB, "message": "peak 3.0Gi + 10% fits 1g.10gb (9.8Gi)"},
        (team_b, "train"): {"namespace": team_b, "name": "train", "node": node.name, "mode": "mig",
                            "current": "1g.10gb", "peak": 9984 * MIB, "verdict": "TooSmall", "suggested": None,
                            "memoryBack": 0, "message": "peak 9.8Gi reached the limit 9.8Gi"},
    }
    one = json.loads(advise(operator.cluster.kubeconfig, "-n", team_a, "--json").stdout)
    assert one["totals"] == {"memoryBack": 30464 * MIB, "wholeGpus": round(30464 / 81559, 3)}

    # A headroom of 1 (100 %): 6 GiB still fits 1g.10gb.
    roomy = json.loads(advise(operator.cluster.kubeconfig, "-n", team_a, "--json", "--headroom", "1").stdout)
    assert [s["message"] for s in roomy["slices"]] == ["peak 3.0Gi + 100% fits 1g.10gb (9.8Gi)"]

    # top shows the same figures.
    top = subprocess.run([sys.executable, "-m", "mig_operator.cli", "top", "--kubeconfig",
                          str(operator.cluster.kubeconfig), "--json"], capture_output=True, text=True, timeout=60,
                         cwd=REPO_ROOT)
    [gpu] = next(n for n in json.loads(top.stdout)["nodes"] if n["name"] == node.name)["gpus"]
    usage = {i["slice"]: i["usage"] for i in gpu["instances"]}
    assert usage[f"{team_a}/notebook"]["memoryPeak"] == 3 * GIB and usage[f"{team_b}/fresh"] is None

    # The tenant: edit in team-a only. Every namespace's slices and the GpuNodes are forbidden to it, so it
    # gets its context's namespace, and the MIG advice from the slice's profile and grant.
    edit_tenant(operator.cluster, team_a, "advise-tenant")
    kubeconfig = tenant_kubeconfig(operator, tmp_path / "tenant", "advise-tenant", team_a)
    tenant = advise(kubeconfig, "--json")
    assert tenant.returncode == 0, tenant.stderr
    out = json.loads(tenant.stdout)
    assert {(s["namespace"], s["name"]) for s in out["slices"]} == {(team_a, "notebook")}
    assert out["slices"][0] == found[(team_a, "notebook")]
    assert out["totals"] == one["totals"]
    assert f"namespace {team_a} only" in tenant.stderr and "cannot list GpuNodes (HTTP 403" in tenant.stderr

    refused = advise(kubeconfig, "-n", team_b)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and 'User "advise-tenant" cannot list' in refused.stderr, refused.stderr
