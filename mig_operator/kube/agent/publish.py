"""What the node agent tells the cluster: its GpuNode (GPUs, instances, who holds what, conditions),
its ResourceSlice (one device per offered slice: ``core.node.lifecycle.offered``) and its metrics.

Changes within ``publish_delay_s`` share one GpuNode write; a heartbeat re-reads the GPUs, the Node
and the runtime and publishes at least every ``heartbeat_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mig_operator.core.node.device_plugin import CONDITION_TYPE, DevicePluginCheck
from mig_operator.core.node.lifecycle import OwnerEntry
from mig_operator.gpu.protocol import GpuError

from ..common import metrics, status
from ..common.client import ApiError, gpunode_path, gpunodes_path
from ..common.names import API_VERSION, NODE_KIND
from .context import AgentContext
from .health import HealthWatch
from .inventory import gpunode_status
from .node_watch import NodeWatch
from .resource_slice import ResourceSlicePublisher, device_info

log = logging.getLogger("mig_operator.agent")


class Publisher:
    """The node's GpuNode, ResourceSlice and gauges, written when something changes and on a heartbeat."""

    def __init__(self, context: AgentContext, node: NodeWatch, offered: Callable[[], list[OwnerEntry]],
                 health: HealthWatch) -> None:
        self.settings = context.settings
        self.gpus = context.gpus
        self.store = context.store
        self.client = context.client
        self.events = context.events
        self.node = node
        self.offered = offered  # the entries whose device the ResourceSlice lists
        self.mps = context.mps
        self.health = health
        self.resource_slice = ResourceSlicePublisher(context.client, context.settings.node)
        self._pending: asyncio.Task | None = None
        self._again = False  # a change arrived while a publish was under way
        self._now = asyncio.Event()  # set: the next publish skips (or cuts short) its coalescing delay
        # One ResourceSlice write at a time (a read, then a PUT with its resourceVersion).
        self._devices_lock = asyncio.Lock()
        self._conflict_reported = False  # a Warning Event about a device plugin conflict was posted
        self._slot_models: dict[str, str] = {}  # GPU index -> the model label of its mig_operator_slots series

    def schedule(self, at_once: bool = False) -> None:
        """Publish soon; changes within ``publish_delay_s`` share one write. A change that arrives
        while a write is under way gets a write of its own after it (the one under way may have read
        the GPUs and the record before the change: skipping it left the GpuNode stale until the
        heartbeat, up to 30 s). ``at_once``: no coalescing delay (a change people wait to see)."""
        self._again = True
        if at_once:
            self._now.set()  # a publish waiting out its delay goes now, with this change
        if self._pending is None or self._pending.done():
            self._pending = asyncio.create_task(self._later(), name="gpunode-publish")

    async def _later(self) -> None:
        while self._again:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), self.settings.publish_delay_s)
            self._now.clear()
            self._again = False
            try:
                await self.publish()
            except (GpuError, ApiError) as exc:
                log.warning("publishing GpuNode %s failed, the heartbeat retries: %s", self.settings.node, exc)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self.gpus.refresh()
                await self.node.read()
                await self.node.read_runtime()
                await self.publish(verify_devices=True)
            except (GpuError, ApiError) as exc:
                log.warning("GpuNode heartbeat failed: %s", exc)

    def cancel(self) -> list[asyncio.Task]:
        if self._pending is not None:
            self._pending.cancel()
            return [self._pending]
        return []

    async def publish(self, verify_devices: bool = False) -> None:
        await self.mps.settle()  # the daemons follow the record (each change publishes; so does the heartbeat)
        models, instances = await self.gpus.read_all()
        node = self.node
        check = node.device_plugin
        body = gpunode_status(self.gpus.all, models, instances, self.store.record, node.labelled, status.now(),
                              self.store.revoked, check, node.device_plugin_since,
                              node.runtime.condition() if node.runtime is not None else None,
                              self.health.conditions())
        mps = self.mps.condition()
        if mps is not None:
            body["conditions"] = [*body.get("conditions", []), mps]
        metrics.DEVICE_PLUGIN_CONFLICT.labels(self.settings.node).set(1 if check.conflict else 0)
        for gpu in body["gpus"]:
            states = {"in_use": 0, "idle": 0}
            for inst in gpu["instances"]:
                states["in_use" if inst["sliceUID"] or inst["inUse"] else "idle"] += 1
            for state, count in states.items():
                metrics.INSTANCES.labels(self.settings.node, str(gpu["index"]), state).set(count)
            metrics.GRANTED_BYTES.labels(self.settings.node, str(gpu["index"])).set(gpu["grantedBytes"])
            metrics.GPU_HEALTHY.labels(self.settings.node, str(gpu["index"])).set(
                1 if self.health.of(gpu["index"]).healthy else 0)
            self.publish_slots(gpu, models.get(gpu["index"]))
        # The GpuNode is what the controller checks a new device against before it ungates a pod: it
        # does not wait behind the ResourceSlice writes of slices turning Ready (one at a time, under
        # the devices' lock), which nothing reads before a pod is scheduled (the controller allocates
        # the claims itself).
        _, written = await asyncio.gather(self.devices(verify_devices), self._write_gpunode(body))
        if written is None:
            return
        self._post_device_plugin_event(written, check)
        self._post_health_events(written)

    async def _write_gpunode(self, body: dict[str, Any]) -> dict | None:
        """The GpuNode's status written (the GpuNode made first if missing); None when the Node is gone
        (the garbage collector removed its GpuNode): nothing is written until a Node of this name exists
        again, so no inventory outlives its node."""
        path = gpunode_path(self.settings.node, status=True)
        try:
            return await self.client.merge_patch(path, {"status": body})
        except ApiError as exc:
            if not exc.not_found:
                raise
            if not self.node.uid:
                log.debug("node %s does not exist: its GpuNode is not written", self.settings.node)
                return None
            await self._create_gpunode()
            return await self.client.merge_patch(path, {"status": body})

    def _post_health_events(self, gpunode: Mapping | None) -> None:
        """The Events of GPUs turned unhealthy or healthy again, on the GpuNode just written."""
        if not isinstance(gpunode, Mapping) or not (gpunode.get("metadata") or {}).get("uid"):
            return
        for kind, reason, message in self.health.events:
            self.events.post(gpunode, kind, reason, message)
        self.health.events.clear()

    def _post_device_plugin_event(self, gpunode: Mapping | None, check: DevicePluginCheck) -> None:
        """An Event on the GpuNode when a device plugin conflict appears, changes or is resolved (the
        poster skips one that repeats the last, so the heartbeat's publishes post nothing new)."""
        if not isinstance(gpunode, Mapping) or not (gpunode.get("metadata") or {}).get("uid"):
            return
        if check.conflict:
            self.events.post(gpunode, "Warning", CONDITION_TYPE, check.message)
            self._conflict_reported = True
        elif check.resources or self._conflict_reported:
            # Shared deliberately, or resolved after a conflict this agent reported: said once.
            self.events.post(gpunode, "Normal", check.reason, check.message)
            self._conflict_reported = False

    def publish_slots(self, gpu: Mapping[str, Any], model: Any) -> None:
        """``mig_operator_slots`` of one GPU: the GpuNode's slot columns, per GPU and model."""
        node, index = self.settings.node, str(gpu["index"])
        slots = slot_states(gpu, model.memory_slots) if gpu["migEnabled"] and model is not None else None
        before = self._slot_models.pop(index, None)
        if before is not None and (slots is None or before != model.name):
            # No longer a MIG GPU (or another model): its old series would count slots it does not have.
            for state in ("in_use", "idle", "free"):
                metrics.SLOTS.remove(node, index, before, state)
        if slots is not None:
            for state, count in slots.items():
                metrics.SLOTS.labels(node, index, model.name, state).set(count)
            self._slot_models[index] = model.name

    async def devices(self, verify: bool = False) -> None:
        """The node's ResourceSlice: one device per offered slice (written only when that changes;
        ``verify``: read back even if unchanged here, since the kubelet may have deleted it)."""
        async with self._devices_lock:
            effect = self.settings.device_taint_effect
            devices = [device_info(e, "" if (h := self.health.of(e.gpu)).healthy else h.reason, effect)
                       for e in self.offered()]
            try:
                await self.resource_slice.publish(devices, self.node.uid, verify=verify)
            except ApiError as exc:
                self.resource_slice.forget()  # written again at the next publish or heartbeat
                log.warning("publishing the ResourceSlice of node %s failed, retried: %s", self.settings.node, exc)

    async def _create_gpunode(self) -> None:
        # Owned by its Node: deleting the Node deletes its inventory (kube-controller-manager's GC).
        meta: dict[str, Any] = {"name": self.settings.node, "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": self.settings.node, "uid": self.node.uid}]}
        body = {"apiVersion": API_VERSION, "kind": NODE_KIND, "metadata": meta,
                "spec": {"nodeName": self.settings.node}}
        try:
            await self.client.create(gpunodes_path(), body)
        except ApiError as exc:
            if not exc.conflict:
                raise


def slot_states(gpu: Mapping[str, Any], memory_slots: int) -> dict[str, int]:
    """A MIG GPU's memory slots under instances in use, under idle ones and under none, from its GpuNode
    entry: the rule of the GpuNode's columns (held by a slice or running a process is in use)."""
    held = idle = 0
    for inst in gpu["instances"]:
        mask = ((1 << inst["size"]) - 1) << inst["start"]
        if inst["sliceUID"] or inst["inUse"]:
            held |= mask
        else:
            idle |= mask
    return {"in_use": held.bit_count(), "idle": idle.bit_count(),
            "free": memory_slots - (held | idle).bit_count()}
