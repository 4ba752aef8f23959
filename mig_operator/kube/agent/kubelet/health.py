"""The DRA resource health service (``NodeWatchResources``) on the plugin's DRA socket: the kubelet
shows each prepared device's health in its pod's ``containerStatuses[].allocatedResourcesStatus``.

The stream sends every device the agent holds for a slice (pool: the node, device: the slice UID, as
the ResourceSlice names them) with its GPU's health, at once, at each change of a GPU's health, and every
``RESEND_S``: the kubelet takes a device it has not heard of within ``health_check_timeout_seconds`` as
Unknown, and learns of a device realised since the last change only from a later report.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import grpc

from mig_operator.core.node.health import GpuHealth

from .prepare import SliceHolder

RESEND_S = 10.0
HEALTH_TIMEOUT_S = 30  # three resends missed: the kubelet's own default timeout
MAX_MESSAGE = 1024  # the kubelet truncates longer messages


def health_status(pb: ModuleType, health: GpuHealth | None) -> int:
    """The ``HealthStatus`` of a GPU's health (None: not read yet, Unknown)."""
    if health is None:
        return pb.HealthStatus.UNKNOWN
    return pb.HealthStatus.HEALTHY if health.healthy else pb.HealthStatus.UNHEALTHY


class HealthService:
    """``DRAResourceHealth`` of one API version; ``pb`` is its generated messages module (the versions'
    messages are the same)."""

    def __init__(self, holder: SliceHolder, pb: ModuleType, resend_s: float = RESEND_S) -> None:
        self.holder = holder
        self.pb = pb
        self.resend_s = resend_s

    def report(self) -> Any:
        """Every device's health now, as a ``NodeWatchResourcesResponse``."""
        now = int(time.time())
        pb = self.pb
        return pb.NodeWatchResourcesResponse(devices=[
            pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=self.holder.node, device_name=name),
                            health=health_status(pb, health), last_updated_time=now,
                            health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                            message=(health.message if health is not None else "")[:MAX_MESSAGE])
            for name, health in sorted(self.holder.device_health(), key=lambda item: item[0])])

    async def NodeWatchResources(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        while True:
            yield self.report()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.holder.health_changed(), self.resend_s)
