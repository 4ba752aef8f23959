"""A fraction's compute share: its words, its exact arithmetic and how a status writes it.

A fraction GPU serves either ``shared`` fractions (time-sliced turns, no promise) or fractions with a
compute share, a number in (0, 1] that NVIDIA MPS turns into that share of the GPU's SMs. A binding
carries the resolved share as a float (``core.placement.cluster.Binding.compute``, None = shared); every sum
and comparison goes through ``exact``, the decimal the float was written as, so shares of 0.34,
0.56 and 0.1 fill a GPU exactly (added as floats they come to 1.0000000000000002).

A MIG slice's compute is its profile's: its compute slices over the GPU's (``3/7``), never a share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import cached_property, lru_cache

from ..requests.quantities import QuantityError, clip_repr, parse_fraction

COMPUTE_EXAMPLE = "0.25"
# What status.compute says of a fraction without a share, and the chart value that leaves it so.
SHARED = "shared"
# The chart value that gives a fraction without spec.compute its memory share of the GPU as compute.
PROPORTIONAL = "proportional"
DEFAULT_COMPUTE_CHOICES = (SHARED, PROPORTIONAL)
# A proportional share is rounded down to this many decimal places (0.01 % of the GPU): written in a
# status it reads back as the same float, and shares rounded down never sum above their memory.
PROPORTIONAL_PLACES = 4
WHOLE = Fraction(1)
# Two floats in (0, 1] this far apart compare as their decimals do (each is within 1e-16 of its own).
_FAR = 1e-12


class DefaultComputeError(QuantityError):
    """--default-compute names neither choice; the message names it and a valid one."""


def parse_compute(value: object) -> float:
    """A compute share in (0, 1] from spec.compute or the ``cdmo.io/gpu-compute`` annotation (text)."""
    return parse_fraction(value, what="compute", example=COMPUTE_EXAMPLE)  # type: ignore[arg-type]


def parse_default_compute(value: str) -> str:
    if value not in DEFAULT_COMPUTE_CHOICES:
        raise DefaultComputeError(
            f"--default-compute {clip_repr(value)} is not one of {', '.join(DEFAULT_COMPUTE_CHOICES)}; "
            f"use e.g. --default-compute {SHARED}"
        )
    return value


@lru_cache(maxsize=4096)
def exact(share: float) -> Fraction:
    """The share as the decimal it is written as (``repr``), compared and summed without drift (cached:
    the planner asks it of one share for every GPU it weighs)."""
    return Fraction(repr(float(share)))


def proportional(granted_bytes: int, gpu_bytes: int) -> float:
    """The compute share equal to a fraction's memory share of its GPU, rounded down to
    ``PROPORTIONAL_PLACES`` places and at least one such step (Backend.AI's fGPU)."""
    step = 10**PROPORTIONAL_PLACES
    if gpu_bytes <= 0:
        return 1.0
    units = min(step, max(1, granted_bytes * step // gpu_bytes))
    return float(Fraction(units, step))


def format_compute(share: float | None) -> str:
    """status.compute of a fraction: ``shared``, or the share as the shortest decimal that reads
    back as the same float (``0.25``, ``1``)."""
    if share is None:
        return SHARED
    text = repr(float(share))
    return text[:-2] if text.endswith(".0") else text


def compute_from_status(text: object) -> float | None:
    """The share a fraction's status.compute records; None for ``shared``, absent or unreadable."""
    if not isinstance(text, str) or text == SHARED:
        return None
    try:
        share = float(text)  # format_compute may write an exponent (``1e-05``)
    except ValueError:
        return None
    return share if 0 < share <= 1 else None


def resolve_compute(asked: float | None, need_bytes: int, gpu_bytes: int, default: str) -> float | None:
    """The share a fraction gets on a GPU: what it asked, else its memory share under the
    ``proportional`` default, else none (shared)."""
    if asked is not None:
        return asked
    return proportional(need_bytes, gpu_bytes) if default == PROPORTIONAL else None


def format_exact(value: Fraction) -> str:
    """A sum of shares in plain decimal (``0.75``, ``1``, ``0.0001``); every share is a decimal,
    so the sum is one too (a non-terminating value is cut at 30 places)."""
    with localcontext() as ctx:
        ctx.prec = 60
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    if "." in text:
        text = text[: text.index(".") + 31].rstrip("0").rstrip(".")
    return text


@dataclass(frozen=True)
class GpuCompute:
    """A fraction GPU's compute as bound now: the shares on it (summed exactly) and how many of its
    fractions have a share and how many are shared. A GPU serves shares (through MPS) or shared
    fractions, never both: a shared process would time-slice against the MPS server and break the
    promised shares."""

    granted: Fraction = Fraction(0)
    with_share: int = 0
    shared: int = 0

    @cached_property
    def left(self) -> Fraction:
        return max(Fraction(0), WHOLE - self.granted)

    @cached_property
    def left_approx(self) -> float:
        """``left`` as the nearest float: to order GPUs, and to settle ``has_room`` quickly when the
        share is far from it (a float is within 1e-16 of its decimal; 1e-12 apart is far)."""
        return float(self.left)

    def conflicts(self, share: float | None) -> bool:
        """Whether a fraction with ``share`` (None: shared) is of the other kind than the GPU's."""
        return bool(self.with_share) if share is None else bool(self.shared)

    def has_room(self, share: float | None) -> bool:
        if share is None or share < self.left_approx - _FAR:
            return True
        if share > self.left_approx + _FAR:
            return False
        return exact(share) <= self.left

    def takes(self, share: float | None) -> bool:
        return not self.conflicts(share) and self.has_room(share)

    def why_not(self, share: float | None) -> str:
        """Why a fraction with ``share`` may not join, in words naming what is left."""
        if share is not None and self.shared:
            return (f"serves {self.shared} shared fraction(s) (time-sliced, no compute share), and a compute "
                    f"share (MPS) cannot join them: a shared process would time-slice against the MPS server")
        if share is None and self.with_share:
            return (f"serves compute shares through MPS ({format_exact(self.granted)} of 1 given out), and a "
                    f"shared fraction cannot join them: it would time-slice against the MPS server")
        return f"has compute {format_exact(self.left)} of 1 left, not {format_compute(share)}"

    def plus(self, share: float | None) -> GpuCompute:
        if share is None:
            return GpuCompute(self.granted, self.with_share, self.shared + 1)
        return GpuCompute(self.granted + exact(share), self.with_share + 1, self.shared)

    def describe(self) -> str:
        """What a GpuNode and ``top`` show of it: the shares given out (``0.75``), ``shared``, or ``""``."""
        if self.with_share:
            return format_exact(self.granted)
        return SHARED if self.shared else ""


def gpu_compute(shares: Iterable[float | None]) -> GpuCompute:
    """The compute of a GPU holding fractions with these shares (None: shared)."""
    total = GpuCompute()
    for share in shares:
        total = total.plus(share)
    return total


def mig_compute(profile_slices: int, gpu_slices: int) -> str:
    """A MIG slice's status.compute: its profile's compute slices over the GPU's (``3/7``); on a
    GpuNode, those of the instances in use (``0/7``). ``""`` when the GPU's are not known."""
    return f"{profile_slices}/{gpu_slices}" if gpu_slices > 0 else ""
