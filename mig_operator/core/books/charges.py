"""What each namespace's slices are charged against its GpuQuota, as the ledger (core.books.ledger) keeps it,
slice by slice, so that an admission costs the same however many slices there are.

A namespace pays for what it denies others. A MIG slice is charged its grant, and so is a fraction on
a node that shares its fraction GPUs across namespaces (``core.placement.tenancy``). A fraction on any other
node holds its GPU for its namespace alone (the tenancy rule), so the namespace is charged that GPU's
whole memory, once per GPU however many of its fractions are there, from its first fraction on the
GPU to its last (``fraction_charge``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..placement.cluster import MODE_FRACTION, Binding, NodeInventory
from ..requests.quantities import MIB
from .quota import Usage, agent_holdings

GpuKey = tuple[str, int]  # (node, GPU index)


@dataclass(frozen=True)
class Charge:
    """One slice's charge: ``granted_bytes`` on its own, or, when ``whole`` names the fraction GPU its
    namespace holds alone, that GPU's memory (``whole_bytes``) shared by every fraction of the namespace there."""

    namespace: str
    granted_bytes: int
    whole: GpuKey | None = None
    whole_bytes: int = 0


def fraction_charge(namespace: str, binding: Binding, shared: bool, gpu_bytes: int | None) -> Charge:
    """The charge of ``binding``: its grant, unless it is a fraction on a node that does not share
    (``shared`` False), then its GPU's whole memory ``gpu_bytes`` (the grant when the GPU is not known)."""
    if binding.mode != MODE_FRACTION or shared:
        return Charge(namespace, binding.granted_bytes)
    whole = max(gpu_bytes or 0, binding.granted_bytes)
    return Charge(namespace, binding.granted_bytes, (binding.node, binding.gpu), whole)


def own_charge(charge: Charge) -> Charge:
    """The same slice charged on its own (its node shares its fraction GPUs)."""
    return Charge(charge.namespace, charge.granted_bytes)


class Charges:
    def __init__(self) -> None:
        self.usage: dict[str, Usage] = {}
        self.charged: dict[str, Charge] = {}  # uid -> its charge
        # namespace -> GPU held whole -> [its fractions there, the GPU's memory charged]
        self.whole: dict[str, dict[GpuKey, list[int]]] = {}
        self._agent_held: dict[str, dict[str, Charge]] = {}  # node -> uid -> what its agent holds
        self._gpu_bytes: dict[str, int] = {}  # node -> its GPUs' memory
        self.cluster_bytes = 0  # every GPU's memory: the share of namespaces without a quota

    def set(self, uid: str, charge: Charge | None) -> None:
        old = self.charged.get(uid)
        if old == charge:
            return
        if old is not None:
            del self.charged[uid]
            self._add(old, -1)
        if charge is not None:
            self.charged[uid] = charge
            self._add(charge, 1)

    def _add(self, charge: Charge, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) one slice's charge: a GPU held whole is charged while any
        fraction of the namespace is there, at the size its latest charge says."""
        namespace = charge.namespace
        memory, whole = sign * charge.granted_bytes, 0
        if charge.whole is not None:
            held = self.whole.setdefault(namespace, {})
            entry = held.setdefault(charge.whole, [0, 0])  # [its fractions there, the memory charged]
            count_before, bytes_before = entry[0], entry[1]
            entry[0] += sign
            if sign > 0:
                entry[1] = charge.whole_bytes
            memory = (entry[1] if entry[0] else 0) - (bytes_before if count_before else 0)
            whole = (entry[0] > 0) - (count_before > 0)
            if not entry[0]:
                del held[charge.whole]
                if not held:
                    del self.whole[namespace]
        used = self.usage.get(namespace, Usage()).plus(memory, sign, whole)
        if used.slices:
            self.usage[namespace] = used
        else:
            self.usage.pop(namespace, None)

    def added(self, namespace: str, charges: Iterable[Charge]) -> tuple[int, list[tuple[GpuKey, int]]]:
        """What ``charges`` (new slices of ``namespace``) would add to its memory charge, and the GPUs
        they would take whole (with each GPU's memory): a GPU it holds whole already adds nothing."""
        held = self.whole.get(namespace, {})
        total = 0
        taken: list[tuple[GpuKey, int]] = []
        for charge in charges:
            if charge.whole is None:
                total += charge.granted_bytes
            elif charge.whole not in held and all(charge.whole != key for key, _ in taken):
                taken.append((charge.whole, charge.whole_bytes))
                total += charge.whole_bytes
        return total, taken

    def held_whole(self, namespace: str) -> dict[GpuKey, int]:
        """The fraction GPUs ``namespace`` holds whole, with the memory each is charged."""
        return {key: entry[1] for key, entry in sorted(self.whole.get(namespace, {}).items())}

    def agent_charge(self, uid: str) -> Charge | None:
        """What an agent still holds for slice ``uid`` (a slice gone while its claim is in use)."""
        return next((held[uid] for held in self._agent_held.values() if uid in held), None)

    def take_inventory(self, node: str, inventory: NodeInventory | None) -> set[str]:
        """Take a node's inventory (None: gone); returns the slices whose agent-held entry changed.
        A fraction an agent holds is charged whole here; the ledger charges it on its own where the
        node shares (``own_charge``)."""
        inventory_bytes = sum(g.memory_mib for g in inventory.gpus) * MIB if inventory is not None else 0
        self.cluster_bytes += inventory_bytes - self._gpu_bytes.pop(node, 0)
        if inventory_bytes:
            self._gpu_bytes[node] = inventory_bytes
        held: dict[str, Charge] = {}
        if inventory is not None:
            where = {f.slice_uid: (g.index, g.memory_mib * MIB) for g in inventory.gpus for f in g.fractions}
            for uid, (namespace, granted) in agent_holdings(inventory).items():
                gpu = where.get(uid)
                held[uid] = (Charge(namespace, granted) if gpu is None
                             else Charge(namespace, granted, (node, gpu[0]), max(gpu[1], granted)))
        old = self._agent_held.pop(node, {})
        if held:
            self._agent_held[node] = held
        return {uid for uid in set(old) | set(held) if old.get(uid) != held.get(uid)}

    def reset(self, inventories: Iterable[NodeInventory]) -> set[str]:
        """Afresh from a full list; returns every slice some agent holds."""
        self.usage, self.charged, self.whole, self._agent_held, self._gpu_bytes = {}, {}, {}, {}, {}
        self.cluster_bytes = 0
        for inventory in inventories:
            self.take_inventory(inventory.node, inventory)
        return {uid for held in self._agent_held.values() for uid in held}
