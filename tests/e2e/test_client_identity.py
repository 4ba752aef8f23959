"""Client commands act as the kubeconfig's user, impersonation included: a kubeconfig whose user is the
session's admin with ``as: <tenant>`` (``edit`` in one namespace) gets from `top` that namespace's slices
only (the cluster-wide lists need more than a namespace's edit), and a refusal for a namespace it may not
read; ``as-groups`` travel too; ``--as`` on the command line does what ``as:`` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from harness import REPO_ROOT, OperatorHarness
from tenants import edit_tenant
from test_advise import write_usage

GIB = 2**30


def acting_kubeconfig(op: OperatorHarness, path: Path, namespace: str = "", **acting: Any) -> Path:
    """The admin's kubeconfig with impersonation fields (``as``, ``as-groups``) under its current user, its
    context in ``namespace`` where one is given."""
    config = yaml.safe_load(op.cluster.kubeconfig.read_text())
    current = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    if namespace:
        current["context"]["namespace"] = namespace
    user = next(u for u in config["users"] if u["name"] == current["context"]["user"])
    user["user"].update(acting)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def top(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", "top", "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def test_top_acts_as_the_kubeconfigs_impersonated_user(operator: OperatorHarness, tmp_path: Path) -> None:
    node = operator.add_node("h100-80gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    ns, other = operator.namespace(), operator.namespace()
    edit_tenant(operator.cluster, ns, "top-tenant")
    operator.create_slice(ns, "mine", {"migProfile": "1g.10gb", "nodeName": node.name})
    operator.create_slice(other, "theirs", {"migProfile": "1g.10gb", "nodeName": node.name})
    write_usage(operator, ns, "mine", GIB, 3 * GIB)

    admin = top(operator.cluster.kubeconfig)
    assert admin.returncode == 0 and f"node {node.name}  " in admin.stdout, admin.stderr

    # The tenant may list neither the GpuNodes nor every namespace's slices: its context's namespace only,
    # said in one line on stderr; the other namespace's slice is not there.
    kubeconfig = acting_kubeconfig(operator, tmp_path / "tenant", ns, **{"as": "top-tenant"})
    tenant = top(kubeconfig)
    assert tenant.returncode == 0, tenant.stderr
    assert tenant.stderr.count("\n") == 1 and f"limited to namespace {ns}" in tenant.stderr, tenant.stderr
    mine = [line.split() for line in tenant.stdout.splitlines() if line.endswith(" mine")]
    assert len(mine) == 1 and "1.0Gi/3.0Gi" in mine[0] and "theirs" not in tenant.stdout, tenant.stdout
    assert f"node {node.name}" not in tenant.stdout
    out = json.loads(top(kubeconfig, "--json").stdout)
    assert out["nodes"] == [] and [(s["namespace"], s["name"]) for s in out["slices"]] == [(ns, "mine")]
    assert out["slices"][0]["usage"]["memoryPeak"] == 3 * GIB

    # Another namespace it may not read: the refusal in one line.
    refused = top(kubeconfig, "-n", other)
    assert refused.returncode == 1 and refused.stdout == "", refused.stdout
    assert refused.stderr.count("\n") == 1 and 'User "top-tenant" cannot list' in refused.stderr, refused.stderr

    # Through the flag, from the admin's own kubeconfig: -n names the namespace; without it, the admin's
    # context's namespace (default), which the tenant may not read either.
    flagged = top(operator.cluster.kubeconfig, "--as", "top-tenant", "-n", ns)
    assert flagged.returncode == 0 and " mine" in flagged.stdout and flagged.stderr == "", flagged.stderr
    flagged = top(operator.cluster.kubeconfig, "--as", "top-tenant")
    assert flagged.returncode == 1 and 'User "top-tenant" cannot list' in flagged.stderr, flagged.stderr

    # Groups are sent too: a user nobody bound anything to, in system:masters, reads everything.
    grouped = top(acting_kubeconfig(operator, tmp_path / "grouped", **{"as": "nobody-in-particular",
                                                                         "as-groups": ["system:masters"]}))
    assert grouped.returncode == 0 and f"node {node.name}  " in grouped.stdout, grouped.stderr
    alone = top(acting_kubeconfig(operator, tmp_path / "alone", **{"as": "nobody-in-particular"}))
    assert alone.returncode == 1 and 'User "nobody-in-particular" cannot list' in alone.stderr, alone.stderr
