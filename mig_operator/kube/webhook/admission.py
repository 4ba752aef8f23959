"""What the admission webhook does to a pod that asks for a slice with an annotation.

It checks the pod with ``core.pod_admission.check_pod`` (the controller checks it again before it
makes the slice). Then it adds, at creation (the only time the
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

from ..common.names import POD_SLICE_LABEL, SCHEDULING_GATE, SHIM_HOST_DIR, SHIM_MOUNT_DIR, SHIM_VOLUME


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
