"""Who may share a GPU that serves fractions: one namespace at a time, unless an admin says otherwise.

A fraction is a memory limit enforced inside cooperating processes (the shim, and MPS where it runs),
not a wall: processes on one GPU see each other's memory footprint and timing, and a hostile one can
exceed its limit by means the shim does not see. So a fraction GPU holds the slices of one namespace
(its *tenant*) at a time; a GPU nobody holds goes to whichever namespace comes first, and is free for
any namespace again once its last fraction is released. A Node labelled
``cdmo.io/fraction-sharing=cross-namespace`` shares its fraction GPUs across namespaces, for clusters
whose teams trust each other. MIG instances are isolated in hardware and not concerned.

A GPU's tenants are the namespaces of every fraction binding the planner holds on it (a slice being
released while in use still holds its binding) and of every fraction its agent still reports there.

Pure: ``FractionGpu`` carries its tenants and whether its node shares; the planner filters with
``FractionGpu.may_take`` while packing, so best fit is chosen among the GPUs a namespace may use.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..requests.quantities import format_bytes
from ..requests.request import SliceRequest
from .fraction_planner import FractionGpu

SHARING_LABEL = "cdmo.io/fraction-sharing"
SHARING_VALUE = "cross-namespace"

# status.reason of a slice that waits because the fraction GPUs with room are held by other namespaces.
OTHER_NAMESPACE = "OtherNamespace"


def shares_across_namespaces(labels: Mapping[str, str] | None) -> bool:
    """Whether an admin labelled the Node ``cdmo.io/fraction-sharing=cross-namespace``."""
    return str((labels or {}).get(SHARING_LABEL, "")).strip() == SHARING_VALUE


def namespace_of(slice_ref: str) -> str | None:
    """The namespace of a ``<namespace>/<name>`` reference (as the agent reports a fraction), else None."""
    namespace, sep, name = slice_ref.partition("/")
    return namespace if sep and namespace and name else None


def other_namespace_message(request: SliceRequest, namespace: str, gpu: FractionGpu, need: int,
                            held_elsewhere: int) -> str:
    """Why a fraction waits for tenancy: the GPU that has room, who holds it, and the admin's way out.

    ``gpu`` is the one best fit would have chosen; ``held_elsewhere`` how many GPUs with room were
    left out for the same cause."""
    holders = ", ".join(sorted(gpu.tenants)[:3]) + (" ..." if len(gpu.tenants) > 3 else "")
    others = f" (and {held_elsewhere - 1} more GPU(s) like it)" if held_elsewhere > 1 else ""
    return (
        f"{request.describe()} of namespace {namespace} waits: GPU {gpu.index} of node {gpu.node} has "
        f"{format_bytes(gpu.free_bytes)} free for its {format_bytes(need)}, but serves fractions of namespace "
        f"{holders}{others}, and a GPU serving fractions serves one namespace at a time (a fraction's memory "
        f"limit is not isolation). It binds when a GPU frees up or a GPU of its own namespace has room; use a "
        f"MIG slice for isolation, or, if the namespaces trust each other, "
        f"kubectl label node {gpu.node} {SHARING_LABEL}={SHARING_VALUE}"
    )
