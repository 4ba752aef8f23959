from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_operator.core.quantities import (
    MAX_BYTES,
    QuantityError,
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


@given(st.fractions(min_value=Fraction(1, 10**6), max_value=1))
def test_fractions_in_range_accepted(value: Fraction) -> None:
    assert parse_fraction(str(float(value))) == pytest.approx(float(value))


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "nan", "inf", "", "half", 0, 2, True])
def test_fractions_out_of_range_refused(value: object) -> None:
    with pytest.raises(QuantityError) as info:
        parse_fraction(value)  # type: ignore[arg-type]
    assert "'0.5'" in str(info.value)


def test_mib_ceil() -> None:
    assert mib_ceil(17 * 10**9) == 16213
    assert mib_ceil(17 * 2**30) == 17408
    assert mib_ceil(2**20) == 1
    assert mib_ceil(2**20 + 1) == 2
