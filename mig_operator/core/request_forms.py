"""GPU requests written in forms other than the operator's own annotations (pure: no I/O).

A container's ``resources.limits: {nvidia.com/mig-<profile>: 1}``, the name NVIDIA's device plugin
advertises MIG devices under and the one MIG workloads and ClearML's CDMO queue templates already use,
is served as a slice of that profile for that container. ``mig_resource_request`` reads it from a pod;
the webhook then removes the extended resource (so neither kube-scheduler nor a device plugin needs
it), records what was asked in ``REQUESTED_ANNOTATION`` and adds the profile annotation, so the pod
goes on as an annotated pod whose claim reaches only the asking container.

One device per pod: a pod whose containers ask for more than one MIG device in all is refused, naming
what each asks for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .quantities import clip_repr
from .request import PROFILE_EXAMPLE, RequestError, parse_profile_name
from .slice_spec import ANNOTATION_PROFILE, ANNOTATION_REQUESTED, REQUEST_ANNOTATIONS

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MIG_RESOURCE_EXAMPLE = f"{MIG_RESOURCE_PREFIX}{PROFILE_EXAMPLE}"
# What a pod asked for before the webhook took the extended resources out: JSON
# ``{"<container>": {"<resource>": "<quantity>"}}``, for the pod's author and for `kubectl describe`.
REQUESTED_ANNOTATION = ANNOTATION_REQUESTED
# A namespace labelled so keeps its nvidia.com/mig-* requests for a device plugin (static MIG).
MIG_REQUESTS_LABEL = "cdmo.io/mig-requests"
MIG_REQUESTS_OFF = "off"
MAX_RECORD_LENGTH = 4096


class RequestFormError(RequestError):
    """A request form the operator does not serve; the message names the container, the key and the value."""


@dataclass(frozen=True)
class MigResourceRequest:
    """One MIG device of ``profile`` for the containers named (those that asked for it)."""

    profile: str
    containers: tuple[str, ...]
    # What each container asked for, as the record annotation's value shows it.
    asked: Mapping[str, Mapping[str, str]]

    def annotations(self) -> dict[str, str]:
        """The annotations the pod goes on with: the profile annotation and the record."""
        record = json.dumps({c: dict(r) for c, r in self.asked.items()}, sort_keys=True, separators=(",", ":"))
        return {ANNOTATION_PROFILE: self.profile, REQUESTED_ANNOTATION: record[:MAX_RECORD_LENGTH]}


def is_mig_resource(key: object) -> bool:
    return isinstance(key, str) and key.startswith(MIG_RESOURCE_PREFIX)


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _device_count(container: str, key: str, value: object) -> int:
    """An extended resource's quantity: a whole number of devices, at least 1 ("1" or 1)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not text.isdigit() or int(text) < 1:
        raise RequestFormError(
            f"container {clip_repr(container)} asks for {clip_repr(key)}: {clip_repr(value)}; a MIG device "
            f"count is a whole number of at least 1, e.g. {MIG_RESOURCE_EXAMPLE}: 1")
    return int(text)


def mig_resource_request(pod: Mapping[str, Any]) -> MigResourceRequest | None:
    """The MIG device a pod's containers ask for through ``nvidia.com/mig-<profile>`` resources, None
    when none does. Raises RequestFormError for what is not served: a bad profile name or count,
    requests that differ from limits, more than one device in all, or a slice annotation as well."""
    asked: dict[str, dict[str, str]] = {}
    profiles: dict[str, int] = {}
    for container in _containers(pod):
        name = str(container.get("name") or "")
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for key in sorted({k for k in (*limits, *requests) if is_mig_resource(k)}):
            if key in limits and key in requests and str(limits[key]) != str(requests[key]):
                raise RequestFormError(
                    f"container {clip_repr(name)} asks for {clip_repr(key)} with limits {clip_repr(limits[key])} "
                    f"and requests {clip_repr(requests[key])}; an extended resource's request equals its "
                    f"limit: set limits only, e.g. {MIG_RESOURCE_EXAMPLE}: 1")
            value = limits[key] if key in limits else requests[key]
            count = _device_count(name, key, value)
            profile = key[len(MIG_RESOURCE_PREFIX):]
            try:
                parse_profile_name(profile)
            except RequestError:
                raise RequestFormError(
                    f"container {clip_repr(name)} asks for {clip_repr(key)}: {clip_repr(profile)} is not a MIG "
                    f"profile name; use e.g. {MIG_RESOURCE_EXAMPLE}: 1") from None
            asked.setdefault(name, {})[key] = str(value).strip()
            profiles[profile] = profiles.get(profile, 0) + count
    if not asked:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    given = [k for k in REQUEST_ANNOTATIONS if k in annotations]
    if given:
        raise RequestFormError(
            f"the pod asks for a slice with annotation {given[0]}: {clip_repr(annotations[given[0]])} and for "
            f"{_shown(asked)}; ask for one or the other, e.g. {MIG_RESOURCE_EXAMPLE}: 1 alone")
    if sum(profiles.values()) > 1:
        raise RequestFormError(
            f"the pod asks for {sum(profiles.values())} MIG devices ({_shown(asked)}); one device per pod is "
            f"served: ask for one in one container, e.g. {MIG_RESOURCE_EXAMPLE}: 1")
    [profile] = profiles
    return MigResourceRequest(profile=profile, containers=tuple(asked), asked=asked)


def _shown(asked: Mapping[str, Mapping[str, str]]) -> str:
    parts = [f"container {clip_repr(c, 40)} {clip_repr(k, 40)}: {clip_repr(v, 12)}"
             for c, resources in asked.items() for k, v in resources.items()]
    return ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")


def without_mig_resources(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's resources with every ``nvidia.com/mig-*`` entry taken out (limits and requests)."""
    resources = dict(container.get("resources") or {})
    for kind in ("limits", "requests"):
        if kind in resources and resources[kind] is not None:
            kept = {k: v for k, v in resources[kind].items() if not is_mig_resource(k)}
            if kept:
                resources[kind] = kept
            else:
                del resources[kind]
    return resources
