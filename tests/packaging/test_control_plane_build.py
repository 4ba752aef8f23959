"""`scripts/control-plane build --for LIST` (what `make demo` and `up --with LIST` ask for) builds only
what `up --with LIST` starts; plain `build` (make test, make control-plane) builds everything.

Checked on a cache of stand-in binaries with GO=/bin/false: a build that wants anything missing fails
at once instead of compiling, so a success means nothing more was wanted.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"
# What the demo starts: kube-apiserver, etcd (and kubectl to talk to them) plus these.
DEMO_COMPONENTS = "scheduler,controller-manager,kwok"
DEMO_BINS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "etcd", "kwok")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache holding the demo's binaries and kwok's stages, and helm; no hollow-node, no cdi-validate."""
    settings = subprocess.run([str(CONTROL_PLANE), "env"], capture_output=True, text=True, timeout=60, check=True)
    version = dict(line.split("=", 1) for line in settings.stdout.splitlines())["K8S_VERSION"]
    bin_dir = tmp_path / "k8s" / version / "bin"
    bin_dir.mkdir(parents=True)
    for name in (*DEMO_BINS, "helm"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name}\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "k8s" / version / "kwok-stages").mkdir()
    return tmp_path


def build(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MIG_OPERATOR_RUN", "MIG_OPERATOR_K8S_VERSION")}
    env.update(MIG_OPERATOR_CACHE=str(cache), GO="/bin/false")
    return subprocess.run([str(CONTROL_PLANE), "build", *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_demos_build_wants_nothing_the_demo_does_not_start(cache: Path) -> None:
    scoped = build(cache, "--for", DEMO_COMPONENTS)
    assert scoped.returncode == 0, scoped.stderr
    assert "already cached" in scoped.stderr


def test_the_full_build_still_wants_hollow_node_and_cdi_validate(cache: Path) -> None:
    full = build(cache)
    assert full.returncode != 0  # it went on to compile what the stand-in cache lacks
    assert "already cached" not in full.stderr


@pytest.mark.parametrize("missing", ["kwok", "etcd", "kube-apiserver"])
def test_the_demos_build_wants_each_binary_the_demo_starts(cache: Path, missing: str) -> None:
    (next(cache.glob("k8s/*/bin")) / missing).unlink()
    assert build(cache, "--for", DEMO_COMPONENTS).returncode != 0


def test_a_listed_hollow_node_is_wanted_too(cache: Path) -> None:
    assert build(cache, "--for", f"{DEMO_COMPONENTS},hollow-node").returncode != 0


def test_an_unknown_component_is_a_usage_error(cache: Path) -> None:
    bad = build(cache, "--for", "scheduler,kubelet")
    assert bad.returncode == 2
    assert "kubelet" in bad.stderr


# ---- Karpenter's kwok provider: one build in the cache shared by every Kubernetes version ----------------


def karpenter_dir(cache: Path) -> Path:
    found = re.search(r"^KARPENTER_VERSION=(\S+)$", CONTROL_PLANE.read_text(), re.MULTILINE)
    assert found
    return cache / "karpenter" / found[1]


def stand_in_karpenter(cache: Path) -> None:
    """A stand-in binary and the five CRD files Karpenter's build leaves in the cache."""
    directory = karpenter_dir(cache)
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "karpenter").write_text("#!/bin/sh\necho karpenter\n")
    (directory / "bin" / "karpenter").chmod(0o755)
    (directory / "crds").mkdir()
    for crd in ("karpenter.sh_nodepools.yaml", "karpenter.sh_nodeclaims.yaml", "karpenter.sh_nodeoverlays.yaml",
                "autoscaling.x-k8s.io_capacitybuffers.yaml", "karpenter.kwok.sh_kwoknodeclasses.yaml"):
        (directory / "crds" / crd).write_text("")


def test_karpenter_is_built_when_listed(cache: Path) -> None:
    assert build(cache, "--for", "karpenter").returncode != 0
    stand_in_karpenter(cache)
    scoped = build(cache, "--for", "karpenter")
    assert scoped.returncode == 0, scoped.stderr
    assert "'up --with scheduler,controller-manager,kwok,karpenter'" in scoped.stderr


def test_karpenter_wants_kwok_beside_it(cache: Path) -> None:
    stand_in_karpenter(cache)
    (next(cache.glob("k8s/*/bin")) / "kwok").unlink()
    assert build(cache, "--for", "karpenter").returncode != 0


def current_stand_in(cache: Path, name: str, source: str) -> None:
    """A stand-in for a tool of tools/ that the script takes as built from the current source: its
    fingerprint, the sha256 of the tool's .go, go.mod and go.sum files in name order (source_hash)."""
    tool = REPO_ROOT / source
    files = sorted(f.name for f in tool.iterdir()
                   if f.is_file() and (f.suffix == ".go" or f.name in ("go.mod", "go.sum")))
    digest = hashlib.sha256(b"".join((tool / f).read_bytes() for f in files)).hexdigest()
    path = next(cache.glob("k8s/*/bin")) / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    path.with_name(f"{name}.source-sha256").write_text(digest + "\n")


def test_karpenter_is_not_part_of_everything(cache: Path) -> None:
    """Plain `build` (make test) leaves Karpenter out; `build --with karpenter` adds it to everything."""
    current_stand_in(cache, "hollow-node", "tools/hollow-node")
    current_stand_in(cache, "cdi-validate", "tools/cdi-validate")
    plain = build(cache)
    assert plain.returncode == 0, plain.stderr
    assert build(cache, "--with", "karpenter").returncode != 0
    stand_in_karpenter(cache)
    with_karpenter = build(cache, "--with", "karpenter")
    assert with_karpenter.returncode == 0, with_karpenter.stderr


def test_an_unknown_with_is_a_usage_error(cache: Path) -> None:
    bad = build(cache, "--with", "node,autoscaler")
    assert bad.returncode == 2
    assert "autoscaler" in bad.stderr
