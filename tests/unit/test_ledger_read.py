"""Reading the shim's ledger (``gpu.ledger``): against files this test packs itself from the layout of
``struct gs_region`` (shim/region.c) as the C compiler lays it out, hostile files, and a ledger the
shim itself wrote (its test build, against the fake libcuda of shim/tests)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mig_operator.gpu.ledger import LedgerFigures, ledger_path, read_ledger

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "shim"
MiB = 1 << 20
BOOT = "0b9a3c6e-5a41-4c1f-9d2e-1f0c7a8b9e21"
MAGIC = 0x31474D48534F4443  # "CDOSHMG1" in region.c

# struct gs_region, version 2, as gcc lays it out: magic u64 @0, version u32 @8, size u32 @12,
# nslots u32 @16, refused u32 @20, peak u64 @24, recovered u64 @32, last_limit u64 @40, boot[40] @48,
# pthread_mutex_t @88 (40 bytes on x86-64 glibc, 48 on aarch64), used u64 at the next 64-byte line,
# slots at the line after; a slot is pid u32 @0, pad u32, start u64 @8, pidns u64 @16, used u64 @24.
X86 = {"used": 128, "slots": 192}
ARM = {"used": 192, "slots": 256}


def pack(used: int = 0, peak: int = 0, refused: int = 0, pids: dict[int, int] | None = None, *,
         layout: dict[str, int] = X86, nslots: int = 1024, magic: int = MAGIC, version: int = 2,
         boot: str = BOOT, size: int | None = None) -> bytes:
    """A ledger file's bytes: ``pids`` maps a slot index to the pid in it."""
    total = layout["slots"] + 32 * nslots
    buf = bytearray(total)
    struct.pack_into("<Q", buf, 0, magic)
    struct.pack_into("<III", buf, 8, version, total if size is None else size, nslots)
    struct.pack_into("<I", buf, 20, refused)
    struct.pack_into("<Q", buf, 24, peak)
    buf[48:48 + len(boot)] = boot.encode()
    struct.pack_into("<Q", buf, layout["used"], used)
    for slot, pid in (pids or {}).items():
        at = layout["slots"] + 32 * slot
        struct.pack_into("<IIQQQ", buf, at, pid, 0, 12345, 4026531836, 1 * MiB)
    return bytes(buf)


def write(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "gpu-5b3b5d0c1f2e4a779c10abcdef012300"
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("layout", [X86, ARM], ids=["x86-64", "aarch64"])
def test_the_figures_a_ledger_holds(tmp_path: Path, layout: dict[str, int]) -> None:
    content = pack(used=3 * 2**30, peak=5 * 2**30, refused=7, pids={0: 4242, 3: 99, 1023: 1}, layout=layout)
    assert read_ledger(write(tmp_path, content), boot_id=BOOT) == LedgerFigures(
        used=3 * 2**30, peak=5 * 2**30, processes=3, refusals=7)


def test_a_peak_behind_used_reads_as_used(tmp_path: Path) -> None:
    # the shim raises the peak just after it adds to used: a read in between sees used higher
    assert read_ledger(write(tmp_path, pack(used=900, peak=800)), boot_id=BOOT) == LedgerFigures(900, 900, 0, 0)


def test_no_figures_until_a_process_of_this_boot_started_the_ledger(tmp_path: Path) -> None:
    assert read_ledger(str(tmp_path / "absent"), boot_id=BOOT) is None  # no process ran yet
    assert read_ledger(write(tmp_path, b""), boot_id=BOOT) is None  # created, not yet sized
    assert read_ledger(write(tmp_path, bytes(32960)), boot_id=BOOT) is None  # sized, magic not yet written
    stale = pack(used=6 * 2**30, pids={0: 4242}, boot="another-boot")
    assert read_ledger(write(tmp_path, stale), boot_id=BOOT) is None  # its processes are all gone


def test_this_machines_boot_id_by_default(tmp_path: Path) -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert read_ledger(write(tmp_path, pack(used=5, pids={0: 1}, boot=boot))) == LedgerFigures(5, 5, 1, 0)


HOSTILE = {
    "truncated-header": (pack()[:40], "truncated"),
    "truncated-slots": (pack()[:5000], "truncated"),
    "wrong-magic": (pack(magic=0x4141414141414141), "not a gpuslice ledger"),
    "version-1": (pack(version=1), "layout version 1"),
    "huge-nslots": (pack(nslots=1024)[:16] + struct.pack("<I", 2**32 - 1) + pack()[20:], "slots"),
    "no-slots": (pack(nslots=1024)[:16] + struct.pack("<I", 0) + pack()[20:], "slots"),
    "huge-size": (pack(size=2**32 - 1), "which no ledger is"),
    "size-not-aligned": (pack(size=192 + 32 * 1024 + 8), "which no ledger is"),
    "size-inside-header": (pack(nslots=2, size=64 + 64), "which no ledger is"),
}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose ledger path is short enough to be quoted whole in a message (a pytest-xdist
    worker's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="ledger-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_file_that_is_not_a_ledger_is_a_value_error_naming_it(short_dir: Path, name: str) -> None:
    content, said = HOSTILE[name]
    path = write(short_dir, content)
    with pytest.raises(ValueError) as bad:
        read_ledger(path, boot_id=BOOT)
    assert said in str(bad.value) and path in str(bad.value) and "\n" not in str(bad.value)
    assert Path(path).read_bytes() == content  # read, never written


def test_a_link_or_a_fifo_in_the_ledgers_place_is_refused_without_waiting(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(pack(used=1))
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        read_ledger(str(link), boot_id=BOOT)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_ledger(str(fifo), boot_id=BOOT)  # opening a FIFO for reading would block without O_NONBLOCK


def test_a_larger_file_is_read_only_as_far_as_the_ledger_goes(tmp_path: Path) -> None:
    content = pack(used=7, pids={2: 5}) + b"\xff" * (1 << 20)
    assert read_ledger(write(tmp_path, content), boot_id=BOOT) == LedgerFigures(7, 7, 1, 0)


def test_ledger_path_names_the_file_the_shim_opens() -> None:
    # shim/report.c: the UUID after its first dash, dashes dropped, lower case, after "gpu-"
    assert ledger_path("/var/lib/mig-operator/ledgers/uid-1", "GPU-5B3B5D0C-1f2e-4a77-9c10-abcdef012300") == \
        "/var/lib/mig-operator/ledgers/uid-1/gpu-5b3b5d0c1f2e4a779c10abcdef012300"
    for bad in ("GPU-5b3b", "GPU-zz3b5d0c-1f2e-4a77-9c10-abcdef012300", "",
                "GPU-5b3b5d0c-1f2e-4a77-9c10-abcdef01230011"):
        with pytest.raises(ValueError, match="32 hex digits"):
            ledger_path("/d", bad)


# ---- a ledger the shim wrote -------------------------------------------------------------------
_TEST_BUILD = ("build/test/libgpuslice.so", "build/fake/libcuda.so.1", "build/fake/libnvidia-ml.so.1")

# Run under the shim's test build: allocate through the fake driver as a CUDA program does, report
# each call's result, and hold until stdin closes (a normal exit gives the process's share back).
_PROGRAM = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ptr = ctypes.c_uint64()
for mib in sys.argv[1:]:
    print(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(mib) << 20)), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def shim_test_build() -> Path:
    """The shim's test build (ledger in the relative directory ``ledger``, limit in the file ``limit``)
    and the fake driver it runs against; `make -C shim test` builds them, else they are built here."""
    if not all((SHIM / f).exists() for f in _TEST_BUILD):
        if shutil.which("make") is None or shutil.which(os.environ.get("CC", "gcc")) is None:
            pytest.skip("the shim's test build is absent and there is no C compiler to build it")
        subprocess.run(["make", "-C", str(SHIM), *_TEST_BUILD], check=True, capture_output=True, timeout=300)
    return SHIM / "build"


def _shimmed(build: Path, workdir: Path, *mib: int) -> subprocess.Popen[str]:
    env = {**os.environ, "LD_PRELOAD": str(build / "test" / "libgpuslice.so"), "LD_LIBRARY_PATH": str(build / "fake")}
    return subprocess.Popen([sys.executable, "-c", _PROGRAM, *map(str, mib)], cwd=workdir, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _results(proc: subprocess.Popen[str], count: int) -> list[int]:
    assert proc.stdout is not None
    return [int(proc.stdout.readline()) for _ in range(count)]


def _end(proc: subprocess.Popen[str]) -> None:
    proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_ledger_the_shim_wrote(shim_test_build: Path, tmp_path: Path) -> None:
    (tmp_path / "ledger").mkdir(mode=0o1777)
    (tmp_path / "limit").write_text(f"{1024 * MiB}\n")
    path = ledger_path(str(tmp_path / "ledger"), "GPU-5b3b5d0c-1f2e-4a77-9c10-abcdef012300")  # the fake GPU
    # 2 = CUDA_ERROR_OUT_OF_MEMORY: 512 + 600 MiB passes the 1 GiB limit
    started: list[subprocess.Popen[str]] = []
    try:
        started.append(first := _shimmed(shim_test_build, tmp_path, 512, 600))
        assert _results(first, 2) == [0, 2]
        assert read_ledger(path) == LedgerFigures(used=512 * MiB, peak=512 * MiB, processes=1, refusals=1)
        started.append(second := _shimmed(shim_test_build, tmp_path, 256))
        assert _results(second, 1) == [0]
        assert read_ledger(path) == LedgerFigures(used=768 * MiB, peak=768 * MiB, processes=2, refusals=1)
        _end(second)
        assert read_ledger(path) == LedgerFigures(used=512 * MiB, peak=768 * MiB, processes=1, refusals=1)
        _end(first)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert read_ledger(path) == LedgerFigures(used=0, peak=768 * MiB, processes=0, refusals=1)
