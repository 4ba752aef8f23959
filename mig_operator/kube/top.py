"""`mig-operator top`'s reads: the GpuNodes, the GpuSlices and the GpuQuotas, three list calls.

Drawing them is core/views/top_view.py's; the command line (cli/top.py) loops for ``--watch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from mig_operator.core.views.top_view import QUOTAS_ABSENT, QUOTAS_LISTED, QUOTAS_UNREADABLE, TopView, build_view

from .common.client import ApiError, KubeClient, Retry, gpunodes_path, slices_path
from .common.names import API_VERSION

QUOTAS_PLURAL = "gpuquotas"
# A person is waiting: fail in about a second rather than after the handlers' long retries.
TOP_RETRY = Retry(attempts=2, first_wait_s=0.2, max_wait_s=1.0)


class TopError(Exception):
    """The API server cannot be read (unreachable, refused, CRDs missing): one line for the user."""


def quotas_path() -> str:
    return f"/apis/{API_VERSION}/{QUOTAS_PLURAL}"


def client_for(kubeconfig: str | None, as_user: str | None = None,
               as_groups: Sequence[str] | None = None) -> KubeClient:
    """A client for a person's command (top, check): fails fast, acts as the kubeconfig's user (``as:``,
    or kubectl's ``--as``/``--as-group``)."""
    return KubeClient.from_environment(kubeconfig, as_user, as_groups, retry=TOP_RETRY, timeout_s=10.0,
                                       connections=4)


async def read_view(client: KubeClient) -> TopView:
    """One picture of the cluster; a missing GpuQuota CRD (or no right to read quotas) costs only the table."""
    nodes_call = client.list(gpunodes_path())
    slices_call = client.list(slices_path())
    quotas_call = client.list(quotas_path())
    nodes, slices, quotas = await asyncio.gather(nodes_call, slices_call, quotas_call, return_exceptions=True)
    for what, result in (("GpuNodes", nodes), ("GpuSlices", slices)):
        if isinstance(result, ApiError):
            if result.not_found:
                raise TopError(f"cannot list {what}: the API server does not know them (is the CRD installed? "
                               "kubectl apply -f crds/)")
            raise TopError(f"cannot list {what}: {result}")
        if isinstance(result, BaseException):
            raise result
    assert isinstance(nodes, list) and isinstance(slices, list)
    if isinstance(quotas, ApiError):
        if quotas.not_found:
            return build_view(nodes, slices, None, QUOTAS_ABSENT,
                              "the GpuQuota CRD is not installed (no namespace is limited)")
        return build_view(nodes, slices, None, QUOTAS_UNREADABLE,
                          f"cannot list GpuQuotas (HTTP {quotas.status} {quotas.reason}): table left out")
    if isinstance(quotas, BaseException):
        raise quotas
    return build_view(nodes, slices, quotas, QUOTAS_LISTED)
