"""The node's MPS host (``mig-operator mps-host``, gpu/mps.py's ``serve_starts``) and the agent's side of
it (``HostedMps``), on the simulator's stand-in: the host, a process of its own, starts a GPU's daemon
when asked through the GPU's directory, starts it again when it dies, leaves it stopped once the agent
stops it, and says why it cannot start one; without a host, nothing starts it. The daemon is looked at
from outside (its PID file, its process, its control socket)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mig_operator.gpu.mps import HostedMps, MpsError, mps_for_backend

UUID = "GPU-5d3c7e4a-1b2c-4d5e-8f9a-0b1c2d3e4f5a"


def pid_of(root: Path) -> int | None:
    try:
        pid = int((root / UUID / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None
    try:
        return pid if b"mps_standin" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except FileNotFoundError:
        return None


def wait_for(check, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s")


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mpsh-"))  # a unix socket path holds 107 bytes
    yield path
    pid = pid_of(path)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def host(root: Path) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", "mps-host", "--backend", "sim:l4-24gb",
                             "--mps-dir", str(root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(15)


def test_the_host_starts_restarts_and_leaves_stopped_what_the_agent_asks(root: Path, host: subprocess.Popen) -> None:
    agent = HostedMps(mps_for_backend("sim:l4-24gb", str(root)))
    assert not agent.running(UUID)
    agent.start(UUID)
    first = pid_of(root)
    assert first is not None and agent.running(UUID)
    agent.hold(UUID, 40, 3 * 2**30)  # the agent talks to the host's daemon over its pipe
    assert agent.daemons.command(UUID, "get_default_active_thread_percentage") == "40.0"
    # Another agent (the next pod) adopts it: asking again starts no second daemon.
    HostedMps(mps_for_backend("sim:l4-24gb", str(root))).start(UUID)
    assert pid_of(root) == first
    # It dies: the host starts it again, no agent asking.
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: (p := pid_of(root)) is not None and p != first and p)
    assert agent.running(UUID)
    # Stopped by the agent: the host leaves it stopped.
    agent.stop(UUID)
    assert pid_of(root) is None and not (root / UUID / "start").exists()
    time.sleep(2)  # four of the host's passes
    assert pid_of(root) is None and not agent.running(UUID)
    assert second != first
    assert host.poll() is None


def test_a_pid_file_left_by_an_earlier_pods_daemon_does_not_pass_for_a_daemon(root: Path,
                                                                               host: subprocess.Popen) -> None:
    # The daemon of an earlier pod died with it; its PID, in this pod's namespace, is another process
    # (here the host itself, whose command line names MPS too).
    pipe = root / UUID / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{host.pid}\n")
    agent = HostedMps(mps_for_backend("sim:l4-24gb", str(root)))
    agent.start(UUID)
    started = pid_of(root)
    assert started is not None and started != host.pid
    agent.stop(UUID)


def test_the_host_says_why_it_cannot_start_a_daemon(root: Path, host: subprocess.Popen) -> None:
    (root / UUID).mkdir()
    (root / UUID / "pipe").write_text("a file where the pipe directory goes")
    agent = HostedMps(mps_for_backend("sim:l4-24gb", str(root)))
    with pytest.raises(MpsError, match=f"cannot make the MPS directories of {UUID}"):
        agent.start(UUID)
    (root / UUID / "pipe").unlink()
    agent.start(UUID)  # the next request, once the cause is gone
    assert pid_of(root) is not None and not (root / UUID / "start-error").exists()
    agent.stop(UUID)


def test_without_a_host_no_daemon_starts_and_the_error_says_where_to_look(root: Path) -> None:
    agent = HostedMps(mps_for_backend("sim:l4-24gb", str(root)), wait_s=1.0)
    with pytest.raises(MpsError, match=r"no MPS host started the MPS control daemon of .* within 1s.*mps-host"):
        agent.start(UUID)
    assert pid_of(root) is None


def test_the_host_refuses_a_bad_backend_in_one_line(root: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mig_operator.cli", "mps-host", "--backend", "cuda",
                           "--mps-dir", str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "mig-operator: --backend 'cuda' is neither nvml nor sim:MODEL; e.g. --backend nvml"
