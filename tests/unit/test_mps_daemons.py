"""gpu/mps.py's daemon control on the simulator's stand-in (the same program interface as NVIDIA's
nvidia-cuda-mps-control): start, adopt, hold, stop; and its refusals. The daemon is looked at from
outside (its PID file, its process, its control socket)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mig_operator.gpu.mps import MpsDaemons, MpsError, mps_dirs, mps_for_backend

UUID = "GPU-5d3c7e4a-1b2c-4d5e-8f9a-0b1c2d3e4f5a"


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mps-"))  # a unix socket path holds 107 bytes
    yield path
    pipe = path / UUID / "pipe"
    if (pipe / "control").exists():
        MpsDaemons(str(path), (sys.executable, "-m", "mig_operator.gpu.mps_standin"), private_shm=False).stop(UUID)


def pid_of(root: Path) -> int | None:
    try:
        pid = int((root / UUID / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    except FileNotFoundError:
        return None
    return pid if os.path.exists(f"/proc/{pid}") else None


def ask(root: Path, line: str) -> str:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(root / UUID / "pipe" / "control"))
        with conn.makefile("rw") as stream:
            stream.write(line + "\n")
            stream.flush()
            return stream.readline().strip()


def test_start_adopt_hold_and_stop(root: Path) -> None:
    daemons = mps_for_backend("sim:l4-24gb", str(root))
    assert not daemons.running(UUID) and pid_of(root) is None
    daemons.start(UUID)
    first = pid_of(root)
    assert first is not None and daemons.running(UUID)
    assert {p.name for p in (root / UUID).iterdir()} == {"pipe", "log", "shm"}
    assert (root / UUID / "shm").stat().st_mode & 0o7777 == 0o1777
    # another agent (restarted) finds it and does not start a second one
    again = mps_for_backend("sim:l4-24gb", str(root))
    assert again.running(UUID)
    again.start(UUID)
    assert pid_of(root) == first
    again.hold(UUID, 75, 6 * 2**30)
    assert ask(root, "get_default_active_thread_percentage") == "75.0"
    assert ask(root, "get_default_device_pinned_mem_limit 0") == "6144M"
    assert "control daemon started for " + UUID in (root / UUID / "log" / "control.log").read_text()
    again.stop(UUID)
    assert not again.running(UUID) and pid_of(root) is None
    assert not (root / UUID / "pipe").exists() and not (root / UUID / "log").exists()
    again.stop(UUID)  # nothing running: nothing to do


def test_a_daemon_that_cannot_start_is_an_mps_error_naming_the_gpu(root: Path) -> None:
    missing = MpsDaemons(str(root), ("/nonexistent/nvidia-cuda-mps-control",), private_shm=False)
    with pytest.raises(MpsError, match=f"cannot start the MPS control daemon of {UUID}"):
        missing.start(UUID)
    (root / "other").mkdir()
    (root / "other" / UUID).write_text("a file where the GPU's directory goes")
    blocked = mps_for_backend("sim:l4-24gb", str(root / "other"))
    with pytest.raises(MpsError, match="cannot make the MPS directories"):
        blocked.start(UUID)


def test_the_nvml_backend_uses_nvidias_program_in_a_namespace_of_its_own() -> None:
    real = mps_for_backend("nvml", "/var/lib/mig-operator/mps")
    assert real.program == ("nvidia-cuda-mps-control",) and real.private_shm


@pytest.mark.parametrize("bad", ["../etc", "GPU-a/b", "", "MIG-5d3c7e4a"])
def test_the_directories_of_a_uuid_that_is_not_one_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a GPU UUID"):
        mps_dirs("/var/lib/mig-operator/mps", bad)


def test_hold_refuses_a_percentage_outside_1_to_100(root: Path) -> None:
    with pytest.raises(ValueError, match="thread percentage 0 is not 1..100"):
        mps_for_backend("sim:l4-24gb", str(root)).hold(UUID, 0, 2**30)
