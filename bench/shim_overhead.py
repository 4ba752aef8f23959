"""Overhead of libgpuslice on a real GPU, measured side by side in one run.

1. Driver allocation/free pairs (bench/shim_alloc_bench.c): cuMemAlloc_v2 +
   cuMemFree_v2, and cuMemAllocAsync + cuMemFreeAsync, per pair, for a 2 MiB
   and a 64 MiB size; runs alternate without and with the shim.
2. A PyTorch training loop (bench/shim_train_step.py): median step time,
   alternating without and with the shim, and at its end the process's
   footprint as NVML reports it beside what the shim counts for it.
3. Footprint (bench/shim_footprint.py): context creation time (the device's
   first use, where the shim measures the footprint), what the shim counts
   after it and after a 1 GiB tensor against NVML's per-process figure, and
   the cost of one NVML per-process query (what a footprint refresh costs).
With the shim, its limit file holds a limit (accounting active) well above
what the workloads use.  Prints a JSON summary; --out FILE also writes it.

Usage: python bench/shim_overhead.py [--rounds N] [--train-rounds N] [--footprint-rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def build() -> Path:
    # the tests' copy of the library: the same code, its ledger the relative directory "ledger" and its
    # limit the relative file "limit" (the library proper has the paths a slice's CDI spec mounts built in)
    subprocess.run(["make", "-C", str(ROOT / "shim"), "build/test/libgpuslice.so"], check=True, capture_output=True)
    exe = Path(tempfile.gettempdir()) / "shim_alloc_bench"
    subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", str(BENCH / "shim_alloc_bench.c"),
                    "-o", str(exe), "-ldl"], check=True)
    return exe


def env_for(shim: bool, tmp: str) -> dict:
    env = dict(os.environ)
    for k in ("LD_PRELOAD", "CDMO_GPU_MEMORY_LIMIT", "CDMO_SHIM_DISABLE"):
        env.pop(k, None)
    if shim:
        os.makedirs(os.path.join(tmp, "ledger"), exist_ok=True)
        with open(os.path.join(tmp, "limit"), "w") as fh:
            fh.write(f"{64 << 30}\n")
        env.update({"LD_PRELOAD": str(ROOT / "shim" / "build" / "test" / "libgpuslice.so"),
                    "CDMO_GPU_MEMORY_LIMIT": str(64 << 30), "CDMO_SLICE": "bench/overhead", "BENCH_CWD": tmp})
    return env


def run_json(cmd: list[str], env: dict) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600,
                         cwd=env.get("BENCH_CWD")).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--train-rounds", type=int, default=3)
    ap.add_argument("--footprint-rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    exe = build()
    tmp = tempfile.mkdtemp(prefix="shimbench.")
    summary: dict = {"alloc": {}, "train": {}, "footprint": {}}
    for size in (2 << 20, 64 << 20) if a.rounds > 0 else ():
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for i in range(a.rounds):
            for which in (("without", "with") if i % 2 == 0 else ("with", "without")):
                runs[which].append(run_json([str(exe), str(size), str(a.pairs)], env_for(which == "with", tmp)))
        row = {}
        for kind in ("sync_ns_per_pair", "async_ns_per_pair"):
            wo = statistics.median(r[kind] for r in runs["without"])
            w = statistics.median(r[kind] for r in runs["with"])
            row[kind] = {"without_ns": round(wo, 1), "with_ns": round(w, 1), "ratio": round(w / wo, 3),
                         "pairs_per_s_without": round(1e9 / wo), "pairs_per_s_with": round(1e9 / w)}
        summary["alloc"][f"{size >> 20}MiB"] = row
    steps: dict[str, list[float]] = {"without": [], "with": []}
    driver_calls: list[int] = []
    train_fp: dict[str, list] = {"without": [], "with": []}
    for i in range(a.train_rounds):  # alternate the order: no drift favours either side
        for which in (("without", "with") if i % 2 == 0 else ("with", "without")):
            r = run_json([sys.executable, str(BENCH / "shim_train_step.py")], env_for(which == "with", tmp))
            steps[which].append(r["median_step_ms"])
            train_fp[which].append({"nvml_process_bytes": r["nvml_process_bytes"],
                                    "shim_counted_bytes": r["mem_get_info_used"] if which == "with" else None})
            if which == "with":
                driver_calls.append(r["device_allocs_in_timed_steps"] + r["device_frees_in_timed_steps"])
    if a.train_rounds > 0:
        wo, w = statistics.median(steps["without"]), statistics.median(steps["with"])
        pair_ratios = [round(b / c, 4) for b, c in zip(steps["with"], steps["without"], strict=True)]
        summary["train"] = {"median_step_ms_without": wo, "median_step_ms_with": w, "ratio": round(w / wo, 4),
                            "median_per_round_ratio": round(statistics.median(pair_ratios), 4),
                            "per_round_ratio": pair_ratios, "rounds": steps,
                            # allocation calls that could reach the shim during the timed steps, per round
                            "driver_alloc_free_calls_in_timed_steps_with_shim": driver_calls,
                            "footprint_per_round": train_fp}
    fp: dict[str, list[dict]] = {"without": [], "with": []}
    for i in range(a.footprint_rounds):
        for which in (("without", "with") if i % 2 == 0 else ("with", "without")):
            fp[which].append(run_json([sys.executable, str(BENCH / "shim_footprint.py")],
                                      env_for(which == "with", tmp)))
    if a.footprint_rounds > 0:
        def med(which: str, key: str) -> float:
            return statistics.median(r[key] for r in fp[which])

        summary["footprint"] = {
            "context_init_ms_without": med("without", "context_init_ms"),
            "context_init_ms_with": med("with", "context_init_ms"),
            "nvml_process_mib_after_1gib_with": round(med("with", "nvml_process_bytes") / 2**20, 1),
            "shim_counted_mib_after_1gib": round(med("with", "counted_after_1gib") / 2**20, 1),
            "shim_counted_mib_after_init": round(med("with", "counted_after_init") / 2**20, 1),
            "nvml_process_mib_after_1gib_without": round(med("without", "nvml_process_bytes") / 2**20, 1),
            "nvml_query_us": med("without", "nvml_query_us"),
            "rounds": fp}
    text = json.dumps(summary, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
