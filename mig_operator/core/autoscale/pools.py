"""The GPU node pools an admin describes (chart value ``autoscaling.pools``), read from the controller's
pools file.

A pool is what one autoscaler node group makes: the labels (and taints) its new nodes carry, the GPU
model from the catalog (``core.placement.profiles``) and how many per node, and the CPU and memory a
new node has to give pods. A pool whose labels include ``cdmo.clear.ml/gpu-partitioning=mig`` makes
MIG nodes (the admin enables MIG mode in the node's image, as on every labelled node); any other makes
fraction nodes. Every value is checked here, with the value named and a valid example shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from ..placement.profiles import CatalogError, GpuModel, get_model
from ..requests.quantities import QuantityError, clip_repr, parse_quantity

MIG_LABEL = "cdmo.clear.ml/gpu-partitioning"
MAX_POOLS = 32
DEFAULT_MAX_NODES = 10
MAX_NODES_LIMIT = 1000
MAX_GPUS_PER_NODE = 16
MAX_LABELS = 32
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", re.ASCII)
MAX_POOL_NAME = 40  # leaves room for the operator's prefix in the CapacityBuffer's name
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", re.ASCII)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", re.ASCII)
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
POOL_EXAMPLE = ('{"name": "h200", "nodeLabels": {"node.kubernetes.io/instance-type": "p5e.48xlarge", '
                '"cdmo.clear.ml/gpu-partitioning": "mig"}, "gpuModel": "h200-141gb", "gpusPerNode": 8, '
                '"cpu": "190", "memory": "1900Gi"}')
_FIELDS = {"name", "nodeLabels", "taints", "gpuModel", "gpusPerNode", "cpu", "memory", "maxNodes"}


BACKENDS = ("auto", "capacitybuffer", "placeholder")
PLACEHOLDER_IMAGE = "registry.k8s.io/pause:3.10"


class PoolError(ValueError):
    """A pools file that cannot be used: the message names the value and shows a valid pool."""


@dataclass(frozen=True)
class NodePool:
    name: str
    labels: Mapping[str, str]
    model: GpuModel
    gpus: int
    cpu: Fraction  # cores a new node gives pods
    memory: int  # bytes a new node gives pods
    taints: tuple[Mapping[str, str], ...] = ()
    max_nodes: int = DEFAULT_MAX_NODES

    @property
    def mig(self) -> bool:
        return self.labels.get(MIG_LABEL) == "mig" and self.model.mig_capable


@dataclass(frozen=True)
class AutoscalingOptions:
    """The controller's autoscaling settings: the pools, where its CapacityBuffers, their PodTemplates and
    its placeholder pods live, how new nodes are asked for (one of BACKENDS), the placeholders'
    PriorityClass and the image of a buffer's or placeholder's pod."""

    pools: tuple[NodePool, ...]
    namespace: str
    backend: str = "auto"
    priority_class: str = "mig-operator-placeholder"
    image: str = PLACEHOLDER_IMAGE


def _fail(index: int, what: str) -> PoolError:
    return PoolError(f"autoscaling pool {index}: {what}; a valid pool: {POOL_EXAMPLE}")


def _text(value: object, pattern: re.Pattern[str], limit: int) -> bool:
    return isinstance(value, str) and len(value) <= limit and pattern.fullmatch(value) is not None


def _labels(index: int, value: object, what: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or len(value) > MAX_LABELS:
        raise _fail(index, f"{what} {clip_repr(value)} is not a map of at most {MAX_LABELS} labels")
    for key, text in value.items():
        if not _text(key, _LABEL_KEY, 316) or not _text(text, _LABEL_VALUE, 63):
            raise _fail(index, f"{what} has {clip_repr(key)}: {clip_repr(text)}, not a Kubernetes label")
    return dict(value)


def _taints(index: int, value: object) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or len(value) > MAX_LABELS:
        raise _fail(index, f"taints {clip_repr(value)} is not a list of taints")
    out = []
    for taint in value:
        if not isinstance(taint, Mapping) or set(taint) - {"key", "value", "effect"}:
            raise _fail(index, f"taint {clip_repr(taint)} is not {{key, value, effect}}")
        key, text, effect = taint.get("key"), taint.get("value", ""), taint.get("effect")
        if not _text(key, _LABEL_KEY, 316) or not _text(text, _LABEL_VALUE, 63) or effect not in _EFFECTS:
            raise _fail(index, f"taint {clip_repr(taint)} needs a label key, a label value and an effect of "
                               f"{', '.join(_EFFECTS)}")
        out.append({"key": key, "value": text, "effect": effect} if text else {"key": key, "effect": effect})
    return tuple(out)


def _count(index: int, value: object, what: str, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise _fail(index, f"{what} {clip_repr(value)} is not a whole number from 1 to {high}")
    return value


def _amount(index: int, value: object, what: str) -> Fraction:
    try:
        amount = parse_quantity(value, what)
    except QuantityError as exc:
        raise _fail(index, str(exc)) from None
    if amount <= 0:
        raise _fail(index, f"{what} {clip_repr(value)} is not more than 0")
    return amount


def read_pool(index: int, entry: object) -> NodePool:
    """One pool of the file (``index`` counts from 0, for the message)."""
    if not isinstance(entry, Mapping):
        raise _fail(index, f"{clip_repr(entry)} is not a map")
    unknown = sorted(str(k) for k in set(entry) - _FIELDS)
    if unknown:
        raise _fail(index, f"unknown field(s) {clip_repr(', '.join(unknown))} (known: {', '.join(sorted(_FIELDS))})")
    name = entry.get("name")
    if not _text(name, _NAME, MAX_POOL_NAME):
        raise _fail(index, f"name {clip_repr(name)} is not a DNS label of at most {MAX_POOL_NAME} characters")
    labels = _labels(index, entry.get("nodeLabels"), "nodeLabels")
    if not labels:
        raise _fail(index, "nodeLabels is empty: the labels only this pool's new nodes carry select them")
    try:
        model = get_model(entry.get("gpuModel"))
    except CatalogError as exc:
        raise _fail(index, f"gpuModel: {exc}") from None
    gpus = _count(index, entry.get("gpusPerNode", 1), "gpusPerNode", MAX_GPUS_PER_NODE)
    cpu = _amount(index, entry.get("cpu"), "cpu")
    memory = _amount(index, entry.get("memory"), "memory")
    if memory < 1:
        raise _fail(index, f"memory {clip_repr(entry.get('memory'))} is less than one byte")
    max_nodes = _count(index, entry.get("maxNodes", DEFAULT_MAX_NODES), "maxNodes", MAX_NODES_LIMIT)
    taints = _taints(index, entry.get("taints", []))
    return NodePool(name, labels, model, gpus, cpu, int(memory), taints, max_nodes)


def read_pools(data: object) -> tuple[NodePool, ...]:
    """The pools of a pools file: a list of pools (or ``{"pools": [...]}``), names distinct."""
    if isinstance(data, Mapping) and set(data) == {"pools"}:
        data = data["pools"]
    if not isinstance(data, list) or not 1 <= len(data) <= MAX_POOLS:
        raise PoolError(f"autoscaling pools {clip_repr(data)} is not a list of 1 to {MAX_POOLS} pools; "
                        f"e.g. [{POOL_EXAMPLE}]")
    pools = tuple(read_pool(i, entry) for i, entry in enumerate(data))
    names = [p.name for p in pools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PoolError(f"autoscaling pool name(s) {', '.join(twice)} used twice; each pool has its own name")
    return pools



def chunk_pod_spec(pool: NodePool, image: str) -> dict:
    """The pod that stands for one new node of ``pool`` (a CapacityBuffer's chunk, or a placeholder):
    the pool's node selector and tolerations, and requests of just over half the node's CPU and memory,
    so that two never share one node. Nothing the new node does not register (no GPU resource, no DRA
    claim): a request the node never offers would keep the autoscaler's node from initializing."""
    cpu_milli = int(pool.cpu * 1000) // 2 + 1
    memory_mi = pool.memory // 2**21 + 1
    spec: dict = {
        "nodeSelector": dict(pool.labels),
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [{
            "name": "placeholder", "image": image,
            "resources": {"requests": {"cpu": f"{cpu_milli}m", "memory": f"{memory_mi}Mi"}},
        }],
    }
    if pool.taints:
        spec["tolerations"] = [{"operator": "Equal", **dict(t)} for t in pool.taints]
    return spec
