"""Removing one finalizer safely while other parts may change the list at the same time."""

from __future__ import annotations

from collections.abc import Mapping

from .client import ApiError, KubeClient


async def remove_finalizer(client: KubeClient, path: str, meta: Mapping, finalizer: str) -> None:
    """Remove ``finalizer`` from the object at ``path`` with a JSON patch that first tests it is
    still at the index seen; on a conflict the object is read again. Gone already is fine."""
    finalizers = list(meta.get("finalizers") or ())
    for _ in range(5):
        if finalizer not in finalizers:
            return
        i = finalizers.index(finalizer)
        ops = [{"op": "test", "path": f"/metadata/finalizers/{i}", "value": finalizer},
               {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
        try:
            await client.json_patch(path, ops)
            return
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.status not in (409, 422, 500):
                raise
        try:
            finalizers = list((await client.get(path))["metadata"].get("finalizers") or ())
        except ApiError as exc:
            if exc.not_found:
                return
            raise
    raise ApiError(409, "Conflict", f"could not remove finalizer {finalizer} from {path}")
