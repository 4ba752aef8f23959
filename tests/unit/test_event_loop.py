"""The operator's processes run on uvloop's event loop where it is installed, asyncio's where not."""

from __future__ import annotations

import asyncio
import sys

import pytest

from mig_operator.kube.common import operator


def _loop_of_run_operator(monkeypatch: pytest.MonkeyPatch) -> asyncio.AbstractEventLoop:
    seen: list[asyncio.AbstractEventLoop] = []

    async def fake_operator(**_kwargs: object) -> None:
        seen.append(asyncio.get_running_loop())

    monkeypatch.setattr(operator.kopf, "operator", fake_operator)
    operator.run_operator(operator.kopf.OperatorRegistry(), standalone=True)
    return seen[0]


def test_kopf_runs_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop  # a dependency (pyproject.toml)
    assert isinstance(_loop_of_run_operator(monkeypatch), uvloop.Loop)


def test_without_uvloop_kopf_runs_on_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    loop = _loop_of_run_operator(monkeypatch)
    assert type(loop).__module__.startswith("asyncio.")
