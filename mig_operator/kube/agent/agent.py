"""The node agent: realises the slices bound to its node, releases them, and publishes its GpuNode.

It is the only part that touches the GPUs. Decisions come from ``core.lifecycle`` (what to do with a
slice event, which instance to use, what to adopt on start); this module reads state, calls them,
and carries the result out in this order, so that a crash anywhere leaves an intent to finish or an
idle instance, never a leak or a device serving two slices:

1. record the intent (owner record ``started``), and write ``phase: Creating`` before any NVML call;
2. destroy the reclaim set (each only if the record gives it to no slice and NVML reports no process),
   then reuse, complete or create the instance;
3. record the device (``completed``), then write ``phase: Ready``.

Release marks the instance idle in the record, then removes the agent's finalizer; nothing is
destroyed until its space is needed or ``--idle-timeout`` passes. Nothing is released while in use:
a deleted slice whose ResourceClaim is reserved for a pod or prepared here (``core.lifecycle.
claim_hold``) keeps its finalizer, so its binding, its GPU room and its quota charge stay, and says
so (condition Released=False, reason InUse). It is looked at again when the kubelet unprepares a
claim on it, and on a timer while it is held (``release_recheck_s``, doubling up to
``release_recheck_max_s`` while nothing changes): one GET of its claim each time, and only for such
slices, rather than a cluster-wide watch of ResourceClaims in every agent. GPU calls run in worker threads
(a create can take seconds); one asyncio lock per GPU serialises the NVML changes on each GPU. A
reuse makes none and is handed over at once, never waiting behind a create; an instance claimed by
one slice's step (a reuse, or a create's reclaim) is never taken by another's until it is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from mig_operator.core.cluster import (
    MODE_FRACTION,
    MODE_MIG,
    Binding,
    InstanceState,
    binding_from_status,
    describe_binding,
)
from mig_operator.core.device_plugin import CONDITION_TYPE, DevicePluginCheck, check_node
from mig_operator.core.lifecycle import (
    COMPLETED,
    CREATING,
    FORGET,
    IN_USE,
    READY,
    REALISE,
    RELEASE,
    STARTED,
    Blocked,
    ClaimHold,
    MigSteps,
    OwnerEntry,
    OwnerRecord,
    adopt,
    agent_step,
    claim_hold,
    idle_instances,
    plan_mig,
)
from mig_operator.core.quantities import MIB, format_bytes
from mig_operator.gpu.protocol import GpuBackend, GpuError, GpuInfo, MigInstance

from ..common import metrics, status
from ..common.client import (
    ApiError,
    KubeClient,
    gpunode_path,
    gpunodes_path,
    resource_version,
    slice_path,
    slices_path,
)
from ..common.events import EventPoster
from ..common.faults import crashpoint
from ..common.finalizers import remove_finalizer
from ..common.names import AGENT_FINALIZER, API_VERSION, MIG_NODE_LABEL, MIG_NODE_VALUE, NODE_KIND, slices_of_node
from .inventory import RuntimeWatch, gpunode_status, instance_state
from .record import RecordStore, boot_id
from .resource_slice import ResourceSlicePublisher, device_info, resource_claim_path

log = logging.getLogger("mig_operator.agent")
T = TypeVar("T")


@dataclass(frozen=True)
class AgentSettings:
    node: str
    idle_timeout_s: float | None = None  # None: idle instances stay until their space is needed
    nvml_attempts: int = 5  # tries of a transiently failing GPU call before the slice fails
    nvml_first_wait_s: float = 0.2
    # Changes within this window go out in one GpuNode write. The controller never waits for it (its
    # own bindings say what is taken), so it only bounds how stale `kubectl get gn` may look.
    publish_delay_s: float = 1.0
    heartbeat_s: float = 30.0  # GpuNode re-read and re-published at least this often
    toolkit_config: str = ""  # the node's NVIDIA toolkit config.toml, read for RuntimeTrusted ("": not read)
    # A deleted slice kept while its claim is in use is looked at again this often (and at once when
    # the kubelet unprepares a claim on it): the pod's end frees the claim's reservation without an
    # event the agent sees.
    release_recheck_s: float = 2.0
    release_recheck_max_s: float = 30.0  # the re-check's interval doubles up to this while nothing changes


def _gpu_error_reason(error: GpuError) -> str:
    # NVML's name in CamelCase for status.reason (IN_USE -> NvmlInUse); the message keeps NVML_ERROR_IN_USE.
    return "Nvml" + "".join(part.capitalize() for part in error.name.split("_"))


def _is_transient(exc: BaseException) -> bool:
    return (isinstance(exc, GpuError) and exc.transient) or (isinstance(exc, Blocked) and exc.transient)


class NodeAgent:
    """One node's agent; ``start`` adopts what exists, ``handle`` takes each slice event."""

    def __init__(self, settings: AgentSettings, backend: GpuBackend, store: RecordStore, client: KubeClient,
                 events: EventPoster) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.client = client
        self.events = events
        self._gpu_locks: dict[int, asyncio.Lock] = {}
        self._gpus: list[GpuInfo] = []
        self._labelled = False
        self._node_uid = ""
        # Whether NVIDIA's device plugin advertises this node's GPUs too (its Node's capacity), and
        # when that last changed: the GpuNode's DevicePluginConflict condition.
        self._device_plugin = DevicePluginCheck(settings.node)
        self._device_plugin_since: str | None = None
        self._conflict_reported = False  # a Warning Event about it was posted and not yet answered
        self._publish_pending: asyncio.Task | None = None
        self._publish_again = False  # a change arrived while a publish was under way
        self._publish_now = asyncio.Event()  # set: the next publish skips (or cuts short) its coalescing delay
        # One ResourceSlice write at a time (a read, then a PUT with its resourceVersion).
        self._devices_lock = asyncio.Lock()
        # Slices realised whose Ready write is under way: their device is published first, and their
        # own older events (still Creating) must not take it out again.
        self._announcing: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._written: dict[str, int] = {}  # slice UID -> resourceVersion of the agent's last write
        # (GPU, GI id) -> the slice whose step holds the instance until that step is recorded: a
        # reuse and a create's reclaim on one GPU never take the same instance.
        self._claims: dict[tuple[int, int], str] = {}
        # Slices Ready on this node and not being deleted: the devices of the node's ResourceSlice.
        self._ready: set[str] = set()
        self._slot_models: dict[str, str] = {}  # GPU index -> the model label of its mig_operator_slots series
        # Deleted slices kept while their claim is in use: uid -> (the latest body seen, the Released
        # message last written); one release of a slice at a time (events, unprepare and the re-check).
        self._holding: dict[str, tuple[Mapping, str]] = {}
        self._release_locks: dict[str, asyncio.Lock] = {}
        self._recheck: asyncio.Task | None = None
        self._due: dict[str, tuple[float, float]] = {}  # held slice uid -> (next re-check, interval)
        self._kicks: set[asyncio.Task] = set()
        self.resource_slice = ResourceSlicePublisher(client, settings.node)
        self.runtime = RuntimeWatch(settings.node, settings.toolkit_config) if settings.toolkit_config else None

    # ---- what the kubelet plugin asks (kubelet_plugin.SliceHolder) --------------------------------

    @property
    def node(self) -> str:
        return self.settings.node

    def ready_entry(self, slice_uid: str) -> OwnerEntry | None:
        entry = self.store.record.owners.get(slice_uid)
        if (entry is None or entry.state != COMPLETED or slice_uid not in self._ready
                or slice_uid in self.store.revoked or not entry.device_uuid):
            return None
        return entry

    def gpu_minor(self, gpu_index: int) -> int | None:
        return next((g.minor for g in self._gpus if g.index == gpu_index), None)

    def gpu_memory_bytes(self, gpu_index: int) -> int | None:
        return next((g.memory_mib * MIB for g in self._gpus if g.index == gpu_index), None)

    async def device_root(self) -> str:
        return await self._gpu("device_root", self.backend.device_root)

    async def claim_released(self, slice_uid: str) -> None:
        """The kubelet unprepared a claim on the slice: a slice deleted meanwhile lets its instance go
        now that no claim holds it (DESIGN: never reused while a claim on it is prepared)."""
        held = self._holding.get(slice_uid)
        if held is not None:
            self._due.pop(slice_uid, None)  # its next re-checks come soon again
            # Looked at again now, outside the kubelet's call (its claim's reservation may go later).
            task = asyncio.create_task(self._release_quietly(held[0]), name="release-after-unprepare")
            self._kicks.add(task)
            task.add_done_callback(self._kicks.discard)
        if slice_uid in self.store.revoked and not self.store.claims_on(slice_uid):
            entry = self.store.record.owners.get(slice_uid)
            if entry is not None:
                self._log_release(entry)
            await asyncio.to_thread(self.store.drop, slice_uid, status.now())
            self.schedule_publish()

    async def _let_go(self, uid: str) -> None:
        """The slice is gone or failed: its instance becomes idle, unless a prepared claim holds it
        (then it stays the slice's, held and offered to nobody, until the kubelet unprepares it)."""
        self._ready.discard(uid)
        if self.store.claims_on(uid):
            if uid not in self.store.revoked:
                entry = self.store.record.owners.get(uid)
                log.info("slice %s is gone while its claim is prepared: %s stays held until the kubelet "
                         "unprepares it", entry.slice if entry else uid, entry.device_uuid if entry else "")
                await asyncio.to_thread(self.store.revoke, uid)
        else:
            await asyncio.to_thread(self.store.drop, uid, status.now())
        self.schedule_publish()

    # ---- GPU calls, measured and off the event loop ----------------------------------------------

    async def _gpu(self, call: str, fn: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args)
        except GpuError as exc:
            metrics.NVML_ERRORS.labels(call, exc.name).inc()
            raise
        finally:
            metrics.NVML_SECONDS.labels(call).observe(time.perf_counter() - started)

    async def _retrying(self, what: Callable[[], Awaitable[T]]) -> T:
        """``what`` again while it fails transiently (NVML IN_USE, TIMEOUT, a process still on an instance)."""
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.settings.nvml_attempts),
            wait=wait_exponential(multiplier=self.settings.nvml_first_wait_s, max=5.0),
            retry=retry_if_exception(_is_transient),
            reraise=True,
        ):
            with attempt:
                return await what()
        raise AssertionError("unreachable: tenacity reraises")

    def _lock(self, gpu: int) -> asyncio.Lock:
        return self._gpu_locks.setdefault(gpu, asyncio.Lock())

    async def _instances(self, gpu: GpuInfo) -> list[MigInstance]:
        return await self._gpu("instances", self.backend.instances, gpu.index) if gpu.mig_enabled else []

    # ---- start -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the GPUs and the node, adopt what exists, complete half-made instances, publish.

        Nothing is destroyed on start: an instance that matches neither the record nor a live
        slice's binding becomes idle, to be reused or reclaimed later.
        """
        self._gpus = await self._gpu("gpus", self.backend.gpus)
        await self._read_node()
        slices = await self.client.list(slices_path(), field_selector=slices_of_node(self.settings.node))
        bindings: dict[str, Binding] = {}
        for body in slices:
            binding = binding_from_status(body["metadata"]["uid"], body.get("status"))
            if binding is not None and binding.node == self.settings.node:
                bindings[body["metadata"]["uid"]] = binding
        found: dict[int, list] = {}
        for gpu in self._gpus:
            found[gpu.index] = [instance_state(i) for i in await self._instances(gpu)]
        adoption = adopt(self.store.record, boot_id(), found, bindings)
        since = status.now()
        record = adoption.record
        names = {b["metadata"]["uid"]: f"{b['metadata']['namespace']}/{b['metadata']['name']}" for b in slices}
        owners = {uid: (replace(e, slice=names.get(uid, e.slice)) if not e.slice else e)
                  for uid, e in record.owners.items()}
        # A slice gone while a claim on it is prepared keeps its instance until the kubelet unprepares
        # the claim, across restarts too: adoption dropped its entry (no live slice), so it comes back.
        held = {c.slice_uid for c in self.store.prepared.values()}
        kept = {uid: e for uid, e in self.store.record.owners.items() if uid in held and uid not in owners}
        owners.update(kept)
        record = replace(record, owners=owners)
        revoke = [uid for uid in held if uid in owners and uid not in bindings]
        # Idle instances found on start count as idle from now (for the idle time-out).
        idle = dict(record.idle_since)
        for gpu, insts in found.items():
            for inst in idle_instances(record, gpu, insts):
                if inst.device_uuid:
                    idle.setdefault(inst.device_uuid, since)
        record = replace(record, idle_since=idle)
        await asyncio.to_thread(self.store.update, lambda _old: record)
        for uid in revoke:
            await asyncio.to_thread(self.store.revoke, uid)
        self._ready = {b["metadata"]["uid"] for b in slices
                       if (b.get("status") or {}).get("phase") == READY and not b["metadata"].get("deletionTimestamp")
                       and b["metadata"]["uid"] in bindings}
        for gpu, inst in adoption.incomplete:
            # A GPU instance without its compute instance: complete it so that it can be handed out.
            try:
                await self._gpu("create_compute_instance", self.backend.create_compute_instance, gpu, inst.gi_id)
            except GpuError as exc:
                log.warning("cannot complete half-made GPU instance %s on GPU %s: %s", inst.gi_id, gpu, exc)
        log.info("agent for node %s started: %d GPU(s), adopted %d, dropped %d, completed %d", self.settings.node,
                 len(self._gpus), len(adoption.adopted), len(adoption.dropped), len(adoption.incomplete))
        await self._read_runtime()
        await self.publish()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="gpunode-heartbeat"))
        if self.settings.idle_timeout_s is not None:
            self._tasks.append(asyncio.create_task(self._reap_idle(), name="idle-reaper"))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._kicks, *([self._publish_pending] if self._publish_pending else []),
                     *([self._recheck] if self._recheck else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _read_node(self) -> None:
        try:
            node = await self.client.get(f"/api/v1/nodes/{self.settings.node}")
        except ApiError as exc:
            if not exc.not_found:
                raise
            self._labelled, self._node_uid = False, ""
            self._take_device_plugin(DevicePluginCheck(self.settings.node))
            return
        self._take_node(node)

    async def _read_runtime(self) -> None:
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.read, status.now())

    def _take_node(self, node: Mapping) -> bool:
        """Note the node's MIG label, UID and device plugin resources; True when the label or what the
        GpuNode says about the device plugin changed."""
        labelled = (node["metadata"].get("labels") or {}).get(MIG_NODE_LABEL) == MIG_NODE_VALUE
        changed = labelled != self._labelled
        self._labelled, self._node_uid = labelled, node["metadata"]["uid"]
        return self._take_device_plugin(check_node(self.settings.node, node)) or changed

    def _take_device_plugin(self, check: DevicePluginCheck) -> bool:
        """Note the device plugin check of the Node; True when it changed (the GpuNode says so at once)."""
        if check == self._device_plugin and self._device_plugin_since is not None:
            return False
        before = self._device_plugin
        if check.conflict != before.conflict or self._device_plugin_since is None:
            self._device_plugin_since = status.now()
        self._device_plugin = check
        if check.conflict:
            log.warning("%s", check.message)
        elif before.conflict:
            log.info("node %s: device plugin conflict resolved (%s)", self.settings.node, check.reason)
        return True

    def node_changed(self, node: Mapping) -> None:
        """A watch event of this agent's own Node: a changed MIG label changes what every GPU serves,
        so the GpuNode says so at once, not at the next heartbeat (30 s)."""
        known, labelled = self._node_uid, self._labelled
        changed = self._take_node(node)
        if labelled != self._labelled:
            log.info("node %s is %s for MIG now", self.settings.node, "labelled" if self._labelled else "not labelled")
        if self._node_uid != known:  # a Node of this name again: its GpuNode is written anew
            self.resource_slice.forget()
        if changed or self._node_uid != known:
            self.schedule_publish(at_once=True)

    def node_deleted(self) -> None:
        """This agent's Node is gone: the garbage collector removes its GpuNode (owned by the Node), and
        none is written again until a Node of this name exists (``node_changed``)."""
        log.warning("node %s was deleted: its GpuNode goes with it", self.settings.node)
        self._labelled, self._node_uid = False, ""
        self._take_device_plugin(DevicePluginCheck(self.settings.node))
        self.resource_slice.forget()

    # ---- slice events ------------------------------------------------------------------------------

    async def handle(self, body: Mapping) -> None:
        """One watch event of a slice bound to this node.

        An event older than the agent's own last write of that slice is skipped: it may still say
        Creating after the agent wrote Failed, and acting on it would realise the slice twice.
        """
        meta = body["metadata"]
        uid = meta["uid"]
        if resource_version(meta) < self._written.get(uid, 0):
            return
        entry = self.store.record.owners.get(uid)
        phase_ready = (body.get("status") or {}).get("phase") == READY and not meta.get("deletionTimestamp")
        if phase_ready and entry is not None and entry.state == COMPLETED and uid not in self._ready:
            self._ready.add(uid)
            self.schedule_publish(at_once=True)
        elif not phase_ready and uid in self._ready and uid not in self._announcing:
            self._ready.discard(uid)
            self.schedule_publish()
        step = agent_step(
            (body.get("status") or {}).get("phase"), bool(meta.get("deletionTimestamp")),
            AGENT_FINALIZER in (meta.get("finalizers") or ()), entry,
        )
        try:
            if step == RELEASE:
                await self._release(body)
            elif step == REALISE:
                await self._realise(body)
            elif step == FORGET:
                await self._let_go(uid)
        except ApiError as exc:
            if exc.not_found:
                return  # deleted meanwhile: its deletion event releases it
            metrics.RECONCILE_ERRORS.labels("agent", "api").inc()
            raise

    async def deleted(self, body: Mapping) -> None:
        """The slice is gone. Normally its release already ran (the finalizer held it); if the
        finalizer was removed by hand, its instance becomes idle now."""
        self._written.pop(body["metadata"]["uid"], None)
        self._holding.pop(body["metadata"]["uid"], None)
        self._ready.discard(body["metadata"]["uid"])
        if body["metadata"]["uid"] in self.store.record.owners:
            if body["metadata"]["uid"] not in self.store.revoked:
                self._log_release(self.store.record.owners[body["metadata"]["uid"]])
            await self._let_go(body["metadata"]["uid"])

    async def _realise(self, body: Mapping) -> None:
        meta, current = body["metadata"], body.get("status") or {}
        uid, ref = meta["uid"], f"{meta['namespace']}/{meta['name']}"
        binding = binding_from_status(uid, current)
        if binding is None or binding.node != self.settings.node:
            return
        started = time.perf_counter()
        gpu = next((g for g in self._gpus if g.index == binding.gpu), None)
        try:
            if gpu is None:
                raise Blocked(f"node {self.settings.node} has no GPU {binding.gpu}", transient=False)
            if binding.mode == MODE_FRACTION:
                action, ready = await self._realise_fraction(uid, ref, binding, gpu)
            else:
                action, ready = await self._realise_mig(uid, ref, binding, body)
        except GpuError as exc:
            await self._fail(body, _gpu_error_reason(exc), f"{describe_binding(binding)}: {exc}")
            return
        except Blocked as exc:
            await self._fail(body, "InUse" if exc.transient else "Conflict", exc.message)
            return
        # The device is in the ResourceSlice before the slice says Ready (the pod's claim already
        # exists: kube-scheduler can allocate it the moment the pod is ungated, with no event to wait
        # for); the GpuNode, which needs the GPUs read again, follows at once (a full publish before
        # Ready cost a new instance more than the controller's wait for it: measured, docs/benchmarks.md).
        self._ready.add(uid)
        self._announcing.add(uid)
        try:
            async with self._devices_lock:
                await self.publish_devices()
            await self._write_status(body, ready)
        except BaseException:
            self._ready.discard(uid)
            self.schedule_publish()
            raise
        finally:
            self._announcing.discard(uid)
        log.info("slice %s ready: %s", ref, ready["message"])
        metrics.REALISE_SECONDS.labels(action).observe(time.perf_counter() - started)
        # The controller hands a device on once the GpuNode lists it: a new instance's must go out at
        # once; a reused instance (listed idle) and a fraction's GPU are listed already, so their
        # change joins the next coalesced publish (a GpuNode write costs kube-apiserver about ten
        # times a slice's status write: docs/benchmarks.md).
        self.schedule_publish(at_once=action == "create")

    async def _realise_fraction(self, uid: str, ref: str, binding: Binding, gpu: GpuInfo) -> tuple[str, dict]:
        if gpu.mig_enabled:
            raise Blocked(f"GPU {gpu.index} of {self.settings.node} is in MIG mode; it takes no fractions",
                          transient=False)
        others = sum(e.granted_bytes for e in self.store.record.owners.values()
                     if e.mode == MODE_FRACTION and e.gpu == gpu.index and e.uid != uid)
        if others + binding.granted_bytes > gpu.memory_mib * 2**20:
            raise Blocked(
                f"GPU {gpu.index} of {self.settings.node} has {format_bytes(gpu.memory_mib * 2**20 - others)} "
                f"left for fractions, not {format_bytes(binding.granted_bytes)}", transient=False,
            )
        entry = OwnerEntry(uid, ref, MODE_FRACTION, gpu.index, COMPLETED, binding.granted_bytes,
                           device_uuid=gpu.uuid)
        await asyncio.to_thread(self.store.put, entry)
        message = f"{describe_binding(binding)} ({gpu.uuid}), enforced by libgpuslice"
        return "fraction", status.ready(None, gpu.uuid, binding.granted_bytes, False, message,
                                        claim=ref.rpartition("/")[2])

    async def _realise_mig(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict]:
        """A reuse (or a resume after a crash) is handed over at once: it makes no NVML call, so it must
        not wait behind a create of seconds on the same GPU. Anything else runs under the GPU's lock,
        retried while it fails transiently."""
        handed = await self._hand_over(uid, ref, binding, body)
        if handed is not None:
            return handed
        async with self._lock(binding.gpu):
            return await self._retrying(lambda: self._realise_mig_locked(uid, ref, binding, body))

    def _claim(self, uid: str, gpu: int, instances: list[InstanceState]) -> list[tuple[int, int]] | None:
        """Claim instances for slice ``uid`` until its step is recorded; None if another slice's step
        holds one of them. Synchronous, so the check and the claim happen with no await between."""
        keys = [(gpu, inst.gi_id) for inst in instances]
        if any(self._claims.get(key, uid) != uid for key in keys):
            return None
        for key in keys:
            self._claims[key] = uid
        return keys

    def _unclaim(self, uid: str, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            if self._claims.get(key) == uid:
                del self._claims[key]

    async def _hand_over(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict] | None:
        instances = [instance_state(i) for i in await self._gpu("instances", self.backend.instances, binding.gpu)]
        try:
            steps = plan_mig(uid, binding, instances, self.store.record)
        except Blocked:
            return None  # the locked path decides (and retries) with the same rules
        if steps.action not in ("reuse", "resume") or steps.destroy:
            return None
        assert steps.instance is not None
        keys = self._claim(uid, binding.gpu, [steps.instance])
        if keys is None:
            return None
        try:
            entry = self.store.record.owners.get(uid)
            reused = entry.reused if entry is not None and entry.state == STARTED else steps.action == "reuse"
            return await self._finish(uid, ref, binding, body, _as_mig(binding.gpu, steps.instance), reused)
        finally:
            self._unclaim(uid, keys)

    async def _realise_mig_locked(self, uid: str, ref: str, binding: Binding, body: Mapping) -> tuple[str, dict]:
        gpu = binding.gpu
        instances = [instance_state(i) for i in await self._gpu("instances", self.backend.instances, gpu)]
        record = self.store.record
        steps = plan_mig(uid, binding, instances, record)
        keys = self._claim(uid, gpu, [*steps.destroy, *([steps.instance] if steps.instance else [])])
        if keys is None:
            raise Blocked(f"an instance at {describe_binding(binding)} is being handed to another slice",
                          transient=True)
        try:
            return await self._carry_out(uid, ref, binding, body, steps, record)
        finally:
            self._unclaim(uid, keys)

    async def _carry_out(self, uid: str, ref: str, binding: Binding, body: Mapping, steps: MigSteps,
                         record: OwnerRecord) -> tuple[str, dict]:
        gpu = binding.gpu
        entry = record.owners.get(uid)
        reused = entry.reused if entry is not None and entry.state == STARTED else steps.action == "reuse"
        base = OwnerEntry(uid, ref, MODE_MIG, gpu, STARTED, binding.granted_bytes, binding.profile_id,
                          binding.profile, binding.start, binding.size, reused=reused)
        if steps.needs_nvml:
            if entry is None or entry.state != STARTED:
                await asyncio.to_thread(self.store.put, base)
            if (body.get("status") or {}).get("phase") != CREATING:
                what = "creating" if steps.action == "create" else "completing"
                reclaim = f" after reclaiming {len(steps.destroy)} idle instance(s)" if steps.destroy else ""
                await self._write_status(body, status.creating(body.get("status"),
                                                               f"{what} {describe_binding(binding)}{reclaim}"))
                log.info("slice %s: %s %s%s", ref, what, describe_binding(binding), reclaim)
            crashpoint("agent:after-intent")
        for n, victim in enumerate(steps.destroy):
            await self._gpu("destroy_instance", self.backend.destroy_instance, gpu, victim.gi_id)
            log.info("slice %s: reclaimed idle %s (%s) to make room", ref,
                     _describe_instance(self.settings.node, gpu, victim), victim.device_uuid or "no device")
            if victim.device_uuid:
                await asyncio.to_thread(self.store.update, lambda r, u=victim.device_uuid: replace(
                    r, idle_since={k: v for k, v in r.idle_since.items() if k != u}))
            if n == 0:
                crashpoint("agent:during-reclaim")
        if steps.action == "create":
            try:
                made = await self._gpu("create_instance", self.backend.create_instance, gpu, binding.profile_id,
                                       binding.start)
            except GpuError:
                await self._clear_half_made(gpu, binding)
                raise
            crashpoint("agent:after-create")
        elif steps.action == "complete":
            assert steps.instance is not None
            made = await self._gpu("create_compute_instance", self.backend.create_compute_instance, gpu,
                                   steps.instance.gi_id)
        else:
            assert steps.instance is not None
            made = _as_mig(gpu, steps.instance)
        return await self._finish(uid, ref, binding, body, made, reused)

    async def _finish(self, uid: str, ref: str, binding: Binding, body: Mapping, made: MigInstance,
                      reused: bool) -> tuple[str, dict]:
        """Record the device as the slice's (the record is the authority from here on), then say Ready."""
        done = OwnerEntry(uid, ref, MODE_MIG, binding.gpu, COMPLETED, binding.granted_bytes, binding.profile_id,
                          binding.profile, binding.start, binding.size, made.gi_id, made.ci_id, made.device_uuid,
                          reused)
        await asyncio.to_thread(self.store.put, done)
        verb = "reused idle" if reused else "created"
        message = f"{verb} {describe_binding(binding)}: {made.device_uuid}"
        ready = status.ready(body.get("status"), made.device_uuid, binding.granted_bytes, reused, message,
                             gi_id=made.gi_id, ci_id=made.ci_id, claim=ref.rpartition("/")[2])
        return ("reuse" if reused else "create"), ready

    async def _clear_half_made(self, gpu: int, binding: Binding) -> None:
        """After a failed create, destroy what it left at the placement (a GI without its CI), if anything."""
        try:
            for inst in await self._gpu("instances", self.backend.instances, gpu):
                if inst.start == binding.start and inst.profile_id == binding.profile_id and inst.ci_id < 0:
                    await self._gpu("destroy_instance", self.backend.destroy_instance, gpu, inst.gi_id)
        except GpuError as exc:
            log.warning("half-made instance at %s on GPU %s stays until the next attempt: %s",
                        binding.start, gpu, exc)

    async def _fail(self, body: Mapping, reason: str, message: str) -> None:
        meta = body["metadata"]
        log.warning("slice %s/%s failed: %s", meta["namespace"], meta["name"], message)
        metrics.RECONCILE_ERRORS.labels("agent", reason).inc()
        await self._let_go(meta["uid"])
        await self._write_status(body, status.failed(body.get("status"), reason, message))
        self.events.post(body, "Warning", reason, message)
        self.schedule_publish()

    async def _write_status(self, body: Mapping, new_status: dict) -> None:
        meta = body["metadata"]
        answer = await self.client.merge_patch(slice_path(meta["namespace"], meta["name"], status=True),
                                               {"status": new_status})
        self._written[meta["uid"]] = resource_version(answer.get("metadata") or {})

    async def _release(self, body: Mapping) -> None:
        """The slice is being deleted: unless its claim is in use (then it is kept as it is and says
        so), its instance becomes idle, then the finalizer goes."""
        meta = body["metadata"]
        uid = meta["uid"]
        lock = self._release_locks.setdefault(uid, asyncio.Lock())
        try:
            async with lock:
                self._ready.discard(uid)
                if uid in self.store.record.owners:
                    hold = await self._claim_hold(body)
                    if not hold.free:
                        await self._hold(body, hold)
                        return
                self._holding.pop(uid, None)
                if uid in self.store.record.owners:
                    if not self.store.claims_on(uid):
                        self._log_release(self.store.record.owners[uid])
                    await self._let_go(uid)
                crashpoint("agent:during-release")
                await remove_finalizer(self.client, slice_path(meta["namespace"], meta["name"]), body,
                                       AGENT_FINALIZER)
        finally:
            if not lock.locked() and self._release_locks.get(uid) is lock:
                del self._release_locks[uid]

    async def _claim_hold(self, body: Mapping) -> ClaimHold:
        """Who holds the slice's claim: its reservations (the API server's claim of the slice's name)
        and the claims prepared here on its device (the record)."""
        meta = body["metadata"]
        try:
            claim = await self.client.get(resource_claim_path(meta["namespace"], meta["name"]))
        except ApiError as exc:
            if not exc.not_found:
                raise
            claim = None
        prepared = [f"{c.namespace}/{c.name}" for c in self.store.claims_on(meta["uid"])]
        return claim_hold(meta["uid"], claim, prepared)

    async def _hold(self, body: Mapping, hold: ClaimHold) -> None:
        """Keep a deleted slice whose claim is in use: the finalizer stays; its status says who holds it."""
        meta = body["metadata"]
        uid = meta["uid"]
        message = hold.message(self.settings.node)
        _, written = self._holding.get(uid, (body, ""))
        shown = status.released_condition(body.get("status"))
        self._holding[uid] = (body, written)
        if written != message and not (shown is not None and shown.get("status") == "False"
                                        and shown.get("message") == message):
            await self._write_status(body, status.held_in_use(body.get("status"), message))
            self._holding[uid] = (body, message)
            self.events.post(body, "Normal", IN_USE, message)
            log.info("slice %s/%s is deleted but kept: %s", meta["namespace"], meta["name"], message)
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.create_task(self._recheck_holds(), name="release-recheck")

    async def _recheck_holds(self) -> None:
        first = self.settings.release_recheck_s
        while self._holding:
            await asyncio.sleep(first)
            now = time.monotonic()
            for uid, (body, _) in list(self._holding.items()):
                due, interval = self._due.setdefault(uid, (now, first))
                if due > now:
                    continue
                await self._release_quietly(body)
                if uid in self._holding:
                    interval = min(interval * 2, self.settings.release_recheck_max_s)
                    self._due[uid] = (time.monotonic() + interval, interval)
            for uid in [u for u in self._due if u not in self._holding]:
                del self._due[uid]

    async def _release_quietly(self, body: Mapping) -> None:
        try:
            await self._release(body)
        except ApiError as exc:
            if exc.not_found:
                self._holding.pop(body["metadata"]["uid"], None)
            else:
                log.warning("slice %s/%s kept for its claim: looking again failed, retried: %s",
                            body["metadata"]["namespace"], body["metadata"]["name"], exc)

    def _log_release(self, entry: OwnerEntry) -> None:
        if entry.mode == MODE_MIG:
            where = Binding(entry.uid, self.settings.node, entry.gpu, MODE_MIG, entry.granted_bytes, entry.profile_id,
                            entry.profile, entry.start, entry.size)
            if entry.device_uuid:
                log.info("slice %s released: %s stays as an idle instance (%s)", entry.slice,
                         describe_binding(where), entry.device_uuid)
            else:
                log.info("slice %s released before its instance %s was made", entry.slice, describe_binding(where))
        else:
            where = Binding(entry.uid, self.settings.node, entry.gpu, entry.mode, entry.granted_bytes)
            log.info("slice %s released: its %s is free", entry.slice, describe_binding(where))

    # ---- idle time-out -----------------------------------------------------------------------------

    async def _reap_idle(self) -> None:
        assert self.settings.idle_timeout_s is not None
        period = max(0.5, min(30.0, self.settings.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap_idle_once()
            except (GpuError, ApiError, OSError) as exc:
                log.warning("idle time-out pass failed: %s", exc)

    async def reap_idle_once(self) -> int:
        """Destroy idle instances idle for longer than the time-out; never one in use. Returns how many."""
        assert self.settings.idle_timeout_s is not None
        limit = datetime.now(UTC) - timedelta(seconds=self.settings.idle_timeout_s)
        destroyed = 0
        for gpu in self._gpus:
            if not gpu.mig_enabled:
                continue
            async with self._lock(gpu.index):
                insts = [instance_state(i) for i in await self._instances(gpu)]
                for inst in idle_instances(self.store.record, gpu.index, insts):
                    since = self.store.record.idle_since.get(inst.device_uuid)
                    if inst.in_use or not since or _parse_time(since) > limit:
                        continue
                    await self._gpu("destroy_instance", self.backend.destroy_instance, gpu.index, inst.gi_id)
                    log.info("reclaimed idle %s (%s): idle since %s, longer than the idle time-out",
                             _describe_instance(self.settings.node, gpu.index, inst), inst.device_uuid, since)
                    await asyncio.to_thread(self.store.update, lambda r, u=inst.device_uuid: replace(
                        r, idle_since={k: v for k, v in r.idle_since.items() if k != u}))
                    destroyed += 1
        if destroyed:
            log.info("idle time-out destroyed %d instance(s)", destroyed)
            self.schedule_publish()
        return destroyed

    # ---- GpuNode -----------------------------------------------------------------------------------

    def schedule_publish(self, at_once: bool = False) -> None:
        """Publish soon; changes within ``publish_delay_s`` share one write. A change that arrives
        while a write is under way gets a write of its own after it (the one under way may have read
        the GPUs and the record before the change: skipping it left the GpuNode stale until the
        heartbeat, up to 30 s). ``at_once``: no coalescing delay (a change people wait to see)."""
        self._publish_again = True
        if at_once:
            self._publish_now.set()  # a publish waiting out its delay goes now, with this change
        if self._publish_pending is None or self._publish_pending.done():
            self._publish_pending = asyncio.create_task(self._publish_later(), name="gpunode-publish")

    async def _publish_later(self) -> None:
        while self._publish_again:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), self.settings.publish_delay_s)
            self._publish_now.clear()
            self._publish_again = False
            try:
                await self.publish()
            except (GpuError, ApiError) as exc:
                log.warning("publishing GpuNode %s failed, the heartbeat retries: %s", self.settings.node, exc)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                self._gpus = await self._gpu("gpus", self.backend.gpus)
                await self._read_node()
                await self._read_runtime()
                await self.publish(verify_devices=True)
            except (GpuError, ApiError) as exc:
                log.warning("GpuNode heartbeat failed: %s", exc)

    async def publish(self, verify_devices: bool = False) -> None:
        models: dict[int, Any] = {}
        instances: dict[int, list[MigInstance]] = {}
        for gpu in self._gpus:
            models[gpu.index] = await self._gpu("model", self.backend.model, gpu.index) if gpu.mig_capable else None
            instances[gpu.index] = await self._instances(gpu)
        record = self.store.record
        check = self._device_plugin
        body = gpunode_status(self._gpus, models, instances, record, self._labelled, status.now(),
                              self.store.revoked, check, self._device_plugin_since,
                              self.runtime.condition() if self.runtime is not None else None)
        metrics.DEVICE_PLUGIN_CONFLICT.labels(self.settings.node).set(1 if check.conflict else 0)
        for gpu in body["gpus"]:
            states = {"in_use": 0, "idle": 0}
            for inst in gpu["instances"]:
                states["in_use" if inst["sliceUID"] or inst["inUse"] else "idle"] += 1
            for state, count in states.items():
                metrics.INSTANCES.labels(self.settings.node, str(gpu["index"]), state).set(count)
            metrics.GRANTED_BYTES.labels(self.settings.node, str(gpu["index"])).set(gpu["grantedBytes"])
            self._publish_slots(gpu, models.get(gpu["index"]))
        # Devices first: the controller writes a slice's claim and ungates its pod once the GpuNode lists
        # the device, and kube-scheduler must then find that device in the ResourceSlice already (else
        # the pod is unschedulable until the next ResourceSlice event requeues it).
        async with self._devices_lock:
            await self.publish_devices(verify_devices)
        path = gpunode_path(self.settings.node, status=True)
        try:
            written = await self.client.merge_patch(path, {"status": body})
        except ApiError as exc:
            if not exc.not_found:
                raise
            if not self._node_uid:
                # The Node is gone (the garbage collector removed its GpuNode): publish nothing until a
                # Node of this name exists again, so no inventory outlives its node.
                log.debug("node %s does not exist: its GpuNode is not written", self.settings.node)
                return
            await self._create_gpunode()
            written = await self.client.merge_patch(path, {"status": body})
        self._post_device_plugin_event(written, check)

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

    def _publish_slots(self, gpu: Mapping[str, Any], model: Any) -> None:
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

    def kubelet_registered(self) -> None:
        """The kubelet (re)registered the plugin: it deletes its node's ResourceSlices when it starts,
        so the ResourceSlice is read and written again now rather than at the next heartbeat."""
        self.resource_slice.forget()
        self.schedule_publish(at_once=True)

    async def publish_devices(self, verify: bool = False) -> None:
        """The node's ResourceSlice: one device per slice Ready here (written only when that changes;
        ``verify``: read back even if unchanged here, since the kubelet may have deleted it)."""
        record, revoked = self.store.record, self.store.revoked
        devices = [device_info(e) for uid, e in record.owners.items()
                   if uid in self._ready and uid not in revoked and e.state == COMPLETED and e.device_uuid]
        try:
            await self.resource_slice.publish(devices, self._node_uid, verify=verify)
        except ApiError as exc:
            self.resource_slice.forget()  # written again at the next publish or heartbeat
            log.warning("publishing the ResourceSlice of node %s failed, retried: %s", self.settings.node, exc)

    async def _create_gpunode(self) -> None:
        # Owned by its Node: deleting the Node deletes its inventory (kube-controller-manager's GC).
        meta: dict[str, Any] = {"name": self.settings.node, "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": self.settings.node, "uid": self._node_uid}]}
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


def _as_mig(gpu: int, inst: Any) -> MigInstance:
    return MigInstance(gpu, inst.gi_id, inst.ci_id, inst.profile_id, inst.profile, inst.start, inst.size,
                       inst.device_uuid, inst.in_use)


def _describe_instance(node: str, gpu: int, inst: InstanceState) -> str:
    return f"{inst.profile} at {{{inst.start}}}:{inst.size} on {node} GPU {gpu}"


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


__all__ = ["AgentSettings", "NodeAgent", "OwnerRecord"]
