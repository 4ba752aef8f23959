"""GPU backends behind one protocol: real NVML and a faithful simulator.

``open_backend`` turns the ``--backend`` value of the CLI into a backend: ``nvml`` for the node's
real GPUs, ``sim:MODEL`` or ``sim:MODELxN`` for N simulated GPUs of a catalog model.
"""

from __future__ import annotations

import re

from mig_operator.core.profiles import CATALOG
from mig_operator.gpu.protocol import GpuBackend, GpuError, GpuInfo, MigInstance

__all__ = ["GpuBackend", "GpuError", "GpuInfo", "MigInstance", "open_backend"]

BACKEND_EXAMPLE = "sim:h200-141gbx2"
_COUNT_SUFFIX = re.compile(r"^(?P<model>.+)x(?P<count>[0-9]+)$")
_MAX_SIM_GPUS = 64


def open_backend(spec: str, state_file: str | None = None) -> GpuBackend:
    """The backend named by ``spec``: ``nvml``, ``sim:h200-141gb`` or ``sim:h200-141gbx2``.

    ``state_file`` applies to the simulator only (where it keeps its instances across restarts).
    A spec that names nothing known raises ValueError with a one-line message and an example.
    """
    if spec == "nvml":
        # Imported here so that the simulator and the controller run where pynvml or the driver is absent.
        from mig_operator.gpu.nvml import NvmlBackend

        return NvmlBackend()
    if not isinstance(spec, str) or not spec.startswith("sim:"):
        raise ValueError(f"backend {spec!r} is not 'nvml' or 'sim:MODEL[xN]'; e.g. {BACKEND_EXAMPLE!r}")
    model, count = spec[len("sim:"):], 1
    # The whole rest is tried as a model first, so a model whose name ends in x<digits> still works.
    match = _COUNT_SUFFIX.match(model)
    if model not in CATALOG and match is not None:
        model, count = match["model"], int(match["count"])
    if model not in CATALOG:
        raise ValueError(
            f"backend {spec!r} names unknown GPU model {model!r} (known: {', '.join(sorted(CATALOG))}); "
            f"e.g. {BACKEND_EXAMPLE!r}"
        )
    if not 1 <= count <= _MAX_SIM_GPUS:
        raise ValueError(
            f"backend {spec!r} asks for {count} GPUs, not 1..{_MAX_SIM_GPUS}; e.g. {BACKEND_EXAMPLE!r}"
        )
    from mig_operator.gpu.simulated import SimulatedBackend

    return SimulatedBackend(model, count=count, state_file=state_file)
