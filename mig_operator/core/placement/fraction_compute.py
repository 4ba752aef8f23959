"""Which compute a fraction GPU serves: compute shares through MPS, or shared fractions, not both.

A GPU serving compute shares runs NVIDIA's MPS server for them; a shared fraction's process on the
same GPU would not be an MPS client and would time-slice against the server, so the shares promised
would no longer hold. So, as with tenancy (``core.placement.tenancy``), a fraction GPU takes whichever kind
comes first and is free for either again once its last fraction is released. A fraction whose
compute is a share goes only to a GPU whose shares leave room for it (they sum to at most 1, compared
exactly: ``core.placement.compute``).

Pure: ``FractionGpu.compute`` (``core.placement.compute.GpuCompute``) carries what is given out, from the
bindings and what the agent still holds (``core.placement.cluster.fraction_compute``); the planner packs with
it (``core.placement.fraction_planner``) and, when only GPUs of the other kind have room, refuses with
``COMPUTE_MODE`` and this module's message.
"""

from __future__ import annotations

from ..requests.request import SliceRequest
from .compute import resolve_compute
from .fraction_planner import FractionGpu, Unplaceable, choose_fraction, fraction_bytes

# status.reason of a slice that waits because the fraction GPUs with room serve the other kind of
# compute (shares through MPS, or shared fractions).
COMPUTE_MODE = "ComputeMode"
# Why a request with compute waits where only MIG GPUs are.
COMPUTE_ONLY_FRACTIONS = " (a compute share is served to fractions only: a MIG slice's compute is its profile's)"


def compute_mode_message(request: SliceRequest, gpus: list[FractionGpu], default_compute: str,
                         namespace: str | None = None) -> str | None:
    """When a GPU ``gpus`` holds would have room for the request but serves the other kind of compute,
    why it waits, naming that GPU (the one best fit would have chosen) where no other namespace than
    ``namespace`` holds it (``FractionGpu.named_for``); None otherwise."""
    try:
        chosen = choose_fraction(request, gpus, default_compute=default_compute, compute_kind=False)
    except Unplaceable:
        return None
    gpu = next(g for g in gpus if (g.node, g.index) == (chosen.node, chosen.gpu))
    share = resolve_compute(request.compute, fraction_bytes(request, gpu.memory_bytes), gpu.memory_bytes,
                            default_compute)
    if not gpu.compute.conflicts(share):
        return None
    return (
        f"{request.describe()} waits: {gpu.named_for(namespace)} has room for it but "
        f"{gpu.compute.why_not(share)}. It binds when a GPU serving its kind has room or a GPU is free; "
        f"a GPU serves compute shares or shared fractions, whichever came first, until its last fraction goes"
    )
