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

Pure: ``FractionGpu`` (core.placement.fraction_planner) carries its tenants and whether its node shares; the
planner filters with ``FractionGpu.may_take`` while packing, so best fit is chosen among the GPUs a
namespace may use, those it holds already first (``FractionGpu.added_charge``). A namespace pays for
what it denies others: its GpuQuota is charged a GPU it holds alone whole (``core.books.charges``). Refusals
name no other namespace, nor its node or GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..requests.quantities import format_bytes
from ..requests.request import SliceRequest

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


def other_namespace_message(request: SliceRequest, namespace: str, need: int) -> str:
    """Why a fraction waits for tenancy, and the ways out. It names no other namespace, node or GPU:
    a namespace's refusals tell it nothing of what another holds."""
    return (
        f"{request.describe()} of namespace {namespace} waits: every fraction GPU with room for its "
        f"{format_bytes(need)} is held by another namespace, and a GPU serving fractions serves one namespace "
        f"at a time (a fraction's memory limit is not isolation). It binds when a GPU frees up or a GPU of "
        f"its own namespace has room; use a MIG slice for isolation, or, if the namespaces trust each other, "
        f"an admin labels nodes {SHARING_LABEL}={SHARING_VALUE}"
    )


def whole_gpu_note(taken: Sequence[tuple[tuple[str, int], int]]) -> str:
    """Why a charge is a GPU's whole memory (``core.books.charges``): the GPUs of its own namespace a binding
    would hold whole, named, and the rule."""
    if not taken:
        return ""
    (node, index), memory = taken[0]
    more = f" and {len(taken) - 1} more GPU(s)" if len(taken) > 1 else ""
    return (
        f" (GPU {index} of node {node}{more} would serve this namespace's fractions alone, by the fraction "
        f"tenancy rule of one namespace per fraction GPU, so the namespace is charged its whole memory, "
        f"{format_bytes(memory)}, once however many of its fractions are there; a MIG slice, or a fraction on a "
        f"node labelled {SHARING_LABEL}={SHARING_VALUE}, is charged its grant alone)"
    )
