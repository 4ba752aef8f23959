"""The node's GPUs as the agent's rooms share them: the list last read, NVML calls measured and run
off the event loop (a create can take seconds), and one asyncio lock per GPU that serialises the
NVML changes on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mig_operator.core.placement.cluster import InstanceState
from mig_operator.core.placement.profiles import GpuModel
from mig_operator.core.requests.quantities import MIB
from mig_operator.gpu.protocol import GpuBackend, GpuError, GpuInfo, MigInstance

from ..common import metrics

T = TypeVar("T")


class Gpus:
    """The GPUs of one node through its backend."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self.all: list[GpuInfo] = []  # as last read (on start and at each heartbeat)
        self._locks: dict[int, asyncio.Lock] = {}
        self._read: dict[int, tuple[GpuModel | None, list[MigInstance]]] = {}  # each GPU's last reading

    async def call(self, call: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, timed and its NVML errors counted under ``call``."""
        return await asyncio.to_thread(_measured, call, fn, *args)

    async def read_all(self) -> tuple[dict[int, GpuModel | None], dict[int, list[MigInstance]]]:
        """Every GPU's model (None without MIG) and MIG instances (none with MIG off), as last listed,
        read in one worker thread: a publish needs them all, and a thread hop per GPU cost more than
        the reads themselves (bench/results/benchmark-history.md). Each read is measured as ``call`` measures it."""
        def read() -> tuple[dict[int, GpuModel | None], dict[int, list[MigInstance]]]:
            models: dict[int, GpuModel | None] = {}
            instances: dict[int, list[MigInstance]] = {}
            for gpu in self.all:
                try:
                    models[gpu.index] = (_measured("model", self.backend.model, gpu.index)
                                         if gpu.mig_capable else None)
                    instances[gpu.index] = (_measured("instances", self.backend.instances, gpu.index)
                                            if gpu.mig_enabled else [])
                except GpuError as exc:
                    if exc.name != "GPU_IS_LOST" or gpu.index not in self._read:
                        raise
                    # A GPU fallen off the bus answers nothing: the node's other GPUs, and this GPU's
                    # health (Healthy=False, GpuLost), are still published, with what it last said.
                    models[gpu.index], instances[gpu.index] = self._read[gpu.index]
                self._read[gpu.index] = (models[gpu.index], instances[gpu.index])
            return models, instances

        return await asyncio.to_thread(read)

    async def refresh(self) -> None:
        self.all = await self.call("gpus", self.backend.gpus)

    def get(self, index: int) -> GpuInfo | None:
        return next((g for g in self.all if g.index == index), None)

    def lock(self, gpu: int) -> asyncio.Lock:
        return self._locks.setdefault(gpu, asyncio.Lock())

    async def instances(self, gpu: GpuInfo) -> list[MigInstance]:
        """The GPU's MIG instances (none when MIG is off)."""
        return await self.on(gpu.index) if gpu.mig_enabled else []

    async def on(self, index: int) -> list[MigInstance]:
        return await self.call("instances", self.backend.instances, index)

    def minor(self, index: int) -> int | None:
        gpu = self.get(index)
        return gpu.minor if gpu is not None else None

    def memory_bytes(self, index: int) -> int | None:
        gpu = self.get(index)
        return gpu.memory_mib * MIB if gpu is not None else None


def _measured(call: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, timed and its NVML errors counted under ``call``."""
    started = time.perf_counter()
    try:
        return fn(*args)
    except GpuError as exc:
        metrics.NVML_ERRORS.labels(call, exc.name).inc()
        raise
    finally:
        metrics.NVML_SECONDS.labels(call).observe(time.perf_counter() - started)


def describe_instance(node: str, gpu: int, inst: InstanceState) -> str:
    return f"{inst.profile} at {{{inst.start}}}:{inst.size} on {node} GPU {gpu}"
