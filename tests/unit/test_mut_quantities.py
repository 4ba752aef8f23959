"""core.requests.quantities and core.requests.request: edges mutation testing found untested (docs/testing.md)."""

from __future__ import annotations

import pytest

from mig_operator.core.requests.quantities import (
    QuantityError,
    clip_repr,
    clip_text,
    format_bytes,
    parse_fraction,
    parse_memory,
)
from mig_operator.core.requests.request import RequestError, slice_request


def test_clip_text_keeps_text_up_to_the_limit_and_quotes_other_values() -> None:
    assert clip_text("a" * 100) == "a" * 100
    assert clip_text("a" * 101) == "a" * 100 + "... (101 characters)"
    assert clip_text("abcdef", limit=3) == "abc... (6 characters)"
    assert clip_text(12345) == "12345"  # not a string: its repr, clipped the same way
    assert clip_text(list(range(10)), limit=5) == "[0, 1... (30 characters in all)"


@pytest.mark.parametrize(("text", "value"), [("1.", 1.0), (".5", 0.5), ("0.50", 0.5)])
def test_fraction_text_with_a_trailing_point(text: str, value: float) -> None:
    assert parse_fraction(text) == value


@pytest.mark.parametrize("text", ["10.", "2.", "0."])
def test_fraction_text_out_of_range_with_a_trailing_point(text: str) -> None:
    with pytest.raises(QuantityError, match=r"must be in \(0, 1\]"):
        parse_fraction(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("1024e0", 1024), ("1024e-0", 1024), ("1024E+00", 1024), ("5e3", 5000), ("25e-1", None),
])
def test_exponents_of_zero_and_their_signs(text: str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(QuantityError, match="is not a whole number of bytes"):
            parse_memory(text)
    else:
        assert parse_memory(text) == expected


def test_the_largest_exponent_is_judged_by_the_value_it_gives() -> None:
    # 40 is the largest exponent computed: 1e40 is refused for its size, 1e41 before any arithmetic.
    with pytest.raises(QuantityError) as info:
        parse_memory("1e40")
    assert str(info.value) == "memory '1e40' is larger than 2^63-1 bytes; use e.g. '4Gi'"
    with pytest.raises(QuantityError) as info:
        parse_memory("1e-40")
    assert "more than nine decimal places" in str(info.value)
    with pytest.raises(QuantityError) as info:
        parse_memory("1e41")
    assert str(info.value) == "memory '1e41' is out of range; use e.g. '4Gi'"


@pytest.mark.parametrize(("value", "message"), [
    (4.0, "memory 4.0 is not a quantity; use a string such as '4Gi'"),
    (0, "memory 0 must be greater than zero; use e.g. '4Gi'"),
    (2**63, "memory 9223372036854775808 is larger than 2^63-1 bytes; use e.g. '4Gi'"),
])
def test_memory_given_as_a_number(value, message: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_memory(value)
    assert str(info.value) == message


class _Unprintable:
    def __repr__(self) -> str:
        raise ValueError("no")


def test_clip_repr_edges() -> None:
    assert clip_repr("a" * 98) == "'" + "a" * 98 + "'"  # exactly 100 characters: whole
    assert clip_repr("a" * 99) == "'" + "a" * 99 + "... (99 characters)"
    assert clip_repr(_Unprintable()) == "<a _Unprintable>"
    assert clip_repr(list(range(100))).endswith("... (390 characters in all)")


@pytest.mark.parametrize(("num_bytes", "text"), [
    (2**40, "1Ti"), (3 * 2**40, "3Ti"), (5 * 2**30, "5Gi"), (2**20, "1Mi"), (1536 * 2**20, "1536Mi"),
    (10**12, "1T"), (2 * 10**9, "2G"), (3 * 10**6, "3M"), (2**10, "1Ki"), (5 * 2**10, "5Ki"), (10**3, "1k"),
    (7 * 10**3, "7k"), (1023, "1023"), (0, "0"), (2**40 + 2**30, "1025Gi"),
])
def test_format_bytes_picks_the_largest_exact_unit(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(("kwargs", "got"), [
    ({}, "none"),
    ({"memory": "1Gi", "fraction": 0.5}, "memory, fraction"),
    ({"memory": "1Gi", "fraction": 0.5, "profile": "1g.18gb"}, "memory, fraction, migProfile"),
    ({"fraction": 0.5, "profile": "1g.18gb"}, "fraction, migProfile"),
])
def test_a_request_names_the_fields_it_got(kwargs, got: str) -> None:
    with pytest.raises(RequestError) as info:
        slice_request(**kwargs)
    assert str(info.value) == (
        f"a slice needs exactly one of memory, fraction, migProfile (got {got}); "
        "e.g. memory: '4Gi' or fraction: 0.5 or migProfile: '2g.35gb'")
