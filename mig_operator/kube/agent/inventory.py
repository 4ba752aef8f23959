"""The GpuNode status an agent publishes: its GPUs, what they offer, and who holds what.

Each GPU model's MIG profile table is published once, in ``models``; a GPU's ``model`` names its entry
(``""`` for a GPU without MIG, which has none).

The controller reads it back with ``core.placement.cluster.inventory_from_status``; a unit test round-trips
one through the other, so the two sides cannot drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mig_operator.core.node.device_plugin import DevicePluginCheck
from mig_operator.core.node.lifecycle import OwnerRecord
from mig_operator.core.node.runtime_trust import RuntimeCheck, check_toolkit_config
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, GpuState, InstanceState, gpu_role
from mig_operator.core.placement.compute import gpu_compute
from mig_operator.core.placement.compute import mig_compute as mig_compute_label
from mig_operator.core.placement.profiles import GpuModel, Profile
from mig_operator.gpu.protocol import GpuInfo, MigInstance

log = logging.getLogger("mig_operator.agent")
MAX_TOOLKIT_CONFIG_BYTES = 1 << 20  # a toolkit configuration is a few KiB


def instance_state(inst: MigInstance) -> InstanceState:
    """NVML's instance as core sees it (ownership is added from the record where needed)."""
    return InstanceState(
        gi_id=inst.gi_id, ci_id=inst.ci_id, profile_id=inst.profile_id, profile=inst.profile, start=inst.start,
        size=inst.size, device_uuid=inst.device_uuid, in_use=inst.in_use,
    )


def _profiles(profiles: Sequence[Profile]) -> list[dict[str, Any]]:
    return [
        {
            "name": p.name, "id": p.id, "slices": p.slices, "memoryMiB": p.memory_mib, "sm": p.sm,
            "maxInstances": p.max_instances,
            "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements],
        }
        for p in profiles
    ]


def model_entries(
    gpus: Sequence[GpuInfo], models: Mapping[int, GpuModel | None],
) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """The model name each GPU's entry gives (``""`` without MIG) and the status's ``models``: each
    named model's profile table once, in the order of the GPUs that first name them. Two boards whose
    models share a name but not a table get distinct names (``<name>-2``), so no GPU reads another
    board's table."""
    names: dict[int, str] = {}
    tables: dict[str, tuple[Profile, ...]] = {}
    for info in gpus:
        model = models.get(info.index)
        if model is None:
            names[info.index] = ""
            continue
        name, n = model.name, 1
        while tables.get(name, model.profiles) != model.profiles:
            n += 1
            name = f"{model.name}-{n}"
        tables[name] = model.profiles
        names[info.index] = name
    return names, [{"name": name, "profiles": _profiles(table)} for name, table in tables.items()]


def _instance(gpu: int, inst: MigInstance, record: OwnerRecord, held: frozenset[str]) -> dict[str, Any]:
    state = instance_state(inst)
    owner = record.owner_of(gpu, state)
    # A deleted slice's instance that a pod's claim still holds (prepared): in use, as if a process ran
    # there, so the controller neither reuses nor reclaims it before the kubelet lets it go.
    in_use = inst.in_use or (owner is not None and owner.uid in held)
    body: dict[str, Any] = {
        "giId": inst.gi_id, "profile": inst.profile, "profileId": inst.profile_id, "start": inst.start,
        "size": inst.size, "inUse": in_use, "complete": state.complete,
        "slice": owner.slice if owner else "", "sliceUID": owner.uid if owner else "",
    }
    if inst.ci_id >= 0:
        body["ciId"] = inst.ci_id
    if inst.device_uuid:
        body["deviceUUID"] = inst.device_uuid
        if owner is None and inst.device_uuid in record.idle_since:
            body["idleSince"] = record.idle_since[inst.device_uuid]
    return body


def _mig_compute(model: GpuModel, held: Sequence[MigInstance]) -> str:
    """The compute slices of a MIG GPU's instances in use over the GPU's (``4/7``)."""
    slices = {p.id: p.slices for p in model.profiles}
    return mig_compute_label(sum(slices.get(i.profile_id, 0) for i in held), max(slices.values(), default=0))


def gpunode_status(
    gpus: Sequence[GpuInfo],
    models: Mapping[int, GpuModel | None],
    instances: Mapping[int, Sequence[MigInstance]],
    record: OwnerRecord,
    labelled: bool,
    observed_at: str,
    held: frozenset[str] = frozenset(),
    device_plugin: DevicePluginCheck | None = None,
    device_plugin_since: str | None = None,
    runtime: Mapping[str, str] | None = None,
    health: Mapping[int, list[dict[str, str]]] | None = None,
) -> dict[str, Any]:
    """The whole status of the node's GpuNode (written with one merge patch: lists are replaced).
    ``held``: the UIDs of deleted slices whose instances a prepared claim still holds.
    ``device_plugin``: the check of the node's capacity (core.node.device_plugin), written as the
    ``DevicePluginConflict`` condition (last changed at ``device_plugin_since``, else now).
    ``runtime``: the ``RuntimeTrusted`` condition (``RuntimeWatch.condition``), written beside it.
    ``health``: each GPU's conditions (its ``Healthy`` condition, ``core.node.health``), by index."""
    entries = []
    model_names, model_list = model_entries(gpus, models)
    free_slots = used_slots = idle_slots = idle = in_use = 0
    for info in gpus:
        model = models.get(info.index)
        insts = list(instances.get(info.index, ()))
        role, why = gpu_role(labelled, GpuState(info.index, info.uuid, mig_capable=info.mig_capable,
                                                mig_enabled=info.mig_enabled))
        held_fractions = [e for e in record.owners.values() if e.mode == MODE_FRACTION and e.gpu == info.index]
        fractions = [
            {"slice": e.slice, "sliceUID": e.uid, "bytes": e.granted_bytes,
             **({"compute": e.compute} if e.compute is not None else {})}
            for e in held_fractions
        ]
        granted = sum(f["bytes"] for f in fractions) + sum(
            e.granted_bytes for e in record.owners.values() if e.mode == MODE_MIG and e.gpu == info.index
        )
        body = [_instance(info.index, inst, record, held) for inst in insts]
        # One rule for instances and their slots: held by a slice (the record names it) or running a
        # process is in use, anything else is idle; slots under no instance are free.
        held_mask = idle_mask = 0
        for inst, entry in zip(insts, body, strict=True):
            mask = ((1 << inst.size) - 1) << inst.start
            if entry["sliceUID"] or entry["inUse"]:
                in_use, held_mask = in_use + 1, held_mask | mask
            else:
                idle, idle_mask = idle + 1, idle_mask | mask
        compute = gpu_compute(e.compute for e in held_fractions).describe()
        if info.mig_enabled and model is not None:
            compute = _mig_compute(model, [i for i, e in zip(insts, body, strict=True)
                                           if e["sliceUID"] or e["inUse"]])
            used_slots += held_mask.bit_count()
            idle_slots += idle_mask.bit_count()
            free_slots += model.memory_slots - (held_mask | idle_mask).bit_count()
        entries.append({
            "index": info.index, "uuid": info.uuid, "product": info.product,
            "model": model_names[info.index], "memoryMiB": info.memory_mib,
            "migCapable": info.mig_capable, "migEnabled": info.mig_enabled, "serves": role, "servesReason": why,
            "instances": body, "fractions": fractions, "grantedBytes": granted,
            **({"compute": compute} if compute else {}),
            **({"conditions": list(health[info.index])} if health and info.index in health else {}),
        })
    extra: dict[str, Any] = {}
    if device_plugin is not None:
        extra = {"devicePluginResources": list(device_plugin.resources),
                 "conditions": [device_plugin.condition(device_plugin_since or observed_at)]}
    if runtime is not None:
        extra["conditions"] = [*extra.get("conditions", []), dict(runtime)]
    return {
        **extra,
        "models": model_list, "gpus": entries, "gpuCount": len(entries),
        "migGpuCount": sum(1 for g in gpus if g.mig_enabled),
        "freeSlots": free_slots, "usedSlots": used_slots, "idleSlots": idle_slots, "idleInstances": idle,
        "inUseInstances": in_use,
        "fractionSlices": sum(len(e["fractions"]) for e in entries), "observedAt": observed_at,
    }



def read_text(path: str) -> tuple[str | None, str]:
    """A small text file's content, or None and why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_TOOLKIT_CONFIG_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        return None, getattr(exc, "strerror", None) or str(exc)
    if len(text) > MAX_TOOLKIT_CONFIG_BYTES:
        return None, f"larger than {MAX_TOOLKIT_CONFIG_BYTES} bytes"
    return text, ""


class RuntimeWatch:
    """The node's NVIDIA container toolkit configuration as the ``RuntimeTrusted`` condition: read at
    the agent's start and at each heartbeat; its transition time moves only when its status does."""

    def __init__(self, node: str, path: str) -> None:
        self.node = node
        self.path = path
        self.check: RuntimeCheck | None = None
        self.since = ""

    def read(self, now: str) -> bool:
        """Read the file again; True when the condition changed (the GpuNode says so at once)."""
        text, error = read_text(self.path)
        check = check_toolkit_config(self.node, self.path, text, error)
        if check == self.check:
            return False
        if self.check is None or check.status != self.check.status:
            self.since = now
            (log.info if check.status == "True" else log.warning)("RuntimeTrusted=%s (%s): %s", check.status,
                                                                   check.reason, check.message)
        self.check = check
        return True

    def condition(self) -> dict[str, str] | None:
        return self.check.condition(self.since) if self.check is not None else None
