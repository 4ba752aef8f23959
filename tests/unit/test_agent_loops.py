"""The agent's long-lived loops (heartbeat, GPU health, idle time-out, usage) run supervised: an unexpected error
in one ends that run, and the loop runs again after its back-off, counted in
``mig_operator_loop_restarts_total{component="agent",loop=...}``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubelet_harness import NODE, ApiStandIn, NoEvents
from prometheus_client import REGISTRY

from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import NodeAgent
from mig_operator.kube.agent.context import AgentSettings
from mig_operator.kube.agent.record import RecordStore


def _restarts(loop: str) -> float:
    return REGISTRY.get_sample_value("mig_operator_loop_restarts_total", {"component": "agent", "loop": loop}) or 0.0


def _owner(agent: NodeAgent, loop: str) -> tuple[Any, str]:
    """The object and method name each loop calls once per pass."""
    return {"heartbeat": (agent.gpus, "refresh"), "health": (agent, "check_health"),
            "idle-reaper": (agent.idle, "reap_once"), "usage": (agent.usage, "read_once")}[loop]


@pytest.mark.parametrize("loop", ["heartbeat", "health", "idle-reaper", "usage"])
def test_a_loop_whose_pass_raises_runs_again(tmp_path: Path, loop: str) -> None:
    async def main() -> None:
        backend = SimulatedBackend("h100-80gb", count=1, state_file=str(tmp_path / "sim.json"), host=NODE)
        settings = AgentSettings(NODE, publish_delay_s=0.01, heartbeat_s=0.05, health_poll_s=0.05,
                                 idle_timeout_s=0.1, usage_interval_s=0.05)
        agent = NodeAgent(settings, backend, RecordStore(str(tmp_path / "owners.json")), ApiStandIn(),
                          NoEvents())  # type: ignore[arg-type]
        await agent.start()
        before = _restarts(loop)
        target, name = _owner(agent, loop)
        real = getattr(target, name)
        passes: list[int] = []

        async def failing_once(*args: Any, **kwargs: Any) -> Any:
            passes.append(1)
            if len(passes) == 1:
                raise RuntimeError(f"injected into {loop}")
            return await real(*args, **kwargs)

        setattr(target, name, failing_once)
        try:
            deadline = asyncio.get_running_loop().time() + 15
            while len(passes) < 2:
                assert asyncio.get_running_loop().time() < deadline, f"{loop} never ran again: {passes}"
                await asyncio.sleep(0.02)
            assert _restarts(loop) - before == 1
            assert f"injected into {loop}" in agent.loops.states[loop].last_error
            assert agent.liveness() == []  # one restart is no reason for the kubelet to restart the agent
        finally:
            await agent.stop()

    asyncio.run(main())
