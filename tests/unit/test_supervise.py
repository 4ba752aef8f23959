"""Supervised loops: a loop that raises or returns runs again after its back-off, each restart counted; the
liveness view names a loop that keeps failing, and forgets it once a run of it lasts."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from mig_operator.kube.common.supervise import Loops, supervised


def _restarts(component: str, loop: str) -> float:
    return REGISTRY.get_sample_value("mig_operator_loop_restarts_total", {"component": component, "loop": loop}) or 0.0


def test_a_loop_that_raises_runs_again_and_each_restart_is_counted() -> None:
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 4:
            raise RuntimeError(f"failure {len(runs)}")
        await asyncio.sleep(3600)  # the fourth run lasts

    async def main() -> None:
        before = _restarts("test", "flaky")
        task = asyncio.create_task(supervised("test", "flaky", flaky, base_delay_s=0.001, max_delay_s=0.002))
        for _ in range(500):
            if len(runs) >= 4:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(runs) == 4
        assert _restarts("test", "flaky") - before == 3

    asyncio.run(main())


def test_a_loop_that_returns_is_started_again() -> None:
    runs = []

    async def ends() -> None:
        runs.append(1)

    async def main() -> None:
        task = asyncio.create_task(supervised("test", "ends", ends, base_delay_s=0.001, max_delay_s=0.001))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(runs) >= 3


def test_the_liveness_view_names_a_loop_failing_past_its_time_and_forgets_it_once_a_run_lasts() -> None:
    loops = Loops("test", stale_s=0.05, healthy_after_s=0.3)
    fail = [True]

    async def sometimes() -> None:
        if fail[0]:
            raise OSError("no GPU")
        await asyncio.sleep(3600)

    async def main() -> None:
        task = loops.start("sometimes", sometimes, base_delay_s=0.001, max_delay_s=0.005)
        await asyncio.sleep(0.02)
        assert loops.unhealthy() == []  # failing, but not for long yet
        await asyncio.sleep(0.1)
        assert loops.unhealthy() == ["sometimes: OSError: no GPU"]
        fail[0] = False
        await asyncio.sleep(0.4)  # a run that lasts longer than healthy_after_s
        assert loops.unhealthy() == []
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
