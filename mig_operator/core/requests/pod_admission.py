"""Whether a pod that asks for a slice by annotation may have one: pure, so that the webhook checks
it at admission and the controller checks it again before it makes the slice (a pod can be made with
the slice label and gate but no annotation, so no webhook sees it, and be annotated later).

The annotation is checked with core's slice rules (a bad value is refused, the message naming the
annotation, the value and a valid example). A pod is also refused when it asks for whole GPUs or MIG
devices through the device plugin as well, sets ``spec.nodeName``, or when a container sets in its own
``env`` a variable the slice gives it or the shim reads (``env`` wins over ``envFrom``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..node.environment import DEVICES_VARIABLE, LIMIT_VARIABLE, PRELOAD_VARIABLE, SLICE_VARIABLE
from .quantities import MEMORY_EXAMPLE, QuantityError, clip_repr
from .request import PROFILE_EXAMPLE, SliceRequest
from .request_forms import PodDevice, pod_devices
from .slice_spec import ANNOTATION_MEMORY, ANNOTATION_PROFILE, ANNOTATION_REQUESTED, REQUEST_ANNOTATIONS

# Device-plugin resources a sliced pod must not also ask for: the slice is its GPU. ``nvidia.com/gpu``
# and its renamed shares (``nvidia.com/gpu.shared`` with the device plugin's time-slicing), and MIG devices.
_WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
_GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/mig-")
# Variables the slice's CDI spec sets: a container's own ``env`` entry would stand beside them and
# widen or hide the slice (``NVIDIA_VISIBLE_DEVICES=all`` shows the whole GPU where a runtime hook
# honours it). A container's ``LD_PRELOAD`` cannot unload the shim, which the spec's read-only
# /etc/ld.so.preload loads; where a pod may get a fraction it is still refused, the strict rule kept
# until the tenancy work decides whether tenants may preload libraries of their own.
# GPU_MEM_LIMIT_GB is informational and may be set.
_SLICE_ENV = (DEVICES_VARIABLE, LIMIT_VARIABLE, SLICE_VARIABLE)
_SHIM_ENV = PRELOAD_VARIABLE
# Every CDMO_* variable is the operator's or the shim's to set (CDMO_GPU_MEMORY_LIMIT,
# CDMO_SHIM_FOOTPRINT, ...): a container that sets one could loosen its own limit or accounting.
OPERATOR_ENV_PREFIX = "CDMO_"


class PodRefused(ValueError):
    """The pod cannot be admitted; the message says why and what to write instead."""




def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("containers") or []) + list(spec.get("initContainers") or [])


def _gpu_resource(key: str) -> bool:
    return key == _WHOLE_GPU_RESOURCE or key.startswith(_GPU_RESOURCE_PREFIXES)


def check_pod(pod: Mapping[str, Any]) -> SliceRequest | None:
    """The request of the pod's (first) device, None when it asks for none (``check_pod_devices``)."""
    devices = check_pod_devices(pod)
    return devices[0].request if devices else None


@dataclass(frozen=True)
class PodAsk:
    """What a pod asks for, read once as the pod is observed (``pod_ask``): its devices (none: it asks
    for nothing), or why it gets none (``reason``: InvalidAnnotation or Refused, and ``message``)."""

    devices: tuple[PodDevice, ...] = ()
    reason: str = ""
    message: str = ""


def pod_ask_inputs(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ``pod_ask`` reads of the pod: an equal tuple gives an equal ask."""
    spec = pod.get("spec") or {}
    return ((pod.get("metadata") or {}).get("annotations") or {}, spec.get("nodeName"),
            spec.get("containers"), spec.get("initContainers"))


def pod_ask(pod: Mapping[str, Any]) -> PodAsk:
    """``check_pod_devices`` as a record: the devices, or the refusal's reason and message."""
    try:
        return PodAsk(check_pod_devices(pod))
    except QuantityError as exc:
        return PodAsk(reason="InvalidAnnotation", message=str(exc))
    except PodRefused as exc:
        return PodAsk(reason="Refused", message=str(exc))


def check_pod_devices(pod: Mapping[str, Any]) -> tuple[PodDevice, ...]:
    """The devices the pod asks for (``core.requests.request_forms.pod_devices``), none when it asks for none;
    raises PodRefused or core's QuantityError/RequestError. Every message names the annotation, its
    value and what to write."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    devices = pod_devices(annotations)
    if not devices:
        return ()
    key = next((k for k in REQUEST_ANNOTATIONS if k in annotations), ANNOTATION_REQUESTED)
    asked = f"annotation {key}: {clip_repr(annotations[key])}"
    # A device that may be a fraction is limited by the preloaded shim; a MIG profile or all of a GPU
    # (fraction 1) is not.
    fraction_possible = any(d.request.profile is None and d.request.fraction != 1.0 for d in devices)
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        raise PodRefused(
            f"the pod sets spec.nodeName {clip_repr(str(spec['nodeName']))} and asks for a slice with {asked}; "
            "a sliced pod waits for its slice and is placed on the slice's node, so leave spec.nodeName out "
            "(a nodeSelector such as kubernetes.io/hostname: gpu-node-1 chooses the node instead)"
        )
    for container in _containers(pod):
        name = clip_repr(container.get("name"))
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for resource in resources.get(kind) or {}:
                if _gpu_resource(str(resource)):
                    raise PodRefused(
                        f"container {name} asks for {clip_repr(str(resource))} and the pod for a slice with "
                        f"{asked}; ask for one or the other: drop resources.{kind}[{clip_repr(str(resource))}] "
                        f"to run on the slice (e.g. {ANNOTATION_MEMORY}: '{MEMORY_EXAMPLE}' alone)"
                    )
        for variable in container.get("env") or []:
            var = variable.get("name")
            if isinstance(var, str) and var.startswith(OPERATOR_ENV_PREFIX) and var not in _SLICE_ENV:
                raise PodRefused(
                    f"container {name} sets {clip_repr(var)} in env; variables named {OPERATOR_ENV_PREFIX}* are the "
                    f"operator's and the shim's to set, not a sliced pod's ({asked}); drop that env entry"
                )
            if var in _SLICE_ENV:
                raise PodRefused(
                    f"container {name} sets {var} in env, which would hide the value its slice gives it "
                    f"({asked}); drop that env entry: the operator sets {var} from the slice"
                )
            if var == _SHIM_ENV and fraction_possible:
                raise PodRefused(
                    f"container {name} sets {_SHIM_ENV} in env, which would replace the shim that enforces "
                    f"the memory limit when the slice is a fraction ({asked}); drop that env entry, or ask "
                    f"for a MIG instance by name ({ANNOTATION_PROFILE}: '{PROFILE_EXAMPLE}'), which needs no shim"
                )
    return devices


