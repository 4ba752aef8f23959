"""What the controller reads of the API's objects, as the records its ledger (core.books.ledger) takes. A
slice's record keeps its body as ``trim.slice_body`` keeps it, never the whole object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

from mig_operator.core.autoscale.nodes import WATCHED_ANNOTATIONS, leaving
from mig_operator.core.books.ledger import NodeLabels, NodeRecord, PodRecord, SliceRecord
from mig_operator.core.node.runtime_trust import accepted
from mig_operator.core.placement.cluster import NodeInventory, binding_from_status, inventory_from_status
from mig_operator.core.placement.tenancy import shares_across_namespaces
from mig_operator.core.requests.pod_admission import pod_ask, pod_ask_inputs
from mig_operator.core.requests.quantities import QuantityError, clip_repr, read_integer
from mig_operator.core.requests.request import SliceRequest
from mig_operator.core.requests.request_forms import MAX_POD_DEVICES
from mig_operator.core.requests.slice_spec import request_from_spec

from ..common.client import resource_version
from ..common.names import (
    AGENT_FINALIZER,
    ELIGIBLE_NODES_ANNOTATION,
    GROUP_ANNOTATION,
    GROUP_SIZE_ANNOTATION,
    MIG_NODE_LABEL,
    MIG_NODE_VALUE,
    SCHEDULING_GATE,
)
from ..common.trim import pod_body, slice_body


def slice_record(body: Mapping) -> SliceRecord:
    body = slice_body(body)
    meta = body["metadata"]
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    request, invalid = _request(spec)
    binding = binding_from_status(meta["uid"], status, meta["namespace"])
    marked = binding is not None and AGENT_FINALIZER in (meta.get("finalizers") or ())
    group, unreadable = _group(meta)
    if unreadable and binding is None:
        # Only an unbound slice is planned by its group; a bound one keeps its device.
        invalid = invalid or unreadable
    return SliceRecord(
        uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], created=meta.get("creationTimestamp", ""),
        version=resource_version(meta), body=body, request=request, invalid=invalid,
        pinned=spec.get("nodeName"), phase=status.get("phase"), binding=binding,
        deleting=bool(meta.get("deletionTimestamp")), marked=marked,
        eligible=_eligible_nodes(meta), pod_owner=_pod_owner(meta), **group,
    )


def _pod_owner(meta: Mapping) -> str | None:
    """The UID of the pod the slice was made for (its v1 Pod owner reference); None for a slice made directly."""
    for ref in meta.get("ownerReferences") or ():
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1":
            return str(ref.get("uid") or "")
    return None


def _request(spec: Mapping) -> tuple[SliceRequest | None, str]:
    """The spec's request, or why it is invalid. Every event of a slice carries its spec (immutable),
    and a burst's slices ask alike: parsed once per distinct spec (a twentieth of the controller's CPU
    in a burst, bench/results/benchmark-history.md)."""
    try:
        # The type is part of the key: True == 1 == 1.0 in Python, not in a GpuSlice spec.
        key = tuple(sorted((name, type(value).__name__, value) for name, value in spec.items()))
        hash(key)
    except TypeError:  # a value that is not a scalar: the spec is invalid, said at each event
        return _parse_request(spec)
    return _parse_request_cached(key)


def _parse_request(spec: Mapping) -> tuple[SliceRequest | None, str]:
    try:
        return request_from_spec(spec), ""
    except QuantityError as exc:
        return None, str(exc)


@lru_cache(maxsize=4096)
def _parse_request_cached(items: tuple[tuple[str, str, Any], ...]) -> tuple[SliceRequest | None, str]:
    return _parse_request({name: value for name, _type, value in items})


def _group(meta: Mapping) -> tuple[dict[str, Any], str]:
    """The slice's group, when its annotations name one of 2 to MAX_POD_DEVICES slices, and why the
    slice cannot be read when its group's size is not a whole number in ASCII digits. A readable size
    outside 2 to MAX_POD_DEVICES is no group: the slice is planned on its own."""
    annotations = meta.get("annotations") or {}
    group, size = annotations.get(GROUP_ANNOTATION), annotations.get(GROUP_SIZE_ANNOTATION)
    if not group or size is None:
        return {}, ""
    if read_integer(size) is None:
        return {}, (f"annotation {GROUP_SIZE_ANNOTATION}: {clip_repr(size)} beside {GROUP_ANNOTATION}: "
                    f"{clip_repr(group)} is not a group size; write a whole number from 2 to {MAX_POD_DEVICES} "
                    f"in ASCII digits, e.g. {GROUP_SIZE_ANNOTATION}: '2'")
    count = read_integer(size, 2, MAX_POD_DEVICES)
    if count is None:
        return {}, ""
    return {"group": str(group), "group_size": count}, ""


def _eligible_nodes(meta: Mapping) -> tuple[str, ...] | None:
    text = (meta.get("annotations") or {}).get(ELIGIBLE_NODES_ANNOTATION)
    if text is None:
        return None
    return tuple(sorted({name.strip() for name in str(text).split(",") if name.strip()}))


def pod_record(body: Mapping, known: PodRecord | None = None) -> PodRecord:
    """The pod's record (``body`` kept as ``trim.pod_body`` keeps it); its request is read again only
    when what it reads changed since ``known`` (a pod's events mostly change its status)."""
    body = pod_body(body)
    meta = body["metadata"]
    if known is not None and pod_ask_inputs(known.body) == pod_ask_inputs(body):
        ask = known.ask
    else:
        ask = pod_ask(body)
    return PodRecord(body, str(meta.get("uid") or ""), resource_version(meta), ask)


def group_of(info: SliceRecord) -> str:
    """The pod group a slice belongs to: the pod's cdmo.io/gpu-slice label value."""
    return info.group or info.name


def owned_by(body: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether the object (a GpuSlice) is the pod's own: its owner references name the pod's UID."""
    uid = pod["metadata"].get("uid")
    return any(ref.get("kind") == "Pod" and ref.get("uid") == uid
               for ref in (body.get("metadata") or {}).get("ownerReferences") or [])


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod still carries the operator's scheduling gate."""
    return any(g.get("name") == SCHEDULING_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def node_labels(labels: Mapping[str, str] | None) -> NodeLabels:
    labels = labels or {}
    return NodeLabels(labels.get(MIG_NODE_LABEL) == MIG_NODE_VALUE, shares_across_namespaces(labels), accepted(labels))


def node_record(body: Mapping) -> NodeRecord:
    """A Node as the ledger keeps it: its labels, its taints and what placement reads of them, its allocatable."""
    labels = dict((body.get("metadata") or {}).get("labels") or {})
    taints = tuple((body.get("spec") or {}).get("taints") or ())
    allocatable = dict((body.get("status") or {}).get("allocatable") or {})
    flags = replace(node_labels(labels), leaving=leaving(taints))
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    kept = {k: str(annotations[k]) for k in WATCHED_ANNOTATIONS if k in annotations}
    return NodeRecord(labels, taints, flags, allocatable, kept)


def inventory(body: Mapping) -> NodeInventory:
    """A GpuNode as its node's inventory (the node is spec.nodeName, else the GpuNode's name)."""
    return inventory_from_status(inventory_node(body), body.get("status"))


def inventory_node(body: Mapping) -> str:
    return (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
