"""libgpuslice on a real GPU: the whole footprint of each process stays within the limit.

Skipped where no GPU is present (the `gpu` fixture).  Each workload
(shim_workloads/fill.py) initialises its framework and waits; we measure its
footprint from outside through NVML (the driver's per-process used memory,
never the shim's own figures), let it allocate until its framework reports
out of memory, and measure again while it holds everything.  The asserts:
  * the footprint NVML reports is at or under the limit;
  * the framework got at least limit - (its measured context) - 3 % of the
    limit, the context being what NVML shows the process holding besides its
    allocations (JAX's default preallocation aside: 75 % of the total by design);
  * the memory queries still report total = limit.
Set SHIM_GPU_LOG to a file to collect every measurement as JSON lines.

The shim's ledger is the fixed directory the CDI spec mounts (LEDGER, built into the library), and
its limit the fixed file the CDI spec mounts beside it (LIMIT): each test starts with the ledger empty
and writes the limit it runs under (CDMO_GPU_MEMORY_LIMIT is set too, as the spec shows it, but the
shim does not read it), which needs root (the GPU machines run these as root); elsewhere they skip.
LIMIT is removed after each test.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(__file__).resolve().parent / "shim_workloads"
FILL = WORK / "fill.py"
GRAPHS = WORK / "graphs.py"
MiB = 1 << 20
GiB = 1 << 30
LIMITS = {"1.5GiB": 3 * GiB // 2, "4GiB": 4 * GiB}
PEAK_OFFSET = 24  # struct gs_region: magic u64, version u32, size u32, nslots u32, refused u32, peak u64
LEDGER = Path("/run/cdmo/ledger")  # GS_LEDGER_DIR in shim/gs.h, LEDGER_PATH_IN_CONTAINER in core
LIMIT = Path("/run/cdmo/limit")  # GS_LIMIT_FILE in shim/gs.h, LIMIT_PATH_IN_CONTAINER in core
SLACK = 0.03  # allocations must reach limit - context - 3 % of the limit


def log(record: dict) -> None:
    path = os.environ.get("SHIM_GPU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def shim() -> Path:
    subprocess.run(["make", "-C", str(ROOT / "shim")], check=True, capture_output=True)
    return ROOT / "shim" / "libgpuslice.so"


@pytest.fixture(autouse=True)
def fresh_ledger(gpu: str) -> Iterator[Path]:
    """The ledger directory on this machine, empty, writable by every uid (as the agent makes it), and
    no limit file until a test writes one (``write_limit``); the limit file is removed afterwards.
    Takes ``gpu``: where none is present nothing here is touched."""
    if os.geteuid() != 0:
        pytest.skip(f"the shim's ledger is {LEDGER} and its limit {LIMIT} (fixed at build time): "
                    "making them needs root")
    shutil.rmtree(LEDGER, ignore_errors=True)
    LIMIT.unlink(missing_ok=True)
    LEDGER.mkdir(parents=True)
    LEDGER.chmod(0o1777)
    yield LEDGER
    LIMIT.unlink(missing_ok=True)


def write_limit(content: str | None) -> None:
    """The slice's limit file as the agent writes it (a byte count and a newline); None: no file."""
    if content is None:
        LIMIT.unlink(missing_ok=True)
    else:
        LIMIT.write_text(f"{content}\n")
        LIMIT.chmod(0o644)


def shim_env(lib: Path, tmp: Path, slice_: str, limit: int | None, extra: dict | None = None) -> dict:
    """The environment of a process under the shim, with ``limit`` written to the limit file (None: no
    file, no limit); SHIM_TEST_TMP (ours, not the shim's) is where its stderr goes."""
    env = dict(os.environ)
    for k in ("CDMO_GPU_MEMORY_LIMIT", "CDMO_SHIM_DISABLE", "CDMO_SHIM_FOOTPRINT", "PYTORCH_CUDA_ALLOC_CONF",
              "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    env.update({"LD_PRELOAD": str(lib), "CDMO_SLICE": slice_, "SHIM_TEST_TMP": str(tmp),
                "PYTHONUNBUFFERED": "1"})
    write_limit(str(limit) if limit else None)
    if limit:
        env["CDMO_GPU_MEMORY_LIMIT"] = str(limit)  # for display, as the CDI spec shows it
    env.update(extra or {})
    return env


# ---- the outside view: NVML's per-process used memory --------------------------------------
def nvml_usage() -> dict[tuple[int, int], int]:
    """{(pid, GPU index): bytes} for every compute process, read by this (unshimmed) process."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out: dict[tuple[int, int], int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.usedGpuMemory is not None:
                    out[(p.pid, i)] = out.get((p.pid, i), 0) + int(p.usedGpuMemory)
        return out
    finally:
        pynvml.nvmlShutdown()


def footprint(pid: int, gpu: int | None = 0) -> int:
    """NVML's used memory of one process on one GPU (GPU 0, where these workloads allocate: the limit
    is per GPU, and a framework may touch another GPU of a multi-GPU machine), or summed over all."""
    return sum(v for (p, g), v in nvml_usage().items() if p == pid and (gpu is None or g == gpu))


# ---- workloads ---------------------------------------------------------------------------------
class Workload:
    _n = 0

    def __init__(self, argv: list[str], env: dict, **popen: object):
        # stderr to a file: a chatty process (CDMO_SHIM_DEBUG) must not block on a full pipe
        Workload._n += 1
        self.errpath = Path(env.get("SHIM_TEST_TMP", "/tmp")) / f"stderr-{Workload._n}.txt"
        self.err = open(self.errpath, "w+")
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, **popen)  # type: ignore[call-overload]
        self.pid = self.p.pid

    def read(self, phase: str) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=60)
            raise AssertionError(f"workload died: rc={self.p.returncode}\n{self.errpath.read_text()[-3000:]}")
        msg = json.loads(line)
        assert msg.get("phase") == phase, msg
        return msg

    def go(self) -> None:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def finish(self) -> str:
        try:
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:  # e.g. an NCCL rank waiting for a peer that died
            self.p.kill()
            self.p.wait(timeout=30)
        self.err.close()
        return self.errpath.read_text()


CHUNK_MIB = 16  # well under 3 % of the smallest limit: the last piece that does not fit loses little


def fill(mode: str, env: dict, cap_mib: int = 16384, devices: str = "0") -> Workload:
    return Workload([sys.executable, str(FILL), mode, str(CHUNK_MIB), str(cap_mib), devices], env)


def region_peak(ledger: Path = LEDGER) -> int:
    """The shim's own high-water mark, over the slice's ledger files (one per GPU it touched)."""
    files = glob.glob(str(ledger / "gpu-*"))
    assert files, "no region"
    peaks = []
    for name in files:
        with open(name, "rb") as f:
            f.seek(PEAK_OFFSET)
            peaks.append(struct.unpack("<Q", f.read(8))[0])
    return max(peaks)


def smi(env: dict | None = None, query: str = "memory.total,memory.used,memory.free") -> list[int]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    return [int(x) for x in out.splitlines()[0].split(",")]


WORKLOADS = {
    "torch-default": ("torch", {}),
    "torch-expandable": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "torch-cudaMallocAsync": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "cupy-default": ("cupy", {}),
    "cupy-async": ("cupy_async", {}),
    "jax-default": ("jax", {}),
    "jax-platform": ("jax", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
}


@pytest.mark.parametrize("limit_name", list(LIMITS))
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_footprint_within_limit(gpu: str, shim: Path, tmp_path: Path, name: str, limit_name: str) -> None:
    limit = LIMITS[limit_name]
    mode, extra = WORKLOADS[name]
    env = shim_env(shim, tmp_path, f"gputest/{name}", limit, extra)
    w = fill(mode, env)
    try:
        ready = w.read("ready")
        ctx = footprint(w.pid)  # the process before it allocates: context, modules, preallocation
        w.go()
        done = w.read("done")
        held = footprint(w.pid)
        peak = region_peak()
        shim_smi = smi(env)
    finally:
        w.finish()
    allocated, err = done["allocated"]["0"], done["error"]["0"]
    rec = {"test": "fill", "workload": name, "limit": limit, "footprint_before": ctx, "footprint_held": held,
           "allocated": allocated, "shim_peak": peak, "framework_error": err, "ready": ready["info"],
           "info": done["info"], "nvidia_smi_under_shim_mib": shim_smi}
    log(rec)
    assert err, f"{name}: never ran out of memory: {rec}"
    assert held <= limit, f"{name}: footprint {held / MiB:.0f} MiB over the {limit / MiB:.0f} MiB limit: {rec}"
    if name != "jax-default":  # JAX preallocates 75 % of the total: see docs/shim.md
        # the measured context: what NVML shows the process holding besides its allocations, before
        # it allocates or once it is full, whichever is more (a stream-ordered pool adds its own)
        overhead = max(ctx, held - allocated)
        floor = limit - overhead - SLACK * limit
        assert allocated >= floor, f"{name}: got {allocated / MiB:.0f} MiB, want >= {floor / MiB:.0f}: {rec}"
    assert shim_smi[0] == limit // MiB, f"nvidia-smi under the shim shows total {shim_smi[0]} MiB"
    if mode in ("torch", "cupy", "cupy_async"):
        info = ready["info"]["0"]
        assert info["total"] == limit, f"{name}: mem_get_info total {info['total']}"
        # free falls by the context's share, as NVML measures it from outside
        assert abs((limit - info["free"]) - ctx) <= 64 * MiB, (
            f"{name}: free {info['free']} against context {ctx}: {rec}")


@pytest.mark.parametrize("limit_name", list(LIMITS))
def test_two_processes_share_one_limit(gpu: str, shim: Path, tmp_path: Path, limit_name: str) -> None:
    limit = LIMITS[limit_name]
    env = shim_env(shim, tmp_path, "gputest/pair", limit)
    a, b = fill("torch", env), fill("torch", env)
    try:
        a.read("ready"), b.read("ready")
        ctx = footprint(a.pid) + footprint(b.pid)
        a.go(), b.go()
        ra, rb = a.read("done"), b.read("done")
        fa, fb = footprint(a.pid), footprint(b.pid)
    finally:
        a.finish(), b.finish()
    both = ra["allocated"]["0"] + rb["allocated"]["0"]
    rec = {"test": "pair", "limit": limit, "allocated": [ra["allocated"]["0"], rb["allocated"]["0"]],
           "footprints": [fa, fb], "contexts_before": ctx}
    log(rec)
    assert ra["error"]["0"] and rb["error"]["0"], rec
    assert fa + fb <= limit, f"summed footprint {(fa + fb) / MiB:.0f} MiB over the limit: {rec}"
    assert both >= limit - ctx - SLACK * limit, f"together only {both / MiB:.0f} MiB: {rec}"


def test_graph_memory_nodes(gpu: str, shim: Path, tmp_path: Path) -> None:
    limit = LIMITS["1.5GiB"]
    env = shim_env(shim, tmp_path, "gputest/graphs", limit)
    w = Workload([sys.executable, str(GRAPHS), str(limit)], env)
    try:
        w.read("ready")
        ctx = footprint(w.pid)
        w.go()
        done = w.read("done")
        held = footprint(w.pid)
    finally:
        stderr = w.finish()
    rec = {"test": "graphs", "limit": limit, "footprint_before": ctx, "footprint_held": held, **done}
    log(rec)
    assert done["a_launch"] == [0, 0], f"{rec}\n{stderr[-2000:]}"
    counted_a = limit - done["a_after"]["free"]
    assert done["a_graph_reserved"] >= 512 * MiB, rec
    assert counted_a >= ctx + done["a_graph_reserved"] - 64 * MiB, f"graph memory not counted: {rec}"
    assert done["b_launch"] == 2, f"a graph of the whole limit must be refused at launch: {rec}"
    assert done["c_alloc"] == 0 and done["c_free"] == 0 and done["c_launch"] == [0, 0, 0], rec
    assert held <= limit, f"footprint {held / MiB:.0f} MiB over the limit: {rec}"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def test_own_pid_namespace_uses_the_context_delta(gpu: str, shim: Path, tmp_path: Path) -> None:
    """In a container's pid namespace NVML's pids are not the process's own: the shim falls back
    to the device's used-memory delta around context creation."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a new pid namespace")
    limit = LIMITS["1.5GiB"]
    env = shim_env(shim, tmp_path, "gputest/pidns", limit, {"CDMO_SHIM_DEBUG": "1"})
    w = Workload(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(FILL), "torch", str(CHUNK_MIB),
                  "16384"], env)
    try:
        w.read("ready")
        kids = []
        for _ in range(50):
            kids = _children(w.pid)
            if kids:
                break
            time.sleep(0.1)
        assert kids, "no process inside the namespace"
        host_pid = kids[0]
        ctx = footprint(host_pid)
        w.go()
        done = w.read("done")
        held = footprint(host_pid)
    finally:
        stderr = w.finish()
    allocated = done["allocated"]["0"]
    rec = {"test": "pidns", "limit": limit, "footprint_before": ctx, "footprint_held": held,
           "allocated": allocated, "shim_log": [ln for ln in stderr.splitlines() if "footprint" in ln
                                                or "context on device" in ln][:6]}
    log(rec)
    assert "context-creation delta" in stderr, f"the fallback was not chosen: {rec}"
    assert "(device used-memory delta)" in stderr, f"context creation was not measured: {rec}"
    assert held <= limit, f"footprint {held / MiB:.0f} MiB over the limit: {rec}"
    assert allocated >= limit - ctx - SLACK * limit, rec


def test_reporting_torch_and_nvidia_smi(gpu: str, shim: Path, tmp_path: Path) -> None:
    limit = LIMITS["4GiB"]
    env = shim_env(shim, tmp_path, "gputest/report", limit)
    w = fill("baseline", env)
    try:
        r = w.read("ready")
        ctx = footprint(w.pid)
        under = smi(env)
        plain = smi()
    finally:
        w.finish()
    info = r["info"]["0"]
    log({"test": "report", "torch_mem_get_info": info, "nvidia_smi_under_shim_mib": under,
         "nvidia_smi_plain_mib": plain, "context_only_process": ctx})
    assert info["total"] == limit and 0 <= info["free"] <= limit
    assert under[0] == limit // MiB and under[1] + under[2] == under[0]
    # nvidia-smi under the shim shows the slice's footprint: this process's context
    assert abs(under[1] - ctx / MiB) <= 64, (under, ctx)
    assert plain[0] > limit // MiB


# The limit file as the container gets it, and what it must do (issue 19)
SMALL = {
    "1GiB": ("1073741824", {}),  # the floor a slice is granted: what is left for tensors
    "1GiB-disable": ("1073741824", {"CDMO_SHIM_DISABLE": "1"}),  # the old kill switch lifts nothing
    "256MiB": (str(256 * MiB), {}),  # the context alone fills it
    "zero": ("0", {}),  # present but not a byte count >= 1: every allocation refused
}


@pytest.mark.parametrize("case", list(SMALL))
def test_small_and_refused_limits(gpu: str, shim: Path, tmp_path: Path, case: str) -> None:
    value, extra = SMALL[case]
    limit = int(value)
    env = shim_env(shim, tmp_path, f"gputest/small-{case}", None, {"CDMO_GPU_MEMORY_LIMIT": value, **extra})
    write_limit(value)
    w = fill("torch", env)
    try:
        ready = w.read("ready")
        ctx = footprint(w.pid)
        w.go()
        done = w.read("done")
        held = footprint(w.pid)
    finally:
        stderr = w.finish()
    allocated, err, info = done["allocated"]["0"], done["error"]["0"], ready["info"]["0"]
    said = [ln for ln in stderr.splitlines() if "libgpuslice" in ln]
    rec = {"test": "small", "case": case, "limit": limit, "footprint_before": ctx, "footprint_held": held,
           "allocated": allocated, "framework_error": err, "ready": info, "info": done["info"], "shim_said": said}
    log(rec)
    assert err, f"{case}: never ran out of memory: {rec}"
    if case.startswith("1GiB"):
        assert info["total"] == limit, rec
        assert held <= limit, f"footprint {held / MiB:.0f} MiB over the limit: {rec}"
        assert allocated >= limit - ctx - SLACK * limit, rec
        assert ("CDMO_SHIM_DISABLE=1 is ignored" in stderr) == ("CDMO_SHIM_DISABLE" in extra), said
        return
    # nothing but the context: every tensor refused before it reached the driver
    assert allocated == 0, rec
    assert held <= ctx + 2 * MiB, rec
    assert info["free"] == 0 and info["total"] == limit, rec
    if limit == 0:
        assert f'the slice\'s limit file {LIMIT} holds "0", which is zero' in stderr, said
    else:
        assert ctx > limit and "alone take the whole limit" in stderr, said


def test_no_limit_changes_nothing(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/nolimit", None)
    w = fill("torch", env, cap_mib=6144)
    try:
        w.read("ready")
        w.go()
        r = w.read("done")
    finally:
        w.finish()
    plain_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    q = fill("baseline", plain_env)
    try:
        plain = q.read("ready")
    finally:
        q.finish()
    log({"test": "nolimit", "info": r["info"], "allocated": r["allocated"], "plain_info": plain["info"]})
    assert r["error"]["0"] is None and r["allocated"]["0"] == 6144 * MiB, r
    assert r["info"]["0"]["total"] == plain["info"]["0"]["total"], (r["info"], plain["info"])
    assert not glob.glob(str(LEDGER / "gpu-*")), "no limit: no ledger file is created"
