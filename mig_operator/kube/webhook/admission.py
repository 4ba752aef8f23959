"""What the admission webhook does to a pod that asks for a slice with an annotation.

It checks the annotation with core's slice rules (a bad value is refused at admission, the message
naming the annotation, the value and a valid example) and refuses a pod that also asks for whole
GPUs or MIG devices through the device plugin. Otherwise it adds, at creation (the only time the
API allows it): a scheduling gate, so the pod waits for its slice; a label naming the pod's slice
(and ConfigMap), so the controller finds the pod with a server-side selector; ``envFrom`` of that
ConfigMap and the shim's host directory, read-only, in every container and init container (a pod's
environment cannot change after creation, so the controller fills the ConfigMap in later).

The slice's name is made here: a pod made from ``generateName`` has no name yet at admission.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from mig_operator.core.request import SliceRequest
from mig_operator.core.slice_spec import request_from_annotations

from ..common.names import POD_SLICE_LABEL, SCHEDULING_GATE, SHIM_HOST_DIR, SHIM_MOUNT_DIR, SHIM_VOLUME

# Device-plugin resources a sliced pod must not also ask for: the slice is its GPU.
_WHOLE_GPU_RESOURCES = ("nvidia.com/gpu",)
_MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


class PodRefused(ValueError):
    """The pod cannot be admitted; the message says why and what to write instead."""


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


def check_pod(pod: Mapping[str, Any]) -> SliceRequest | None:
    """The pod's slice request, None when it asks for none; raises PodRefused or core's
    QuantityError/RequestError (whose messages name the annotation, the value and an example)."""
    request = request_from_annotations((pod.get("metadata") or {}).get("annotations"))
    if request is None:
        return None
    if (pod.get("spec") or {}).get("nodeName"):
        raise PodRefused(
            f"the pod sets spec.nodeName {str(pod['spec']['nodeName'])[:100]!r} and asks for a slice "
            f"({request.describe()}); a sliced pod waits for its slice and is placed on the slice's node, "
            "so leave spec.nodeName out (a nodeSelector such as kubernetes.io/hostname also pins it)"
        )
    for container in _containers(pod):
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for key in resources.get(kind) or {}:
                if key in _WHOLE_GPU_RESOURCES or key.startswith(_MIG_RESOURCE_PREFIX):
                    raise PodRefused(
                        f"container {container.get('name')!r} asks for {key} and the pod for a slice "
                        f"({request.describe()}); ask for one or the other: drop resources.{kind}.{key} "
                        "to run on the slice"
                    )
    return request


def mutate_pod(pod: MutableMapping[str, Any], slice_name: str, shim: ShimMount | None = None) -> None:
    """Add the gate, the slice label, ``envFrom`` and the shim volume to ``pod`` (in place).

    Idempotent: a pod that already carries the slice label is left as it is (a re-invoked webhook).
    """
    shim = shim or ShimMount()
    meta = pod.setdefault("metadata", {})
    labels = meta.get("labels") or {}
    if POD_SLICE_LABEL in labels:
        return
    meta["labels"] = {**labels, POD_SLICE_LABEL: slice_name}
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
            env_from = list(container.get("envFrom") or [])
            env_from.append({"configMapRef": {"name": slice_name}})
            container["envFrom"] = env_from
            mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != SHIM_VOLUME]
            mounts.append({"name": SHIM_VOLUME, "mountPath": shim.mount_dir, "readOnly": True})
            container["volumeMounts"] = mounts
