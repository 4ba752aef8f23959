"""The node's MPS host with NVIDIA's own control daemon on a real GPU.

``mig-operator mps-host`` (the chart's per-node MPS pod) starts a GPU's daemon when an agent asks
(``HostedMps.start`` writes the request and waits for an answer). Checked here with the real
``nvidia-cuda-mps-control``, not the stand-in the other suites use:

- an agent that asked and then exited leaves the daemon running and answering: the daemon is the
  host's, not the asking process's;
- a second host process (the MPS pod replaced, or the host restarted) adopts the running daemon: the
  PID the daemon wrote in its pipe directory is the same, and that process's environment names the
  pipe directory (what the host reads to tell a live daemon from a stale PID file);
- a stop through ``HostedMps`` ends the daemon, and the host does not start it again.

The daemon is stopped at the end whatever happens. Skipped without a GPU, or where every GPU is in MIG
mode (compute shares need one that is not).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PID_FILE = "nvidia-cuda-mps-control.pid"


@pytest.fixture
def mps_root() -> Iterator[Path]:
    # The daemon's control socket lives in the pipe directory: keep the path short (a socket path
    # holds at most 107 bytes).
    path = Path(tempfile.mkdtemp(prefix="mpsh-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_host(root: Path, log: Path) -> subprocess.Popen:
    out = log.open("a")
    return subprocess.Popen([sys.executable, "-m", "mig_operator.cli", "mps-host", "--backend", "nvml",
                             "--mps-dir", str(root)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_host(host: subprocess.Popen) -> None:
    if host.poll() is None:
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(10)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait(10)


def ask_from_another_process(root: Path, uuid: str) -> None:
    """An agent's ``HostedMps.start`` in a process that exits right after (the agent pod replaced)."""
    code = ("import sys; from mig_operator.gpu.mps import HostedMps, mps_for_backend; "
            "HostedMps(mps_for_backend('nvml', sys.argv[1])).start(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(root), uuid], cwd=REPO, check=True, timeout=60)


def daemon_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def test_the_mps_host_runs_nvidias_daemon_for_an_agent_that_left_and_adopts_it_when_replaced(
        gpu: str, mps_root: Path) -> None:
    from mig_operator.gpu import open_backend
    from mig_operator.gpu.mps import HostedMps, mps_for_backend

    backend = open_backend("nvml")
    try:
        serving = [g for g in backend.gpus() if not g.mig_enabled]
    finally:
        backend.close()
    if not serving:
        pytest.skip("every GPU here is in MIG mode; compute shares need one that is not")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed here")
    uuid = serving[0].uuid
    daemons = mps_for_backend("nvml", str(mps_root))
    pipe = Path(daemons.dirs(uuid).pipe)
    log = mps_root.parent / f"{mps_root.name}.host.log"
    host = start_host(mps_root, log)
    second: subprocess.Popen | None = None
    try:
        ask_from_another_process(mps_root, uuid)
        # The asking process is gone; the daemon is the host's and answers.
        assert daemons.running(uuid), log.read_text()
        first = daemon_pid(pipe)
        assert first is not None, f"no live daemon PID in {pipe}: {sorted(os.listdir(pipe))}"
        environ = Path(f"/proc/{first}/environ").read_bytes().split(b"\0")
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ
        assert float(daemons.command(uuid, "get_default_active_thread_percentage")) == 100.0

        # The host replaced: the new one adopts the daemon (same PID, still answering), and starts none.
        stop_host(host)
        second = start_host(mps_root, log)
        time.sleep(2.0)  # four passes of the new host
        assert daemon_pid(pipe) == first
        assert daemons.running(uuid)

        # A stop through the agent's side ends it; the host does not bring it back.
        HostedMps(daemons).stop(uuid)
        deadline = time.monotonic() + 15
        while daemon_pid(pipe) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon_pid(pipe) is None
        time.sleep(1.5)
        assert daemon_pid(pipe) is None and not daemons.running(uuid), log.read_text()
    finally:
        for proc in (host, second):
            if proc is not None:
                stop_host(proc)
        if daemons.running(uuid):
            daemons.stop(uuid)
