"""The client rate limiters of kube-scheduler and kube-controller-manager are the cluster admin's:
`scripts/control-plane up --scheduler-qps N --scheduler-burst N` (and --controller-manager-*) hands
them to the program (--kube-api-qps/--kube-api-burst), bad values stop `up` before anything starts,
and bench/pod_latency.py takes the same flags."""

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
    (["--controller-manager-qps", "fast"], "'fast'"),
    (["--controller-manager-burst=0"], "'0'"),
    (["--controller-manager-burst"], "needs a value"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_UP_FLAGS, ids=[" ".join(f) for f, _ in BAD_UP_FLAGS])
def test_a_bad_limit_stops_up_with_one_line_and_exit_2(tmp_path: Path, flags: list[str], named: str):
    state = tmp_path / "state"
    result = control_plane(state, "up", "--with", "scheduler,controller-manager,kwok", *flags, timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and f"e.g. {flags[0].split('=')[0]} " in lines[0]
    assert result.stdout == ""
    assert not state.exists(), "nothing may start (or be prepared) on a bad flag"


@pytest.mark.parametrize(("flag", "component"), [("--scheduler-qps", "scheduler"),
                                               ("--controller-manager-burst", "controller-manager")])
def test_limits_of_a_program_not_started_are_refused(tmp_path: Path, flag: str, component: str):
    state = tmp_path / "state"
    result = control_plane(state, "up", "--with", "kwok", flag, "1000", timeout=30)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and f"--with {component}" in result.stderr
    assert not state.exists()


def limit_args(state: Path, program: str) -> set[str]:
    """The --kube-api-* flags on a running program's own command line, read from /proc by the pid
    `up` recorded."""
    pid = (state / "pids" / program).read_text().split()[0]
    return {a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a.startswith("--kube-api-")}


@pytest.mark.parametrize(("flags", "scheduler", "controller_manager"), [
    (["--scheduler-qps", "1000", "--scheduler-burst", "2000"], {"--kube-api-qps=1000", "--kube-api-burst=2000"}, set()),
    (["--scheduler-burst=300", "--controller-manager-qps", "12.5"], {"--kube-api-burst=300"}, {"--kube-api-qps=12.5"}),
    ([], set(), set()),  # the programs' own defaults: no limit flag at all
], ids=["scheduler", "both", "none"])
def test_the_limits_reach_the_programs(tmp_path: Path, flags: list[str], scheduler: set[str],
                                       controller_manager: set[str]):
    state = tmp_path / "state"
    up = control_plane(state, "up", "--with", "scheduler,controller-manager", *flags)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert limit_args(state, "kube-scheduler") == scheduler
        assert limit_args(state, "kube-controller-manager") == controller_manager
        status = control_plane(state, "status").stdout
        assert "kube-scheduler running" in status and "kube-controller-manager running" in status
    finally:
        assert control_plane(state, "down").returncode == 0


@pytest.mark.parametrize(("flag", "value"), [("--scheduler-qps", "0"), ("--scheduler-qps", "x"),
                                             ("--scheduler-burst", "2.5"), ("--scheduler-burst", "0"),
                                             ("--controller-manager-qps", "1e10")])
def test_the_benchmark_refuses_a_bad_limit_before_starting(flag: str, value: str):
    # A state dir that does not exist: had the flags been accepted, `up` would have failed differently.
    env = dict(os.environ, MIG_OPERATOR_RUN="/nonexistent/state")
    result = subprocess.run([sys.executable, str(REPO / "bench" / "pod_latency.py"), flag, value],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert f"'{value}'" in result.stderr.strip().splitlines()[-1]
    assert "e.g." in result.stderr
