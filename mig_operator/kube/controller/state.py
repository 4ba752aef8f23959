"""What the controller knows of the cluster: slices, inventories, labelled nodes, bindings in flight.

Fed by watch events and by periodic full lists (``replace_all``), read by the binder. A watch event
older than what is known (a smaller resourceVersion) is ignored, so a binding the controller has
just written cannot be undone by a late event from before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_operator.core.cluster import (
    Binding,
    ClusterPlanner,
    NodeInventory,
    binding_from_status,
    inventory_from_status,
)
from mig_operator.core.quantities import QuantityError
from mig_operator.core.request import SliceRequest
from mig_operator.core.slice_spec import request_from_spec

from ..common.client import resource_version
from ..common.names import AGENT_FINALIZER, ELIGIBLE_NODES_ANNOTATION, SLICE_NODE_LABEL


@dataclass
class SliceInfo:
    """One GpuSlice as the controller needs it."""

    uid: str
    namespace: str
    name: str
    created: str
    version: int
    body: dict[str, Any]
    request: SliceRequest | None
    invalid: str  # why the spec cannot be served (an API server without CEL let it in), else ""
    pinned: str | None
    phase: str | None
    binding: Binding | None
    deleting: bool
    marked: bool  # carries the node label and the agent's finalizer
    eligible: tuple[str, ...] | None = None  # the only nodes it may go to (a pod's node selector), if set

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[str, str, str]:
        """Oldest first: Pending slices are planned again in this order."""
        return (self.created, self.namespace, self.name)


def slice_info(body: Mapping) -> SliceInfo:
    meta = body["metadata"]
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    request, invalid = None, ""
    try:
        request = request_from_spec(spec)
    except QuantityError as exc:
        invalid = str(exc)
    binding = binding_from_status(meta["uid"], status)
    labels = meta.get("labels") or {}
    marked = binding is not None and labels.get(SLICE_NODE_LABEL) == binding.node and AGENT_FINALIZER in (
        meta.get("finalizers") or ())
    return SliceInfo(
        uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], created=meta.get("creationTimestamp", ""),
        version=resource_version(meta), body=dict(body), request=request, invalid=invalid,
        pinned=spec.get("nodeName"), phase=status.get("phase"), binding=binding,
        deleting=bool(meta.get("deletionTimestamp")), marked=marked,
        eligible=_eligible_nodes(meta),
    )


def _eligible_nodes(meta: Mapping) -> tuple[str, ...] | None:
    text = (meta.get("annotations") or {}).get(ELIGIBLE_NODES_ANNOTATION)
    if text is None:
        return None
    return tuple(sorted({name.strip() for name in str(text).split(",") if name.strip()}))


@dataclass
class ClusterState:
    """Every change goes through a method here, which keeps ``planner`` (core's incremental view of
    the cluster) current: a decision then costs the same whatever the cluster's size."""

    slices: dict[str, SliceInfo] = field(default_factory=dict)
    inventories: dict[str, NodeInventory] = field(default_factory=dict)
    labelled: set[str] = field(default_factory=set)
    # Bindings decided but not yet seen in a slice's status: they hold their GPU room meanwhile.
    in_flight: dict[str, Binding] = field(default_factory=dict)
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, name) -> uid
    planner: ClusterPlanner = field(default_factory=ClusterPlanner)

    def _held(self, uid: str) -> None:
        """Tell the planner what room slice ``uid`` holds now: its written binding, else the one in
        flight, else none."""
        info = self.slices.get(uid)
        binding = info.binding if info is not None and info.binding is not None else self.in_flight.get(uid)
        if binding is None:
            self.planner.drop_binding(uid)
        else:
            self.planner.put_binding(binding)

    def reserve(self, binding: Binding) -> None:
        self.in_flight[binding.uid] = binding
        self._held(binding.uid)

    def unreserve(self, uid: str) -> None:
        self.in_flight.pop(uid, None)
        self._held(uid)

    def set_labelled(self, node: str, labelled: bool) -> None:
        (self.labelled.add if labelled else self.labelled.discard)(node)
        self.planner.set_labelled(node, labelled)

    # ---- slices --------------------------------------------------------------------------------

    def put_slice(self, body: Mapping) -> SliceInfo | None:
        """Take a slice event; None when it is older than what is known (ignored)."""
        info = slice_info(body)
        known = self.slices.get(info.uid)
        if known is not None and info.version and known.version > info.version:
            return None
        self.slices[info.uid] = info
        self.names[(info.namespace, info.name)] = info.uid
        if info.binding is not None:
            self.in_flight.pop(info.uid, None)
        self._held(info.uid)
        return info

    def remove_slice(self, uid: str) -> SliceInfo | None:
        self.in_flight.pop(uid, None)
        gone = self.slices.pop(uid, None)
        if gone is not None and self.names.get((gone.namespace, gone.name)) == uid:
            del self.names[(gone.namespace, gone.name)]
        self.planner.drop_binding(uid)
        return gone

    def slice_named(self, namespace: str, name: str) -> SliceInfo | None:
        uid = self.names.get((namespace, name))
        return self.slices.get(uid) if uid is not None else None

    def bindings(self) -> list[Binding]:
        """Every binding that holds GPU room: written ones (until the slice is gone) and in flight."""
        held = {uid: s.binding for uid, s in self.slices.items() if s.binding is not None}
        held.update(self.in_flight)
        return list(held.values())

    def pending(self) -> list[SliceInfo]:
        """Slices waiting for a binding, oldest first."""
        waiting = [
            s for s in self.slices.values()
            if s.binding is None and s.uid not in self.in_flight and not s.deleting and s.phase in (None, "Pending")
            and s.request is not None
        ]
        return sorted(waiting, key=lambda s: s.order)

    # ---- inventories and labels ----------------------------------------------------------------

    def put_inventory(self, body: Mapping) -> None:
        name = body["metadata"]["name"]
        node = (body.get("spec") or {}).get("nodeName") or name
        self.inventories[node] = inventory_from_status(node, body.get("status"))
        self.planner.set_inventory(self.inventories[node])

    def remove_inventory(self, body: Mapping) -> None:
        node = (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
        self.inventories.pop(node, None)
        self.planner.remove_inventory(node)

    def replace_all(self, slices: Iterable[Mapping], inventories: Iterable[Mapping], labelled: Iterable[str]) -> None:
        """A fresh full list: what is not in it is gone (events may have been missed while paused)."""
        fresh = {}
        for body in slices:
            info = slice_info(body)
            known = self.slices.get(info.uid)
            fresh[info.uid] = known if known is not None and known.version > info.version else info
        self.slices = fresh
        self.names = {(s.namespace, s.name): uid for uid, s in fresh.items()}
        self.in_flight = {uid: b for uid, b in self.in_flight.items() if uid in fresh}
        self.inventories = {}
        for body in inventories:
            node = (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
            self.inventories[node] = inventory_from_status(node, body.get("status"))
        self.labelled = set(labelled)
        self.planner.reset(self.inventories.values(), self.labelled, self.bindings())

    def counts(self) -> dict[tuple[str, str], int]:
        """Slices by (phase, mode), for the metrics."""
        out: dict[tuple[str, str], int] = {}
        for s in self.slices.values():
            key = (s.phase or "New", str((s.body.get("status") or {}).get("mode", "")))
            out[key] = out.get(key, 0) + 1
        return out
