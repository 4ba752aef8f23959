"""Pods that ask for a slice with an annotation: their GpuSlice and release from the gate.

The webhook gave the pod a scheduling gate, the label naming its GpuSlice, and that slice's
ResourceClaim (same name) in the pod and its containers. Here the controller:

1. creates the GpuSlice, owned by the pod (deleting the pod deletes the slice through garbage
   collection, and the agent then releases its instance);
2. once the slice is Ready and its ResourceClaim written and allocated (claims.py), in one update pins
   the pod to the slice's node with required node affinity and removes the gate; kube-scheduler then
   reserves the claim and binds the pod there, and the kubelet has the agent prepare the device;
3. while the slice cannot be served, leaves the gate on and posts an Event with the reason on the pod;
4. once the pod has finished (phase Succeeded or Failed: a Job's pod, kept until its Job goes),
   deletes its GpuSlice and that slice's ResourceClaim, so the instance is released as when the pod is
   deleted. A finished pod's containers never run again.

The slice's node must be one the pod may run on, or the pinned pod would never be scheduled: a pod
with a ``nodeSelector`` or required node affinity gets a slice pinned to the one GPU node they allow
(``spec.nodeName``) or limited to those they allow (annotation ``cdmo.io/eligible-nodes``); a pod
they allow no GPU node waits, gated, with an Event, and is looked at again at every resync. A slice
is handed only to the pod its owner reference names.

A watch event only observes the pod (the ledger keeps it) and adds its key to the controller's work queue,
``("pod", namespace, pod group)``, whose reconcile makes its missing slices (gated), deletes its slices
(finished, or unschedulable too long), and asks its slices' keys to let their claims go (a gated pod
deleted: its reservations; a finished or unschedulable pod: the claims). The gate is removed by a slice's
key (slice_key.py, ``move_on``) once every slice of the pod is ready; a write that fails comes back after
the queue's back-off.

A pod's slice that failed is replaced on the controller's work queue, key ``("slice-retry", namespace,
slice name)``: added with the back-off (``core.node.lifecycle.slice_retry_delay``), it deletes the failed
slice, is woken by that slice's deletion, then makes the next one; a failed write brings it back after
the queue's own back-off. While the key waits, nothing else makes a slice of that name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from mig_operator.core.books.device_check import ACCEPT, REFUSE
from mig_operator.core.books.ledger import Ledger, PodRecord, SliceRecord
from mig_operator.core.node.lifecycle import BOUND, FAILED, READY, SLICE_TRIES, slice_retry_delay
from mig_operator.core.placement.pod_fit import Shortfall
from mig_operator.core.requests.quantities import read_integer
from mig_operator.core.requests.request_forms import device_slice_names

from ..common.client import ApiError, KubeClient, core_path, slice_path, slices_path
from ..common.events import EventPoster
from ..common.names import (
    AGENT_FINALIZER,
    API_VERSION,
    ELIGIBLE_NODES_ANNOTATION,
    GROUP_ANNOTATION,
    GROUP_SIZE_ANNOTATION,
    POD_SLICE_LABEL,
    POD_WATCH_FIELDS,
    SCHEDULING_GATE,
    SLICE_KIND,
    SLICE_TRY_ANNOTATION,
)
from ..common.trim import SCHEDULED, pod_body
from ..common.workqueue import Requeue, WorkQueue
from .claims import DELETE, UNRESERVE, SliceClaims
from .observe import gated, group_of, owned_by, pod_record, slice_record
from .pod_nodes import HOSTNAME_LABEL, eligible, fitting, hostname

log = logging.getLogger("mig_operator.controller.pods")
FINISHED_PHASES = ("Succeeded", "Failed")
# A Ready slice's device not yet on its GpuNode gets the pod an Event after this long (a new instance
# waits for the GpuNode publish that follows its Ready, a tenth of a second: no Event for that).
DEVICE_WAIT_EVENT_S = 2.0
# A failed slice being deleted is looked at again this often should its deletion's event not come.
FAILED_SLICE_RECHECK_S = 5.0
# A gated pod whose requests fit no GPU node is looked at again this often: pods bound elsewhere finish
# or go without an event the controller watches.
ROOM_RECHECK_S = 30.0
# An ungated pod kube-scheduler reports Unschedulable this long has its slices released.
UNSCHEDULABLE_S = 30.0


def _owner(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = pod["metadata"]
    return [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "controller": True}]


def ungate_ops(pod: Mapping[str, Any], node: str, hostname: str | None = None) -> list[dict[str, Any]]:
    """One JSON patch that removes the operator's scheduling gate and pins the pod to ``node``.

    While a pod is gated the API lets node affinity be set if it was unset, and required terms only
    gain expressions: an unset affinity gets a term matching the node's name; existing terms each
    gain an expression on the node's ``kubernetes.io/hostname`` label, ``hostname`` (its value on
    that node, which the kubelet may set apart from the node's name; default the name). The
    scheduler ANDs within a term and ORs between terms.
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
        expression = {"key": HOSTNAME_LABEL, "operator": "In", "values": [hostname or node]}
        base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms"
        for i, term in enumerate(required.get("nodeSelectorTerms") or []):
            if term.get("matchExpressions"):
                ops.append({"op": "add", "path": f"{base}/{i}/matchExpressions/-", "value": expression})
            else:
                ops.append({"op": "add", "path": f"{base}/{i}/matchExpressions", "value": [expression]})
    return ops


def slice_nodes(allowed: list[str] | None) -> tuple[str | None, tuple[str, ...] | None]:
    """Where a pod's slice may go, given the GPU nodes the pod may go to (``pod_nodes.eligible``; None:
    every one): its ``spec.nodeName`` when that is one node (the pod can only go there, so must its
    slice), else the nodes its annotation ``cdmo.io/eligible-nodes`` names (None: no limit)."""
    if allowed is None:
        return None, None
    if len(allowed) == 1:
        return allowed[0], None
    return None, tuple(sorted(allowed))


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """What kube-scheduler says when it reports the pod Unschedulable (its PodScheduled condition False,
    reason Unschedulable); None when it does not."""
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                SCHEDULED, "False", "Unschedulable"):
            return str(condition.get("message") or "").strip()
    return None


def _retry_key(namespace: str, name: str) -> tuple[str, str, str]:
    """The work queue's key of a failed slice's replacement."""
    return ("slice-retry", namespace, name)


class PodSlices:
    """Keeps each annotated pod's GpuSlice and gate in step with its slice."""

    def __init__(self, client: KubeClient, events: EventPoster, state: Ledger, claims: SliceClaims,
                 queue: WorkQueue) -> None:
        self.client = client
        self.events = events
        self.state = state
        self.claims = claims
        self.queue = queue
        queue.register("pod", self.reconcile)
        # Pod UID -> when (``clock``) an ungated pod was first seen reported Unschedulable. Not the
        # condition's lastTransitionTime: it stays that of the gate's SchedulingGated (status False too).
        self._refused_since: dict[str, float] = {}
        self._released: set[str] = set()  # UIDs of such pods whose slices are being released
        self.clock = time.monotonic

    def pod(self, key: tuple[str, str]) -> dict[str, Any] | None:
        """The pod of ``key`` (namespace, pod group) as last seen, None when none is."""
        record = self.state.pod(*key)
        return record.body if record is not None else None

    async def pod_event(self, pod: dict[str, Any], deleted: bool) -> None:
        """Observe a labelled pod's event: the ledger keeps it (a finished one too, until it is deleted) and
        its key is added; a gated pod deleted asks its slices' keys to take their claims' reservations off
        now, not once its slices are collected."""
        pod = pod_body(pod)  # what is kept of it (a watch event's pod is kept already)
        meta = pod["metadata"]
        name = (meta.get("labels") or {}).get(POD_SLICE_LABEL)
        if not name:
            return
        key = (meta["namespace"], name)
        if deleted or meta.get("deletionTimestamp"):
            self.state.remove_pod(*key)
            self.events.forget(meta["uid"])
            self._refused_since.pop(meta["uid"], None)
            self._released.discard(meta["uid"])
            if gated(pod):  # never ran
                for info in self._own_slices(pod, key):
                    self.claims.ask_let_go(info, UNRESERVE)
            return
        known = self.state.pod(*key)
        if not self.state.put_pod(*key, pod_record(pod, known if known is not None and known.uid == meta["uid"]
                                                   else None)):
            return  # older than the pod as the controller last wrote it (its ungate's answer): nothing new
        self.queue.enqueue(("pod", *key))

    def make_slices(self, namespace: str, group: str) -> None:
        """Have the pod's key look at it (its missing slices made)."""
        self.queue.enqueue(("pod", namespace, group))

    async def reconcile(self, namespace: str, group: str) -> Requeue | None:
        """A pod's key: a finished pod's slices deleted, a gated pod's missing slices made, an ungated pod
        reported Unschedulable too long released from its slices."""
        record = self.state.pod(namespace, group)
        if record is None:
            return None  # gone: what its slices' claims needed was asked at its deletion
        if (record.body.get("status") or {}).get("phase") in FINISHED_PHASES:
            self._refused_since.pop(record.uid, None)
            self._released.discard(record.uid)
            await self._release(record.body, (namespace, group))
            return None
        if gated(record.body):
            return await self._make_slices(namespace, group)
        if unschedulable(record.body) is not None or record.uid in self._refused_since:
            return await self._unschedulable(namespace, group)
        return None

    async def _make_slices(self, namespace: str, group: str) -> Requeue | None:
        record = self.state.pod(namespace, group)
        if record is None or not gated(record.body):
            return None
        names = await self._create_slices(record, group)
        if isinstance(names, Requeue):
            return names
        # Each slice's key tells the pod why it waits, or moves it on; a pod that asks for nothing, the
        # slice its label names (another pod's, maybe: it is told so).
        for name in names or (group,):
            self.queue.enqueue(("slice", namespace, name))
        return None

    async def slice_deleted(self, body: Mapping[str, Any]) -> None:
        """A slice is gone: if its pod still waits, gated, its key makes it again (a group's part the binder
        gave back, or a slice deleted by hand); a failed slice's replacement is its retry key's, woken now."""
        meta = body["metadata"]
        retry = _retry_key(meta["namespace"], meta["name"])
        if self.queue.pending(retry):
            self.queue.wake(retry)
            return
        annotations = meta.get("annotations") or {}
        group = annotations.get(GROUP_ANNOTATION) or meta["name"]
        pod = self.pod((meta["namespace"], group))
        if pod is None or not gated(pod) or not owned_by(body, pod):
            return
        self.make_slices(meta["namespace"], group)

    def _own_slices(self, pod: Mapping[str, Any], key: tuple[str, str]) -> list[SliceRecord]:
        """The pod's slices (``key``: namespace, pod group) that it owns."""
        first = self.state.slice_named(*key) or self.state.slice_named(key[0], f"{key[1]}-0")
        if first is None:
            return []
        return [info for info in self.state.group_members(first) if owned_by(info.body, pod)]

    async def _release(self, pod: Mapping[str, Any], key: tuple[str, str]) -> None:
        """Delete a finished pod's slices (its own only), each once its key has deleted its claim
        (``SliceClaims.ask_let_go``; that key adds this one again): the agent then releases the instances
        at once. kube-controller-manager reserves an allocated claim again for a bound pod, finished or
        not, and a reserved claim holds the slice."""
        for info in self._own_slices(pod, key):
            claim_gone = self.claims.ask_let_go(info, DELETE)
            if info.deleting or not claim_gone:
                continue
            try:
                await self.client.delete(slice_path(info.namespace, info.name))
            except ApiError as exc:
                if not exc.not_found:
                    raise
            log.debug("pod %s/%s finished: its slice %s released", key[0], pod["metadata"]["name"], info.ref)

    async def _create_slices(self, record: PodRecord, group: str,
                             tries: Mapping[str, int] | None = None) -> tuple[str, ...] | Requeue:
        """Make the pod's slices that do not exist yet, one per device (``device_slice_names``): a
        pod's several devices carry its group, so the binder places them together or not at all.
        Returns the slices' names (none when the pod is refused or waits for an eligible node), or when
        to look again when the pod's requests fit no GPU node it may go to."""
        pod, ask = record.body, record.ask
        meta = pod["metadata"]
        # Read as the pod was observed, not only at admission: a pod made with the label and gate but no
        # annotation never reached the webhook, and its annotations may be added or changed later.
        if ask.reason:
            self.events.post(pod, "Warning", ask.reason, f"{ask.message}; the pod stays gated: delete it and "
                             "create it again")
            log.info("pod %s/%s: no slice made: %s", meta["namespace"], meta["name"], ask.message)
            return ()
        devices = ask.devices
        if not devices:
            return ()  # labelled by hand, asking for nothing: not the operator's pod
        names = device_slice_names(group, len(devices))
        # A name whose failed slice waits for its retry key is that key's to make (``tries`` names it).
        missing = [(name, device) for name, device in zip(names, devices, strict=True)
                   if self.state.slice_named(meta["namespace"], name) is None
                   and (name in (tries or {}) or not self.queue.pending(_retry_key(meta["namespace"], name)))]
        if not missing:
            return names
        annotations: dict[str, str] = {}
        allowed, misfits = await self._allowed(pod)
        if allowed == [] and misfits:
            why = "; ".join(shortfall.describe(node) for node in sorted(misfits) for shortfall in misfits[node])
            self.events.post(pod, "Warning", "InsufficientResources", (
                f"the pod's requests fit none of the {len(misfits)} GPU nodes it may go to, as kube-scheduler "
                f"counts them: {why}; it waits, gated, and is looked at again every {ROOM_RECHECK_S:g} s (the "
                "operator places the pod on its slice's node)"))
            return Requeue(ROOM_RECHECK_S)
        if allowed == []:
            known = len(self.state.inventories)
            self.events.post(pod, "Warning", "NoEligibleNode", (
                f"none of the {known} GPU nodes matches the pod's nodeSelector and required node affinity "
                "and has only taints it tolerates; it waits, gated, for one that does (the operator places "
                "the pod on its slice's node)"))
            return ()
        node_name, only = slice_nodes(allowed)
        if only is not None:
            annotations[ELIGIBLE_NODES_ANNOTATION] = ",".join(only)
        if len(names) > 1:
            annotations.update({GROUP_ANNOTATION: group, GROUP_SIZE_ANNOTATION: str(len(names))})
        for name, device in missing:
            spec = {**device.spec, **({"nodeName": node_name} if node_name else {})}
            extra = dict(annotations)
            if tries and tries.get(name, 1) > 1:
                extra[SLICE_TRY_ANNOTATION] = str(tries[name])
            body = {"apiVersion": API_VERSION, "kind": SLICE_KIND,
                    # The agent's finalizer from the start: binding the slice is then one write.
                    "metadata": {"name": name, "namespace": meta["namespace"], "ownerReferences": _owner(pod),
                                 "finalizers": [AGENT_FINALIZER],
                                 "labels": {"cdmo.io/pod": meta["name"][:63].rstrip("-.")},
                                 **({"annotations": extra} if extra else {})},
                    "spec": spec}
            try:
                made = await self.client.create(slices_path(meta["namespace"]), body)
            except ApiError as exc:
                if not exc.conflict:
                    raise
                continue
            # Observed as its watch event will be (which then comes as old): its key binds it now.
            self.state.put_slice(slice_record(made))
            self.queue.enqueue(("slice", meta["namespace"], name))
            log.debug("pod %s/%s: GpuSlice %s made", meta["namespace"], meta["name"], name)
        return names

    async def move_on(self, info: SliceRecord, handed: bool) -> None:
        """The last step of a slice's key: if a gated pod waits for the slice, move the pod on (or tell it
        why not). A pod with several devices moves on once every one of its slices is ready and its claim
        allocated (each by its own key), all on one node: the key of the last one to get there ungates.
        ``handed``: what ``SliceClaims.ensure`` said of this slice's claim just now."""
        pod = self.pod((info.namespace, group_of(info)))
        if pod is None or info.deleting or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            return
        if not gated(pod):
            self._failed_after_ungate(pod, info)
            return
        if not owned_by(info.body, pod):
            # The pod's label names another pod's slice: never hand that slice's device to this pod.
            self.events.post(pod, "Warning", "SliceNotOwned",
                             f"GpuSlice {info.ref}, which the pod's label {POD_SLICE_LABEL} names, belongs to "
                             "another pod; delete this pod and create it again with its annotation only")
            return
        st = info.body.get("status") or {}
        phase = st.get("phase")
        if phase == "Failed":
            self._slice_failed(pod, info)
            return
        if phase == "Pending" and st.get("reason"):
            if await self._limited_otherwise(pod, info):
                await self._make_again(info)
                return
            self.events.post(pod, "Warning", st["reason"], f"waiting for GpuSlice {info.ref}: {st.get('message', '')}")
            return
        if phase not in (READY, BOUND) or info.binding is None:
            return
        members = self.state.group_members(info)
        if len(members) != info.group_size or not all(m.phase in (READY, BOUND) and m.binding is not None
                                                      for m in members):
            return
        if len({m.binding.node for m in members if m.binding is not None}) != 1:
            return  # never: a group is bound on one node (the binder gives back a split one)
        for member in members:
            if not self._device_checked(pod, member) or not (
                    handed if member.uid == info.uid else self.claims.handed(member)):
                return
        await self._release_gate(pod, info)

    async def _allowed(self, pod: Mapping[str, Any]) -> tuple[list[str] | None, dict[str, tuple[Shortfall, ...]]]:
        """The GPU nodes the pod's slice may go to (None: every one): those its nodeSelector, required
        node affinity and tolerations allow (``eligible``) and its requests fit (``fitting``); and why
        each node its requests do not fit is left out."""
        allowed = eligible(pod, self.state.inventories, self.state.nodes)
        if allowed == []:
            return [], {}
        candidates = sorted(self.state.inventories) if allowed is None else allowed
        fit, misfits = await fitting(self.client, pod, candidates, self.state.nodes)
        if allowed is None and not misfits:
            return None, {}
        return fit, misfits

    async def _limited_otherwise(self, pod: Mapping[str, Any], info: SliceRecord) -> bool:
        """Whether the waiting slice is limited to other nodes than its pod may go to now. Taints come
        and go (kube-controller-manager taints a node unreachable for a moment when a heartbeat is late;
        a cordon ends), so the nodes a slice was limited to when it was made may differ from the pod's now:
        such a slice could wait for ever on a full node while the pod may go to one with room. The pods
        bound to the nodes change what the pod's requests fit likewise. While no GPU node takes the pod,
        the slice waits as it is."""
        allowed, _misfits = await self._allowed(pod)
        return allowed != [] and slice_nodes(allowed) != (info.pinned, info.eligible)

    async def _make_again(self, info: SliceRecord) -> None:
        """Delete a gated pod's waiting slices (a group's members alike), each unless it was bound
        meanwhile (a deletion holds only for the version seen waiting); their deletion has the pod's
        slices made again (``slice_deleted``) with the nodes the pod may go to now. Nothing ran on them:
        they hold no instance."""
        for member in self.state.group_members(info):
            if member.binding is not None or member.deleting or self.state.reserved(member.uid) is not None:
                continue
            log.info("slice %s waits on nodes other than those its pod may go to now (their taints or labels "
                     "changed): made again", member.ref)
            try:
                await self.client.delete(slice_path(member.namespace, member.name),
                                         resource_version=str(member.version))
            except ApiError as exc:
                if not (exc.not_found or exc.conflict):
                    raise

    def look_waiting(self) -> None:
        """Look at every waiting slice of a pod again (``_limited_otherwise``): the nodes' taints or
        labels changed."""
        for info in self.state.pending():
            if info.pod_owner is not None:
                self.queue.enqueue(("slice", info.namespace, info.name))

    def _failed_after_ungate(self, pod: Mapping[str, Any], info: SliceRecord) -> None:
        """A pod let go at its slice's binding (its device needed no NVML call) whose slice then failed:
        the kubelet cannot prepare its claim, so the pod is told, once, how to get a new slice."""
        st = info.body.get("status") or {}
        running = (pod.get("status") or {}).get("phase") == "Running"
        if st.get("phase") != FAILED or running or not owned_by(info.body, pod):
            return
        self.events.post(pod, "Warning", st.get("reason") or "Failed",
                         f"GpuSlice {info.ref} failed after the pod was scheduled: {st.get('message', '')}; the pod "
                         "cannot start: delete it, and its next pod gets a new slice")

    def _slice_failed(self, pod: Mapping[str, Any], info: SliceRecord) -> None:
        """A pod's slice Failed: a new slice of the same name after a back-off (core's
        ``slice_retry_delay``), an Event each time; after SLICE_TRIES the pod waits for its owner."""
        key = _retry_key(info.namespace, info.name)
        if self.queue.pending(key):
            return
        st = info.body.get("status") or {}
        tries = max(1, read_integer(((info.body.get("metadata") or {}).get("annotations") or {})
                                    .get(SLICE_TRY_ANNOTATION, "1")) or 1)
        delay = slice_retry_delay(tries)
        failed = f"GpuSlice {info.ref} failed: {st.get('message', '')}"
        if delay is None:
            self.events.post(pod, "Warning", st.get("reason") or "Failed",
                             f"{failed}; {tries} slices of this pod failed, so no new one is made: the pod stays "
                             "gated; delete it (kubectl describe gs shows each failure)")
            return
        self.events.post(pod, "Warning", st.get("reason") or "Failed",
                         f"{failed}; a new slice in {delay:g} s (try {tries + 1} of {SLICE_TRIES})")
        log.info("slice %s failed (try %d of %d); a new one in %g s", info.ref, tries, SLICE_TRIES, delay)
        namespace, name, group, uid = info.namespace, info.name, group_of(info), info.uid
        self.queue.add(key, lambda: self._replace_failed(namespace, name, group, uid, tries), delay)

    async def _replace_failed(self, namespace: str, name: str, group: str, failed_uid: str,
                              tries: int) -> Requeue | None:
        """Delete the failed slice and, once it is gone, make the pod's next one (same name: the pod's
        claim names it). The slice's deletion wakes the key (``slice_deleted``)."""
        record = self.state.pod(namespace, group)
        if record is None or not gated(record.body):
            return None
        current = self.state.slice_named(namespace, name)
        if current is not None:
            if current.uid != failed_uid:
                return None  # another slice of the name: not this retry's
            if not current.deleting:
                try:
                    await self.client.delete(slice_path(namespace, name))
                except ApiError as exc:
                    if not exc.not_found:
                        raise
            return Requeue(FAILED_SLICE_RECHECK_S)
        made = await self._create_slices(record, group, {name: tries + 1})
        return made if isinstance(made, Requeue) else None

    async def _unschedulable(self, namespace: str, group: str) -> Requeue | None:
        """An ungated pod kube-scheduler has reported Unschedulable for UNSCHEDULABLE_S: its slices are
        released (claims unreserved and deleted, slices deleted) with a Warning Event quoting the
        scheduler. Its required node affinity, added at the ungate, pins it to its slices' node and
        cannot be taken off an ungated pod, so the pod cannot follow a slice elsewhere: its next pod
        (from its owner, or made again) is placed where its requests fit."""
        record = self.state.pod(namespace, group)
        if record is None or gated(record.body):
            return None
        pod = record.body
        said = unschedulable(pod)
        if said is None:
            self._refused_since.pop(record.uid, None)
            return None
        waited = self.clock() - self._refused_since.setdefault(record.uid, self.clock())
        if waited < UNSCHEDULABLE_S:
            return Requeue(UNSCHEDULABLE_S - waited)
        own = [info for info in self._own_slices(pod, (namespace, group)) if not info.deleting]
        if not own:
            return None
        nodes = sorted({info.binding.node for info in own if info.binding is not None})
        if record.uid in self._released:
            await self._release(pod, (namespace, group))  # told already: its slices' claims went meanwhile
            return None
        self._released.add(record.uid)
        self.events.post(pod, "Warning", "Unschedulable", (
            f"kube-scheduler has not placed the pod for {waited:.0f} s ({said}); it is pinned to "
            f"{'node ' + ', '.join(nodes) if nodes else 'its slice'}, so GpuSlice "
            f"{', '.join(info.ref for info in own)} is released: delete the pod, and its next pod gets a slice "
            "where its requests fit"))
        log.info("pod %s/%s unschedulable for %.0f s: its slices are released", namespace, pod["metadata"]["name"],
                 waited)
        await self._release(pod, (namespace, group))
        return None

    def _device_checked(self, pod: Mapping[str, Any], info: SliceRecord) -> bool:
        """Whether the slice's device may be handed on (``Ledger.check_device``: Ready with its device on
        its node's GpuNode, or still Bound onto a device its agent takes without an NVML call); if not
        yet, the pod is looked at again when that GpuNode changes, or at the slice's Ready. A wrong
        device is never handed on."""
        verdict, waited = self.state.check_device(info.uid, time.monotonic())
        if verdict.action == ACCEPT:
            return True
        if info.phase != READY:
            return False  # its Ready event brings the pod here again
        if verdict.action == REFUSE:
            log.warning("slice %s: device refused: %s", info.ref, verdict.message)
            self.events.post(pod, "Warning", verdict.reason,
                             f"GpuSlice {info.ref}: {verdict.message}; the pod stays gated")
            return False
        # Usually the moment between a new instance's Ready and its GpuNode publish: an Event only once
        # the wait is long (seen again at the GpuNode's next publish, at least every heartbeat).
        if waited >= DEVICE_WAIT_EVENT_S:
            self.events.post(pod, "Normal", verdict.reason, f"GpuSlice {info.ref}: {verdict.message}; waiting")
        return False

    async def _release_gate(self, pod: dict[str, Any], info: SliceRecord) -> None:
        key = (info.namespace, group_of(info))
        current = self.pod(key)
        if self.state.ungating(*key) or current is None or not gated(current) or (
                current["metadata"].get("uid") != pod["metadata"].get("uid")):
            return  # being ungated, or ungated while this pass awaited the claim: nothing left to do
        self.state.set_ungating(*key, True)
        try:
            await self._ungate(current, info)
        finally:
            self.state.set_ungating(*key, False)

    async def _ungate(self, pod: dict[str, Any], info: SliceRecord) -> None:
        assert info.binding is not None
        meta = pod["metadata"]
        path = core_path("pods", info.namespace, meta["name"])
        node = info.binding.node
        try:
            answer = await self.client.json_patch(path, ungate_ops(pod, node, hostname(pod, node, self.state.nodes)))
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.status not in (409, 422):
                raise
            fresh = await self.client.get(path)  # changed meanwhile: try again on what it is now
            if not gated(fresh):
                return
            ops = ungate_ops(fresh, node, hostname(fresh, node, self.state.nodes))
            answer = await self.client.json_patch(path, ops)
        key = (info.namespace, group_of(info))
        self.state.put_pod(*key, pod_record(answer, self.state.pod(*key)))
        log.debug("pod %s/%s ungated onto %s", info.namespace, meta["name"], node)

    def revisit(self) -> None:
        """Every pod the books hold that may need a write looked at again (the periodic pass; nothing
        listed): gated, reported Unschedulable, or finished."""
        for (namespace, group), record in self.state.pods_held():
            body = record.body
            if gated(body) or unschedulable(body) is not None or (
                    (body.get("status") or {}).get("phase") in FINISHED_PHASES):
                self.queue.enqueue(("pod", namespace, group))

    async def resync(self) -> None:
        """Every labelled pod listed again (the full read, after a restart or failover): none is left gated
        without cause. A pod the books hold that the list lacks, known from before the list was read, is
        running or gone: a watch that lists again reports no DELETED for what left meanwhile."""
        pods, listed_at = await self.client.list_at("/api/v1/pods", label_selector=POD_SLICE_LABEL,
                                                    field_selector=POD_WATCH_FIELDS, keep=pod_body)
        listed = set()
        for pod in pods:
            meta = pod["metadata"]
            listed.add((meta["namespace"], (meta.get("labels") or {}).get(POD_SLICE_LABEL)))
            await self.pod_event(pod, deleted=False)
        for key, record in self.state.pods_held():
            if key not in listed and listed_at and record.version <= listed_at:
                self.state.remove_pod(*key)
