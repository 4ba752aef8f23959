"""What the controller and the agent keep of the API's objects: the fields their decisions read.

Every watched kind has one transform, applied where its events and lists enter a handler
(``operator.on_event``'s ``keep``, and the full lists of a resync), so no cache, book or waiting pod
holds more than these fields: no ``managedFields``, no annotations or labels but the keys the
operator reads, and of a pod's spec only what admission checks and placement read. A tenant's
annotations (any size the API server takes) never reach memory beyond the event that carries them.

A transform returns a new dict and shares the nested values it keeps with its argument; a kept body
passed through it again comes out equal (a handler may be given a body already kept).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mig_operator.core.autoscale.nodes import WATCHED_ANNOTATIONS
from mig_operator.core.requests.quantities import QUOTE_LIMIT
from mig_operator.core.requests.slice_spec import ANNOTATION_PREFIX, POD_ANNOTATIONS

from .names import (
    ELIGIBLE_NODES_ANNOTATION,
    GROUP_ANNOTATION,
    GROUP_SIZE_ANNOTATION,
    HEALTH_CLEARED_ANNOTATION,
    POD_SLICE_LABEL,
    SLICE_TRY_ANNOTATION,
)

# Every kind: the metadata handlers read, patch against (resourceVersion, finalizers) or name in Events.
_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
         "finalizers")
# A GpuSlice's annotations the controller reads: its pod group, the nodes its pod may go to, its try.
SLICE_ANNOTATIONS = (GROUP_ANNOTATION, GROUP_SIZE_ANNOTATION, ELIGIBLE_NODES_ANNOTATION, SLICE_TRY_ANNOTATION)
# A stray cdmo.io/* annotation on a pod is refused with its value quoted (clipped to QUOTE_LIMIT): no more is kept.
_STRAY_VALUE = QUOTE_LIMIT + 8
# Of a pod's containers: what admission checks (GPU resources, the operator's variables by name).
_CONTAINER_LISTS = ("containers", "initContainers")
# The one pod condition kept: whether kube-scheduler could place the pod, and why not.
SCHEDULED = "PodScheduled"


def _metadata(meta: Mapping[str, Any], labels: Iterable[str] | None = (),
              annotations: Iterable[str] = (), owners: bool = False) -> dict[str, Any]:
    """The kept metadata; ``labels`` None keeps every label (a Node's: a nodeSelector may name any)."""
    kept = {key: meta[key] for key in _META if key in meta}
    given_labels = meta.get("labels") or {}
    chosen = dict(given_labels) if labels is None else {k: given_labels[k] for k in labels if k in given_labels}
    if chosen:
        kept["labels"] = chosen
    given = meta.get("annotations") or {}
    chosen = {key: given[key] for key in annotations if key in given}
    if chosen:
        kept["annotations"] = chosen
    if owners and meta.get("ownerReferences"):
        kept["ownerReferences"] = meta["ownerReferences"]
    return kept


def _head(body: Mapping[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {key: body[key] for key in ("apiVersion", "kind") if key in body}
    kept["metadata"] = metadata
    return kept


def slice_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A GpuSlice: its spec (the request; the CRD's schema bounds it) and status (written by the
    controller and the agents only), its owner (a pod's slice) and the annotations in SLICE_ANNOTATIONS."""
    kept = _head(body, _metadata(body.get("metadata") or {}, annotations=SLICE_ANNOTATIONS, owners=True))
    for part in ("spec", "status"):
        if part in body:
            kept[part] = body[part]
    return kept


def _pod_annotations(given: Mapping[str, Any]) -> dict[str, Any]:
    """The request annotations whole; any other cdmo.io/* key (refused as a misspelt request) with its
    value cut to what the refusal quotes; no other key."""
    kept: dict[str, Any] = {}
    for key, value in given.items():
        if key in POD_ANNOTATIONS:
            kept[key] = value
        elif key.lower().startswith(ANNOTATION_PREFIX):
            kept[key] = value[:_STRAY_VALUE] if isinstance(value, str) else value
    return kept


def _container(container: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {"name": container.get("name")}
    resources = container.get("resources") or {}
    if resources:
        kept["resources"] = {kind: resources[kind] for kind in ("limits", "requests", "claims") if kind in resources}
    if "restartPolicy" in container:  # an init container's: a sidecar's requests count beside the containers'
        kept["restartPolicy"] = container["restartPolicy"]
    names = [{"name": var.get("name")} for var in container.get("env") or () if isinstance(var, Mapping)]
    if names:
        kept["env"] = names
    return kept


def pod_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A pod labelled cdmo.io/gpu-slice: its request annotations, the label, its scheduling gates and
    claims, where it may run (nodeName, nodeSelector, node affinity, tolerations), its containers'
    resources and variable names, what else the scheduler counts of its requests (overhead, pod-level
    resources), its phase and its PodScheduled condition."""
    meta = body.get("metadata") or {}
    metadata = _metadata(meta, labels=(POD_SLICE_LABEL,))
    annotations = _pod_annotations(meta.get("annotations") or {})
    if annotations:
        metadata["annotations"] = annotations
    kept = _head(body, metadata)
    spec = body.get("spec") or {}
    kept_spec = {key: spec[key] for key in ("nodeName", "nodeSelector", "tolerations", "schedulingGates",
                                            "resourceClaims", "overhead", "resources") if key in spec}
    if "affinity" in spec:
        # Present or not matters to the ungate's patch (it adds /spec/affinity only where there is none).
        affinity = spec["affinity"]
        kept_spec["affinity"] = affinity if not affinity else {
            key: affinity[key] for key in ("nodeAffinity",) if key in affinity}
    for key in _CONTAINER_LISTS:
        if spec.get(key):
            kept_spec[key] = [_container(c) for c in spec[key] if isinstance(c, Mapping)]
    kept["spec"] = kept_spec
    status = body.get("status") or {}
    kept_status: dict[str, Any] = {"phase": status["phase"]} if status.get("phase") is not None else {}
    scheduled = [c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == SCHEDULED]
    if scheduled:
        kept_status["conditions"] = scheduled
    if kept_status:
        kept["status"] = kept_status
    return kept


def bound_pod_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A pod bound to a node, as the fit of another pod there reads it (``core.placement.pod_fit``):
    its name, its containers' and init containers' requests, overhead and pod-level resources, its phase."""
    meta = body.get("metadata") or {}
    kept = _head(body, {key: meta[key] for key in ("name", "namespace", "uid") if key in meta})
    spec = body.get("spec") or {}
    kept_spec: dict[str, Any] = {key: spec[key] for key in ("nodeName", "overhead", "resources") if key in spec}
    for key in _CONTAINER_LISTS:
        if spec.get(key):
            kept_spec[key] = [_requests_only(c) for c in spec[key] if isinstance(c, Mapping)]
    kept["spec"] = kept_spec
    phase = (body.get("status") or {}).get("phase")
    if phase is not None:
        kept["status"] = {"phase": phase}
    return kept


def _requests_only(container: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    requests = (container.get("resources") or {}).get("requests")
    if requests:
        kept["resources"] = {"requests": requests}
    if "restartPolicy" in container:
        kept["restartPolicy"] = container["restartPolicy"]
    return kept


def node_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Node: its labels (placement may read any), taints, and the status the agent's device-plugin
    check reads (capacity, allocatable, conditions); not its images or addresses, and of its annotations
    only the admin's GPU health clear mark (the agent reads it) and those that keep it from a node
    autoscaler (the controller writes them)."""
    kept = _head(body, _metadata(body.get("metadata") or {}, labels=None,
                                 annotations=(HEALTH_CLEARED_ANNOTATION, *WATCHED_ANNOTATIONS)))
    taints = (body.get("spec") or {}).get("taints")
    if taints:
        kept["spec"] = {"taints": taints}
    status = body.get("status") or {}
    kept_status = {key: status[key] for key in ("capacity", "allocatable", "conditions") if key in status}
    if kept_status:
        kept["status"] = kept_status
    return kept


def owned_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """An object only the operator or an admin writes (GpuNode, GpuQuota): spec and status whole,
    metadata without managedFields, annotations or labels."""
    kept = _head(body, _metadata(body.get("metadata") or {}, owners=True))
    for part in ("spec", "status"):
        if part in body:
            kept[part] = body[part]
    return kept
