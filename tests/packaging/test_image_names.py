"""`make image` and the chart name the same image: scripts/image tags the operator with the chart's
appVersion, and the chart's default values (image.repository, image.tag empty) pull exactly that name,
so `ctr -n k8s.io images import` of the archive and `helm install` meet without --set.

Each side is read on its own: the script's name from `scripts/image env`, the chart's from Chart.yaml
and from `helm template` with the default values.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "mig-operator"
CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"


def script_env(script: str) -> dict[str, str]:
    out = subprocess.run([str(REPO_ROOT / "scripts" / script), "env"], capture_output=True, text=True, timeout=60,
                         check=True, env={k: v for k, v in os.environ.items() if k != "MIG_OPERATOR_RUN"})
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def cri_name(ref: str) -> str:
    """A Docker image reference as containerd's CRI resolves it: a bare name is docker.io/library/NAME,
    a first path part without a dot, a colon or `localhost` is a Docker Hub namespace."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def test_make_image_tags_the_operator_with_the_charts_app_version() -> None:
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    name, _, tag = script_env("image")["OPERATOR_IMAGE"].rpartition(":")
    assert (name, tag) == ("docker.io/library/mig-operator", str(app_version))


def test_the_charts_default_images_are_the_one_make_image_builds() -> None:
    helm = Path(script_env("control-plane")["BIN_DIR"]) / "helm"
    if not helm.exists():
        pytest.fail(f"{helm} is missing: run `scripts/control-plane build` (make test does)", pytrace=False)
    out = subprocess.run([str(helm), "template", "mig-operator", str(CHART_DIR), "--namespace", "mig-operator"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    images = {c["image"] for doc in yaml.safe_load_all(out) if doc and doc.get("kind") in ("Deployment", "DaemonSet")
              for key in ("containers", "initContainers")
              for c in doc["spec"]["template"]["spec"].get(key) or []}
    assert images, "the chart renders no workload"
    assert {cri_name(image) for image in images} == {script_env("image")["OPERATOR_IMAGE"]}
