"""GpuSlice status bodies, one function per phase, as the CRD (crds/gpuslice.yaml) defines them.

Every write is a JSON merge patch of ``status``: maps merge (so ``phaseTimes`` gains one key per
phase), lists are replaced (so ``conditions`` is always written whole, keeping the transition time
of a condition whose status did not change).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from mig_operator.core.node.health import DEVICE_HEALTHY_CONDITION, GpuHealth
from mig_operator.core.node.lifecycle import BOUND, CREATING, FAILED, IN_USE, PENDING, READY
from mig_operator.core.placement.cluster import MODE_MIG, Binding
from mig_operator.core.placement.compute import format_compute
from mig_operator.core.requests.request import SliceRequest

BOUND_CONDITION = "Bound"
READY_CONDITION = "Ready"
# On a slice being deleted whose claim is still in use: False with reason InUse (core.node.lifecycle.claim_hold).
RELEASED_CONDITION = "Released"


MAX_MESSAGE = 4096  # the CRD's maxLength of status.message


def seconds_now() -> str:
    """RFC 3339 in UTC to the second: the resolution of a built-in API's timestamps (metav1.Time)."""
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _message(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def now() -> str:
    """RFC 3339 in UTC with milliseconds: phase times are compared at that resolution."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _condition(previous: Mapping | None, kind: str, status: bool, reason: str, message: str, when: str) -> dict:
    value = "True" if status else "False"
    old = next((c for c in (previous or {}).get("conditions") or () if c.get("type") == kind), None)
    since = old.get("lastTransitionTime", when) if old and old.get("status") == value else when
    return {"type": kind, "status": value, "reason": reason, "message": message[:32768], "lastTransitionTime": since}


def _conditions(previous: Mapping | None, bound: tuple[bool, str, str], ready: tuple[bool, str, str],
                when: str) -> list[dict]:
    return [_condition(previous, BOUND_CONDITION, *bound, when), _condition(previous, READY_CONDITION, *ready, when)]


def pending(previous: Mapping | None, request: SliceRequest, reason: str, message: str,
            pool: str | None = None) -> dict:
    """Waiting, with why; ``pool``: the node pool whose new node would take it (reason ``WaitingForNode``),
    None takes ``status.pool`` off (a merge patch's null)."""
    when = now()
    return {
        "phase": PENDING, "reason": reason, "message": _message(message), "request": request.describe(), "pool": pool,
        "conditions": _conditions(previous, (False, reason, message), (False, reason, "not bound yet"), when),
        "phaseTimes": {PENDING: (previous or {}).get("phaseTimes", {}).get(PENDING, when)},
    }


def bound(previous: Mapping | None, request: SliceRequest, binding: Binding, gpu_uuid: str,
          reclaim: list[dict], message: str, mig_compute: str = "") -> dict:
    """The controller's decision: phase Bound with the node, GPU, mode, profile and placement, and
    ``compute`` (core.placement.compute): a fraction's share or ``shared``, a MIG slice's ``mig_compute`` (``3/7``);
    ``status.pool`` taken off (it waits for no node)."""
    when = now()
    body: dict[str, Any] = {
        "phase": BOUND, "reason": "Bound", "message": _message(message), "request": request.describe(),
        "pool": None, "mode": binding.mode, "node": binding.node, "gpu": binding.gpu, "gpuUUID": gpu_uuid,
        "grantedBytes": binding.granted_bytes,
        "conditions": _conditions(previous, (True, "Bound", message), (False, "Bound", "waiting for the node agent"),
                                  when),
        "phaseTimes": {BOUND: when},
    }
    if binding.mode == MODE_MIG:
        body.update(profile=binding.profile, profileId=binding.profile_id,
                    placement={"start": binding.start, "size": binding.size}, reclaim=reclaim)
        if mig_compute:
            body["compute"] = mig_compute
    else:
        body["compute"] = format_compute(binding.compute)
    return body


def creating(previous: Mapping | None, message: str) -> dict:
    """The agent's intent, written before its first NVML call."""
    when = now()
    bound_cond = _condition(previous, BOUND_CONDITION, True, "Bound", "bound", when)
    return {
        "phase": CREATING, "reason": "Creating", "message": _message(message),
        "conditions": [bound_cond, _condition(previous, READY_CONDITION, False, "Creating", message, when)],
        "phaseTimes": {CREATING: when},
    }


def ready(previous: Mapping | None, device_uuid: str, granted_bytes: int, reused: bool, message: str,
          gi_id: int | None = None, ci_id: int | None = None, claim: str = "") -> dict:
    """``claim``: the slice's ResourceClaim (its own name), named in the same write as Ready so that
    the controller, which writes the claim itself, need not write the slice's status again."""
    when = now()
    body: dict[str, Any] = {
        "phase": READY, "reason": "Ready", "message": _message(message), "deviceUUID": device_uuid,
        "grantedBytes": granted_bytes, "reused": reused,
        "conditions": [
            _condition(previous, BOUND_CONDITION, True, "Bound", "bound", when),
            _condition(previous, READY_CONDITION, True, "Reused" if reused else "Created", message, when),
        ],
        "phaseTimes": {READY: when},
    }
    if gi_id is not None:
        body.update(giId=gi_id, ciId=ci_id)
    if claim:
        body["claim"] = claim
    return body


def failed(previous: Mapping | None, reason: str, message: str) -> dict:
    when = now()
    return {
        "phase": FAILED, "reason": reason, "message": _message(message),
        "conditions": [
            _condition(previous, BOUND_CONDITION, bool((previous or {}).get("node")), "Bound", "bound", when),
            _condition(previous, READY_CONDITION, False, reason, message, when),
        ],
        "phaseTimes": {FAILED: when},
    }


def held_in_use(previous: Mapping | None, message: str) -> dict:
    """A deleted slice kept while its claim is in use: condition ``Released`` False, reason InUse,
    naming who holds it, and the same reason and message on the slice (``kubectl get gs`` shows
    them); the phase and the other conditions stay as they are."""
    kept = [c for c in (previous or {}).get("conditions") or () if c.get("type") != RELEASED_CONDITION]
    return {"reason": IN_USE, "message": _message(message),
            "conditions": [*kept, _condition(previous, RELEASED_CONDITION, False, IN_USE, message, now())]}


def serving(previous: Mapping | None, ok: bool, reason: str, message: str) -> dict:
    """A Ready slice whose device stops (``ok`` False) or starts again to serve: its Ready condition
    says so, with the reason, and so do its reason and message; the phase and the other conditions
    stay as they are."""
    kept = [c for c in (previous or {}).get("conditions") or () if c.get("type") != READY_CONDITION]
    return {"reason": reason if not ok else "Ready", "message": _message(message),
            "conditions": [*kept, _condition(previous, READY_CONDITION, ok, reason, message, now())]}


def device_healthy(previous: Mapping | None, health: GpuHealth) -> dict:
    """A Ready slice whose GPU turns unhealthy, or healthy again: its ``DeviceHealthy`` condition says so
    (reason ``Healthy``, ``Xid<N>`` or ``GpuLost``); the phase and the other conditions stay as they are."""
    kept = [c for c in (previous or {}).get("conditions") or () if c.get("type") != DEVICE_HEALTHY_CONDITION]
    message = health.message or "the GPU reports no critical error"
    return {"conditions": [*kept, _condition(previous, DEVICE_HEALTHY_CONDITION, health.healthy, health.reason,
                                             message, now())]}


def released_condition(current: Mapping | None) -> Mapping | None:
    """The slice's Released condition, if it has one."""
    return next((c for c in (current or {}).get("conditions") or () if c.get("type") == RELEASED_CONDITION), None)
