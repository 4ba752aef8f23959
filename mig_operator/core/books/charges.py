"""What each namespace's slices are charged against its GpuQuota, as the ledger (core.books.ledger) keeps it,
slice by slice, so that an admission costs the same however many slices there are."""

from __future__ import annotations

from collections.abc import Iterable

from ..placement.cluster import NodeInventory
from ..requests.quantities import MIB
from .quota import Usage, agent_holdings

Charge = tuple[str, int]  # (namespace, granted bytes)


class Charges:
    def __init__(self) -> None:
        self.usage: dict[str, Usage] = {}
        self.charged: dict[str, Charge] = {}  # uid -> its charge
        self._agent_held: dict[str, dict[str, Charge]] = {}  # node -> uid -> what its agent holds
        self._gpu_bytes: dict[str, int] = {}  # node -> its GPUs' memory
        self.cluster_bytes = 0  # every GPU's memory: the share of namespaces without a quota

    def set(self, uid: str, charge: Charge | None) -> None:
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

    def agent_charge(self, uid: str) -> Charge | None:
        """What an agent still holds for slice ``uid`` (a slice gone while its claim is in use)."""
        return next((held[uid] for held in self._agent_held.values() if uid in held), None)

    def take_inventory(self, node: str, inventory: NodeInventory | None) -> set[str]:
        """Take a node's inventory (None: gone); returns the slices whose agent-held entry changed."""
        inventory_bytes = sum(g.memory_mib for g in inventory.gpus) * MIB if inventory is not None else 0
        self.cluster_bytes += inventory_bytes - self._gpu_bytes.pop(node, 0)
        if inventory_bytes:
            self._gpu_bytes[node] = inventory_bytes
        held = agent_holdings(inventory) if inventory is not None else {}
        old = self._agent_held.pop(node, {})
        if held:
            self._agent_held[node] = held
        return {uid for uid in set(old) | set(held) if old.get(uid) != held.get(uid)}

    def reset(self, inventories: Iterable[NodeInventory]) -> set[str]:
        """Afresh from a full list; returns every slice some agent holds."""
        self.usage, self.charged, self._agent_held, self._gpu_bytes, self.cluster_bytes = {}, {}, {}, {}, 0
        for inventory in inventories:
            self.take_inventory(inventory.node, inventory)
        return {uid for held in self._agent_held.values() for uid in held}
