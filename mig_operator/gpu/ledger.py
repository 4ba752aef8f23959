"""The shim's ledger of one slice on one GPU, read from the node: the bytes its processes hold now, the
high-water mark, how many processes hold a slot, and how many allocations it refused for the limit.

The ledger is ``struct gs_region`` of shim/region.c, a file every process of the slice maps shared.
It is read here with one ``pread``, never locked, mapped or written, so a reader can neither stall
nor disturb the slice's allocations; each figure is one atomic word, so a read sees each as it was
at some instant (a sum across them may be a moment apart). Layout, little-endian, offsets in bytes:

    0   u64 magic "CDOSHMG1"      20  u32 refused          48  char boot[40] (the kernel's boot id)
    8   u32 version (2)           24  u64 peak (of used)   88  pthread_mutex_t (size per C library)
    12  u32 size (whole region)   32  u64 recovered        ..  u64 used, alone on a 64-byte line
    16  u32 nslots                40  u64 last_limit       ..  slots[nslots], 32 bytes each

A slot is ``u32 pid`` (0: free), ``u32 pad``, ``u64 start``, ``u64 pidns``, ``u64 used``. The slots
end the region and are 64-byte aligned, so they start at ``size - nslots * 32`` and ``used`` sits
one cache line before them, whatever the mutex's size.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass

from mig_operator.core.requests.quantities import clip_repr
from mig_operator.gpu.files import host_boot_id

LEDGER_MAGIC = 0x31474D48534F4443  # "CDOSHMG1", GS_MAGIC
LEDGER_VERSION = 2  # GS_VERSION
MAX_SLOTS = 1024  # GS_SLOTS
SLOT_BYTES = 32
# The region is 32,960 bytes with glibc on x86-64; nothing larger than this is one.
MAX_LEDGER_BYTES = 64 * 1024
_HEADER = struct.Struct("<QIIIIQQQ40s")  # magic .. boot: the fixed part before the mutex
_SLOT_PID = struct.Struct("<I28x")  # a slot's pid; the rest of the slot skipped
_U64 = struct.Struct("<Q")
_LINE = 64


@dataclass(frozen=True)
class LedgerFigures:
    """What a slice's ledger on one GPU says now."""

    used: int  # bytes the slice's processes hold on the GPU
    peak: int  # the most they held at once since the ledger was started (this boot)
    processes: int  # processes holding a slot (a process killed without exiting keeps its slot until reaped)
    refusals: int  # allocations refused because they would have passed the slice's limit


def ledger_path(ledger_dir: str, gpu_uuid: str) -> str:
    """The ledger file the shim opens in ``ledger_dir`` for the GPU ``gpu_uuid``: ``gpu-`` and the UUID's
    32 hex digits in lower case, without its ``GPU-`` prefix and dashes (shim/report.c
    ``nvml_uuid_hex``). ValueError for a UUID that is not one."""
    _prefix, dash, rest = gpu_uuid.partition("-")
    digits = (rest if dash else gpu_uuid).replace("-", "").lower()
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"GPU UUID {clip_repr(gpu_uuid)} does not hold 32 hex digits; e.g. GPU-5b3b5d0c-...")
    return os.path.join(ledger_dir, f"gpu-{digits}")


def read_ledger(path: str, boot_id: str | None = None) -> LedgerFigures | None:
    """The figures of the ledger at ``path``. None when no process of this boot has started it: there is
    no file, the file is still being made (empty, or its magic not yet written), or it was left by an
    earlier boot (``boot_id``, None: this machine's), which the next process starts afresh.

    ValueError, naming the path and what is wrong, for a file that is not such a ledger: a symbolic
    link or not a regular file, shorter than its header or than its own size says, another magic or
    version, more slots than the shim has. Other OSErrors are raised as they come."""
    shown = clip_repr(path)
    try:
        # O_NONBLOCK: a FIFO put in the ledger's place (the directory is writable by the slice's
        # containers) must not hang the reader; O_NOFOLLOW: nor may a link lead it elsewhere.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"ledger {shown} is a symbolic link, not the shim's ledger file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"ledger {shown} is not a regular file")
        data = os.pread(fd, MAX_LEDGER_BYTES, 0)
    finally:
        os.close(fd)
    if not data:
        return None  # created, not yet sized: the shim is making it
    if len(data) < _HEADER.size:
        raise ValueError(f"ledger {shown} is truncated: {len(data)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, size, nslots, refused, peak, _recovered, _limit, boot = _HEADER.unpack_from(data)
    if magic == 0:
        return None  # sized, not yet initialised: the magic is written last
    if magic != LEDGER_MAGIC:
        raise ValueError(f"ledger {shown} is not a gpuslice ledger (magic {magic:#018x})")
    if version != LEDGER_VERSION:
        raise ValueError(f"ledger {shown} has layout version {version}; this agent reads version {LEDGER_VERSION}")
    if not 1 <= nslots <= MAX_SLOTS:
        raise ValueError(f"ledger {shown} says it has {nslots} slots; the shim has 1 to {MAX_SLOTS}")
    slots_at = size - nslots * SLOT_BYTES
    if size > MAX_LEDGER_BYTES or slots_at % _LINE or slots_at - _LINE < _HEADER.size:
        raise ValueError(f"ledger {shown} says it is {size} bytes with {nslots} slots, which no ledger is")
    if len(data) < size:
        raise ValueError(f"ledger {shown} is truncated: {len(data)} bytes of the {size} it says it has")
    expected_boot = host_boot_id() if boot_id is None else boot_id
    if boot.rstrip(b"\0").decode("ascii", "replace") != expected_boot:
        return None  # an earlier boot's: none of its processes runs
    used = _U64.unpack_from(data, slots_at - _LINE)[0]
    processes = sum(1 for (pid,) in _SLOT_PID.iter_unpack(memoryview(data)[slots_at:size]) if pid)
    # The peak is raised just after used grows, so a read in between sees used above it.
    return LedgerFigures(used=used, peak=max(peak, used), processes=processes, refusals=refused)
