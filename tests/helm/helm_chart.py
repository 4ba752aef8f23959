"""What the chart tests share: where the chart is, the helm binary, and looking objects up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"


def bin_dir() -> Path:
    """Where scripts/control-plane keeps kubectl and helm (its ``env`` command says)."""
    env = subprocess.run([str(CONTROL_PLANE), "env"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "MIG_OPERATOR_RUN"})
    values = dict(line.split("=", 1) for line in env.stdout.splitlines() if "=" in line)
    return Path(values["BIN_DIR"])


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) among ``docs``."""
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {[(d['kind'], d['metadata']['name']) for d in docs]}"
    return found[0]


def workload(docs: list[dict[str, Any]], kind: str, container_name: str, init: bool = False) -> dict[str, Any]:
    """The one object of ``kind`` (a Deployment, a DaemonSet) whose pods run a container of that name."""
    key = "initContainers" if init else "containers"
    found = [d for d in docs if d["kind"] == kind
             and any(c["name"] == container_name for c in d["spec"]["template"]["spec"].get(key) or [])]
    assert len(found) == 1, f"{len(found)} {kind} running {container_name}"
    return found[0]


def container(docs: list[dict[str, Any]], kind: str, name: str, init: bool = False) -> dict[str, Any]:
    spec = workload(docs, kind, name, init)["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)
