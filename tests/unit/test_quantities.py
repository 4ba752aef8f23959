
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_operator.core.requests.quantities import (
    MAX_BYTES,
    QuantityError,
    clip_repr,
    format_bytes,
    mib_ceil,
    parse_fraction,
    parse_memory,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4G", 4 * 10**9),
        ("4Gi", 4 * 2**30),
        ("4096Mi", 4 * 2**30),
        ("4096MiB", 4 * 2**30),
        ("4096mib", 4 * 2**30),
        ("4GB", 4 * 10**9),
        ("4gb", 4 * 10**9),
        ("4GiB", 4 * 2**30),
        ("4gib", 4 * 2**30),
        ("500MB", 500 * 10**6),
        ("2T", 2 * 10**12),
        ("1Ti", 2**40),
        ("1073741824", 2**30),
        ("1e9", 10**9),
        ("0.5Gi", 2**29),
        ("+4G", 4 * 10**9),
        ("17G", 17 * 10**9),
        ("17Gi", 17 * 2**30),
    ],
)
def test_accepted_quantities(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


def test_integer_is_bytes() -> None:
    assert parse_memory(4096) == 4096


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("4X", "unknown unit 'X'"),
        ("-1G", "greater than zero"),
        ("0", "greater than zero"),
        ("0Gi", "greater than zero"),
        ("1e400", "out of range"),
        ("", "not a quantity"),
        ("4g", "unknown unit 'g'"),
        ("4m", "whole number of bytes"),
        ("1.5", "whole number of bytes"),
        (" 4G", "not a quantity"),
        ("GiB", "not a quantity"),
        ("9Ei", "larger than 2^63-1"),
        ("four", "not a quantity"),
    ],
)
def test_refused_quantities_name_the_value_and_show_an_example(text: str, fragment: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_memory(text)
    message = str(info.value)
    assert fragment in message
    assert repr(text) in message
    assert "'4Gi'" in message


@pytest.mark.parametrize("value", [True, None, 1.5, [4]])
def test_non_string_memory_refused(value: object) -> None:
    with pytest.raises(QuantityError):
        parse_memory(value)  # type: ignore[arg-type]


@given(st.integers(min_value=1, max_value=2**40), st.sampled_from(["", "k", "M", "G", "Ki", "Mi", "Gi"]))
def test_parse_matches_the_unit_table(number: int, suffix: str) -> None:
    scale = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[suffix]
    if number * scale > MAX_BYTES:
        with pytest.raises(QuantityError):
            parse_memory(f"{number}{suffix}")
    else:
        assert parse_memory(f"{number}{suffix}") == number * scale


@given(st.integers(min_value=1, max_value=2**32), st.sampled_from(["MB", "mb", "Mb", "GB", "gB", "MiB", "GIB"]))
def test_aliases_equal_their_kubernetes_suffix(number: int, alias: str) -> None:
    canonical = {"mb": "M", "gb": "G", "mib": "Mi", "gib": "Gi"}[alias.lower()]
    assert parse_memory(f"{number}{alias}") == parse_memory(f"{number}{canonical}")


@given(st.integers(min_value=1, max_value=MAX_BYTES))
def test_format_bytes_round_trips(num: int) -> None:
    assert parse_memory(format_bytes(num)) == num


@given(st.text(max_size=12))
def test_any_text_is_parsed_or_refused_cleanly(text: str) -> None:
    try:
        value = parse_memory(text)
    except QuantityError as exc:
        assert repr(text) in str(exc)
    else:
        assert 1 <= value <= MAX_BYTES


@given(st.integers(min_value=1, max_value=10**6), st.integers(min_value=0, max_value=3))
def test_decimal_fractions_in_range_accepted(millionths: int, extra_zeros: int) -> None:
    # Written out by hand as a decimal (not by float's str, which may choose '1e-06').
    whole, part = divmod(millionths, 10**6)
    text = f"{whole}.{part:06d}" + "0" * extra_zeros
    assert parse_fraction(text) == millionths / 10**6


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.5", 0.5), (".5", 0.5), ("1", 1.0), ("1.", 1.0), ("1.000", 1.0), ("0.25", 0.25), ("00.5", 0.5),
     ("0.000001", 1e-6)],
)
def test_fraction_grammar_accepts_plain_decimals(text: str, expected: float) -> None:
    assert parse_fraction(text) == expected


@pytest.mark.parametrize(
    "text",
    ["0.2_5", "\uff10.\uff15", "0.\u0665", "inf", "Infinity", "nan", "NaN", " 0.5", "0.5 ", "0.5\n", "\t0.5",
     "1e-1", "5E-1", "0x1p-1", "-", "+", "-x", "+-0.5", "--1", ".", "", "0,5", "1/2", "50%", "half", "0.5.1"],
)
def test_fraction_grammar_refuses_what_float_would_take(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_fraction(text)
    assert "is not a number" in str(info.value) and "'0.5'" in str(info.value)


@pytest.mark.parametrize("value", ["0", "0.0", "-0.5", "1.01", "2", "1.0000000000000000001", 0, 2, -0.5, 1.5])
def test_fractions_out_of_range_refused(value: object) -> None:
    with pytest.raises(QuantityError) as info:
        parse_fraction(value)  # type: ignore[arg-type]
    message = str(info.value)
    # Every one is a number outside (0, 1], '-0.5' included: it is named as such, not "not a number".
    assert f"fraction {value!r} must be in (0, 1]" in message
    assert "'0.5'" in message


@pytest.mark.parametrize("text", ["-1", "-0", "-.5", "-1.", "-0.0"])
def test_a_negative_fraction_is_out_of_range_not_a_non_number(text: str) -> None:
    with pytest.raises(QuantityError, match=rf"^fraction '{re.escape(text)}' must be in \(0, 1\]; use e\.g\. '0\.5'$"):
        parse_fraction(text)


@pytest.mark.parametrize("text", ["+0.5", "+1", "+.25"])
def test_a_plus_sign_is_named(text: str) -> None:
    expected = rf"^fraction '{re.escape(text)}' must be written without a sign; use e\.g\. '0\.5'$"
    with pytest.raises(QuantityError, match=expected):
        parse_fraction(text)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, None, [0.5]])
def test_non_numbers_refused_as_fractions(value: object) -> None:
    with pytest.raises(QuantityError, match="is not a number"):
        parse_fraction(value)  # type: ignore[arg-type]


def test_fraction_text_too_long() -> None:
    with pytest.raises(QuantityError, match="too long: may not be more than 32 characters"):
        parse_fraction("0." + "5" * 31)
    assert parse_fraction("0." + "0" * 29 + "1") == 1e-30  # 32 characters: the longest allowed
    # 1e-400 as a JSON number arrives as 0.0: out of range.
    with pytest.raises(QuantityError, match="must be in"):
        parse_fraction(float("1e-400"))


def test_long_values_are_quoted_short() -> None:
    for value in ("7" * 5000, "0." + "0" * 5000 + "1", "1e" + "9" * 5000, "9" * 5000 + "Qi", 10**4000):
        with pytest.raises(QuantityError) as info:
            parse_memory(value)  # type: ignore[arg-type]
        message = str(info.value)
        assert len(message) < 400 and "'4Gi'" in message, message


@pytest.mark.parametrize(
    ("text", "outcome"),
    [
        ("1" * 5000, "larger than 2^63-1 bytes"),
        ("-" + "1" * 5000, "greater than zero"),
        ("0" * 5000 + "4Gi", 4 * 2**30),
        ("4." + "0" * 5000, "more than nine decimal places"),
        ("1e" + "0" * 5000 + "9", 10**9),
        ("1e" + "9" * 5000, "out of range"),
        ("1e-" + "9" * 5000, "out of range"),
    ],
)
def test_thousands_of_digits_are_judged_without_a_crash(text: str, outcome: int | str) -> None:
    # Python refuses int() of more than 4300 digits; the parser must not get there.
    if isinstance(outcome, int):
        assert parse_memory(text) == outcome
    else:
        with pytest.raises(QuantityError) as info:
            parse_memory(text)
        assert outcome in str(info.value)


def test_clip_repr() -> None:
    assert clip_repr("abc") == "'abc'"
    long = clip_repr("x" * 1000)
    assert long.startswith("'" + "x" * 99) and long.endswith("... (1000 characters)") and len(long) < 130
    assert clip_repr(10**200).endswith("... (201 digits)")
    assert clip_repr(10**5000) == "<an integer of about 5001 digits>"
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert clip_repr(nested) == "<a list nested too deeply to show>"


def test_mib_ceil() -> None:
    assert mib_ceil(17 * 10**9) == 16213
    assert mib_ceil(17 * 2**30) == 17408
    assert mib_ceil(2**20) == 1
    assert mib_ceil(2**20 + 1) == 2
