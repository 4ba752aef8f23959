"""What a slice uses, read on a real GPU: the shim's ledger (``gpu.ledger``) against NVML's own
per-process figures, and NVML's activity of a whole GPU (``NvmlBackend.device_usage``).

Skipped where no GPU is present (the ``gpu`` fixture) and where not root (the shim's ledger and limit
are fixed paths, ``fresh_ledger`` of test_shim_gpu.py). Each PyTorch process (shim_workloads/hold.py)
holds, frees and asks for memory on command, so the ledger and NVML are read from outside at each step.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_shim_gpu import LEDGER, WORK, GiB, MiB, Workload, shim_env
from test_shim_gpu import fresh_ledger as fresh_ledger  # autouse: each test starts with an empty ledger
from test_shim_gpu import shim as shim  # the fixture: the library built on this machine

from mig_operator.core.usage.advice import advise_fraction
from mig_operator.gpu.ledger import LedgerFigures, ledger_path, read_ledger

if TYPE_CHECKING:
    from mig_operator.gpu.nvml import NvmlBackend

HOLD = WORK / "hold.py"
LIMIT = 8 * GiB
TOLERANCE = 64 * MiB  # the ledger against NVML's per-process figure


@pytest.fixture
def nvml(gpu: str) -> Iterator[NvmlBackend]:
    pytest.importorskip("torch")
    from mig_operator.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        yield backend
    finally:
        backend.close()


def hold(env: dict) -> Workload:
    w = Workload([sys.executable, str(HOLD)], env)
    w.read("ready")
    return w


def tell(w: Workload, command: str) -> dict:
    """Send one command to a hold.py process and wait for its answer."""
    assert w.p.stdin is not None
    w.p.stdin.write(command + "\n")
    w.p.stdin.flush()
    return w.read(command.split()[0])


def ledger_file() -> str:
    files = glob.glob(str(LEDGER / "gpu-*"))
    assert len(files) == 1, f"one GPU's ledger, found {files}"
    return files[0]


def figures(path: str) -> LedgerFigures:
    read = read_ledger(path)
    assert read is not None, f"{path} holds no figures of this boot"
    return read


def per_process(nvml: NvmlBackend, gpu_uuid: str) -> dict[int, int]:
    """NVML's used memory of each process on the GPU, through the backend the agent uses."""
    usage = nvml.device_usage(gpu_uuid)
    return {p.pid: p.memory_used for p in usage.processes}


def test_ledger_matches_nvml_keeps_its_peak_sums_processes_and_counts_refusals(
        gpu: str, shim: Path, tmp_path: Path, nvml: NvmlBackend) -> None:
    env = shim_env(shim, tmp_path, "gputest/usage", LIMIT)
    a = hold(env)
    b: Workload | None = None
    try:
        path = ledger_file()
        # ledger_path names exactly the file the shim opened for this GPU
        uuids = [g.uuid for g in nvml.gpus() if ledger_path(str(LEDGER), g.uuid) == path]
        assert len(uuids) == 1, f"no GPU's ledger_path is {path}"
        gpu_uuid = uuids[0]
        start = figures(path)
        assert (start.processes, start.refusals) == (1, 0), start

        assert tell(a, "alloc 3072")["ok"]
        held = figures(path)
        nv = per_process(nvml, gpu_uuid)
        assert a.pid in nv, f"NVML does not list pid {a.pid}: {nv}"
        assert held.used >= 3 * GiB and abs(held.used - nv[a.pid]) <= TOLERANCE, (held, nv[a.pid])
        print(f"\n3 GiB held: ledger used {held.used / MiB:.0f} MiB, NVML's figure for the process "
              f"{nv[a.pid] / MiB:.0f} MiB")  # pytest -s shows it: docs/benchmarks.md quotes it
        assert held.peak >= held.used, held

        tell(a, "free")
        freed = figures(path)
        assert freed.used <= held.used - 3 * GiB + TOLERANCE, (freed, held)
        assert freed.peak == held.peak, f"the peak stays after the memory is freed: {freed} after {held}"
        # The advice on this peak names a fraction that holds it (read here as whole GiB, independently).
        advice = advise_fraction(LIMIT, freed.peak, freed.refusals)
        assert advice is not None and advice.verdict == "Smaller", advice
        assert advice.suggested is not None and advice.suggested.endswith("Gi"), advice
        assert freed.peak <= int(advice.suggested.removesuffix("Gi")) * GiB < LIMIT, (advice, freed)

        b = hold(env)
        assert tell(a, "alloc 2048")["ok"] and tell(b, "alloc 1024")["ok"]
        both = figures(path)
        nv = per_process(nvml, gpu_uuid)
        assert both.processes == 2, both
        assert abs(both.used - (nv[a.pid] + nv[b.pid])) <= 2 * TOLERANCE, (both, nv)
        print(f"two processes: ledger used {both.used / MiB:.0f} MiB, NVML's figures summed "
              f"{(nv[a.pid] + nv[b.pid]) / MiB:.0f} MiB, peak {both.peak / MiB:.0f} MiB")

        assert both.refusals == 0, both
        assert not tell(b, "alloc 6144")["ok"], "6 GiB more than 3 GiB held fits an 8 GiB limit"
        refused = figures(path)
        assert refused.refusals >= 1, refused

        b.finish()
        b = None
        assert figures(path).processes == 1
    finally:
        if b is not None:
            b.finish()
        a.finish()
    end = figures(path)
    assert (end.processes, end.used) == (0, 0), f"every process ended, so nothing is held: {end}"
    assert end.peak >= held.peak, end


def test_whole_gpu_activity_is_the_share_with_a_kernel_running(gpu: str, tmp_path: Path, nvml: NvmlBackend) -> None:
    gpu_uuid = nvml.gpus()[0].uuid
    env = {**os.environ, "SHIM_TEST_TMP": str(tmp_path), "CUDA_VISIBLE_DEVICES": gpu_uuid, "PYTHONUNBUFFERED": "1"}
    env.pop("LD_PRELOAD", None)
    w = hold(env)
    try:
        first = nvml.device_usage(gpu_uuid)
        assert first.active_percent is not None and 0 <= first.active_percent <= 100, first
        assert w.pid in {p.pid for p in first.processes}, first
        tell(w, "busy 3")
        busy = nvml.device_usage(gpu_uuid)
    finally:
        w.finish()
    # Three seconds of back-to-back matrix products since the reading before: kernels ran most of it.
    assert busy.active_percent is not None and busy.active_percent >= 50, busy
