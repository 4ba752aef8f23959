"""A slice's life on its node, as pure decisions: what the agent does next, and with which instance.

The agent keeps a node-local owner record (slice UID -> GPU, placement, GI/CI ids), modelled on
NVIDIA's DRA driver checkpoint: an entry is written as ``started`` before the first NVML call for a
slice and ``completed`` after its device exists, and the file carries the boot id. These functions
decide from that record, NVML's instances and the slice's binding; the agent carries the decisions
out. An instance belongs to the slice whose UID the record names, never to whatever sits at a
position, and an instance without its compute instance is never handed out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from ..placement.cluster import MODE_MIG, Binding, InstanceState

PENDING = "Pending"
BOUND = "Bound"
CREATING = "Creating"
READY = "Ready"
FAILED = "Failed"

STARTED = "started"
COMPLETED = "completed"


@dataclass(frozen=True)
class OwnerEntry:
    """One slice the agent has taken on: its intent (``started``) or its device (``completed``)."""

    uid: str
    slice: str  # <namespace>/<name>, for people reading the record and the GpuNode
    mode: str
    gpu: int
    state: str = STARTED
    granted_bytes: int = 0
    profile_id: int = -1
    profile: str = ""
    start: int = 0
    size: int = 0
    gi_id: int = -1
    ci_id: int = -1
    device_uuid: str = ""
    reused: bool = False
    # A fraction's compute share (Binding.compute), served by MPS; None: shared.
    compute: float | None = None

    def holds(self, inst: InstanceState, gpu: int) -> bool:
        """Whether this entry names that instance: same GPU and GI, and the same device once known."""
        if self.mode != MODE_MIG or self.gpu != gpu or self.gi_id != inst.gi_id:
            return False
        return not self.device_uuid or not inst.device_uuid or self.device_uuid == inst.device_uuid


@dataclass
class OwnerRecord:
    """The agent's record: owners by slice UID, the boot it was written in, and idle times."""

    boot_id: str = ""
    owners: dict[str, OwnerEntry] = field(default_factory=dict)
    # MIG device UUID -> when it became idle (RFC 3339), for --idle-timeout.
    idle_since: dict[str, str] = field(default_factory=dict)

    def owner_of(self, gpu: int, inst: InstanceState) -> OwnerEntry | None:
        return next((e for e in self.owners.values() if e.holds(inst, gpu)), None)


# --- what the agent does with a slice event -----------------------------------------------------

RELEASE = "release"
REALISE = "realise"
FORGET = "forget"
NOTHING = "nothing"


def agent_step(phase: str | None, deleting: bool, has_finalizer: bool, entry: OwnerEntry | None) -> str:
    """The agent's next step for a slice bound to its node.

    - being deleted: release (the instance becomes idle, then the finalizer goes; while its claim is
      in use, ``claim_hold``, the slice is kept as it is and only says so);
    - not yet carrying the finalizer and not in the record: nothing yet (the agent sees a slice from
      its binding's status write; a slice made by hand gets the finalizer just after it), so every
      slice the agent realises carries its finalizer;
    - Bound or Creating: realise (again after a crash: every step is idempotent);
    - Ready without a completed entry: realise, which adopts the instance without an NVML create;
    - Failed while the record still names it: forget it, so its instance is idle again.
    """
    if deleting:
        return RELEASE if has_finalizer or entry is not None else NOTHING
    if not has_finalizer and entry is None:
        return NOTHING
    if phase in (BOUND, CREATING):
        return REALISE
    if phase == READY:
        return NOTHING if entry is not None and entry.state == COMPLETED else REALISE
    if phase == FAILED and entry is not None:
        return FORGET
    return NOTHING


# --- releasing a slice whose claim is in use -------------------------------------------------------

# status.conditions reason of a deleted slice kept while its claim is in use (condition Released=False).
IN_USE = "InUse"


@dataclass(frozen=True)
class ClaimHold:
    """What keeps a deleted slice from being released: the consumers its ResourceClaim is reserved
    for (``kind namespace/name``, e.g. ``pod team-a/train``) and the claims the kubelet has had the
    agent prepare on its device (``namespace/name``). Free when both are empty."""

    reserved_for: tuple[str, ...] = ()
    prepared: tuple[str, ...] = ()

    @property
    def free(self) -> bool:
        return not self.reserved_for and not self.prepared

    def message(self, node: str) -> str:
        """For the Released condition: who holds the slice, and when it goes."""
        parts = []
        if self.reserved_for:
            parts.append("its ResourceClaim is reserved for " + ", ".join(self.reserved_for))
        if self.prepared:
            parts.append(f"prepared on node {node} for ResourceClaim " + ", ".join(self.prepared))
        return ("in use: " + "; ".join(parts) + ". The slice keeps its device, its GPU room and its quota "
                "charge until they let it go (the pod ends), then it is released")


def claim_hold(slice_uid: str, claim: Mapping | None, prepared: Iterable[str]) -> ClaimHold:
    """Who holds slice ``slice_uid``: ``claim`` is the ResourceClaim of the slice's name and namespace
    as the API server has it (None when there is none), ``prepared`` the claims (``namespace/name``)
    the agent's record has prepared on the slice's device. A claim of that name that the slice does
    not own (no ownerReference to its UID) holds nothing of it; one being deleted holds the slice
    while it is still reserved (the API keeps a claim in use)."""
    reserved: list[str] = []
    if claim is not None:
        meta = claim.get("metadata") or {}
        owned = any(isinstance(r, Mapping) and r.get("uid") == slice_uid for r in meta.get("ownerReferences") or ())
        if owned:
            namespace = str(meta.get("namespace", ""))
            for consumer in (claim.get("status") or {}).get("reservedFor") or ():
                if not isinstance(consumer, Mapping):
                    continue
                kind = str(consumer.get("resource") or "object").removesuffix("s")
                reserved.append(f"{kind} {namespace}/{consumer.get('name', '')}")
    return ClaimHold(tuple(sorted(reserved)), tuple(sorted(set(prepared))))


# --- realising a MIG binding ----------------------------------------------------------------------


class Blocked(Exception):
    """The binding cannot be realised now. ``transient``: it may clear (a process still runs on an
    instance); otherwise the slice fails with this message (the placement belongs to another slice)."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


@dataclass(frozen=True)
class MigSteps:
    """What realising a MIG binding takes: instances to destroy first, then one of
    ``reuse`` (an idle, complete instance: no NVML call), ``resume`` (already this slice's),
    ``complete`` (a GPU instance without its compute instance: create the CI), ``create``."""

    action: str
    instance: InstanceState | None = None
    destroy: tuple[InstanceState, ...] = ()

    @property
    def needs_nvml(self) -> bool:
        return self.action in ("create", "complete") or bool(self.destroy)


def plan_mig(uid: str, binding: Binding, instances: Iterable[InstanceState], record: OwnerRecord) -> MigSteps:
    """How to give ``binding``'s placement to slice ``uid`` on a GPU holding ``instances`` (NVML's view).

    Never reuses or destroys an instance the record gives to another slice, nor one NVML reports in
    use by a process no slice of this record owns.
    """
    target: InstanceState | None = None
    victims: list[InstanceState] = []
    for inst in instances:
        if inst.start == binding.start and inst.profile_id == binding.profile_id:
            target = inst
        elif inst.mask & binding.mask:
            victims.append(inst)
    for inst in ([target] if target else []) + victims:
        owner = record.owner_of(binding.gpu, inst)
        if owner is not None and owner.uid != uid:
            raise Blocked(
                f"GPU {binding.gpu} instance {inst.profile}@{inst.start} (GI {inst.gi_id}) belongs to slice "
                f"{owner.slice}; it is not handed to another", transient=False,
            )
        if inst.in_use and owner is None:
            raise Blocked(
                f"a process runs on GPU {binding.gpu} instance {inst.profile}@{inst.start} (GI {inst.gi_id}) "
                "that no slice owns; waiting for it to exit", transient=True,
            )
    if target is not None:
        owner = record.owner_of(binding.gpu, target)
        if not target.complete:
            return MigSteps("complete", target, tuple(victims))
        return MigSteps("resume" if owner is not None else "reuse", target, tuple(victims))
    return MigSteps("create", None, tuple(victims))


# --- adopting what exists, on start --------------------------------------------------------------


@dataclass(frozen=True)
class Adoption:
    """The record after matching it against NVML and the slices that exist, and what to complete."""

    record: OwnerRecord
    adopted: tuple[str, ...]  # slice UIDs whose instance was found
    dropped: tuple[str, ...]  # record entries whose slice is gone: their instances are idle now
    incomplete: tuple[tuple[int, InstanceState], ...]  # (gpu, GI without CI) to complete


def adopt(
    record: OwnerRecord,
    boot_id: str,
    instances: Mapping[int, Iterable[InstanceState]],
    bindings: Mapping[str, Binding],
) -> Adoption:
    """Match the record, NVML's instances and the live slices' bindings (uid -> binding) on start.

    An instance is kept for the slice the record names, if that slice still exists; else for a live
    slice whose binding names its GPU, profile and start; else it is idle. Nothing is destroyed. After
    a reboot (another boot id) recorded GI ids mean nothing, so only bindings match.
    """
    same_boot = record.boot_id == boot_id
    owners: dict[str, OwnerEntry] = {}
    adopted: list[str] = []
    dropped = [uid for uid in record.owners if uid not in bindings]
    claimed: set[tuple[int, int]] = set()
    incomplete: list[tuple[int, InstanceState]] = []
    by_gpu = {gpu: list(insts) for gpu, insts in instances.items()}
    live_entries = [(uid, e, bindings[uid]) for uid, e in record.owners.items() if uid in bindings]
    # The record is the authority on ownership: first every entry that names its instance (same
    # boot), so that no entry matched by placement below can take an instance another one names.
    for uid, entry, _binding in live_entries:
        if entry.mode != MODE_MIG:
            owners[uid] = entry
            continue
        if not same_boot or entry.gi_id < 0:
            continue
        found = next((i for i in by_gpu.get(entry.gpu, []) if entry.holds(i, entry.gpu)), None)
        if found is not None and (entry.gpu, found.gi_id) not in claimed:
            claimed.add((entry.gpu, found.gi_id))
            owners[uid] = _pointing_at(entry, entry.gpu, found)
            adopted.append(uid)
    # Then the entries whose instance the record cannot name: by their binding's placement.
    for uid, entry, binding in live_entries:
        if uid in owners:
            continue
        found = _at(by_gpu.get(binding.gpu, []), binding)
        if found is not None and (binding.gpu, found.gi_id) not in claimed:
            claimed.add((binding.gpu, found.gi_id))
            owners[uid] = _pointing_at(entry, binding.gpu, found)
            adopted.append(uid)
        else:
            # Its instance is gone (reboot, or never made): the intent stands, realise makes it.
            owners[uid] = replace(entry, state=STARTED, gi_id=-1, ci_id=-1, device_uuid="")
    # Live bindings the record does not know (record lost, or written by an earlier agent).
    for uid, binding in bindings.items():
        if uid in owners or binding.mode != MODE_MIG:
            continue
        found = _at(by_gpu.get(binding.gpu, []), binding)
        if found is not None and (binding.gpu, found.gi_id) not in claimed:
            claimed.add((binding.gpu, found.gi_id))
            entry = OwnerEntry(uid, "", MODE_MIG, binding.gpu, granted_bytes=binding.granted_bytes,
                               profile_id=binding.profile_id, profile=binding.profile, start=binding.start,
                               size=binding.size)
            owners[uid] = _pointing_at(entry, binding.gpu, found)
            adopted.append(uid)
    for gpu, insts in by_gpu.items():
        incomplete.extend((gpu, inst) for inst in insts if not inst.complete)
    idle = {u: t for u, t in record.idle_since.items()} if same_boot else {}
    return Adoption(OwnerRecord(boot_id, owners, idle), tuple(adopted), tuple(dropped), tuple(incomplete))


def _at(instances: list[InstanceState], binding: Binding) -> InstanceState | None:
    return next((i for i in instances if i.start == binding.start and i.profile_id == binding.profile_id), None)


def _pointing_at(entry: OwnerEntry, gpu: int, inst: InstanceState) -> OwnerEntry:
    # A found but half-made instance stays "started": realise completes it.
    state = COMPLETED if inst.complete and entry.state == COMPLETED else STARTED
    return replace(entry, gpu=gpu, gi_id=inst.gi_id, ci_id=inst.ci_id, device_uuid=inst.device_uuid,
                   profile_id=inst.profile_id, profile=inst.profile, start=inst.start, size=inst.size, state=state)


def idle_instances(record: OwnerRecord, gpu: int, instances: Iterable[InstanceState]) -> list[InstanceState]:
    """Instances on ``gpu`` that no slice of the record owns."""
    return [i for i in instances if record.owner_of(gpu, i) is None]


def settle_adoption(
    adoption: Adoption,
    before: OwnerRecord,
    names: Mapping[str, str],
    held: Collection[str],
    live: Collection[str],
    found: Mapping[int, Iterable[InstanceState]],
    since: str,
) -> tuple[OwnerRecord, tuple[str, ...]]:
    """The record the agent keeps after ``adopt``, and the slices to revoke.

    ``before``: the record read on start; ``names``: live slice UID -> ``namespace/name``; ``held``:
    slice UIDs a prepared claim names; ``live``: UIDs of the live slices bound here; ``found``: NVML's
    instances by GPU; ``since``: now (RFC 3339).

    - an entry adopted from a binding alone gets its slice's name;
    - a slice gone while a claim on it is prepared keeps its entry (adoption dropped it: no live
      slice) until the kubelet unprepares the claim, across restarts too, and is revoked;
    - an instance found idle counts as idle from ``since`` (for the idle time-out), unless the record
      already says since when.
    """
    owners = {uid: (replace(e, slice=names.get(uid, e.slice)) if not e.slice else e)
              for uid, e in adoption.record.owners.items()}
    owners.update({uid: e for uid, e in before.owners.items() if uid in held and uid not in owners})
    record = replace(adoption.record, owners=owners)
    revoke = tuple(sorted(uid for uid in set(held) if uid in owners and uid not in live))
    idle = dict(record.idle_since)
    for gpu, insts in found.items():
        for inst in idle_instances(record, gpu, insts):
            if inst.device_uuid:
                idle.setdefault(inst.device_uuid, since)
    return replace(record, idle_since=idle), revoke


# --- what a device offers --------------------------------------------------------------------------


def offered(entry: OwnerEntry | None, revoked: bool, shown_ready: bool) -> bool:
    """Whether a slice's device is offered: listed in the node's ResourceSlice and preparable by the
    kubelet. Its record entry names a made device, the slice is not one gone while a claim holds it
    (``revoked``), and its status says Ready (``shown_ready``: as last seen, or being written by the
    agent, whose device must be listed before the slice says Ready)."""
    return (entry is not None and entry.state == COMPLETED and bool(entry.device_uuid)
            and not revoked and shown_ready)


def offered_entries(record: OwnerRecord, revoked: Collection[str], shown_ready: Collection[str]) -> list[OwnerEntry]:
    """The record's entries whose device is offered (``offered``), in the record's order."""
    return [e for uid, e in record.owners.items() if offered(e, uid in revoked, uid in shown_ready)]


# A pod whose slice Failed gets a new slice after a back-off, this many times in all, then waits for
# its owner (the failure is then not a passing one: an NVML error the agent could not retry away).
SLICE_TRIES = 4
SLICE_RETRY_BASE_S = 5.0


def slice_retry_delay(failed_tries: int, base_s: float = SLICE_RETRY_BASE_S) -> float | None:
    """Seconds to wait before a pod's next slice after ``failed_tries`` slices of it failed (1, 2,
    ...): ``base_s`` doubling each time (5, 10, 20 s); None once ``SLICE_TRIES`` slices have failed."""
    if failed_tries < 1:
        raise ValueError(f"failed_tries {failed_tries} must be at least 1")
    if failed_tries >= SLICE_TRIES:
        return None
    return base_s * 2 ** (failed_tries - 1)
