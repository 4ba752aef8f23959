"""What the admission webhook does to a pod that asks for a slice with an annotation.

It checks the pod with ``core.pod_admission.check_pod`` (the controller checks it again before it
makes the slice). Then it adds, at creation (the only time the API allows it): a scheduling gate,
so the pod waits for its slice; a label naming the pod's slice, so the controller finds the pod
with a server-side selector; and the slice's ResourceClaim (same name, written by the controller
when the slice is Ready) in the pod and in every container and init container.

The slice's name is made here: a pod made from ``generateName`` has no name yet at admission.
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Collection, Mapping, MutableMapping
from typing import Any

from mig_operator.core.request_forms import MigResourceRequest, without_mig_resources

from ..common.names import POD_CLAIM_ENTRY, POD_SLICE_LABEL, SCHEDULING_GATE


class RefusalsAtInfo(logging.Filter):
    """For the ``kopf.objects`` logger: a pod refused at admission is the user's request turned down,
    not an operator error, so kopf's ``ERROR Webhook '<id>' failed permanently: ...`` (how it logs the
    handler's ``AdmissionError``) becomes one INFO line naming the namespace and the pod. Every other
    failure of the handler (kopf says "failed with an exception") stays an ERROR."""

    def __init__(self, *handler_ids: str) -> None:
        super().__init__()
        self._prefixes = tuple(f"Webhook {handler_id!r} failed permanently: " for handler_id in handler_ids)

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = next((p for p in self._prefixes if str(record.msg).startswith(p)), None)
        if record.levelno != logging.ERROR or prefix is None:
            return True
        ref = getattr(record, "k8s_ref", None) or {}
        pod = f"{ref.get('namespace') or '?'}/{ref.get('name') or '(name not yet generated)'}"
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg, record.args = f"pod {pod} refused at admission: {str(record.msg)[len(prefix):]}", None
        # The logger's level let an ERROR through; an INFO line is shown only where INFO is asked for.
        return logging.getLogger().isEnabledFor(logging.INFO)


def slice_name_for(pod: Mapping[str, Any], token: str | None = None) -> str:
    """A name for the pod's GpuSlice and ConfigMap, unique without knowing the pod's final name:
    the pod's name (or generateName) cut to 40 characters, ``-gs-`` and 8 random hex digits. It is
    also a label value, so it stays within 63 characters and ends alphanumeric."""
    meta = pod.get("metadata") or {}
    base = (meta.get("name") or meta.get("generateName") or "pod").strip("-.")[:40].rstrip("-.") or "pod"
    return f"{base}-gs-{token or secrets.token_hex(4)}"


def mutate_pod(pod: MutableMapping[str, Any], slice_name: str, containers: Collection[str] | None = None) -> None:
    """Add the gate, the slice label and the claim of the pod's slice to ``pod`` (in place).

    The pod names its slice's ResourceClaim (same name) once, in ``spec.resourceClaims``, and every
    container and init container (or only those named in ``containers``) lists it in
    ``resources.claims``; the kubelet then hands the device over through the agent (DRA, CDI), to
    those containers only. Nothing else is added: no env, no volume.

    The pod always gets ``slice_name``, its own: a pod that arrives carrying the slice label already
    (copied from a sliced pod, e.g. ``kubectl get pod -o yaml``) would otherwise run on the other
    pod's device. A claim entry of the operator's name it already has is replaced, never doubled.
    """
    meta = pod.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), POD_SLICE_LABEL: slice_name}
    spec = pod.setdefault("spec", {})
    gates = list(spec.get("schedulingGates") or [])
    if not any(g.get("name") == SCHEDULING_GATE for g in gates):
        gates.append({"name": SCHEDULING_GATE})
    spec["schedulingGates"] = gates
    claims = [c for c in spec.get("resourceClaims") or [] if c.get("name") != POD_CLAIM_ENTRY]
    claims.append({"name": POD_CLAIM_ENTRY, "resourceClaimName": slice_name})
    spec["resourceClaims"] = claims
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            if containers is not None and container.get("name") not in containers:
                continue
            resources = container.setdefault("resources", {})
            used = [c for c in resources.get("claims") or [] if c.get("name") != POD_CLAIM_ENTRY]
            used.append({"name": POD_CLAIM_ENTRY})
            resources["claims"] = used


def _take_mig_request(pod: MutableMapping[str, Any], asked: MigResourceRequest) -> None:
    meta = pod.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), **asked.annotations()}
    spec = pod.get("spec") or {}
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            resources = without_mig_resources(container)
            if resources:
                container["resources"] = resources
            else:
                container.pop("resources", None)


def with_mig_request(pod: Mapping[str, Any], asked: MigResourceRequest) -> dict[str, Any]:
    """A copy of ``pod`` as it goes on once its nvidia.com/mig-* request is taken: the extended resources
    out, the profile annotation and the record of what was asked in (for the admission check)."""
    out = copy.deepcopy(dict(pod))
    _take_mig_request(out, asked)
    return out


def serve_mig_request(pod: MutableMapping[str, Any], asked: MigResourceRequest, slice_name: str) -> None:
    """Turn a pod that asks through nvidia.com/mig-* resources into an annotated pod (in place), whose
    slice's claim reaches only the containers that asked."""
    _take_mig_request(pod, asked)
    mutate_pod(pod, slice_name, containers=asked.containers)
