"""A GPU's health: which Xid errors take a GPU out of service, and the words its GpuNode and slices use.

NVML reports an Xid (an error the driver logged for a GPU) through its event set, and a GPU that fell
off the bus as ``GPU_IS_LOST`` on any call. Most Xids an application causes (an illegal address, a
graphics exception) say nothing about the GPU: NVIDIA's device plugin skips 13, 31, 43, 45, 68 and 109
by default, and so does ``xid_critical``; every other Xid marks the GPU unhealthy until it is reset.

An admin who dealt with a GPU's error (reset it) clears the Xid the agent keeps with a time on the Node
(``cleared_at``): every Xid the agent saw at or before it is forgotten (``xids_to_clear``); a GPU NVML
still reports lost stays unhealthy.

An unhealthy GPU takes no new slice and its idle instances are not reused (``core.placement``); its
GpuNode entry carries the ``Healthy`` condition, and each slice realised on it ``DeviceHealthy``.
Pure: the inputs are what NVML reported or what a GpuNode's status says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

# The condition on each GPU of a GpuNode (status.gpus[].conditions) and on each slice realised there.
HEALTHY_CONDITION = "Healthy"
DEVICE_HEALTHY_CONDITION = "DeviceHealthy"
# Reasons: a GPU fine; one NVML cannot reach (fell off the bus); an Xid's is ``Xid<N>``.
HEALTHY_REASON = "Healthy"
GPU_LOST = "GpuLost"
# The refusal code of a slice whose only GPUs in reach are unhealthy.
GPU_UNHEALTHY = "GpuUnhealthy"

# Xids an application causes, not the GPU (NVIDIA's k8s-device-plugin default skip list).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# What the common critical Xids mean (NVIDIA's Xid catalog), for messages; others are named by number.
XID_MEANINGS: Mapping[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "the GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    154: "the GPU needs a recovery action",
}


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health: ``reason`` is ``Healthy``, ``Xid<N>`` or ``GpuLost``; ``message`` says what
    happened and what to do."""

    healthy: bool = True
    reason: str = HEALTHY_REASON
    message: str = ""


HEALTHY = GpuHealth()


def xid_critical(xid: int) -> bool:
    """True when Xid ``xid`` takes the GPU out of service (everything but the application Xids)."""
    return xid not in APPLICATION_XIDS


def xid_health(index: int, xid: int) -> GpuHealth:
    """The health of GPU ``index`` after critical Xid ``xid``."""
    meaning = XID_MEANINGS.get(xid, "a critical error")
    return GpuHealth(False, f"Xid{xid}", f"GPU {index} reported Xid {xid} ({meaning}); it takes no new slice "
                                         "until it is reset")


def lost_health(index: int) -> GpuHealth:
    """The health of GPU ``index`` once NVML answers ``GPU_IS_LOST``."""
    return GpuHealth(False, GPU_LOST, f"GPU {index} is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus or "
                                      "stopped answering; it takes no new slice until it is reset")


def condition(kind: str, health: GpuHealth, since: str) -> dict[str, str]:
    """The ``Healthy`` (GPU) or ``DeviceHealthy`` (slice) condition of ``health``, last changed at ``since``."""
    message = health.message or "NVML reports no critical error"
    return {"type": kind, "status": "True" if health.healthy else "False", "reason": health.reason,
            "message": message, "lastTransitionTime": since}


def health_from_conditions(conditions: object) -> GpuHealth:
    """A GpuNode GPU entry's health, from its ``Healthy`` condition; healthy when there is none (an
    agent that does not publish it) or it is not False."""
    for raw in conditions if isinstance(conditions, list) else ():
        if isinstance(raw, Mapping) and raw.get("type") == HEALTHY_CONDITION and raw.get("status") == "False":
            return GpuHealth(False, str(raw.get("reason") or "Unhealthy"), str(raw.get("message") or ""))
    return HEALTHY


def unhealthy_note(unhealthy: Mapping[tuple[str, int], GpuHealth]) -> str:
    """The unhealthy GPUs in a slice's reach, for its refusal: each ``GPU <i> of node <n> (<reason>)``,
    at most five named."""
    shown = sorted(unhealthy)[:5]
    named = ", ".join(f"GPU {i} of node {n} ({unhealthy[(n, i)].reason})" for n, i in shown)
    more = f" and {len(unhealthy) - len(shown)} more" if len(unhealthy) > len(shown) else ""
    if len(unhealthy) == 1:
        return f"{named} is unhealthy and takes no new slice"
    return f"{len(unhealthy)} GPUs are unhealthy and take no new slice: {named}{more}"


def cleared_at(value: str) -> datetime:
    """The time in an admin's clear mark (RFC 3339, as ``date -u +%Y-%m-%dT%H:%M:%SZ`` writes it);
    ValueError naming the value and a valid example otherwise."""
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise ValueError(f"{value[:64]!r} is not an RFC 3339 time with its zone; e.g. 2026-11-27T18:00:00Z")
    return when.astimezone(UTC)


def xids_to_clear(health: Mapping[int, GpuHealth], seen: Mapping[int, str], cleared: datetime) -> list[int]:
    """The GPUs whose critical Xid an admin's clear mark at ``cleared`` forgets: unhealthy by an Xid
    (``Xid<N>``, not ``GpuLost``) first seen (``seen``, RFC 3339) at or before that time."""
    return sorted(index for index, h in health.items()
                  if not h.healthy and h.reason.startswith("Xid") and index in seen
                  and datetime.fromisoformat(seen[index]) <= cleared)
