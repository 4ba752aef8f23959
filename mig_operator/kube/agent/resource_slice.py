"""The node's ResourceSlices for driver ``gpu.cdmo.io``: one device per slice realised here and Ready.

kube-scheduler allocates ResourceClaims from them; the controller's claim for a GpuSlice selects the
device by ``gpu.cdmo.io/slice`` (the slice's UID), which is also the device's name. Idle instances
are not devices: nothing but a slice's own claim can get an instance. One pool per node (named after
it), owned by the Node like the GpuNode, so it goes with the Node.

A ResourceSlice holds at most 128 devices, so the pool spreads over as many as it needs: devices in
UID order, 128 to a slice, named ``<node>-gpu.cdmo.io``, ``<node>-gpu.cdmo.io-1``, ... Every change
rewrites each of them with the pool's next generation and the new ``resourceSliceCount``, then
deletes the surplus ones: kube-scheduler uses only the slices of a pool's highest generation (and
knows the pool is complete when it has ``resourceSliceCount`` of them), so it never combines devices
of two generations.

A device whose GPU is unhealthy (``core.node.health``) carries the taint ``gpu.cdmo.io/unhealthy`` (value
its reason, e.g. ``Xid79``; effect ``NoSchedule``, or ``NoExecute`` with ``--device-taint-effect``), so
kube-scheduler allocates it to no new claim and, with NoExecute, kube-controller-manager evicts the pods
using it. An API server that does not serve device taints (before 1.37 unless its feature gate is on)
drops the field: the first write that loses it turns taints off for this publisher.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kubernetes.utils import parse_quantity

from mig_operator.core.books.slice_claim import DRA_API as RESOURCE_API
from mig_operator.core.node.cdi import DRIVER
from mig_operator.core.node.lifecycle import OwnerEntry
from mig_operator.core.placement.cluster import MODE_MIG

from ..common.client import ApiError, KubeClient

log = logging.getLogger("mig_operator.agent")

RESOURCE_SLICES_PATH = f"/apis/{RESOURCE_API}/resourceslices"
MAX_DEVICES = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices
MAX_ATTRIBUTE_STRING = 64  # resource.k8s.io/v1 DeviceAttributeMaxValueLength
UNHEALTHY_TAINT = f"{DRIVER}/unhealthy"
TAINT_EFFECTS = ("NoSchedule", "NoExecute")


def resource_slice_name(node: str, index: int = 0) -> str:
    """The name of the node's ``index``-th ResourceSlice (the first keeps the plain name)."""
    return f"{node}-{DRIVER}" if index == 0 else f"{node}-{DRIVER}-{index}"


def resource_slice_path(node: str, index: int = 0) -> str:
    return f"{RESOURCE_SLICES_PATH}/{resource_slice_name(node, index)}"


def resource_slices_of_node(node: str) -> str:
    """The field selector of a node's ResourceSlices (every driver's: the caller keeps its own)."""
    return f"spec.nodeName={node}"


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
    unhealthy: str = ""  # its GPU's health reason while the GPU is unhealthy (Xid79, GpuLost); "": healthy
    taint_effect: str = "NoSchedule"


def device_info(entry: OwnerEntry, unhealthy: str = "", taint_effect: str = "NoSchedule") -> SliceDeviceInfo:
    namespace, _, name = entry.slice.partition("/")
    return SliceDeviceInfo(entry.uid, namespace, name, entry.mode, entry.profile if entry.mode == MODE_MIG else "",
                           entry.device_uuid, entry.granted_bytes, unhealthy, taint_effect)


def _attribute(value: str) -> dict[str, str] | None:
    # The API refuses longer strings; a name that long is only informational here (claims select by UID).
    return {"string": value} if len(value) <= MAX_ATTRIBUTE_STRING else None


def device(info: SliceDeviceInfo) -> dict[str, Any]:
    attributes = {
        "slice": _attribute(info.uid), "sliceName": _attribute(info.name),
        "sliceNamespace": _attribute(info.namespace), "mode": _attribute(info.mode),
        "profile": _attribute(info.profile), "uuid": _attribute(info.device_uuid),
    }
    body: dict[str, Any] = {
        "name": info.uid,
        "attributes": {f"{DRIVER}/{key}": value for key, value in attributes.items() if value is not None},
        "capacity": {f"{DRIVER}/memory": {"value": str(info.granted_bytes)}},
    }
    if info.unhealthy:
        body["taints"] = [{"key": UNHEALTHY_TAINT, "value": info.unhealthy[:63], "effect": info.taint_effect}]
    return body


def pool_specs(node: str, devices: Iterable[SliceDeviceInfo], generation: int) -> list[dict[str, Any]]:
    """The specs of the node's ResourceSlices at ``generation``: devices by name, ``MAX_DEVICES`` to a
    slice, at least one slice (an empty pool says the node has no device)."""
    listed = [device(info) for info in sorted(devices, key=lambda d: d.uid)]
    chunks = [listed[i:i + MAX_DEVICES] for i in range(0, len(listed), MAX_DEVICES)] or [[]]
    return [{"driver": DRIVER, "nodeName": node,
             "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
             "devices": chunk} for chunk in chunks]


class ResourceSlicePublisher:
    """Writes the node's ResourceSlices when its devices change (the pool's generation goes up by one)."""

    def __init__(self, client: KubeClient, node: str) -> None:
        self.client = client
        self.node = node
        self._published: list[dict[str, Any]] | None = None  # the devices last written, in order
        self._published_for = ""  # the Node UID those ResourceSlices are owned by
        self._current: dict[str, dict[str, Any]] | None = None  # name -> ResourceSlice as last written or read
        self.taints_served: bool | None = None  # whether the API server keeps device taints; None: not seen yet

    async def publish(self, devices: Iterable[SliceDeviceInfo], node_uid: str, verify: bool = False) -> bool:
        """Make the node's ResourceSlices list ``devices``; True when they were written. Nothing is
        written without the Node (``node_uid`` empty): the ResourceSlices go with it. ``verify``: read
        them even if this publisher wrote the same devices last (the kubelet deletes its node's
        ResourceSlices when it starts, and a driver's 30 s after that driver's plugin went away)."""
        if not node_uid:
            return False
        devices = list(devices)
        if self.taints_served is False:
            devices = [replace(d, unhealthy="") for d in devices]
        wanted = [d for spec in pool_specs(self.node, devices, 0) for d in spec["devices"]]
        if not verify and wanted == self._published and node_uid == self._published_for:
            return False
        known = self._current
        if not verify and known is not None and node_uid == self._published_for:
            # PUTs on what this publisher last wrote; their resourceVersions make a change by anyone
            # else (the kubelet deleting them, another writer) fail, and then they are read afresh.
            try:
                await self._write(devices, _generation(known.values()) + 1, known, node_uid)
            except ApiError as exc:
                if not (exc.conflict or exc.not_found):
                    raise
            else:
                self._published = wanted
                return True
        current = await self._read(node_uid)
        specs = pool_specs(self.node, devices, _generation(current.values()))
        if _same_pool(current, {resource_slice_name(self.node, i): spec for i, spec in enumerate(specs)}):
            self._published, self._published_for, self._current = wanted, node_uid, current
            return False
        await self._write(devices, _generation(current.values()) + 1, current, node_uid)
        self._published, self._published_for = wanted, node_uid
        return True

    async def _read(self, node_uid: str) -> dict[str, dict[str, Any]]:
        """This driver's ResourceSlices of the node, by name; those a gone Node of this name owned are
        deleted (the garbage collector would take them; they are written anew)."""
        found: dict[str, dict[str, Any]] = {}
        for body in await self.client.list(RESOURCE_SLICES_PATH, field_selector=resource_slices_of_node(self.node)):
            spec = body.get("spec") or {}
            if spec.get("driver") != DRIVER or spec.get("nodeName") != self.node:
                continue
            name = body["metadata"]["name"]
            if _owner_uid(body) not in ("", node_uid):
                await self._delete(name)
            else:
                found[name] = body
        return found

    async def _write(self, devices: list[SliceDeviceInfo], generation: int, known: Mapping[str, dict[str, Any]],
                     node_uid: str) -> None:
        """Every slice of the pool at ``generation`` (an update of each one ``known`` holds, with its
        resourceVersion, a create of the others), then the surplus ones deleted."""
        self._current = None  # until all are written: a failure leaves nothing to PUT on
        written: dict[str, dict[str, Any]] = {}
        specs = pool_specs(self.node, devices, generation)
        for index, spec in enumerate(specs):
            name = resource_slice_name(self.node, index)
            body = known.get(name)
            if body is not None:
                written[name] = await self.client.request("PUT", f"{RESOURCE_SLICES_PATH}/{name}",
                                                          body={**body, "spec": spec})
            else:
                written[name] = await self.client.create(RESOURCE_SLICES_PATH, {
                    "apiVersion": RESOURCE_API, "kind": "ResourceSlice",
                    "metadata": {"name": name, "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid}]},
                    "spec": spec})
            self._saw_taints(spec, written[name])
        for name in sorted(set(known) - set(written)):
            await self._delete(name)
        self._current = written
        log.info("ResourceSlices of node %s: %d device(s) in %d slice(s), pool generation %d", self.node,
                 len(devices), len(specs), generation)

    def _saw_taints(self, spec: Mapping[str, Any], answer: Mapping[str, Any]) -> None:
        """The first write of a tainted device tells whether the API server keeps device taints."""
        if self.taints_served is not None or not any(d.get("taints") for d in spec["devices"]):
            return
        kept = ((answer.get("spec") or {}).get("devices") or [])
        self.taints_served = any(d.get("taints") for d in kept)
        if not self.taints_served:
            log.info("the API server does not keep device taints (DRADeviceTaints): unhealthy GPUs' devices are "
                     "published untainted; the GpuNode and the slices' DeviceHealthy still say so")

    async def _delete(self, name: str) -> None:
        try:
            await self.client.delete(f"{RESOURCE_SLICES_PATH}/{name}")
        except ApiError as exc:
            if not exc.not_found:
                raise

    def forget(self) -> None:
        """Write again at the next publish (the Node or the ResourceSlices changed under us)."""
        self._published = None
        self._current = None


def _generation(bodies: Iterable[Mapping]) -> int:
    """The highest pool generation among ResourceSlices (0 when there are none)."""
    return max((int(((b.get("spec") or {}).get("pool") or {}).get("generation", 0)) for b in bodies), default=0)


def _same_pool(current: Mapping[str, Mapping], wanted: Mapping[str, Mapping]) -> bool:
    """Whether the ResourceSlices read are the wanted ones: the same names, each with the wanted
    devices and slice count, all of one generation."""
    if current.keys() != wanted.keys():
        return False
    generations = set()
    for name, spec in wanted.items():
        have = current[name].get("spec") or {}
        pool = have.get("pool") or {}
        generations.add(pool.get("generation"))
        counted = (pool.get("name"), pool.get("resourceSliceCount"))
        if counted != (spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) \
                or not _same_devices(have.get("devices") or [], spec["devices"]):
            return False
    return len(generations) == 1


def _comparable(devices: Iterable[Mapping]) -> list[tuple]:
    # The API server writes quantities in canonical form (10737418240 -> 10Gi): compare their values.
    # A taint's timeAdded is the API server's: compare key, value and effect.
    return [(d.get("name"), d.get("attributes") or {},
             {k: parse_quantity(v.get("value", "0")) for k, v in (d.get("capacity") or {}).items()},
             [(t.get("key"), t.get("value"), t.get("effect")) for t in d.get("taints") or ()])
            for d in devices]


def _same_devices(current: Iterable[Mapping], wanted: Iterable[Mapping]) -> bool:
    try:
        return _comparable(current) == _comparable(wanted)
    except (ValueError, AttributeError, TypeError):
        return False


def _owner_uid(body: Mapping) -> str:
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    return next((r.get("uid", "") for r in refs if r.get("kind") == "Node"), "")
