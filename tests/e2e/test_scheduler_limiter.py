"""kube-scheduler's client rate limiter is the cluster admin's: `scripts/control-plane up
--scheduler-qps N --scheduler-burst N` hands it to kube-scheduler (--kube-api-qps/--kube-api-burst),
bad values stop `up` before anything starts, and bench/pod_latency.py takes the same flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = REPO / "scripts" / "control-plane"


def control_plane(state: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(CONTROL_PLANE), *args], env=dict(os.environ, MIG_OPERATOR_RUN=str(state)),
                          capture_output=True, text=True, timeout=timeout)


BAD_UP_FLAGS = [
    (["--scheduler-qps", "abc"], "'abc'"),
    (["--scheduler-qps", "0"], "'0'"),
    (["--scheduler-qps", "0.000"], "'0.000'"),
    (["--scheduler-qps", "-5"], "'-5'"),
    (["--scheduler-qps", "1e400"], "'1e400'"),
    (["--scheduler-qps="], "''"),
    (["--scheduler-qps"], "needs a value"),
    (["--scheduler-burst", "0"], "'0'"),
    (["--scheduler-burst", "1.5"], "'1.5'"),
    (["--scheduler-burst", "2147483648"], "'2147483648'"),  # kube-scheduler's burst is an int32
    (["--scheduler-burst", "-"], "'-'"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_UP_FLAGS, ids=[" ".join(f) for f, _ in BAD_UP_FLAGS])
def test_a_bad_limit_stops_up_with_one_line_and_exit_2(tmp_path: Path, flags: list[str], named: str):
    state = tmp_path / "state"
    result = control_plane(state, "up", "--with", "scheduler,kwok", *flags, timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and "e.g. --scheduler-" in lines[0]
    assert result.stdout == ""
    assert not state.exists(), "nothing may start (or be prepared) on a bad flag"


def test_limits_without_the_scheduler_are_refused(tmp_path: Path):
    state = tmp_path / "state"
    result = control_plane(state, "up", "--with", "kwok", "--scheduler-qps", "1000", timeout=30)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--with scheduler" in result.stderr
    assert not state.exists()


def scheduler_args(state: Path) -> list[str]:
    """The running kube-scheduler's own command line, read from /proc by the pid `up` recorded."""
    pid = (state / "pids" / "kube-scheduler").read_text().split()[0]
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.parametrize(("flags", "expected"), [
    (["--scheduler-qps", "1000", "--scheduler-burst", "2000"], {"--kube-api-qps=1000", "--kube-api-burst=2000"}),
    (["--scheduler-burst=300"], {"--kube-api-burst=300"}),
    ([], set()),  # kube-scheduler's own defaults: no limit flag at all
], ids=["both", "burst-only", "none"])
def test_the_limits_reach_kube_scheduler(tmp_path: Path, flags: list[str], expected: set[str]):
    state = tmp_path / "state"
    up = control_plane(state, "up", "--with", "scheduler", *flags)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        args = scheduler_args(state)
        assert {a for a in args if a.startswith("--kube-api-")} == expected
        assert "kube-scheduler running" in control_plane(state, "status").stdout
    finally:
        assert control_plane(state, "down").returncode == 0


@pytest.mark.parametrize(("flag", "value"), [("--scheduler-qps", "0"), ("--scheduler-qps", "x"),
                                             ("--scheduler-burst", "2.5"), ("--scheduler-burst", "0")])
def test_the_benchmark_refuses_a_bad_limit_before_starting(flag: str, value: str):
    # A state dir that does not exist: had the flags been accepted, `up` would have failed differently.
    env = dict(os.environ, MIG_OPERATOR_RUN="/nonexistent/state")
    result = subprocess.run([sys.executable, str(REPO / "bench" / "pod_latency.py"), flag, value],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert f"'{value}'" in result.stderr.strip().splitlines()[-1]
    assert "e.g." in result.stderr
