"""Memory requests and fractions, parsed exactly as DESIGN's "Memory quantities" says.

A memory request follows Kubernetes quantity rules (``4G`` = 4*10^9 bytes, ``4Gi`` = 4*2^30 bytes,
``1e9`` = 10^9 bytes, a plain integer is bytes), and also accepts the spellings ``GB``, ``GiB``,
``MB``, ``MiB`` in any case as aliases of ``G``, ``Gi``, ``M``, ``Mi``. The result must be a whole
number of bytes between 1 and 2^63-1 (what Kubernetes stores in an int64), written with at most nine
decimal places after its unit (Kubernetes keeps quantities to 1n); anything else is refused
with one error type whose message names the value and shows a valid example.

The CRD's CEL rules mirror these rules (``crds/gpuslice.yaml``); a test runs both on one corpus.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MEMORY_EXAMPLE = "4Gi"
FRACTION_EXAMPLE = "0.5"
MAX_BYTES = 2**63 - 1
MIB = 2**20

# Kubernetes suffixes (k8s.io/apimachinery resource.Quantity). Case matters: "4g" is not a quantity.
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# Decimal SI suffixes as powers of ten.
_DECIMAL_POWERS = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Byte-style aliases, any case, normalised to the Kubernetes suffix before parsing.
_ALIASES = {"gib": "Gi", "mib": "Mi", "gb": "G", "mb": "M"}

_NUMBER = re.compile(r"^(?P<sign>[+-]?)(?P<digits>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<suffix>.*)$")
_EXPONENT = re.compile(r"^[eE](?P<exp>[+-]?[0-9]+)$")
# An exponent beyond this can only give a value far outside (0, MAX_BYTES]; refuse before computing it.
_MAX_EXPONENT = 40
# Kubernetes keeps quantities to 1n (it rounds finer input up), so the API server would see
# '1.9999999999' as 2; refuse more decimal places than that, after the unit's power of ten.
MAX_DECIMAL_PLACES = 9


class QuantityError(ValueError):
    """A memory request or fraction that cannot be used; the message names it and shows an example."""


def normalise_memory_alias(text: str) -> str:
    """Rewrite a trailing ``GB``/``GiB``/``MB``/``MiB`` (any case) to its Kubernetes suffix."""
    lowered = text.lower()
    for alias, suffix in _ALIASES.items():
        if lowered.endswith(alias) and len(text) > len(alias):
            return text[: -len(alias)] + suffix
    return text


def parse_memory(value: str | int) -> int:
    """Bytes asked for by a memory request such as ``4G``, ``17Gi``, ``4096MiB`` or ``1073741824``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise QuantityError(f"memory {value!r} is not a quantity; use a string such as {MEMORY_EXAMPLE!r}")
    if isinstance(value, int):
        return _check_bytes(repr(value), Fraction(value))
    text = value.strip()
    if text != value or not text:
        raise QuantityError(f"memory {value!r} is not a quantity; use e.g. {MEMORY_EXAMPLE!r}")
    match = _NUMBER.match(normalise_memory_alias(text))
    if match is None:
        raise QuantityError(f"memory {value!r} is not a quantity; use e.g. {MEMORY_EXAMPLE!r} or '4G'")
    digits = match["digits"]
    number = Fraction(digits if not digits.endswith(".") else digits[:-1])
    if match["sign"] == "-":
        number = -number
    multiplier, power = _multiplier(value, match["suffix"])
    places = len(digits.partition(".")[2])
    if places - power > MAX_DECIMAL_PLACES:
        raise QuantityError(
            f"memory {value!r} has more than nine decimal places after its unit (Kubernetes keeps "
            f"quantities to 1n, so it cannot be checked to be a whole number of bytes); "
            f"use e.g. {MEMORY_EXAMPLE!r}"
        )
    return _check_bytes(repr(value), number * multiplier)


def _multiplier(value: str, suffix: str) -> tuple[Fraction, int]:
    """The suffix's factor, and its power of ten (0 for binary units) for the decimal-places rule."""
    if suffix in _BINARY:
        return Fraction(_BINARY[suffix]), 0
    if suffix in _DECIMAL_POWERS:
        power = _DECIMAL_POWERS[suffix]
    else:
        exponent = _EXPONENT.match(suffix)
        if exponent is None:
            raise QuantityError(
                f"memory {value!r} has an unknown unit {suffix!r}; use one of Ki, Mi, Gi, Ti, k, M, G, T "
                f"(or GB, GiB, MB, MiB), e.g. {MEMORY_EXAMPLE!r}"
            )
        power = int(exponent["exp"])
        if abs(power) > _MAX_EXPONENT:
            raise QuantityError(f"memory {value!r} is out of range; use e.g. {MEMORY_EXAMPLE!r}")
    return Fraction(10) ** power, power


def _check_bytes(shown: str, amount: Fraction) -> int:
    if amount <= 0:
        raise QuantityError(f"memory {shown} must be greater than zero; use e.g. {MEMORY_EXAMPLE!r}")
    if amount.denominator != 1:
        raise QuantityError(f"memory {shown} is not a whole number of bytes; use e.g. {MEMORY_EXAMPLE!r}")
    if amount > MAX_BYTES:
        raise QuantityError(f"memory {shown} is larger than 2^63-1 bytes; use e.g. {MEMORY_EXAMPLE!r}")
    return int(amount)


def parse_fraction(value: str | float | int) -> float:
    """A share of one GPU in (0, 1], from an annotation string (``"0.5"``) or a number."""
    if isinstance(value, bool):
        raise QuantityError(f"fraction {value!r} is not a number; use e.g. {FRACTION_EXAMPLE!r}")
    if isinstance(value, str):
        try:
            number = float(value.strip()) if value.strip() == value and value else math.nan
        except ValueError:
            number = math.nan
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        number = math.nan
    if math.isnan(number):
        raise QuantityError(f"fraction {value!r} is not a number; use e.g. {FRACTION_EXAMPLE!r}")
    if not 0.0 < number <= 1.0:
        raise QuantityError(f"fraction {value!r} must be in (0, 1]; use e.g. {FRACTION_EXAMPLE!r}")
    return number


def mib_ceil(num_bytes: int) -> int:
    """Whole MiB needed to hold ``num_bytes`` (a profile holds ``memorySizeMB`` MiB)."""
    return -(-num_bytes // MIB)


def format_bytes(num_bytes: int) -> str:
    """Short exact form: ``17Gi``, ``17G``, ``16213Mi``, ``512``; binary units first, then decimal."""
    units = (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("T", 10**12), ("G", 10**9), ("M", 10**6),
             ("Ki", 2**10), ("k", 10**3))
    for suffix, unit in units:
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)
