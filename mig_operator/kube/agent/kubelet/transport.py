"""The plugin's two gRPC servers, as the kubelet's plugin manager expects: the registration service
and the DRA service (with the resource health service beside it), each on its unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import grpc

from mig_operator.core.node.cdi import (
    DRIVER,
)

from ..kubeletapi import DRA_HEALTH_SERVICES, DRA_PLUGIN_SERVICE, DRA_PLUGIN_TYPE
from ..kubeletapi import dra_health_v1_pb2 as health_v1
from ..kubeletapi import dra_health_v1_pb2_grpc as health_v1_grpc
from ..kubeletapi import dra_health_v1alpha1_pb2 as health_v1alpha1
from ..kubeletapi import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_grpc
from ..kubeletapi import dra_v1_pb2 as dra
from ..kubeletapi import dra_v1_pb2_grpc as dra_grpc
from ..kubeletapi import pluginregistration_v1_pb2 as reg
from ..kubeletapi import pluginregistration_v1_pb2_grpc as reg_grpc
from .health import HealthService
from .prepare import ClaimPreparer, SliceHolder
from .settings import PluginSettings

log = logging.getLogger("mig_operator.agent.kubelet")


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.holder = holder
        self.settings = settings
        self.registered: asyncio.Event = asyncio.Event()

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:  # noqa: N802
        return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name=DRIVER, endpoint=self.settings.dra_socket,
                              supported_versions=[DRA_PLUGIN_SERVICE, *DRA_HEALTH_SERVICES])

    async def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,  # noqa: N802
                                       context: grpc.aio.ServicerContext) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("the kubelet registered DRA driver %s at %s", DRIVER, self.settings.dra_socket)
            self.registered.set()
            self.holder.kubelet_registered()
        else:
            log.error("the kubelet refused DRA driver %s: %s", DRIVER, request.error)
        return reg.RegistrationStatusResponse()


class _DraService(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> dra.NodePrepareResourcesResponse:
        return await self.preparer.prepare(request.claims)

    async def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest,  # noqa: N802
                                     context: grpc.aio.ServicerContext) -> dra.NodeUnprepareResourcesResponse:
        return await self.preparer.unprepare(request.claims)


class KubeletPlugin:
    """Both gRPC servers on their unix sockets, in the running asyncio loop."""

    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.settings = settings
        self.holder = holder
        self.preparer = ClaimPreparer(holder, settings)
        self.registration = _Registration(holder, settings)
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> bool:
        """Serve both sockets; False (and nothing served) when there is no kubelet registry here."""
        if not self.settings.registry_dir:
            return False
        if not os.path.isdir(self.settings.registry_dir):
            log.warning("no kubelet plugin registry at %s: the kubelet cannot find DRA driver %s on this "
                        "node (mount the kubelet's plugins_registry there, or pass --kubelet-registry-dir)",
                        self.settings.registry_dir, DRIVER)
            return False
        os.makedirs(self.settings.plugin_dir, exist_ok=True)
        await self.preparer.resync()
        dra_server = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(_DraService(self.preparer), dra_server)
        health_v1_grpc.add_DRAResourceHealthServicer_to_server(HealthService(self.holder, health_v1), dra_server)
        health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
            HealthService(self.holder, health_v1alpha1), dra_server)
        await self._serve(dra_server, self.settings.dra_socket)
        # Registration last: the kubelet calls the DRA socket as soon as it has registered us.
        reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, reg_server)
        await self._serve(reg_server, self.settings.registration_socket)
        log.info("DRA driver %s: registration at %s, service %s at %s", DRIVER, self.settings.registration_socket,
                 DRA_PLUGIN_SERVICE, self.settings.dra_socket)
        return True

    async def _serve(self, server: grpc.aio.Server, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by an earlier agent
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._servers.append(server)

    async def stop(self) -> None:
        # The registration socket goes first: the kubelet deregisters the plugin when it disappears.
        for server, path in zip(reversed(self._servers), (self.settings.registration_socket, self.settings.dra_socket),
                                strict=False):
            await server.stop(grace=1.0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._servers.clear()
