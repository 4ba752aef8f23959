"""The cluster's MIG GPUs, indexed by planning state, so a decision costs the same on 64 GPUs as on 16,384.

A GPU's planning state is its model and its instances (where, which profile, in use or idle). It is
small and repeats: thousands of GPUs share a few hundred states. Every term of the planner's rule
(``planner.PlacementOption.key``) depends only on the state, so ``PlanningIndex`` computes each
state's best option per profile once, files the state under that key, and chooses among states;
within the best key, the GPU with the lowest (node, index) wins.

Structure (all pure, no I/O):

* ``_State``: one interned (model, instances) with the GPUs in it and the lowest of them.
* ``_Bucket``: the non-empty states that share one key, and the lowest GPU among all of them.
* ``_Ladder``: the buckets of one (model, profile), and the smallest key among the non-empty ones.

Keys, GPUs and states each sit in binary heaps with lazy deletion: an entry is checked when it
reaches the top and dropped if stale; a heap is rebuilt when stale entries outnumber live ones.
A decision walks the grant sizes (a handful) and, for each (model, profile) of a size, reads one
ladder top: its cost depends on the number of models and profiles, not on the number of GPUs.
Changing one GPU moves it between two states and touches each state's ladders once (about a dozen
heap operations). A refusal is summarised from counters kept on the way, never by visiting GPUs.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from ..requests.request import SliceRequest
from .mig_refusals import RoomSummary, model_order, no_room_reason, too_large_reason
from .planner import (
    InstanceSlot,
    MigDecision,
    MigGpu,
    PlacementOption,
    PlannerSettings,
    Profile,
    Unplaceable,
    grant_levels,
    instances_after,
    instances_released,
    option_decision,
    plan_on_gpu,
)
from .profiles import GpuModel

GpuId = tuple[str, int]  # (node, index): how the planner orders GPUs on a tie
DEFAULT_SETTINGS = PlannerSettings()

# A heap is rebuilt from its live entries when it holds more than this many stale ones per live one.
_STALE_RATIO = 2
_STALE_SLACK = 16


class _State:
    """GPUs that share one planning state; the lowest GPU id is kept in a lazy heap."""

    __slots__ = ("model", "instances", "used", "members", "heap", "options", "buckets", "serial")

    def __init__(self, model: GpuModel, instances: tuple[InstanceSlot, ...], serial: int) -> None:
        self.model = model
        self.instances = instances
        busy = 0
        for inst in instances:
            if inst.in_use:
                busy |= inst.mask
        self.used = busy.bit_count()
        self.members: set[GpuId] = set()
        self.heap: list[GpuId] = []
        self.serial = serial
        # Best option per profile id (None: cannot go here), and the buckets this state is filed in.
        self.options: dict[int, PlacementOption | None] = {}
        self.buckets: list[_Bucket] = []

    def lowest(self) -> GpuId:
        heap, members = self.heap, self.members
        while heap[0] not in members:
            heapq.heappop(heap)
        return heap[0]

    def add(self, gpu: GpuId) -> None:
        self.members.add(gpu)
        heapq.heappush(self.heap, gpu)

    def discard(self, gpu: GpuId) -> None:
        self.members.discard(gpu)
        if len(self.heap) > _STALE_RATIO * len(self.members) + _STALE_SLACK:
            self.heap = list(self.members)
            heapq.heapify(self.heap)


class _Bucket:
    """Non-empty states that share one key in one ladder; ``best`` is the lowest GPU among them."""

    __slots__ = ("ladder", "key", "states", "heap")

    def __init__(self, ladder: _Ladder, key: tuple) -> None:
        self.ladder = ladder
        self.key = key
        self.states: set[_State] = set()
        # (lowest GPU of the state when pushed, state serial, state). Every state in ``states`` has
        # an entry with its current lowest GPU; older entries are stale and dropped when on top.
        self.heap: list[tuple[GpuId, int, _State]] = []

    def enter(self, state: _State) -> None:
        self.states.add(state)
        self.moved(state)
        if len(self.states) == 1:
            self.ladder.filled(self.key)

    def moved(self, state: _State) -> None:
        """The state's lowest GPU changed (or it just entered)."""
        heapq.heappush(self.heap, (state.lowest(), state.serial, state))
        if len(self.heap) > _STALE_RATIO * len(self.states) + _STALE_SLACK:
            self.heap = [(s.lowest(), s.serial, s) for s in self.states]
            heapq.heapify(self.heap)

    def leave(self, state: _State) -> None:
        self.states.discard(state)
        if not self.states:
            self.ladder.emptied(self.key)

    def best(self) -> tuple[GpuId, _State]:
        heap, states = self.heap, self.states
        while True:
            gpu, _, state = heap[0]
            if state in states and state.lowest() == gpu:
                return gpu, state
            heapq.heappop(heap)


class _Ladder:
    """The buckets of one (model, profile id), or of room sizes; ``best`` is the smallest key's."""

    __slots__ = ("buckets", "keys")

    def __init__(self) -> None:
        self.buckets: dict[tuple, _Bucket] = {}  # non-empty buckets, and ones being filled
        self.keys: list[tuple] = []  # keys of non-empty buckets, with stale and repeated ones

    def bucket(self, key: tuple) -> _Bucket:
        found = self.buckets.get(key)
        if found is None:
            found = self.buckets[key] = _Bucket(self, key)
        return found

    def filled(self, key: tuple) -> None:
        heapq.heappush(self.keys, key)
        if len(self.keys) > _STALE_RATIO * len(self.buckets) + _STALE_SLACK:
            self.keys = list(self.buckets)
            heapq.heapify(self.keys)

    def emptied(self, key: tuple) -> None:
        # States that still name this bucket are gone (a state leaves its buckets only when empty).
        del self.buckets[key]

    def best(self) -> tuple[tuple, GpuId, _State] | None:
        keys = self.keys
        while keys:
            bucket = self.buckets.get(keys[0])
            if bucket is not None and bucket.states:
                gpu, state = bucket.best()
                return bucket.key, gpu, state
            heapq.heappop(keys)
        return None


@dataclass(frozen=True)
class IndexStats:
    """Sizes, for the benchmark and for an operator's metrics."""

    gpus: int
    states: int
    ladders: int
    buckets: int


class PlanningIndex:
    """The MIG GPUs of a cluster, kept indexed for ``choose``: the one MIG planner.

    Feed it every GPU's state as inventories arrive (``put``, which replaces, and ``remove``), and
    tell it what was decided and released (``apply``, ``release``) so it stays current between
    inventories. ``choose`` returns the profile, placement and reclaims the rule ranks first (the
    lowest (node, index) among equally ranked GPUs). Its cost does not grow with the number of GPUs,
    except with ``nodes``, which restricts the choice to GPUs on those nodes (``spec.nodeName``) and
    indexes just those GPUs.

    A GPU whose model has no MIG profile (L4, T4, 0 memory slots) is accepted and never chosen.
    Pure: no I/O, no clock, no threads; one caller at a time.
    """

    def __init__(self, gpus: Iterable[MigGpu] = ()) -> None:
        self._states: dict[tuple[GpuModel, tuple[InstanceSlot, ...]], _State] = {}
        self._nodes: dict[str, dict[int, _State]] = {}
        self._ladders: dict[tuple[GpuModel, int], _Ladder] = {}
        # Room: key (-slots not in use,) so the ladder's smallest key is the roomiest GPU.
        self._room = _Ladder()
        self._models: Counter[GpuModel] = Counter()
        self._model_tuple: tuple[GpuModel, ...] | None = ()
        self._used: Counter[tuple[GpuModel, int]] = Counter()  # (model, slots in use) -> GPUs
        self._serial = 0
        self._count = 0
        for gpu in gpus:
            self.put(gpu)

    # --- keeping it current -------------------------------------------------------------------

    def put(self, gpu: MigGpu) -> None:
        """Add the GPU, or replace what the index knew of it (an inventory arrived)."""
        self._place(gpu.node, gpu.index, gpu.model, gpu.instances)

    def remove(self, node: str, index: int) -> None:
        """Forget the GPU (its node left, or MIG was disabled on it). Unknown GPUs are ignored."""
        on_node = self._nodes.get(node)
        state = on_node.pop(index, None) if on_node is not None else None
        if state is None:
            return
        if not on_node:
            del self._nodes[node]
        self._leave(state, (node, index))
        self._count -= 1

    def apply(self, decision: MigDecision) -> MigGpu:
        """Record a decision as carried out: its reclaims destroyed, its instance in use."""
        state = self._state_of(decision.node, decision.gpu)
        instances = instances_after(state.instances, decision)
        self._place(decision.node, decision.gpu, state.model, instances)
        return MigGpu(decision.node, decision.gpu, state.model, instances)

    def release(self, node: str, index: int, start: int, destroy: bool = False) -> MigGpu:
        """Record the slice at ``start`` as released: its instance idle, or destroyed if ``destroy``."""
        state = self._state_of(node, index)
        instances = instances_released(state.instances, start, destroy)
        self._place(node, index, state.model, instances)
        return MigGpu(node, index, state.model, instances)

    # --- reading it ---------------------------------------------------------------------------

    def get(self, node: str, index: int) -> MigGpu | None:
        state = self._nodes.get(node, {}).get(index)
        return None if state is None else MigGpu(node, index, state.model, state.instances)

    def gpus(self, nodes: Collection[str] | None = None) -> Iterator[MigGpu]:
        """The GPUs as ``MigGpu`` records (of ``nodes`` only, if given), by node then index."""
        for node in sorted(self._nodes if nodes is None else set(nodes) & self._nodes.keys()):
            for index, state in sorted(self._nodes[node].items()):
                yield MigGpu(node, index, state.model, state.instances)

    def __len__(self) -> int:
        return self._count

    def nodes(self) -> Collection[str]:
        """The nodes with at least one indexed GPU."""
        return self._nodes.keys()

    def models(self) -> tuple[GpuModel, ...]:
        """The models of the indexed GPUs (each once), in the planner's model order."""
        return self._present_models()

    def state_count(self) -> int:
        return len(self._states)

    def stats(self) -> IndexStats:
        return IndexStats(self._count, len(self._states), len(self._ladders),
                          sum(len(ladder.buckets) for ladder in self._ladders.values()))

    def choose(
        self,
        request: SliceRequest,
        settings: PlannerSettings = DEFAULT_SETTINGS,
        nodes: Collection[str] | None = None,
    ) -> MigDecision:
        """The decision for ``request`` on the indexed GPUs (on
        ``nodes`` only, if given); raises Unplaceable with the reason. Changes nothing: call
        ``apply`` once the decision is bound."""
        if nodes is not None:
            if isinstance(nodes, str):
                raise TypeError(f"nodes must be a collection of node names, not the string {nodes!r}; "
                                f"e.g. nodes=[{nodes!r}]")
            pinned = list(self.gpus(nodes))
            if not pinned:
                shown = ", ".join(sorted(nodes)[:5]) + (" ..." if len(nodes) > 5 else "")
                raise Unplaceable(f"no MIG-enabled GPU on node {shown}" if shown else "no node given")
            return PlanningIndex(pinned).choose(request, settings)
        if not self._count:
            raise Unplaceable("no MIG-enabled GPU is available")
        levels = grant_levels(self._present_models(), request, settings.allow_larger_profile)
        if not levels:
            raise Unplaceable(too_large_reason(request, self._models))
        for level in levels:
            best: tuple[tuple, _State, Profile] | None = None
            for rank, (model, profile) in enumerate(level.options):
                ladder = self._ladders.get((model, profile.id))
                found = ladder.best() if ladder is not None else None
                if found is None:
                    continue
                key, gpu, state = found
                candidate = (key, gpu, rank)
                if best is None or candidate < best[0]:
                    best = (candidate, state, profile)
            if best is not None:
                (_, (node, index), _), state, profile = best
                option = state.options[profile.id]
                assert option is not None, "a state is filed only under profiles it can take"
                return option_decision(node, index, state.model, profile, option)
        raise Unplaceable(no_room_reason(request, levels, self._summary()))

    # --- internals ----------------------------------------------------------------------------

    def _state_of(self, node: str, index: int) -> _State:
        state = self._nodes.get(node, {}).get(index)
        if state is None:
            raise KeyError(f"GPU {index} of node {node!r} is not in the planning index; put() it first, "
                           f"e.g. index.put(MigGpu({node!r}, {index}, model))")
        return state

    def _place(self, node: str, index: int, model: GpuModel, instances: tuple[InstanceSlot, ...]) -> None:
        gpu = (node, index)
        on_node = self._nodes.setdefault(node, {})
        old = on_node.get(index)
        if old is not None:
            if old.model is model and old.instances == instances:
                return
            self._leave(old, gpu)
        else:
            self._count += 1
        state = self._states.get((model, instances))
        if state is None:
            state = self._new_state(model, instances)
        on_node[index] = state
        was_empty = not state.members
        lowest_before = None if was_empty else state.lowest()
        state.add(gpu)
        if was_empty:
            for bucket in state.buckets:
                bucket.enter(state)
        elif gpu < lowest_before:
            for bucket in state.buckets:
                bucket.moved(state)
        self._used[(model, state.used)] += 1
        self._models[model] += 1
        if self._models[model] == 1:
            self._model_tuple = None

    def _leave(self, state: _State, gpu: GpuId) -> None:
        lowest_before = state.lowest()
        state.discard(gpu)
        self._used[(state.model, state.used)] -= 1
        if not self._used[(state.model, state.used)]:
            del self._used[(state.model, state.used)]
        self._models[state.model] -= 1
        if not self._models[state.model]:
            del self._models[state.model]
            self._model_tuple = None
        if not state.members:
            for bucket in state.buckets:
                bucket.leave(state)
            del self._states[(state.model, state.instances)]
        elif gpu == lowest_before:
            for bucket in state.buckets:
                bucket.moved(state)

    def _new_state(self, model: GpuModel, instances: tuple[InstanceSlot, ...]) -> _State:
        self._serial += 1
        state = _State(model, instances, self._serial)
        for profile in model.profiles:
            option = plan_on_gpu(model, instances, profile.id) if profile.placements else None
            state.options[profile.id] = option
            if option is not None:
                ladder = self._ladders.get((model, profile.id))
                if ladder is None:
                    ladder = self._ladders[(model, profile.id)] = _Ladder()
                state.buckets.append(ladder.bucket(option.key))
        if model.memory_slots > 0:
            state.buckets.append(self._room.bucket((state.used - model.memory_slots, model.memory_slots)))
        self._states[(model, instances)] = state
        return state

    def _present_models(self) -> tuple[GpuModel, ...]:
        if self._model_tuple is None:
            self._model_tuple = tuple(sorted(self._models, key=model_order))
        return self._model_tuple

    def _summary(self) -> RoomSummary:
        summary = RoomSummary()
        for (model, used), gpus in sorted(self._used.items(), key=lambda item: (model_order(item[0][0]), item[0][1])):
            summary.count(model, used, gpus)
        # The room ladder's smallest key is (-(slots not in use), slots); its bucket's lowest GPU is
        # the one a summary of every GPU names. Keys with equal room but other slot counts tie on room.
        roomiest = self._roomiest()
        if roomiest is not None:
            summary.roomiest = roomiest
        return summary

    def _roomiest(self) -> tuple[int, str, int, int] | None:
        found = self._room.best()
        if found is None:
            return None
        (negative_room, _), _, _ = found
        # Models with other slot counts can have the same room (an A30 and an H200 with 4 free
        # slots each): the lowest GPU among all of them is the one named.
        best: tuple[GpuId, int] | None = None
        for (room_key, slots), bucket in self._room.buckets.items():
            if room_key == negative_room and bucket.states:
                gpu, _ = bucket.best()
                if best is None or gpu < best[0]:
                    best = (gpu, slots)
        assert best is not None
        (node, index), slots = best
        return (-negative_room, node, index, slots)


def choose_mig(request: SliceRequest, gpus: Iterable[MigGpu], settings: PlannerSettings = DEFAULT_SETTINGS
               ) -> MigDecision:
    """The decision for ``request`` among ``gpus``, through an index made for them: for a one-off
    decision on a list of GPUs (a trace's replay, the demo, a node's GPUs); keep a ``PlanningIndex``
    where decisions repeat. Raises Unplaceable with the reason."""
    return PlanningIndex(gpus).choose(request, settings)
