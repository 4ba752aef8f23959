"""libgpuslice on two GPUs: one limit per GPU UUID, and NCCL under the shim.

Needs at least two GPUs (skipped otherwise).  Footprints are read from
outside through NVML, as in test_shim_gpu.py.  CUDA_DEVICE_ORDER=PCI_BUS_ID
makes CUDA's device numbers NVML's.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from test_shim_gpu import (  # noqa: F401  (fixtures: shim, fresh_ledger)
    FILL,
    LEDGER,
    SLACK,
    WORK,
    MiB,
    Workload,
    fill,
    footprint,
    fresh_ledger,
    log,
    nvml_usage,
    shim,
    shim_env,
)

LIMIT = 2 << 30
__all__ = ["shim"]  # the fixture, re-exported for pytest


@pytest.fixture
def two_gpus(gpu: str) -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        n = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if n < 2:
        pytest.skip(f"needs two GPUs, found {n}")


def env_for(shim_lib: Path, tmp: Path, slice_: str, extra: dict | None = None) -> dict:
    env = shim_env(shim_lib, tmp, slice_, LIMIT, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                  # NVLink multicast stays off on shared hosts
                                                  "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    env.update(extra or {})
    return env


def test_one_process_two_gpus_one_limit_each(two_gpus: None, shim: Path, tmp_path: Path) -> None:
    w = fill("torch", env_for(shim, tmp_path, "gputest/two-gpus"), devices="0,1")
    try:
        w.read("ready")
        ctx = [footprint(w.pid, 0), footprint(w.pid, 1)]
        w.go()
        done = w.read("done")
        held = [footprint(w.pid, 0), footprint(w.pid, 1)]
    finally:
        w.finish()
    got = [done["allocated"]["0"], done["allocated"]["1"]]
    rec = {"test": "one-process-two-gpus", "limit": LIMIT, "contexts": ctx, "footprints": held, "allocated": got,
           "regions": sorted(p.name for p in LEDGER.glob("gpu-*"))}
    log(rec)
    assert len(rec["regions"]) == 2, f"one region per GPU UUID: {rec}"
    for d in (0, 1):
        assert done["error"][str(d)], rec
        assert held[d] <= LIMIT, f"GPU {d}: footprint {held[d] / MiB:.0f} MiB over the limit: {rec}"
        assert got[d] >= LIMIT - ctx[d] - SLACK * LIMIT, f"GPU {d} got only {got[d] / MiB:.0f} MiB: {rec}"


def test_two_processes_on_two_gpus_do_not_share(two_gpus: None, shim: Path, tmp_path: Path) -> None:
    ws = [fill("torch", env_for(shim, tmp_path, "gputest/split", {"CUDA_VISIBLE_DEVICES": str(d)})) for d in (0, 1)]
    try:
        for w in ws:
            w.read("ready")
        ctx = [footprint(ws[d].pid, d) for d in (0, 1)]
        for w in ws:
            w.go()
        done = [w.read("done") for w in ws]
        held = [footprint(ws[d].pid, d) for d in (0, 1)]
    finally:
        for w in ws:
            w.finish()
    got = [r["allocated"]["0"] for r in done]
    rec = {"test": "two-processes-two-gpus", "limit": LIMIT, "contexts": ctx, "footprints": held, "allocated": got}
    log(rec)
    for d in (0, 1):
        assert held[d] <= LIMIT, rec
        assert got[d] >= LIMIT - ctx[d] - SLACK * LIMIT, f"process on GPU {d} shared a limit: {rec}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_allreduce_under_the_shim(two_gpus: None, shim: Path, tmp_path: Path) -> None:
    env = env_for(shim, tmp_path, "gputest/nccl")
    port = str(_free_port())
    ws = [Workload([sys.executable, str(WORK / "allreduce.py"), str(r), "2", port, "200"], env) for r in (0, 1)]
    try:
        ready = [w.read("ready") for w in ws]
        for w in ws:
            w.go()
        done = [w.read("done") for w in ws]
        usage = nvml_usage()
    except AssertionError as e:  # a rank died: the other waits for it; show both ranks' output
        errs = [w.finish() for w in ws]
        raise AssertionError(f"{e}\n" + "\n".join(f"rank {r}: {t[-3000:]}" for r, t in enumerate(errs))) from e
    errs = [w.finish() for w in ws]
    per = {f"{pid}/gpu{g}": v for (pid, g), v in usage.items() if pid in (ws[0].pid, ws[1].pid)}
    rec = {"test": "nccl", "limit": LIMIT, "ready": ready, "done": done, "footprints": per}
    log(rec)
    for r, e in zip(done, errs, strict=True):
        assert r["wrong"] == 0 and r["iters"] == 200, f"{rec}\n{e[-2000:]}"
        assert r["total"] == LIMIT, rec
    assert per, f"NVML lists neither rank: {rec}"
    for k, v in per.items():
        assert v <= LIMIT, f"{k}: footprint {v / MiB:.0f} MiB over the {LIMIT / MiB:.0f} MiB limit: {rec}"


assert FILL.exists()
