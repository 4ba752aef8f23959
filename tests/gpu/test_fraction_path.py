"""The fraction path on a real GPU: the node agent on NVML realises two fraction slices, and PyTorch
processes started with exactly the environment the controller writes into each pod's ConfigMap see
their limit, cannot allocate past it, and have their whole footprint read from outside through NVML.

The agent runs with its real NVML backend (read only: MIG stays as it is; a GPU with MIG disabled
serves fractions) and its real owner record; only the API server is an in-memory double here, since
the GPU machine runs no control plane (the e2e suite covers the API side on a real kube-apiserver).
Run with ``-s`` to see the figures; docs/fraction-gpu-run.md records one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FILL = Path(__file__).resolve().parent / "shim_workloads" / "fill.py"
GIB = 2**30
CHUNK_MIB = 16


class MemoryApi:
    """The few API calls the agent makes, answered from memory: what it writes is kept to be read."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0
        self.writes: list[tuple[str, str]] = []

    async def get(self, path: str, params: Any = None) -> dict:
        from mig_operator.kube.common.client import ApiError

        if path not in self.objects:
            raise ApiError(404, "Not Found", f"GET {path}: not found")
        return self.objects[path]

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list:
        return []

    async def merge_patch(self, path: str, body: dict) -> dict:
        self.version += 1
        self.writes.append(("PATCH", path))
        current = self.objects.setdefault(path, {"metadata": {}})
        for key, value in body.items():
            if isinstance(value, dict) and isinstance(current.get(key), dict):
                current[key] = {**current[key], **value}
            else:
                current[key] = value
        current["metadata"] = {**current.get("metadata", {}), "resourceVersion": str(self.version)}
        return current

    async def create(self, path: str, body: dict) -> dict:
        self.writes.append(("POST", path))
        return body

    async def json_patch(self, path: str, ops: list) -> dict:
        self.writes.append(("PATCH", path))
        return {}

    async def close(self) -> None:
        return None


def bound_fraction(name: str, gpu: int, granted: int) -> dict:
    """A GpuSlice as the controller leaves it for the agent: phase Bound, mode fraction."""
    return {
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "resourceVersion": "1",
                     "finalizers": ["cdmo.io/agent"], "labels": {"cdmo.io/node": "gpu-node"}},
        "spec": {"memory": str(granted)},
        "status": {"phase": "Bound", "mode": "fraction", "node": "gpu-node", "gpu": gpu, "grantedBytes": granted},
    }


def per_process_used(pid: int) -> int | None:
    """NVML's used memory of one process, over every GPU (None when NVML does not list it)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        total = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    total = (total or 0) + int(proc.usedGpuMemory)
        return total
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(scope="module")
def shim_library() -> Path:
    subprocess.run(["make", "-C", str(REPO / "shim")], check=True, capture_output=True)
    return REPO / "shim" / "libgpuslice.so"


def test_agent_realises_fractions_and_torch_holds_each_limit(gpu: str, shim_library: Path, tmp_path: Path) -> None:
    from mig_operator.core.environment import slice_environment
    from mig_operator.gpu import open_backend
    from mig_operator.kube.agent.agent import AgentSettings, NodeAgent
    from mig_operator.kube.agent.record import RecordStore
    from mig_operator.kube.common.client import slice_path
    from mig_operator.kube.common.events import EventPoster

    backend = open_backend("nvml")
    try:
        serving = [g for g in backend.gpus() if not g.mig_enabled]
        assert serving, f"every GPU here is in MIG mode; the fraction path needs one that is not:\n{gpu}"
        target = serving[0]
        api = MemoryApi()
        agent = NodeAgent(AgentSettings(node="gpu-node", publish_delay_s=0.0), backend,
                          RecordStore(str(tmp_path / "owners.json")), api,  # type: ignore[arg-type]
                          EventPoster(api, "test"))  # type: ignore[arg-type]
        slices = [bound_fraction("four", target.index, 4 * GIB), bound_fraction("eight", target.index, 8 * GIB)]

        async def realise() -> None:
            await agent.start()
            for body in slices:
                await agent.handle(body)
            await agent.publish()
            await agent.stop()

        asyncio.run(realise())
    finally:
        backend.close()

    inventory = api.objects["/apis/cdmo.io/v1alpha1/gpunodes/gpu-node/status"]["status"]
    published = next(g for g in inventory["gpus"] if g["index"] == target.index)
    assert published["serves"] == "fraction" and published["uuid"] == target.uuid
    assert sorted(f["bytes"] for f in published["fractions"]) == [4 * GIB, 8 * GIB]
    results = []
    for body in slices:
        meta = body["metadata"]
        st = api.objects[slice_path(meta["namespace"], meta["name"], status=True)]["status"]
        assert st["phase"] == "Ready" and st["deviceUUID"] == target.uuid and st["grantedBytes"] == \
            body["status"]["grantedBytes"]
        env = slice_environment(st.get("mode", "fraction"), st["deviceUUID"], st["grantedBytes"], meta["namespace"],
                                meta["name"], shim_path=str(shim_library))
        asked = {"four": 4 * GIB, "eight": 8 * GIB}[meta["name"]]
        assert env["NVIDIA_VISIBLE_DEVICES"] == target.uuid and env["CDMO_GPU_MEMORY_LIMIT"] == str(asked)
        # The container runtime turns NVIDIA_VISIBLE_DEVICES into the only visible GPU; outside a
        # container CUDA_VISIBLE_DEVICES does that.
        run_env = dict(os.environ, **env, CUDA_VISIBLE_DEVICES=target.uuid, CDMO_SHIM_DIR=str(tmp_path))
        limit = st["grantedBytes"]
        proc = subprocess.Popen([sys.executable, str(FILL), "torch", str(CHUNK_MIB), str(limit * 2 >> 20)],
                                env=run_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        free, total = ready["info"]["0"]["free"], ready["info"]["0"]["total"]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        done = json.loads(proc.stdout.readline())
        footprint = per_process_used(proc.pid)
        proc.stdin.close()
        proc.wait(60)
        got, oom = done["allocated"]["0"], done["error"]["0"]
        result = {"slice": meta["name"], "limit": limit, "mem_get_info_total": total, "mem_get_info_free": free,
                  "allocated": got, "oom": oom, "nvml_footprint": footprint}
        results.append(result)
        print(json.dumps(result))
        assert total == limit, "torch.cuda.mem_get_info() reports the slice's limit as the total"
        assert got <= limit and oom, "allocation stops with out-of-memory at the limit"
        assert got >= limit - 2 * GIB, "and gets close to it (the context and the allocator's slack aside)"
        assert footprint is not None and footprint <= limit, (
            f"NVML's footprint of the process ({footprint}) stays within its limit ({limit})")
    assert len(results) == 2
