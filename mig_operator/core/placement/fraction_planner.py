"""Fractions: memory bin-packing on GPUs without MIG (best fit), one namespace per GPU unless its node
shares across namespaces (``core.placement.tenancy``), and compute as a second dimension (``core.placement.compute``):
the shares on one GPU sum to at most 1, and a GPU serves shares or shared fractions, not both."""

from __future__ import annotations

from dataclasses import dataclass

from ..requests.quantities import MIB, format_bytes
from ..requests.request import MIN_SLICE_BYTES, SliceRequest
from .compute import SHARED, GpuCompute, resolve_compute
from .planner import Unplaceable


@dataclass(frozen=True)
class FractionGpu:
    """A GPU shared by fractions: its memory and what slices were granted on it."""

    node: str
    index: int
    memory_bytes: int
    granted_bytes: int = 0
    # Namespaces whose fractions it holds, and whether its node shares across namespaces (core.placement.tenancy).
    tenants: frozenset[str] = frozenset()
    shared: bool = False
    compute: GpuCompute = GpuCompute()

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.granted_bytes

    def may_take(self, namespace: str) -> bool:
        """Whether a fraction of ``namespace`` may go here (core.placement.tenancy): the node shares across
        namespaces, or no other namespace holds the GPU."""
        tenants = self.tenants
        return not tenants or self.shared or (len(tenants) == 1 and namespace in tenants)

    def added_charge(self, namespace: str, need: int) -> int:
        """What a fraction of ``need`` bytes here adds to ``namespace``'s quota charge (core.books.charges):
        nothing on a GPU it holds alone already, the GPU's whole memory on one it would take alone, its
        own bytes on a node that shares across namespaces."""
        if self.shared:
            return need
        return 0 if namespace in self.tenants else self.memory_bytes

    def named_for(self, namespace: str | None) -> str:
        """The GPU as a refusal to ``namespace`` may name it: by node and index when no other namespace
        holds fractions there, else without naming it (core.placement.tenancy). None: words the same for every
        namespace, naming only a GPU nobody holds."""
        if self.tenants and namespace is None:
            return "one GPU"
        if self.tenants - {namespace}:
            return "a GPU that serves another namespace"
        return f"GPU {self.index} of node {self.node}"


@dataclass(frozen=True)
class FractionDecision:
    node: str
    gpu: int
    granted_bytes: int
    compute: float | None = None  # the share resolved for that GPU (core.placement.compute); None: shared


def fraction_bytes(request: SliceRequest, gpu_memory_bytes: int) -> int:
    """Bytes a fraction-mode request needs on a GPU of this size."""
    if request.memory_bytes is not None:
        return request.memory_bytes
    if request.fraction is not None:
        # Whole MiB, rounded down, so fraction 1.0 is exactly the GPU and 0.5 + 0.5 fit.
        return int(request.fraction * gpu_memory_bytes) // MIB * MIB
    raise Unplaceable(f"migProfile {request.profile} needs a MIG node; this node shares GPUs by fractions")


def choose_fraction(request: SliceRequest, gpus: list[FractionGpu], namespace: str | None = None,
                    default_compute: str = SHARED, compute_kind: bool = True) -> FractionDecision:
    """Memory bin-packing: with ``namespace``, among the GPUs it may take (``FractionGpu.may_take``),
    the one that adds least to its quota charge first (``FractionGpu.added_charge``: a GPU it holds
    already before one it would take whole); then the GPU with the least free memory that still fits
    (best fit), then the least compute left.
    The request's compute share on each GPU is ``core.placement.compute.resolve_compute`` with
    ``default_compute``; a GPU must have room for it, and, with ``compute_kind``, serve its kind
    (shares or shared).

    A GPU on which a fraction's grant would be less than ``MIN_SLICE_BYTES`` (a small share of a small
    GPU) is never chosen: the CUDA context alone would fill such a slice. Memory requests below it are
    refused at admission (``slice_spec.check_floor``), not here, so ``plan`` traces may use any size.
    """
    if not gpus:
        raise Unplaceable("no GPU is available for fractions")
    best: tuple[tuple, FractionGpu, int, float | None] | None = None
    large_enough = []
    short: tuple[FractionGpu, float | None] | None = None  # best fit by memory that compute kept out
    for gpu in gpus:
        need = fraction_bytes(request, gpu.memory_bytes)
        if request.fraction is not None and need < MIN_SLICE_BYTES:
            continue
        large_enough.append(gpu)
        if need > gpu.free_bytes or (namespace is not None and gpu.tenants and not gpu.may_take(namespace)):
            continue
        share = resolve_compute(request.compute, need, gpu.memory_bytes, default_compute)
        if not gpu.compute.has_room(share) or (compute_kind and gpu.compute.conflicts(share)):
            if short is None or (gpu.free_bytes, gpu.node, gpu.index) < (short[0].free_bytes, short[0].node,
                                                                          short[0].index):
                short = (gpu, share)
            continue
        # Then the least compute left (the same order as what would be left after it, for one share).
        added = gpu.added_charge(namespace, need) if namespace is not None else 0
        key = (added, gpu.free_bytes - need, gpu.compute.left_approx if share is not None else 0.0, gpu.node, gpu.index)
        if best is None or key < best[0]:
            best = (key, gpu, need, share)
    if best is None and short is not None:
        gpu, share = short
        raise Unplaceable(f"{gpu.named_for(namespace)} has {format_bytes(gpu.free_bytes)} free for "
                          f"{request.describe()}, but {gpu.compute.why_not(share)}")
    if best is None:
        largest = max(gpus, key=lambda g: g.memory_bytes)
        need = fraction_bytes(request, largest.memory_bytes)
        if not large_enough:
            raise Unplaceable(
                f"{request.describe()} comes to {format_bytes(need)} even on the largest GPU "
                f"({format_bytes(largest.memory_bytes)}), below the smallest slice, {format_bytes(MIN_SLICE_BYTES)}"
            )
        if need > largest.memory_bytes:
            raise Unplaceable(
                f"{request.describe()} is larger than any GPU (largest: {format_bytes(largest.memory_bytes)})"
            )
        raise Unplaceable(f"every GPU is held by slices in use: none has {format_bytes(need)} free")
    return FractionDecision(best[1].node, best[1].index, best[2], best[3])
