"""Pods that ask for a slice with an annotation: their GpuSlice, ConfigMap and release from the gate.

The webhook gave the pod a scheduling gate, ``envFrom`` of a ConfigMap and the label naming both
that ConfigMap and its GpuSlice. Here the controller:

1. creates the GpuSlice, owned by the pod (deleting the pod deletes the slice through garbage
   collection, and the agent then releases its instance);
2. once the slice is Ready, writes the ConfigMap with the slice's environment (also owned by the
   pod), and only then, in one update, pins the pod to the slice's node with required node affinity
   and removes the gate; kube-scheduler then binds it there;
3. while the slice cannot be served, leaves the gate on and posts an Event with the reason on the pod.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mig_operator.core.environment import slice_environment
from mig_operator.core.quantities import QuantityError, parse_fraction
from mig_operator.core.slice_spec import (
    ANNOTATION_FRACTION,
    ANNOTATION_MEMORY,
    ANNOTATION_PROFILE,
    check_node_name,
    request_from_annotations,
)

from ..common.client import ApiError, KubeClient, core_path, slices_path
from ..common.events import EventPoster
from ..common.names import API_VERSION, POD_SLICE_LABEL, SCHEDULING_GATE, SHIM_LIBRARY, SHIM_MOUNT_DIR, SLICE_KIND
from .state import ClusterState, SliceInfo

log = logging.getLogger("mig_operator.controller.pods")
HOSTNAME_LABEL = "kubernetes.io/hostname"


def slice_spec_for(annotations: Mapping[str, str]) -> dict[str, Any]:
    """The GpuSlice spec a pod's annotations ask for (already checked at admission, checked again)."""
    request_from_annotations(annotations)
    if ANNOTATION_MEMORY in annotations:
        return {"memory": annotations[ANNOTATION_MEMORY]}
    if ANNOTATION_FRACTION in annotations:
        return {"fraction": parse_fraction(annotations[ANNOTATION_FRACTION])}
    return {"migProfile": annotations[ANNOTATION_PROFILE]}


def _owner(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = pod["metadata"]
    return [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "controller": True}]


def ungate_ops(pod: Mapping[str, Any], node: str) -> list[dict[str, Any]]:
    """One JSON patch that removes the operator's scheduling gate and pins the pod to ``node``.

    While a pod is gated the API lets node affinity be set if it was unset, and required terms only
    gain expressions: an unset affinity gets a term matching the node's name; existing terms each
    gain a hostname expression (the scheduler ANDs within a term and ORs between terms).
    """
    spec = pod.get("spec") or {}
    gates = list(spec.get("schedulingGates") or [])
    index = next(i for i, g in enumerate(gates) if g.get("name") == SCHEDULING_GATE)
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": f"/spec/schedulingGates/{index}", "value": gates[index]},
        {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
    ]
    by_name = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    affinity = spec.get("affinity")
    node_affinity = (affinity or {}).get("nodeAffinity")
    required = (node_affinity or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if affinity is None:
        ops.append({"op": "add", "path": "/spec/affinity",
                    "value": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": by_name}}})
    elif node_affinity is None:
        ops.append({"op": "add", "path": "/spec/affinity/nodeAffinity",
                    "value": {"requiredDuringSchedulingIgnoredDuringExecution": by_name}})
    elif required is None:
        ops.append({"op": "add", "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution",
                    "value": by_name})
    else:
        expression = {"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}
        base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms"
        for i, term in enumerate(required.get("nodeSelectorTerms") or []):
            if term.get("matchExpressions"):
                ops.append({"op": "add", "path": f"{base}/{i}/matchExpressions/-", "value": expression})
            else:
                ops.append({"op": "add", "path": f"{base}/{i}/matchExpressions", "value": [expression]})
    return ops


def _gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == SCHEDULING_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


class PodSlices:
    """Keeps each annotated pod's GpuSlice, ConfigMap and gate in step with its slice."""

    def __init__(self, client: KubeClient, events: EventPoster, state: ClusterState,
                 shim_path: str = f"{SHIM_MOUNT_DIR}/{SHIM_LIBRARY}") -> None:
        self.client = client
        self.events = events
        self.state = state
        self.shim_path = shim_path
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, slice name) -> pod

    async def pod_event(self, pod: dict[str, Any], deleted: bool) -> None:
        meta = pod["metadata"]
        name = (meta.get("labels") or {}).get(POD_SLICE_LABEL)
        if not name:
            return
        key = (meta["namespace"], name)
        if deleted or meta.get("deletionTimestamp"):
            self.pods.pop(key, None)
            self.events.forget(meta["uid"])
            return
        self.pods[key] = pod
        if not _gated(pod):
            return
        info = self.state.slice_named(*key)
        if info is None:
            await self._create_slice(pod, name)
        else:
            await self.slice_changed(info)

    async def _create_slice(self, pod: Mapping[str, Any], name: str) -> None:
        meta = pod["metadata"]
        try:
            spec = slice_spec_for(meta.get("annotations") or {})
            pinned = ((pod.get("spec") or {}).get("nodeSelector") or {}).get(HOSTNAME_LABEL)
            if pinned:
                spec["nodeName"] = check_node_name(pinned)  # the pod can only go there: so must its slice
        except QuantityError as exc:
            self.events.post(pod, "Warning", "InvalidAnnotation", str(exc))
            return
        body = {"apiVersion": API_VERSION, "kind": SLICE_KIND,
                "metadata": {"name": name, "namespace": meta["namespace"], "ownerReferences": _owner(pod),
                             "labels": {"cdmo.io/pod": meta["name"][:63].rstrip("-.")}},
                "spec": spec}
        try:
            await self.client.create(slices_path(meta["namespace"]), body)
        except ApiError as exc:
            if not exc.conflict:
                raise

    async def slice_changed(self, info: SliceInfo) -> None:
        """A slice changed: if a gated pod waits for it, move the pod on (or tell it why not)."""
        pod = self.pods.get((info.namespace, info.name))
        if pod is None or not _gated(pod) or info.deleting:
            return
        st = info.body.get("status") or {}
        phase = st.get("phase")
        if phase == "Ready" and info.binding is not None:
            await self._release_gate(pod, info)
        elif phase == "Failed":
            self.events.post(pod, "Warning", st.get("reason") or "Failed",
                             f"GpuSlice {info.ref} failed: {st.get('message', '')}")
        elif phase == "Pending" and st.get("reason"):
            self.events.post(pod, "Warning", st["reason"], f"waiting for GpuSlice {info.ref}: {st.get('message', '')}")

    async def _release_gate(self, pod: dict[str, Any], info: SliceInfo) -> None:
        assert info.binding is not None
        meta = pod["metadata"]
        st = info.body["status"]
        env = slice_environment(info.binding.mode, st.get("deviceUUID", ""), info.binding.granted_bytes,
                                info.namespace, info.name, self.shim_path)
        config = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": info.name, "namespace": info.namespace, "ownerReferences": _owner(pod)},
                  "data": env}
        try:
            await self.client.create(core_path("configmaps", info.namespace), config)
        except ApiError as exc:
            if not exc.conflict:
                raise
            await self.client.merge_patch(core_path("configmaps", info.namespace, info.name), {"data": env})
        path = core_path("pods", info.namespace, meta["name"])
        try:
            answer = await self.client.json_patch(path, ungate_ops(pod, info.binding.node))
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.status not in (409, 422):
                raise
            fresh = await self.client.get(path)  # changed meanwhile: try again on what it is now
            if not _gated(fresh):
                return
            answer = await self.client.json_patch(path, ungate_ops(fresh, info.binding.node))
        self.pods[(info.namespace, info.name)] = answer
        log.debug("pod %s/%s ungated onto %s", info.namespace, meta["name"], info.binding.node)

    async def resync(self) -> None:
        """Every labelled pod again (after a restart or failover): none is left gated without cause."""
        for pod in await self.client.list("/api/v1/pods", label_selector=POD_SLICE_LABEL):
            try:
                await self.pod_event(pod, deleted=False)
            except ApiError as exc:
                log.warning("pod %s/%s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], exc)
