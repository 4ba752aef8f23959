"""Removing one finalizer safely while other parts may change the list at the same time."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .client import ApiError, KubeClient, resource_version


async def remove_finalizer(client: KubeClient, path: str, body: Mapping, finalizer: str,
                           unless: Callable[[Mapping], bool] | None = None) -> None:
    """Remove ``finalizer`` from the object at ``path`` (``body`` as last seen) with a JSON patch that
    first tests it is still at the index seen; on a conflict the object is read again. Gone already
    is fine. ``unless``: the removal holds only for the version seen (the patch also tests its
    resourceVersion), and a version read again for which ``unless`` is true keeps the finalizer."""
    meta = body.get("metadata") or {}
    for _ in range(5):
        finalizers = list(meta.get("finalizers") or ())
        if finalizer not in finalizers:
            return
        i = finalizers.index(finalizer)
        ops = [{"op": "test", "path": f"/metadata/finalizers/{i}", "value": finalizer},
               {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
        if unless is not None:
            ops.insert(0, {"op": "test", "path": "/metadata/resourceVersion", "value": str(resource_version(meta))})
        try:
            await client.json_patch(path, ops)
            return
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.status not in (409, 422, 500):
                raise
        try:
            fresh = await client.get(path)
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        if unless is not None and unless(fresh):
            return
        meta = fresh.get("metadata") or {}
    raise ApiError(409, "Conflict", f"could not remove finalizer {finalizer} from {path}")
