"""``mig-operator controller``: the cluster-wide controller as a kopf operator.

Replicas elect one active through kopf peering (each with its own priority); a standby resumes
when the active one stops. The admission webhook, when asked for, is served by every replica.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any

import kopf

from mig_operator.core.autoscale.pools import AutoscalingOptions
from mig_operator.core.books.quota import DEFAULT_HOLD_S
from mig_operator.core.placement.compute import SHARED
from mig_operator.core.placement.planner import PlannerSettings

from ..common.client import ApiError, KubeClient
from ..common.events import EventPoster
from ..common.names import (
    CONTROLLER_PREFIX,
    GROUP,
    NODES,
    PEERING_NAME,
    POD_SLICE_LABEL,
    POD_WATCH_FIELDS,
    SLICES,
    VERSION,
)
from ..common.operator import EventFn, on_event, own_identity, register_login, tune
from ..common.probes import Probes, watch_operator
from ..common.supervise import Loops
from ..common.trim import node_body, owned_body, pod_body, slice_body
from .binder import Binder, assemble
from .idle_pods import IdlePods
from .quotas import QUOTAS
from .standing import Standing

log = logging.getLogger("mig_operator.controller")


@dataclass(frozen=True)
class ControllerOptions:
    kubeconfig: str | None = None
    priority: int | None = None  # the peering priority; the CLI derives one per replica (``default_priority``)
    peering: str = PEERING_NAME
    peering_lifetime_s: int = 10
    resync_s: float = 30.0
    # How long a slice waiting for room keeps its namespace's younger slices behind it (fair order).
    fair_hold_s: float = DEFAULT_HOLD_S
    # A namespace without a GpuQuota gets no slice (reason NoQuota).
    quota_required: bool = False
    # The compute of a fraction without spec.compute (core.placement.compute): shared or proportional.
    default_compute: str = SHARED
    # New GPU nodes from a node autoscaler (kube/controller/capacity.py); None: off.
    autoscaling: AutoscalingOptions | None = None


def default_priority() -> int:
    # Two live peers with the same priority both pause (kopf-notes): derive a distinct one per replica.
    return 1 + zlib.crc32(f"{os.uname().nodename}/{os.getpid()}".encode()) % 1_000_000


async def ensure_peering(client: KubeClient, name: str) -> None:
    """Create the ClusterKopfPeering object when missing (its CRD ships in crds/peering.yaml)."""
    body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    try:
        await client.create("/apis/kopf.dev/v1/clusterkopfpeerings", body)
    except ApiError as exc:
        if not exc.conflict:
            raise


def build_registry(options: ControllerOptions, probes: Probes | None = None,
                   loops: Loops | None = None) -> kopf.OperatorRegistry:
    """The controller's kopf registry. ``loops``: its supervised loops (the webhook's server runs there too
    when the process serves it); ``probes``: live while those loops and kopf's tasks are, ready once the
    first full read of the books is done."""
    registry = kopf.OperatorRegistry()
    register_login(registry, options.kubeconfig)
    state: dict[str, Any] = {}
    loops = loops or Loops("controller")
    if probes is not None:
        probes.add(live=loops.unhealthy,
                   ready=lambda: [] if state.get("read") else ["the first full read of the books is not done yet"])
        watch_operator(registry, probes)

    @kopf.on.startup(registry=registry, backoff=2)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        tune(settings, CONTROLLER_PREFIX)
        settings.peering.lifetime = options.peering_lifetime_s
        # Nodes are watched whole: the ledger keeps every Node's labels and taints (where a pod may go, and the
        # labels placement reads); an event whose labels change nothing placement reads costs a comparison.
        settings.watching.label_selectors["v1", "pods"] = POD_SLICE_LABEL  # only pods the webhook marked
        settings.watching.field_selectors["v1", "pods"] = POD_WATCH_FIELDS  # and not Running
        client = KubeClient.from_environment(options.kubeconfig)
        await ensure_peering(client, options.peering)
        events = EventPoster(client, "mig-operator-controller", os.uname().nodename, loops)
        binder = assemble(client, events, PlannerSettings(default_compute=options.default_compute),
                          quota_required=options.quota_required, resync_s=options.resync_s,
                          hold_s=options.fair_hold_s, autoscaling=options.autoscaling)
        client.on_back.append(binder.queue.retry_failed_now)  # work that failed while kube-apiserver was away
        # The queue runs only while this replica acts (kopf's peering pauses watches, not queued work).
        standing = Standing(client, binder.queue, options.peering, own_identity(), options.priority or 0)
        loops.start("standing", standing.run)
        idle = IdlePods(client, events, binder.ledger, binder.queue)  # registered on the queue: kind "idle"
        state.update(client=client, binder=binder, pods=binder.pods, idle=idle)
        await binder.resync()
        state["read"] = True

    def autoscaling_changed() -> None:
        """What the new nodes asked for and the nodes kept depend on: slices, pods, nodes, inventories."""
        if state["binder"].autoscaling is not None:
            state["binder"].autoscaling.changed()

    async def slice_event(body: dict[str, Any], type: str | None) -> None:
        binder: Binder = state["binder"]
        autoscaling_changed()
        info = await binder.slice_event(body, deleted=type == "DELETED")  # its key added
        binder.publish_counts()
        state["idle"].slice_event(info, body, deleted=type == "DELETED")  # its pod's idle key, the usage gauges
        if type == "DELETED":
            await state["pods"].slice_deleted(body)  # its pod's key, when the pod waits for it

    async def gpunode_event(body: dict[str, Any], type: str | None) -> None:
        state["binder"].inventory_event(body, deleted=type == "DELETED")
        autoscaling_changed()

    async def gpuquota_event(body: dict[str, Any], type: str | None) -> None:
        # A quota raised, lowered, made or removed: waiting slices are planned again (no restart).
        state["binder"].quota_event(body, deleted=type == "DELETED")  # its namespace's status is written again
        state["idle"].quota_event(body, deleted=type == "DELETED")  # its idlePodTimeout

    async def node_event(body: dict[str, Any], type: str | None) -> None:
        state["binder"].node_event(body["metadata"]["name"], None if type == "DELETED" else body)
        autoscaling_changed()

    async def pod_event(body: dict[str, Any], type: str | None) -> None:
        await state["pods"].pod_event(body, deleted=type == "DELETED")
        autoscaling_changed()

    def listed_first(fn: EventFn) -> EventFn:
        """A watch's listing (events of type None) of any kind, at start or when this standby becomes
        the active replica, stops binding until the books are read afresh (``Binder.listing_event``):
        the first event a resumed replica acts on may be a pod's, whose new slice would otherwise be
        planned on books as old as the replica's last full read."""
        async def observed(body: dict[str, Any], type: str | None) -> None:
            if type is None:
                state["binder"].listing_event()
            await fn(body, type)
        return observed

    # Each kind's transform (kube/common/trim.py) keeps what the handlers and the books read.
    for group, plural, fn, keep in ((GROUP, SLICES, slice_event, slice_body), (GROUP, NODES, gpunode_event, owned_body),
                                    (GROUP, QUOTAS, gpuquota_event, owned_body), ("", "nodes", node_event, node_body),
                                    ("", "pods", pod_event, pod_body)):
        on_event(registry, group, VERSION if group else "v1", plural, listed_first(fn), keep)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if "binder" in state:
            await state["binder"].events.drain()
            await state["client"].close()

    return registry
