"""What the admission webhook does to a pod that asks for a slice with an annotation.

It checks the annotation with core's slice rules (a bad value is refused at admission, the message
naming the annotation, the value and a valid example) and refuses a pod that also asks for whole
GPUs or MIG devices through the device plugin, or whose containers set in ``env`` what the slice's
ConfigMap sets (``env`` wins over ``envFrom``). Otherwise it adds, at creation (the only time the
API allows it): a scheduling gate, so the pod waits for its slice; a label naming the pod's slice
(and ConfigMap), so the controller finds the pod with a server-side selector; ``envFrom`` of that
ConfigMap and the shim's host directory, read-only, in every container and init container (a pod's
environment cannot change after creation, so the controller fills the ConfigMap in later).

The slice's name is made here: a pod made from ``generateName`` has no name yet at admission.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from mig_operator.core.environment import DEVICES_VARIABLE, LIMIT_VARIABLE, PRELOAD_VARIABLE, SLICE_VARIABLE
from mig_operator.core.quantities import MEMORY_EXAMPLE, clip_repr
from mig_operator.core.request import PROFILE_EXAMPLE, SliceRequest
from mig_operator.core.slice_spec import (
    ANNOTATION_MEMORY,
    ANNOTATION_PROFILE,
    REQUEST_ANNOTATIONS,
    request_from_annotations,
)

from ..common.names import POD_SLICE_LABEL, SCHEDULING_GATE, SHIM_HOST_DIR, SHIM_MOUNT_DIR, SHIM_VOLUME

# Device-plugin resources a sliced pod must not also ask for: the slice is its GPU. ``nvidia.com/gpu``
# and its renamed shares (``nvidia.com/gpu.shared`` with the device plugin's time-slicing), and MIG devices.
_WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
_GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu.", "nvidia.com/mig-")
# Variables the slice's ConfigMap sets: a container's own ``env`` entry would win over ``envFrom`` and
# hide the slice (``NVIDIA_VISIBLE_DEVICES=all`` shows the whole GPU; another ``LD_PRELOAD`` drops the
# shim that enforces a fraction's limit). GPU_MEM_LIMIT_GB is informational and may be set.
_SLICE_ENV = (DEVICES_VARIABLE, LIMIT_VARIABLE, SLICE_VARIABLE)
_SHIM_ENV = PRELOAD_VARIABLE


class PodRefused(ValueError):
    """The pod cannot be admitted; the message says why and what to write instead."""


class RefusalsAtInfo(logging.Filter):
    """For the ``kopf.objects`` logger: a pod refused at admission is the user's request turned down,
    not an operator error, so kopf's ``ERROR Webhook '<id>' failed permanently: ...`` (how it logs the
    handler's ``AdmissionError``) becomes one INFO line naming the namespace and the pod. Every other
    failure of the handler (kopf says "failed with an exception") stays an ERROR."""

    def __init__(self, handler_id: str) -> None:
        super().__init__()
        self._prefix = f"Webhook {handler_id!r} failed permanently: "

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not str(record.msg).startswith(self._prefix):
            return True
        ref = getattr(record, "k8s_ref", None) or {}
        pod = f"{ref.get('namespace') or '?'}/{ref.get('name') or '(name not yet generated)'}"
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg, record.args = f"pod {pod} refused at admission: {str(record.msg)[len(self._prefix):]}", None
        # The logger's level let an ERROR through; an INFO line is shown only where INFO is asked for.
        return logging.getLogger().isEnabledFor(logging.INFO)


@dataclass(frozen=True)
class ShimMount:
    host_dir: str = SHIM_HOST_DIR
    mount_dir: str = SHIM_MOUNT_DIR


def slice_name_for(pod: Mapping[str, Any], token: str | None = None) -> str:
    """A name for the pod's GpuSlice and ConfigMap, unique without knowing the pod's final name:
    the pod's name (or generateName) cut to 40 characters, ``-gs-`` and 8 random hex digits. It is
    also a label value, so it stays within 63 characters and ends alphanumeric."""
    meta = pod.get("metadata") or {}
    base = (meta.get("name") or meta.get("generateName") or "pod").strip("-.")[:40].rstrip("-.") or "pod"
    return f"{base}-gs-{token or secrets.token_hex(4)}"


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("containers") or []) + list(spec.get("initContainers") or [])


def _gpu_resource(key: str) -> bool:
    return key == _WHOLE_GPU_RESOURCE or key.startswith(_GPU_RESOURCE_PREFIXES)


def check_pod(pod: Mapping[str, Any]) -> SliceRequest | None:
    """The pod's slice request, None when it asks for none; raises PodRefused or core's
    QuantityError/RequestError. Every message names the annotation, its value and what to write."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    request = request_from_annotations(annotations)
    if request is None:
        return None
    key = next(k for k in REQUEST_ANNOTATIONS if k in annotations)
    asked = f"annotation {key}: {clip_repr(annotations[key])}"
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
            if var in _SLICE_ENV:
                raise PodRefused(
                    f"container {name} sets {var} in env, which would hide the value its slice gives it "
                    f"({asked}); drop that env entry: the operator sets {var} from the slice"
                )
            if var == _SHIM_ENV and request.profile is None:
                raise PodRefused(
                    f"container {name} sets {_SHIM_ENV} in env, which would replace the shim that enforces "
                    f"the memory limit when the slice is a fraction ({asked}); drop that env entry, or ask "
                    f"for a MIG instance by name ({ANNOTATION_PROFILE}: '{PROFILE_EXAMPLE}'), which needs no shim"
                )
    return request


def mutate_pod(pod: MutableMapping[str, Any], slice_name: str, shim: ShimMount | None = None) -> None:
    """Add the gate, the slice label, ``envFrom`` and the shim volume to ``pod`` (in place).

    The pod always gets ``slice_name``, its own: a pod that arrives carrying the slice label already
    (copied from a sliced pod, e.g. ``kubectl get pod -o yaml``) would otherwise run on the other
    pod's device. The ``envFrom`` of the ConfigMap the old label names is dropped; the gate, the
    volume and the mounts are never doubled.
    """
    shim = shim or ShimMount()
    meta = pod.setdefault("metadata", {})
    labels = dict(meta.get("labels") or {})
    stale = labels.get(POD_SLICE_LABEL)
    labels[POD_SLICE_LABEL] = slice_name
    meta["labels"] = labels
    spec = pod.setdefault("spec", {})
    gates = list(spec.get("schedulingGates") or [])
    if not any(g.get("name") == SCHEDULING_GATE for g in gates):
        gates.append({"name": SCHEDULING_GATE})
    spec["schedulingGates"] = gates
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != SHIM_VOLUME]
    # Directory, not DirectoryOrCreate: on a node where the agent never installed the shim the pod
    # fails to start, rather than run a fraction with no limit (ld.so skips a missing LD_PRELOAD).
    volumes.append({"name": SHIM_VOLUME, "hostPath": {"path": shim.host_dir, "type": "Directory"}})
    spec["volumes"] = volumes
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            env_from = [e for e in container.get("envFrom") or []
                        if not stale or (e.get("configMapRef") or {}).get("name") not in (stale, slice_name)]
            env_from.append({"configMapRef": {"name": slice_name}})
            container["envFrom"] = env_from
            mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != SHIM_VOLUME]
            mounts.append({"name": SHIM_VOLUME, "mountPath": shim.mount_dir, "readOnly": True})
            container["volumeMounts"] = mounts
