"""How many new nodes of which pool would let the waiting slices be placed.

The planner itself (``ClusterPlanner``) is run on the waiting line against empty nodes of the pools:
each waiting slice (a pod's group at once) goes, oldest first, onto the pool nodes already opened for
the slices before it when one has room, else onto one more node of the first pool that can take it,
up to the pool's ``max_nodes``. No new heuristics: the same profile choice, packing and fraction rules
as on real nodes. A slice no pool can take (too large for every pool's GPU, a node selector no pool's
labels match, a quota) is left out and keeps its own reason.

Pure: no I/O; one caller at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..placement.cluster import Binding, GpuState, NodeInventory, Refusal
from ..placement.cluster_planner import ClusterPlanner
from ..placement.planner import PlannerSettings
from ..requests.request import SliceRequest
from .pools import NodePool

# A pool node's name in the scratch planner: '#' is in no Kubernetes node name.
_SEPARATOR = "#"


def _inventory(pool: NodePool, name: str) -> NodeInventory:
    mig = pool.mig
    gpus = tuple(
        GpuState(index=i, uuid=f"{name}/gpu-{i}", product=pool.model.product, model=pool.model.name,
                 memory_mib=pool.model.memory_mib, mig_capable=pool.model.mig_capable, mig_enabled=mig,
                 profiles=pool.model.profiles)
        for i in range(pool.gpus)
    )
    return NodeInventory(name, gpus)


@dataclass(frozen=True)
class Waiting:
    """One waiting slice, or a pod's group of them, as the scale-up plan takes it: ``key`` names it
    (a slice uid, or the group's), ``members`` are (uid, request), ``allows(pool)`` says whether its
    pod may run on a new node of that pool (its node selector, affinity and tolerations),
    ``admits(bindings)`` whether its namespace's quota holds what it would be granted there."""

    key: str
    namespace: str
    members: Sequence[tuple[str, SliceRequest]]
    allows: Callable[[NodePool], bool]
    admits: Callable[[Sequence[Binding]], bool] = lambda _bindings: True


class ScaleUp:
    """The new nodes the waiting line needs, kept as slices are added (``place``)."""

    def __init__(self, pools: Sequence[NodePool], settings: PlannerSettings | None = None) -> None:
        self.pools = tuple(pools)
        self._settings = settings or PlannerSettings()
        self._planner = ClusterPlanner()
        self._opened: dict[str, list[str]] = {p.name: [] for p in self.pools}
        self._by_key: dict[str, str] = {}  # waiting key -> the pool it goes to
        self._refused: set[tuple] = set()  # shapes no pool takes, so an equal one is not planned again

    @property
    def nodes(self) -> Mapping[str, int]:
        """New nodes needed, by pool name (0 for a pool that needs none)."""
        return {name: len(opened) for name, opened in self._opened.items()}

    def pool_of(self, key: str) -> str | None:
        """The pool a waiting slice (or group) placed by this plan goes to; None when it was not placed."""
        return self._by_key.get(key)

    def place(self, waiting: Waiting) -> str | None:
        """Place ``waiting`` on the pool nodes opened so far, else on one new node of the first pool that
        takes it; the pool's name, or None when no pool can."""
        if waiting.key in self._by_key:
            return self._by_key[waiting.key]
        pools = [p for p in self.pools if waiting.allows(p)]
        shape = (tuple(r for _, r in waiting.members), waiting.namespace, tuple(p.name for p in pools))
        if not pools or shape in self._refused:
            return None
        opened = [node for p in pools for node in self._opened[p.name]]
        node = self._fit(waiting, opened) if opened else None
        if node is not None:
            return self._placed(waiting, node.rsplit(_SEPARATOR, 1)[0])
        for pool in pools:
            names = self._opened[pool.name]
            if len(names) >= pool.max_nodes:
                continue
            name = f"{pool.name}{_SEPARATOR}{len(names)}"
            self._planner.set_inventory(_inventory(pool, name))
            self._planner.set_labelled(name, pool.mig)
            if self._fit(waiting, [name]) is not None:
                names.append(name)
                return self._placed(waiting, pool.name)
            self._planner.remove_inventory(name)
            self._planner.set_labelled(name, False)
        self._refused.add(shape)
        return None

    def _placed(self, waiting: Waiting, pool: str) -> str:
        self._by_key[waiting.key] = pool
        for uid, _request in waiting.members:
            self._by_key[uid] = pool
        return pool

    def _fit(self, waiting: Waiting, nodes: list[str]) -> str | None:
        """The node of ``nodes`` the planner puts ``waiting`` on (its room then held), or None."""
        try:
            placed = self._planner.plan_group(waiting.members, None, self._settings, nodes=nodes,
                                              namespace=waiting.namespace)
        except Refusal:
            return None
        if not waiting.admits(placed):
            for binding in placed:
                self._planner.drop_binding(binding.uid)
            return None
        return placed[0].node if placed else None
