"""core.quantities: edges mutation testing found untested (docs/testing.md)."""

from __future__ import annotations

import pytest

from mig_operator.core.quantities import QuantityError, clip_text, parse_fraction


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
