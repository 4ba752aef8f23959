"""The calls the kubelet's plugin watcher and DRA manager make to a DRA driver, built from the
kubelet's own protos (the agent's vendored stubs), over the driver's real unix sockets. Shared by
tests/unit/test_kubelet_plugin.py and tests/gpu/test_fraction_path.py (tests/conftest.py puts this
directory on the import path)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import grpc

from mig_operator.kube.agent.kubeletapi import dra_health_v1_pb2 as health_v1
from mig_operator.kube.agent.kubeletapi import dra_health_v1_pb2_grpc as health_v1_grpc
from mig_operator.kube.agent.kubeletapi import dra_health_v1alpha1_pb2 as health_v1alpha1
from mig_operator.kube.agent.kubeletapi import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_grpc
from mig_operator.kube.agent.kubeletapi import dra_v1_pb2 as dra
from mig_operator.kube.agent.kubeletapi import dra_v1_pb2_grpc as dra_grpc
from mig_operator.kube.agent.kubeletapi import pluginregistration_v1_pb2 as reg
from mig_operator.kube.agent.kubeletapi import pluginregistration_v1_pb2_grpc as reg_grpc


class FakeKubelet:
    """Registers at ``registration_socket`` and then calls the DRA service its GetInfo names; claims
    are (uid, name) pairs of ``namespace``."""

    def __init__(self, registration_socket: str, namespace: str = "team", timeout_s: float = 10.0) -> None:
        self.registration_socket = registration_socket
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.dra: dra_grpc.DRAPluginStub | None = None
        self.dra_endpoint = ""
        self._channels: list[grpc.aio.Channel] = []

    async def register(self) -> reg.PluginInfo:
        channel = grpc.aio.insecure_channel(f"unix://{self.registration_socket}")
        self._channels.append(channel)
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg.InfoRequest(), timeout=self.timeout_s)
        await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=self.timeout_s)
        dra_channel = grpc.aio.insecure_channel(f"unix://{info.endpoint}")
        self._channels.append(dra_channel)
        self.dra = dra_grpc.DRAPluginStub(dra_channel)
        self.dra_endpoint = info.endpoint
        return info

    def _claims(self, claims: tuple[tuple[str, str], ...]) -> list[dra.Claim]:
        return [dra.Claim(namespace=self.namespace, uid=uid, name=name) for uid, name in claims]

    async def prepare(self, *claims: tuple[str, str]) -> dra.NodePrepareResourcesResponse:
        assert self.dra is not None, "register first"
        request = dra.NodePrepareResourcesRequest(claims=self._claims(claims))
        return await self.dra.NodePrepareResources(request, timeout=self.timeout_s)

    async def unprepare(self, *claims: tuple[str, str]) -> dra.NodeUnprepareResourcesResponse:
        assert self.dra is not None, "register first"
        request = dra.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        return await self.dra.NodeUnprepareResources(request, timeout=self.timeout_s)

    def watch_health(self, service: str = "v1.DRAResourceHealth") -> tuple[ModuleType, Any]:
        """The ``NodeWatchResources`` stream of the resource health service ``service`` (as GetInfo lists
        it) on the DRA socket, with that version's messages module: read it with ``await call.read()``."""
        assert self.dra_endpoint, "register first"
        pb, pb_grpc = {"v1.DRAResourceHealth": (health_v1, health_v1_grpc),
                       "v1alpha1.DRAResourceHealth": (health_v1alpha1, health_v1alpha1_grpc)}[service]
        channel = grpc.aio.insecure_channel(f"unix://{self.dra_endpoint}")
        self._channels.append(channel)
        return pb, pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
