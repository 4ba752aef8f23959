"""Compute shares through NVIDIA MPS on a real GPU: the split, the overhead, and what a client can
change itself (issue 26; docs/benchmarks.md "Compute shares through MPS").

    python bench/mps_share.py [--seconds 8] [--out FILE]     # needs a GPU with MIG off, and PyTorch

Workers are PyTorch processes (``worker KIND SECONDS``): ``matmul`` (bf16 8192² matmuls back to back),
``graph`` (the same matmuls replayed from a CUDA graph), ``small`` (inference-like steps of small
kernels, each step synchronised; a client holding an MPS server), ``fill`` (256 MiB allocations until out of
memory). Each prints one JSON line when CUDA is ready, waits for ``go`` on stdin (so the processes of
a phase start together), runs SECONDS and prints its result.

This program runs workers as plain processes on the host, beside an MPS control daemon it starts
through ``mig_operator.gpu.mps`` (its own directories under a temporary root) and always stops;
each client gets what its CDI spec would give (``core.node.environment.mps_environment``), with the pipe
directory's host path. ``tests/gpu/test_mps_share.py`` runs the same phases (``run_together``) in
containers made from the agent's own CDI specs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
Launch = Callable[[Mapping[str, str], Sequence[str]], subprocess.Popen]


# ---- the worker (runs in its own process) ------------------------------------------------------------

def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def worker(kind: str, seconds: float) -> None:
    import torch

    dev = torch.device("cuda")
    free, total = torch.cuda.mem_get_info()
    result: dict[str, Any] = {"kind": kind, "mem_total": total, "mem_free": free,
                              "env_threads": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                              "env_pinned": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    step: Callable[[], int]
    if kind in ("matmul", "graph"):
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        c = a @ b
        if kind == "graph":
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    c = a @ b
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                for _ in range(8):
                    torch.matmul(a, b, out=c)

            def step() -> int:
                graph.replay()
                torch.cuda.synchronize()
                return 8
        else:
            def step() -> int:
                for _ in range(8):
                    torch.matmul(a, b, out=c)
                torch.cuda.synchronize()
                return 8
    elif kind == "small":
        x0 = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
        w = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) / 32

        def step() -> int:
            x = x0
            for _ in range(16):
                x = torch.tanh(x @ w)
            torch.cuda.synchronize()
            return 1
    elif kind == "fill":
        held: list = []

        def step() -> int:
            return 0
    else:
        raise SystemExit(f"worker kind {kind!r} is not matmul, graph, small or fill")
    for _ in range(5):
        step()
    _say({"phase": "ready", "pid": os.getpid()})
    sys.stdin.readline()
    if kind == "fill":
        got, error = 0, None
        while True:
            try:
                held.append(torch.empty(256 << 20, dtype=torch.uint8, device=dev))
                got += 256 << 20
            except RuntimeError as exc:
                error = str(exc).splitlines()[0][:300]
                break
        result.update(allocated=got, error=error)
        _say({"phase": "done", **result})
        return
    latencies: list[float] = []
    work = 0
    start = time.perf_counter()
    end = start + seconds
    while True:
        t0 = time.perf_counter()
        work += step()
        t1 = time.perf_counter()
        latencies.append(t1 - t0)
        if t1 >= end:
            break
    elapsed = time.perf_counter() - start
    latencies.sort()
    result.update(iterations=work, seconds=elapsed, rate=work / elapsed, steps=len(latencies),
                  p50_ms=latencies[len(latencies) // 2] * 1e3,
                  p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3)
    _say({"phase": "done", **result})


# ---- running workers together ------------------------------------------------------------------------

def _read_json(stream: IO[str], proc: subprocess.Popen, what: str) -> dict:
    line = stream.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"{what} ended (status {proc.returncode}) before it said anything: "
                           f"{(proc.stderr.read() if proc.stderr else '')[-2000:]}")
    return json.loads(line)


def run_together(workers: Mapping[str, tuple[Launch, Mapping[str, str], str]], seconds: float) -> dict[str, dict]:
    """Start each named worker (launch, its environment, its kind), let them go together once all
    are ready, and return each one's result."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, (launch, env, kind) in workers.items():
            procs[name] = launch(env, ["worker", kind, str(seconds)])
        for name, proc in procs.items():
            assert proc.stdout is not None
            _read_json(proc.stdout, proc, name)
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = {}
        for name, proc in procs.items():
            assert proc.stdout is not None
            results[name] = _read_json(proc.stdout, proc, name)
        return results
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def split(results: Mapping[str, dict], first: str, second: str) -> float:
    """``first``'s part of the two workers' combined throughput, in percent."""
    a, b = results[first]["rate"], results[second]["rate"]
    return 100.0 * a / (a + b)


def host_launch(stderr_dir: Path, user: str = "") -> Launch:
    """Workers as plain processes on this host, with the given variables over this environment
    (``user``: as that uid, through ``setpriv``)."""
    # Bounded: a client of a second uid may wait for the first uid's MPS server to end.
    prefix = ["timeout", "90", "setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []

    def launch(env: Mapping[str, str], args: Sequence[str]) -> subprocess.Popen:
        log = open(stderr_dir / f"worker-{time.monotonic_ns()}.stderr", "w")  # noqa: SIM115 (kept for the run)
        return subprocess.Popen([*prefix, sys.executable, str(Path(__file__).resolve()), *args], text=True,
                                env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log)
    return launch


# ---- the benchmark ------------------------------------------------------------------------------------

def control_as(user: str, mps_env: Mapping[str, str], command: str) -> dict[str, Any]:
    """Send a control command as another user (``setpriv``); what the daemon answered."""
    argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "nvidia-cuda-mps-control"]
    try:
        done = subprocess.run(argv, input=command + "\n", capture_output=True, text=True, timeout=20,
                              env={**os.environ, **mps_env})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"command": command, "user": user, "error": str(exc)}
    return {"command": command, "user": user, "status": done.returncode, "stdout": done.stdout.strip()[:300],
            "stderr": done.stderr.strip()[:300]}


def gpu_zero() -> tuple[str, str, str]:
    """GPU 0's UUID, name and driver version, as nvidia-smi gives them."""
    query = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=uuid,name,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, check=True, timeout=60)
    uuid, name, driver = (part.strip() for part in query.stdout.strip().split(","))
    return uuid, name, driver


def bench(seconds: float, root: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from mig_operator.core.node.environment import mps_environment
    from mig_operator.gpu.mps import MpsDaemons

    uuid, name, driver = gpu_zero()
    logs = root / "stderr"
    logs.mkdir(parents=True, exist_ok=True)
    launch = host_launch(logs)
    plain = {"CUDA_VISIBLE_DEVICES": uuid}
    out: dict[str, Any] = {"gpu": str(name), "uuid": uuid, "driver": str(driver), "seconds": seconds}
    # Without MPS: one process alone, two time-sliced. (Latency beside training: bench/mps_latency.py.)
    out["alone"] = run_together({"a": (launch, plain, "matmul")}, seconds)["a"]
    out["timesliced"] = run_together({"a": (launch, plain, "matmul"), "b": (launch, plain, "matmul")}, seconds)
    daemons = MpsDaemons(str(root / "mps"), private_shm=False)  # host processes share the host's /dev/shm
    pipe = daemons.dirs(uuid).pipe
    granted = 8 * GIB

    def client(share: float, size: int = granted) -> dict[str, str]:
        return {**plain, **mps_environment(share, size), "CUDA_MPS_PIPE_DIRECTORY": pipe}

    try:
        daemons.start(uuid)
        out["overhead_1.0"] = run_together({"a": (launch, client(1.0), "matmul")}, seconds)["a"]
        out["alone_0.25"] = run_together({"a": (launch, client(0.25), "matmul")}, seconds)["a"]
        out["pair_25_75"] = run_together({"a": (launch, client(0.25), "matmul"),
                                          "b": (launch, client(0.75), "matmul")}, seconds)
        out["pair_50_50"] = run_together({"a": (launch, client(0.5), "matmul"),
                                          "b": (launch, client(0.5), "matmul")}, seconds)
        out["graph_25_75"] = run_together({"a": (launch, client(0.25), "graph"),
                                           "b": (launch, client(0.75), "matmul")}, seconds)
        # A client outside MPS (no pipe directory) beside an MPS client: does it run, and with what share?
        out["bypass_beside_0.75"] = run_together({"a": (launch, {**plain, "CUDA_MPS_PIPE_DIRECTORY": "/nonexistent"},
                                                            "matmul"),
                                                  "b": (launch, client(0.75), "matmul")}, seconds)
        # What a client can change itself: the daemon holds 25 % and 4 GiB for servers to come.
        daemons.stop(uuid)
        daemons.start(uuid)
        daemons.hold(uuid, 25, 4 * GIB)
        out["held_25_env_25"] = run_together({"a": (launch, client(0.25), "matmul")}, seconds)["a"]
        out["held_25_env_100"] = run_together({"a": (launch, client(1.0), "matmul")}, seconds)["a"]
        out["held_4g_env_20g"] = run_together({"a": (launch, client(1.0, 20 * GIB), "fill")}, seconds)["a"]
        out["held_4g_env_2g"] = run_together({"a": (launch, client(1.0, 2 * GIB), "fill")}, seconds)["a"]
        out["held_4g_no_env"] = run_together({"a": (launch, {**plain, "CUDA_MPS_PIPE_DIRECTORY": pipe}, "fill")},
                                             seconds)["a"]
        # Per-server limits: with a server running (a client holds it), lower its share to 25 % and
        # start a client that asks for 100 %.
        mps_env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": daemons.dirs(uuid).log}
        daemons.stop(uuid)
        daemons.start(uuid)
        holder = launch(client(1.0), ["worker", "small", str(seconds)])
        assert holder.stdout is not None and holder.stdin is not None
        _read_json(holder.stdout, holder, "holder")
        servers = daemons.servers(uuid)
        out["servers"] = servers
        for pid in servers:
            daemons.command(uuid, f"set_active_thread_percentage {pid} 25")
        out["server_25_env_100"] = run_together({"a": (launch, client(1.0), "matmul")}, seconds)["a"]
        holder.stdin.write("go\n")
        holder.stdin.close()
        holder.wait(60)
        # The control socket from another user (a container running as a user other than the daemon's).
        out["control_as_nobody"] = [control_as("65534", mps_env, c) for c in
                                    ("get_server_list", "set_default_active_thread_percentage 100")]
        out["default_after_nobody"] = daemons.command(uuid, "get_default_active_thread_percentage")
    finally:
        daemons.stop(uuid)
        out["daemon_running_after_stop"] = daemons.running(uuid)
    return out


def extra(seconds: float, root: Path) -> dict[str, Any]:
    """A client running as another uid than the daemon's (uid 65534)."""
    sys.path.insert(0, str(REPO))
    from mig_operator.core.node.environment import mps_environment
    from mig_operator.gpu.mps import MpsDaemons

    uuid, name, driver = gpu_zero()
    logs = root / "stderr"
    logs.mkdir(parents=True, exist_ok=True)
    os.chmod(logs, 0o777)
    launch, nobody = host_launch(logs), host_launch(logs, "65534")
    plain = {"CUDA_VISIBLE_DEVICES": uuid, "HOME": "/tmp"}
    out: dict[str, Any] = {"gpu": name, "uuid": uuid, "driver": driver, "seconds": seconds}
    out["alone"] = run_together({"a": (launch, plain, "matmul")}, seconds)["a"]
    daemons = MpsDaemons(str(root / "mps"), private_shm=False)
    pipe = daemons.dirs(uuid).pipe

    def client(share: float) -> dict[str, str]:
        return {**plain, **mps_environment(share, 8 * GIB), "CUDA_MPS_PIPE_DIRECTORY": pipe}

    try:
        daemons.start(uuid)
        try:
            out["nobody_alone_0.25"] = run_together({"a": (nobody, client(0.25), "matmul")}, 4.0)["a"]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out["nobody_alone_0.25"] = {"error": str(exc)[-1500:]}
        out["nobody_servers"] = daemons.command(uuid, "get_server_list")
    finally:
        daemons.stop(uuid)
        out["daemon_running_after_stop"] = daemons.running(uuid)
    return out


def extra_summary(out: Mapping[str, Any]) -> dict[str, Any]:
    nobody = out["nobody_alone_0.25"]
    return {"nobody_of_gpu_pct": round(100 * nobody["rate"] / out["alone"]["rate"], 1) if "rate" in nobody else nobody}


def summary(out: Mapping[str, Any]) -> dict[str, Any]:
    alone = out["alone"]["rate"]
    return {
        "alone_it_s": round(alone, 1),
        "timesliced_it_s": [round(out["timesliced"][k]["rate"], 1) for k in ("a", "b")],
        "overhead_1.0_pct": round(100 * (1 - out["overhead_1.0"]["rate"] / alone), 2),
        "alone_0.25_of_gpu_pct": round(100 * out["alone_0.25"]["rate"] / alone, 1),
        "pair_25_75_split_pct": round(split(out["pair_25_75"], "a", "b"), 2),
        "pair_25_75_sum_of_alone_pct": round(100 * sum(r["rate"] for r in out["pair_25_75"].values()) / alone, 1),
        "pair_50_50_split_pct": round(split(out["pair_50_50"], "a", "b"), 2),
        "graph_25_75_split_pct": round(split(out["graph_25_75"], "a", "b"), 2),
        "bypass_it_s": round(out["bypass_beside_0.75"]["a"]["rate"], 1),
        "bypass_split_pct": round(split(out["bypass_beside_0.75"], "a", "b"), 2),
        "held_25_env_25_of_gpu_pct": round(100 * out["held_25_env_25"]["rate"] / alone, 1),
        "held_25_env_100_of_gpu_pct": round(100 * out["held_25_env_100"]["rate"] / alone, 1),
        "server_25_env_100_of_gpu_pct": round(100 * out["server_25_env_100"]["rate"] / alone, 1),
        "held_4g_allocated_mib": {k: out[k]["allocated"] >> 20 for k in
                                  ("held_4g_env_20g", "held_4g_env_2g", "held_4g_no_env")},
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        worker(argv[1], float(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", help="write every raw result here (JSON)")
    parser.add_argument("--extra", action="store_true",
                        help="only the second run: a client of another uid")
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 120:
        print(f"--seconds {args.seconds} must be 1..120; e.g. --seconds 8", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mps-bench-") as root:
        os.chmod(root, 0o755)  # a client of another uid reaches the pipe directory under it
        out = extra(args.seconds, Path(root)) if args.extra else bench(args.seconds, Path(root))
    out["summary"] = extra_summary(out) if args.extra else summary(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
