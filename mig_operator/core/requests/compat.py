"""The seed platforms' GPU request forms, read as the operator's own (pure: no I/O).

Clusters moving from Run:ai (or KAI) or from ClearML's Fractional GPU Injector carry pods and templates
in those platforms' forms. With a dialect enabled (chart value ``compat``), ``dialect_request`` reads
that form from a pod and says what the webhook does with it: the ``cdmo.io/*`` request annotation to add
(checked by its own rules), the extended resources to take out, which containers get the device, and
what was asked (``DialectRequest.record``). A dialect that is not enabled means nothing.

``runai`` (pod annotations, as Run:ai and KAI read them):
  - ``gpu-fraction: "0.5"``: a share of one GPU, below 1 (KAI refuses 1 and more) -> ``cdmo.io/gpu-fraction``;
  - ``gpu-memory``: KAI's form is a whole number of MiB (``"2000"``), read as ``2000Mi``; the
    ``--gpu-memory 4G`` style with a unit (``4G``, ``4Gi``, ``4096M``, ``4096MiB``) follows the
    operator's memory rules (``4G`` is 4*10^9 bytes) -> ``cdmo.io/gpu-memory``;
  - ``mig-profile: 2g.10gb`` (Run:ai's dynamic MIG) -> ``cdmo.io/mig-profile``;
  - ``gpu-fraction-container-name``: the container (or init container) that gets the device; without
    it, the pod's first container does, as in KAI;
  - ``gpu-fraction-num-devices: "N"`` (1 to 16) -> ``cdmo.io/gpu-count``; Run:ai's burst limits
    ``gpu-fraction-limit`` and ``gpu-memory-limit`` are refused (a slice's limit is its request).

``clearml`` (ClearML's Fractional GPU Injector): the pod label ``clearml-injector/fraction``, whose
documented values are 0.0625, the eighths 0.125 ... 0.875 and whole GPUs (``1.000``; 2 and more are
several devices, refused), in the queue templates of its three generations:
  - label with ``nvidia.com/gpu: 1`` and ``clear.ml/fraction-1: "0.5"`` in one container's limits;
  - label with ``nvidia.com/gpu: N`` in one container, N = 8 x fraction (injector < 1.3.0, whose
    device plugin splits each GPU 8 ways), e.g. ``0.500`` with ``nvidia.com/gpu: 4``;
  - the label alone (injector >= 1.3.0): every container gets the device, as with an annotation.
  -> ``cdmo.io/gpu-fraction`` with the label's value; ``nvidia.com/gpu`` and ``clear.ml/fraction-1``
  are taken out. ClearML's CDMO queue templates (``nvidia.com/mig-1g.10gb: 1``) need no dialect.

Anything else a dialect's keys say is refused (naming key, value and a valid example), as is a pod
asking in two forms at once (two dialects, or a dialect beside another request form that differs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .quantities import MAX_FRACTION_LENGTH, QuantityError, clip_repr, read_integer
from .request import SliceRequest
from .request_forms import MAX_POD_DEVICES, MAX_RECORD_LENGTH, MIG_RESOURCE_PREFIX, RequestFormError
from .slice_spec import (
    ANNOTATION_COUNT,
    ANNOTATION_FRACTION,
    ANNOTATION_MEMORY,
    ANNOTATION_PROFILE,
    REQUEST_ANNOTATIONS,
    request_from_annotations,
)

RUNAI = "runai"
CLEARML = "clearml"
COMPAT_DIALECTS = (RUNAI, CLEARML)

# --- runai: pod annotations -----------------------------------------------------------------------
RUNAI_FRACTION = "gpu-fraction"
RUNAI_MEMORY = "gpu-memory"
RUNAI_PROFILE = "mig-profile"
RUNAI_CONTAINER = "gpu-fraction-container-name"
RUNAI_DEVICES = "gpu-fraction-num-devices"
# Run:ai's dynamic fractions: a guaranteed request and a larger limit the workload may burst into.
RUNAI_FRACTION_LIMIT = "gpu-fraction-limit"
RUNAI_MEMORY_LIMIT = "gpu-memory-limit"
# Run:ai's request annotations and the operator's annotation each is read as.
RUNAI_REQUESTS = {
    RUNAI_MEMORY: ANNOTATION_MEMORY,
    RUNAI_FRACTION: ANNOTATION_FRACTION,
    RUNAI_PROFILE: ANNOTATION_PROFILE,
}
RUNAI_KEYS = (RUNAI_MEMORY, RUNAI_FRACTION, RUNAI_PROFILE, RUNAI_CONTAINER, RUNAI_DEVICES, RUNAI_FRACTION_LIMIT,
              RUNAI_MEMORY_LIMIT)
RUNAI_EXAMPLES = {RUNAI_MEMORY: "4G", RUNAI_FRACTION: "0.5", RUNAI_PROFILE: "2g.10gb"}
# KAI's gpu-memory: a whole number of MiB, no unit.
_MIB_COUNT = re.compile(r"[0-9]+", re.ASCII)

# --- clearml: the Fractional GPU Injector's label and queue templates ------------------------------
CLEARML_LABEL = "clearml-injector/fraction"
CLEARML_RESOURCE_PREFIX = "clear.ml/fraction"
CLEARML_FRACTION_RESOURCE = "clear.ml/fraction-1"
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
# The injector's device plugin (before 1.3.0) time-slices each GPU into this many nvidia.com/gpu.
CLEARML_LEGACY_REPLICAS = 8
# The label's documented values that are one device: 1/16, the eighths, and a whole GPU.
CLEARML_FRACTIONS = (Fraction(1, 16), *(Fraction(k, 8) for k in range(1, 9)))
CLEARML_SHOWN = "0.0625, 0.125, 0.250, 0.375, 0.500, 0.625, 0.750, 0.875, 1.000"
CLEARML_EXAMPLE = "0.500"
# The label's value as text: ASCII decimal, as the operator's fraction grammar writes it.
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
# An extended resource's quantity as the API server hands it to a webhook: "1", "0.5" or "500m".
_QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<milli>m?)", re.ASCII)

# Where a record entry came from when it is not a container (container names have no dots).
_RECORD_ANNOTATIONS = "metadata.annotations"
_RECORD_LABELS = "metadata.labels"


class DialectError(RequestFormError):
    """A dialect's request the operator does not serve; the message names the key and the value and
    shows a valid example."""


class UnknownDialect(ValueError):
    """A ``compat`` value that names no dialect; the message names it and lists the known ones."""


@dataclass(frozen=True)
class DialectRequest:
    """What the webhook does with a pod that asks in a dialect's form."""

    dialect: str
    # The cdmo.io request annotation to add.
    annotations: Mapping[str, str]
    # The request that annotation makes, as core's rules read it.
    request: SliceRequest
    # Extended resources to take out of every container's limits and requests.
    removed_resources: tuple[str, ...]
    # The containers (or init containers) that get the device; None: every one of them.
    containers: tuple[str, ...] | None
    # What the pod asked, by where it said it: "metadata.annotations", "metadata.labels" or a container's
    # name (names have no dots), each mapping keys to values as written.
    asked: Mapping[str, Mapping[str, str]]

    def record(self) -> str:
        """``asked`` as compact JSON, for an informational annotation the pod's author can read. Not
        ``cdmo.io/requested-resources``: beside a request annotation that one is refused, since it is
        the request of a pod that asked through nvidia.com/mig-* resources."""
        text = json.dumps({k: dict(v) for k, v in self.asked.items()}, sort_keys=True, separators=(",", ":"))
        return text[:MAX_RECORD_LENGTH]


def check_dialects(names: Iterable[str] | str) -> tuple[str, ...]:
    """The enabled dialects from the chart value or flag (a list, or one comma-separated string), in
    COMPAT_DIALECTS order; raises UnknownDialect naming a name that is not a dialect."""
    given = names.split(",") if isinstance(names, str) else list(names)
    wanted: set[str] = set()
    for name in given:
        text = name.strip() if isinstance(name, str) else name
        if text == "":
            continue
        if text not in COMPAT_DIALECTS:
            raise UnknownDialect(
                f"compat dialect {clip_repr(text)} is not one the operator knows; use any of "
                f"{', '.join(COMPAT_DIALECTS)}, e.g. compat: [{RUNAI}]")
        wanted.add(text)
    return tuple(d for d in COMPAT_DIALECTS if d in wanted)


def dialect_match_expression(dialects: Collection[str]) -> str:
    """CEL over a pod (``object``) that is true exactly when it carries a key of an enabled dialect:
    a Run:ai annotation, or ClearML's label or a ``clear.ml/fraction*`` resource. ``false`` when no
    dialect is enabled (then no webhook entry is needed)."""
    terms: list[str] = []
    enabled = check_dialects(dialects)
    if RUNAI in enabled:
        keys = ", ".join(f"'{k}'" for k in RUNAI_KEYS)
        terms.append(f"(has(object.metadata.annotations) && object.metadata.annotations.exists(k, k in [{keys}]))")
    if CLEARML in enabled:
        asks = (
            "has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, "
            f"k.startsWith('{CLEARML_RESOURCE_PREFIX}'))) || (has(c.resources.requests) && "
            f"c.resources.requests.exists(k, k.startsWith('{CLEARML_RESOURCE_PREFIX}'))))"
        )
        terms.append(
            f"(has(object.metadata.labels) && '{CLEARML_LABEL}' in object.metadata.labels) || "
            f"object.spec.containers.exists(c, {asks}) || "
            f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {asks}))"
        )
    return " || ".join(terms) if terms else "false"


def dialect_request(pod: Mapping[str, Any], dialects: Collection[str]) -> DialectRequest | None:
    """What a pod asks for in the forms of the enabled ``dialects``, None when it uses none of them
    (or only those of dialects not enabled). Raises DialectError for what is not served."""
    enabled = check_dialects(dialects)
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    runai_keys = [k for k in RUNAI_KEYS if k in annotations] if RUNAI in enabled else []
    clearml_asks = CLEARML in enabled and (CLEARML_LABEL in labels or _asks_clearml_resource(pod))
    if runai_keys and clearml_asks:
        raise DialectError(
            f"the pod asks for a GPU with Run:ai's annotation {runai_keys[0]}: "
            f"{clip_repr(annotations[runai_keys[0]])} and with ClearML's "
            + (f"label {CLEARML_LABEL}: {clip_repr(labels[CLEARML_LABEL])}" if CLEARML_LABEL in labels
               else "clear.ml/fraction resources")
            + f"; ask in one form, e.g. the annotation {RUNAI_FRACTION}: '0.5' alone")
    if runai_keys:
        return _runai_request(pod, annotations)
    if clearml_asks:
        return _clearml_request(pod, labels)
    return None


# --- runai ---------------------------------------------------------------------------------------


def _runai_request(pod: Mapping[str, Any], annotations: Mapping[str, Any]) -> DialectRequest:
    given = [k for k in RUNAI_REQUESTS if k in annotations]
    for key in (RUNAI_FRACTION_LIMIT, RUNAI_MEMORY_LIMIT):
        if key in annotations:
            raise DialectError(
                f"annotation {key}: {clip_repr(annotations[key])} asks to burst past the request; a slice's "
                f"limit is its request, so drop {key} and ask for what the workload needs, "
                f"e.g. {RUNAI_FRACTION}: '0.5'")
    if not given:
        key = next(k for k in (RUNAI_CONTAINER, RUNAI_DEVICES) if k in annotations)
        raise DialectError(
            f"annotation {key}: {clip_repr(annotations[key])} needs a request beside it; add one of "
            f"{', '.join(RUNAI_REQUESTS)}, e.g. {RUNAI_FRACTION}: '0.5'")
    if len(given) > 1:
        shown = ", ".join(f"{k}: {clip_repr(annotations[k], 40)}" for k in given)
        raise DialectError(
            f"a pod may carry only one of {', '.join(RUNAI_REQUESTS)} (got {shown}); e.g. {RUNAI_FRACTION}: '0.5'")
    key = given[0]
    value = annotations[key]
    devices = _device_count(annotations[RUNAI_DEVICES]) if RUNAI_DEVICES in annotations else 1
    cdmo_key = RUNAI_REQUESTS[key]
    translated = _runai_value(key, value)
    request = _checked(key, value, cdmo_key, translated, RUNAI_EXAMPLES[key])
    if request.fraction is not None and request.fraction >= 1:
        raise DialectError(
            f"annotation {key}: {clip_repr(value)} is not a share of a GPU: Run:ai's {key} is below 1; "
            f"use e.g. {key}: '0.5' (a whole GPU is nvidia.com/gpu: 1)")
    _refuse_device_plugin_resources(pod, f"annotation {key}: {clip_repr(value)}", f"{key}: '{RUNAI_EXAMPLES[key]}'")
    asked = {k: str(annotations[k]) for k in RUNAI_KEYS if k in annotations}
    translated_annotations = _translated(pod, cdmo_key, translated, f"annotation {key}")
    if devices > 1:  # several devices of the request, all for the one container (Run:ai's multi-GPU fractions)
        translated_annotations[ANNOTATION_COUNT] = str(devices)
    return DialectRequest(
        dialect=RUNAI,
        annotations=translated_annotations,
        request=request,
        removed_resources=(),
        containers=(_runai_container(pod, annotations),),
        asked={_RECORD_ANNOTATIONS: asked},
    )


def _runai_value(key: str, value: object) -> object:
    """The cdmo.io annotation's value for a Run:ai annotation's value: KAI's gpu-memory is MiB."""
    if key == RUNAI_MEMORY and isinstance(value, str) and _MIB_COUNT.fullmatch(value):
        mib = read_integer(value.lstrip("0") or "0")
        if not mib:
            what = "must be more than zero MiB" if mib == 0 else "is more MiB than any GPU holds"
            raise DialectError(
                f"annotation {key}: {clip_repr(value)} {what}; use e.g. {key}: '4096' (MiB) or {key}: '4G'")
        return f"{mib}Mi"
    return value


def _device_count(value: object) -> int:
    """``gpu-fraction-num-devices``: how many devices of the request (``cdmo.io/gpu-count``)."""
    count = read_integer(value, 1, MAX_POD_DEVICES) if isinstance(value, str) else None
    if count is None:
        raise DialectError(
            f"annotation {RUNAI_DEVICES}: {clip_repr(value)} is not a number of devices from 1 to "
            f"{MAX_POD_DEVICES} in ASCII digits; leave it out or write a count, e.g. {RUNAI_DEVICES}: '2'")
    return count


def _runai_container(pod: Mapping[str, Any], annotations: Mapping[str, Any]) -> str:
    """The container that gets the device: the one named, or the pod's first (KAI's rule)."""
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or [])
    if RUNAI_CONTAINER not in annotations:
        if not containers:
            raise DialectError("the pod has no containers to give the GPU to; add one")
        return str(containers[0].get("name") or "")
    wanted = annotations[RUNAI_CONTAINER]
    names = [str(c.get("name") or "") for c in (*(spec.get("initContainers") or []), *containers)]
    if not isinstance(wanted, str) or wanted not in names:
        raise DialectError(
            f"annotation {RUNAI_CONTAINER}: {clip_repr(wanted)} names no container of the pod; use one of "
            f"{clip_repr(names, 80)}, e.g. {RUNAI_CONTAINER}: {clip_repr(names[0] if names else 'main')}")
    return wanted


# --- clearml -------------------------------------------------------------------------------------


def _clearml_resources(pod: Mapping[str, Any]) -> list[tuple[str, str, str, str | None]]:
    """(container, resource, limit, request) for every clear.ml/fraction* and nvidia.com/gpu entry."""
    found: list[tuple[str, str, str, str | None]] = []
    for container in _containers(pod):
        name = str(container.get("name") or "")
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for key in sorted(k for k in {*limits, *requests} if isinstance(k, str)):
            if key == WHOLE_GPU_RESOURCE or key.startswith(CLEARML_RESOURCE_PREFIX):
                given = limits[key] if key in limits else requests[key]
                other = requests[key] if key in limits and key in requests else None
                found.append((name, key, str(given).strip(), None if other is None else str(other).strip()))
    return found


def _asks_clearml_resource(pod: Mapping[str, Any]) -> bool:
    """Whether a container asks for a clear.ml/fraction* resource (nvidia.com/gpu alone is not ClearML's)."""
    return any(key != WHOLE_GPU_RESOURCE for _, key, _, _ in _clearml_resources(pod))


def _clearml_request(pod: Mapping[str, Any], labels: Mapping[str, Any]) -> DialectRequest:
    entries = _clearml_resources(pod)
    for name, key, limit, request in entries:
        if request is not None and request != limit:
            raise DialectError(
                f"container {clip_repr(name)} asks for {clip_repr(key)} with limits {clip_repr(limit)} and requests "
                f"{clip_repr(request)}; an extended resource's request equals its limit: set limits only, "
                f"e.g. {WHOLE_GPU_RESOURCE}: 1")
    resources = [(name, key, limit) for name, key, limit, _ in entries]
    clearml_only = [r for r in resources if r[1] != WHOLE_GPU_RESOURCE]
    if CLEARML_LABEL not in labels:
        name, key, value = clearml_only[0]
        raise DialectError(
            f"container {clip_repr(name)} asks for {clip_repr(key)}: {clip_repr(value)} without the pod label "
            f"{CLEARML_LABEL}, which says the share; add it, e.g. {CLEARML_LABEL}: '{CLEARML_EXAMPLE}'")
    value = labels[CLEARML_LABEL]
    asked = f"label {CLEARML_LABEL}: {clip_repr(value)}"
    fraction = _clearml_fraction(value)
    for name, key, quantity in clearml_only:
        if key != CLEARML_FRACTION_RESOURCE:
            raise DialectError(
                f"container {clip_repr(name)} asks for {clip_repr(key)}: {clip_repr(quantity)} beside {asked}; the "
                f"injector's queue template names {CLEARML_FRACTION_RESOURCE} (one GPU), e.g. "
                f"{CLEARML_FRACTION_RESOURCE}: '0.5' with {CLEARML_LABEL}: '{CLEARML_EXAMPLE}'")
        if _quantity(quantity) != fraction:
            raise DialectError(
                f"container {clip_repr(name)} asks for {key}: {clip_repr(quantity)} but the pod's {asked} says "
                f"another share; write the same share in both, e.g. {key}: '0.5' with {CLEARML_LABEL}: "
                f"'{CLEARML_EXAMPLE}'")
    asking = sorted({name for name, _, _ in resources})
    if len(asking) > 1:
        raise DialectError(
            f"containers {', '.join(clip_repr(n, 40) for n in asking[:4])} each ask for a GPU beside {asked}; one "
            f"device per pod is served: ask in one container, e.g. {WHOLE_GPU_RESOURCE}: 1")
    for name, key, quantity in resources:
        if key != WHOLE_GPU_RESOURCE:
            continue
        count = _quantity(quantity)
        legacy = fraction * CLEARML_LEGACY_REPLICAS
        if count != 1 and not (legacy.denominator == 1 and count == legacy):
            also = f" or {legacy.numerator} (8 x the share, injector < 1.3.0)" if legacy.denominator == 1 else ""
            raise DialectError(
                f"container {clip_repr(name)} asks for {WHOLE_GPU_RESOURCE}: {clip_repr(quantity)} beside {asked}; "
                f"with the label a container asks for {WHOLE_GPU_RESOURCE}: 1{also}")
    if clearml_only and not any(key == WHOLE_GPU_RESOURCE for _, key, _ in resources):
        name, key, quantity = clearml_only[0]
        raise DialectError(
            f"container {clip_repr(name)} asks for {key}: {clip_repr(quantity)} without {WHOLE_GPU_RESOURCE}; the "
            f"injector's queue template asks for both, e.g. {WHOLE_GPU_RESOURCE}: 1 and {key}: '0.5'")
    _refuse_mig_resources(pod, asked, f"{CLEARML_LABEL}: '{CLEARML_EXAMPLE}'")
    request = _checked(f"label {CLEARML_LABEL}", value, ANNOTATION_FRACTION, value, CLEARML_EXAMPLE)
    record: dict[str, dict[str, str]] = {_RECORD_LABELS: {CLEARML_LABEL: str(value)}}
    for name, key, quantity in resources:
        record.setdefault(name, {})[key] = quantity
    return DialectRequest(
        dialect=CLEARML,
        annotations=_translated(pod, ANNOTATION_FRACTION, value, f"label {CLEARML_LABEL}"),
        request=request,
        removed_resources=tuple(sorted({key for _, key, _ in resources})),
        containers=tuple(asking) if asking else None,
        asked=record,
    )


def _clearml_fraction(value: object) -> Fraction:
    """The label's share: one of CLEARML_FRACTIONS, written as a decimal."""
    example = f"use one of {CLEARML_SHOWN}, e.g. {CLEARML_LABEL}: '{CLEARML_EXAMPLE}'"
    if not isinstance(value, str) or len(value) > MAX_FRACTION_LENGTH or _DECIMAL.fullmatch(value) is None:
        raise DialectError(f"label {CLEARML_LABEL}: {clip_repr(value)} is not a decimal; {example}")
    exact = Fraction(value.rstrip(".") or "0")
    if exact > 1 and exact.denominator == 1:
        raise DialectError(
            f"label {CLEARML_LABEL}: {clip_repr(value)} asks for {exact.numerator} GPUs; one device per pod is "
            f"served: {example}")
    if exact not in CLEARML_FRACTIONS:
        raise DialectError(f"label {CLEARML_LABEL}: {clip_repr(value)} is not a share the injector defines; {example}")
    return exact


def _quantity(text: str) -> Fraction | None:
    """An extended resource's quantity ("1", "0.5", "500m") exactly; None when it is none of those."""
    match = _QUANTITY.fullmatch(text) if len(text) <= MAX_FRACTION_LENGTH else None
    if match is None:
        return None
    number = Fraction(match["number"].rstrip(".") or "0")
    return number / 1000 if match["milli"] else number


# --- shared --------------------------------------------------------------------------------------


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _checked(key: str, value: object, cdmo_key: str, translated: object, example: str) -> SliceRequest:
    """Core's request for ``{cdmo_key: translated}``; its refusal re-raised naming the dialect's key."""
    try:
        request = request_from_annotations({cdmo_key: translated})  # type: ignore[dict-item]
    except QuantityError as error:
        reason = str(error).removeprefix(f"annotation {cdmo_key}: ")
        named = key if key.startswith("label ") else f"annotation {key}"
        shown = key.removeprefix("label ")
        read = f", read as {cdmo_key}: {clip_repr(translated)}" if translated != value else ""
        raise DialectError(
            f"{named}: {clip_repr(value)} is refused{read} ({reason}); e.g. {shown}: '{example}'") from error
    assert request is not None  # one request annotation was given
    return request


def _translated(pod: Mapping[str, Any], cdmo_key: str, value: object, asked: str) -> dict[str, str]:
    """The annotations the pod goes on with; refuses a cdmo.io request annotation that says otherwise
    (one that says the same, as on a copy of a pod already served, is kept)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    for key in REQUEST_ANNOTATIONS:
        if key in annotations and (key != cdmo_key or annotations[key] != value):
            raise DialectError(
                f"the pod asks for a slice with annotation {key}: {clip_repr(annotations[key])} and with {asked}; "
                f"ask in one form, e.g. {asked.split(': ')[0]} alone")
    return {cdmo_key: str(value)}


def _refuse_device_plugin_resources(pod: Mapping[str, Any], asked: str, example: str) -> None:
    """A Run:ai request beside nvidia.com/gpu (KAI refuses both too) or nvidia.com/mig-*."""
    for container in _containers(pod):
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for key in resources.get(kind) or {}:
                if key == WHOLE_GPU_RESOURCE or (isinstance(key, str) and key.startswith(MIG_RESOURCE_PREFIX)):
                    raise DialectError(
                        f"container {clip_repr(container.get('name'))} asks for {clip_repr(key)} and the pod for a "
                        f"GPU with {asked}; ask for one or the other, e.g. {example} alone")


def _refuse_mig_resources(pod: Mapping[str, Any], asked: str, example: str) -> None:
    for container in _containers(pod):
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for key in resources.get(kind) or {}:
                if isinstance(key, str) and key.startswith(MIG_RESOURCE_PREFIX):
                    raise DialectError(
                        f"container {clip_repr(container.get('name'))} asks for {clip_repr(key)} and the pod for a "
                        f"GPU share with {asked}; ask for one or the other, e.g. {example} alone")

