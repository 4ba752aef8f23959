"""GPU backends behind one protocol: real NVML and a faithful simulator.

``open_backend`` turns the ``--backend`` value of the CLI into a backend: ``nvml`` for the node's
real GPUs, ``sim:MODEL`` or ``sim:MODELxN`` for N simulated GPUs of a catalog model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mig_operator.core.placement.profiles import CATALOG
from mig_operator.core.requests.quantities import clip_repr, clip_text
from mig_operator.gpu.protocol import GpuBackend, GpuError, GpuInfo, MigInstance

__all__ = ["GpuBackend", "GpuError", "GpuInfo", "MigInstance", "open_backend"]

BACKEND_EXAMPLE = "sim:h200-141gbx2"
_COUNT_SUFFIX = re.compile(r"(?P<model>.+)x(?P<count>[0-9]+)", re.ASCII)
_MAX_SIM_GPUS = 64


def open_backend(
    spec: str, state_file: str | None = None, latency_s: float | Mapping[str, float] | None = None,
    host: str = "",
) -> GpuBackend:
    """The backend named by ``spec``: ``nvml``, ``sim:h200-141gb``, ``sim:h200-141gbx2``, ``sim:l4-24gbx2``.

    ``state_file`` and ``latency_s`` apply to the simulator only (where it keeps its instances, faults
    and latency across restarts and processes; ``latency_s`` None keeps the state file's); ``host``
    names a simulated node, so that its GPUs get UUIDs of their own.
    A spec, state file or latency that cannot be used raises ValueError with a one-line message and
    an example.
    """
    if spec == "nvml":
        # Imported here so that the simulator and the controller run where pynvml or the driver is absent.
        from mig_operator.gpu.nvml import NvmlBackend

        return NvmlBackend()
    shown = clip_repr(spec)
    if not isinstance(spec, str) or not spec.startswith("sim:"):
        raise ValueError(f"backend {shown} is not 'nvml' or 'sim:MODEL[xN]'; e.g. {BACKEND_EXAMPLE!r}")
    model, digits = spec[len("sim:"):], "1"
    # The whole rest is tried as a model first, so a model whose name ends in x<digits> still works.
    match = _COUNT_SUFFIX.fullmatch(model)
    if model not in CATALOG and match is not None:
        model, digits = match["model"], match["count"]
    if model not in CATALOG:
        raise ValueError(
            f"backend {shown} names unknown GPU model {clip_repr(model, 40)} (known: {', '.join(sorted(CATALOG))}); "
            f"e.g. {BACKEND_EXAMPLE!r}"
        )
    # Judged as text first: int() refuses more than 4300 digits.
    count = int(digits) if len(digits) <= 6 else _MAX_SIM_GPUS + 1
    if not 1 <= count <= _MAX_SIM_GPUS:
        raise ValueError(
            f"backend {shown} asks for {clip_text(digits)} GPUs, not 1..{_MAX_SIM_GPUS}; e.g. {BACKEND_EXAMPLE!r}"
        )
    from mig_operator.gpu.simulated import SimulatedBackend

    return SimulatedBackend(model, count=count, state_file=state_file, latency_s=latency_s, host=host)
