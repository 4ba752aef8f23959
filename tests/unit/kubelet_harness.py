"""The kubelet plugin tests' node: an in-memory API server stand-in (the Node, GpuSlices and
ResourceClaims the agent reads and writes), and a real NodeAgent with its plugin on simulated GPUs,
restartable. The e2e tests use the real API server."""

from __future__ import annotations

import asyncio
import copy
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_events import event, settled  # noqa: F401 (the agent tests' helpers, here too)
from fake_kubelet import FakeKubelet

from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import NodeAgent
from mig_operator.kube.agent.context import AgentSettings
from mig_operator.kube.agent.kubelet.settings import PluginSettings
from mig_operator.kube.agent.kubelet.transport import KubeletPlugin
from mig_operator.kube.agent.record import RecordStore
from mig_operator.kube.common.client import ApiError

NODE = "node-a"
SLICES = "/apis/cdmo.io/v1alpha1"
CLAIMS = "/apis/resource.k8s.io/v1"
MIG_PROFILE_ID, MIG_PROFILE = 19, "1g.10gb"  # h100-80gb's smallest profile


class ApiStandIn:
    """Objects by path; just what NodeAgent and the plugin call. ``watch`` (the agent's ``saw``) is handed
    each slice written, soon after the write, as the agent's watch hands it."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {
            f"/api/v1/nodes/{NODE}": {"metadata": {"name": NODE, "uid": "node-uid-1", "labels": {}}},
        }
        self.version = 1
        self.watch: Callable[[dict], None] | None = None

    def _bump(self, path: str) -> dict:
        body = self.objects[path]
        self.version += 1
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        if self.watch is not None and "/gpuslices/" in path:
            asyncio.get_running_loop().call_soon(self.watch, copy.deepcopy(body))
        return copy.deepcopy(body)

    async def get(self, path: str, params: Any = None) -> dict:
        if path not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        return copy.deepcopy(self.objects[path])

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: Callable[[dict], dict] | None = None) -> list:
        if path.endswith("/resourceslices"):  # one node here: the field selector holds for all of them
            found = [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(f"{path}/")]
        else:
            found = [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(SLICES) and "/gpuslices/" in p]
        return found if keep is None else [keep(o) for o in found]

    async def merge_patch(self, path: str, body: dict) -> dict:
        target = path.removesuffix("/status")
        if target.startswith(f"{SLICES}/gpunodes"):
            return {"metadata": {"resourceVersion": "1"}}
        if target not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        self.objects[target].setdefault("status", {}).update(copy.deepcopy(body.get("status") or {}))
        return self._bump(target)

    async def json_patch(self, path: str, ops: list) -> dict:
        # Only the agent's finalizer removal: drop the finalizers the ops remove.
        body = self.objects[path]
        for op in ops:
            if op["op"] == "remove":
                body["metadata"]["finalizers"].pop(int(op["path"].rsplit("/", 1)[1]))
        return self._bump(path)

    async def create(self, path: str, body: dict) -> dict:
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "Conflict", "exists")
        self.objects[full] = copy.deepcopy(dict(body))
        return self._bump(full)

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict:
        assert method == "PUT"
        self.objects[path] = copy.deepcopy(body)
        return self._bump(path)

    async def delete(self, path: str) -> dict:
        return self.objects.pop(path)


class NoEvents:
    def post(self, *args: Any) -> None:
        pass

    async def drain(self) -> None:
        pass


def mig_slice(uid: str, name: str, start: int, phase: str = "Bound") -> dict:
    return {"metadata": {"uid": uid, "name": name, "namespace": "team", "resourceVersion": "1",
                         "finalizers": ["cdmo.io/agent"]},
            "status": {"phase": phase, "node": NODE, "gpu": 0, "mode": "mig", "grantedBytes": 10 * 2**30,
                       "profileId": MIG_PROFILE_ID, "profile": MIG_PROFILE, "placement": {"start": start, "size": 1}}}


def allocated_claim(uid: str, name: str, device: str, pool: str = NODE, namespace: str = "team",
                    owner: str | None = "") -> dict:
    """A claim allocated ``device``; controlled by the GpuSlice of UID ``owner`` ("": the device's
    slice, as the controller writes it; None: no owner)."""
    refs = [] if owner is None else [{"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": name,
                                      "uid": owner or device, "controller": True}]
    return {"metadata": {"uid": uid, "name": name, "namespace": namespace, "ownerReferences": refs},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.cdmo.io", "pool": pool, "device": device}]}}}}


class Node:
    """One simulated node: API stand-in, backend, record, agent and plugin, restartable."""

    def __init__(self, root: Path, model: str = "h100-80gb") -> None:
        self.root = root
        self.model = model
        self.api = ApiStandIn()
        self.settings = PluginSettings(registry_dir=str(root / "reg"), plugin_dir=str(root / "plug"),
                                       cdi_dir=str(root / "cdi"), shim_host_dir=str(root / "shim"),
                                       nvidia_cdi_dirs=(str(root / "etc-cdi"), str(root / "cdi")))
        (root / "reg").mkdir()
        self.agent: NodeAgent | None = None
        self.plugin: KubeletPlugin | None = None

    def backend(self) -> SimulatedBackend:
        return SimulatedBackend(self.model, count=1, state_file=str(self.root / "sim.json"), host=NODE)

    async def start(self) -> None:
        store = RecordStore(str(self.root / "owners.json"))
        self.agent = NodeAgent(AgentSettings(NODE, publish_delay_s=0.01, heartbeat_s=3600,
                                                 release_recheck_s=0.05), self.backend(), store,
                               self.api, NoEvents())  # type: ignore[arg-type]
        await self.agent.start()
        self.api.watch = self.agent.saw
        self.plugin = KubeletPlugin(self.agent, self.settings)
        assert await self.plugin.start()

    def kubelet(self, namespace: str = "team") -> FakeKubelet:
        """A kubelet (pods of ``namespace``) looking for the plugin where the kubelet finds it: the
        driver's registration socket in the plugins registry, spelt out here rather than taken from
        the plugin's settings."""
        return FakeKubelet(str(self.root / "reg" / "gpu.cdmo.io-reg.sock"), namespace=namespace)

    async def stop(self) -> None:
        assert self.plugin is not None and self.agent is not None
        await self.plugin.stop()
        await self.agent.stop()

    async def add_slice(self, body: dict) -> dict:
        path = f"{SLICES}/namespaces/team/gpuslices/{body['metadata']['name']}"
        self.api.objects[path] = body
        assert self.agent is not None
        await event(self.agent, copy.deepcopy(body))  # the watch then shows the agent's own writes
        return self.api.objects[path]

    def add_claim(self, body: dict) -> None:
        meta = body["metadata"]
        self.api.objects[f"{CLAIMS}/namespaces/{meta['namespace']}/resourceclaims/{meta['name']}"] = body

    def spec_path(self, slice_uid: str) -> Path:
        return self.root / "cdi" / f"gpu.cdmo.io-slice_{slice_uid}.json"


@pytest.fixture(name="root")
def root_fixture() -> Iterator[Path]:
    """A test's own directory (fixture ``root``)."""
    # Short: a unix socket path holds at most 107 bytes, and pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
