"""Where a slice goes: the planner's incremental view of the cluster (``ClusterPlanner``), private to the
controller's ledger (``core.books.ledger``).

Bindings take precedence over inventories: the agents publish what exists, which lags behind what
the controller has decided. An instance a binding will reuse is in use; one a binding's placement
overlaps is being reclaimed and is gone; a binding whose instance does not exist yet holds its
placement. That is what keeps two slices bound in the same second off one placement.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from ..node.health import GPU_UNHEALTHY, GpuHealth, unhealthy_note
from ..requests.quantities import MIB, mib_ceil
from ..requests.request import MIN_SLICE_BYTES, SliceRequest
from .cluster import (
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    NO_GPU,
    NO_SUCH_NODE,
    NO_SUCH_PROFILE,
    OTHER_NAMESPACE,
    TOO_LARGE,
    TOO_SMALL,
    Binding,
    GpuState,
    InstanceState,
    NodeInventory,
    Refusal,
    clip_message,
    fraction_compute,
    fraction_granted,
    gpu_role,
    model_of,
)
from .fraction_compute import COMPUTE_MODE, COMPUTE_ONLY_FRACTIONS, compute_mode_message
from .fraction_planner import FractionGpu, choose_fraction, fraction_bytes
from .node_blocks import NodeBlock, blocked_code, blocked_note, blocked_text, node_block
from .planner import InstanceSlot, MigDecision, MigGpu, PlannerSettings, Unplaceable
from .planning_index import PlanningIndex
from .profiles import GpuModel
from .tenancy import namespace_of, other_namespace_message


def _same(inst: InstanceState, binding: Binding) -> bool:
    return inst.start == binding.start and inst.profile_id == binding.profile_id


def _overlaps(inst: InstanceState, binding: Binding) -> bool:
    return bool(inst.mask & binding.mask)


def _block(inventory: NodeInventory, accepted: bool, leaving: str | None = None) -> NodeBlock | None:
    return node_block(inventory.node, inventory.device_plugin_conflict, inventory.runtime_untrusted, accepted,
                      leaving)


def _fraction_gpu(node: str, gpu: GpuState, bound: list[Binding], sharing: bool) -> FractionGpu:
    """A GPU serving fractions: what is taken on it (memory and compute), and its tenants
    (core.placement.tenancy): the namespaces of its fraction bindings and of the fractions its agent still
    holds there."""
    reported = (namespace_of(f.slice) for f in gpu.fractions)
    held = frozenset(b.namespace for b in bound if b.mode == MODE_FRACTION)
    held |= frozenset(ns for ns in reported if ns is not None)
    return FractionGpu(node, gpu.index, gpu.memory_mib * MIB, fraction_granted(gpu, bound), held, sharing,
                       fraction_compute(gpu, bound))


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


def no_such_node(request: SliceRequest, node: str) -> Refusal:
    """The refusal of a slice pinned to a node that has no GpuNode: it binds once the node's agent
    publishes one (every GpuNode change plans Pending slices again)."""
    return Refusal(NO_SUCH_NODE, clip_message(
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
    unhealthy: Mapping[tuple[str, int], GpuHealth] | None = None,
) -> Binding:
    """The one rule, whether the MIG GPUs come as a list or as a PlanningIndex.

    ``blocked``: the nodes within reach whose GPUs were left out (``core.placement.node_blocks``); a refusal
    names them, and when nothing else was within reach its code is theirs. Fractions go only to GPUs
    ``namespace`` may use (``core.placement.tenancy``); when only GPUs of other namespaces have room, the code is
    OtherNamespace. A request with compute goes only to fraction GPUs (a MIG slice's compute is its
    profile's); when only GPUs serving the other kind of compute have room, the code is ComputeMode.
    ``unhealthy``: the GPUs within reach left out for their health (``core.node.health``), named in a
    refusal; when nothing else was within reach the code is GpuUnhealthy.
    """
    if request.profile is not None:
        fraction = []
    if request.compute is not None:
        has_mig = False
    if where is None:
        where = f"on node {node}" if node is not None else "in the cluster"
    blocked = blocked or {}
    unhealthy = unhealthy or {}
    if not has_mig and not fraction:
        if blocked:
            text = blocked_text(request, blocked) + (f"; {unhealthy_note(unhealthy)}" if unhealthy else "")
            raise Refusal(blocked_code(blocked), clip_message(text))
        if unhealthy:
            raise Refusal(GPU_UNHEALTHY, clip_message(f"{request.describe()} waits: {unhealthy_note(unhealthy)}"))
        kind = "MIG GPU" if request.profile is not None else "GPU serving fractions" if request.compute else "GPU"
        raise Refusal(NO_GPU, clip_message(f"no {kind} {where} can take slices: {request.describe()} waits for one"
                                           + (COMPUTE_ONLY_FRACTIONS if request.compute is not None else "")))
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
        default = settings.default_compute
        try:
            share = choose_fraction(request, fraction, namespace, default)
        except Unplaceable:
            pass
        else:
            return Binding(uid="", node=share.node, gpu=share.gpu, mode=MODE_FRACTION,
                           granted_bytes=share.granted_bytes, namespace=namespace, compute=share.compute)
        held = _held_by_others(request, namespace, [g for g in fraction if not g.may_take(namespace)], default)
        if held is not None:
            raise Refusal(OTHER_NAMESPACE, clip_message("; ".join([held, *reasons])))
        other_kind = compute_mode_message(request, [g for g in fraction if g.may_take(namespace)], default, namespace)
        if other_kind is not None:
            raise Refusal(COMPUTE_MODE, clip_message("; ".join([other_kind, *reasons])))
        # No GPU fits it, whoever holds them: the reason is the same for every namespace (a pass of the
        # binder reuses a NoCapacity refusal for an equal request of another namespace).
        try:
            choose_fraction(request, fraction, default_compute=default)
        except Unplaceable as exc:
            reasons.append(f"fractions: {exc.reason}")
    code = _refusal_code(request, list(models()) if has_mig else [], fraction)
    if blocked:
        reasons.append(blocked_note(blocked))
    if unhealthy:
        reasons.append(unhealthy_note(unhealthy))
    raise Refusal(code, clip_message(f"{request.describe()} fits nowhere {where}: " + "; ".join(reasons)))


def _held_by_others(request: SliceRequest, namespace: str, others: list[FractionGpu],
                    default_compute: str) -> str | None:
    """When a GPU that other namespaces hold has room for the request, why it waits (naming none of
    them); None when tenancy is not what keeps it waiting."""
    try:
        share = choose_fraction(request, others, default_compute=default_compute)
    except Unplaceable:
        return None
    return other_namespace_message(request, namespace, share.granted_bytes)


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
    """The planner's view of the cluster, kept current instead of rebuilt for every decision.

    The ledger feeds it inventories, labels and bindings as they change; a GPU is recomputed only
    when its inventory, its node's labels or one of its bindings changed, and MIG GPUs live in a
    ``PlanningIndex``, so a decision costs the same on 16 GPUs as on 16,000. A property test holds
    ``plan`` equal to a view rebuilt from scratch for each decision (tests/unit/cluster_reference.py).
    Pure: no I/O; one caller at a time.
    """

    def __init__(self) -> None:
        self._inventories: dict[str, NodeInventory] = {}
        self._labelled: set[str] = set()
        self._sharing: set[str] = set()  # nodes labelled cdmo.io/fraction-sharing=cross-namespace
        self._accepted: set[str] = set()  # nodes labelled cdmo.io/runtime-trust=accepted
        self._leaving: dict[str, str] = {}  # node -> the removal taint it carries (core.autoscale.nodes)
        self._bindings: dict[str, Binding] = {}
        self._by_gpu: dict[tuple[str, int], dict[str, Binding]] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._dirty_nodes: set[str] = set()
        self._index = PlanningIndex()
        self._fraction: dict[tuple[str, int], FractionGpu] = {}
        self._shown: dict[str, set[int]] = {}  # node -> GPU indices currently in the index or fractions
        self._blocked: dict[str, NodeBlock] = {}  # node -> why it takes no new slice
        self._unhealthy: dict[tuple[str, int], GpuHealth] = {}  # GPUs left out for their health
        self.uuids: dict[tuple[str, int], str] = {}

    # ---- inputs ---------------------------------------------------------------------------------

    @property
    def inventories(self) -> Mapping[str, NodeInventory]:
        return self._inventories

    @property
    def bindings(self) -> Mapping[str, Binding]:
        return self._bindings

    def labels_of(self, node: str) -> tuple[bool, bool, bool, str | None]:
        """The node's MIG, fraction-sharing and runtime-trust-accepted labels, and its removal taint."""
        return node in self._labelled, node in self._sharing, node in self._accepted, self._leaving.get(node)

    def set_inventory(self, inventory: NodeInventory) -> None:
        self._inventories[inventory.node] = inventory
        self._update_block(inventory.node)

    def remove_inventory(self, node: str) -> None:
        self._inventories.pop(node, None)
        self._update_block(node)

    def _update_block(self, node: str) -> None:
        inventory = self._inventories.get(node)
        block = _block(inventory, node in self._accepted, self._leaving.get(node)) if inventory is not None else None
        if block is None:
            self._blocked.pop(node, None)
        else:
            self._blocked[node] = block
        self._dirty_nodes.add(node)

    def set_labelled(self, node: str, labelled: bool) -> None:
        """The node's MIG label (cdmo.clear.ml/gpu-partitioning=mig)."""
        self._set(self._labelled, node, labelled)

    def set_fraction_sharing(self, node: str, sharing: bool) -> None:
        """The node's label cdmo.io/fraction-sharing=cross-namespace (core.placement.tenancy)."""
        self._set(self._sharing, node, sharing)

    def set_runtime_accepted(self, node: str, accepted: bool) -> None:
        """The node's label cdmo.io/runtime-trust=accepted (core.node.runtime_trust)."""
        if self._set(self._accepted, node, accepted):
            self._update_block(node)

    def set_leaving(self, node: str, taint: str | None) -> None:
        """The removal taint a node autoscaler put on the node (None: none): it takes no new slice."""
        if self._leaving.get(node) == taint:
            return
        if taint is None:
            del self._leaving[node]
        else:
            self._leaving[node] = taint
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
              sharing: Iterable[str] = (), accepted: Iterable[str] = (),
              leaving: Mapping[str, str] | None = None) -> None:
        """Everything afresh (after a full list)."""
        for node in list(self._inventories):
            self.remove_inventory(node)
        for uid in list(self._bindings):
            self.drop_binding(uid)
        for nodes, setter in ((self._labelled, self.set_labelled), (self._sharing, self.set_fraction_sharing),
                              (self._accepted, self.set_runtime_accepted)):
            for node in list(nodes):
                setter(node, False)
        for node in list(self._leaving):
            self.set_leaving(node, None)
        for node, taint in (leaving or {}).items():
            self.set_leaving(node, taint)
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
        """Where ``request`` goes: a MIG GPU when one can take it (hardware isolation), else a fraction
        GPU ``namespace`` may use (``core.placement.tenancy``); ``node`` pins it (spec.nodeName). A Refusal
        (code, message of at most MAX_MESSAGE) otherwise.

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
        allowed_nodes = None if pinned is None else set(pinned)
        unhealthy = {k: h for k, h in self._unhealthy.items() if allowed_nodes is None or k[0] in allowed_nodes}
        return _decide(request, node, settings or PlannerSettings(), has_mig,
                       lambda s: index.choose(request, s, nodes=pinned), models, fraction, where, blocked, namespace,
                       unhealthy)

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
                message = f"{what} of {len(members)} devices: {refusal.message}"
                raise Refusal(refusal.code, clip_message(message)) from None
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
        raise Refusal(NO_CAPACITY, clip_message(
            f"{what} needs {len(members)} devices ({first.describe()} first) on one node, and {where} "
            f"has room for fewer; it waits, holding none, until one node has room for all"))

    def _refresh(self) -> None:
        gpus = set(self._dirty)
        for node in self._dirty_nodes:
            gpus.update((node, i) for i in self._shown.get(node, ()))
            # An unhealthy GPU is in neither the index nor the shown set: forgotten with its node too.
            gpus.update(key for key in self._unhealthy if key[0] == node)
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
        self._unhealthy.pop((node, index), None)
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
        if not gpu.health.healthy:
            self._unhealthy[(node, index)] = gpu.health
            return  # nothing new on it, its idle instances not reused: in neither the index nor the fractions
        bound = list(self._by_gpu.get((node, index), {}).values())
        role, _why = gpu_role(node in self._labelled, gpu)
        if role == MODE_MIG and gpu.profiles:
            self._index.put(_mig_gpu(node, gpu, [b for b in bound if b.mode == MODE_MIG], self._bindings.keys()))
            shown.add(index)
        elif role == MODE_FRACTION and gpu.memory_mib > 0:
            self._fraction[(node, index)] = _fraction_gpu(node, gpu, bound, node in self._sharing)
            shown.add(index)
