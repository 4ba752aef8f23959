"""--default-compute: checked before start (one line, exit 2, naming the value and a valid one), and
what it says reaches the controller's planner."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, controller_options, part


@pytest.mark.parametrize("value", ["proportionl", "Shared", "mps", ""])
def test_a_bad_default_compute_exits_2_naming_the_value_and_a_valid_one(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--default-compute", value)
    assert_one_line_error(proc, 2, "--default-compute")
    assert repr(value) in proc.stderr and "e.g. --default-compute shared" in proc.stderr


@pytest.mark.parametrize(("value", "expected"), [(None, "shared"), ("shared", "shared"),
                                                 ("proportional", "proportional")])
def test_the_default_compute_reaches_the_controller(monkeypatch, tmp_path, capsys, value: str | None,
                                                   expected: str) -> None:
    code, err, options = controller_options(monkeypatch, tmp_path, capsys,
                                            *(["--default-compute", value] if value else []))
    assert code is None and options.default_compute == expected, err
