"""Runs the shim's GPU-free C tests (shim/tests/shimtest.c) one case at a time,
so that pytest counts and reports each.  The library, the fake libcuda.so.1 /
libnvidia-ml.so.1 and the test binary are built with `make -C shim` first."""

import os
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


LEDGER_IN_CONTAINER = "/run/cdmo/ledger"  # core/node/cdi.py mounts the claim's ledger directory here
LIMIT_IN_CONTAINER = "/run/cdmo/limit"  # and the slice's limit file here, read-only


def test_the_ledger_and_the_limit_are_fixed_at_build_time() -> None:
    """No variable chooses another ledger (issue 24) or another limit: the library names the directory
    and the file the CDI spec mounts, and reads no variable that could point elsewhere or change how
    the context is counted."""
    _build()
    from mig_operator.core.node.environment import LEDGER_PATH_IN_CONTAINER, LIMIT_PATH_IN_CONTAINER

    assert (LEDGER_PATH_IN_CONTAINER, LIMIT_PATH_IN_CONTAINER) == (LEDGER_IN_CONTAINER, LIMIT_IN_CONTAINER)
    data = (SHIM / "libgpuslice.so").read_bytes()
    assert LEDGER_IN_CONTAINER.encode() + b"\0" in data
    assert LIMIT_IN_CONTAINER.encode() + b"\0" in data
    for gone in (b"CDMO_SHIM_DIR", b"CDMO_SHIM_STRICT", b"/dev/shm", b"CDMO_SLICE", b"CDMO_SHIM_FOOTPRINT"):
        assert gone not in data, gone
    # the tests' copy differs in those paths (and honours CDMO_SHIM_FOOTPRINT against the fake driver)
    test_copy = (SHIM / "build" / "test" / "libgpuslice.so").read_bytes()
    assert LEDGER_IN_CONTAINER.encode() not in test_copy and LIMIT_IN_CONTAINER.encode() not in test_copy


# ---- /etc/ld.so.preload: the shim whatever the environment says --------------------------------
# Unless a user and mount namespace of our own can be made (unshare -Urm), or we are root (unshare -m),
# these tests skip: /etc/ld.so.preload is only ever replaced inside a private mount namespace, never on
# this machine. Inside it, a directory of our own is bound over /etc holding the loader's cache and an
# ld.so.preload naming the tests' copy of the library, as the CDI spec's read-only file names the shim.
def _namespace_prefix() -> list[str] | None:
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-Urm", "--propagation", "private"], ["unshare", "-m", "--propagation", "private"]):
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, check=False)
        if done.returncode == 0:
            return prefix
    return None


def _run_case_in_container(tmp_path: Path, case: str, limit: str | None, preload: bool,
                           env_words: list[str]) -> subprocess.CompletedProcess:
    """Run one shimtest case as a process of a sliced container would start: its own case directory
    (the ledger, and the limit file when ``limit`` is given), LD_PRELOAD removed (``env -u``), the
    variables ``env_words`` set, and, with ``preload``, /etc/ld.so.preload naming the library."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -Urm / unshare -m): /etc/ld.so.preload is "
                    "never replaced outside one")
    _build()
    case_dir = tmp_path / "case"
    (case_dir / "ledger").mkdir(parents=True)
    (case_dir / "ledger").chmod(0o1777)
    if limit is not None:
        (case_dir / "limit").write_text(limit)
    etc = tmp_path / "etc"
    etc.mkdir()
    if Path("/etc/ld.so.cache").exists():
        shutil.copy("/etc/ld.so.cache", etc / "ld.so.cache")
    if preload:
        (etc / "ld.so.preload").write_text(f"{SHIM / 'build' / 'test' / 'libgpuslice.so'}\n")
    # The bind mount happens in the namespace only; the process then runs with LD_PRELOAD gone.
    script = 'mount --bind "$1" /etc && shift && exec "$@"'
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SHIMTEST_DIR": str(case_dir),
           "LD_LIBRARY_PATH": str(SHIM / "build" / "fake"),
           "LD_PRELOAD": str(SHIM / "build" / "test" / "libgpuslice.so")}  # what `env -u` takes away
    with open(case_dir / "stderr", "w") as stderr:
        done = subprocess.run([*prefix, "sh", "-c", script, "sh", str(etc),
                               "env", "-u", "LD_PRELOAD", *env_words, str(BIN), "--case", case],
                              cwd=case_dir, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120)
    done.stderr = (case_dir / "stderr").read_text()
    return done


WHOLE_GPU = str(80 << 30)  # the fake driver's whole GPU


def test_a_process_that_drops_ld_preload_and_raises_the_variable_keeps_the_files_limit(tmp_path: Path) -> None:
    done = _run_case_in_container(tmp_path, "limit_exact", "1073741824\n", preload=True,
                                  env_words=[f"CDMO_GPU_MEMORY_LIMIT={WHOLE_GPU}"])
    assert done.returncode == 0, f"the 1 GiB limit did not hold:\n{done.stdout}\n{done.stderr}"


def test_without_ld_so_preload_the_same_process_is_not_limited(tmp_path: Path) -> None:
    """The control: the same process and files, no /etc/ld.so.preload. Nothing loads the shim, so the
    case's 1 GiB + 1 byte allocation gets through to the fake driver's 80 GiB and the case fails;
    the test above passes because of the preload file, not by chance."""
    done = _run_case_in_container(tmp_path, "limit_exact", "1073741824\n", preload=False,
                                  env_words=[f"CDMO_GPU_MEMORY_LIMIT={WHOLE_GPU}"])
    assert done.returncode != 0 and "limit + 1 byte is refused" in done.stderr, done.stderr


def test_a_preloaded_shim_with_the_variable_but_no_limit_file_refuses_everything(tmp_path: Path) -> None:
    done = _run_case_in_container(tmp_path, "limit_env_only", None, preload=True,
                                  env_words=[f"CDMO_GPU_MEMORY_LIMIT={WHOLE_GPU}"])
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


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
