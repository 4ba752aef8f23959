"""What the admission webhook does to a pod that asks for a slice with an annotation.

It checks the pod with ``core.requests.pod_admission.check_pod`` (the controller checks it again before it
makes the slice). Then it adds, at creation (the only time the API allows it): a scheduling gate,
so the pod waits for its slice; a label naming the pod's slice, so the controller finds the pod
with a server-side selector; and the slice's ResourceClaim (same name, written by the controller
when the slice is Ready) in the pod and in every container and init container.

The slice's name is made here: a pod made from ``generateName`` has no name yet at admission.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from mig_operator.core.requests.compat import DialectRequest
from mig_operator.core.requests.quantities import read_integer
from mig_operator.core.requests.request_forms import (
    MigResourceRequest,
    PodDevice,
    device_slice_names,
    resource_form,
    without_resources,
)
from mig_operator.core.requests.slice_spec import ANNOTATION_COMPAT_RECORD

from ..common.names import POD_CLAIM_ENTRY, POD_SLICE_LABEL, SCHEDULING_GATE


def slice_name_for(pod: Mapping[str, Any], token: str | None = None) -> str:
    """A name for the pod's GpuSlices and ResourceClaims, unique without knowing the pod's final name:
    the pod's name (or generateName) cut to 40 characters, ``-gs-`` and 8 random hex digits. It is
    also a label value, so it stays within 63 characters and ends alphanumeric."""
    meta = pod.get("metadata") or {}
    base = (meta.get("name") or meta.get("generateName") or "pod").strip("-.")[:40].rstrip("-.") or "pod"
    return f"{base}-gs-{token or secrets.token_hex(4)}"


def claim_entries(count: int) -> tuple[str, ...]:
    """The pod's claim entry names for its devices: ``gpu-slice`` for one, ``gpu-slice-<k>`` for several."""
    return (POD_CLAIM_ENTRY,) if count == 1 else tuple(f"{POD_CLAIM_ENTRY}-{k}" for k in range(count))


def _ours(entry: object) -> bool:
    text = str(entry)
    return text == POD_CLAIM_ENTRY or (text.startswith(f"{POD_CLAIM_ENTRY}-")
                                        and read_integer(text[len(POD_CLAIM_ENTRY) + 1:]) is not None)


def mutate_pod(pod: MutableMapping[str, Any], group: str, devices: Sequence[PodDevice] | None = None) -> None:
    """Add the gate, the slice label and the claims of the pod's slices to ``pod`` (in place).

    ``devices`` (default: one, seen by every container) are the pod's slices, named
    ``device_slice_names(group, n)``. The pod names each slice's ResourceClaim (same name) in
    ``spec.resourceClaims``, and each container and init container lists, in ``resources.claims``,
    the claims of the devices it sees; the kubelet then hands those devices over through the agent
    (DRA, CDI), to those containers only. Nothing else is added: no env, no volume.

    The pod always gets ``group``, its own: a pod that arrives carrying the slice label already
    (copied from a sliced pod, e.g. ``kubectl get pod -o yaml``) would otherwise run on the other
    pod's devices. Claim entries of the operator's names it already has are replaced, never doubled.
    """
    count = len(devices) if devices else 1
    entries = claim_entries(count)
    names = device_slice_names(group, count)
    meta = pod.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), POD_SLICE_LABEL: group}
    spec = pod.setdefault("spec", {})
    gates = list(spec.get("schedulingGates") or [])
    if not any(g.get("name") == SCHEDULING_GATE for g in gates):
        gates.append({"name": SCHEDULING_GATE})
    spec["schedulingGates"] = gates
    claims = [c for c in spec.get("resourceClaims") or [] if not _ours(c.get("name"))]
    claims += [{"name": entry, "resourceClaimName": name} for entry, name in zip(entries, names, strict=True)]
    spec["resourceClaims"] = claims
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            seen = [entry for entry, device in zip(entries, devices or [None], strict=True)
                    if device is None or device.containers is None or container.get("name") in device.containers]
            if not seen:
                continue
            resources = container.setdefault("resources", {})
            used = [c for c in resources.get("claims") or [] if not _ours(c.get("name"))]
            used += [{"name": entry} for entry in seen]
            resources["claims"] = used


def _take_request(pod: MutableMapping[str, Any], annotations: Mapping[str, str],
                  taken: Callable[[object], bool]) -> None:
    """Add ``annotations`` to ``pod`` and take the extended resources ``taken`` accepts out of every
    container and init container (in place)."""
    meta = pod.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
    spec = pod.get("spec") or {}
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            resources = without_resources(container, taken)
            if resources:
                container["resources"] = resources
            else:
                container.pop("resources", None)


def _take_mig_request(pod: MutableMapping[str, Any], asked: MigResourceRequest, whole_gpus: bool) -> None:
    _take_request(pod, asked.annotations(), resource_form(whole_gpus))


def with_mig_request(pod: Mapping[str, Any], asked: MigResourceRequest, whole_gpus: bool = False) -> dict[str, Any]:
    """A copy of ``pod`` as it goes on once its nvidia.com/mig-* (``whole_gpus``: nvidia.com/gpu)
    request is taken: the extended resources out, the record of what was asked in (for the admission
    check)."""
    out = copy.deepcopy(dict(pod))
    _take_mig_request(out, asked, whole_gpus)
    return out


def serve_mig_request(pod: MutableMapping[str, Any], asked: MigResourceRequest, group: str,
                      devices: Sequence[PodDevice], whole_gpus: bool = False) -> None:
    """Turn a pod that asks through nvidia.com/mig-* (``whole_gpus``: nvidia.com/gpu) resources into one
    whose annotation records the request (in place), each container getting the claims of its own
    devices."""
    _take_mig_request(pod, asked, whole_gpus)
    mutate_pod(pod, group, devices)


def _take_dialect_request(pod: MutableMapping[str, Any], asked: DialectRequest) -> None:
    _take_request(pod, {**asked.annotations, ANNOTATION_COMPAT_RECORD: asked.record()},
                  lambda key: key in asked.removed_resources)


def with_dialect_request(pod: Mapping[str, Any], asked: DialectRequest) -> dict[str, Any]:
    """A copy of ``pod`` as it goes on once its seed-platform request is taken: the operator's request
    annotation and the record of what was asked in, the dialect's extended resources out."""
    out = copy.deepcopy(dict(pod))
    _take_dialect_request(out, asked)
    return out


def serve_dialect_request(pod: MutableMapping[str, Any], asked: DialectRequest, group: str,
                          devices: Sequence[PodDevice]) -> None:
    """Turn a pod that asks in a seed platform's form into an annotated pod (in place), the device's
    claim reaching the containers the dialect gives it to."""
    _take_dialect_request(pod, asked)
    mutate_pod(pod, group, devices)
