"""Preparing a claim for the kubelet: the claim checked against the slice this node holds Ready, the
slice's files and CDI spec written, the prepared claim recorded before the answer; and the reverse."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from mig_operator.core.books.claim_owner import claim_refusal
from mig_operator.core.books.slice_claim import claim_path
from mig_operator.core.node.cdi import (
    DRIVER,
    SliceDevice,
    device_id,
    ledger_dir,
    limit_dir,
    slice_spec,
    spec_file_name,
)
from mig_operator.core.node.environment import shim_files
from mig_operator.core.node.health import GpuHealth
from mig_operator.core.node.lifecycle import OwnerEntry
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG
from mig_operator.gpu.device_files import DeviceFileError, device_nodes
from mig_operator.gpu.files import write_atomically
from mig_operator.gpu.mps import MpsDirs

from ...common.client import ApiError, KubeClient
from ..kubeletapi import dra_v1_pb2 as dra
from ..record import PreparedClaim, RecordStore
from .files import find_nvidia_device, make_ledger_dir, remove_slice_dir, write_limit_dir
from .settings import PluginSettings

# How long a prepare waits for a slice being realised here to be Ready (a reuse or a fraction: a
# record write and no GPU call, milliseconds).
REALISE_WAIT_S = 10.0
log = logging.getLogger("mig_operator.agent.kubelet")


class SliceHolder(Protocol):
    """What the plugin needs of the node agent (``NodeAgent`` is one)."""

    @property
    def node(self) -> str: ...

    @property
    def store(self) -> RecordStore: ...

    @property
    def client(self) -> KubeClient: ...

    def ready_entry(self, slice_uid: str) -> OwnerEntry | None:
        """The slice's completed owner entry if it is Ready here and not being taken away."""
        ...

    async def until_ready(self, slice_uid: str, timeout_s: float) -> OwnerEntry | None:
        """``ready_entry`` once the slice's realisation here ends, if it is under way (at most
        ``timeout_s``); None at once for a slice not being realised here."""
        ...

    def gpu_minor(self, gpu_index: int) -> int | None: ...

    def gpu_memory_bytes(self, gpu_index: int) -> int | None: ...

    def mps_dirs(self, gpu_uuid: str) -> MpsDirs | None:
        """The GPU's MPS directories while its control daemon answers, else None."""
        ...

    async def device_root(self) -> str: ...

    async def claim_released(self, slice_uid: str) -> None:
        """A prepared claim on the slice was unprepared (a held instance may go now)."""
        ...

    def kubelet_registered(self) -> None:
        """The kubelet registered the plugin (it may have deleted the node's ResourceSlices)."""
        ...

    def device_health(self) -> list[tuple[str, GpuHealth | None]]:
        """(device name, its GPU's health; None: not read yet) of each device this node's pool holds or held
        for a claim still in use."""
        ...

    async def health_changed(self) -> None:
        """Returns once a GPU's health changes."""
        ...


class PrepareRefused(Exception):
    """One claim cannot be prepared; the message (for the pod's events) names the claim, the device, why."""


def _claim_ref(claim: Any) -> str:
    return f"ResourceClaim {claim.namespace}/{claim.name} (uid {claim.uid})"


class ClaimPreparer:
    """Prepare and unprepare claims for the agent; one call at a time (they share the record)."""

    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.holder = holder
        self.settings = settings
        self._lock = asyncio.Lock()

    async def prepare(self, claims: Sequence[Any]) -> dra.NodePrepareResourcesResponse:
        answer = dra.NodePrepareResourcesResponse()
        async with self._lock:
            for claim in claims:
                try:
                    devices = await self._prepare_one(claim)
                    answer.claims[claim.uid].devices.extend(devices)
                except PrepareRefused as exc:
                    log.warning("refused to prepare %s: %s", _claim_ref(claim), exc)
                    answer.claims[claim.uid].error = str(exc)
                except (ApiError, OSError, DeviceFileError) as exc:
                    log.warning("cannot prepare %s: %s", _claim_ref(claim), exc)
                    answer.claims[claim.uid].error = f"{_claim_ref(claim)}: {exc}"
        return answer

    async def unprepare(self, claims: Sequence[Any]) -> dra.NodeUnprepareResourcesResponse:
        answer = dra.NodeUnprepareResourcesResponse()
        async with self._lock:
            for claim in claims:
                try:
                    await self._unprepare_one(claim)
                    answer.claims[claim.uid].error = ""
                except OSError as exc:
                    answer.claims[claim.uid].error = f"{_claim_ref(claim)}: {exc}"
        return answer

    async def _prepare_one(self, claim: Any) -> list[dra.Device]:
        holder = self.holder
        ref = _claim_ref(claim)
        try:
            body = await holder.client.get(claim_path(claim.namespace, claim.name))
        except ApiError as exc:
            if exc.not_found:
                raise PrepareRefused(f"{ref} does not exist") from None
            raise
        if body["metadata"].get("uid") != claim.uid:
            raise PrepareRefused(f"{ref}: the API server's claim of that name has uid "
                                 f"{body['metadata'].get('uid')}, another claim")
        results = [r for r in ((((body.get("status") or {}).get("allocation") or {}).get("devices") or {})
                               .get("results") or []) if r.get("driver") == DRIVER]
        if not results:
            raise PrepareRefused(f"{ref} has no device of driver {DRIVER} allocated")
        devices: list[dra.Device] = []
        for result in results:
            name, pool = str(result.get("device", "")), str(result.get("pool", ""))
            where = f"device {DRIVER}/{pool}/{name}"
            if pool != holder.node:
                raise PrepareRefused(f"{ref}: {where} is in pool {pool!r}, not this node's ({holder.node})")
            entry = holder.ready_entry(name)
            if entry is None and any(c.claim_uid == claim.uid for c in holder.store.claims_on(name)):
                # Prepared before (the kubelet asks again): the instance is still held for this claim,
                # even if its slice has gone since.
                entry = holder.store.record.owners.get(name)
            if entry is None:
                # A pod whose device needs no NVML call is let go at its slice's binding, so the
                # kubelet may ask while the slice is still being realised here: that takes no GPU call.
                entry = await holder.until_ready(name, REALISE_WAIT_S)
            if entry is None:
                raise PrepareRefused(f"{ref}: {where} is not a slice Ready on node {holder.node} "
                                     "(deleted, failed, not yet Ready, or bound elsewhere)")
            refusal = claim_refusal(body["metadata"], name, entry.slice)
            if refusal is not None:
                raise PrepareRefused(f"{ref}: {where} {refusal}")
            others = [c for c in holder.store.claims_on(name) if c.claim_uid != claim.uid]
            if others:
                other = others[0]
                raise PrepareRefused(f"{ref}: {where} (slice {entry.slice}) is already prepared for "
                                     f"ResourceClaim {other.namespace}/{other.name} (uid {other.claim_uid})")
            ids = await self._write_spec(ref, where, entry)
            devices.append(dra.Device(request_names=[str(result.get("request", ""))], pool_name=pool,
                                      device_name=name, cdi_device_ids=ids))
        # Recorded before answering: from here on the instance stays until the claim is unprepared.
        for device in devices:
            await asyncio.to_thread(holder.store.put_prepared,
                                    PreparedClaim(claim.uid, claim.namespace, claim.name, device.device_name))
        log.info("prepared %s: %s", ref, ", ".join(i for d in devices for i in d.cdi_device_ids))
        return devices

    async def _write_spec(self, ref: str, where: str, entry: OwnerEntry) -> list[str]:
        minor = self.holder.gpu_minor(entry.gpu)
        if minor is None or minor < 0:
            raise PrepareRefused(f"{ref}: {where}: GPU {entry.gpu} of node {self.holder.node} has no device minor")
        root = await self.holder.device_root()
        try:
            if entry.mode == MODE_MIG:
                nodes = device_nodes(root, minor, entry.gi_id, entry.ci_id)
            else:
                nodes = device_nodes(root, minor)
        except DeviceFileError as exc:
            raise PrepareRefused(f"{ref}: {where}: {exc}") from None
        namespace, _, name = entry.slice.partition("/")
        memory = self.holder.gpu_memory_bytes(entry.gpu)
        whole = entry.mode == MODE_FRACTION and memory is not None and entry.granted_bytes >= memory
        pipe = shm = ""
        if entry.compute is not None:  # an MPS client: its GPU's daemon must answer before it starts
            mps = self.holder.mps_dirs(entry.device_uuid)
            if mps is None:
                raise PrepareRefused(f"{ref}: {where}: the MPS control daemon of GPU {entry.gpu} "
                                     f"({entry.device_uuid}) on node {self.holder.node} is not running "
                                     "(GpuNode condition MPSReady)")
            pipe, shm = mps.pipe, mps.shm
        spec = slice_spec(SliceDevice(entry.uid, namespace, name, entry.mode, entry.device_uuid, entry.granted_bytes,
                                      tuple(nodes), self.settings.shim_host_dir, self.settings.ledger_host_dir,
                                      self.settings.limits_host_dir, whole_gpu=whole, compute=entry.compute,
                                      mps_pipe_dir=pipe, mps_shm_dir=shm))
        if entry.mode == MODE_FRACTION and not whole:  # the shim's ledger and limit, which the spec mounts
            await asyncio.to_thread(make_ledger_dir, ledger_dir(self.settings.ledger_host_dir, entry.uid))
            await asyncio.to_thread(write_limit_dir, limit_dir(self.settings.limits_host_dir, entry.uid),
                                    shim_files(entry.granted_bytes))
        os.makedirs(self.settings.cdi_dir, exist_ok=True)
        path = os.path.join(self.settings.cdi_dir, spec_file_name(entry.uid))
        await asyncio.to_thread(write_atomically, path, json.dumps(spec, indent=1) + "\n", 0o644)
        ids = [device_id(entry.uid)]
        nvidia = await asyncio.to_thread(find_nvidia_device, self.settings.nvidia_cdi_dirs, entry.device_uuid)
        if nvidia is not None:
            ids.append(nvidia)
        return ids

    async def resync(self) -> None:
        """On start: the spec of every claim still prepared is written again (``/var/run/cdi`` is a
        tmpfs, and the kubelet does not prepare a claim again that its own checkpoint says is
        prepared), and specs of this driver that no prepared claim names are removed."""
        async with self._lock:
            store = self.holder.store
            wanted: set[str] = set()
            for claim in store.prepared.values():
                entry = store.record.owners.get(claim.slice_uid)
                if entry is None or not entry.device_uuid:
                    log.warning("prepared ResourceClaim %s/%s names slice %s, which this node no longer holds",
                                claim.namespace, claim.name, claim.slice_uid)
                    continue
                wanted.add(spec_file_name(claim.slice_uid))
                ref = f"ResourceClaim {claim.namespace}/{claim.name} (uid {claim.claim_uid})"
                try:
                    await self._write_spec(ref, f"device {DRIVER}/{self.holder.node}/{claim.slice_uid}", entry)
                except (PrepareRefused, OSError, DeviceFileError) as exc:
                    log.warning("cannot write the CDI spec of %s again: %s", ref, exc)
            prefix = spec_file_name("")
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(self.settings.cdi_dir):
                    if name.startswith(prefix.removesuffix(".json")) and name.endswith(".json") \
                            and name not in wanted:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(self.settings.cdi_dir, name))
                        log.info("removed CDI spec %s: no prepared claim names its slice", name)
            await asyncio.to_thread(self._prune_slice_dirs, {c.slice_uid for c in store.prepared.values()})

    def _prune_slice_dirs(self, keep: set[str]) -> None:
        for directory, what in ((self.settings.ledger_host_dir, "ledger"), (self.settings.limits_host_dir, "limit")):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    if name not in keep:
                        remove_slice_dir(os.path.join(directory, name))
                        log.info("removed %s %s: no prepared claim names its slice", what, name)

    async def _unprepare_one(self, claim: Any) -> None:
        store = self.holder.store
        prepared = await asyncio.to_thread(store.drop_prepared, claim.uid)
        if prepared is None:
            log.info("unprepare %s: not prepared here (already unprepared)", _claim_ref(claim))
            return
        if not store.claims_on(prepared.slice_uid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.settings.cdi_dir, spec_file_name(prepared.slice_uid)))
            await asyncio.to_thread(remove_slice_dir,
                                    ledger_dir(self.settings.ledger_host_dir, prepared.slice_uid))
            await asyncio.to_thread(remove_slice_dir,
                                    limit_dir(self.settings.limits_host_dir, prepared.slice_uid))
        log.info("unprepared %s (slice %s)", _claim_ref(claim), prepared.slice_uid)
        await self.holder.claim_released(prepared.slice_uid)
