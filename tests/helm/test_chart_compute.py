"""The chart value fractions.defaultCompute reaches the controller as --default-compute, and a value
the controller would refuse stops the render, naming it."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from helm_chart import CHART_DIR, container

from mig_operator.cli import build_parser


def _default_compute(docs: list[dict[str, Any]]) -> str:
    args = container(docs, "Deployment", "controller")["args"]
    return build_parser().parse_args(args).default_compute


def test_the_default_is_shared_and_documented(render: Any) -> None:
    assert yaml.safe_load((CHART_DIR / "values.yaml").read_text())["fractions"]["defaultCompute"] == "shared"
    assert _default_compute(render()) == "shared"
    assert "--default-compute=shared" in container(render(), "Deployment", "controller")["args"]


def test_proportional_reaches_the_controller(render: Any) -> None:
    assert _default_compute(render("--set", "fractions.defaultCompute=proportional")) == "proportional"


@pytest.mark.parametrize("value", ["Proportional", "mps", ""])
def test_any_other_value_stops_the_render_naming_it(helm: Any, value: str) -> None:
    with pytest.raises(AssertionError, match=f'fractions.defaultCompute "{value}" is not shared or proportional'):
        helm("template", "gs", str(CHART_DIR), "--set", f"fractions.defaultCompute={value}")
