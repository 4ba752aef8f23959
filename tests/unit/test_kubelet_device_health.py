"""The plugin's resource health stream read as the kubelet reads it: a real gRPC client on the DRA
socket, the kubelet's own protos (the vendored stubs), a real NodeAgent on simulated GPUs whose GPU
gets a critical Xid and is reset."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from kubelet_harness import (
    NODE,
    Node,
    mig_slice,
    root_fixture,  # noqa: F401 (the fixture ``root``)
)

from mig_operator.core.node.health import GpuHealth
from mig_operator.kube.agent.kubelet.health import HealthService
from mig_operator.kube.agent.kubeletapi import dra_health_v1_pb2 as pb
from mig_operator.kube.agent.kubeletapi import dra_health_v1_pb2_grpc as pb_grpc

READ_S = 5.0


def devices(response: Any) -> list[tuple[str, str, str, str]]:
    """(pool, device, health name, message) of each device of a report (v1 or v1alpha1: the same numbers)."""
    return [(d.device.pool_name, d.device.device_name, pb.HealthStatus.Name(d.health), d.message)
            for d in response.devices]


def test_the_stream_reports_each_device_and_follows_its_gpus_health(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = node.kubelet()
        try:
            info = await kubelet.register()
            # The kubelet (1.37) calls a health service only when the plugin lists it.
            assert list(info.supported_versions) == \
                ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
            await node.add_slice(mig_slice("s-2", "infer", 1))
            await node.add_slice(mig_slice("s-1", "train", 0))

            _, call = kubelet.watch_health()
            _, alpha = kubelet.watch_health("v1alpha1.DRAResourceHealth")
            first = await asyncio.wait_for(call.read(), READ_S)
            assert devices(first) == [(NODE, "s-1", "HEALTHY", ""), (NODE, "s-2", "HEALTHY", "")]
            assert all(d.health_check_timeout_seconds == 30 for d in first.devices)
            assert devices(await asyncio.wait_for(alpha.read(), READ_S)) == devices(first)

            node.backend().inject_xid(0, 79)  # the GPU has fallen off the bus
            assert node.agent is not None
            await node.agent.check_health()
            sick = devices(await asyncio.wait_for(call.read(), READ_S))
            assert [d[:3] for d in sick] == [(NODE, "s-1", "UNHEALTHY"), (NODE, "s-2", "UNHEALTHY")]
            assert all("Xid 79" in d[3] for d in sick), sick
            assert [d[:3] for d in devices(await asyncio.wait_for(alpha.read(), READ_S))] == [d[:3] for d in sick]

            node.backend().reset_gpu(0)
            await node.agent.check_health()
            assert devices(await asyncio.wait_for(call.read(), READ_S)) == \
                [(NODE, "s-1", "HEALTHY", ""), (NODE, "s-2", "HEALTHY", "")]
            call.cancel()
            alpha.cancel()
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


class Holder:
    """Just what the health service asks of the agent: devices and healths set by the test, no change signal."""

    node = "node-b"

    def __init__(self) -> None:
        self.healths: list[tuple[str, GpuHealth | None]] = []

    def device_health(self) -> list[tuple[str, GpuHealth | None]]:
        return list(self.healths)

    async def health_changed(self) -> None:
        await asyncio.Event().wait()


def test_the_report_is_sent_again_unasked_with_a_gpu_not_read_yet_unknown(root: Path) -> None:
    async def scenario() -> None:
        holder = Holder()
        holder.healths = [("s-9", None)]
        server = grpc.aio.server()
        pb_grpc.add_DRAResourceHealthServicer_to_server(HealthService(holder, pb, resend_s=0.05), server)  # type: ignore[arg-type]
        socket = root / "health.sock"
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        try:
            call = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
            assert devices(await asyncio.wait_for(call.read(), READ_S)) == [("node-b", "s-9", "UNKNOWN", "")]
            # A device realised since: the next report (no health change) names it.
            holder.healths = [("s-9", GpuHealth()), ("s-3", GpuHealth(False, "GpuLost", "GPU 1 is lost"))]
            assert devices(await asyncio.wait_for(call.read(), READ_S)) == \
                [("node-b", "s-3", "UNHEALTHY", "GPU 1 is lost"), ("node-b", "s-9", "HEALTHY", "")]
            call.cancel()
        finally:
            await channel.close()
            await server.stop(grace=None)

    asyncio.run(scenario())
