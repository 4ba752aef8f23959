"""libgpuslice on a real GPU: PyTorch, CuPy and JAX under a 4 GiB limit.

Skipped where no GPU is present (the `gpu` fixture).  Each workload
(shim_workloads/fill.py) allocates until its framework reports out of memory
and then holds its memory while we look at it from outside: the shim's own
high-water mark (read from the slice's region file), nvidia-smi without the
shim (the driver's per-process figure) and nvidia-smi under the shim.
Set SHIM_GPU_LOG to a file to collect every measurement as JSON lines.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILL = Path(__file__).resolve().parent / "shim_workloads" / "fill.py"
LIMIT = 4 << 30
MiB = 1 << 20
PEAK_OFFSET = 24  # struct gs_region: magic u64, version u32, size u32, nslots u32, pad u32, peak u64


def log(record: dict) -> None:
    path = os.environ.get("SHIM_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def shim() -> Path:
    subprocess.run(["make", "-C", str(ROOT / "shim")], check=True, capture_output=True)
    return ROOT / "shim" / "libgpuslice.so"


def shim_env(lib: Path, tmp: Path, slice_: str, limit: int | None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("CDMO_GPU_MEMORY_LIMIT", "CDMO_SHIM_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    env.update({"LD_PRELOAD": str(lib), "CDMO_SLICE": slice_, "CDMO_SHIM_DIR": str(tmp),
                "PYTHONUNBUFFERED": "1"})
    if limit:
        env["CDMO_GPU_MEMORY_LIMIT"] = str(limit)
    env.update(extra or {})
    return env


def start(mode: str, env: dict, cap_mib: int = 16384) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FILL), mode, "64", str(cap_mib)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    line = p.stdout.readline()
    if not line:
        p.wait(timeout=max(1, deadline - time.time()))
        raise AssertionError(f"workload died: rc={p.returncode}\n{p.stderr.read()[-3000:]}")
    return json.loads(line)


def finish(p: subprocess.Popen) -> str:
    p.stdin.close()
    p.wait(timeout=120)
    return p.stderr.read()


def region_peak(tmp: Path) -> int:
    files = glob.glob(str(tmp / "cdmo-gpuslice-*"))
    assert len(files) == 1, files
    with open(files[0], "rb") as f:
        f.seek(PEAK_OFFSET)
        return struct.unpack("<Q", f.read(8))[0]


def smi(env: dict | None = None, query: str = "memory.total,memory.used,memory.free") -> list[int]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    return [int(x) for x in out.splitlines()[0].split(",")]


def process_mib(pid: int) -> int | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60).stdout
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


WORKLOADS = {
    "torch-default": ("torch", {}),
    "torch-expandable": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "torch-cudaMallocAsync": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "cupy-default": ("cupy", {}),
    "cupy-async": ("cupy_async", {}),
    "jax-default": ("jax", {}),
    "jax-mem-fraction-0.95": ("jax", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_fill_to_the_limit(gpu: str, shim: Path, tmp_path: Path, name: str) -> None:
    mode, extra = WORKLOADS[name]
    env = shim_env(shim, tmp_path, f"gputest/{name}", LIMIT, extra)
    p = start(mode, env)
    try:
        r = result(p)
        peak = region_peak(tmp_path)
        phys = process_mib(p.pid)
        shim_smi = smi(env)
    finally:
        finish(p)
    rec = {"test": "fill", "workload": name, "limit": LIMIT, "shim_peak": peak, "allocated": r["allocated"],
           "framework_error": r["error"], "info": r["info"], "driver_process_mib": phys,
           "nvidia_smi_under_shim_mib": shim_smi}
    log(rec)
    assert r["error"], f"{name}: never ran out of memory: {rec}"
    assert peak <= LIMIT, f"{name}: the slice went over its limit: {rec}"
    assert r["allocated"] <= LIMIT, rec
    if name != "jax-default":  # JAX preallocates 75% of total by default: see docs/shim.md
        assert peak >= 0.9 * LIMIT, f"{name}: reached only {peak / LIMIT:.1%} of the limit: {rec}"
    else:
        assert peak >= 0.7 * LIMIT, rec
    assert shim_smi[0] == LIMIT // MiB, f"nvidia-smi under the shim shows total {shim_smi[0]} MiB"
    if mode in ("torch", "cupy", "cupy_async"):
        assert r["info"]["total"] == LIMIT, f"{name}: mem_get_info total {r['info']['total']}"


def test_two_processes_share_one_limit(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/pair", LIMIT)
    a, b = start("torch", env), start("torch", env)
    try:
        ra, rb = result(a), result(b)
        peak = region_peak(tmp_path)
    finally:
        finish(a), finish(b)
    both = ra["allocated"] + rb["allocated"]
    log({"test": "pair", "limit": LIMIT, "allocated": [ra["allocated"], rb["allocated"]], "shim_peak": peak})
    assert ra["error"] and rb["error"]
    assert both <= LIMIT and peak <= LIMIT, (both, peak)
    assert both >= 0.9 * LIMIT, f"together only {both / LIMIT:.1%}"


def test_reporting_torch_and_nvidia_smi(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/report", LIMIT)
    p = start("baseline", env)
    try:
        r = result(p)
        under = smi(env)
        plain = smi()
        base_mib = process_mib(p.pid)
    finally:
        finish(p)
    log({"test": "report", "torch_mem_get_info": r["info"], "nvidia_smi_under_shim_mib": under,
         "nvidia_smi_plain_mib": plain, "context_only_process_mib": base_mib})
    assert r["info"]["total"] == LIMIT and 0 <= r["info"]["free"] <= LIMIT
    assert under[0] == LIMIT // MiB and under[1] + under[2] == under[0]
    assert plain[0] > LIMIT // MiB


def test_no_limit_changes_nothing(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/nolimit", None)
    p = start("torch", env, cap_mib=6144)
    try:
        r = result(p)
    finally:
        finish(p)
    plain_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    q = start("baseline", plain_env)
    try:
        plain = result(q)
    finally:
        finish(q)
    log({"test": "nolimit", "info": r["info"], "allocated": r["allocated"], "plain_info": plain["info"]})
    assert r["error"] is None and r["allocated"] == 6144 * MiB, r
    assert r["info"]["total"] == plain["info"]["total"], (r["info"], plain["info"])
    assert not glob.glob(str(tmp_path / "cdmo-gpuslice-*")), "no limit: no region is created"
