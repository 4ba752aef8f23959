"""A Ledger fed with API bodies, as the binder feeds it (kube/controller/observe.py): the fixture of
the tests that play watch events into the controller's books."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mig_operator.core.books.ledger import Ledger, SliceRecord
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.kube.controller.observe import inventory, inventory_node, node_record, slice_record


class BodyLedger(Ledger):
    @property
    def planner(self) -> ClusterPlanner:
        return self._index

    def put_slice(self, body: Mapping | SliceRecord) -> SliceRecord | None:  # type: ignore[override]
        return super().put_slice(body if isinstance(body, SliceRecord) else slice_record(body))

    def put_inventory(self, body: Mapping) -> set[str]:  # type: ignore[override]
        return super().put_inventory(inventory(body))

    def remove_inventory(self, body: Mapping) -> set[str]:  # type: ignore[override]
        return super().remove_inventory(inventory_node(body))

    def set_node_labels(self, node: str, labels: Mapping[str, str] | None) -> bool:
        """A Node event carrying ``labels`` (None: the Node is gone); whether placement's labels changed."""
        body = None if labels is None else {"metadata": {"name": node, "labels": labels}}
        return self.put_node(node, None if body is None else node_record(body)) is not None

    def replace_all(self, slices: Iterable[Mapping], inventories: Iterable[Mapping],  # type: ignore[override]
                    nodes: Iterable[Mapping], listed_at: int | None = None) -> None:
        records = {n["metadata"]["name"]: node_record(n) for n in nodes}
        super().replace_all([slice_record(b) for b in slices], [inventory(b) for b in inventories], records,
                            listed_at)
