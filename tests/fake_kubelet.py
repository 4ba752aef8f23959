"""The calls the kubelet's plugin watcher and DRA manager make to a DRA driver, built from the
kubelet's own protos (the agent's vendored stubs), over the driver's real unix sockets. Shared by
tests/unit/test_kubelet_plugin.py and tests/gpu/test_fraction_path.py (tests/conftest.py puts this
directory on the import path)."""

from __future__ import annotations

import grpc

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

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
