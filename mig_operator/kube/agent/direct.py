"""A decision carried out straight on a GPU backend, with no API server: ``mig-operator demo``.

The trace demo plans with the planner and realises each decision here, with the same rule the
node agent follows (``core.node.lifecycle.plan_mig``): destroy what the placement overlaps, then reuse,
complete or create. Which instances the demo's own slices hold is the caller's ``bound`` set, as
the owner record is for the agent.
"""

from __future__ import annotations

from collections.abc import Collection

from mig_operator.core.node.lifecycle import Blocked, OwnerRecord, plan_mig
from mig_operator.core.placement.cluster import MODE_MIG, Binding
from mig_operator.core.placement.planner import InstanceSlot, MigDecision, MigGpu
from mig_operator.gpu.protocol import GpuBackend, GpuError, MigInstance

from .inventory import instance_state


def planner_view(backend: GpuBackend, index: int, bound_gi_ids: Collection[int], node: str = "") -> MigGpu:
    """GPU ``index`` as the planner sees it: an instance is in use if a slice holds it, if NVML
    reports a process on it (never idle on cluster state alone), or if it is half-made."""
    model = backend.model(index)
    slots = tuple(
        InstanceSlot(inst.profile_id, inst.start, inst.size,
                     in_use=inst.in_use or inst.gi_id in bound_gi_ids or not instance_state(inst).complete)
        for inst in sorted(backend.instances(index), key=lambda i: i.start)
    )
    return MigGpu(node, index, model, slots)


def realise_decision(backend: GpuBackend, decision: MigDecision) -> MigInstance:
    """Carry ``decision`` out: destroy the instances its placement overlaps, then reuse, complete or
    create. A retry after an interrupted attempt finishes the job. Raises GpuError."""
    binding = Binding("", decision.node, decision.gpu, MODE_MIG, decision.profile.memory_mib * 2**20,
                      decision.profile.id, decision.profile.name, decision.start, decision.size)
    found = {i.gi_id: i for i in backend.instances(decision.gpu)}
    try:
        steps = plan_mig("", binding, [instance_state(i) for i in found.values()], OwnerRecord())
    except Blocked as exc:
        # In NVML's words: a process on an instance in the way is IN_USE (worth retrying).
        raise GpuError("IN_USE" if exc.transient else "INSUFFICIENT_RESOURCES", exc.message) from None
    for victim in steps.destroy:
        backend.destroy_instance(decision.gpu, victim.gi_id)
    if steps.action == "create":
        if decision.action == "reuse":
            raise GpuError("NOT_FOUND", f"reuse of {decision.profile.name} at {{{decision.start}}}:{decision.size} "
                           f"on GPU {decision.gpu}: the idle instance is gone")
        return backend.create_instance(decision.gpu, decision.profile.id, decision.start)
    assert steps.instance is not None
    if steps.action == "complete":
        return backend.create_compute_instance(decision.gpu, steps.instance.gi_id)
    return found[steps.instance.gi_id]
