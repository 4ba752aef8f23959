"""Whether a pod fits a node's resources, counted as kube-scheduler's NodeResourcesFit filter counts them.

A sliced pod is pinned to its slice's node, so the slice must go where the pod's resources fit too.

The pod's request of each resource (k8s.io/component-helpers ``resource.PodRequests``): the sum over its
containers; each init container in turn asks its own request plus what the restartable (sidecar, restart
policy ``Always``) init containers before it ask, and the pod asks at least the largest of those; a sidecar
also adds to the sum, as it keeps running beside the containers. Pod-level ``spec.resources.requests``
replace the containers' cpu, memory and hugepages where given. ``spec.overhead`` (its RuntimeClass's) is
added. The scheduler counts cpu in millicores and every other resource in whole units, each rounded up
from the exact sum.

A node's free amount of a resource is its allocatable less the requests of the pods bound to it that
have not finished (phase neither Succeeded nor Failed). The pod fits when one more pod stays within the
node's allocatable ``pods``, and each resource it asks more than zero of is at most what is free
(a resource the node does not have is zero free).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mig_operator.core.requests.quantities import QuantityError, format_bytes, parse_quantity

CPU = "cpu"
MEMORY = "memory"
PODS = "pods"
FINISHED_PHASES = ("Succeeded", "Failed")
# What pod-level requests may set (PodLevelResources); other resources stay the containers'.
_POD_LEVEL = (CPU, MEMORY)
_POD_LEVEL_PREFIX = "hugepages-"


def _exact(requests: Mapping[str, Any] | None, what: str) -> dict[str, Fraction]:
    """A requests or allocatable map read exactly; an unreadable value is ``QuantityError``."""
    return {name: parse_quantity(value, f"{what} {name}") for name, value in (requests or {}).items()}


def _add(into: dict[str, Fraction], more: Mapping[str, Fraction]) -> None:
    for name, amount in more.items():
        into[name] = into.get(name, Fraction(0)) + amount


def _at_least(into: dict[str, Fraction], other: Mapping[str, Fraction]) -> None:
    for name, amount in other.items():
        if amount > into.get(name, Fraction(0)):
            into[name] = amount


def _requests(container: Mapping[str, Any]) -> dict[str, Fraction]:
    return _exact((container.get("resources") or {}).get("requests"), f"container {container.get('name')} request")


def _units(name: str, amount: Fraction) -> int:
    """What the scheduler compares: millicores for cpu, whole units for the rest, rounded up."""
    return math.ceil(amount * 1000) if name == CPU else math.ceil(amount)


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """What a pod with this spec asks of a node, per resource (cpu in millicores), as the scheduler counts
    it; ``pods`` is not among them (every pod takes one). Raises ``QuantityError`` on an unreadable value."""
    total: dict[str, Fraction] = {}
    for container in spec.get("containers") or ():
        _add(total, _requests(container))
    sidecars: dict[str, Fraction] = {}
    init_peak: dict[str, Fraction] = {}
    for container in spec.get("initContainers") or ():
        own = _requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            running = dict(sidecars)
        else:
            running = dict(sidecars)
            _add(running, own)
        _at_least(init_peak, running)
    _at_least(total, init_peak)
    pod_level = _exact((spec.get("resources") or {}).get("requests"), "pod request")
    for name, amount in pod_level.items():
        if name in _POD_LEVEL or name.startswith(_POD_LEVEL_PREFIX):
            total[name] = amount
    _add(total, _exact(spec.get("overhead"), "pod overhead"))
    return {name: _units(name, amount) for name, amount in total.items()}


@dataclass(frozen=True)
class NodeUse:
    """What the pods bound to a node ask together (``pod_requests``' units) and how many they are."""

    requested: Mapping[str, int]
    pods: int


def node_use(bound: Iterable[Mapping[str, Any]]) -> NodeUse:
    """The use of a node by ``bound``, the pods bound to it (bodies with ``spec`` and ``status.phase``);
    finished pods are not counted, nor a pod whose requests cannot be read (the API server validated them)."""
    requested: dict[str, int] = {}
    count = 0
    for pod in bound:
        if (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        count += 1
        try:
            asks = pod_requests(pod.get("spec") or {})
        except QuantityError:
            continue
        for name, amount in asks.items():
            requested[name] = requested.get(name, 0) + amount
    return NodeUse(requested, count)


@dataclass(frozen=True)
class Shortfall:
    """A resource of which the pod asks more than a node has free (``pods``: the node holds its maximum)."""

    resource: str
    asked: int
    free: int
    allocatable: int

    def describe(self, node: str) -> str:
        """``cpu: the pod asks 8, node n1 has 2 free of 2 allocatable`` (cpu in cores or millicores,
        memory and storage in bytes' units)."""
        if self.resource == PODS:
            return f"pods: node {node} holds {self.allocatable - self.free} of its {self.allocatable} pods"
        return (f"{self.resource}: the pod asks {show_amount(self.resource, self.asked)}, node {node} has "
                f"{show_amount(self.resource, self.free)} free of {show_amount(self.resource, self.allocatable)} "
                "allocatable")


def show_amount(resource: str, units: int) -> str:
    """A scheduler amount as a quantity: cpu ``8`` or ``500m``, memory and storage ``16Gi``, counts as is."""
    if resource == CPU:
        return str(units // 1000) if units % 1000 == 0 else f"{units}m"
    if resource == MEMORY or resource == "ephemeral-storage" or resource.startswith(_POD_LEVEL_PREFIX):
        return format_bytes(units) if units > 0 else str(units)
    return str(units)


def shortfalls(asks: Mapping[str, int], allocatable: Mapping[str, Any], use: NodeUse) -> tuple[Shortfall, ...]:
    """Why a pod asking ``asks`` (``pod_requests``) does not fit a node with ``allocatable`` (its
    status, as written) used by ``use``; empty when it fits. Raises ``QuantityError`` on an unreadable
    allocatable."""
    have = {name: _units(name, amount) for name, amount in _exact(allocatable, "allocatable").items()}
    found = []
    if use.pods + 1 > have.get(PODS, 0):
        found.append(Shortfall(PODS, 1, max(0, have.get(PODS, 0) - use.pods), have.get(PODS, 0)))
    for name in sorted(asks):
        asked = asks[name]
        free = have.get(name, 0) - use.requested.get(name, 0)
        if asked > 0 and asked > free:
            found.append(Shortfall(name, asked, free, have.get(name, 0)))
    return tuple(found)
