"""The controller's books: one owner for what it knows and what it has decided.

The slices (``SliceRecord``), the pods that ask for them (``PodRecord``), the GpuNode inventories,
every Node (``NodeRecord``: the controller's one Node cache, labels and taints), the bindings (written
in a slice's status, or reserved while that write is in flight), each namespace's GpuQuota (its
object's generation and status last written too) and charges (``core.books.charges``), the waiting line
(``core.books.waiting_line``) and the slices whose device check waits for their node's GpuNode. The
planner's index (``core.placement.cluster.ClusterPlanner``) is its private part: inventories, labels and
held bindings live there only. Its face: observe (``put_slice``, ``remove_slice``, ``put_pod``,
``remove_pod``, ``put_inventory``, ``remove_inventory``, ``put_node``, ``put_quota``, ``remove_quota``,
``replace_all``);
``decide(uid)`` for a slice's group (a slice alone is a group of one), quota admission included:
bind (reserved), refuse (code, message, could it ever fit; the slices join the line) or skip; then
``commit`` once the write is done or ``rollback`` once it failed (the books as before ``decide``);
``check_device(uid)``, the one device check (``core.books.device_check``), and ``take_device_waits``;
how far each slice's ResourceClaim is written (``claim_state``, ``unreserving``).
Nothing outside this module changes its fields.

Rules kept here: a slice being deleted holds its binding and charge until it is gone; a device an
agent still holds for a slice gone is charged from its GpuNode; a fraction on a GPU its namespace
holds alone is charged that GPU's whole memory, once (``core.books.charges``); a fraction GPU's occupancy counts
what its agent holds and serves one namespace unless labelled (``core.placement.cluster``, ``core.placement.tenancy``);
an untrusted runtime takes nothing new unless accepted (``core.placement.node_blocks``); ``quota_required``
refuses a namespace without a GpuQuota (NoQuota). Pure and synchronous: no I/O, one caller at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Literal

from ..node.lifecycle import READY
from ..placement.cluster import MODE_FRACTION, NO_CAPACITY, Binding, NodeInventory, Refusal
from ..placement.cluster_planner import ClusterPlanner
from ..placement.planner import PlannerSettings
from ..placement.tenancy import whole_gpu_note
from ..requests.pod_admission import PodAsk
from ..requests.quantities import MIB, QuantityError
from ..requests.request import SliceRequest
from .charges import Charge, Charges, GpuKey, fraction_charge, own_charge
from .device_check import ACCEPT, DeviceVerdict, check_slice_device
from .quota import (
    NO_QUOTA,
    QUOTA_EXCEEDED,
    QUOTA_NAME,
    Quota,
    Usage,
    admit,
    quota_from_spec,
    quota_missing,
    share,
)
from .waiting_line import WaitingLine


@dataclass
class SliceRecord:
    """One GpuSlice as the controller needs it."""

    uid: str
    namespace: str
    name: str
    created: str
    version: int
    body: dict[str, Any]
    request: SliceRequest | None
    invalid: str  # why the spec cannot be served (an API server without CEL let it in), else ""
    pinned: str | None
    phase: str | None
    binding: Binding | None
    deleting: bool
    marked: bool  # bound and carrying the agent's finalizer
    eligible: tuple[str, ...] | None = None  # the only nodes it may go to (a pod's node selector), if set
    group: str | None = None  # a pod's group of slices placed together (GROUP_ANNOTATION), if any
    group_size: int = 1
    pod_owner: str | None = None  # the UID of the pod the slice was made for (its Pod owner reference), if any

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[str, str, str]:
        """Oldest first: Pending slices are planned again in this order."""
        return (self.created, self.namespace, self.name)


@dataclass(frozen=True)
class NodeLabels:
    """What placement reads of a Node's labels and taints: the MIG label, fraction sharing across
    namespaces (core.placement.tenancy), runtime trust accepted (core.node.runtime_trust), the removal
    taint a node autoscaler put on it (core.autoscale.nodes)."""

    mig: bool = False
    sharing: bool = False
    accepted: bool = False
    leaving: str | None = None


@dataclass(frozen=True)
class PodRecord:
    """A pod that asks for slices (labelled with its group) as the controller keeps it: its body as
    the watch's transform keeps it, its uid and resourceVersion, and its request, read once."""

    body: dict[str, Any]
    uid: str
    version: int
    ask: PodAsk


@dataclass(frozen=True)
class NodeRecord:
    """A Node as the controller reads it: its labels and taints (where a pod may go,
    ``core.placement.node_selection``), what placement reads of its labels (``flags``) and its
    ``status.allocatable`` as written (whether a pod's requests fit, ``core.placement.pod_fit``), and the
    annotations that keep it from a node autoscaler (``core.autoscale.nodes``)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    flags: NodeLabels = NodeLabels()
    allocatable: Mapping[str, Any] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What ``decide`` came to for a slice's group.

    bind: ``bindings`` (reserved in the books) are to be written for ``todo``, in order, with ``uuids``
    (binding uid -> GPU UUID). refuse: ``refusal`` is to be written to each of ``todo`` (now in the
    waiting line), and ``give_back`` (members already bound) deleted; ``could_fit`` is False when its
    quota cannot hold it even alone. skip: nothing to plan (gone, bound, reserved, incomplete group)."""

    kind: Literal["bind", "refuse", "skip"]
    todo: tuple[SliceRecord, ...] = ()
    bindings: tuple[Binding, ...] = ()
    uuids: Mapping[str, str] = field(default_factory=dict)
    refusal: Refusal | None = None
    could_fit: bool = True
    give_back: tuple[SliceRecord, ...] = ()


SKIP = Decision("skip")

# How far the controller has taken a slice's ResourceClaim (``claim_state``).
CLAIM_NONE = ""
CLAIM_WRITTEN = "written"
CLAIM_ALLOCATED = "allocated"


class Ledger:
    def __init__(self, settings: PlannerSettings | None = None, quota_required: bool = False) -> None:
        self.settings = settings or PlannerSettings()
        self.quota_required = quota_required  # a namespace without a GpuQuota gets nothing (NoQuota)
        self._index = ClusterPlanner()  # inventories, labels and held bindings: the only copy
        self.slices: dict[str, SliceRecord] = {}
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid
        self._groups: dict[tuple[str, str], set[str]] = {}  # (namespace, group) -> uids
        # Bindings decided but not yet seen in a slice's status, with the slice's waiting entry before.
        self._reserved: dict[str, tuple[Binding, tuple[str, str] | None]] = {}
        self.quotas: dict[str, Quota] = {}
        self.quota_errors: dict[str, str] = {}  # namespace -> why its GpuQuota is ignored
        # Namespace -> its GpuQuota object's metadata.generation, and the status last written to it (as
        # read from the object, then as the controller wrote it): written again only when it differs.
        self._quota_generations: dict[str, int] = {}
        self._quota_written: dict[str, dict] = {}
        self._charges = Charges()
        self.line = WaitingLine()
        self._writing: set[str] = set()  # decided, write not yet committed or rolled back
        # Node -> the resourceVersion of the GpuNode its inventory was read from (0: unknown).
        self._inventory_versions: dict[str, int] = {}
        self.nodes: dict[str, NodeRecord] = {}  # every Node: the controller's one Node cache
        self._nodes_listed = False  # whether ``nodes`` came from a full list yet (else a Node missing says nothing)
        self._pods: dict[tuple[str, str], PodRecord] = {}  # (namespace, pod group) -> its pod
        # Pods (namespace, pod group) whose gate is being removed: the pod's own event and its slice's may
        # both find it ready at once, and a second patch would only be refused (422) and read the pod.
        self._ungating: set[tuple[str, str]] = set()
        # Slices (namespace, name) whose device their node's GpuNode did not list (yet), by node, and
        # when each was first found waiting (slice uid -> the caller's clock).
        self._device_waits: dict[str, set[tuple[str, str]]] = {}
        self._device_wait_since: dict[str, float] = {}
        # Slice uid -> how far its claim is written (CLAIM_WRITTEN, CLAIM_ALLOCATED), and the slices
        # whose claim's reservation for their gated pod was taken off.
        self._claims: dict[str, str] = {}
        self._unreserved: set[str] = set()
        # Slices seen deleted since the last full list: uid -> the deletion's resourceVersion.
        self._gone: dict[str, int] = {}

    # ---- reading -------------------------------------------------------------------------------

    @property
    def inventories(self) -> Mapping[str, NodeInventory]:
        return self._index.inventories

    def uuid(self, node: str, gpu: int) -> str:
        return self._index.uuids.get((node, gpu), "")

    def bindings(self) -> list[Binding]:
        """Every binding that holds GPU room: written ones (until the slice is gone) and reserved."""
        return list(self._index.bindings.values())

    def reserved(self, uid: str) -> Binding | None:
        entry = self._reserved.get(uid)
        return entry[0] if entry is not None else None

    @property
    def usage(self) -> Mapping[str, Usage]:
        return self._charges.usage

    @property
    def cluster_bytes(self) -> int:
        return self._charges.cluster_bytes

    def used(self, namespace: str) -> Usage:
        return self._charges.usage.get(namespace, Usage())

    def charges(self) -> Mapping[str, Charge]:
        return self._charges.charged

    def held_whole(self, namespace: str) -> dict[GpuKey, int]:
        """The fraction GPUs ``namespace`` holds alone, charged whole (``core.books.charges``), with their memory."""
        return self._charges.held_whole(namespace)

    def share(self, namespace: str) -> Fraction:
        """The namespace's place in the fair order: the share of its quota (or of the cluster) it holds."""
        return share(self.quotas.get(namespace), self.used(namespace), self.cluster_bytes)

    def slice_named(self, namespace: str, name: str) -> SliceRecord | None:
        uid = self._names.get((namespace, name))
        return self.slices.get(uid) if uid is not None else None

    def group_members(self, info: SliceRecord) -> list[SliceRecord]:
        """The slices of ``info``'s group (itself included) not being deleted, by name."""
        if info.group is None:
            return [info]
        members = (self.slices[u] for u in self._groups.get((info.namespace, info.group), ()) if u in self.slices)
        return sorted((m for m in members if not m.deleting), key=lambda m: m.name)

    def pending(self) -> list[SliceRecord]:
        """Slices waiting for a binding, oldest first."""
        waiting = [
            s for s in self.slices.values()
            if s.binding is None and s.uid not in self._reserved and not s.deleting and s.phase in (None, "Pending")
            and s.request is not None
        ]
        return sorted(waiting, key=lambda s: s.order)

    def node_gone(self, node: str) -> bool:
        """Whether ``node`` is gone: neither its Node nor its GpuNode exists (a node autoscaler or an admin
        removed it; its agent and its devices went with it). False until the Nodes were listed once."""
        return self._nodes_listed and node not in self.nodes and node not in self.inventories

    def bound_on(self, node: str) -> list[SliceRecord]:
        """The slices bound to ``node``."""
        return [s for s in self.slices.values() if s.binding is not None and s.binding.node == node]

    def nodes_to_keep(self) -> set[str]:
        """The nodes a node autoscaler must not remove (``core.autoscale.nodes``): where a slice is bound
        (or its binding is being written), is not being deleted, and its pod is not running yet (the books
        hold a pod until it runs); a slice made directly keeps its node while it exists."""
        keep = set()
        for info in self.slices.values():
            binding = info.binding or self.reserved(info.uid)
            if binding is None or info.deleting:
                continue
            if info.pod_owner is None or self.pod(info.namespace, info.group or info.name) is not None:
                keep.add(binding.node)
        return keep

    def counts(self) -> dict[tuple[str, str], int]:
        """Slices by (phase, mode), for the metrics."""
        out: dict[tuple[str, str], int] = {}
        for s in self.slices.values():
            key = (s.phase or "New", str((s.body.get("status") or {}).get("mode", "")))
            out[key] = out.get(key, 0) + 1
        return out

    @property
    def waiting(self) -> Mapping[str, tuple[str, str]]:
        """The waiting line: uid -> (namespace, refusal code)."""
        return self.line.waiting

    def touched_namespaces(self) -> set[str]:
        """The namespaces whose waiting slices changed since the last call (their GpuQuota status)."""
        return self.line.drain_touched()

    # ---- the device check ------------------------------------------------------------------------

    def check_device(self, uid: str, now: float) -> tuple[DeviceVerdict, float]:
        """Whether slice ``uid``'s device may be handed on (``core.books.device_check.check_slice_device``
        against its node's GpuNode), and for how long (by ``now``, the caller's clock) it has waited.
        A Ready slice not accepted waits for its node's GpuNode to change (``take_device_waits``)."""
        info = self.slices.get(uid)
        if info is None or info.binding is None or info.deleting:
            return DeviceVerdict("wait"), 0.0
        status = info.body.get("status") or {}
        verdict = check_slice_device(uid, info.phase, str(status.get("deviceUUID") or ""), info.binding,
                                     self.inventories.get(info.binding.node), early=info.pod_owner is not None,
                                     held=self._holds_device)
        key = (info.namespace, info.name)
        if verdict.action == ACCEPT or info.phase != READY:  # a slice not Ready yet: its Ready event comes
            self._device_waits.get(info.binding.node, set()).discard(key)
            self._device_wait_since.pop(uid, None)
            return verdict, 0.0
        self._device_waits.setdefault(info.binding.node, set()).add(key)
        since = self._device_wait_since.setdefault(uid, now)
        return verdict, now - since

    # ---- the slices' claims ----------------------------------------------------------------------

    def claim_state(self, uid: str) -> str:
        """How far the controller has taken slice ``uid``'s ResourceClaim: CLAIM_NONE, CLAIM_WRITTEN
        (this slice's claim exists) or CLAIM_ALLOCATED (and allocated to its device)."""
        return self._claims.get(uid, CLAIM_NONE)

    def set_claim_state(self, uid: str, state: str) -> None:
        """Slice ``uid``'s claim was written, allocated, or found gone or wrong (CLAIM_NONE: written anew)."""
        if state == CLAIM_NONE or uid not in self.slices:
            self._claims.pop(uid, None)
        else:
            self._claims[uid] = state

    def unreserving(self, uid: str) -> bool:
        """Slice ``uid``'s claim's reservation for its gated pod is to be taken off: True the first time
        (``unreserve_failed`` makes it the first again)."""
        if uid in self._unreserved or uid not in self.slices:
            return False
        self._unreserved.add(uid)
        return True

    def unreserve_failed(self, uid: str) -> None:
        self._unreserved.discard(uid)

    def _holds_device(self, uid: str) -> bool:
        """Whether slice ``uid`` still holds the device a GpuNode names it the owner of."""
        info = self.slices.get(uid)
        return info is not None and not info.deleting

    def take_device_waits(self, node: str) -> list[tuple[str, str]]:
        """The slices (namespace, name) whose device ``node``'s GpuNode did not list, in order; they wait
        no more (a GpuNode changed: each is checked again)."""
        return sorted(self._device_waits.pop(node, set()))

    # ---- deciding ------------------------------------------------------------------------------

    def decide(self, uid: str, refused: dict | None = None) -> Decision:
        """Plan the slice ``uid`` with its group (every member on one node, or none), admit it against its
        namespace's quota, and reserve the bindings or put the slices in the waiting line.

        ``refused`` (one pass of the line) remembers refusals: within a pass room only shrinks, so an
        equal request (or the same group) is refused without planning again."""
        info = self.slices.get(uid)
        if info is None or info.binding is not None or uid in self._reserved or info.request is None:
            return SKIP
        key: Any = ("group", info.namespace, info.group)
        if info.group is not None and refused is not None and key in refused:
            cached: Decision = refused[key]
            return replace(cached, todo=(), give_back=())  # its members were refused with it
        members = self.group_members(info)
        if info.group is not None and len(members) != info.group_size:
            return SKIP  # the pod's controller is still making the others (or one is being replaced)
        held = [m for m in members if m.binding is not None or m.uid in self._reserved]
        todo = [m for m in members if m not in held]
        if not todo or any(m.request is None or m.phase not in (None, "Pending") for m in todo):
            return SKIP
        decision = self._decide(info, held, todo, refused)
        if decision.kind == "refuse":
            assert decision.refusal is not None
            for member in todo:
                self.line.set(member.uid, (member.namespace, decision.refusal.code))
            if info.group is not None and refused is not None:
                refused[key] = decision
        else:
            for member, binding in zip(todo, decision.bindings, strict=True):
                self._reserved[member.uid] = (binding, self.waiting.get(member.uid))
                self._writing.add(member.uid)
                self.line.set(member.uid, None)
                self._held(member.uid)
        return decision

    def _decide(self, info: SliceRecord, held: list[SliceRecord], todo: list[SliceRecord],
                refused: dict | None) -> Decision:
        quota = self.quotas.get(info.namespace)
        used = self.used(info.namespace)
        shape = (info.request, info.pinned, info.eligible)
        held_nodes = {self._binding_of(m).node for m in held}
        try:
            missing = quota_missing(info.namespace, quota, self.quota_required, self.quota_errors.get(info.namespace))
            if missing is not None:
                raise Refusal(NO_QUOTA, missing)
            if info.group is None:
                assert info.request is not None
                if refused is not None and shape in refused:
                    raise refused[shape]
                planned = self._index.plan(info.request, info.pinned, self.settings, nodes=info.eligible,
                                           namespace=info.namespace)
                bindings = [replace(planned, uid=info.uid)]
            else:
                what = f"the group {info.group} of namespace {info.namespace}"
                if len(held_nodes) > 1:
                    raise Refusal(NO_CAPACITY, f"{what} is bound on several nodes ({', '.join(sorted(held_nodes))})")
                node = next(iter(held_nodes)) if len(held_nodes) == 1 else info.pinned
                requests = [(m.uid, m.request) for m in todo if m.request is not None]
                bindings = self._index.plan_group(requests, node, self.settings, nodes=info.eligible, what=what,
                                                  namespace=info.namespace)
        except Refusal as refusal:
            if refusal.code == NO_CAPACITY:
                if info.group is None and refused is not None:
                    refused[shape] = refusal
                # No placement, so no grant: the requests' bytes are the least they would add.
                least = sum(m.request.memory_bytes or 0 for m in todo if m.request is not None)
                verdict = admit(quota, used, least, at_least=True, slices=len(todo))
                if not verdict.allowed:
                    refusal = Refusal(QUOTA_EXCEEDED, verdict.message)
                    return Decision("refuse", tuple(todo), refusal=refusal, could_fit=verdict.could_fit,
                                    give_back=tuple(held))
            return Decision("refuse", tuple(todo), refusal=refusal, give_back=tuple(held))
        added, taken = self._charges.added(info.namespace, [self._charge(info.namespace, b) for b in bindings])
        verdict = admit(quota, used, added, slices=len(bindings), note=whole_gpu_note(taken))
        if not verdict.allowed:
            for b in bindings:
                self._held(b.uid)  # plan_group left its tentative bindings in the index
            return Decision("refuse", tuple(todo), refusal=Refusal(QUOTA_EXCEEDED, verdict.message),
                            could_fit=verdict.could_fit, give_back=tuple(held))
        uuids = {b.uid: self.uuid(b.node, b.gpu) for b in bindings}
        return Decision("bind", tuple(todo), tuple(bindings), uuids)

    def probe(self, uid: str) -> Refusal | None:
        """How slice ``uid`` alone would be planned now, holding nothing: its refusal, or None (it fits)."""
        info = self.slices[uid]
        assert info.request is not None
        try:
            self._index.plan(info.request, info.pinned, self.settings, nodes=info.eligible, namespace=info.namespace)
        except Refusal as refusal:
            return refusal
        return None

    def wait_in_line(self, uid: str, code: str) -> None:
        """Slice ``uid`` waits, refused with ``code`` outside ``decide`` (held behind an older slice)."""
        info = self.slices.get(uid)
        if info is not None and info.binding is None and uid not in self._reserved:
            self.line.set(uid, (info.namespace, code))

    def writing(self, uid: str) -> bool:
        """Whether the binding ``decide`` made for ``uid`` is still being written (not yet committed or
        rolled back): its own write's watch event may arrive before the write returns."""
        return uid in self._writing

    def commit(self, uid: str) -> None:
        """The binding write is done (the written status was observed with ``put_slice``)."""
        self._writing.discard(uid)

    def rollback(self, uid: str) -> None:
        """The binding write failed: the books are as before ``decide`` for this slice. A claim allocated
        to the reserved binding meanwhile counts as written only: the next binding's allocation is checked
        against it (a pod's slice's claim is allocated beside the binding's write)."""
        self._writing.discard(uid)
        entry = self._reserved.pop(uid, None)
        info = self.slices.get(uid)
        if entry is not None and (info is None or info.binding is None):
            self.line.set(uid, entry[1])
            if self._claims.get(uid) == CLAIM_ALLOCATED:
                self._claims[uid] = CLAIM_WRITTEN
        self._held(uid)

    def _binding_of(self, info: SliceRecord) -> Binding:
        return info.binding or self._reserved[info.uid][0]

    # ---- charges -------------------------------------------------------------------------------

    def _held(self, uid: str) -> None:
        """Put in the index the room slice ``uid`` holds now (its written binding, else its reserved
        one, else none), and charge its namespace's quota the same way. A slice being deleted holds
        both until it is gone; a slice gone whose device an agent still holds is charged from that
        agent's GpuNode."""
        info = self.slices.get(uid)
        binding = info.binding if info is not None and info.binding is not None else self.reserved(uid)
        if binding is None:
            self._index.drop_binding(uid)
        else:
            self._index.put_binding(binding)
        charge = None
        if binding is not None and info is not None:
            charge = self._charge(info.namespace, binding)
        elif info is None:
            charge = self._charges.agent_charge(uid)
            if charge is not None and charge.whole is not None and self._index.labels_of(charge.whole[0])[1]:
                charge = own_charge(charge)
        self._charges.set(uid, charge)

    def _charge(self, namespace: str, binding: Binding) -> Charge:
        """What ``binding`` costs its namespace (``core.books.charges.fraction_charge``): a fraction on a node
        that does not share is charged its GPU's whole memory."""
        shared = self._index.labels_of(binding.node)[1]
        gpu_bytes = None
        if binding.mode == MODE_FRACTION and not shared:
            inventory = self._index.inventories.get(binding.node)
            gpu = next((g for g in inventory.gpus if g.index == binding.gpu), None) if inventory else None
            gpu_bytes = gpu.memory_mib * MIB if gpu is not None else None
        return fraction_charge(namespace, binding, shared, gpu_bytes)

    def _recharge(self, node: str) -> set[str]:
        """Charge again every slice held on ``node`` (its sharing label or its GPUs changed); returns
        the namespaces whose use changed."""
        changed: set[str] = set()
        uids = {b.uid for b in self._index.bindings.values() if b.node == node}
        uids |= {uid for uid, c in self._charges.charged.items() if c.whole is not None and c.whole[0] == node}
        for uid in uids:
            before = self._charges.charged.get(uid)
            self._held(uid)
            after = self._charges.charged.get(uid)
            if before != after:
                changed.update(c.namespace for c in (before, after) if c is not None)
        return changed

    # ---- observing: quotas and labels ----------------------------------------------------------

    def put_quota(self, body: Mapping) -> bool:
        """Take a GpuQuota event; False when it is not the namespace's quota (another name: the CRD
        refuses those, an API server without CEL may not) or its spec is not valid (then ignored)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if name != QUOTA_NAME:
            return False
        self._quota_generations[namespace] = int(meta.get("generation") or 0)
        if body.get("status") is not None and namespace not in self._quota_written:
            self._quota_written[namespace] = dict(body["status"])  # e.g. after a restart: no write when equal
        try:
            self.quotas[namespace] = quota_from_spec(namespace, body.get("spec"), name)
        except QuantityError as exc:
            self.quotas.pop(namespace, None)
            self.quota_errors[namespace] = str(exc)
            return False
        self.quota_errors.pop(namespace, None)
        return True

    def remove_quota(self, body: Mapping) -> None:
        meta = body["metadata"]
        if meta["name"] == QUOTA_NAME:
            self.quotas.pop(meta["namespace"], None)
            self.quota_errors.pop(meta["namespace"], None)
            self._quota_generations.pop(meta["namespace"], None)
            self._quota_written.pop(meta["namespace"], None)

    def replace_quotas(self, bodies: Iterable[Mapping]) -> None:
        """Every GpuQuota afresh (a full list); what was written to each is as the list read it."""
        self.quotas, self.quota_errors, self._quota_generations, self._quota_written = {}, {}, {}, {}
        for body in bodies:
            self.put_quota(body)

    def quota_generation(self, namespace: str) -> int | None:
        """The namespace's GpuQuota object's generation; None when it has none (nothing to write to)."""
        return self._quota_generations.get(namespace)

    @property
    def quota_objects(self) -> Iterable[str]:
        """The namespaces with a GpuQuota object (valid or not)."""
        return self._quota_generations.keys()

    def quota_status_written(self, namespace: str) -> Mapping | None:
        """The status last written to (or read from) the namespace's GpuQuota."""
        return self._quota_written.get(namespace)

    def quota_status_wrote(self, namespace: str, status: Mapping) -> None:
        """The namespace's GpuQuota status was written (kept only while the object is known)."""
        if namespace in self._quota_generations:
            self._quota_written[namespace] = dict(status)

    def put_node(self, node: str, record: NodeRecord | None) -> set[str] | None:
        """Take a Node (None: it is gone); None when nothing placement reads of its labels changed, else
        the namespaces whose quota use changed (fraction sharing changes what its fractions are charged)."""
        if record is None:
            self.nodes.pop(node, None)
        else:
            self.nodes[node] = record
        flags = record.flags if record is not None else NodeLabels()
        before = NodeLabels(*self._index.labels_of(node))
        if flags == before:
            return None
        self._index.set_labelled(node, flags.mig)
        self._index.set_fraction_sharing(node, flags.sharing)
        self._index.set_runtime_accepted(node, flags.accepted)
        self._index.set_leaving(node, flags.leaving)
        return self._recharge(node) if flags.sharing != before.sharing else set()

    # ---- observing: pods -----------------------------------------------------------------------

    def pod(self, namespace: str, group: str) -> PodRecord | None:
        """The pod of ``group`` (its label's value) in ``namespace``, as last seen."""
        return self._pods.get((namespace, group))

    def put_pod(self, namespace: str, group: str, record: PodRecord) -> bool:
        """Take a pod event; False when it is older than what is known of that pod (ignored: e.g. a
        watch event that comes after the controller's own write's answer)."""
        known = self._pods.get((namespace, group))
        if known is not None and known.uid == record.uid and known.version > record.version:
            return False
        self._pods[(namespace, group)] = record
        return True

    def pods_held(self) -> list[tuple[tuple[str, str], PodRecord]]:
        """Every pod the books hold, by (namespace, group)."""
        return list(self._pods.items())

    def remove_pod(self, namespace: str, group: str) -> None:
        """The pod is gone, going or finished: nothing waits for it."""
        self._pods.pop((namespace, group), None)

    def ungating(self, namespace: str, group: str) -> bool:
        """Whether the pod's gate is being removed (its write is under way)."""
        return (namespace, group) in self._ungating

    def set_ungating(self, namespace: str, group: str, on: bool) -> None:
        if on:
            self._ungating.add((namespace, group))
        else:
            self._ungating.discard((namespace, group))

    # ---- observing: slices ---------------------------------------------------------------------

    def put_slice(self, info: SliceRecord) -> SliceRecord | None:
        """Take a slice event; None when it is older than what is known (ignored)."""
        known = self.slices.get(info.uid)
        if known is not None and info.version and known.version > info.version:
            return None
        if known is not None and info.version and known.version == info.version:
            info = known  # the same version seen again (a listing after a full read): one copy is kept
        if known is not None and known.group != info.group:
            self._ungroup(known)
        self.slices[info.uid] = info
        self._names[(info.namespace, info.name)] = info.uid
        if info.group is not None:
            self._groups.setdefault((info.namespace, info.group), set()).add(info.uid)
        if info.binding is not None:
            self._reserved.pop(info.uid, None)
        if info.binding is not None or info.deleting or info.phase not in (None, "Pending"):
            self.line.set(info.uid, None)  # bound, going or past planning: it waits no more
        self._held(info.uid)
        return info

    def remove_slice(self, uid: str, version: int = 0) -> SliceRecord | None:
        """Take a slice's deletion; ``version``: the deletion's resourceVersion (0: unknown), so that
        a full list read before it does not bring the slice back."""
        if version:
            self._gone[uid] = max(version, self._gone.get(uid, 0))
        self._reserved.pop(uid, None)
        self.line.set(uid, None)
        self._device_wait_since.pop(uid, None)
        self._claims.pop(uid, None)
        self._unreserved.discard(uid)
        gone = self.slices.pop(uid, None)
        if gone is not None and self._names.get((gone.namespace, gone.name)) == uid:
            del self._names[(gone.namespace, gone.name)]
        if gone is not None:
            self._ungroup(gone)
        self._held(uid)
        return gone

    def _ungroup(self, info: SliceRecord) -> None:
        if info.group is None:
            return
        members = self._groups.get((info.namespace, info.group), set())
        members.discard(info.uid)
        if not members:
            self._groups.pop((info.namespace, info.group), None)

    # ---- observing: inventories ----------------------------------------------------------------

    def put_inventory(self, inventory: NodeInventory, version: int = 0) -> set[str]:
        """Take a GpuNode's inventory (``version``: the GpuNode's resourceVersion); returns the namespaces
        whose quota use changed."""
        self._inventory_versions[inventory.node] = version
        old = self._index.inventories.get(inventory.node)
        self._index.set_inventory(inventory)
        changed = self._agent_holds(inventory.node, inventory)
        if old is None or _gpu_memory(old) != _gpu_memory(inventory):
            changed |= self._recharge(inventory.node)  # a fraction GPU's whole memory is what it charges
        return changed

    def remove_inventory(self, node: str) -> set[str]:
        self._inventory_versions.pop(node, None)
        # Slices still bound there keep the charge they have: a GPU held whole stays charged its size.
        self._index.remove_inventory(node)
        return self._agent_holds(node, None)

    def _agent_holds(self, node: str, inventory: NodeInventory | None) -> set[str]:
        """Take what ``node``'s agent holds now; charges change only for slices the controller does not know."""
        changed: set[str] = set()
        for uid in self._charges.take_inventory(node, inventory):
            if uid in self.slices:
                continue
            before = self._charges.charged.get(uid)
            self._held(uid)
            changed.update(c.namespace for c in (before, self._charges.charged.get(uid)) if c is not None)
        return changed

    def replace_all(self, slices: Iterable[SliceRecord], inventories: Iterable[NodeInventory],
                    nodes: Mapping[str, NodeRecord], listed_at: int | None = None,
                    inventories_at: tuple[Mapping[str, int], int] | None = None) -> None:
        """A fresh full list: what is not in it is gone (events may have been missed while paused).
        ``nodes``: every Node. ``listed_at``: the slices' list's
        resourceVersion. The watch runs on while the list is read, so what it showed after that
        version stands: a slice made (or changed) since is kept though the list lacks it, and a
        slice deleted since is not brought back, so neither its room nor another's binding is lost.
        ``inventories_at``: each listed GpuNode's resourceVersion and the GpuNodes' list's; likewise an
        inventory the watch brought newer than the list's is kept (a new instance's device stays listed)."""
        fresh = {}
        for info in slices:
            if listed_at is not None and self._gone.get(info.uid, 0) > listed_at:
                continue
            known = self.slices.get(info.uid)
            fresh[info.uid] = known if known is not None and known.version >= info.version else info
        if listed_at is not None:
            fresh.update({uid: s for uid, s in self.slices.items() if uid not in fresh and s.version > listed_at})
        self._gone = {uid: v for uid, v in self._gone.items() if listed_at is not None and v > listed_at}
        self.slices = fresh
        self._names = {(s.namespace, s.name): uid for uid, s in fresh.items()}
        self._groups = {}
        for uid, s in fresh.items():
            if s.group is not None:
                self._groups.setdefault((s.namespace, s.group), set()).add(uid)
        self._reserved = {uid: r for uid, r in self._reserved.items() if uid in fresh}
        for uid in [uid for uid in self.waiting if uid not in fresh]:
            self.line.set(uid, None)
        self._device_wait_since = {uid: t for uid, t in self._device_wait_since.items() if uid in fresh}
        self._claims = {uid: c for uid, c in self._claims.items() if uid in fresh}
        self._unreserved &= fresh.keys()
        self.nodes = dict(nodes)
        self._nodes_listed = True
        labels = {name: record.flags for name, record in self.nodes.items()}
        held = {uid: s.binding for uid, s in fresh.items() if s.binding is not None}
        held.update({uid: r[0] for uid, r in self._reserved.items()})
        inventories = self._fresh_inventories(list(inventories), inventories_at)
        self._index.reset(inventories, [n for n, f in labels.items() if f.mig], held.values(),
                          sharing=[n for n, f in labels.items() if f.sharing],
                          accepted=[n for n, f in labels.items() if f.accepted],
                          leaving={n: f.leaving for n, f in labels.items() if f.leaving is not None})
        for uid in {*self.slices, *self._charges.reset(inventories)}:
            self._held(uid)


    def _fresh_inventories(self, listed: list[NodeInventory],
                           listed_at: tuple[Mapping[str, int], int] | None) -> list[NodeInventory]:
        """The listed inventories, each but where the watch brought a newer GpuNode while the list was
        read (and those it brought made after the list), which stand; the versions kept follow."""
        if listed_at is None:
            self._inventory_versions = {}
            return listed
        versions, list_version = listed_at
        known = self._index.inventories
        fresh = {}
        kept_versions = {}
        for inventory in listed:
            mine = self._inventory_versions.get(inventory.node, 0)
            listed_version = versions.get(inventory.node, 0)
            newer = inventory.node in known and mine > listed_version
            fresh[inventory.node] = known[inventory.node] if newer else inventory
            kept_versions[inventory.node] = mine if newer else listed_version
        for node, version in self._inventory_versions.items():
            if node not in fresh and node in known and version > list_version:
                fresh[node], kept_versions[node] = known[node], version
        self._inventory_versions = kept_versions
        return list(fresh.values())


def _gpu_memory(inventory: NodeInventory) -> dict[int, int]:
    return {g.index: g.memory_mib for g in inventory.gpus}
