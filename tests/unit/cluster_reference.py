"""The reference the incremental planner (core.placement.cluster_planner.ClusterPlanner) is held equal to:
every GPU's view rebuilt from the inventories, labels and bindings for each decision (``build_view``),
and one decision on it (``plan_binding``). Slow and obviously right: for tests only."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from mig_operator.core.node.health import GpuHealth
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, NodeInventory, gpu_role
from mig_operator.core.placement.cluster_planner import _block, _decide, _fraction_gpu, _mig_gpu, no_such_node
from mig_operator.core.placement.fraction_planner import FractionGpu
from mig_operator.core.placement.node_blocks import NodeBlock
from mig_operator.core.placement.planner import MigGpu, PlannerSettings
from mig_operator.core.placement.planning_index import choose_mig
from mig_operator.core.requests.request import SliceRequest


@dataclass
class ClusterView:
    """The planner's input for one decision, plus what is needed to write the decision down."""

    mig: list[MigGpu] = field(default_factory=list)
    fraction: list[FractionGpu] = field(default_factory=list)
    uuids: dict[tuple[str, int], str] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=set)  # nodes that have an inventory (a GpuNode)
    # Nodes whose GPUs take no new slice (core.placement.node_blocks) -> why.
    blocked: dict[str, NodeBlock] = field(default_factory=dict)
    # GPUs of unblocked nodes that take no new slice for their health (core.node.health).
    unhealthy: dict[tuple[str, int], GpuHealth] = field(default_factory=dict)


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
            if not gpu.health.healthy:
                view.unhealthy[(inventory.node, gpu.index)] = gpu.health
                continue
            role, _why = gpu_role(labelled, gpu)
            bound = by_gpu.get((inventory.node, gpu.index), [])
            if role == MODE_MIG and gpu.profiles:
                view.mig.append(_mig_gpu(inventory.node, gpu, [b for b in bound if b.mode == MODE_MIG], live))
            elif role == MODE_FRACTION and gpu.memory_mib > 0:
                view.fraction.append(_fraction_gpu(inventory.node, gpu, bound, inventory.node in sharing_nodes))
    return view


def plan_binding(
    request: SliceRequest,
    view: ClusterView,
    node: str | None = None,
    settings: PlannerSettings | None = None,
    namespace: str = "",
) -> Binding:
    """Where ``request`` goes: a MIG GPU when one can take it (hardware isolation), else a fraction GPU
    that no other namespace holds (``core.placement.tenancy``).

    ``node`` pins the choice to one node (spec.nodeName). A request by profile name needs a MIG GPU.
    The returned binding has no uid and carries ``namespace`` (the slice's); raises Refusal with a code
    and a message of at most MAX_MESSAGE.
    """
    if node is not None and node not in view.nodes:
        raise no_such_node(request, node)
    mig = [g for g in view.mig if node is None or g.node == node]
    fraction = [g for g in view.fraction if node is None or g.node == node]
    blocked = {n: r for n, r in view.blocked.items() if node is None or n == node}
    unhealthy = {k: h for k, h in view.unhealthy.items() if node is None or k[0] == node}
    return _decide(request, node, settings or PlannerSettings(), bool(mig),
                   lambda s: choose_mig(request, mig, s), lambda: {g.model for g in mig}, fraction,
                   blocked=blocked, namespace=namespace, unhealthy=unhealthy)
