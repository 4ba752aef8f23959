"""The node agent: the router between its rooms. It is the only part that touches the GPUs.

- ``realise.py``: realising a slice bound here (intent, reuse/create/reclaim through NVML, Ready or
  Failed), and letting its instance go; ``release.py``: a deleted slice's release, held while its
  claim is in use;
- ``publish.py``: the GpuNode, the ResourceSlice and the metrics, coalesced, with a heartbeat;
- ``node_watch.py``: this node's Node (MIG label, device plugin resources, runtime trust);
- ``idle.py``: the idle time-out;
- ``usage.py``: what each Ready slice uses (status.usage, its metrics) and whether it is idle (``Active``);
- ``mps_keeper.py``: the MPS control daemon of each GPU that holds a compute share;
- ``gpus.py``: the GPUs they share (measured NVML calls off the event loop, one lock per GPU);
- ``context.py``: the settings and the one instance of each collaborator every room takes.

``start`` adopts what exists (``core.node.lifecycle.adopt`` and ``settle_adoption``) and starts the
long-lived loops (heartbeat, health, idle time-out, usage) under ``Loops("agent")``, each started again after an
unexpected error. A slice's watch event is recorded (``seen.py``) and its key ``("slice", namespace, uid)``
enqueued on the agent's ``WorkQueue``; ``reconcile(key)`` acts on what is recorded then
(``core.node.lifecycle.agent_step``: realise, release, let go), and an error raises, so the queue runs
the key again after its back-off. Whether a slice's device is offered (ResourceSlice, kubelet prepare)
is ``core.node.lifecycle.offered`` of its record entry, whether it was revoked, and whether its status
says Ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from mig_operator.core.node.health import GpuHealth
from mig_operator.core.node.lifecycle import (
    FORGET,
    READY,
    REALISE,
    RELEASE,
    OwnerEntry,
    OwnerRecord,
    adopt,
    agent_step,
    settle_adoption,
)
from mig_operator.core.placement.cluster import Binding, binding_from_status
from mig_operator.gpu.mps import MpsControl, MpsDirs
from mig_operator.gpu.protocol import GpuBackend, GpuError

from ..common import metrics, status
from ..common.client import ApiError, KubeClient, resource_version, slice_path, slices_path
from ..common.events import EventPoster
from ..common.names import AGENT_FINALIZER, slices_of_node
from ..common.supervise import Loops
from ..common.trim import slice_body
from ..common.workqueue import Requeue, WorkQueue
from .context import AgentContext, AgentSettings
from .gpus import Gpus
from .health import HealthWatch
from .idle import IdleReaper
from .inventory import instance_state
from .mps_keeper import MpsKeeper
from .node_watch import NodeWatch
from .publish import Publisher
from .realise import Realiser
from .record import RecordStore
from .release import Releaser
from .seen import SeenSlice, SeenSlices
from .usage import UsageWatch

log = logging.getLogger("mig_operator.agent")


SliceKey = tuple[str, str, str]  # ("slice", namespace, uid)


def slice_key(body: Mapping) -> SliceKey:
    """A slice's key on the agent's work queue."""
    return ("slice", body["metadata"]["namespace"], body["metadata"]["uid"])


class NodeAgent:
    """One node's agent; ``start`` adopts what exists, ``saw``/``gone`` record each slice event and
    ``reconcile`` acts on it from the work queue."""

    def __init__(self, settings: AgentSettings, backend: GpuBackend, store: RecordStore, client: KubeClient,
                 events: EventPoster, mps: MpsControl | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.client = client
        self.events = events
        self.gpus = Gpus(backend)
        self.mps = MpsKeeper(self.gpus, store, mps, status.now)
        self.node_watch = NodeWatch(settings.node, client, settings.toolkit_config)
        context = AgentContext(settings, self.gpus, store, client, events, self.mps)
        self.health = HealthWatch(self.gpus, store, client)
        self.publisher = Publisher(context, self.node_watch, lambda: self.realiser.offered_entries(), self.health)
        self.realiser = Realiser(context, self.publisher)
        self.mps.on_change = self.realiser.mps_changed
        self.releaser = Releaser(context, self.realiser)
        self.idle = (IdleReaper(settings.node, settings.idle_timeout_s, self.gpus, store, self.publisher.schedule)
                     if settings.idle_timeout_s is not None else None)
        self.slices = SeenSlices()
        self.queue = WorkQueue(component="agent")
        self.loops = Loops("agent")
        self.usage = (UsageWatch(context, self.realiser, self.slices, self.queue)
                      if settings.usage_interval_s > 0 else None)
        self.started = False  # the node's instances adopted and the loops running
        self._stopped = False
        self._tasks: list[asyncio.Task] = []

    # ---- what the kubelet plugin asks (kubelet.prepare.SliceHolder) --------------------------------

    @property
    def node(self) -> str:
        return self.settings.node

    def ready_entry(self, slice_uid: str) -> OwnerEntry | None:
        return self.store.record.owners.get(slice_uid) if self.realiser.offers(slice_uid) else None

    async def until_ready(self, slice_uid: str, timeout_s: float) -> OwnerEntry | None:
        await self.realiser.until_offered(slice_uid, timeout_s)
        return self.ready_entry(slice_uid)

    def gpu_minor(self, gpu_index: int) -> int | None:
        return self.gpus.minor(gpu_index)

    def gpu_memory_bytes(self, gpu_index: int) -> int | None:
        return self.gpus.memory_bytes(gpu_index)

    def mps_dirs(self, gpu_uuid: str) -> MpsDirs | None:
        """The GPU's MPS directories while its daemon answers; None while it does not (or no MPS here)."""
        return self.mps.dirs(gpu_uuid) if self.mps.ready(gpu_uuid) else None

    async def device_root(self) -> str:
        return await self.gpus.call("device_root", self.backend.device_root)

    async def claim_released(self, slice_uid: str) -> None:
        if await self.releaser.claim_released(slice_uid):
            seen = self.slices.get(slice_uid)
            if seen is not None:
                self._enqueue(slice_key(seen.body))

    def device_health(self) -> list[tuple[str, GpuHealth | None]]:
        """Each slice holding an instance here (its device name, the slice UID) and its GPU's health; None
        while the GPU's health was never read."""
        return [(entry.uid, self.health.health.get(entry.gpu)) for entry in self.store.record.owners.values()]

    async def health_changed(self) -> None:
        await self.health.next_change()

    def kubelet_registered(self) -> None:
        """The kubelet (re)registered the plugin: it deletes its node's ResourceSlices when it starts,
        so the ResourceSlice is read and written again now rather than at the next heartbeat."""
        self.publisher.resource_slice.forget()
        self.schedule_publish(at_once=True)

    # ---- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the GPUs and the node, adopt what exists, complete half-made instances, publish.

        Nothing is destroyed on start: an instance that matches neither the record nor a live
        slice's binding becomes idle, to be reused or reclaimed later.
        """
        await self.gpus.refresh()
        await self.health.poll()
        await self.node_watch.read()
        slices = await self.client.list(slices_path(), field_selector=slices_of_node(self.settings.node),
                                        keep=slice_body)
        bindings: dict[str, Binding] = {}
        for body in slices:
            self.health.saw_slice(body["metadata"]["uid"], body)
            binding = binding_from_status(body["metadata"]["uid"], body.get("status"))
            if binding is not None and binding.node == self.settings.node:
                bindings[body["metadata"]["uid"]] = binding
        found = {gpu.index: [instance_state(i) for i in await self.gpus.instances(gpu)] for gpu in self.gpus.all}
        boot = await self.gpus.call("boot_id", self.backend.boot_id)
        adoption = adopt(self.store.record, boot, found, bindings)
        names = {b["metadata"]["uid"]: f"{b['metadata']['namespace']}/{b['metadata']['name']}" for b in slices}
        held = {c.slice_uid for c in self.store.prepared.values()}
        record, revoke = settle_adoption(adoption, self.store.record, names, held, bindings, found, status.now())
        await asyncio.to_thread(self.store.update, lambda _old: record)
        for uid in revoke:
            await asyncio.to_thread(self.store.revoke, uid)
        self.realiser.shown_ready = {
            b["metadata"]["uid"] for b in slices
            if (b.get("status") or {}).get("phase") == READY and not b["metadata"].get("deletionTimestamp")
            and b["metadata"]["uid"] in bindings}
        for gpu, inst in adoption.incomplete:
            # A GPU instance without its compute instance: complete it so that it can be handed out.
            try:
                await self.gpus.call("create_compute_instance", self.backend.create_compute_instance, gpu,
                                     inst.gi_id)
            except GpuError as exc:
                log.warning("cannot complete half-made GPU instance %s on GPU %s: %s", inst.gi_id, gpu, exc)
        log.info("agent for node %s started: %d GPU(s), adopted %d, dropped %d, completed %d", self.settings.node,
                 len(self.gpus.all), len(adoption.adopted), len(adoption.dropped), len(adoption.incomplete))
        await self.node_watch.read_runtime()
        await self.publish()
        self._tasks.append(self.loops.start("heartbeat", self.publisher.heartbeat))
        self._tasks.append(self.loops.start("health", self._watch_health))
        if self.idle is not None:
            self._tasks.append(self.loops.start("idle-reaper", self.idle.run))
        if self.usage is not None:
            self._tasks.append(self.loops.start("usage", self.usage.run))
        self.started = True

    async def stop(self) -> None:
        """Stop the loops and start no more slice work (work under way ends as it is)."""
        self._stopped = True
        for task in [*self._tasks, *self.publisher.cancel()]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- probes ------------------------------------------------------------------------------------

    def liveness(self) -> list[str]:
        """What should make the kubelet restart the process: a loop failing in a row for long. Slice
        keys failing for long are not here: they fail on what a restart does not change (the API
        server away, a refused write), and the queue keeps trying them."""
        return self.loops.unhealthy()

    def readiness(self) -> list[str]:
        """Why the agent cannot serve yet: its node's instances not adopted (``start`` not done)."""
        if not self.started:
            return [f"the agent of node {self.settings.node} has not adopted its GPUs' instances yet"]
        return []

    # ---- health ------------------------------------------------------------------------------------

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_poll_s)
            try:
                await self.check_health()
            except (GpuError, ApiError) as exc:
                log.warning("GPU health check failed: %s", exc)

    async def check_health(self) -> None:
        """Read each GPU's health once: a change is published at once, and ``DeviceHealthy`` written on the
        Ready slices whose GPU changed."""
        if await self.health.poll(self.node_watch.health_cleared):
            self.schedule_publish(at_once=True)
        for uid, ref, health in self.health.slices_to_mark(self.realiser.shown_ready):
            await self.health.mark(uid, ref, health, self.realiser.write_status)

    # ---- the Node ----------------------------------------------------------------------------------

    def node_changed(self, node: Mapping) -> None:
        """A watch event of this agent's own Node: a changed MIG label changes what every GPU serves,
        so the GpuNode says so at once, not at the next heartbeat (30 s)."""
        publish, again = self.node_watch.changed(node)
        if again:  # a Node of this name again: its GpuNode is written anew
            self.publisher.resource_slice.forget()
        if publish:
            self.schedule_publish(at_once=True)

    def node_deleted(self) -> None:
        """This agent's Node is gone: the garbage collector removes its GpuNode (owned by the Node), and
        none is written again until a Node of this name exists (``node_changed``)."""
        self.node_watch.deleted()
        self.publisher.resource_slice.forget()

    # ---- publishing --------------------------------------------------------------------------------

    def schedule_publish(self, at_once: bool = False) -> None:
        self.publisher.schedule(at_once)

    async def publish(self, verify_devices: bool = False) -> None:
        await self.publisher.publish(verify_devices)

    async def reap_idle_once(self) -> int:
        assert self.idle is not None
        return await self.idle.reap_once()

    # ---- slice events ------------------------------------------------------------------------------

    def saw(self, body: Mapping) -> None:
        """A watch event of a slice bound to this node: recorded, and its key enqueued.

        An event older than the agent's own last write of that slice is skipped: it may still say
        Creating after the agent wrote Failed, and acting on it would realise the slice twice.
        """
        meta = body["metadata"]
        if resource_version(meta) < self.realiser.written.get(meta["uid"], 0):
            return
        if self.slices.take(body):
            self._enqueue(slice_key(body))

    def gone(self, body: Mapping) -> None:
        """The slice is deleted (or no longer bound to this node): recorded, and its key enqueued."""
        if self.slices.take(body, gone=True):
            self._enqueue(slice_key(body))

    def _enqueue(self, key: SliceKey, after_s: float = 0.0) -> None:
        self.queue.add(key, lambda: self.reconcile(key), after_s)

    async def reconcile(self, key: SliceKey) -> Requeue | None:
        """Act on what is recorded of the slice: realise, release or let go (``agent_step``). Raises on
        an API error, so the queue runs the key again after its back-off; after a conflict (or a 404) the
        slice is read again before the next try, and one deleted meanwhile is let go and done."""
        uid = key[2]
        seen = self.slices.get(uid)
        if seen is None or self._stopped:
            return None
        if not seen.gone and seen.stale:
            seen = await self._read_again(seen)
        if seen.gone:
            await self.releaser.deleted(seen.body)
            self.health.forget(uid)
            if self.usage is not None:
                self.usage.forget(uid)
            self.slices.forget(uid, seen)
            return None
        if seen.version < self.realiser.written.get(uid, 0):
            return None  # the watch brings the agent's own newer write, and its key runs again then
        try:
            return await self._act(seen.body)
        except ApiError as exc:
            metrics.RECONCILE_ERRORS.labels("agent", "api").inc()
            if exc.conflict or exc.not_found:
                self.slices.mark_stale(uid)  # the next try acts on the slice as the API server has it
            raise

    async def _read_again(self, seen: SeenSlice) -> SeenSlice:
        """The slice as the API server has it now (gone: recorded as gone)."""
        meta = seen.body["metadata"]
        try:
            fresh = slice_body(await self.client.get(slice_path(meta["namespace"], meta["name"])))
        except ApiError as exc:
            if not exc.not_found:
                raise
            fresh = None
        if fresh is None or fresh["metadata"].get("uid") != meta["uid"]:
            self.slices.take(seen.body, gone=True)
        else:
            self.slices.take(fresh)
        return self.slices.get(meta["uid"]) or seen

    async def _act(self, body: Mapping) -> Requeue | None:
        meta = body["metadata"]
        uid = meta["uid"]
        self.health.saw_slice(uid, body)
        entry = self.store.record.owners.get(uid)
        was_offered = self.realiser.offers(uid)
        self.realiser.saw(uid, (body.get("status") or {}).get("phase") == READY and not meta.get("deletionTimestamp"))
        now_offered = self.realiser.offers(uid)
        if now_offered != was_offered:
            self.schedule_publish(at_once=now_offered)
        step = agent_step(
            (body.get("status") or {}).get("phase"), bool(meta.get("deletionTimestamp")),
            AGENT_FINALIZER in (meta.get("finalizers") or ()), entry,
        )
        if step == RELEASE:
            again = await self.releaser.release(body)
            return Requeue(again) if again is not None else None
        if step == REALISE:
            await self.realiser.realise(body)
        elif step == FORGET:
            await self.realiser.let_go(uid)
        return None


__all__ = ["AgentSettings", "NodeAgent", "OwnerRecord"]
