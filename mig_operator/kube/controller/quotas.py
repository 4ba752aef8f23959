"""GpuQuota status and the quota metrics: what each namespace holds and how many of its slices wait.

The binder says which namespaces changed (``changed``); their status, read from the ledger's books
(``core.books.ledger``), is written at most every ``interval_s`` (a burst of bindings makes one write
per quota), and only when it differs from what was last written: ``used.memory`` (the bytes charged,
``core.books.charges``, as a quantity string of bytes), ``used.slices``, ``used.wholeGpus`` and
``heldWhole`` (the fraction GPUs the namespace holds alone, each charged its whole memory; its own
GPUs, so naming them tells it nothing of another namespace), ``waiting`` (Pending slices the quota
holds back) and ``observedGeneration``. Each namespace's write is a key on the work queue,
``("quota-status", namespace)``: a failed write raises and the key comes back after its back-off.
"""

from __future__ import annotations

from mig_operator.core.books.ledger import Ledger
from mig_operator.core.books.quota import QUOTA_NAME

from ..common import metrics
from ..common.client import ApiError, KubeClient
from ..common.workqueue import WorkQueue

QUOTAS = "gpuquotas"


def quota_status_path(namespace: str) -> str:
    return f"/apis/cdmo.io/v1alpha1/namespaces/{namespace}/{QUOTAS}/{QUOTA_NAME}/status"


class QuotaStatus:
    def __init__(self, client: KubeClient, ledger: Ledger, queue: WorkQueue, interval_s: float = 0.5) -> None:
        self.client = client
        self.ledger = ledger
        self.queue = queue
        self.interval_s = interval_s
        self._shown: set[str] = set()  # namespaces with quota metrics set

    def changed(self, namespace: str) -> None:
        self.queue.add(("quota-status", namespace), lambda: self._flush(namespace), self.interval_s)

    async def _flush(self, namespace: str) -> None:
        self._publish(namespace)
        await self._write(namespace)

    def status_of(self, namespace: str) -> dict:
        used = self.ledger.used(namespace)
        whole = self.ledger.held_whole(namespace)
        return {
            "used": {"memory": str(used.memory_bytes), "slices": used.slices, "wholeGpus": used.whole_gpus},
            "heldWhole": [{"node": node, "gpu": gpu, "memory": str(memory)} for (node, gpu), memory in whole.items()],
            "waiting": self.ledger.line.quota_waiting(namespace),
            "observedGeneration": self.ledger.quota_generation(namespace) or 0,
        }

    def _publish(self, namespace: str) -> None:
        """The quota metrics: use for every namespace that holds slices or has a quota."""
        used = self.ledger.used(namespace)
        quota = self.ledger.quotas.get(namespace)
        if quota is None and not used.slices:
            if namespace in self._shown:
                self._shown.discard(namespace)
                for gauge in (metrics.QUOTA_USED_BYTES, metrics.QUOTA_USED_SLICES, metrics.QUOTA_WHOLE_GPUS,
                              metrics.QUOTA_HARD_BYTES, metrics.QUOTA_WAITING_SLICES):
                    try:
                        gauge.remove(namespace)
                    except KeyError:
                        pass
            return
        self._shown.add(namespace)
        metrics.QUOTA_USED_BYTES.labels(namespace).set(used.memory_bytes)
        metrics.QUOTA_USED_SLICES.labels(namespace).set(used.slices)
        metrics.QUOTA_WHOLE_GPUS.labels(namespace).set(used.whole_gpus)
        if quota is not None:
            metrics.QUOTA_HARD_BYTES.labels(namespace).set(quota.memory_bytes)
            metrics.QUOTA_WAITING_SLICES.labels(namespace).set(self.ledger.line.quota_waiting(namespace))
        else:
            for gauge in (metrics.QUOTA_HARD_BYTES, metrics.QUOTA_WAITING_SLICES):
                try:
                    gauge.remove(namespace)
                except KeyError:
                    pass

    async def _write(self, namespace: str) -> None:
        if self.ledger.quota_generation(namespace) is None:
            return  # no GpuQuota object in the namespace: nothing to write to
        wanted = self.status_of(namespace)
        if self.ledger.quota_status_written(namespace) == wanted:
            return
        try:
            await self.client.merge_patch(quota_status_path(namespace), {"status": wanted})
        except ApiError as exc:
            if exc.not_found:
                return  # the GpuQuota is gone: its deletion's event takes it out of the books
            raise  # the namespace's key comes back after its back-off
        self.ledger.quota_status_wrote(namespace, wanted)

    async def resync(self) -> None:
        """After a full list: every namespace's status and metrics again (written only where changed)."""
        for namespace in set(self.ledger.quota_objects) | set(self.ledger.usage) | self._shown:
            self.changed(namespace)
