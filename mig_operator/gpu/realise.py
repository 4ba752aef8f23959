"""Observe and act for MIG decisions: the planner's view of a GPU, and carrying out a decision.

``planner_view`` turns NVML's instances into the planner's ``MigGpu``; ``realise`` destroys the
reclaim set (each refused by NVML with IN_USE while a process runs on it) and creates or reuses the
chosen instance. Both the demo and the node agent use them.
"""

from __future__ import annotations

from collections.abc import Collection

from mig_operator.core.planner import InstanceSlot, MigDecision, MigGpu

from .protocol import GpuBackend, GpuError, MigInstance


def planner_view(backend: GpuBackend, index: int, bound_gi_ids: Collection[int], node: str = "") -> MigGpu:
    """GPU ``index`` as the planner sees it: an instance is in use if a slice is bound to it or if
    NVML reports a process on it (never count an instance idle on cluster state alone)."""
    model = backend.model(index)
    slots = tuple(
        InstanceSlot(inst.profile_id, inst.start, inst.size, in_use=inst.in_use or inst.gi_id in bound_gi_ids)
        for inst in sorted(backend.instances(index), key=lambda i: i.start)
    )
    return MigGpu(node, index, model, slots)


def _at(instances: list[MigInstance], start: int, profile_id: int) -> MigInstance | None:
    return next((i for i in instances if i.start == start and i.profile_id == profile_id), None)


def realise(backend: GpuBackend, decision: MigDecision) -> MigInstance:
    """Carry out ``decision`` on the GPU: destroy its reclaim set, then reuse or create.

    Raises GpuError; an instance already destroyed by an earlier, interrupted attempt is skipped, so a
    retry after a crash finishes the job instead of failing.
    """
    instances = backend.instances(decision.gpu)
    for victim in decision.reclaim:
        found = _at(instances, victim.start, victim.profile_id)
        if found is not None:
            backend.destroy_instance(decision.gpu, found.gi_id)
    existing = _at(backend.instances(decision.gpu), decision.start, decision.profile.id)
    if existing is not None:
        return existing
    if decision.action == "reuse":
        raise GpuError(
            "NOT_FOUND",
            f"reuse of {decision.profile.name} at {{{decision.start}}}:{decision.size} on GPU {decision.gpu}: "
            "the idle instance is gone",
        )
    return backend.create_instance(decision.gpu, decision.profile.id, decision.start)
