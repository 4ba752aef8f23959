"""--default-compute: checked before start (one line, exit 2, naming the value and a valid one), and
what it says reaches the controller's planner."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, part, unreachable_kubeconfig

from mig_operator.cli import main


@pytest.mark.parametrize("value", ["proportionl", "Shared", "mps", ""])
def test_a_bad_default_compute_exits_2_naming_the_value_and_a_valid_one(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--default-compute", value)
    assert_one_line_error(proc, 2, "--default-compute")
    assert repr(value) in proc.stderr and "e.g. --default-compute shared" in proc.stderr


@pytest.mark.parametrize(("value", "expected"), [(None, "shared"), ("shared", "shared"),
                                                 ("proportional", "proportional")])
def test_the_default_compute_reaches_the_controller(monkeypatch, tmp_path, value: str | None, expected: str) -> None:
    import mig_operator.kube.controller.main as controller_main

    seen = []

    class Built(Exception):
        pass

    def build_registry(options, *_):
        seen.append(options)
        raise Built

    monkeypatch.setattr(controller_main, "build_registry", build_registry)
    argv = ["controller", "--kubeconfig", str(unreachable_kubeconfig(tmp_path))]
    with pytest.raises(Built):
        main(argv + (["--default-compute", value] if value else []))
    assert [o.default_compute for o in seen] == [expected]
