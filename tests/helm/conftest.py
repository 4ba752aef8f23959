"""Rendering the Helm chart (helm/mig-operator) offline, with the helm binary scripts/control-plane builds.

No cluster is needed here: these tests lint, render and schema-check the chart, and compare it with
the code it deploys. tests/e2e/test_chart.py installs it into the local control plane.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from helm_chart import CHART_DIR, bin_dir

Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def helm() -> Callable[..., subprocess.CompletedProcess]:
    """``helm(*args)`` runs the cached helm binary; a missing binary fails (never skips) the test."""
    binary = bin_dir() / "helm"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run `scripts/control-plane build` (make test does)", pytrace=False)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    return run


@pytest.fixture(scope="session")
def render(helm: Callable[..., subprocess.CompletedProcess]) -> Render:
    """``render("--set", "a=b", release="r", namespace="ns")``: the chart's objects as dicts."""

    def run(*args: str, release: str = "mig-operator", namespace: str = "mig-operator") -> list[dict[str, Any]]:
        out = helm("template", release, str(CHART_DIR), "--namespace", namespace, *args).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return run
