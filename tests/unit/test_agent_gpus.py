"""kube.agent.gpus.Gpus.read_all: every GPU's model and instances in one read, each call still measured."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from mig_operator.core.placement.profiles import get_model
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.gpus import Gpus


def _count(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _gpus(backend: SimulatedBackend) -> Gpus:
    gpus = Gpus(backend)
    asyncio.run(gpus.refresh())
    return gpus


def test_read_all_gives_each_gpus_model_and_instances_and_measures_each_call() -> None:
    backend = SimulatedBackend("h100-80gb", count=3)
    one_g = next(p for p in get_model("h100-80gb").profiles if p.name.startswith("1g."))
    made = backend.create_instance(0, one_g.id, 6)
    backend.set_mig_mode(2, False)  # MIG off: no instances to read
    gpus = _gpus(backend)
    before = {call: _count("mig_operator_nvml_call_seconds_count", {"call": call}) for call in ("model", "instances")}
    models, instances = asyncio.run(gpus.read_all())
    assert {i: m.name if m else None for i, m in models.items()} == {0: "h100-80gb", 1: "h100-80gb", 2: "h100-80gb"}
    assert [(i.gi_id, i.start, i.device_uuid) for i in instances[0]] == [(made.gi_id, 6, made.device_uuid)]
    assert instances[1] == [] and instances[2] == []
    after = {call: _count("mig_operator_nvml_call_seconds_count", {"call": call}) for call in ("model", "instances")}
    assert after["model"] - before["model"] == 3  # every MIG-capable GPU
    assert after["instances"] - before["instances"] == 2  # GPU 2 has MIG off: not asked


def test_a_gpu_without_mig_has_no_model_and_a_failed_read_is_counted() -> None:
    gpus = _gpus(SimulatedBackend("l4-24gb", count=1))
    models, instances = asyncio.run(gpus.read_all())
    assert models == {0: None} and instances == {0: []}

    backend = SimulatedBackend("a100-40gb", count=1)
    gpus = _gpus(backend)
    backend.inject_fault("instances", "GPU_IS_LOST")
    errors = _count("mig_operator_nvml_errors_total", {"call": "instances", "error": "GPU_IS_LOST"})
    with pytest.raises(GpuError):
        asyncio.run(gpus.read_all())
    assert _count("mig_operator_nvml_errors_total", {"call": "instances", "error": "GPU_IS_LOST"}) == errors + 1
