"""A real node for the node suite: `scripts/control-plane up --with node` (kubelet, containerd with CDI,
runc, CNI) in a private state dir, with the operator and workload images (`scripts/image`) imported into
its containerd.

Where the node cannot start on this machine (not root, no bridge, no overlayfs, no Go proxy to build
from) every test here is skipped with one line saying why; a node that was built but fails to start
fails the tests, with the tail of its log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"
IMAGE_SCRIPT = REPO_ROOT / "scripts" / "image"
BUILD_TIMEOUT_S = 3600


@dataclass
class RealNode:
    """The running plane and its node, as the tests see them."""

    kubeconfig: Path
    bin_dir: Path
    settings: dict[str, str]  # `scripts/control-plane env`: NODE_NAME, NODE_DIR, NODE_CDI_DIR, ...
    images: dict[str, str]  # `scripts/image env`: OPERATOR_IMAGE, WORKLOAD_IMAGE, ...
    state_dir: str
    _client: kubernetes.client.ApiClient | None = None

    @property
    def name(self) -> str:
        return self.settings["NODE_NAME"]

    @property
    def node_dir(self) -> Path:
        return Path(self.settings["NODE_DIR"])

    @property
    def api_client(self) -> kubernetes.client.ApiClient:
        if self._client is None:
            self._client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._client

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                                input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(self.bin_dir / "helm"), f"--kubeconfig={self.kubeconfig}", *args],
                                capture_output=True, text=True, timeout=600)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def control_plane(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return _run([str(CONTROL_PLANE), *args], self.state_dir, timeout)

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        """ctr against the node's containerd, in the kubelet's namespace."""
        return subprocess.run([self.settings["NODE_BIN_DIR"] + "/ctr", "--address",
                               self.settings["NODE_CONTAINERD_SOCKET"], "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, timeout=300)


def _run(cmd: list[str], state_dir: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, MIG_OPERATOR_RUN=state_dir)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _env(cmd: list[str], state_dir: str) -> dict[str, str]:
    out = _run([*cmd, "env"], state_dir, 60).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _why_not() -> str | None:
    """Why the node cannot run here, or None once its parts and the images are built (cached after the
    first time)."""
    state_dir = os.path.join(tempfile.gettempdir(), "mig-node-preflight")  # only read by `env`
    why = _env([str(CONTROL_PLANE)], state_dir).get("NODE_PREFLIGHT")
    if why:
        return f"the real node cannot start here: {why}"
    build = _run([str(CONTROL_PLANE), "build", "--with", "node"], state_dir, BUILD_TIMEOUT_S)
    if build.returncode != 0:
        return f"the real node's parts could not be built here: {_last_line(build.stderr)}"
    image = _run([str(IMAGE_SCRIPT), "build"], state_dir, BUILD_TIMEOUT_S)
    if image.returncode != 0:
        return f"the images could not be built here: {_last_line(image.stderr)}"
    return None


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: no build for tests not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Checked once, before any test runs, so that a node that cannot start here skips the whole
    suite with one line of `pytest -ra` (a skip mark folds into one report line; a skip from a
    fixture would print one per test)."""
    here = Path(__file__).resolve().parent
    mine = [item for item in items if here in Path(item.path).resolve().parents]
    if not mine:
        return
    why = _why_not()
    for item in mine:
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def node_kubeconfig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """$KUBECONFIG names the real node's plane while a test of it runs, and only then: the e2e tests a
    pytest-xdist worker runs after the node suite keep the session plane's (their admin token)."""
    if "real_node" in request.fixturenames:
        monkeypatch.setenv("KUBECONFIG", str(request.getfixturevalue("real_node").kubeconfig))


@pytest.fixture(scope="session")
def real_node() -> Iterator[RealNode]:
    # A short path: containerd's and the kubelet's sockets live under it (108-byte limit).
    state_dir = os.path.join(tempfile.mkdtemp(prefix="mig-node-"), "cp")
    settings = _env([str(CONTROL_PLANE)], state_dir)
    images = _env([str(IMAGE_SCRIPT)], state_dir)
    up = _run([str(CONTROL_PLANE), "up", "--with", "node"], state_dir, 600)
    last = _last_line(up.stdout)
    if up.returncode != 0 or not last.startswith("KUBECONFIG="):
        _run([str(CONTROL_PLANE), "down"], state_dir, 120)
        pytest.fail(f"scripts/control-plane up --with node failed (exit {up.returncode}):\n"
                    + "\n".join(up.stderr.splitlines()[-40:]), pytrace=False)
    node = RealNode(kubeconfig=Path(last.removeprefix("KUBECONFIG=")),
                    bin_dir=Path(settings["BIN_DIR"]), settings=_env([str(CONTROL_PLANE)], state_dir),
                    images=images, state_dir=state_dir)
    try:
        for archive in (images["OPERATOR_ARCHIVE"], images["WORKLOAD_ARCHIVE"]):
            result = node.ctr("images", "import", "--local", archive)
            assert result.returncode == 0, f"ctr images import {archive}: {result.stderr}"
        yield node
    finally:
        if node._client is not None:
            node._client.close()
        down = _run([str(CONTROL_PLANE), "down"], state_dir, 300)
        shutil.rmtree(os.path.dirname(state_dir), ignore_errors=True)
        assert down.returncode == 0, f"scripts/control-plane down failed:\n{down.stderr}"
