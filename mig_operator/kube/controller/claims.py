"""Each Ready GpuSlice's ResourceClaim: how a device reaches a container (DESIGN "Handing a device").

When a slice is Ready and its device is on its node's GpuNode (core/device_check), the controller
writes a ResourceClaim of the slice's name in its namespace, owned by the slice (deleting the slice
deletes the claim), asking for one device of class ``gpuslice.cdmo.io`` whose ``slice`` attribute is
the slice's UID: only the device the agent publishes for that slice matches. kube-scheduler then
allocates it to a pod that names the claim, and the kubelet asks the agent to prepare it.

A pod's slice gets its claim as soon as the slice exists, not when it is Ready: the pod names the
claim and stays gated until its slice is Ready and its device checked, and kube-scheduler must know
the claim before it sees the pod ungated (a pod it schedules before the claim reaches its cache is
unschedulable until the claim's event requeues it, after a back-off of a second or more). Until the
agent publishes the slice's device, the claim matches no device, so nothing can be allocated early.

A claim of that name left from an earlier slice of the same name (a pod's next try, a slice made
again) is deleted and written anew; a claim of that name the operator did not write is never
touched: the slice's status says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from mig_operator.core.device_check import ACCEPT, check_ready_device

from ..common.client import ApiError, KubeClient, slice_path
from ..common.events import EventPoster
from ..common.names import API_VERSION, DEVICE_CLASS, DRA_API, DRA_DRIVER, SLICE_KIND
from .state import ClusterState, SliceInfo

log = logging.getLogger("mig_operator.controller.claims")
REQUEST_NAME = "gpu"
CLAIM_TAKEN = "ClaimNameTaken"
# How long an earlier slice's claim may take to go once deleted before the new one is written.
STALE_CLAIM_WAIT_S = 30.0


def claims_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{DRA_API}/namespaces/{namespace}/resourceclaims"
    return f"{base}/{name}" if name else base


def device_selector(slice_uid: str) -> str:
    """The CEL expression that matches the device of slice ``slice_uid`` and no other."""
    return f'device.attributes["{DRA_DRIVER}"].slice == "{slice_uid}"'


def claim_body(namespace: str, name: str, slice_uid: str) -> dict[str, Any]:
    """The ResourceClaim of slice ``namespace/name`` (UID ``slice_uid``)."""
    return {
        "apiVersion": DRA_API, "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "ownerReferences": [
            {"apiVersion": API_VERSION, "kind": SLICE_KIND, "name": name, "uid": slice_uid, "controller": True}]},
        "spec": {"devices": {"requests": [{"name": REQUEST_NAME, "exactly": {
            "deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": 1,
            "selectors": [{"cel": {"expression": device_selector(slice_uid)}}]}}]}},
    }


def slice_owner(claim: Mapping[str, Any]) -> str | None:
    """The UID of the GpuSlice that owns ``claim``; None when no GpuSlice does (not the operator's)."""
    for ref in (claim.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == SLICE_KIND and str(ref.get("apiVersion", "")).startswith(API_VERSION.split("/")[0] + "/"):
            return str(ref.get("uid") or "")
    return None


def early(info: SliceInfo) -> bool:
    """Whether the slice's claim is written before it is Ready: a pod's slice (see the module's doc)."""
    refs = (info.body.get("metadata") or {}).get("ownerReferences") or []
    return not info.deleting and any(ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" for ref in refs)


class SliceClaims:
    """Writes the ResourceClaim of every Ready slice whose device its node's GpuNode lists."""

    def __init__(self, client: KubeClient, events: EventPoster, state: ClusterState) -> None:
        self.client = client
        self.events = events
        self.state = state
        self.written: dict[tuple[str, str], str] = {}  # (namespace, name) -> slice UID of the claim there
        # Ready slices whose device their node's GpuNode did not list yet, by node: tried again when it changes.
        self.waiting: dict[str, set[tuple[str, str]]] = {}
        # One write of a claim at a time: a slice's own watch event may come while the write its creation
        # started is under way, and a second create would only be refused (409), at kube-apiserver's cost.
        self._writing: dict[tuple[str, str], asyncio.Lock] = {}

    async def slice_changed(self, info: SliceInfo) -> None:
        await self.ensure(info)

    async def inventory_changed(self, node: str) -> None:
        for key in sorted(self.waiting.pop(node, set())):
            info = self.state.slice_named(*key)
            if info is not None:
                await self.ensure(info)

    async def resync(self) -> None:
        """After a full list: forget the slices that are gone, write what is missing."""
        self.written = {key: uid for key, uid in self.written.items() if uid in self.state.slices}
        for info in list(self.state.slices.values()):
            try:
                await self.ensure(info)
            except ApiError as exc:
                log.warning("slice %s: its ResourceClaim: %s", info.ref, exc)

    def ready(self, info: SliceInfo) -> bool:
        """Whether ``info`` is Ready, not being deleted, and its device checked against its GpuNode."""
        st = info.body.get("status") or {}
        if st.get("phase") != "Ready" or info.binding is None or info.deleting:
            return False
        verdict = check_ready_device(info.uid, st.get("deviceUUID", ""), info.binding,
                                     self.state.inventories.get(info.binding.node))
        return verdict.action == ACCEPT

    async def ensure(self, info: SliceInfo) -> bool:
        """Write the claim of a ready slice (``ready``), or of a pod's slice (``early``), when it is not
        there yet; True when the slice's claim exists and the slice is ready."""
        key = (info.namespace, info.name)
        if self.written.get(key) == info.uid:
            return self.ready(info)
        lock = self._writing.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._ensure(info, key)
        finally:
            if not lock.locked() and self._writing.get(key) is lock:
                del self._writing[key]

    async def _ensure(self, info: SliceInfo, key: tuple[str, str]) -> bool:
        ready = self.ready(info)
        if self.written.get(key) == info.uid:
            return ready
        if not ready and not early(info):
            if (info.body.get("status") or {}).get("phase") == "Ready" and info.binding is not None:
                self.waiting.setdefault(info.binding.node, set()).add(key)
            return False
        path = claims_path(info.namespace)
        try:
            await self.client.create(path, claim_body(info.namespace, info.name, info.uid))
        except ApiError as exc:
            if not exc.conflict:
                raise
            if not await self._take_over(info):
                return False
        self.written[key] = info.uid
        if ready:
            await self._record(info)  # an early claim: the agent names it in its Ready write
        log.info("slice %s: ResourceClaim %s written", info.ref, info.name)
        if not ready and (info.body.get("status") or {}).get("phase") == "Ready" and info.binding is not None:
            self.waiting.setdefault(info.binding.node, set()).add(key)
        return ready

    async def _take_over(self, info: SliceInfo) -> bool:
        """A claim of the slice's name exists: True when it is this slice's; an earlier slice's is
        deleted (written again at the slice's next event); a claim not the operator's is left alone."""
        existing = await self.client.get(claims_path(info.namespace, info.name))
        owner = slice_owner(existing)
        if owner == info.uid:
            return True
        if owner is None:
            message = (f"ResourceClaim {info.namespace}/{info.name} exists and was not written by mig-operator; "
                       "rename or delete it, or give the GpuSlice another name")
            self.events.post(info.body, "Warning", CLAIM_TAKEN, message)
            log.info("slice %s: %s", info.ref, message)
            return False
        path = claims_path(info.namespace, info.name)
        if not (existing.get("metadata") or {}).get("deletionTimestamp"):
            try:
                await self.client.delete(path)
            except ApiError as exc:
                if not exc.not_found:
                    raise
        # Gone once its pods let it go (the API keeps a claim in use): then this slice's is written.
        deadline = time.monotonic() + STALE_CLAIM_WAIT_S
        while time.monotonic() < deadline:
            try:
                await self.client.get(path)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                await self.client.create(claims_path(info.namespace), claim_body(info.namespace, info.name, info.uid))
                return True
            await asyncio.sleep(0.2)
        log.info("slice %s: the ResourceClaim of an earlier slice of its name is still in use", info.ref)
        return False

    async def _record(self, info: SliceInfo) -> None:
        """The claim's name in the slice's status (``kubectl get gs`` shows it)."""
        if (info.body.get("status") or {}).get("claim") == info.name:
            return
        try:
            await self.client.merge_patch(f"{slice_path(info.namespace, info.name)}/status",
                                          {"status": {"claim": info.name}})
        except ApiError as exc:
            if not exc.not_found:
                raise
