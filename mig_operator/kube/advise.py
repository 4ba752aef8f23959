"""`mig-operator advise`'s reads: the GpuSlices the caller may list and the GpuNodes (for each GPU's model).

Without ``--namespace`` or ``--all-namespaces`` it lists every namespace's slices and, where a cluster-wide
list is forbidden (a tenant with ``edit`` in one namespace), the kubeconfig context's namespace, as kubectl
does. GpuNodes the caller may not read cost only the MIG advice that needs them. Building the report is
core/views/advise_view.py's job.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from mig_operator.core.views.advise_view import AdviceReport, build_report

from .common.client import ApiError, KubeClient, cannot_list, gpunodes_path, slices_path
from .common.impersonation import kubeconfig_namespace

FORBIDDEN = 403
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class AdviseError(Exception):
    """The slices cannot be read (unreachable, forbidden, CRD missing): one line for the user."""


@dataclass(frozen=True)
class Scope:
    """Which slices to list: ``namespace`` (one), or every namespace (``None``); ``fallback`` is the
    namespace to list instead when every namespace was asked for implicitly and is forbidden."""

    namespace: str | None
    fallback: str | None = None


@dataclass(frozen=True)
class Reading:
    report: AdviceReport
    notes: tuple[str, ...] = field(default=())


def context_namespace(kubeconfig: str | None) -> str:
    """The namespace kubectl would use: the ServiceAccount's in a pod (no kubeconfig given), else the
    kubeconfig context's, else ``default``."""
    if kubeconfig is None and os.path.isfile(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="ascii", errors="replace") as fh:
            namespace = fh.read(64).strip()
        if namespace:
            return namespace
    import kubernetes  # only for the default kubeconfig location, as kube/common/client.py reads it

    return kubeconfig_namespace(kubeconfig, kubernetes.config.KUBE_CONFIG_DEFAULT_LOCATION)


def _unreadable(what: str, exc: ApiError) -> AdviseError:
    return AdviseError(cannot_list(what, exc))


async def _slices(client: KubeClient, scope: Scope) -> tuple[list[dict], list[str]]:
    try:
        return await client.list(slices_path(scope.namespace)), []
    except ApiError as exc:
        if exc.status != FORBIDDEN or scope.namespace is not None or scope.fallback is None:
            where = f"namespace {scope.namespace}" if scope.namespace else "all namespaces"
            raise _unreadable(f"GpuSlices in {where}", exc) from None
    try:
        items = await client.list(slices_path(scope.fallback))
    except ApiError as exc:
        raise _unreadable(f"GpuSlices in namespace {scope.fallback}", exc) from None
    return items, [f"you may not list GpuSlices in all namespaces: namespace {scope.fallback} only "
                   "(-n NAMESPACE for another)"]


async def read_report(client: KubeClient, scope: Scope, headroom: float) -> Reading:
    """The report of the slices ``scope`` names, each advised with ``headroom``."""
    slices_call = _slices(client, scope)
    nodes_call = client.list(gpunodes_path())
    slices, nodes = await asyncio.gather(slices_call, nodes_call, return_exceptions=True)
    if isinstance(slices, BaseException):
        raise slices
    items, notes = slices
    if isinstance(nodes, ApiError):
        if not nodes.not_found and nodes.status != FORBIDDEN:
            raise _unreadable("GpuNodes", nodes)
        notes.append(f"cannot list GpuNodes (HTTP {nodes.status} {nodes.reason}): each GPU's model is not known")
        nodes = None
    elif isinstance(nodes, BaseException):
        raise nodes
    report = build_report(items, nodes, headroom)
    return Reading(report, tuple(notes) + report.notes)
