"""Fixtures for end-to-end tests against a real local control plane (scripts/control-plane).

One control plane serves the whole session (under pytest-xdist, each worker's session): etcd,
kube-apiserver, kube-scheduler, kube-controller-manager and kwok (fake nodes annotated
``kwok.x-k8s.io/node=fake``), all on 127.0.0.1. The scheduler and controller-manager are included so
that pods get bound, namespaces finish deleting and owner references cascade, as on a real cluster;
starting them costs about a second. The first run builds the binaries (see docs/control-plane.md; run
``scripts/control-plane build`` beforehand to see its progress).

If the control plane cannot start, every e2e test fails with the tail of its log: these tests
never skip because the cluster is missing.

Where the control plane lives (its state dir, see scripts/control-plane):
  default                      a private temporary dir per session, stopped at the end, so two
                               sessions (two developers, CI jobs) never share or stop each
                               other's cluster
  MIG_OPERATOR_KEEP_CLUSTER=1  the script's default dir (/tmp/mig-operator-cp), left running after
                               the session and reused by the next one: fast iteration
  MIG_OPERATOR_RUN=DIR         that dir; a plane already running there is reused and left running
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster import REPO_ROOT, ChartIdentities, KubeCluster, apply_chart_identities

CONTROL_PLANE = REPO_ROOT / "scripts" / "control-plane"
E2E_DIR = Path(__file__).resolve().parent
COMPONENTS = "scheduler,controller-manager,kwok"
# A cold build takes 9-11 min on 2 cores (docs/control-plane.md), a warm `up` about 7 s.
UP_TIMEOUT_S = 3600
LOG_TAIL_LINES = 60


def _state_dir() -> str | None:
    """The control plane's state dir for this session; None means the script's default. Under
    pytest-xdist a named dir gets the worker's id, so that workers never share a plane."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if "MIG_OPERATOR_RUN" in os.environ:
        return f"{os.environ['MIG_OPERATOR_RUN']}-{worker}" if worker else os.environ["MIG_OPERATOR_RUN"]
    if os.environ.get("MIG_OPERATOR_KEEP_CLUSTER") == "1":
        return f"/tmp/mig-operator-cp-{worker}" if worker else None
    # A subdir, so that the script's lock file (kept beside the state dir) goes away with it too.
    return os.path.join(tempfile.mkdtemp(prefix="mig-operator-cp-"), "state")


def _control_plane(
    *args: str, state_dir: str | None, log_path: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run scripts/control-plane; with log_path its stderr (progress, log tails) goes there."""
    env = dict(os.environ)
    if state_dir is not None:
        env["MIG_OPERATOR_RUN"] = state_dir
    if log_path is None:
        return subprocess.run([str(CONTROL_PLANE), *args], env=env, capture_output=True, text=True, timeout=timeout)
    with log_path.open("w") as log:
        return subprocess.run(
            [str(CONTROL_PLANE), *args], env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout
        )


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _running_processes(state_dir: str | None) -> frozenset[str]:
    status = _control_plane("status", state_dir=state_dir)
    return frozenset(line.split()[0] for line in status.stdout.splitlines() if line.split()[1:2] == ["running"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e is an e2e test, so `-m "not e2e"` deselects them all."""
    for item in items:
        if E2E_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """Start (building first if needed) the local control plane once per session.

    It also points KUBECONFIG at it and puts kubectl and helm on PATH for the session, so that
    code under test (kopf, subprocesses) talks to this cluster and nothing else.
    """
    state_dir = _state_dir()
    already_running = "kube-apiserver" in _running_processes(state_dir)
    log_path = tmp_path_factory.mktemp("control-plane") / "up.log"
    try:
        up = _control_plane("up", "--with", COMPONENTS, state_dir=state_dir, log_path=log_path, timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"scripts/control-plane up timed out after {UP_TIMEOUT_S} s; last lines of {log_path}:\n" + _tail(log_path),
            pytrace=False,
        )
    last_line = up.stdout.strip().splitlines()[-1] if up.stdout.strip() else ""
    if up.returncode != 0 or not last_line.startswith("KUBECONFIG="):
        pytest.fail(
            f"scripts/control-plane up failed (exit {up.returncode}); last lines of {log_path}:\n" + _tail(log_path),
            pytrace=False,
        )
    env = dict(
        line.split("=", 1) for line in _control_plane("env", state_dir=state_dir).stdout.splitlines() if "=" in line
    )
    cluster = KubeCluster(
        kubeconfig=Path(last_line.removeprefix("KUBECONFIG=")),
        bin_dir=Path(env["BIN_DIR"]),
        k8s_version=env["K8S_VERSION"],
        running=_running_processes(state_dir),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        patch.setenv("PATH", f"{cluster.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        yield cluster
    if cluster._api_client is not None:
        cluster._api_client.close()
    if already_running or os.environ.get("MIG_OPERATOR_KEEP_CLUSTER") == "1":
        return
    down = _control_plane("down", state_dir=state_dir)
    if down.returncode != 0:
        raise RuntimeError(f"scripts/control-plane down failed:\n{down.stderr}")
    if "MIG_OPERATOR_RUN" not in os.environ:
        shutil.rmtree(os.path.dirname(state_dir), ignore_errors=True)


@pytest.fixture(scope="session")
def kubectl(kube_cluster: KubeCluster) -> Callable[..., subprocess.CompletedProcess]:
    """``kubectl("get", "ns")`` runs the cached kubectl against the session's cluster."""
    return kube_cluster.kubectl


@pytest.fixture(scope="session")
def operator_crds(kube_cluster: KubeCluster) -> None:
    """Every CRD and policy in crds/ (GpuSlice, GpuNode, kopf peering), applied once per session."""
    from harness import apply_crds

    apply_crds(kube_cluster)


@pytest.fixture
def operator(kube_cluster: KubeCluster, operator_crds: None, chart_identities: ChartIdentities,
             tmp_path: Path) -> Iterator[Any]:
    """An OperatorHarness: kwok nodes, agents on simulated GPUs and a controller, all stopped (and
    their nodes, inventories and namespaces removed) at the end. A failing test prints their logs.

    The controller and the agents run as the Helm chart's ServiceAccounts, with exactly the chart's
    RBAC (``chart_identities``), so a verb missing from the chart fails the test that needs it. The
    webhook configuration gets the name the chart's RBAC lets the controller patch. The test's own
    calls (nodes, slices, pods, reading state) keep the admin kubeconfig."""
    from harness import OperatorHarness

    harness = OperatorHarness(kube_cluster, tmp_path)
    harness.kubeconfigs = dict(chart_identities.kubeconfigs)
    harness.webhook_config = chart_identities.webhook_config
    yield harness
    # Some RBAC refusals only reach the logs (kopf retries them, Events are best effort): any fails.
    refused = [f"{proc.name}: {line}" for proc in harness.procs if proc.log.exists()
               for line in proc.log.read_text(errors="replace").splitlines() if RBAC_REFUSAL.search(line)
               and not harness.api_server_restarted]
    harness.close()
    assert not refused, "the chart's RBAC refused a call:\n" + "\n".join(refused[:10])


# ---- the chart's identities -------------------------------------------------------------------------

# How the API server words an RBAC refusal (not other 403s, such as writes into a terminating namespace).
RBAC_REFUSAL = re.compile(r'is forbidden: User "[^"]*" cannot ')


@pytest.fixture(scope="session")
def chart_identities(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> ChartIdentities:
    """The chart's ServiceAccounts and RBAC in the session's cluster (``cluster.apply_chart_identities``).
    Left in place at the end: applying is idempotent, and a kept control plane serves the next session
    with the same objects."""
    return apply_chart_identities(kube_cluster, tmp_path_factory.mktemp("chart-identities"))


# ---- the CDI validator --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cdi_validate() -> Path:
    """tools/cdi-validate, the official CDI library as a checker of CDI specs, built (seconds, no
    Kubernetes build) by ``scripts/control-plane build cdi-validate`` into the cache's bin dir.
    ``[str(cdi_validate), "--cdi-dir", DIR, "gpu.cdmo.io/slice=<uid>"]`` prints, as JSON, the env,
    mounts and device nodes a container would get (docs/control-plane.md)."""
    build = _control_plane("build", "cdi-validate", state_dir=None, timeout=UP_TIMEOUT_S)
    if build.returncode != 0:
        pytest.fail(f"scripts/control-plane build cdi-validate failed:\n{build.stderr}", pytrace=False)
    env = dict(line.split("=", 1) for line in _control_plane("env", state_dir=None).stdout.splitlines() if "=" in line)
    return Path(env["CDI_VALIDATE"])


# ---- a plane of the oldest supported release, for an in-place upgrade ---------------------------------


def _script_setting(name: str) -> str:
    """The value of a ``NAME=value`` line of scripts/control-plane (K8S_OLDEST_VERSION), as the Makefile reads it."""
    found = re.search(rf"^{name}=(\S+)$", CONTROL_PLANE.read_text(), re.MULTILINE)
    assert found, f"{name} in {CONTROL_PLANE}"
    return found[1]


@dataclass
class UpgradablePlane:
    """A private control plane started at ``from_version`` that ``upgrade`` takes to ``to_version`` in
    place (``scripts/control-plane upgrade``: kube-apiserver, kube-controller-manager, kube-scheduler
    replaced, etcd and kwok kept); ``cluster`` follows it."""

    cluster: KubeCluster
    state_dir: str
    from_version: str
    to_version: str
    log_dir: Path

    def upgrade(self) -> None:
        log_path = self.log_dir / "upgrade.log"
        try:
            done = _control_plane("upgrade", self.to_version, state_dir=self.state_dir, log_path=log_path,
                                  timeout=UP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"scripts/control-plane upgrade timed out; last lines of {log_path}:\n" + _tail(log_path),
                        pytrace=False)
        if done.returncode != 0:
            pytest.fail(f"scripts/control-plane upgrade failed (exit {done.returncode}); last lines of {log_path}:\n"
                        + _tail(log_path), pytrace=False)
        self.cluster.k8s_version = self.to_version
        self.cluster.bin_dir = self.cluster.bin_dir.parents[1] / self.to_version / "bin"


@dataclass
class PrivatePlane:
    """A control plane of a test module's own: its KubeCluster, state dir and the dir of its scripts' logs."""

    cluster: KubeCluster
    state_dir: str
    log_dir: Path


@contextlib.contextmanager
def private_plane(tmp_path_factory: pytest.TempPathFactory, name: str, components: str,
                  k8s_version: str | None = None) -> Iterator[PrivatePlane]:
    """``up --with components`` in a fresh state dir (at ``k8s_version``, else the script's default),
    stopped and removed at the end; the session's plane is not touched."""
    state_dir = os.path.join(tempfile.mkdtemp(prefix=f"mig-operator-{name}-cp-"), "state")
    log_dir = tmp_path_factory.mktemp(f"{name}-plane")
    log_path = log_dir / "up.log"
    try:
        with pytest.MonkeyPatch.context() as patch:
            if k8s_version is not None:
                patch.setenv("MIG_OPERATOR_K8S_VERSION", k8s_version)
            try:
                up = _control_plane("up", "--with", components, state_dir=state_dir, log_path=log_path,
                                    timeout=UP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"scripts/control-plane up --with {components} timed out after {UP_TIMEOUT_S} s:\n"
                            + _tail(log_path), pytrace=False)
            env = dict(line.split("=", 1) for line in _control_plane("env", state_dir=state_dir).stdout.splitlines()
                       if "=" in line)
        last_line = up.stdout.strip().splitlines()[-1] if up.stdout.strip() else ""
        if up.returncode != 0 or not last_line.startswith("KUBECONFIG="):
            pytest.fail(f"scripts/control-plane up --with {components} ({env['K8S_VERSION']}) failed "
                        f"(exit {up.returncode}):\n" + _tail(log_path), pytrace=False)
        cluster = KubeCluster(kubeconfig=Path(last_line.removeprefix("KUBECONFIG=")), bin_dir=Path(env["BIN_DIR"]),
                              k8s_version=env["K8S_VERSION"], running=_running_processes(state_dir))
        yield PrivatePlane(cluster, state_dir, log_dir)
        if cluster._api_client is not None:
            cluster._api_client.close()
    finally:
        _control_plane("down", state_dir=state_dir)
        shutil.rmtree(os.path.dirname(state_dir), ignore_errors=True)


@pytest.fixture(scope="module")
def upgradable_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpgradablePlane]:
    """A control plane of its own (scheduler, controller-manager, kwok) at K8S_OLDEST_VERSION, for tests
    that upgrade it to K8S_DEFAULT_VERSION; stopped at the end. The session's plane is not touched."""
    oldest, newest = _script_setting("K8S_OLDEST_VERSION"), _script_setting("K8S_DEFAULT_VERSION")
    with private_plane(tmp_path_factory, "upgrade", COMPONENTS, k8s_version=oldest) as plane:
        yield UpgradablePlane(plane.cluster, plane.state_dir, oldest, newest, plane.log_dir)


# ---- a plane with a real node autoscaler ---------------------------------------------------------------

KARPENTER_COMPONENTS = f"{COMPONENTS},karpenter"


@pytest.fixture(scope="module")
def karpenter_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """A control plane of its own with Karpenter's kwok provider (``up --with ...,karpenter``: its CRDs,
    CapacityBuffer enabled, the GPU node shapes of scripts/karpenter/gpu-instance-types.json) and no
    node; tests/e2e/autoscaler.py applies NodePools to it. Stopped at the end."""
    with private_plane(tmp_path_factory, "karpenter", KARPENTER_COMPONENTS) as plane:
        yield plane.cluster
