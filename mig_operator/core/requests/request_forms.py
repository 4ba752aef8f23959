"""The devices a pod asks for, whichever form it asks in (pure: no I/O).

Two forms reach the operator:

* the operator's annotations: one of ``cdmo.io/gpu-memory``, ``cdmo.io/gpu-fraction``,
  ``cdmo.io/mig-profile``, and optionally ``cdmo.io/gpu-count: "N"`` beside it: N devices of that
  request, every container and init container sees all of them (as it sees the one device without
  the count);
* a container's ``resources.limits: {nvidia.com/mig-<profile>: N}``, the name NVIDIA's device plugin
  advertises MIG devices under and the one MIG workloads and ClearML's CDMO queue templates use: N
  MIG devices of that profile for that container alone. ``mig_resource_request`` reads it; the
  webhook then takes the extended resource out (so neither kube-scheduler nor a device plugin needs
  it) and records what was asked in ``ANNOTATION_REQUESTED``, which from then on is the pod's request.

``pod_devices`` turns either into the pod's devices, each one GpuSlice: the webhook gives the pod a
claim per device, the controller makes the slices and has them planned as one group, all on one
node or none (``docs/api.md``, "Request forms").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .quantities import clip_repr, parse_fraction, read_integer
from .request import PROFILE_EXAMPLE, RequestError, SliceRequest, parse_profile_name
from .slice_spec import (
    ANNOTATION_COUNT,
    ANNOTATION_FRACTION,
    ANNOTATION_MEMORY,
    ANNOTATION_PROFILE,
    ANNOTATION_REQUESTED,
    REQUEST_ANNOTATIONS,
    request_from_annotations,
)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MIG_RESOURCE_EXAMPLE = f"{MIG_RESOURCE_PREFIX}{PROFILE_EXAMPLE}"
# Whole GPUs, in namespaces that opt in: each is a slice of fraction 1, which only a GPU holding
# nothing else can take: on a MIG GPU its full-size profile (all its memory slots), on a GPU without
# MIG the whole GPU (its memory as the limit).
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
WHOLE_GPU_SPEC: Mapping[str, Any] = {"fraction": 1.0}
WHOLE_GPUS_LABEL = "cdmo.io/whole-gpus"
WHOLE_GPUS_ON = "on"
REQUESTED_ANNOTATION = ANNOTATION_REQUESTED
# A namespace labelled so keeps its nvidia.com/mig-* requests for a device plugin (static MIG).
MIG_REQUESTS_LABEL = "cdmo.io/mig-requests"
MIG_REQUESTS_OFF = "off"
# The most devices one pod may ask for: a node of 8 GPUs has at most 56 MIG instances, and each device
# is a slice, a claim and a claim entry in the pod; 16 covers every multi-GPU job seen in practice.
MAX_POD_DEVICES = 16
MAX_RECORD_LENGTH = 4096


class RequestFormError(RequestError):
    """A request form the operator does not serve; the message names the container, the key and the value."""


@dataclass(frozen=True)
class PodDevice:
    """One device of a pod: its GpuSlice's spec and the containers that see it (None: every one)."""

    spec: Mapping[str, Any]
    request: SliceRequest
    containers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class MigResourceRequest:
    """The nvidia.com/mig-* devices a pod's containers ask for: ``asked`` maps each asking container
    to its resources and quantities, as the record annotation shows them."""

    asked: Mapping[str, Mapping[str, str]]

    def annotations(self) -> dict[str, str]:
        """What the pod goes on with: the record of what was asked (its request from then on)."""
        record = json.dumps({c: dict(r) for c, r in self.asked.items()}, sort_keys=True, separators=(",", ":"))
        return {ANNOTATION_REQUESTED: record}


def is_mig_resource(key: object) -> bool:
    return isinstance(key, str) and key.startswith(MIG_RESOURCE_PREFIX)


def resource_form(whole_gpus: bool) -> Callable[[object], bool]:
    """Which extended resources one form reads: ``nvidia.com/gpu`` for whole GPUs, else ``nvidia.com/mig-*``."""
    return (lambda key: key == WHOLE_GPU_RESOURCE) if whole_gpus else is_mig_resource


def is_served_resource(key: object) -> bool:
    """A device-plugin resource the webhook may serve as slices: MIG devices, whole GPUs."""
    return is_mig_resource(key) or key == WHOLE_GPU_RESOURCE


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _device_count(container: str, key: str, value: object) -> int:
    """An extended resource's quantity: a whole number of devices, at least 1 ("1" or 1). Space around
    it is dropped, as the API server's quantity decoding drops it."""
    count = read_integer(value.strip(" \t\r\n") if isinstance(value, str) else value, 1, MAX_POD_DEVICES)
    if count is None:
        whole = key == WHOLE_GPU_RESOURCE
        what, example = ("GPU", WHOLE_GPU_RESOURCE) if whole else ("MIG device", MIG_RESOURCE_EXAMPLE)
        raise RequestFormError(
            f"container {clip_repr(container)} asks for {clip_repr(key)}: {clip_repr(value)}; a {what} "
            f"count is a whole number from 1 to {MAX_POD_DEVICES} in ASCII digits, e.g. {example}: 1")
    return count


def _profile_of(container: str, key: str) -> str:
    profile = key[len(MIG_RESOURCE_PREFIX):]
    try:
        return parse_profile_name(profile)
    except RequestError:
        raise RequestFormError(
            f"container {clip_repr(container)} asks for {clip_repr(key)}: {clip_repr(profile)} is not a MIG "
            f"profile name; use e.g. {MIG_RESOURCE_EXAMPLE}: 1") from None


def mig_resource_request(pod: Mapping[str, Any], whole_gpus: bool = False) -> MigResourceRequest | None:
    """The MIG devices a pod's containers ask for through ``nvidia.com/mig-<profile>`` resources (and,
    with ``whole_gpus``, the whole GPUs through ``nvidia.com/gpu``), None when none does. Raises
    RequestFormError for what is not served: a bad profile name or count, requests that differ from
    limits, more than MAX_POD_DEVICES in all, or a slice annotation as well."""
    wanted = resource_form(whole_gpus)
    asked: dict[str, dict[str, str]] = {}
    for container in _containers(pod):
        name = str(container.get("name") or "")
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for key in sorted({k for k in (*limits, *requests) if wanted(k)}):
            if key in limits and key in requests and str(limits[key]) != str(requests[key]):
                raise RequestFormError(
                    f"container {clip_repr(name)} asks for {clip_repr(key)} with limits {clip_repr(limits[key])} "
                    f"and requests {clip_repr(requests[key])}; an extended resource's request equals its "
                    f"limit: set limits only, e.g. {MIG_RESOURCE_EXAMPLE}: 1")
            value = limits[key] if key in limits else requests[key]
            _device_count(name, key, value)
            if key != WHOLE_GPU_RESOURCE:
                _profile_of(name, key)
            asked.setdefault(name, {})[key] = str(value).strip()
    if not asked:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    given = [k for k in (*REQUEST_ANNOTATIONS, ANNOTATION_COUNT) if k in annotations]
    if given:
        raise RequestFormError(
            f"the pod asks for a slice with annotation {given[0]}: {clip_repr(annotations[given[0]])} and for "
            f"{_shown(asked)}; ask for one or the other, e.g. {MIG_RESOURCE_EXAMPLE}: 1 alone")
    total = sum(int(v) for resources in asked.values() for v in resources.values())
    if total > MAX_POD_DEVICES:
        raise RequestFormError(
            f"the pod asks for {total} devices ({_shown(asked)}); a pod may have at most {MAX_POD_DEVICES}")
    other = [k for c in _containers(pod) for kind in ("limits", "requests")
             for k in ((c.get("resources") or {}).get(kind) or {}) if is_served_resource(k) and not wanted(k)]
    if other:
        raise RequestFormError(
            f"the pod asks for {_shown(asked)} and for {clip_repr(other[0])}; a pod asks for MIG devices "
            f"({MIG_RESOURCE_PREFIX}*) or for whole GPUs ({WHOLE_GPU_RESOURCE}), not both, e.g. "
            f"{MIG_RESOURCE_EXAMPLE}: 2")
    return MigResourceRequest(asked=asked)


def _shown(asked: Mapping[str, Mapping[str, str]]) -> str:
    parts = [f"container {clip_repr(c, 40)} {clip_repr(k, 40)}: {clip_repr(v, 12)}"
             for c, resources in asked.items() for k, v in resources.items()]
    return ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")


def without_resources(container: Mapping[str, Any], taken: Callable[[object], bool]) -> dict[str, Any]:
    """The container's resources with every limit and request whose name ``taken`` accepts taken out
    (an empty ``limits`` or ``requests`` goes too)."""
    resources = dict(container.get("resources") or {})
    for kind in ("limits", "requests"):
        if kind in resources and resources[kind] is not None:
            kept = {k: v for k, v in resources[kind].items() if not taken(k)}
            if kept:
                resources[kind] = kept
            else:
                del resources[kind]
    return resources


def _count(annotations: Mapping[str, str]) -> int:
    text = annotations.get(ANNOTATION_COUNT)
    if text is None:
        return 1
    count = read_integer(text, 1, MAX_POD_DEVICES) if isinstance(text, str) else None
    if count is None:
        raise RequestFormError(
            f"annotation {ANNOTATION_COUNT}: {clip_repr(text)} is not a device count; use a whole number from 1 "
            f"to {MAX_POD_DEVICES} in ASCII digits beside a request, e.g. {ANNOTATION_COUNT}: '2' with "
            f"{ANNOTATION_MEMORY}: '4G'")
    return count


def _recorded(annotations: Mapping[str, str]) -> tuple[PodDevice, ...]:
    """The devices ``ANNOTATION_REQUESTED`` records: per container (in name order), per resource (in
    name order), as many as its quantity."""
    text = annotations[ANNOTATION_REQUESTED]
    example = f'{{"train":{{"{MIG_RESOURCE_EXAMPLE}":"1"}}}}'
    try:
        record = json.loads(text) if isinstance(text, str) and len(text) <= MAX_RECORD_LENGTH else None
    except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than the decoder goes
        record = None
    if not isinstance(record, dict) or not record or not all(
            isinstance(c, str) and isinstance(r, dict) and r for c, r in record.items()):
        raise RequestFormError(
            f"annotation {ANNOTATION_REQUESTED}: {clip_repr(text)} is not what the webhook records: a JSON object "
            f"of containers and their {MIG_RESOURCE_PREFIX}* requests, e.g. {example}")
    devices: list[PodDevice] = []
    for container in sorted(record):
        for key in sorted(record[container]):
            if not is_served_resource(key):
                raise RequestFormError(
                    f"annotation {ANNOTATION_REQUESTED}: {clip_repr(key)} is not a {MIG_RESOURCE_PREFIX}* or "
                    f"{WHOLE_GPU_RESOURCE} resource; e.g. {example}")
            count = _device_count(container, key, record[container][key])
            if key == WHOLE_GPU_RESOURCE:
                device = PodDevice(WHOLE_GPU_SPEC, SliceRequest(fraction=1.0), (container,))
            else:
                profile = _profile_of(container, key)
                device = PodDevice({"migProfile": profile}, SliceRequest(profile=profile), (container,))
            devices += [device] * count
    if len(devices) > MAX_POD_DEVICES:
        raise RequestFormError(f"annotation {ANNOTATION_REQUESTED} asks for {len(devices)} devices; a pod may "
                               f"have at most {MAX_POD_DEVICES}")
    return tuple(devices)


def pod_devices(annotations: Mapping[str, str] | None) -> tuple[PodDevice, ...]:
    """The devices a pod's annotations ask for (none: an empty tuple). Raises RequestError (or core's
    QuantityError) naming the annotation and its value."""
    annotations = annotations or {}
    request = request_from_annotations(annotations)
    if ANNOTATION_REQUESTED in annotations and request is None and ANNOTATION_COUNT not in annotations:
        return _recorded(annotations)
    if request is None:
        if ANNOTATION_COUNT in annotations:
            raise RequestFormError(
                f"annotation {ANNOTATION_COUNT}: {clip_repr(annotations[ANNOTATION_COUNT])} goes beside a request; "
                f"add one of {', '.join(REQUEST_ANNOTATIONS)}, e.g. {ANNOTATION_MEMORY}: '4G'")
        return ()
    if ANNOTATION_REQUESTED in annotations:
        key = next(k for k in REQUEST_ANNOTATIONS if k in annotations)
        raise RequestFormError(
            f"the pod asks with annotation {key}: {clip_repr(annotations[key])} and with "
            f"{ANNOTATION_REQUESTED}: {clip_repr(annotations[ANNOTATION_REQUESTED])}; keep one of the two")
    if ANNOTATION_MEMORY in annotations:
        spec: dict[str, Any] = {"memory": annotations[ANNOTATION_MEMORY]}
    elif ANNOTATION_FRACTION in annotations:
        spec = {"fraction": parse_fraction(annotations[ANNOTATION_FRACTION])}
    else:
        spec = {"migProfile": annotations[ANNOTATION_PROFILE]}
    if request.compute is not None:
        spec["compute"] = request.compute
    return (PodDevice(spec, request),) * _count(annotations)


def device_slice_names(group: str, count: int) -> tuple[str, ...]:
    """The GpuSlice (and ResourceClaim) names of a pod's devices: the group name itself for one device,
    ``<group>-<k>`` for several (a group name is at most 52 characters, so these stay labels too)."""
    return (group,) if count == 1 else tuple(f"{group}-{k}" for k in range(count))
