r"""Memory requests and fractions, parsed as Kubernetes quantities, plus the GB/GiB/MB/MiB aliases.

A memory request follows Kubernetes quantity rules (``4G`` = 4*10^9 bytes, ``4Gi`` = 4*2^30 bytes,
``1e9`` = 10^9 bytes, a plain integer is bytes), and also accepts the spellings ``GB``, ``GiB``,
``MB``, ``MiB`` in any case as aliases of ``G``, ``Gi``, ``M``, ``Mi``. The result must be a whole
number of bytes between 1 and 2^63-1 (what Kubernetes stores in an int64), written with at most nine
decimal places after its unit (Kubernetes keeps quantities to 1n); anything else is refused
with one error type whose message names the value and shows a valid example.

A fraction given as text (a pod annotation, a trace) follows one ASCII grammar, decimal only:
``[0-9]+(\.[0-9]*)?`` or ``\.[0-9]+`` (``0.5``, ``.25``, ``1``, ``1.0``), at most 32 characters, and
its value must be in (0, 1]. Signs, exponents (``1e-1``), underscores (``0.2_5``), white space, non-ASCII
digits, ``inf`` and ``nan`` are refused, though Python's ``float()`` takes them. A fraction given as a
number (the CRD's ``spec.fraction``, a JSON trace) is only range-checked.

A whole number given as text (a count, a group size, a port) is ASCII digits ``0-9`` only, at most
``MAX_INTEGER_DIGITS`` of them (``read_integer``, ``parse_integer``): Python's ``int()`` also takes
``'٣'``, ``'１'``, ``' 1'``, ``'1_0'`` and ``'+1'``, and ``str.isdigit()`` takes ``'²'``, which ``int()``
then refuses.

Every message quotes at most about 100 characters of the value (``clip_repr``).

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
_EXPONENT = re.compile(r"^[eE](?P<sign>[+-]?)(?P<exp>[0-9]+)$")
# An exponent beyond this can only give a value far outside (0, MAX_BYTES]; refuse before computing it.
_MAX_EXPONENT = 40
# Kubernetes keeps quantities to 1n (it rounds finer input up), so the API server would see
# '1.9999999999' as 2; refuse more decimal places than that, after the unit's power of ten.
MAX_DECIMAL_PLACES = 9


# A whole part longer than this (leading zeros aside) is far above MAX_BYTES whatever the unit, and
# Python refuses to turn more than 4300 digits into an int: judge it by its length alone.
_MAX_WHOLE_DIGITS = 1000
# How much of a refused value a message quotes.
QUOTE_LIMIT = 100

# The one grammar of a fraction written as text: ASCII decimal, no sign, exponent, '_' or space.
_FRACTION_TEXT = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
MAX_FRACTION_LENGTH = 32


# The one grammar of a whole number written as text; 18 digits stay below 2^63 (an int64).
MAX_INTEGER_DIGITS = 18
_INTEGER_TEXT = re.compile(r"[0-9]+", re.ASCII)


class QuantityError(ValueError):
    """A memory request or fraction that cannot be used; the message names it and shows an example."""


class IntegerError(QuantityError):
    """A whole number that is not ASCII digits, is too long or is out of range; the message names the
    value and shows a valid example."""


def clip_repr(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters with an ellipsis.

    Never raises: an int beyond Python's 4300-digit conversion limit, or a structure nested too deeply
    to print, is described instead of shown.
    """
    try:
        text = repr(value)
    except ValueError:
        # int.__repr__ refuses more than 4300 digits; log10(2) ~ 0.30103 digits per bit.
        bits = value.bit_length() if isinstance(value, int) else 0
        return f"<an integer of about {int(bits * 0.30103) + 1} digits>" if bits else f"<a {type(value).__name__}>"
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply to show>"
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        size = f"{len(value)} characters"
    elif isinstance(value, int):
        size = f"{len(text.lstrip('-'))} digits"
    else:
        size = f"{len(text)} characters in all"
    return f"{text[:limit]}... ({size})"


def clip_text(value: object, limit: int = QUOTE_LIMIT) -> str:
    """A name for a message without quotes (a field or annotation key), cut like ``clip_repr``."""
    if not isinstance(value, str):
        return clip_repr(value, limit)
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


def normalise_memory_alias(text: str) -> str:
    """Rewrite a trailing ``GB``/``GiB``/``MB``/``MiB`` (any case) to its Kubernetes suffix."""
    lowered = text.lower()
    for alias, suffix in _ALIASES.items():
        if lowered.endswith(alias) and len(text) > len(alias):
            return text[: -len(alias)] + suffix
    return text


def parse_memory(value: str | int) -> int:
    """Bytes asked for by a memory request such as ``4G``, ``17Gi``, ``4096MiB`` or ``1073741824``."""
    shown = clip_repr(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise QuantityError(f"memory {shown} is not a quantity; use a string such as {MEMORY_EXAMPLE!r}")
    if isinstance(value, int):
        return _check_bytes(shown, Fraction(value))
    text = value.strip()
    if text != value or not text:
        raise QuantityError(f"memory {shown} is not a quantity; use e.g. {MEMORY_EXAMPLE!r}")
    match = _NUMBER.match(normalise_memory_alias(text))
    if match is None:
        raise QuantityError(f"memory {shown} is not a quantity; use e.g. {MEMORY_EXAMPLE!r} or '4G'")
    whole, _, decimals = match["digits"].partition(".")
    multiplier, power = _multiplier(shown, match["suffix"])
    # Checked before any arithmetic, so thousands of decimal digits cost nothing.
    if len(decimals) - power > MAX_DECIMAL_PLACES:
        raise QuantityError(
            f"memory {shown} has more than nine decimal places after its unit (Kubernetes keeps "
            f"quantities to 1n, so it cannot be checked to be a whole number of bytes); "
            f"use e.g. {MEMORY_EXAMPLE!r}"
        )
    whole = whole.lstrip("0")
    negative = match["sign"] == "-"
    if len(whole) > _MAX_WHOLE_DIGITS:
        if negative:
            raise QuantityError(f"memory {shown} must be greater than zero; use e.g. {MEMORY_EXAMPLE!r}")
        raise QuantityError(f"memory {shown} is larger than 2^63-1 bytes; use e.g. {MEMORY_EXAMPLE!r}")
    number = Fraction(int(whole or "0")) + Fraction(int(decimals or "0"), 10 ** len(decimals))
    if negative:
        number = -number
    return _check_bytes(shown, number * multiplier)


def _multiplier(shown: str, suffix: str) -> tuple[Fraction, int]:
    """The suffix's factor, and its power of ten (0 for binary units) for the decimal-places rule."""
    if suffix in _BINARY:
        return Fraction(_BINARY[suffix]), 0
    if suffix in _DECIMAL_POWERS:
        power = _DECIMAL_POWERS[suffix]
    else:
        exponent = _EXPONENT.match(suffix)
        if exponent is None:
            raise QuantityError(
                f"memory {shown} has an unknown unit {clip_repr(suffix)}; use one of Ki, Mi, Gi, Ti, k, M, G, T "
                f"(or GB, GiB, MB, MiB), e.g. {MEMORY_EXAMPLE!r}"
            )
        sign, digits = exponent["sign"], exponent["exp"].lstrip("0")
        # Compared as text first: int() refuses more than 4300 digits.
        if len(digits) > 3 or int(digits or "0") > _MAX_EXPONENT:
            raise QuantityError(f"memory {shown} is out of range; use e.g. {MEMORY_EXAMPLE!r}")
        power = -int(digits or "0") if sign == "-" else int(digits or "0")
    return Fraction(10) ** power, power


def _check_bytes(shown: str, amount: Fraction) -> int:
    if amount <= 0:
        raise QuantityError(f"memory {shown} must be greater than zero; use e.g. {MEMORY_EXAMPLE!r}")
    if amount.denominator != 1:
        raise QuantityError(f"memory {shown} is not a whole number of bytes; use e.g. {MEMORY_EXAMPLE!r}")
    if amount > MAX_BYTES:
        raise QuantityError(f"memory {shown} is larger than 2^63-1 bytes; use e.g. {MEMORY_EXAMPLE!r}")
    return int(amount)


def show_fraction(value: object) -> str:
    """A fraction for a message: text quoted as written, a number in plain decimal (``0.00002``, not
    ``2e-05``), to nine places, as the CRD's message writes it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return clip_repr(value)
    if isinstance(value, int) or abs(value) >= 1e15:
        return clip_repr(value)
    return f"{value:.9f}".rstrip("0").rstrip(".")


def parse_fraction(value: str | float | int, what: str = "fraction", example: str = FRACTION_EXAMPLE) -> float:
    """A share of one GPU in (0, 1], from an annotation string (``"0.5"``) or a number; ``what`` names
    it in messages (``fraction``, or ``compute`` for a compute share) and ``example`` is the valid one shown.

    Text must match the module's fraction grammar; its value is compared exactly, so
    ``1.0000000000000000001`` is refused although it rounds to the float 1.0.
    """
    shown = show_fraction(value)
    not_a_number = (
        f"{what} {shown} is not a number; write a decimal such as {example!r} "
        f"(ASCII digits and at most one point)"
    )
    if isinstance(value, bool):
        raise QuantityError(not_a_number)
    if isinstance(value, str):
        if len(value) > MAX_FRACTION_LENGTH:
            raise QuantityError(
                f"{what} {shown} is too long: may not be more than {MAX_FRACTION_LENGTH} characters; "
                f"use e.g. {example!r}"
            )
        if _FRACTION_TEXT.fullmatch(value) is None:
            if value[:1] in "+-" and _FRACTION_TEXT.fullmatch(value[1:]) is not None:
                # A signed decimal is a number, just not one this grammar writes: say what is wrong.
                if value[0] == "-":
                    raise QuantityError(f"{what} {shown} must be in (0, 1]; use e.g. {example!r}")
                raise QuantityError(f"{what} {shown} must be written without a sign; use e.g. {example!r}")
            raise QuantityError(not_a_number)
        exact = Fraction(value if not value.endswith(".") else value[:-1])
    elif isinstance(value, int):
        exact = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(not_a_number)
        exact = Fraction(value)
    else:
        raise QuantityError(not_a_number)
    if not 0 < exact <= 1:
        raise QuantityError(f"{what} {shown} must be in (0, 1]; use e.g. {example!r}")
    # Positive as a float too: 32 characters cannot write a number below the smallest float.
    return float(exact)


def read_integer(value: object, low: int = 0, high: int | None = None,
                 max_digits: int = MAX_INTEGER_DIGITS) -> int | None:
    """The whole number ``value`` writes, None unless it is text of 1 to ``max_digits`` ASCII digits
    ``0-9`` (or an int, not a bool) from ``low`` to ``high``. For a caller that words its own error."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and len(value) <= max_digits and _INTEGER_TEXT.fullmatch(value) is not None:
        number = int(value)
    else:
        return None
    return number if low <= number and (high is None or number <= high) else None


def parse_integer(value: object, what: str, example: str, low: int = 0, high: int | None = None,
                  max_digits: int = MAX_INTEGER_DIGITS) -> int:
    """``read_integer``, raising IntegerError instead of giving None; ``what`` names the value
    (``annotation cdmo.io/gpu-count``) and ``example`` is a valid one (``'2'``)."""
    number = read_integer(value, low, high, max_digits)
    if number is not None:
        return number
    bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
    raise IntegerError(f"{what} {clip_repr(value)} is not a whole number {bounds} written in ASCII digits 0-9; "
                       f"use e.g. {example}")


# A resource quantity longer than this is not one the API server wrote (it bounds int() on the digits).
MAX_QUANTITY_LENGTH = 64
QUANTITY_EXAMPLE = "'500m', '2' or '4Gi'"


def parse_quantity(value: object, what: str = "quantity") -> Fraction:
    """A Kubernetes resource quantity as a pod's requests or a node's allocatable write it (``500m``,
    ``2``, ``1.5Gi``, ``1e3``), exactly and at least zero; ASCII only, at most MAX_QUANTITY_LENGTH
    characters, none of the GB/GiB aliases a memory request takes. ``what`` names it in messages."""
    shown = clip_repr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise QuantityError(f"{what} {shown} is negative; use e.g. {QUANTITY_EXAMPLE}")
        return Fraction(value)
    if not isinstance(value, str) or len(value) > MAX_QUANTITY_LENGTH:
        raise QuantityError(f"{what} {shown} is not a quantity; use e.g. {QUANTITY_EXAMPLE}")
    match = _NUMBER.fullmatch(value)
    if match is None or match["sign"] == "-":
        raise QuantityError(f"{what} {shown} is not a quantity of at least zero; use e.g. {QUANTITY_EXAMPLE}")
    try:
        multiplier, _power = _multiplier(shown, match["suffix"])
    except QuantityError:
        raise QuantityError(f"{what} {shown} has an unknown unit; use e.g. {QUANTITY_EXAMPLE}") from None
    whole, _, decimals = match["digits"].partition(".")
    return (Fraction(int(whole or "0")) + Fraction(int(decimals or "0"), 10 ** len(decimals))) * multiplier


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


def short_bytes(num_bytes: int) -> str:
    """Rounded form for a column: ``3.0Gi``, ``512.0Mi``, ``1.2Ti``; the largest binary unit it reaches, one
    decimal; plain bytes below 1Ki."""
    for suffix, unit in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if num_bytes >= unit:
            return f"{num_bytes / unit:.1f}{suffix}"
    return str(num_bytes)
