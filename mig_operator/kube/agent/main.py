"""``mig-operator agent``: the node agent as a kopf operator, standalone (every agent runs).

It watches only the GpuSlices bound to its node (a server-side field selector on the slice's node), so
its work and traffic grow with its own node's slices, not with the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

import kopf

from mig_operator.gpu.mps import MpsControl
from mig_operator.gpu.protocol import GpuBackend

from ..common import metrics
from ..common.client import ApiError, KubeClient, Retry
from ..common.events import EventPoster
from ..common.names import AGENT_PREFIX, GROUP, SLICES, VERSION, slices_of_node
from ..common.operator import on_event, register_login, run_operator, tune
from ..common.probes import Check, Probes, watch_operator
from ..common.trim import node_body, slice_body
from .agent import NodeAgent
from .context import AgentSettings
from .kubelet.settings import PluginSettings
from .kubelet.transport import KubeletPlugin
from .record import RecordStore

log = logging.getLogger("mig_operator.agent")


@dataclass(frozen=True)
class AgentOptions:
    settings: AgentSettings
    record_file: str
    kubeconfig: str | None = None
    metrics_address: str | None = None
    metrics_socket: socket.socket | None = None  # bound before start (metrics.bind); else bound from the address
    plugin: PluginSettings = PluginSettings()  # the kubelet's DRA plugin (registry dir "": none)
    mps: MpsControl | None = None  # the GPUs' MPS control daemons (compute shares); None: none served


def build_registry(options: AgentOptions, backend: GpuBackend,
                   state: dict[str, Any] | None = None) -> kopf.OperatorRegistry:
    """``state``: filled at start (``agent``: the NodeAgent, read by the probes)."""
    registry = kopf.OperatorRegistry()
    register_login(registry, options.kubeconfig)
    state = {} if state is None else state

    @kopf.on.startup(registry=registry, backoff=2)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        tune(settings, AGENT_PREFIX)
        settings.watching.field_selectors[GROUP, SLICES] = slices_of_node(options.settings.node)
        # Its own Node only: a MIG label added or removed shows in the GpuNode within a second.
        settings.watching.field_selectors["v1", "nodes"] = f"metadata.name={options.settings.node}"
        client = KubeClient.from_environment(options.kubeconfig)
        agent = NodeAgent(options.settings, backend, RecordStore(options.record_file), client,
                          EventPoster(client, "mig-operator-agent", options.settings.node), options.mps)
        client.on_back.append(agent.queue.retry_failed_now)  # keys that failed while the API server was away
        await agent.start()
        state.update(agent=agent, client=client)
        # After the agent has adopted its instances: a prepare needs the record and the Ready slices.
        plugin = KubeletPlugin(agent, options.plugin)
        try:
            await plugin.start()
        except (OSError, RuntimeError) as exc:
            # The slices are still realised and published; only the kubelet cannot hand them out.
            log.error("cannot serve the kubelet plugin (%s, %s): %s", options.plugin.registration_socket,
                      options.plugin.dra_socket, exc)
        state.update(plugin=plugin)

    async def slice_event(body: dict[str, Any], type: str | None) -> None:
        # Recorded and enqueued only: the agent's work queue acts on it (NodeAgent.reconcile).
        if type == "DELETED":
            state["agent"].gone(body)
        else:
            state["agent"].saw(body)

    async def own_node_event(body: dict[str, Any], type: str | None) -> None:
        if type == "DELETED":
            state["agent"].node_deleted()
        else:
            state["agent"].node_changed(body)

    # A slice's events in order (operator.on_event), each as its kind's transform keeps it (kube/common/trim.py).
    on_event(registry, GROUP, VERSION, SLICES, slice_event, slice_body)
    on_event(registry, "", "v1", "nodes", own_node_event, node_body)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        plugin = state.get("plugin")
        if plugin is not None:
            await plugin.stop()
        agent = state.get("agent")
        if agent is not None:
            await agent.stop()
            await agent.events.drain()
            await state["client"].close()

    return registry


def node_exists(kubeconfig: str | None, node: str) -> bool | None:
    """Whether the API server has Node ``node``: None when it cannot tell (unreachable, forbidden), so
    that the agent starts and kopf keeps retrying as for any other outage."""

    async def ask() -> bool | None:
        client = KubeClient.from_environment(kubeconfig, retry=Retry(attempts=3), timeout_s=10.0)
        try:
            await client.get(f"/api/v1/nodes/{node}")
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            log.warning("cannot check that node %s exists, starting anyway: %s", node, exc)
            return None
        finally:
            await client.close()

    return asyncio.run(ask())


def run_agent(options: AgentOptions, backend: GpuBackend, probes: Probes | None = None) -> None:
    """Run the agent until it stops; ``probes`` (served by the caller) ask the NodeAgent's ``liveness`` and
    ``readiness`` and see kopf's own tasks alive."""
    if options.metrics_socket is not None or options.metrics_address:
        metrics.serve(options.metrics_socket or options.metrics_address or "", options.kubeconfig)
    state: dict[str, Any] = {}
    registry = build_registry(options, backend, state)
    if probes is not None:
        probes.add(live=_agent_says(state, "liveness"), ready=_agent_says(state, "readiness"))
        watch_operator(registry, probes)
    try:
        run_operator(registry, standalone=True)
    finally:
        backend.close()


def _agent_says(state: dict[str, Any], probe: str) -> Check:
    """The NodeAgent's own view of ``probe`` (liveness or readiness) once it has started; before, it is
    live and not ready."""
    def check() -> list[str]:
        agent = state.get("agent")
        if agent is None:
            return [] if probe == "liveness" else ["the node agent has not started yet"]
        return list(getattr(agent, probe)())
    return check
