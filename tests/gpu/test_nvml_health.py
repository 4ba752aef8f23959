"""On a real GPU, ``NvmlBackend.health``: the Xid event set is made and drained without waiting, and a
working GPU is healthy. Read-only: nothing is injected, nothing changes on the GPU."""

from __future__ import annotations

import time

from mig_operator.core.node.health import HEALTHY


def test_a_working_gpu_is_healthy_and_reading_it_does_not_wait(gpu: str) -> None:
    from mig_operator.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        gpus = backend.gpus()
        assert gpus
        for info in gpus:
            started = time.monotonic()
            assert backend.health(info.index) == HEALTHY
            again = backend.health(info.index)  # the event set exists now: drained again, still healthy
            took = time.monotonic() - started
            assert again == HEALTHY
            print(f"GPU {info.index} {info.product}: two health reads in {took * 1000:.1f} ms")
    finally:
        backend.close()
