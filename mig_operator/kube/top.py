"""`mig-operator top`'s reads: the GpuNodes, the GpuSlices and the GpuQuotas, three list calls.

A caller refused the cluster-wide lists (a tenant with ``edit`` in one namespace) gets the picture of one
namespace instead, as ``advise`` does: its slices and GpuQuotas, no GPUs.

Drawing them is core/views/top_view.py's; the command line (cli/top.py) loops for ``--watch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from mig_operator.core.views.top_view import (
    QUOTAS_ABSENT,
    QUOTAS_LISTED,
    QUOTAS_UNREADABLE,
    TopView,
    build_view,
    namespace_view,
)

from .advise import FORBIDDEN, Scope
from .common.client import ApiError, KubeClient, Retry, cannot_list, gpunodes_path, slices_path
from .common.names import API_VERSION

QUOTAS_PLURAL = "gpuquotas"
# A person is waiting: fail in about a second rather than after the handlers' long retries.
TOP_RETRY = Retry(attempts=2, first_wait_s=0.2, max_wait_s=1.0)


class TopError(Exception):
    """The API server cannot be read (unreachable, refused, CRDs missing): one line for the user."""


def quotas_path(namespace: str | None = None) -> str:
    if namespace is None:
        return f"/apis/{API_VERSION}/{QUOTAS_PLURAL}"
    return f"/apis/{API_VERSION}/namespaces/{quote(namespace, safe='')}/{QUOTAS_PLURAL}"


def client_for(kubeconfig: str | None, as_user: str | None = None,
               as_groups: Sequence[str] | None = None) -> KubeClient:
    """A client for a person's command (top, check): fails fast, acts as the kubeconfig's user (``as:``,
    or kubectl's ``--as``/``--as-group``)."""
    return KubeClient.from_environment(kubeconfig, as_user, as_groups, retry=TOP_RETRY, timeout_s=10.0,
                                       connections=4)


def _unreadable(what: str, exc: ApiError) -> TopError:
    return TopError(cannot_list(what, exc))


def _quota_table(quotas: list[dict] | BaseException) -> dict[str, Any]:
    """``build_view``'s and ``namespace_view``'s quota arguments; a missing GpuQuota CRD (or no right to
    read quotas) costs only the table."""
    if isinstance(quotas, ApiError):
        if quotas.not_found:
            return {"quotas": None, "quota_state": QUOTAS_ABSENT,
                    "quota_note": "the GpuQuota CRD is not installed (no namespace is limited)"}
        return {"quotas": None, "quota_state": QUOTAS_UNREADABLE,
                "quota_note": f"cannot list GpuQuotas (HTTP {quotas.status} {quotas.reason}): table left out"}
    if isinstance(quotas, BaseException):
        raise quotas
    return {"quotas": quotas, "quota_state": QUOTAS_LISTED}


CLUSTER = Scope(None)  # the whole cluster, no fallback


async def read_view(client: KubeClient, scope: Scope = CLUSTER) -> TopView:
    """One picture of the cluster; of ``scope.namespace`` when it names one, or of ``scope.fallback`` when
    the cluster-wide lists of GpuNodes or GpuSlices are forbidden."""
    if scope.namespace is not None:
        return await _read_namespace(client, scope.namespace)
    nodes_call = client.list(gpunodes_path())
    slices_call = client.list(slices_path())
    quotas_call = client.list(quotas_path())
    nodes, slices, quotas = await asyncio.gather(nodes_call, slices_call, quotas_call, return_exceptions=True)
    refused = [what for what, result in (("GpuNodes", nodes), ("GpuSlices", slices))
               if isinstance(result, ApiError) and result.status == FORBIDDEN]
    if refused and scope.fallback is not None:
        return await _read_namespace(client, scope.fallback, (
            f"the view is limited to namespace {scope.fallback}: the cluster-wide lists of {' and '.join(refused)} "
            "are refused (-n NAMESPACE for another)"))
    for what, result in (("GpuNodes", nodes), ("GpuSlices", slices)):
        if isinstance(result, ApiError):
            raise _unreadable(what, result)
        if isinstance(result, BaseException):
            raise result
    assert isinstance(nodes, list) and isinstance(slices, list)
    return build_view(nodes, slices, **_quota_table(quotas))


async def _read_namespace(client: KubeClient, namespace: str, note: str = "") -> TopView:
    """The picture of one namespace: its GpuSlices and GpuQuotas, two list calls."""
    slices, quotas = await asyncio.gather(client.list(slices_path(namespace)), client.list(quotas_path(namespace)),
                                          return_exceptions=True)
    if isinstance(slices, ApiError):
        raise _unreadable(f"GpuSlices in namespace {namespace}", slices)
    if isinstance(slices, BaseException):
        raise slices
    return namespace_view(namespace, slices, **_quota_table(quotas), note=note)
