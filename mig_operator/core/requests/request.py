"""What a slice asks for: memory, a fraction of a GPU, or a MIG profile by name (exactly one)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..placement.compute import COMPUTE_EXAMPLE, format_compute, parse_compute
from .quantities import QuantityError, clip_repr, format_bytes, parse_fraction, parse_memory

PROFILE_EXAMPLE = "2g.35gb"
# The least a slice holds. Its limit counts the whole process footprint, and the CUDA context alone
# takes about 0.5 GiB (518 MiB with PyTorch on an H100), so a smaller slice could not allocate at all.
MIN_SLICE_BYTES = 2**30
# The least share a fraction may ask for (both floors are checked at admission: core/requests/slice_spec.py).
# On a GPU where a share comes to less than MIN_SLICE_BYTES (0.01 of an 80 GiB H100 is 819 MiB) the
# planner does not place it.
MIN_FRACTION = 0.01
# Asking compute of a MIG slice (the CRD's rule on spec says the same).
MIG_COMPUTE_REFUSAL = (
    "compute cannot be asked of a MIG slice: its compute is its profile's (spec.migProfile); leave compute "
    f"out, or ask by memory or fraction, e.g. fraction: 0.5 with compute: {COMPUTE_EXAMPLE}"
)
# `<compute slices>g.<memory GB>gb`, optionally with NVML's engine suffixes (+me, -me, +gfx, +me.all).
PROFILE_NAME = re.compile(r"^[1-8]g\.[1-9][0-9]{0,3}gb(\+me|-me|\+gfx|\+me\.all)?$")


class RequestError(QuantityError):
    """A slice request that is malformed as a whole (none or several of memory/fraction/migProfile)."""


@dataclass(frozen=True)
class SliceRequest:
    """One slice's request; exactly one of the three fields is set, and ``compute`` (a fraction's
    compute share, core.placement.compute) only beside memory or fraction."""

    memory_bytes: int | None = None
    fraction: float | None = None
    profile: str | None = None
    compute: float | None = None

    def describe(self) -> str:
        share = "" if self.compute is None else f", compute {format_compute(self.compute)}"
        if self.memory_bytes is not None:
            return f"memory {format_bytes(self.memory_bytes)}{share}"
        if self.fraction is not None:
            return f"fraction {self.fraction:g}{share}"
        return f"profile {self.profile}"


def parse_profile_name(value: object) -> str:
    """A MIG profile name such as ``2g.35gb`` or ``1g.18gb+me``."""
    if not isinstance(value, str) or PROFILE_NAME.fullmatch(value) is None:
        raise RequestError(
            f"migProfile {clip_repr(value)} is not a MIG profile name; use e.g. {PROFILE_EXAMPLE!r}"
        )
    return value


def slice_request(
    memory: str | int | None = None, fraction: str | float | None = None, profile: str | None = None,
    compute: str | float | None = None,
) -> SliceRequest:
    """Validate the three request fields together and parse the one that is set, and ``compute``
    beside memory or fraction."""
    given = [name for name, v in (("memory", memory), ("fraction", fraction), ("migProfile", profile)) if v is not None]
    if len(given) != 1:
        shown = ", ".join(given) if given else "none"
        raise RequestError(
            f"a slice needs exactly one of memory, fraction, migProfile (got {shown}); "
            f"e.g. memory: '4Gi' or fraction: 0.5 or migProfile: '{PROFILE_EXAMPLE}'"
        )
    if compute is not None and profile is not None:
        raise RequestError(MIG_COMPUTE_REFUSAL)
    share = None if compute is None else parse_compute(compute)
    if memory is not None:
        return SliceRequest(memory_bytes=parse_memory(memory), compute=share)
    if fraction is not None:
        return SliceRequest(fraction=parse_fraction(fraction), compute=share)
    return SliceRequest(profile=parse_profile_name(profile))
