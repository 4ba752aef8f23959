"""Handing a NodeAgent a slice's watch event as its watch does, and waiting until its work queue has
acted on it (the unit tests' and the GPU tests' agents run without kopf)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from mig_operator.kube.agent.agent import NodeAgent, slice_key


async def settled(agent: NodeAgent, body: Mapping, timeout_s: float = 10.0) -> None:
    """Until the agent's work queue has no run of the slice's key waiting or running."""
    key = slice_key(body)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while agent.queue.pending(key):
        assert asyncio.get_running_loop().time() < deadline, f"the agent never finished {key}"
        await asyncio.sleep(0.002)


async def event(agent: NodeAgent, body: Mapping, deleted: bool = False) -> None:
    """A watch event of the slice (``deleted``: its deletion), handed to the agent, then waited for."""
    if deleted:
        agent.gone(body)
    else:
        agent.saw(body)
    await settled(agent, body)
