"""Client commands act as the kubeconfig's user, impersonation included: a kubeconfig whose user is the
session's admin with ``as: <tenant>`` (``edit`` in one namespace) gets the tenant's refusal from `top`
(the cluster-wide lists need more than a namespace's edit); ``as-groups`` travel too; ``--as`` on the
command line does what ``as:`` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from harness import REPO_ROOT, OperatorHarness
from tenants import edit_tenant


def acting_kubeconfig(op: OperatorHarness, path: Path, **acting: Any) -> Path:
    """The admin's kubeconfig with impersonation fields (``as``, ``as-groups``) under its current user."""
    config = yaml.safe_load(op.cluster.kubeconfig.read_text())
    current = next(c for c in config["contexts"] if c["name"] == config["current-context"])
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
    ns = operator.namespace()
    edit_tenant(operator.cluster, ns, "top-tenant")

    admin = top(operator.cluster.kubeconfig)
    assert admin.returncode == 0 and f"node {node.name}  " in admin.stdout, admin.stderr

    tenant = top(acting_kubeconfig(operator, tmp_path / "tenant", **{"as": "top-tenant"}))
    assert tenant.returncode == 1 and tenant.stdout == "", tenant.stdout
    assert tenant.stderr.count("\n") == 1 and 'User "top-tenant" cannot list' in tenant.stderr, tenant.stderr

    # The same refusal through the flag, from the admin's own kubeconfig.
    flagged = top(operator.cluster.kubeconfig, "--as", "top-tenant")
    assert flagged.returncode == 1 and 'User "top-tenant" cannot list' in flagged.stderr, flagged.stderr

    # Groups are sent too: a user nobody bound anything to, in system:masters, reads everything.
    grouped = top(acting_kubeconfig(operator, tmp_path / "grouped", **{"as": "nobody-in-particular",
                                                                         "as-groups": ["system:masters"]}))
    assert grouped.returncode == 0 and f"node {node.name}  " in grouped.stdout, grouped.stderr
    alone = top(acting_kubeconfig(operator, tmp_path / "alone", **{"as": "nobody-in-particular"}))
    assert alone.returncode == 1 and 'User "nobody-in-particular" cannot list' in alone.stderr, alone.stderr
