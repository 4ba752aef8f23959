"""A fraction's compute share: its words, its exact arithmetic and how a status writes it.

A fraction GPU serves either ``shared`` fractions (time-sliced turns, no promise) or fractions with a
compute share, a number in (0, 1] that NVIDIA MPS turns into that share of the GPU's SMs. A binding
carries the resolved share as a float (``core.cluster.Binding.compute``, None = shared); every sum
and comparison goes through ``exact``, the decimal the float was written as, so three shares of
0.1, 0.2 and 0.7 fill a GPU exactly (as floats they add up to 1.0000000000000002).

A MIG slice's compute is its profile's: its compute slices over the GPU's (``3/7``), never a share.
"""

from __future__ import annotations

from fractions import Fraction

from .quantities import parse_fraction

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


class DefaultComputeError(ValueError):
    """--default-compute names neither choice; the message names it and a valid one."""


def parse_compute(value: object) -> float:
    """A compute share in (0, 1] from spec.compute or the ``cdmo.io/gpu-compute`` annotation (text)."""
    return parse_fraction(value, what="compute", example=COMPUTE_EXAMPLE)  # type: ignore[arg-type]


def parse_default_compute(value: str) -> str:
    if value not in DEFAULT_COMPUTE_CHOICES:
        raise DefaultComputeError(
            f"--default-compute {value!r} is not one of {', '.join(DEFAULT_COMPUTE_CHOICES)}; "
            f"use e.g. --default-compute {SHARED}"
        )
    return value


def exact(share: float) -> Fraction:
    """The share as the decimal it is written as (``repr``), compared and summed without drift."""
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


def mig_compute(profile_slices: int, gpu_slices: int) -> str:
    """A MIG slice's status.compute: its profile's compute slices over the GPU's (``3/7``)."""
    return f"{profile_slices}/{gpu_slices}" if profile_slices > 0 and gpu_slices > 0 else ""
