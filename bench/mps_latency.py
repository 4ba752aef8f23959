"""A latency-sensitive process at compute 0.25 beside a training loop at 0.75: its p99 per step against
running alone, measured paired (issue 26; docs/benchmarks.md "Compute shares through MPS").

    python bench/mps_latency.py [--rounds 8] [--phase-seconds 1.5] [--out FILE] [--raw FILE]

One latency process and one trainer live through a whole section, so every phase runs the same
contexts, allocations and kernels. The trainer (bf16 8192² matmuls, 8 per synchronised step) is
switched busy or idle between phases; an idle trainer has no work on the GPU, so the latency process
is then alone on it. Rounds alternate the order of the two phases (alone, beside, beside, alone, ...)
so that drift (clocks, temperature) falls on both alike; each phase runs up to ``--max-steps`` steps
or ``--phase-seconds`` after ``--warmup`` steps that are discarded. A step is one inference-like
request: 16 pairs of small kernels (64x1024 by 1024x1024 bf16 matmul, tanh) then a synchronise, timed on
the host (what a caller waits) and by CUDA events around it (the GPU's span). Two forms: ``eager``
(PyTorch launching each kernel) and ``graph`` (the same step replayed from a CUDA graph).

The comparison is per round (beside/alone - 1 of that round's p99s): the median over rounds, and a
distribution-free confidence interval for that median from the order statistics; also the p99 of
all steps of each phase pooled over the rounds. Sections: MPS (its own control daemon through
``mig_operator.gpu.mps``, the latency process at 0.25 and the trainer at 0.75 with the variables of
``core.node.environment.mps_environment``), and time-sliced (no MPS: today's ``shared``). In each, the
latency process first runs alone before the trainer exists (``solo``), which checks that an idle
trainer changes nothing. The daemon is stopped at the end whatever happens (SIGTERM included).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = next(p for p in HERE.parents if (p / "mig_operator").is_dir())
GIB = 2**30
KINDS = ("eager", "graph")
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}
Launch = Callable[[Mapping[str, str], Sequence[str]], subprocess.Popen]


@dataclass(frozen=True)
class Plan:
    """How long each phase runs and how many rounds."""

    rounds: int = 8
    phase_seconds: float = 1.5
    max_steps: int = 4000
    warmup: int = 200


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    out = {k: quantile(ordered, q) for k, q in QUANTILES.items()}
    out.update(max=ordered[-1], mean=sum(ordered) / len(ordered), steps=len(ordered))
    return out


# ---- the workers (each in its own process) --------------------------------------------------------------

def latency_worker() -> None:
    """Answers ``run KIND MAX_STEPS SECONDS WARMUP`` with one JSON line per phase; ``quit`` ends it."""
    import torch

    dev = torch.device("cuda")
    x0 = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) / 32

    def eager() -> Any:
        x = x0
        for _ in range(16):
            x = torch.tanh(x @ w)
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    steps = {"eager": eager, "graph": graph.replay}
    events: dict[int, tuple[list, list]] = {}
    for fn in steps.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    _say({"phase": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        kind, max_steps, seconds, warmup = words[1], int(words[2]), float(words[3]), int(words[4])
        fn, total = steps[kind], max_steps + warmup
        if total not in events:
            events[total] = ([torch.cuda.Event(enable_timing=True) for _ in range(total)],
                             [torch.cuda.Event(enable_timing=True) for _ in range(total)])
        starts, ends = events[total]
        wall: list[int] = []
        deadline = math.inf
        n = 0
        while n < total:
            t0 = time.perf_counter_ns()
            starts[n].record()
            fn()
            ends[n].record()
            torch.cuda.synchronize()
            t1 = time.perf_counter_ns()
            wall.append(t1 - t0)
            n += 1
            if n == warmup:
                deadline = t1 + seconds * 1e9
            elif t1 >= deadline:
                break
        gpu_us = [round(starts[i].elapsed_time(ends[i]) * 1e3, 1) for i in range(warmup, n)]
        wall_us = [round(v / 1e3, 1) for v in wall[warmup:]]
        _say({"kind": kind, "wall_us": wall_us, "gpu_us": gpu_us})


def train_worker() -> None:
    """bf16 8192² matmuls, 8 per synchronised step, while told ``busy``; says ``busy`` after its first
    step and ``idle`` (with its rate) after its last; ``quit`` ends it."""
    import torch

    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = a @ b
    busy, done = threading.Event(), threading.Event()

    def read() -> None:
        for line in sys.stdin:
            word = line.strip()
            if word == "busy":
                busy.set()
            elif word == "idle":
                busy.clear()
            elif word == "quit":
                break
        done.set()
        busy.set()

    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    threading.Thread(target=read, daemon=True).start()
    _say({"phase": "ready", "pid": os.getpid()})
    while True:
        busy.wait()
        if done.is_set():
            return
        n, start = 0, time.perf_counter()
        while busy.is_set() and not done.is_set():
            for _ in range(8):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            n += 1
            if n == 1:
                _say({"state": "busy"})
        _say({"state": "idle", "steps": n, "matmuls_per_s": 8 * n / (time.perf_counter() - start)})


# ---- the controller ----------------------------------------------------------------------------------------

class Worker:
    """One worker process (``launch``: how, e.g. ``host_launch``) and its JSON lines."""

    def __init__(self, role: str, launch: Launch, env: Mapping[str, str], cpus: str) -> None:
        self.role = role
        self.proc = launch(env, ["worker", role, cpus])

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            log = getattr(self.proc, "log_path", None)
            tail = Path(log).read_text()[-2000:] if log else "(its stderr is in the launcher's logs)"
            raise RuntimeError(f"{self.role} worker ended (status {self.proc.returncode}): {tail}")
        return json.loads(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send("quit")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(30)


def host_launch(logs: Path) -> Launch:
    """Workers as plain processes on this host, with the given variables over this environment."""
    def launch(env: Mapping[str, str], args: Sequence[str]) -> subprocess.Popen:
        path = logs / f"{args[1]}-{time.monotonic_ns()}.stderr"
        with open(path, "w") as log:
            proc = subprocess.Popen([sys.executable, str(HERE), *args], text=True, env={**os.environ, **env},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        proc.log_path = str(path)  # type: ignore[attr-defined]
        return proc
    return launch


def gpu_state(uuid: str) -> dict[str, str]:
    """Clocks, temperature, power and throttle reasons at this moment (read only; nothing is set)."""
    fields = ["clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active"]
    for names in (fields, fields[:-1]):
        try:
            done = subprocess.run(["nvidia-smi", "-i", uuid, f"--query-gpu={','.join(names)}",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": str(exc)}
        if done.returncode == 0:
            return dict(zip(names, (v.strip() for v in done.stdout.strip().split(",")), strict=False))
    return {"error": done.stdout.strip()[:200] + done.stderr.strip()[:200]}


def section(uuid: str, lat: tuple[Launch, Mapping[str, str]], train: tuple[Launch, Mapping[str, str]],
            plan: Plan, raw: dict) -> dict[str, Any]:
    """``solo`` phases of the latency worker (launcher, environment), then ``plan.rounds`` rounds of
    alone and beside the trainer; every step's latency into ``raw``."""
    many = len(os.sched_getaffinity(0)) >= 8 and {2, 3, 4, 5} <= os.sched_getaffinity(0)
    lat_cpus, train_cpus = ("2,3", "4,5") if many else ("", "")
    workers: list[Worker] = []
    phase_cmd = f"{plan.max_steps} {plan.phase_seconds} {plan.warmup}"

    def measure(tag: str) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for kind in KINDS:
            latency.send(f"run {kind} {phase_cmd}")
            got = latency.read()
            raw.setdefault(tag, []).append(got)
            result[kind] = {"wall": _stats(got["wall_us"]), "gpu": _stats(got["gpu_us"])}
        result["gpu_state"] = gpu_state(uuid)
        return result

    try:
        latency = Worker("lat", *lat, lat_cpus)
        workers.append(latency)
        latency.read()
        out: dict[str, Any] = {"solo": measure("solo")}
        trainer = Worker("train", *train, train_cpus)
        workers.append(trainer)
        trainer.read()
        rounds = []
        for r in range(plan.rounds):
            record: dict[str, Any] = {}
            for phase in (("alone", "beside") if r % 2 == 0 else ("beside", "alone")):
                if phase == "beside":
                    trainer.send("busy")
                    assert trainer.read()["state"] == "busy"
                record[phase] = measure(f"{phase}-{r}")
                if phase == "beside":
                    trainer.send("idle")
                    record[phase]["train"] = trainer.read()
            rounds.append(record)
        out["rounds"] = rounds
        return out
    finally:
        for worker in workers:
            worker.close()


def median_interval(values: Sequence[float], level: float = 0.9) -> tuple[float, float, float, float]:
    """The median, a distribution-free interval for it from the order statistics (the narrowest that
    covers at least ``level``, or the widest the number of values allows), and that coverage."""
    ordered, n = sorted(values), len(values)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]

    def coverage(k: int) -> float:  # of [ordered[k], ordered[n-1-k]]: 1 - 2 P(Bin(n, 1/2) <= k)
        return 1 - 2 * sum(below[:k + 1])

    k = -1  # -1: no interval yet
    while k + 1 <= n - 2 - k and coverage(k + 1) >= level:
        k += 1
    k = max(k, 0)
    return median, ordered[k], ordered[n - 1 - k], coverage(k)


def compare(measured: Mapping[str, Any], raw: Mapping[str, list], rounds: int) -> dict[str, Any]:
    """Per kind and clock (host wall, GPU events): beside against alone, paired by round."""
    out: dict[str, Any] = {}
    for i, kind in enumerate(KINDS):
        for clock in ("wall", "gpu"):
            key = f"{clock}_us"
            alone = [measured["rounds"][r]["alone"][kind][clock]["p99"] for r in range(rounds)]
            beside = [measured["rounds"][r]["beside"][kind][clock]["p99"] for r in range(rounds)]
            ratios = [100 * (b / a - 1) for a, b in zip(alone, beside, strict=True)]
            # Noise floor: the same phase, alone, in consecutive rounds.
            drift = [abs(100 * (alone[r + 1] / alone[r] - 1)) for r in range(rounds - 1)]
            med, lo, hi, cover = median_interval(ratios)
            pooled = {phase: quantile(sorted(v for r in range(rounds) for v in raw[f"{phase}-{r}"][i][key]), 0.99)
                      for phase in ("alone", "beside")}
            p50s = [100 * (measured["rounds"][r]["beside"][kind][clock]["p50"] /
                           measured["rounds"][r]["alone"][kind][clock]["p50"] - 1) for r in range(rounds)]
            out[f"{kind}_{clock}"] = {
                "solo_p99_us": round(measured["solo"][kind][clock]["p99"], 1),
                "alone_p99_us_median": round(median_interval(alone)[0], 1),
                "beside_p99_us_median": round(median_interval(beside)[0], 1),
                "p99_beside_vs_alone_pct_median": round(med, 1),
                "interval_pct": [round(lo, 1), round(hi, 1)], "interval_coverage": round(cover, 3),
                "per_round_pct": [round(v, 1) for v in ratios],
                "alone_round_to_round_pct_median": round(median_interval(drift)[0], 1),
                "pooled_p99_us": {k: round(v, 1) for k, v in pooled.items()},
                "pooled_p99_beside_vs_alone_pct": round(100 * (pooled["beside"] / pooled["alone"] - 1), 1),
                "p50_beside_vs_alone_pct_median": round(median_interval(p50s)[0], 1),
            }
    trains = [measured["rounds"][r]["beside"]["train"]["matmuls_per_s"] for r in range(rounds)]
    out["train_matmuls_per_s_median"] = round(median_interval(trains)[0], 1)
    # The trainer takes the GPU to its power cap: clocks fall for every kernel, which no SM share divides.
    for phase in ("alone", "beside"):
        for field in ("clocks.sm", "power.draw"):
            seen = [float(measured["rounds"][r][phase]["gpu_state"].get(field, "nan")) for r in range(rounds)]
            out[f"{phase}_{field.replace('.', '_')}_median"] = median_interval(seen)[0]
    return out


def bench(plan: Plan, root: Path, raw_file: str | None) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from mig_operator.core.node.environment import mps_environment
    from mig_operator.gpu.mps import MpsDaemons

    query = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=uuid,name,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, check=True, timeout=60)
    uuid, name, driver = (part.strip() for part in query.stdout.strip().split(","))
    logs = root / "stderr"
    logs.mkdir(parents=True, exist_ok=True)
    plain = {"CUDA_VISIBLE_DEVICES": uuid}
    launch = host_launch(logs)
    out: dict[str, Any] = {"gpu": name, "uuid": uuid, "driver": driver, "plan": asdict(plan),
                           "gpu_state_start": gpu_state(uuid)}
    raw: dict[str, dict] = {"timesliced": {}, "mps": {}}
    out["timesliced"] = section(uuid, (launch, plain), (launch, plain), plan, raw["timesliced"])
    daemons = MpsDaemons(str(root / "mps"), private_shm=False)  # host processes share the host's /dev/shm
    pipe = daemons.dirs(uuid).pipe

    def client(share: float) -> dict[str, str]:
        return {**plain, **mps_environment(share, 8 * GIB), "CUDA_MPS_PIPE_DIRECTORY": pipe}

    try:
        daemons.start(uuid)
        out["mps"] = section(uuid, (launch, client(0.25)), (launch, client(0.75)), plan, raw["mps"])
    finally:
        daemons.stop(uuid)
        out["daemon_running_after_stop"] = daemons.running(uuid)
    out["summary"] = {mode: compare(out[mode], raw[mode], plan.rounds) for mode in ("mps", "timesliced")}
    if raw_file:
        with gzip.open(raw_file, "wt") as f:
            json.dump(raw, f)
    return out


def table(summary: Mapping[str, Any]) -> str:
    lines = ["mode        step   clock  solo p99  alone p99  beside p99  median d%  interval (cover)  pooled d%  "
             "alone r2r%"]
    for mode, kinds in summary.items():
        for key, s in kinds.items():
            if not isinstance(s, dict):
                continue
            kind, clock = key.split("_")
            lines.append(f"{mode:<11} {kind:<6} {clock:<5} {s['solo_p99_us']:>9} {s['alone_p99_us_median']:>10} "
                         f"{s['beside_p99_us_median']:>11} {s['p99_beside_vs_alone_pct_median']:>+10} "
                         f"{str(s['interval_pct']):>14} ({s['interval_coverage']:.2f}) "
                         f"{s['pooled_p99_beside_vs_alone_pct']:>+9} {s['alone_round_to_round_pct_median']:>10}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        # Steady CPUs for each launching process: scheduler moves are host noise, not the GPU's.
        cpus = {int(c) for c in argv[2].split(",") if c} if len(argv) > 2 else set()
        if cpus and cpus <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
        {"lat": latency_worker, "train": train_worker}[argv[1]]()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--phase-seconds", type=float, default=1.5)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--root", help="the MPS daemon's directories go under here (default: a temporary one)")
    parser.add_argument("--out", help="write every phase's figures and the summary here (JSON)")
    parser.add_argument("--raw", help="write every step's latency here (gzipped JSON)")
    args = parser.parse_args(argv)
    for flag, value, low, high, example in (("--rounds", args.rounds, 4, 50, "8"),
                                            ("--phase-seconds", args.phase_seconds, 0.1, 30, "1.5"),
                                            ("--max-steps", args.max_steps, 100, 100000, "4000"),
                                            ("--warmup", args.warmup, 0, 10000, "200")):
        if not low <= value <= high:
            print(f"{flag} {value} must be {low}..{high}; e.g. {flag} {example}", file=sys.stderr)
            return 2
    # A SIGTERM (a timeout) unwinds through the finally blocks: workers ended, the daemon stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="mps-latency-", dir=args.root) as root:
        plan = Plan(args.rounds, args.phase_seconds, args.max_steps, args.warmup)
        out = bench(plan, Path(root), args.raw)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))
    print(table(out["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
