"""Whether a node's NVIDIA container toolkit can be trusted to hand out GPUs only through claims.

The toolkit mounts every GPU that ``NVIDIA_VISIBLE_DEVICES`` names into a container; with
``accept-nvidia-visible-devices-envvar-when-unprivileged`` true (its default when the key is absent)
it does so for unprivileged containers too, and the variable may come from the image's ``ENV``
(every CUDA base image sets ``all``), which no admission policy sees. So on such a node any pod of any
namespace can take every GPU, slices included. The agent reads the node's toolkit configuration and
publishes the answer as its GpuNode's ``RuntimeTrusted`` condition; the controller places no new
slice on a node whose condition is False unless an admin labels the node
``cdmo.io/runtime-trust=accepted``.

The controller reads the condition back (``untrusted_from_conditions``): only False keeps new slices
off the node (``core.placement.node_blocks``). True and Unknown place as usual: Unknown means the agent found no
configuration to read, as on a node whose runtime hands devices over through CDI alone (containerd's
CDI support, no NVIDIA runtime), where nothing reads that variable; refusing those would stop the
safest nodes. Slices already bound stay in every case.

Pure: the caller reads the file (or the reason it could not) and writes the condition.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

CONDITION_TYPE = "RuntimeTrusted"
SETTING = "accept-nvidia-visible-devices-envvar-when-unprivileged"
DEFAULT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
TRUST_LABEL = "cdmo.io/runtime-trust"
TRUST_VALUE = "accepted"
MAX_MESSAGE = 4096  # the GpuNode CRD's limit on a condition's message

# Reasons (CamelCase, as Kubernetes reasons are).
REASON_REFUSED = "EnvvarRefusedWhenUnprivileged"  # True: the setting is false
REASON_ACCEPTED = "EnvvarAcceptedWhenUnprivileged"  # False: the setting is true
REASON_DEFAULT = "EnvvarAcceptedByDefault"  # False: the setting is absent (the toolkit's default is true)
REASON_UNREADABLE = "ToolkitConfigUnreadable"  # Unknown: the file cannot be read
REASON_INVALID = "ToolkitConfigInvalid"  # Unknown: not TOML, or the setting is not a boolean

_FIX = (f"set {SETTING} = false in it (the toolkit reads it as each container starts; containers already "
        "running keep the GPUs they got); the agent gets its own GPUs as a privileged container, which this "
        "setting does not affect")


@dataclass(frozen=True)
class RuntimeCheck:
    """The ``RuntimeTrusted`` condition of one node, without its transition time."""

    node: str
    path: str
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str

    def condition(self, last_transition_time: str) -> dict[str, str]:
        """The GpuNode condition (Kubernetes' condition shape)."""
        return {"type": CONDITION_TYPE, "status": self.status, "reason": self.reason,
                "message": self.message[:MAX_MESSAGE], "lastTransitionTime": last_transition_time}


def check_toolkit_config(node: str, path: str, text: str | None, error: str = "") -> RuntimeCheck:
    """The check of the toolkit configuration ``text`` read from ``path`` on ``node``; ``text`` None:
    it could not be read, for the reason ``error``."""
    untrusted = (f"any pod on node {node} can take every GPU of the node, slices included, through "
                 "NVIDIA_VISIBLE_DEVICES in its image (which no admission policy sees): no new slice is placed "
                 f"here unless the node is labelled {TRUST_LABEL}={TRUST_VALUE}. Fix: {_FIX}")
    if text is None:
        return RuntimeCheck(node, path, "Unknown", REASON_UNREADABLE, (
            f"cannot read the NVIDIA container toolkit configuration {path} ({error or 'no such file'}) to see "
            f"whether {SETTING} is false. Mount the node's toolkit configuration into the agent (chart value "
            "agent.toolkitConfig, flag --toolkit-config) and make sure it says "
            f"{SETTING} = false"))
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return RuntimeCheck(node, path, "Unknown", REASON_INVALID,
                            f"{path} is not valid TOML ({exc}), so whether {SETTING} is false is unknown; "
                            f"{_FIX}")
    if SETTING not in config:
        return RuntimeCheck(node, path, "False", REASON_DEFAULT,
                            f"{path} does not set {SETTING}, and the toolkit's default is true: {untrusted}")
    value = config[SETTING]
    if value is True:
        return RuntimeCheck(node, path, "False", REASON_ACCEPTED, f"{path} sets {SETTING} = true: {untrusted}")
    if value is False:
        return RuntimeCheck(node, path, "True", REASON_REFUSED, (
            f"{path} sets {SETTING} = false: the NVIDIA container toolkit on node {node} ignores "
            "NVIDIA_VISIBLE_DEVICES from unprivileged containers, so GPUs reach pods only through their claims"))
    return RuntimeCheck(node, path, "Unknown", REASON_INVALID,
                        f"{path} sets {SETTING} = {str(value)[:40]!r}, not a boolean (true or false); {_FIX}")


# ---- read back by the controller ------------------------------------------------------------------

# Kept short in a slice's message (the condition's own message may be as long as MAX_MESSAGE).
_CONDITION_MESSAGE_SHOWN = 1500


def untrusted_from_conditions(conditions: object) -> str | None:
    """The message of a GpuNode's ``RuntimeTrusted`` condition when its status is ``False`` (the node
    takes no new slice unless accepted), else None: True, Unknown, absent or malformed conditions
    place as usual (an agent that publishes no such condition says nothing)."""
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
    return str((labels or {}).get(TRUST_LABEL, "")).strip() == TRUST_VALUE


def untrusted_message(node: str, condition_message: str) -> str:
    """Why a node takes no new slice, and the two ways out, for the reason of a slice that can only
    go there."""
    return (
        f"node {node} has GpuNode condition {CONDITION_TYPE}=False ({condition_message}): no new slice is placed "
        f"there (slices already there are kept). Fix the toolkit's configuration, or, to accept it knowingly, "
        f"kubectl label node {node} {TRUST_LABEL}={TRUST_VALUE}"
    )
