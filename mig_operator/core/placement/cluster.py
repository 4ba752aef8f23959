"""The cluster as the controller reads it: plain records of what the agents published and what the
controller decided, and the words for a decision.

``NodeInventory`` (a GpuNode's status: GPUs, their models' profiles, instances and who holds them,
fractions, the node's conditions), ``Binding`` (a GpuSlice status's decision, or one just made),
``gpu_role`` (what a GPU serves and why), the refusal codes and ``Refusal``, and ``fraction_granted``
(a fraction GPU's occupancy). Where a slice goes is ``core.placement.cluster_planner``; the books it is kept
in, ``core.books.ledger``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from ..node.device_plugin import conflict_from_conditions
from ..node.health import GPU_UNHEALTHY as GPU_UNHEALTHY  # re-exported: a refusal code
from ..node.health import HEALTHY, GpuHealth, health_from_conditions
from ..node.runtime_trust import untrusted_from_conditions
from ..requests.quantities import format_bytes
from .compute import GpuCompute, compute_from_status, format_compute, gpu_compute, mig_compute
from .node_blocks import DEVICE_PLUGIN_CONFLICT as DEVICE_PLUGIN_CONFLICT  # re-exported: a refusal code
from .node_blocks import RUNTIME_UNTRUSTED as RUNTIME_UNTRUSTED  # re-exported: a refusal code
from .profiles import GpuModel, Placement, Profile
from .tenancy import OTHER_NAMESPACE as OTHER_NAMESPACE  # re-exported: a refusal code

MODE_MIG = "mig"
MODE_FRACTION = "fraction"
ROLE_NONE = "none"

# Refusal codes, written to status.reason of a Pending slice (CamelCase, as Kubernetes reasons are).
NO_GPU = "NoGpu"
TOO_LARGE = "TooLarge"
NO_SUCH_PROFILE = "NoSuchProfile"
NO_CAPACITY = "NoCapacity"
# A fraction that comes to less than the smallest slice on every GPU it may use.
TOO_SMALL = "TooSmall"
# spec.nodeName names a node with no GpuNode: no such node, or no agent runs on it.
NO_SUCH_NODE = "NoSuchNode"
# Also refusal codes, defined beside their rules and imported above: DEVICE_PLUGIN_CONFLICT and
# RUNTIME_UNTRUSTED (core.placement.node_blocks: every node the slice may use takes no new slice), OTHER_NAMESPACE
# (core.placement.tenancy: the fraction GPUs with room serve another namespace), GPU_UNHEALTHY
# (core.node.health: every GPU the slice may use is unhealthy).

# Kubernetes caps status.message at 4096 characters; a refusal must fit however many GPUs there are.
MAX_MESSAGE = 4096


@dataclass(frozen=True)
class InstanceState:
    """One MIG instance as the node's agent published it."""

    gi_id: int
    ci_id: int
    profile_id: int
    profile: str
    start: int
    size: int
    device_uuid: str = ""
    in_use: bool = False  # NVML: a process runs on it
    slice_uid: str = ""  # the slice the agent recorded as its owner; empty when idle
    slice: str = ""  # <namespace>/<name> of that slice
    idle_since: str | None = None

    @property
    def mask(self) -> int:
        return Placement(self.start, self.size).mask

    @property
    def complete(self) -> bool:
        """A GPU instance with its compute instance and device: only such an instance is handed out."""
        return self.ci_id >= 0 and bool(self.device_uuid)


@dataclass(frozen=True)
class FractionState:
    """One fraction its node's agent holds on a GPU (the GpuNode's ``fractions``)."""

    slice_uid: str
    slice: str  # <namespace>/<name>
    granted_bytes: int
    compute: float | None = None  # its compute share (MPS); None: shared


@dataclass(frozen=True)
class GpuState:
    """One GPU of a node's inventory."""

    index: int
    uuid: str
    product: str = ""
    model: str = ""
    memory_mib: int = 0
    mig_capable: bool = False
    mig_enabled: bool = False
    profiles: tuple[Profile, ...] = ()
    instances: tuple[InstanceState, ...] = ()
    fractions: tuple[FractionState, ...] = ()
    # Its ``Healthy`` condition (core.node.health): an unhealthy GPU takes no new slice and its idle
    # instances are not reused; the slices bound there stay.
    health: GpuHealth = HEALTHY


@dataclass(frozen=True)
class NodeInventory:
    node: str
    gpus: tuple[GpuState, ...] = ()
    # The device plugin's resources its GpuNode's DevicePluginConflict condition names while True:
    # the node takes no new slice (its bindings stay). Empty: it may take new slices.
    device_plugin_conflict: tuple[str, ...] = ()
    # The message of its RuntimeTrusted condition while False: no new slice unless the Node is
    # labelled cdmo.io/runtime-trust=accepted. None: True, Unknown or not published.
    runtime_untrusted: str | None = None


@dataclass(frozen=True)
class Binding:
    """Where a slice was bound: what its status says, or what the controller just decided."""

    uid: str
    node: str
    gpu: int
    mode: str  # MODE_MIG or MODE_FRACTION
    granted_bytes: int = 0
    profile_id: int = -1
    profile: str = ""
    start: int = 0
    size: int = 0
    namespace: str = ""  # the slice's: a fraction GPU's tenant (core.placement.tenancy)
    # A fraction's compute share in (0, 1], served by MPS (core.placement.compute); None: shared (time-sliced),
    # and always None for a MIG slice, whose compute is its profile's.
    compute: float | None = None

    @property
    def mask(self) -> int:
        return Placement(self.start, self.size).mask if self.mode == MODE_MIG else 0


def gpu_role(labelled: bool, gpu: GpuState) -> tuple[str, str]:
    """Whether a GPU serves MIG slices, fractions or nothing new, and why, in words for its GpuNode.

    Admins enable MIG mode themselves and then label the node; the operator never changes MIG mode.
    """
    if gpu.mig_enabled:
        if labelled:
            return MODE_MIG, "MIG mode is enabled and the node is labelled for MIG"
        return ROLE_NONE, (
            "MIG mode is enabled but the node is not labelled cdmo.clear.ml/gpu-partitioning=mig: "
            "no new slices until it is labelled (or MIG is disabled)"
        )
    if not gpu.mig_capable:
        return MODE_FRACTION, "the GPU has no MIG: it serves fractions"
    if labelled:
        return MODE_FRACTION, (
            f"the node is labelled for MIG but MIG mode is disabled on GPU {gpu.index}: it serves fractions "
            f"until an admin enables MIG (nvidia-smi -i {gpu.index} -mig 1)"
        )
    return MODE_FRACTION, "MIG mode is disabled: the GPU serves fractions"


def binding_mig_compute(gpu: GpuState | None, binding: Binding) -> str:
    """A MIG binding's compute for its status (``3/7``): its profile's compute slices over the most
    any profile of its GPU has; ``""`` for a fraction or a GPU whose profiles are not known."""
    if gpu is None or binding.mode != MODE_MIG:
        return ""
    profile = next((p for p in gpu.profiles if p.id == binding.profile_id), None)
    if profile is None or profile.slices <= 0:
        return ""
    return mig_compute(profile.slices, max(p.slices for p in gpu.profiles))


@lru_cache(maxsize=256)
def model_of(name: str, product: str, memory_mib: int, profiles: tuple[Profile, ...]) -> GpuModel:
    """The planner's model for a published profile table; equal tables share one object, so the
    planner's caches keyed by model keep working across inventory updates."""
    slots = max((pl.start + pl.size for p in profiles for pl in p.placements), default=0)
    return GpuModel(name=name or product, product=product, memory_slots=slots, memory_mib=memory_mib,
                    profiles=profiles)


def fraction_granted(gpu: GpuState, bound: Iterable[Binding]) -> int:
    """Memory taken on a fraction GPU: the bindings made, and what its agent still holds for slices
    no binding names (a slice gone while its claim is in use), each slice once."""
    granted = {b.uid: b.granted_bytes for b in bound if b.mode == MODE_FRACTION}
    for held in gpu.fractions:
        granted.setdefault(held.slice_uid, held.granted_bytes)
    return sum(granted.values())


def fraction_compute(gpu: GpuState, bound: Iterable[Binding]) -> GpuCompute:
    """Compute given out on a fraction GPU, counted as ``fraction_granted`` counts memory."""
    shares = {b.uid: b.compute for b in bound if b.mode == MODE_FRACTION}
    for held in gpu.fractions:
        shares.setdefault(held.slice_uid, held.compute)
    return gpu_compute(shares.values())


@dataclass(frozen=True)
class Refusal(Exception):
    """No GPU can take the request now: ``code`` for status.reason, ``message`` for status.message."""

    code: str
    message: str

    def __str__(self) -> str:
        return self.message


def clip_message(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


# --- reading the published records ---------------------------------------------------------------


def _profile_from(raw: Mapping) -> Profile:
    placements = tuple(
        sorted(Placement(int(p["start"]), int(p["size"])) for p in raw.get("placements") or ())
    )
    return Profile(
        name=str(raw["name"]), id=int(raw["id"]), slices=int(raw.get("slices", 0)),
        memory_mib=int(raw.get("memoryMiB", 0)), sm=int(raw.get("sm", 0)),
        max_instances=int(raw.get("maxInstances", len(placements))), placements=placements,
    )


def _instance_from(raw: Mapping) -> InstanceState:
    return InstanceState(
        gi_id=int(raw.get("giId", -1)), ci_id=int(raw.get("ciId", -1)), profile_id=int(raw["profileId"]),
        profile=str(raw.get("profile", "")), start=int(raw["start"]), size=int(raw["size"]),
        device_uuid=str(raw.get("deviceUUID", "")), in_use=bool(raw.get("inUse", False)),
        slice_uid=str(raw.get("sliceUID", "")), slice=str(raw.get("slice", "")),
        idle_since=raw.get("idleSince"),
    )


def _share(value: object) -> float | None:
    """A published fraction's compute share (a number in (0, 1]); None: shared, or not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        return None
    return float(value)


def published_profiles(status: Mapping | None) -> dict[str, list]:
    """Each model's profile table as a GpuNode status publishes it (``models``), raw, by model name.
    A GPU's ``model`` names its table; a GPU without MIG names none (``""``)."""
    tables: dict[str, list] = {}
    models = (status or {}).get("models")
    for raw in models if isinstance(models, list) else ():
        if isinstance(raw, Mapping) and isinstance(raw.get("name"), str) and raw["name"]:
            profiles = raw.get("profiles")
            tables[raw["name"]] = profiles if isinstance(profiles, list) else []
    return tables


def _profile_tables(status: Mapping | None) -> dict[str, tuple[Profile, ...] | None]:
    """``published_profiles`` read into Profiles, each table once; None for a table not well formed."""
    tables: dict[str, tuple[Profile, ...] | None] = {}
    for name, raw in published_profiles(status).items():
        try:
            tables[name] = tuple(_profile_from(p) for p in raw)
        except (KeyError, TypeError, ValueError, AttributeError):
            tables[name] = None
    return tables


def _gpu_profiles(model: str, tables: Mapping[str, tuple[Profile, ...] | None]) -> tuple[Profile, ...]:
    """The profiles of the model a GPU names: none for ``""``; a KeyError for a model the status does
    not publish, or publishes not well formed (its GPU is then skipped, as any malformed entry is)."""
    if not model:
        return ()
    table = tables.get(model)
    if table is None:
        raise KeyError(f"GPU names model {model!r}, which the status's models do not publish well formed")
    return table


def inventory_from_status(node: str, status: Mapping | None) -> NodeInventory:
    """A GpuNode's status as a NodeInventory; entries that are not well formed are skipped, and so is
    a GPU naming a model whose profile table is missing or not well formed (its MIG room is unknown)."""
    gpus = []
    tables = _profile_tables(status)
    for raw in (status or {}).get("gpus") or ():
        try:
            gpus.append(
                GpuState(
                    index=int(raw["index"]), uuid=str(raw["uuid"]), product=str(raw.get("product", "")),
                    model=str(raw.get("model", "")), memory_mib=int(raw.get("memoryMiB", 0)),
                    mig_capable=bool(raw.get("migCapable", False)), mig_enabled=bool(raw.get("migEnabled", False)),
                    profiles=_gpu_profiles(str(raw.get("model", "")), tables),
                    instances=tuple(_instance_from(i) for i in raw.get("instances") or ()),
                    fractions=tuple(FractionState(str(f["sliceUID"]), str(f.get("slice", "")), int(f.get("bytes", 0)),
                                                  _share(f.get("compute")))
                                    for f in raw.get("fractions") or () if f.get("sliceUID")),
                    health=health_from_conditions(raw.get("conditions")),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # the agent wrote it; a malformed entry is skipped rather than stopping every binding
    conditions = (status or {}).get("conditions")
    conflict = conflict_from_conditions(conditions, (status or {}).get("devicePluginResources"))
    return NodeInventory(node, tuple(sorted(gpus, key=lambda g: g.index)), conflict,
                         untrusted_from_conditions(conditions))


def binding_from_status(uid: str, status: Mapping | None, namespace: str = "") -> Binding | None:
    """The binding a GpuSlice status records, or None when it has none (Pending, Failed, empty);
    ``namespace`` is the slice's (a fraction GPU's tenant)."""
    status = status or {}
    if status.get("phase") not in BOUND_PHASES or not status.get("node"):
        return None
    try:
        mode = str(status.get("mode", ""))
        if mode == MODE_MIG:
            placement = status.get("placement") or {}
            return Binding(uid, str(status["node"]), int(status["gpu"]), mode, int(status.get("grantedBytes", 0)),
                           int(status["profileId"]), str(status.get("profile", "")), int(placement["start"]),
                           int(placement["size"]), namespace)
        if mode == MODE_FRACTION:
            return Binding(uid, str(status["node"]), int(status["gpu"]), mode, int(status.get("grantedBytes", 0)),
                           namespace=namespace, compute=compute_from_status(status.get("compute")))
    except (KeyError, TypeError, ValueError):
        return None
    return None


def describe_binding(binding: Binding) -> str:
    """A short human form for logs and Events: ``1g.18gb@0 on node-a/gpu 1`` or ``4Gi fraction ...``."""
    if binding.mode == MODE_MIG:
        return f"{binding.profile} at {{{binding.start}}}:{binding.size} on {binding.node} GPU {binding.gpu}"
    share = "" if binding.compute is None else f" with compute {format_compute(binding.compute)}"
    return f"{format_bytes(binding.granted_bytes)} fraction{share} of {binding.node} GPU {binding.gpu}"


# Phases in which a slice holds a binding (and so its GPU room).
BOUND_PHASES = frozenset({"Bound", "Creating", "Ready"})
