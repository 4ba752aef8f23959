"""A slice's one key on the controller's work queue, ``("slice", namespace, name)``.

Its reconcile takes the slice from what the books say of it now (``core.books.ledger``: the slice, its
claim, its pod) to what it should be, one step after the other; a step that is done does nothing, and
a step that cannot go on yet ends the pass (the event that lets it go on adds the key again):

1. the claim's letting go a pod asked for (its pod deleted while gated, finished, or unschedulable;
   ``SliceClaims.let_go``);
2. being deleted: an unbound slice's finalizer taken off (no agent selects it), and so a bound one's
   whose node is gone (no agent is left to release it), and its claim's reservation for a pod still
   gated taken off (``SliceClaims.slice_going``); nothing more;
3. a spec that cannot be served: phase Failed, reason InvalidSpec;
4. unbound and Pending: bound (``Binder.bind_now``), unless its namespace has slices in line (the line's
   pass binds it, then adds this key); a pod's slice's claim is written and allocated beside the
   binding's write;
5. bound to a node that is gone (neither Node nor GpuNode): phase Failed, reason NodeGone;
   bound without the agent's finalizer (made by hand): the finalizer added (``Binder.mark``);
6. its claim written and allocated once its device may be handed on (``SliceClaims.ensure``);
7. its gated pod ungated once every slice of the pod has come this far (``PodSlices.move_on``); a slice
   that waits or failed has its pod told why instead (or made again where the pod may go now).

Every write to a slice's claim happens here, under its key, so one claim has one writer at a time.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mig_operator.core.books.ledger import Ledger

from ..common.workqueue import WorkQueue
from .claims import SliceClaims
from .pods import PodSlices

if TYPE_CHECKING:
    from .binder import Binder

KIND = "slice"


class SliceKey:
    """The reconcile of a slice's key; registered on the controller's queue as kind ``slice``."""

    def __init__(self, ledger: Ledger, queue: WorkQueue, binder: Binder, claims: SliceClaims,
                 pods: PodSlices) -> None:
        self.ledger = ledger
        self.binder = binder
        self.claims = claims
        self.pods = pods
        queue.register(KIND, self.reconcile)

    async def reconcile(self, namespace: str, name: str) -> None:
        info = self.ledger.slice_named(namespace, name)
        if info is None:
            return  # gone: its claim goes with it (owned)
        await self.claims.let_go(info)
        if self.claims.deleted_for_pod(info) and not info.deleting:
            return  # its pod finished or could not be scheduled: the pod's key deletes it next
        if info.deleting:
            await self.binder.let_go_unbound(info)
            await self.binder.let_go_gone_node(info)
            await self.claims.slice_going(info)
            return
        if info.invalid:
            await self.binder.fail_invalid(info)
            return
        if info.binding is None:
            # The binding is decided before the first await, so the claim's allocation (a pod's slice's
            # claim is written early) goes beside the binding's write rather than after it.
            results = await asyncio.gather(self.binder.bind_now(info), self.claims.ensure(info),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            info = self.ledger.slices.get(info.uid)
            if info is None:
                return
            if info.binding is None:  # waits or failed: its pod is told why (or its slice made again)
                await self.pods.move_on(info, False)
                return
        if await self.binder.fail_gone_node(info):
            return
        await self.binder.mark(info)
        await self.pods.move_on(info, await self.claims.ensure(info))
