"""The health probes (kube/common/probes.py) as the kubelet asks them: GET /healthz and /readyz, 200 "ok"
or 500 naming each problem; the checks run on the part's event loop, and a loop that does not run them is
itself a liveness problem. The parts' --health-address flag: a bad value is one line and exit 2."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from probe_http import probe_get

from mig_operator.kube.common.probes import LIVE, READY, Probes, serve, tasks_alive
from mig_operator.kube.common.supervise import Loops
from mig_operator.kube.controller.main import ControllerOptions, build_registry


def _served(probes: Probes) -> tuple[int, object]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock.getsockname()[1], serve(sock, probes)


def test_a_liveness_problem_fails_healthz_naming_it_and_a_readiness_problem_fails_readyz_alone() -> None:
    live: list[str] = []
    ready: list[str] = []
    probes = Probes()
    probes.add(live=lambda: list(live), ready=lambda: list(ready))
    port, server = _served(probes)

    async def main() -> list[tuple[int, str]]:
        probes.attach()
        answers = []
        for problems_live, problems_ready in (([], []), (["event-sender-0: OSError: boom"], []),
                                              ([], ["the first full read of the books is not done yet"])):
            live[:], ready[:] = problems_live, problems_ready
            answers.append(await asyncio.to_thread(probe_get, port, LIVE))
            answers.append(await asyncio.to_thread(probe_get, port, READY))
        return answers

    try:
        answers = asyncio.run(main())
    finally:
        server.shutdown()  # type: ignore[attr-defined]
    assert answers == [
        (200, "ok"), (200, "ok"),
        (500, "event-sender-0: OSError: boom\n"), (200, "ok"),
        (200, "ok"), (500, "the first full read of the books is not done yet\n"),
    ]


def test_before_the_loop_runs_a_part_is_live_and_not_ready_and_an_unknown_path_is_404() -> None:
    probes = Probes()
    probes.add(live=lambda: ["never asked before the loop runs"])
    port, server = _served(probes)
    try:
        assert probe_get(port, LIVE) == (200, "ok")
        code, text = probe_get(port, READY)
        assert code == 500 and "starting" in text
        assert probe_get(port, "/livez")[0] == 404
    finally:
        server.shutdown()  # type: ignore[attr-defined]


def test_a_loop_that_does_not_run_the_checks_fails_liveness_and_a_check_that_raises_is_named() -> None:
    probes = Probes(loop_timeout_s=0.2)

    def broken() -> list[str]:
        raise KeyError("binder")

    probes.add(ready=broken)
    port, server = _served(probes)
    answers: dict[str, tuple[int, str]] = {}

    async def main() -> None:
        probes.attach()
        answers["ready"] = await asyncio.to_thread(probe_get, port, READY)
        asker = threading.Thread(target=lambda: answers.__setitem__("wedged", probe_get(port, LIVE)))
        asker.start()
        time.sleep(0.6)  # the loop is blocked (a wedged process) while the probe waits for it
        await asyncio.to_thread(asker.join)
        answers["after"] = await asyncio.to_thread(probe_get, port, LIVE)

    try:
        asyncio.run(main())
    finally:
        server.shutdown()  # type: ignore[attr-defined]
    assert answers["ready"] == (500, "broken failed: KeyError: 'binder'\n")
    assert answers["wedged"] == (500, "the event loop did not run the checks within 0.2 s\n")
    assert answers["after"] == (200, "ok")


def test_a_task_watched_for_liveness_that_ends_is_a_problem() -> None:
    async def main() -> tuple[list[str], list[str]]:
        task = asyncio.create_task(asyncio.sleep(3600), name="multidimensional multitasker")
        await asyncio.sleep(0)
        alive = tasks_alive()
        before = alive()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return before, alive()

    assert asyncio.run(main()) == ([], ["multidimensional multitasker has ended"])


def test_the_controller_is_live_with_its_loops_and_ready_once_its_books_are_read() -> None:
    probes, loops = Probes(), Loops("controller-probe-test", stale_s=0.0)
    build_registry(ControllerOptions(), probes, loops)
    assert probes.run(LIVE) == []
    assert probes.run(READY) == ["the first full read of the books is not done yet"]

    async def failing() -> None:
        raise OSError("no route to host")

    async def main() -> list[str]:
        task = loops.start("event-sender-0", failing, base_delay_s=0.001, max_delay_s=0.002)
        await asyncio.sleep(0.05)
        problems = probes.run(LIVE)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return problems

    assert asyncio.run(main()) == ["event-sender-0: OSError: no route to host"]


# ---- the flag ----------------------------------------------------------------------------------


def _part(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    extra = ["--node", "n1", "--backend", "sim:h100-80gb", "--state-file", str(tmp_path / "sim.json")] \
        if argv[0] == "agent" else ["--webhook", "127.0.0.1:9443"] if argv[0] == "webhook" else []
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", *argv, *extra, "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=30, env=dict(os.environ))


@pytest.mark.parametrize("command", ["controller", "webhook", "agent"])
def test_a_bad_health_address_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    proc = _part(tmp_path, command, "--health-address", "8081")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[:600]
    assert "--health-address '8081' is not HOST:PORT" in proc.stderr and "e.g. --health-address :8081" in proc.stderr


@pytest.mark.parametrize("command", ["controller", "agent"])
def test_a_health_port_in_use_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _part(tmp_path, command, "--health-address", f"127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[:600]
    assert f"--health-address '127.0.0.1:{port}' cannot be listened on: port {port} is in use" in proc.stderr
