"""Whether a node's container runtime can be trusted with slices, as its GpuNode says.

The agent reads its node's NVIDIA container toolkit configuration and publishes a GpuNode condition
``RuntimeTrusted``: ``False`` when the runtime hands GPUs to containers on its own (e.g. it honours
``NVIDIA_VISIBLE_DEVICES`` from unprivileged containers, so any image whose ``ENV`` names ``all``
takes every GPU of the node, past every slice); ``True`` when it does not; ``Unknown`` when the agent
finds no toolkit configuration to read (a node whose runtime knows only CDI, e.g. containerd with CDI
and no NVIDIA runtime, has none, and nothing there reads that variable). The controller places no
new slice on a node whose condition is False (``core.node_blocks``) until an admin fixes the runtime
or labels the Node ``cdmo.io/runtime-trust=accepted``; True and Unknown place as usual, and slices
already bound stay in every case.

Pure: the input is the GpuNode's conditions, the output what placement needs of them.
"""

from __future__ import annotations

from collections.abc import Mapping

CONDITION_TYPE = "RuntimeTrusted"

# The Node label an admin sets to place slices on a node whose runtime is not trusted, knowingly.
ACCEPTED_LABEL = "cdmo.io/runtime-trust"
ACCEPTED_VALUE = "accepted"

# Kept short in a slice's message: the condition's own message is the agent's, of any length.
_CONDITION_MESSAGE_SHOWN = 600


def untrusted_from_conditions(conditions: object) -> str | None:
    """The message of the GpuNode's ``RuntimeTrusted`` condition when its status is ``False`` (the
    node takes no new slice unless accepted), else None: True, Unknown, absent or malformed
    conditions place as usual (an agent that does not publish the condition yet says nothing)."""
    if not isinstance(conditions, list):
        return None
    for cond in conditions:
        if isinstance(cond, Mapping) and cond.get("type") == CONDITION_TYPE:
            if str(cond.get("status")) != "False":
                return None
            message = str(cond.get("message") or cond.get("reason") or "no reason given")
            if len(message) > _CONDITION_MESSAGE_SHOWN:
                message = message[: _CONDITION_MESSAGE_SHOWN - 1] + "…"
            return message
    return None


def accepted(labels: Mapping[str, str] | None) -> bool:
    """Whether an admin labelled the Node ``cdmo.io/runtime-trust=accepted``."""
    return str((labels or {}).get(ACCEPTED_LABEL, "")).strip() == ACCEPTED_VALUE


def untrusted_message(node: str, condition_message: str) -> str:
    """Why a node takes no new slice, and the two ways out, for the reason of a slice that can only
    go there."""
    return (
        f"node {node} has GpuNode condition {CONDITION_TYPE}=False ({condition_message}): its container runtime "
        f"could hand GPUs to containers outside their slices, so no new slice is placed there (slices already "
        f"there are kept). Fix the runtime's configuration, or, to accept it knowingly, "
        f"kubectl label node {node} {ACCEPTED_LABEL}={ACCEPTED_VALUE}"
    )
