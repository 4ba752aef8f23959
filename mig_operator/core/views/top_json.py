"""``mig-operator top --json``: the stable shape of a ``core.views.top_view.TopView`` for scripts; keys and
meanings are documented in docs/operations.md."""

from __future__ import annotations

from typing import Any

from ..usage.advice import Advice
from ..usage.figures import SliceUsage, usage_status
from .top_view import TopView


def _usage(usage: SliceUsage | None, advice: Advice | None) -> dict[str, Any] | None:
    """A slice's ``status.usage`` as read back (the same keys); None while it has none."""
    return usage_status(usage, advice) if usage is not None else None


def view_json(view: TopView) -> dict[str, Any]:
    """``top --json``: keys and meanings are documented in docs/operations.md and kept stable. One
    namespace's picture (``view.namespace``) has no nodes and a key more, ``slices``."""
    shape = {
        "nodes": [{
            "name": n.name, "observedAt": n.observed_at,
            "gpus": [{
                "index": g.index, "product": g.product, "model": g.model, "memoryBytes": g.memory_bytes,
                "mode": "mig" if g.mig else "fraction", "serves": g.serves, "servesReason": g.serves_reason,
                "slots": g.slots, "slotStates": list(g.slot_states), "slotCounts": g.slot_counts() if g.mig else {},
                "grantedBytes": g.granted_bytes, "compute": g.compute,
                "healthy": not g.unhealthy, "unhealthyReason": g.unhealthy,
                "instances": [{
                    "label": s.label, "start": s.start, "size": s.size, "profile": s.profile, "state": s.state,
                    "slice": s.slice, "sliceUID": s.slice_uid, "deviceUUID": s.device_uuid, "drawn": s.drawn,
                    "compute": s.compute, "usage": _usage(s.usage, s.advice),
                } for s in g.spans],
                "fractions": [{
                    "label": s.label, "slice": s.slice, "sliceUID": s.slice_uid, "bytes": s.bytes, "state": s.state,
                    "compute": s.compute, "usage": _usage(s.usage, s.advice),
                } for s in g.shares],
            } for g in n.gpus],
        } for n in view.nodes],
        "pending": {"total": sum(view.pending.values()), "byReason": dict(view.pending)},
        "waitingForNode": dict(view.waiting_for_node),
        "quotas": {
            "state": view.quota_state, "note": view.quota_note,
            "items": [{
                "namespace": q.namespace, "name": q.name, "usedBytes": q.used_bytes, "hardBytes": q.hard_bytes,
                "usedSlices": q.used_slices, "hardSlices": q.hard_slices, "waiting": q.waiting,
                "wholeGpus": q.whole_gpus,
            } for q in view.quotas],
        },
    }
    if view.namespace:
        shape["slices"] = [{
            "namespace": s.ref.partition("/")[0], "name": s.ref.partition("/")[2], "node": s.node, "gpu": s.gpu,
            "mode": s.mode, "profile": s.profile, "bytes": s.granted_bytes, "phase": s.phase, "reason": s.reason,
            "compute": s.compute, "usage": _usage(s.usage, s.advice),
        } for s in view.slices]
    return shape
