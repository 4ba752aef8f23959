"""Runs the shim's GPU-free C tests (shim/tests/shimtest.c) one case at a time,
so that pytest counts and reports each.  The library, the fake libcuda.so.1 /
libnvidia-ml.so.1 and the test binary are built with `make -C shim` first."""

import shutil
import subprocess
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parents[2] / "shim"
BIN = SHIM / "build" / "shimtest"

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("cc") is None, reason="needs make and a C compiler"
)


def _build() -> None:
    subprocess.run(
        ["make", "-C", str(SHIM), "libgpuslice.so", "build/test/libgpuslice.so", "build/fake/libcuda.so.1",
         "build/fake/libnvidia-ml.so.1", "build/shimtest"],
        check=True, capture_output=True, text=True,
    )


def _cases() -> list[str]:
    try:
        _build()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return ["build"]  # reported as a failure by test_case below
    out = subprocess.run([str(BIN), "--list"], check=True, capture_output=True, text=True).stdout
    return out.split()


@pytest.mark.parametrize("case", _cases())
def test_case(case: str) -> None:
    _build()
    r = subprocess.run([str(BIN), "--run", case], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{case} failed:\n{r.stdout}\n{r.stderr}"
    assert f"ok 1 - {case}" in r.stdout


def test_library_exports_only_entry_points() -> None:
    _build()
    out = subprocess.run(["nm", "-D", "--defined-only", str(SHIM / "libgpuslice.so")],
                         check=True, capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert "dlsym" in names and "cuMemAlloc_v2" in names and "nvmlDeviceGetMemoryInfo_v2" in names
    stray = {n for n in names if not (n.startswith(("cu", "nvml")) or n == "dlsym")}
    assert not stray, f"internal symbols leak: {sorted(stray)}"
    assert "cuGetExportTable" not in names, "cuGetExportTable must reach the driver untouched"


LEDGER_IN_CONTAINER = "/run/cdmo/ledger"  # core/cdi.py mounts the claim's ledger directory here


def test_the_ledger_is_fixed_at_build_time() -> None:
    """No variable chooses another ledger (issue 24): the library names its directory, the one the CDI
    spec mounts, and reads no variable that could point elsewhere."""
    _build()
    from mig_operator.core.environment import LEDGER_PATH_IN_CONTAINER

    assert LEDGER_PATH_IN_CONTAINER == LEDGER_IN_CONTAINER
    data = (SHIM / "libgpuslice.so").read_bytes()
    assert LEDGER_IN_CONTAINER.encode() + b"\0" in data
    for gone in (b"CDMO_SHIM_DIR", b"CDMO_SHIM_STRICT", b"/dev/shm", b"CDMO_SLICE"):
        assert gone not in data, gone
    # the tests' copy differs only in that directory
    assert LEDGER_IN_CONTAINER.encode() not in (SHIM / "build" / "test" / "libgpuslice.so").read_bytes()


def test_no_cuda_headers_and_warnings_as_errors() -> None:
    src = "".join(p.read_text() for p in SHIM.glob("*.[ch]"))
    assert "#include <cuda.h>" not in src and "#include <nvml.h>" not in src
    assert "-Werror" in (SHIM / "Makefile").read_text()


def _undefined(obj: Path) -> set[str]:
    out = subprocess.run(["nm", "-u", str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_config_calls_into_no_other_module() -> None:
    """config.c reads the environment and logs; no module is set up from it (issue 19)."""
    _build()
    called = sorted(n for n in _undefined(SHIM / "build" / "config.o") if n.startswith("gs_"))
    assert not called, f"config.c calls other modules: {called}"


def test_each_module_registers_its_own_fork_handlers() -> None:
    _build()
    objs = sorted((SHIM / "build").glob("*.o"))
    assert len(objs) >= 10, objs
    for obj in objs:
        foreign = sorted(n for n in _undefined(obj) if "atfork" in n and n != "pthread_atfork")
        assert not foreign, f"{obj.name} calls another module's fork handler: {foreign}"
