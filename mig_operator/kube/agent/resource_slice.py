"""The node's ResourceSlice for driver ``gpu.cdmo.io``: one device per slice realised here and Ready.

kube-scheduler allocates ResourceClaims from it; the controller's claim for a GpuSlice selects the
device by ``gpu.cdmo.io/slice`` (the slice's UID), which is also the device's name. Idle instances
are not devices: nothing but a slice's own claim can get an instance. One pool per node (named after
it) in one ResourceSlice, owned by the Node like the GpuNode, so it goes with the Node.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from mig_operator.core.cdi import DRIVER
from mig_operator.core.cluster import MODE_MIG
from mig_operator.core.lifecycle import OwnerEntry

from ..common.client import ApiError, KubeClient

log = logging.getLogger("mig_operator.agent")

RESOURCE_API = "resource.k8s.io/v1"
RESOURCE_SLICES_PATH = f"/apis/{RESOURCE_API}/resourceslices"
RESOURCE_CLAIMS = "resourceclaims"
MAX_DEVICES = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices
MAX_ATTRIBUTE_STRING = 64  # resource.k8s.io/v1 DeviceAttributeMaxValueLength


def resource_slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"


def resource_slice_path(node: str) -> str:
    return f"{RESOURCE_SLICES_PATH}/{resource_slice_name(node)}"


def resource_claim_path(namespace: str, name: str) -> str:
    return f"/apis/{RESOURCE_API}/namespaces/{namespace}/{RESOURCE_CLAIMS}/{name}"


@dataclass(frozen=True)
class SliceDeviceInfo:
    """What the ResourceSlice says of one slice's device."""

    uid: str
    namespace: str
    name: str
    mode: str
    profile: str
    device_uuid: str
    granted_bytes: int


def device_info(entry: OwnerEntry) -> SliceDeviceInfo:
    namespace, _, name = entry.slice.partition("/")
    return SliceDeviceInfo(entry.uid, namespace, name, entry.mode, entry.profile if entry.mode == MODE_MIG else "",
                           entry.device_uuid, entry.granted_bytes)


def _attribute(value: str) -> dict[str, str] | None:
    # The API refuses longer strings; a name that long is only informational here (claims select by UID).
    return {"string": value} if len(value) <= MAX_ATTRIBUTE_STRING else None


def device(info: SliceDeviceInfo) -> dict[str, Any]:
    attributes = {
        "slice": _attribute(info.uid), "sliceName": _attribute(info.name),
        "sliceNamespace": _attribute(info.namespace), "mode": _attribute(info.mode),
        "profile": _attribute(info.profile), "uuid": _attribute(info.device_uuid),
    }
    return {
        "name": info.uid,
        "attributes": {f"{DRIVER}/{key}": value for key, value in attributes.items() if value is not None},
        "capacity": {f"{DRIVER}/memory": {"value": str(info.granted_bytes)}},
    }


def slice_spec(node: str, devices: Iterable[SliceDeviceInfo], generation: int) -> dict[str, Any]:
    """The ResourceSlice's spec: the node's pool at ``generation``, devices ordered by name."""
    listed = sorted(devices, key=lambda d: d.uid)
    if len(listed) > MAX_DEVICES:
        log.warning("node %s has %d slices; a ResourceSlice holds %d devices, the rest are not offered",
                    node, len(listed), MAX_DEVICES)
        listed = listed[:MAX_DEVICES]
    return {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": [device(info) for info in listed],
    }


class ResourceSlicePublisher:
    """Writes the node's ResourceSlice when its devices change (the pool's generation goes up by one)."""

    def __init__(self, client: KubeClient, node: str) -> None:
        self.client = client
        self.node = node
        self._published: list[dict[str, Any]] | None = None  # the devices last written
        self._published_for = ""  # the Node UID that ResourceSlice is owned by
        self._current: dict[str, Any] | None = None  # the ResourceSlice as last written or read

    async def publish(self, devices: Iterable[SliceDeviceInfo], node_uid: str, verify: bool = False) -> bool:
        """Make the ResourceSlice list ``devices``; True when it was written. Nothing is written
        without the Node (``node_uid`` empty): the ResourceSlice goes with it. ``verify``: read it
        even if this publisher wrote the same devices last (the kubelet deletes its node's
        ResourceSlices when it starts, and a driver's 30 s after that driver's plugin went away)."""
        if not node_uid:
            return False
        devices = list(devices)
        wanted = slice_spec(self.node, devices, 0)["devices"]
        if not verify and wanted == self._published and node_uid == self._published_for:
            return False
        path = resource_slice_path(self.node)
        known = self._current
        if not verify and known is not None and node_uid == self._published_for:
            # One PUT on what this publisher last wrote; its resourceVersion makes a change by anyone
            # else (the kubelet deleting it, another writer) fail, and then it is read afresh.
            generation = int(((known.get("spec") or {}).get("pool") or {}).get("generation", 0)) + 1
            try:
                self._current = await self.client.request(
                    "PUT", path, body={**known, "spec": slice_spec(self.node, devices, generation)})
            except ApiError as exc:
                if not (exc.conflict or exc.not_found):
                    raise
                self._current = None
            else:
                self._published = wanted
                log.info("ResourceSlice %s: %d device(s)", resource_slice_name(self.node), len(wanted))
                return True
        try:
            current = await self.client.get(path)
        except ApiError as exc:
            if not exc.not_found:
                raise
            current = None
        if current is not None and _owner_uid(current) not in ("", node_uid):
            # Left by a Node of this name that is gone: the garbage collector takes it; write anew.
            await self.client.delete(path)
            current = None
        if current is None:
            body = {"apiVersion": RESOURCE_API, "kind": "ResourceSlice",
                    "metadata": {"name": resource_slice_name(self.node), "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid}]},
                    "spec": slice_spec(self.node, devices, 1)}
            try:
                self._current = await self.client.create(RESOURCE_SLICES_PATH, body)
            except ApiError as exc:
                if exc.conflict:
                    self._published = None  # created meanwhile: the next publish updates it
                raise
        else:
            spec = current.get("spec") or {}
            if _same_devices(spec.get("devices") or [], wanted):
                self._published, self._published_for, self._current = wanted, node_uid, current
                return False
            generation = int((spec.get("pool") or {}).get("generation", 0)) + 1
            body = {**current, "spec": slice_spec(self.node, devices, generation)}
            # A PUT with the resourceVersion read: a concurrent writer makes it fail, not vanish.
            self._current = await self.client.request("PUT", path, body=body)
        self._published, self._published_for = wanted, node_uid
        log.info("ResourceSlice %s: %d device(s)", resource_slice_name(self.node), len(wanted))
        return True

    def forget(self) -> None:
        """Write again at the next publish (the Node or the ResourceSlice changed under us)."""
        self._published = None
        self._current = None


def _comparable(devices: Iterable[Mapping]) -> list[tuple]:
    # The API server writes quantities in canonical form (10737418240 -> 10Gi): compare their values.
    return [(d.get("name"), d.get("attributes") or {},
             {k: parse_quantity(v.get("value", "0")) for k, v in (d.get("capacity") or {}).items()})
            for d in devices]


def _same_devices(current: Iterable[Mapping], wanted: Iterable[Mapping]) -> bool:
    try:
        return _comparable(current) == _comparable(wanted)
    except (ValueError, AttributeError, TypeError):
        return False


def _owner_uid(body: Mapping) -> str:
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    return next((r.get("uid", "") for r in refs if r.get("kind") == "Node"), "")
