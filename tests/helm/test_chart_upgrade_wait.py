"""Upgrades and the MPS host's OnDelete: the chart keeps the MPS host pods through an upgrade (their
daemons hold the compute shares' CUDA contexts), so Helm 4's default waiter (kstatus, which counts a
DaemonSet rolled out only when every pod runs the new template) would fail any upgrade that changes
its template. Every `helm upgrade` or `helm rollback` the docs give must therefore use a waiter that
passes an OnDelete DaemonSet: `--wait=legacy` (Helm 3's), `--wait=hookOnly` or none at all, and
`--rollback-on-failure` (which turns kstatus on when no waiter is named) only with one of those.
"""

from __future__ import annotations

import re
from typing import Any

from doc_commands import commands
from helm_chart import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PASSING_WAITERS = {"--wait=legacy", "--wait=hookOnly"}


def on_delete_workloads(docs: list[dict[str, Any]]) -> list[str]:
    return [f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in ("DaemonSet", "StatefulSet")
            and (d["spec"].get("updateStrategy") or {}).get("type") == "OnDelete"]


def documented_commands(verb: str) -> list[tuple[str, list[str]]]:
    """Each `helm VERB` command in the docs' fenced blocks (any language: a console block counts too),
    split as tests/doc_commands.py splits them, as (where, its words)."""
    found = []
    for path in DOCS:
        for block in re.findall(r"^```[\w-]*\n(.*?)^```", path.read_text(), re.M | re.S):
            for command in commands(block):
                if command.line.startswith(f"helm {verb}"):
                    found.append((f"{path.relative_to(REPO_ROOT)}: {command.line}", command.argv))
    return found


def kstatus_waits(words: list[str]) -> bool:
    """Whether Helm 4 waits with kstatus: `--wait`/`--wait=watcher`, or `--rollback-on-failure` (or its
    old name `--atomic`) without a waiter named."""
    waits = [w for w in words if w == "--wait" or w.startswith("--wait=")]
    if any(w in ("--wait", "--wait=watcher", "--wait=true") for w in waits):
        return True
    return bool({"--rollback-on-failure", "--atomic"} & set(words)) and not set(waits) & PASSING_WAITERS


def test_the_mps_host_is_the_charts_only_on_delete_workload(render: Any) -> None:
    assert on_delete_workloads(render()) == ["DaemonSet/mig-operator-mps"]


def test_no_documented_upgrade_or_rollback_waits_with_kstatus_on_the_mps_host(render: Any) -> None:
    assert on_delete_workloads(render()), "no OnDelete workload left: this rule can go"
    commands = documented_commands("upgrade") + documented_commands("rollback")
    assert commands, "the docs give no helm upgrade"
    assert [where for where, words in commands if kstatus_waits(words)] == []


def test_the_check_catches_helm_4s_kstatus_waits() -> None:
    """The rule itself, on commands written out here: the default waiter in its spellings is caught."""
    base = "helm upgrade r helm/mig-operator --namespace mig-operator".split()
    assert kstatus_waits([*base, "--wait"]) and kstatus_waits([*base, "--wait=watcher"])
    assert kstatus_waits([*base, "--rollback-on-failure"])
    assert not kstatus_waits([*base, "--rollback-on-failure", "--wait=legacy"])
    assert not kstatus_waits([*base, "--wait=legacy"]) and not kstatus_waits(base)
