"""What the controller knows of the cluster: slices, inventories, labelled nodes, bindings in flight.

Fed by watch events and by periodic full lists (``replace_all``), read by the binder. A watch event
older than what is known (a smaller resourceVersion) is ignored, so a binding the controller has
just written cannot be undone by a late event from before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mig_operator.core.cluster import (
    Binding,
    ClusterPlanner,
    NodeInventory,
    binding_from_status,
    inventory_from_status,
)
from mig_operator.core.quantities import MIB, QuantityError
from mig_operator.core.quota import QUOTA_NAME, Quota, Usage, agent_holdings, quota_from_spec, share
from mig_operator.core.request import SliceRequest
from mig_operator.core.request_forms import MAX_POD_DEVICES
from mig_operator.core.runtime_trust import TRUST_LABEL, TRUST_VALUE, accepted
from mig_operator.core.slice_spec import request_from_spec
from mig_operator.core.tenancy import SHARING_LABEL, SHARING_VALUE, shares_across_namespaces

from ..common.client import resource_version
from ..common.names import (
    AGENT_FINALIZER,
    ELIGIBLE_NODES_ANNOTATION,
    GROUP_ANNOTATION,
    GROUP_SIZE_ANNOTATION,
    MIG_NODE_LABEL,
    MIG_NODE_VALUE,
)


@dataclass
class SliceInfo:
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

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[str, str, str]:
        """Oldest first: Pending slices are planned again in this order."""
        return (self.created, self.namespace, self.name)


def slice_info(body: Mapping) -> SliceInfo:
    meta = body["metadata"]
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    request, invalid = None, ""
    try:
        request = request_from_spec(spec)
    except QuantityError as exc:
        invalid = str(exc)
    binding = binding_from_status(meta["uid"], status, meta["namespace"])
    marked = binding is not None and AGENT_FINALIZER in (meta.get("finalizers") or ())
    return SliceInfo(
        uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], created=meta.get("creationTimestamp", ""),
        version=resource_version(meta), body=dict(body), request=request, invalid=invalid,
        pinned=spec.get("nodeName"), phase=status.get("phase"), binding=binding,
        deleting=bool(meta.get("deletionTimestamp")), marked=marked,
        eligible=_eligible_nodes(meta), **_group(meta),
    )


def _group(meta: Mapping) -> dict[str, Any]:
    """The slice's group, when its annotations name one of 2 to MAX_POD_DEVICES slices (else none:
    a slice made by hand with a bad size is planned on its own)."""
    annotations = meta.get("annotations") or {}
    group, size = annotations.get(GROUP_ANNOTATION), str(annotations.get(GROUP_SIZE_ANNOTATION, ""))
    if not group or not size.isdigit() or not 2 <= int(size) <= MAX_POD_DEVICES:
        return {}
    return {"group": str(group), "group_size": int(size)}


# The Node labels placement reads (key, value): one list each at a resync finds every node that has one.
PLACEMENT_LABELS = ((MIG_NODE_LABEL, MIG_NODE_VALUE), (SHARING_LABEL, SHARING_VALUE), (TRUST_LABEL, TRUST_VALUE))


@dataclass(frozen=True)
class NodeLabels:
    """What placement reads of a Node's labels: the MIG label, fraction sharing across namespaces
    (core.tenancy), runtime trust accepted (core.runtime_trust)."""

    mig: bool = False
    sharing: bool = False
    accepted: bool = False

    @classmethod
    def of(cls, labels: Mapping[str, str] | None) -> NodeLabels:
        labels = labels or {}
        return cls(labels.get(MIG_NODE_LABEL) == MIG_NODE_VALUE, shares_across_namespaces(labels), accepted(labels))


def _eligible_nodes(meta: Mapping) -> tuple[str, ...] | None:
    text = (meta.get("annotations") or {}).get(ELIGIBLE_NODES_ANNOTATION)
    if text is None:
        return None
    return tuple(sorted({name.strip() for name in str(text).split(",") if name.strip()}))


@dataclass
class ClusterState:
    """Every change goes through a method here, which keeps ``planner`` (core's incremental view of
    the cluster) current: a decision then costs the same whatever the cluster's size."""

    slices: dict[str, SliceInfo] = field(default_factory=dict)
    inventories: dict[str, NodeInventory] = field(default_factory=dict)
    labelled: set[str] = field(default_factory=set)  # nodes with the MIG label
    node_labels: dict[str, NodeLabels] = field(default_factory=dict)  # nodes with any label placement reads
    # Bindings decided but not yet seen in a slice's status: they hold their GPU room meanwhile.
    in_flight: dict[str, Binding] = field(default_factory=dict)
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, name) -> uid
    groups: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (namespace, group) -> uids
    planner: ClusterPlanner = field(default_factory=ClusterPlanner)
    # Quotas: each namespace's GpuQuota (named QUOTA_NAME), and what its slices hold, kept current
    # slice by slice so an admission costs the same however many slices there are.
    quotas: dict[str, Quota] = field(default_factory=dict)
    quota_errors: dict[str, str] = field(default_factory=dict)  # namespace -> why its GpuQuota is ignored
    usage: dict[str, Usage] = field(default_factory=dict)
    charged: dict[str, tuple[str, int]] = field(default_factory=dict)  # uid -> (namespace, granted bytes)
    gpu_bytes: dict[str, int] = field(default_factory=dict)  # node -> its GPUs' memory
    cluster_bytes: int = 0
    # What each node's agent holds by slice UID, from its GpuNode (core.quota.agent_holdings).
    agent_held: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)

    def _held(self, uid: str) -> None:
        """Tell the planner what room slice ``uid`` holds now: its written binding, else the one in
        flight, else none; and charge its namespace's quota use the same way. A slice being deleted
        holds both until it is gone (its agent keeps it while its claim is in use); a slice gone
        whose device an agent still holds is charged from that agent's GpuNode."""
        info = self.slices.get(uid)
        binding = info.binding if info is not None and info.binding is not None else self.in_flight.get(uid)
        if binding is None:
            self.planner.drop_binding(uid)
        else:
            self.planner.put_binding(binding)
        charge = None
        if binding is not None and info is not None:
            charge = (info.namespace, binding.granted_bytes)
        elif info is None:
            charge = next((held[uid] for held in self.agent_held.values() if uid in held), None)
        self._charge(uid, charge)

    def _charge(self, uid: str, charge: tuple[str, int] | None) -> None:
        old = self.charged.get(uid)
        if old == charge:
            return
        if old is not None:
            del self.charged[uid]
            left = self.usage[old[0]].plus(-old[1], -1)
            if left.slices:
                self.usage[old[0]] = left
            else:
                del self.usage[old[0]]
        if charge is not None:
            self.charged[uid] = charge
            self.usage[charge[0]] = self.usage.get(charge[0], Usage()).plus(charge[1])

    def used(self, namespace: str) -> Usage:
        return self.usage.get(namespace, Usage())

    def share(self, namespace: str) -> Fraction:
        """The namespace's place in the fair order: the share of its quota (or of the cluster) it holds."""
        return share(self.quotas.get(namespace), self.used(namespace), self.cluster_bytes)

    # ---- quotas --------------------------------------------------------------------------------

    def put_quota(self, body: Mapping) -> bool:
        """Take a GpuQuota event; False when it is not the namespace's quota (another name: the CRD
        refuses those, an API server without CEL may not) or its spec is not valid (then ignored)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if name != QUOTA_NAME:
            return False
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

    def replace_quotas(self, bodies: Iterable[Mapping]) -> None:
        self.quotas, self.quota_errors = {}, {}
        for body in bodies:
            self.put_quota(body)

    def reserve(self, binding: Binding) -> None:
        self.in_flight[binding.uid] = binding
        self._held(binding.uid)

    def unreserve(self, uid: str) -> None:
        self.in_flight.pop(uid, None)
        self._held(uid)

    def set_node_labels(self, node: str, labels: Mapping[str, str] | None) -> bool:
        """Take a Node's labels (None: the Node is gone); False when nothing placement reads changed."""
        flags = NodeLabels.of(labels)
        if flags == self.node_labels.get(node, NodeLabels()):
            return False
        if flags == NodeLabels():
            self.node_labels.pop(node, None)
        else:
            self.node_labels[node] = flags
        (self.labelled.add if flags.mig else self.labelled.discard)(node)
        self.planner.set_labelled(node, flags.mig)
        self.planner.set_fraction_sharing(node, flags.sharing)
        self.planner.set_runtime_accepted(node, flags.accepted)
        return True

    # ---- slices --------------------------------------------------------------------------------

    def put_slice(self, body: Mapping) -> SliceInfo | None:
        """Take a slice event; None when it is older than what is known (ignored)."""
        info = slice_info(body)
        known = self.slices.get(info.uid)
        if known is not None and info.version and known.version > info.version:
            return None
        if known is not None and known.group != info.group:
            self._ungroup(known)
        self.slices[info.uid] = info
        self.names[(info.namespace, info.name)] = info.uid
        if info.group is not None:
            self.groups.setdefault((info.namespace, info.group), set()).add(info.uid)
        if info.binding is not None:
            self.in_flight.pop(info.uid, None)
        self._held(info.uid)
        return info

    def remove_slice(self, uid: str) -> SliceInfo | None:
        self.in_flight.pop(uid, None)
        gone = self.slices.pop(uid, None)
        if gone is not None and self.names.get((gone.namespace, gone.name)) == uid:
            del self.names[(gone.namespace, gone.name)]
        if gone is not None:
            self._ungroup(gone)
        self._held(uid)
        return gone

    def _ungroup(self, info: SliceInfo) -> None:
        if info.group is None:
            return
        members = self.groups.get((info.namespace, info.group), set())
        members.discard(info.uid)
        if not members:
            self.groups.pop((info.namespace, info.group), None)

    def group_members(self, info: SliceInfo) -> list[SliceInfo]:
        """The slices of ``info``'s group (itself included) not being deleted, by name."""
        if info.group is None:
            return [info]
        members = (self.slices[u] for u in self.groups.get((info.namespace, info.group), ()) if u in self.slices)
        return sorted((m for m in members if not m.deleting), key=lambda m: m.name)

    def slice_named(self, namespace: str, name: str) -> SliceInfo | None:
        uid = self.names.get((namespace, name))
        return self.slices.get(uid) if uid is not None else None

    def bindings(self) -> list[Binding]:
        """Every binding that holds GPU room: written ones (until the slice is gone) and in flight."""
        held = {uid: s.binding for uid, s in self.slices.items() if s.binding is not None}
        held.update(self.in_flight)
        return list(held.values())

    def pending(self) -> list[SliceInfo]:
        """Slices waiting for a binding, oldest first."""
        waiting = [
            s for s in self.slices.values()
            if s.binding is None and s.uid not in self.in_flight and not s.deleting and s.phase in (None, "Pending")
            and s.request is not None
        ]
        return sorted(waiting, key=lambda s: s.order)

    # ---- inventories and labels ----------------------------------------------------------------

    def put_inventory(self, body: Mapping) -> set[str]:
        """Take a GpuNode event; returns the namespaces whose quota use changed."""
        name = body["metadata"]["name"]
        node = (body.get("spec") or {}).get("nodeName") or name
        self.inventories[node] = inventory_from_status(node, body.get("status"))
        self.planner.set_inventory(self.inventories[node])
        self._count_memory(node)
        return self._agent_holds(node, agent_holdings(self.inventories[node]))

    def remove_inventory(self, body: Mapping) -> set[str]:
        node = (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
        self.inventories.pop(node, None)
        self.planner.remove_inventory(node)
        self._count_memory(node)
        return self._agent_holds(node, {})

    def _agent_holds(self, node: str, held: dict[str, tuple[str, int]]) -> set[str]:
        """Take what ``node``'s agent holds now; charges change only for slices the controller does not know."""
        old = self.agent_held.get(node, {})
        if held:
            self.agent_held[node] = held
        else:
            self.agent_held.pop(node, None)
        changed: set[str] = set()
        for uid in set(old) | set(held):
            if uid in self.slices or old.get(uid) == held.get(uid):
                continue
            before = self.charged.get(uid)
            self._held(uid)
            changed.update(c[0] for c in (before, self.charged.get(uid)) if c is not None)
        return changed

    def _count_memory(self, node: str) -> None:
        """Keep ``cluster_bytes``, every GPU's memory (the share of namespaces without a quota), current."""
        inventory = self.inventories.get(node)
        now = sum(g.memory_mib for g in inventory.gpus) * MIB if inventory is not None else 0
        self.cluster_bytes += now - self.gpu_bytes.get(node, 0)
        if now:
            self.gpu_bytes[node] = now
        else:
            self.gpu_bytes.pop(node, None)

    def replace_all(self, slices: Iterable[Mapping], inventories: Iterable[Mapping], nodes: Iterable[Mapping]) -> None:
        """A fresh full list: what is not in it is gone (events may have been missed while paused).
        ``nodes``: Node bodies, at least those carrying a label placement reads (``NodeLabels``)."""
        fresh = {}
        for body in slices:
            info = slice_info(body)
            known = self.slices.get(info.uid)
            fresh[info.uid] = known if known is not None and known.version > info.version else info
        self.slices = fresh
        self.names = {(s.namespace, s.name): uid for uid, s in fresh.items()}
        self.groups = {}
        for uid, s in fresh.items():
            if s.group is not None:
                self.groups.setdefault((s.namespace, s.group), set()).add(uid)
        self.in_flight = {uid: b for uid, b in self.in_flight.items() if uid in fresh}
        self.inventories = {}
        for body in inventories:
            node = (body.get("spec") or {}).get("nodeName") or body["metadata"]["name"]
            self.inventories[node] = inventory_from_status(node, body.get("status"))
        flags = {n["metadata"]["name"]: NodeLabels.of(n["metadata"].get("labels")) for n in nodes}
        self.node_labels = {name: f for name, f in flags.items() if f != NodeLabels()}
        self.labelled = {name for name, f in flags.items() if f.mig}
        self.planner.reset(self.inventories.values(), self.labelled, self.bindings(),
                           sharing=[name for name, f in flags.items() if f.sharing],
                           accepted=[name for name, f in flags.items() if f.accepted])
        self.gpu_bytes, self.cluster_bytes = {}, 0
        for node in self.inventories:
            self._count_memory(node)
        self.agent_held = {node: held for node, inv in self.inventories.items() if (held := agent_holdings(inv))}
        self.charged, self.usage = {}, {}
        for uid in {*self.slices, *(uid for held in self.agent_held.values() for uid in held)}:
            self._held(uid)

    def counts(self) -> dict[tuple[str, str], int]:
        """Slices by (phase, mode), for the metrics."""
        out: dict[tuple[str, str], int] = {}
        for s in self.slices.values():
            key = (s.phase or "New", str((s.body.get("status") or {}).get("mode", "")))
            out[key] = out.get(key, 0) + 1
        return out
