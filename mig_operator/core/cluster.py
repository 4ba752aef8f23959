"""The cluster as the controller sees it, and the binding of one slice to a GPU.

Inputs are plain records: each node's inventory as its agent published it (``NodeInventory``, read
from the GpuNode status), which nodes an admin labelled for MIG, and the bindings the controller
has already made (``Binding``, read from GpuSlice statuses or just decided). ``build_view`` turns
them into the planner's ``MigGpu``/``FractionGpu`` lists; ``plan_binding`` decides where one request
goes. Both are pure, so the controller's handler only reads state, calls them and writes the result.

Bindings take precedence over inventories: the agents publish what exists, which lags behind what
the controller has decided. An instance a binding will reuse is in use; one a binding's placement
overlaps is being reclaimed and is gone; a binding whose instance does not exist yet holds its
placement. That is what keeps two slices bound in the same second off one placement.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .device_plugin import conflict_from_conditions
from .node_blocks import DEVICE_PLUGIN_CONFLICT as DEVICE_PLUGIN_CONFLICT  # re-exported: a refusal code
from .node_blocks import RUNTIME_UNTRUSTED as RUNTIME_UNTRUSTED  # re-exported: a refusal code
from .node_blocks import (
    NodeBlock,
    blocked_code,
    blocked_note,
    blocked_text,
    node_block,
)
from .planner import (
    FractionGpu,
    InstanceSlot,
    MigDecision,
    MigGpu,
    PlannerSettings,
    Unplaceable,
    choose_fraction,
    choose_mig,
    fraction_bytes,
)
from .planning_index import PlanningIndex
from .profiles import GpuModel, Placement, Profile
from .quantities import MIB, format_bytes, mib_ceil
from .request import MIN_SLICE_BYTES, SliceRequest
from .runtime_trust import untrusted_from_conditions
from .tenancy import OTHER_NAMESPACE, namespace_of, other_namespace_message

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
# RUNTIME_UNTRUSTED (core.node_blocks: every node the slice may use takes no new slice), OTHER_NAMESPACE
# (core.tenancy: the fraction GPUs with room serve another namespace).

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
    def complete(self) -> bool:
        """A GPU instance with its compute instance and device: only such an instance is handed out."""
        return self.ci_id >= 0 and bool(self.device_uuid)


@dataclass(frozen=True)
class FractionState:
    """One fraction its node's agent holds on a GPU (the GpuNode's ``fractions``)."""

    slice_uid: str
    slice: str  # <namespace>/<name>
    granted_bytes: int


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
    namespace: str = ""  # the slice's: a fraction GPU's tenant (core.tenancy)

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start if self.mode == MODE_MIG else 0


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


@lru_cache(maxsize=256)
def model_of(name: str, product: str, memory_mib: int, profiles: tuple[Profile, ...]) -> GpuModel:
    """The planner's model for a published profile table; equal tables share one object, so the
    planner's caches keyed by model keep working across inventory updates."""
    slots = max((pl.start + pl.size for p in profiles for pl in p.placements), default=0)
    return GpuModel(name=name or product, product=product, memory_slots=slots, memory_mib=memory_mib,
                    profiles=profiles)


@dataclass
class ClusterView:
    """The planner's input for one decision, plus what is needed to write the decision down."""

    mig: list[MigGpu] = field(default_factory=list)
    fraction: list[FractionGpu] = field(default_factory=list)
    uuids: dict[tuple[str, int], str] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=set)  # nodes that have an inventory (a GpuNode)
    # Nodes whose GPUs take no new slice (core.node_blocks) -> why.
    blocked: dict[str, NodeBlock] = field(default_factory=dict)


def _same(inst: InstanceState, binding: Binding) -> bool:
    return inst.start == binding.start and inst.profile_id == binding.profile_id


def _overlaps(inst: InstanceState, binding: Binding) -> bool:
    return bool((((1 << inst.size) - 1) << inst.start) & binding.mask)


def build_view(
    inventories: Iterable[NodeInventory], labelled_nodes: Collection[str], bindings: Iterable[Binding],
    sharing_nodes: Collection[str] = (), accepted_nodes: Collection[str] = (),
) -> ClusterView:
    """Every GPU that can take a new slice, with the bindings already made counted in.

    ``labelled_nodes`` carry the MIG label; ``sharing_nodes`` cdmo.io/fraction-sharing=cross-namespace;
    ``accepted_nodes`` cdmo.io/runtime-trust=accepted."""
    by_gpu: dict[tuple[str, int], list[Binding]] = {}
    live: set[str] = set()
    for binding in bindings:
        by_gpu.setdefault((binding.node, binding.gpu), []).append(binding)
        live.add(binding.uid)
    view = ClusterView()
    for inventory in inventories:
        view.nodes.add(inventory.node)
        labelled = inventory.node in labelled_nodes
        block = _block(inventory, inventory.node in accepted_nodes)
        if block is not None:
            view.blocked[inventory.node] = block
        for gpu in inventory.gpus:
            view.uuids[(inventory.node, gpu.index)] = gpu.uuid
            if block is not None:
                continue  # another allocator, or an untrusted runtime: no new slice here
            role, _why = gpu_role(labelled, gpu)
            bound = by_gpu.get((inventory.node, gpu.index), [])
            if role == MODE_MIG and gpu.profiles:
                view.mig.append(_mig_gpu(inventory.node, gpu, [b for b in bound if b.mode == MODE_MIG], live))
            elif role == MODE_FRACTION and gpu.memory_mib > 0:
                view.fraction.append(_fraction_gpu(inventory.node, gpu, bound, inventory.node in sharing_nodes))
    return view


def _block(inventory: NodeInventory, accepted: bool) -> NodeBlock | None:
    return node_block(inventory.node, inventory.device_plugin_conflict, inventory.runtime_untrusted, accepted)


def fraction_granted(gpu: GpuState, bound: Iterable[Binding]) -> int:
    """Memory taken on a fraction GPU: the bindings made, and what its agent still holds for slices
    no binding names (a slice gone while its claim is in use), each slice once."""
    granted = {b.uid: b.granted_bytes for b in bound if b.mode == MODE_FRACTION}
    for held in gpu.fractions:
        granted.setdefault(held.slice_uid, held.granted_bytes)
    return sum(granted.values())


def _fraction_gpu(node: str, gpu: GpuState, bound: list[Binding], sharing: bool) -> FractionGpu:
    """A GPU serving fractions: what is taken on it, and its tenants (core.tenancy): the namespaces
    of its fraction bindings and of the fractions its agent still holds there."""
    reported = (namespace_of(f.slice) for f in gpu.fractions)
    held = frozenset(b.namespace for b in bound if b.mode == MODE_FRACTION)
    held |= frozenset(ns for ns in reported if ns is not None)
    return FractionGpu(node, gpu.index, gpu.memory_mib * MIB, fraction_granted(gpu, bound), held, sharing)


def _mig_gpu(node: str, gpu: GpuState, bound: list[Binding], live: Collection[str]) -> MigGpu:
    slots: list[InstanceSlot] = []
    for inst in gpu.instances:
        if any(_overlaps(inst, b) and not _same(inst, b) for b in bound):
            continue  # a binding reclaims it: as good as gone
        held = (
            any(_same(inst, b) for b in bound)
            or inst.in_use
            or not inst.complete  # half-made: the agent completes it before anyone gets it
            or inst.slice_uid in live
        )
        slots.append(InstanceSlot(inst.profile_id, inst.start, inst.size, in_use=held))
    for b in bound:
        if not any(_same(inst, b) for inst in gpu.instances):
            slots.append(InstanceSlot(b.profile_id, b.start, b.size, in_use=True))
    model = model_of(gpu.model, gpu.product, gpu.memory_mib, gpu.profiles)
    return MigGpu(node, gpu.index, model, tuple(sorted(slots, key=lambda s: s.start)))


@dataclass(frozen=True)
class Refusal(Exception):
    """No GPU can take the request now: ``code`` for status.reason, ``message`` for status.message."""

    code: str
    message: str

    def __str__(self) -> str:
        return self.message


def plan_binding(
    request: SliceRequest,
    view: ClusterView,
    node: str | None = None,
    settings: PlannerSettings | None = None,
    namespace: str = "",
) -> Binding:
    """Where ``request`` goes: a MIG GPU when one can take it (hardware isolation), else a fraction GPU
    that no other namespace holds (``core.tenancy``).

    ``node`` pins the choice to one node (spec.nodeName). A request by profile name needs a MIG GPU.
    The returned binding has no uid and carries ``namespace`` (the slice's); raises Refusal with a code
    and a message of at most MAX_MESSAGE.
    """
    if node is not None and node not in view.nodes:
        raise no_such_node(request, node)
    mig = [g for g in view.mig if node is None or g.node == node]
    fraction = [g for g in view.fraction if node is None or g.node == node]
    blocked = {n: r for n, r in view.blocked.items() if node is None or n == node}
    return _decide(request, node, settings or PlannerSettings(), bool(mig),
                   lambda s: choose_mig(request, mig, s), lambda: {g.model for g in mig}, fraction,
                   blocked=blocked, namespace=namespace)


def no_such_node(request: SliceRequest, node: str) -> Refusal:
    """The refusal of a slice pinned to a node that has no GpuNode: it binds once the node's agent
    publishes one (every GpuNode change plans Pending slices again)."""
    return Refusal(NO_SUCH_NODE, _clip(
        f"node {node} does not exist or runs no mig-operator agent (there is no GpuNode {node}): "
        f"{request.describe()} waits for it"))


def _decide(
    request: SliceRequest,
    node: str | None,
    settings: PlannerSettings,
    has_mig: bool,
    choose: Callable[[PlannerSettings], MigDecision],
    models: Callable[[], Iterable[GpuModel]],
    fraction: list[FractionGpu],
    where: str | None = None,
    blocked: Mapping[str, NodeBlock] | None = None,
    namespace: str = "",
) -> Binding:
    """The one rule, whether the MIG GPUs come as a list or as a PlanningIndex.

    ``blocked``: the nodes within reach whose GPUs were left out (``core.node_blocks``); a refusal
    names them, and when nothing else was within reach its code is theirs. Fractions go only to GPUs
    ``namespace`` may use (``core.tenancy``); when only GPUs of other namespaces have room, the code is
    OtherNamespace.
    """
    if request.profile is not None:
        fraction = []
    if where is None:
        where = f"on node {node}" if node is not None else "in the cluster"
    blocked = blocked or {}
    if not has_mig and not fraction:
        if blocked:
            raise Refusal(blocked_code(blocked), _clip(blocked_text(request, blocked)))
        kind = "MIG GPU" if request.profile is not None else "GPU"
        raise Refusal(NO_GPU, _clip(f"no {kind} {where} can take slices: {request.describe()} waits for one"))
    reasons: list[str] = []
    if has_mig:
        try:
            decision = choose(settings)
        except Unplaceable as exc:
            reasons.append(f"MIG: {exc.reason}")
        else:
            return Binding(
                uid="", node=decision.node, gpu=decision.gpu, mode=MODE_MIG,
                granted_bytes=decision.profile.memory_mib * MIB, profile_id=decision.profile.id,
                profile=decision.profile.name, start=decision.start, size=decision.size, namespace=namespace,
            )
    if fraction:
        try:
            share = choose_fraction(request, fraction, namespace)
        except Unplaceable:
            pass
        else:
            return Binding(uid="", node=share.node, gpu=share.gpu, mode=MODE_FRACTION,
                           granted_bytes=share.granted_bytes, namespace=namespace)
        held = _held_by_others(request, namespace, [g for g in fraction if not g.may_take(namespace)])
        if held is not None:
            raise Refusal(OTHER_NAMESPACE, _clip("; ".join([held, *reasons])))
        # No GPU fits it, whoever holds them: the reason is the same for every namespace (a pass of the
        # binder reuses a NoCapacity refusal for an equal request of another namespace).
        try:
            choose_fraction(request, fraction)
        except Unplaceable as exc:
            reasons.append(f"fractions: {exc.reason}")
    code = _refusal_code(request, list(models()) if has_mig else [], fraction)
    if blocked:
        reasons.append(blocked_note(blocked))
    raise Refusal(code, _clip(f"{request.describe()} fits nowhere {where}: " + "; ".join(reasons)))


def _fits(request: SliceRequest, gpu: FractionGpu) -> bool:
    need = fraction_bytes(request, gpu.memory_bytes)
    return need <= gpu.free_bytes and (request.fraction is None or need >= MIN_SLICE_BYTES)


def _held_by_others(request: SliceRequest, namespace: str, others: list[FractionGpu]) -> str | None:
    """When a GPU that other namespaces hold has room for the request, why it waits (naming the GPU
    best fit would have chosen); None when tenancy is not what keeps it waiting."""
    try:
        share = choose_fraction(request, others)
    except Unplaceable:
        return None
    chosen = next(g for g in others if (g.node, g.index) == (share.node, share.gpu))
    with_room = sum(1 for g in others if _fits(request, g))
    return other_namespace_message(request, namespace, chosen, share.granted_bytes, with_room)


def _refusal_code(request: SliceRequest, models: list[GpuModel], fraction: list[FractionGpu]) -> str:
    """TooLarge (or NoSuchProfile, TooSmall) when no GPU could ever take it, else NoCapacity: it waits
    for room."""
    if request.profile is not None:
        offered = any(model.has_profile(request.profile) for model in models)
        return NO_CAPACITY if offered else NO_SUCH_PROFILE
    if request.memory_bytes is not None:
        need_mib = mib_ceil(request.memory_bytes)
        largest_mig = max((p.memory_mib for m in models for p in m.profiles if p.placements), default=0)
        largest_gpu = max((g.memory_bytes for g in fraction), default=0)
        if need_mib > largest_mig and request.memory_bytes > largest_gpu:
            return TOO_LARGE
    if request.fraction is not None and not models and fraction:
        largest_gpu = max(g.memory_bytes for g in fraction)
        if fraction_bytes(request, largest_gpu) < MIN_SLICE_BYTES:
            return TOO_SMALL
    return NO_CAPACITY


class ClusterPlanner:
    """``build_view`` and ``plan_binding`` kept current instead of rebuilt for every decision.

    The controller feeds it inventories, labels and bindings as they change; a GPU is recomputed
    (with ``build_view``'s rules) only when its inventory, its node's label or one of its bindings
    changed, and MIG GPUs live in a ``PlanningIndex``, so a decision costs the same on 16 GPUs as on
    16,000. ``plan`` decides exactly as ``plan_binding`` on ``build_view`` of the same inputs (a
    property test holds them equal). Pure: no I/O; one caller at a time.
    """

    def __init__(self) -> None:
        self._inventories: dict[str, NodeInventory] = {}
        self._labelled: set[str] = set()
        self._sharing: set[str] = set()  # nodes labelled cdmo.io/fraction-sharing=cross-namespace
        self._accepted: set[str] = set()  # nodes labelled cdmo.io/runtime-trust=accepted
        self._bindings: dict[str, Binding] = {}
        self._by_gpu: dict[tuple[str, int], dict[str, Binding]] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._dirty_nodes: set[str] = set()
        self._index = PlanningIndex()
        self._fraction: dict[tuple[str, int], FractionGpu] = {}
        self._shown: dict[str, set[int]] = {}  # node -> GPU indices currently in the index or fractions
        self._blocked: dict[str, NodeBlock] = {}  # node -> why it takes no new slice
        self.uuids: dict[tuple[str, int], str] = {}

    # ---- inputs ---------------------------------------------------------------------------------

    @property
    def inventories(self) -> Mapping[str, NodeInventory]:
        return self._inventories

    @property
    def bindings(self) -> Mapping[str, Binding]:
        return self._bindings

    def labels_of(self, node: str) -> tuple[bool, bool, bool]:
        """The node's MIG, fraction-sharing and runtime-trust-accepted labels."""
        return node in self._labelled, node in self._sharing, node in self._accepted

    def set_inventory(self, inventory: NodeInventory) -> None:
        self._inventories[inventory.node] = inventory
        self._update_block(inventory.node)

    def remove_inventory(self, node: str) -> None:
        self._inventories.pop(node, None)
        self._update_block(node)

    def _update_block(self, node: str) -> None:
        inventory = self._inventories.get(node)
        block = _block(inventory, node in self._accepted) if inventory is not None else None
        if block is None:
            self._blocked.pop(node, None)
        else:
            self._blocked[node] = block
        self._dirty_nodes.add(node)

    def set_labelled(self, node: str, labelled: bool) -> None:
        """The node's MIG label (cdmo.clear.ml/gpu-partitioning=mig)."""
        self._set(self._labelled, node, labelled)

    def set_fraction_sharing(self, node: str, sharing: bool) -> None:
        """The node's label cdmo.io/fraction-sharing=cross-namespace (core.tenancy)."""
        self._set(self._sharing, node, sharing)

    def set_runtime_accepted(self, node: str, accepted: bool) -> None:
        """The node's label cdmo.io/runtime-trust=accepted (core.runtime_trust)."""
        if self._set(self._accepted, node, accepted):
            self._update_block(node)

    def _set(self, nodes: set[str], node: str, on: bool) -> bool:
        if on == (node in nodes):
            return False
        (nodes.add if on else nodes.discard)(node)
        self._dirty_nodes.add(node)
        return True

    def put_binding(self, binding: Binding) -> None:
        old = self._bindings.get(binding.uid)
        if old == binding:
            return
        if old is not None:
            self.drop_binding(binding.uid)
        self._bindings[binding.uid] = binding
        self._by_gpu.setdefault((binding.node, binding.gpu), {})[binding.uid] = binding
        self._dirty.add((binding.node, binding.gpu))

    def drop_binding(self, uid: str) -> None:
        old = self._bindings.pop(uid, None)
        if old is None:
            return
        on_gpu = self._by_gpu.get((old.node, old.gpu), {})
        on_gpu.pop(uid, None)
        if not on_gpu:
            self._by_gpu.pop((old.node, old.gpu), None)
        self._dirty.add((old.node, old.gpu))

    def reset(self, inventories: Iterable[NodeInventory], labelled: Iterable[str], bindings: Iterable[Binding],
              sharing: Iterable[str] = (), accepted: Iterable[str] = ()) -> None:
        """Everything afresh (after a full list); the node sets as ``build_view`` takes them."""
        for node in list(self._inventories):
            self.remove_inventory(node)
        for uid in list(self._bindings):
            self.drop_binding(uid)
        for nodes, setter in ((self._labelled, self.set_labelled), (self._sharing, self.set_fraction_sharing),
                              (self._accepted, self.set_runtime_accepted)):
            for node in list(nodes):
                setter(node, False)
        for inventory in inventories:
            self.set_inventory(inventory)
        for node in labelled:
            self.set_labelled(node, True)
        for node in sharing:
            self.set_fraction_sharing(node, True)
        for node in accepted:
            self.set_runtime_accepted(node, True)
        for binding in bindings:
            self.put_binding(binding)

    # ---- deciding -------------------------------------------------------------------------------

    def plan(self, request: SliceRequest, node: str | None = None, settings: PlannerSettings | None = None,
             nodes: Collection[str] | None = None, namespace: str = "") -> Binding:
        """``plan_binding(request, build_view(...), node, settings, namespace)`` on the current inputs.

        ``nodes``, if given, restricts the choice to those nodes as well (a pod's node selector:
        the GpuSlice annotation ``cdmo.io/eligible-nodes``); with ``node`` too, both must hold.
        """
        if node is not None and node not in self._inventories:
            raise no_such_node(request, node)
        self._refresh()
        index = self._index
        where = None
        if nodes is not None:
            allowed = sorted(set(nodes) if node is None else set(nodes) & {node})
            if node is None:
                shown = ", ".join(allowed[:5]) + (" ..." if len(allowed) > 5 else "")
                where = f"on its eligible nodes ({shown or 'none'})"
            pinned: list[str] | None = allowed
        else:
            pinned = None if node is None else [node]
        has_mig = bool(len(index)) if pinned is None else any(n in index.nodes() for n in pinned)
        fraction = [g for g in self._fraction.values() if pinned is None or g.node in pinned]
        fraction.sort(key=lambda g: (g.node, g.index))
        models = (lambda: index.models()) if pinned is None else (lambda: {g.model for g in index.gpus(pinned)})
        blocked = self._blocked if pinned is None else {n: self._blocked[n] for n in pinned if n in self._blocked}
        return _decide(request, node, settings or PlannerSettings(), has_mig,
                       lambda s: index.choose(request, s, nodes=pinned), models, fraction, where, blocked, namespace)

    def plan_group(self, members: Sequence[tuple[str, SliceRequest]], node: str | None = None,
                   settings: PlannerSettings | None = None, nodes: Collection[str] | None = None,
                   what: str = "the group", namespace: str = "") -> list[Binding]:
        """Where a pod's devices go: every member ``(uid, request)`` on one node, or none (a Refusal).

        The node the planner would choose for the first member is tried first, then every other
        allowed node in name order; on each, the members are planned one after another, each
        holding its room for the next. A node that cannot take them all keeps none of them, so a
        waiting group holds nothing. On success the bindings stay put in the planner (the caller
        reserves them); on a refusal the planner is as before. ``node``: the members must go there
        (a member already bound there, or spec.nodeName).
        """
        if not members:
            return []
        settings = settings or PlannerSettings()
        _, first = members[0]
        try:
            candidates = [self.plan(first, node, settings, nodes, namespace).node]
        except Refusal as refusal:
            if refusal.code != NO_CAPACITY or node is not None:
                raise Refusal(refusal.code, _clip(f"{what} of {len(members)} devices: {refusal.message}")) from None
            candidates = []
        if node is None:
            allowed = set(self._inventories) if nodes is None else set(nodes) & set(self._inventories)
            candidates += sorted(allowed - set(candidates))
        for candidate in candidates:
            placed: list[Binding] = []
            try:
                for uid, request in members:
                    binding = replace(self.plan(request, candidate, settings, nodes, namespace), uid=uid)
                    self.put_binding(binding)
                    placed.append(binding)
            except Refusal:
                for binding in placed:
                    self.drop_binding(binding.uid)
                continue
            return placed
        where = f"node {node}" if node is not None else "any single node"
        raise Refusal(NO_CAPACITY, _clip(
            f"{what} needs {len(members)} devices ({first.describe()} first) on one node, and {where} "
            f"has room for fewer; it waits, holding none, until one node has room for all"))

    def _refresh(self) -> None:
        gpus = set(self._dirty)
        for node in self._dirty_nodes:
            gpus.update((node, i) for i in self._shown.get(node, ()))
            inventory = self._inventories.get(node)
            if inventory is not None:
                gpus.update((node, g.index) for g in inventory.gpus)
        self._dirty.clear()
        self._dirty_nodes.clear()
        for node, index in gpus:
            self._recompute(node, index)

    def _recompute(self, node: str, index: int) -> None:
        self._index.remove(node, index)
        self._fraction.pop((node, index), None)
        shown = self._shown.setdefault(node, set())
        shown.discard(index)
        inventory = self._inventories.get(node)
        gpu = next((g for g in inventory.gpus if g.index == index), None) if inventory else None
        if gpu is None:
            self.uuids.pop((node, index), None)
            return
        self.uuids[(node, index)] = gpu.uuid
        if node in self._blocked:
            return  # a device plugin hands these GPUs out too: in neither the index nor the fractions
        bound = list(self._by_gpu.get((node, index), {}).values())
        role, _why = gpu_role(node in self._labelled, gpu)
        if role == MODE_MIG and gpu.profiles:
            self._index.put(_mig_gpu(node, gpu, [b for b in bound if b.mode == MODE_MIG], self._bindings.keys()))
            shown.add(index)
        elif role == MODE_FRACTION and gpu.memory_mib > 0:
            self._fraction[(node, index)] = _fraction_gpu(node, gpu, bound, node in self._sharing)
            shown.add(index)


def _clip(message: str) -> str:
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


def inventory_from_status(node: str, status: Mapping | None) -> NodeInventory:
    """A GpuNode's status as a NodeInventory; entries that are not well formed are skipped."""
    gpus = []
    for raw in (status or {}).get("gpus") or ():
        try:
            gpus.append(
                GpuState(
                    index=int(raw["index"]), uuid=str(raw["uuid"]), product=str(raw.get("product", "")),
                    model=str(raw.get("model", "")), memory_mib=int(raw.get("memoryMiB", 0)),
                    mig_capable=bool(raw.get("migCapable", False)), mig_enabled=bool(raw.get("migEnabled", False)),
                    profiles=tuple(_profile_from(p) for p in raw.get("profiles") or ()),
                    instances=tuple(_instance_from(i) for i in raw.get("instances") or ()),
                    fractions=tuple(FractionState(str(f["sliceUID"]), str(f.get("slice", "")), int(f.get("bytes", 0)))
                                    for f in raw.get("fractions") or () if f.get("sliceUID")),
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
                           namespace=namespace)
    except (KeyError, TypeError, ValueError):
        return None
    return None


def describe_binding(binding: Binding) -> str:
    """A short human form for logs and Events: ``1g.18gb@0 on node-a/gpu 1`` or ``4Gi fraction ...``."""
    if binding.mode == MODE_MIG:
        return f"{binding.profile} at {{{binding.start}}}:{binding.size} on {binding.node} GPU {binding.gpu}"
    return f"{format_bytes(binding.granted_bytes)} fraction of {binding.node} GPU {binding.gpu}"


# Phases in which a slice holds a binding (and so its GPU room).
BOUND_PHASES = frozenset({"Bound", "Creating", "Ready"})
