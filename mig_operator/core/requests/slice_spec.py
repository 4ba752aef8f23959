"""A GpuSlice's request, checked by the same rules wherever it comes from.

The API server checks a GpuSlice's spec with the CEL rules in ``crds/gpuslice.yaml``; this module
applies the same rules in Python, for pod annotations (which no CRD schema sees) and for API servers
that do not run CEL. ``tests/e2e/test_crds.py`` runs both on ``tests/corpus/gpuslice_specs.yaml`` and
fails where they disagree, so a rule changed here must be changed there too.

Parsing is core's (``slice_request``); this module adds only what the schema adds on top of it:
field types, unknown fields, length limits, node names and immutability.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..placement.compute import COMPUTE_EXAMPLE, parse_compute
from .quantities import (
    FRACTION_EXAMPLE,
    MEMORY_EXAMPLE,
    QUOTE_LIMIT,
    QuantityError,
    clip_repr,
    clip_text,
    format_bytes,
    show_fraction,
)
from .request import (
    MIN_FRACTION,
    MIN_SLICE_BYTES,
    PROFILE_EXAMPLE,
    RequestError,
    SliceRequest,
    parse_profile_name,
    slice_request,
)

ANNOTATION_MEMORY = "cdmo.io/gpu-memory"
ANNOTATION_FRACTION = "cdmo.io/gpu-fraction"
ANNOTATION_PROFILE = "cdmo.io/mig-profile"
REQUEST_ANNOTATIONS = (ANNOTATION_MEMORY, ANNOTATION_FRACTION, ANNOTATION_PROFILE)
# Beside cdmo.io/gpu-memory or cdmo.io/gpu-fraction: the slice's compute share (spec.compute).
ANNOTATION_COMPUTE = "cdmo.io/gpu-compute"
# Written by the webhook on a pod whose containers asked through nvidia.com/mig-* resources: what they
# asked for (core/requests/request_forms.py). Informational: a pod may carry it (a copy of such a pod does).
ANNOTATION_REQUESTED = "cdmo.io/requested-resources"
# Beside a request annotation: how many devices of that request (core/requests/request_forms.py).
ANNOTATION_COUNT = "cdmo.io/gpu-count"
# Written by the webhook on a pod that asked in a seed platform's form (core/requests/compat.py): what it asked.
# Informational: the request annotation written beside it is the request.
ANNOTATION_COMPAT_RECORD = "cdmo.io/compat-request"
POD_ANNOTATIONS = (*REQUEST_ANNOTATIONS, ANNOTATION_COMPUTE, ANNOTATION_COUNT, ANNOTATION_REQUESTED,
                   ANNOTATION_COMPAT_RECORD)
# Any other annotation under this prefix, in any case, is refused, not ignored: a misspelt request
# (cdmo.io/gpu-memroy, cdmo.io/GPU-memory, cdmo.io/mig-profiles) or a guessed one (cdmo.io/gpu: 1)
# would otherwise run with no slice and no word said.
ANNOTATION_PREFIX = "cdmo.io/"


def looks_like_request(key: str) -> bool:
    """Whether a pod annotation key is under the operator's prefix but not one the operator knows."""
    return key.lower().startswith(ANNOTATION_PREFIX) and key not in POD_ANNOTATIONS

SPEC_FIELDS = ("memory", "fraction", "migProfile", "compute", "nodeName")
# All of the spec is the request: the controller may have acted on any of it, so none may change.
IMMUTABLE_FIELDS = SPEC_FIELDS

# Same limits as the CRD's maxLength (the API server needs them to bound the cost of CEL rules).
MAX_MEMORY_LENGTH = 64
MAX_PROFILE_LENGTH = 32
MAX_NODE_NAME_LENGTH = 253
NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NODE_NAME_EXAMPLE = "gpu-node-1"


def request_from_spec(spec: Mapping[str, Any]) -> SliceRequest:
    """The request of a GpuSlice ``spec``, refused exactly where the CRD's schema and rules refuse it."""
    if not isinstance(spec, Mapping):
        raise RequestError(f"spec {clip_repr(spec)} must be an object; e.g. {{memory: '{MEMORY_EXAMPLE}'}}")
    unknown = sorted((key for key in spec if key not in SPEC_FIELDS), key=clip_text)
    if unknown:
        raise RequestError(
            f'unknown field "spec.{clip_text(unknown[0])}"; a GpuSlice spec has only '
            f"{', '.join(SPEC_FIELDS)}, e.g. memory: '{MEMORY_EXAMPLE}'"
        )
    memory = spec.get("memory")
    fraction = spec.get("fraction")
    profile = spec.get("migProfile")
    compute = spec.get("compute")
    node_name = spec.get("nodeName")
    if memory is not None:
        _check_memory_text(memory)
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))):
        raise RequestError(f"fraction {clip_repr(fraction)} must be of type number; use e.g. 0.5")
    if compute is not None and (isinstance(compute, bool) or not isinstance(compute, (int, float))):
        raise RequestError(f"compute {clip_repr(compute)} must be of type number; use e.g. {COMPUTE_EXAMPLE}")
    if profile is not None:
        _check_profile_text(profile)
    if node_name is not None:
        check_node_name(node_name)
    request = slice_request(memory=memory, fraction=fraction, profile=profile, compute=compute)
    return check_floor(request, memory or fraction)


def check_floor(request: SliceRequest, given: object) -> SliceRequest:
    """Refuse a memory request below ``MIN_SLICE_BYTES`` or a fraction below ``MIN_FRACTION``.

    The floor is the schema's, not parsing's: ``plan`` traces and the planner take any size. ``given``
    is the value as written, for the message.
    """
    if request.memory_bytes is not None and request.memory_bytes < MIN_SLICE_BYTES:
        raise QuantityError(
            f"memory {clip_repr(given)} is below the smallest slice, {format_bytes(MIN_SLICE_BYTES)} "
            f"(the CUDA context alone takes about 0.5 GiB); use e.g. '{MEMORY_EXAMPLE}'"
        )
    if request.fraction is not None and request.fraction < MIN_FRACTION:
        raise QuantityError(
            f"fraction {show_fraction(given)} is below the smallest share, {MIN_FRACTION:g}; "
            f"use e.g. {FRACTION_EXAMPLE!r}"
        )
    return request


def request_from_annotations(annotations: Mapping[str, str] | None) -> SliceRequest | None:
    """The request a pod's annotations make, or None when it carries no slice annotation."""
    if not annotations:
        return None
    stray = sorted(key for key in annotations if looks_like_request(key))
    if stray:
        raise RequestError(
            f"annotation {clip_text(stray[0])}: {clip_repr(annotations[stray[0]])} is not a slice annotation "
            f"(keys are lower case); use one of "
            f"{', '.join(REQUEST_ANNOTATIONS)}, e.g. {ANNOTATION_MEMORY}: '{MEMORY_EXAMPLE}'"
        )
    given = [key for key in REQUEST_ANNOTATIONS if key in annotations]
    compute = annotations.get(ANNOTATION_COMPUTE)
    if compute is not None and (not given or given == [ANNOTATION_PROFILE]):
        beside = (f"goes beside {ANNOTATION_MEMORY} or {ANNOTATION_FRACTION}" if not given
                  else f"cannot go beside {ANNOTATION_PROFILE}: a MIG slice's compute is its profile's")
        raise RequestError(
            f"annotation {ANNOTATION_COMPUTE}: {clip_repr(compute)} {beside}; "
            f"e.g. {ANNOTATION_FRACTION}: '0.5' with {ANNOTATION_COMPUTE}: '{COMPUTE_EXAMPLE}'"
        )
    if not given:
        return None
    if len(given) > 1:
        shown = ", ".join(f"{key}: {clip_repr(annotations[key], QUOTE_LIMIT // len(given))}" for key in given)
        raise RequestError(
            f"a pod may carry only one of {', '.join(REQUEST_ANNOTATIONS)} (got {shown}); "
            f"e.g. {ANNOTATION_MEMORY}: '{MEMORY_EXAMPLE}'"
        )
    key = given[0]
    value = annotations[key]
    # The schema's length limits, with the value quoted (clipped) and an example: a pod's author sees
    # no field path, only this message.
    limit, field, example = {ANNOTATION_MEMORY: (MAX_MEMORY_LENGTH, "memory", MEMORY_EXAMPLE),
                             ANNOTATION_PROFILE: (MAX_PROFILE_LENGTH, "migProfile", PROFILE_EXAMPLE)}.get(
                                 key, (0, "", ""))
    if limit and isinstance(value, str) and len(value) > limit:
        error = RequestError if key == ANNOTATION_PROFILE else QuantityError
        raise error(f"annotation {key}: {field} {clip_repr(value)} is too long: may not be more than {limit} "
                    f"characters; use e.g. '{example}'")
    if compute is not None:
        try:
            parse_compute(compute)
        except QuantityError as error:
            raise QuantityError(f"annotation {ANNOTATION_COMPUTE}: {error}") from error
    try:
        if key == ANNOTATION_MEMORY:
            _check_memory_text(value)
            return check_floor(slice_request(memory=value, compute=compute), value)
        if key == ANNOTATION_FRACTION:
            # Annotation values are strings; core parses "0.5" itself.
            return check_floor(slice_request(fraction=value, compute=compute), value)
        _check_profile_text(value)
        return slice_request(profile=value)
    except RequestError as error:
        raise RequestError(f"annotation {key}: {error}") from error
    except QuantityError as error:
        raise QuantityError(f"annotation {key}: {error}") from error


def check_node_name(value: object) -> str:
    """A Node's name as spec.nodeName may give it: a lower-case DNS subdomain of at most 253 characters."""
    if not isinstance(value, str):
        raise RequestError(f"nodeName {clip_repr(value)} must be of type string; use e.g. '{NODE_NAME_EXAMPLE}'")
    if len(value) > MAX_NODE_NAME_LENGTH:
        raise RequestError(f"nodeName is too long: may not be more than {MAX_NODE_NAME_LENGTH} characters")
    if NODE_NAME.fullmatch(value) is None:
        raise RequestError(
            f"nodeName {clip_repr(value)} is not a node name (lower-case DNS subdomain); "
            f"use e.g. '{NODE_NAME_EXAMPLE}'"
        )
    return value


def _check_memory_text(value: object) -> None:
    """What the schema checks of spec.memory before core parses it: type and length."""
    if not isinstance(value, str):
        raise QuantityError(f"memory {clip_repr(value)} must be of type string; use e.g. '{MEMORY_EXAMPLE}'")
    if len(value) > MAX_MEMORY_LENGTH:
        raise QuantityError(f"memory is too long: may not be more than {MAX_MEMORY_LENGTH} characters")


def _check_profile_text(value: object) -> None:
    """What the schema checks of a profile name beyond core's pattern: type and length."""
    if not isinstance(value, str):
        raise RequestError(f"migProfile {clip_repr(value)} must be of type string; use e.g. '{PROFILE_EXAMPLE}'")
    if len(value) > MAX_PROFILE_LENGTH:
        raise RequestError(f"migProfile is too long: may not be more than {MAX_PROFILE_LENGTH} characters")
    parse_profile_name(value)
