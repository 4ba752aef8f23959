"""The agent's kubelet plugin driven as the kubelet drives it: over the real unix sockets, with the
kubelet's own protos (the vendored stubs), against a real NodeAgent on simulated GPUs.

The API server here is an in-memory stand-in holding the few objects the agent reads and writes
(the Node, GpuSlices, ResourceClaims); the e2e tests use the real one.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_kubelet import FakeKubelet

from mig_operator.core.cdi import SliceDevice, slice_spec
from mig_operator.core.lifecycle import idle_instances
from mig_operator.gpu.device_files import device_nodes, simulated_cap_minor
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.agent import AgentSettings, NodeAgent
from mig_operator.kube.agent.inventory import instance_state
from mig_operator.kube.agent.kubelet_plugin import KubeletPlugin, PluginSettings
from mig_operator.kube.agent.record import RecordStore
from mig_operator.kube.common.client import ApiError

NODE = "node-a"
SLICES = "/apis/cdmo.io/v1alpha1"
CLAIMS = "/apis/resource.k8s.io/v1"
MIG_PROFILE_ID, MIG_PROFILE = 19, "1g.10gb"  # h100-80gb's smallest profile


class ApiStandIn:
    """Objects by path; just what NodeAgent and the plugin call."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {
            f"/api/v1/nodes/{NODE}": {"metadata": {"name": NODE, "uid": "node-uid-1", "labels": {}}},
        }
        self.version = 1

    def _bump(self, body: dict) -> dict:
        self.version += 1
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return copy.deepcopy(body)

    async def get(self, path: str, params: Any = None) -> dict:
        if path not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        return copy.deepcopy(self.objects[path])

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list:
        if path.endswith("/resourceslices"):  # one node here: the field selector holds for all of them
            return [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(f"{path}/")]
        return [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(SLICES) and "/gpuslices/" in p]

    async def merge_patch(self, path: str, body: dict) -> dict:
        target = path.removesuffix("/status")
        if target.startswith(f"{SLICES}/gpunodes"):
            return {"metadata": {"resourceVersion": "1"}}
        if target not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        self.objects[target].setdefault("status", {}).update(copy.deepcopy(body.get("status") or {}))
        return self._bump(self.objects[target])

    async def json_patch(self, path: str, ops: list) -> dict:
        # Only the agent's finalizer removal: drop the finalizers the ops remove.
        body = self.objects[path]
        for op in ops:
            if op["op"] == "remove":
                body["metadata"]["finalizers"].pop(int(op["path"].rsplit("/", 1)[1]))
        return self._bump(body)

    async def create(self, path: str, body: dict) -> dict:
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "Conflict", "exists")
        self.objects[full] = copy.deepcopy(dict(body))
        return self._bump(self.objects[full])

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict:
        assert method == "PUT"
        self.objects[path] = copy.deepcopy(body)
        return self._bump(self.objects[path])

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
        self.plugin = KubeletPlugin(self.agent, self.settings)
        assert await self.plugin.start()

    async def stop(self) -> None:
        assert self.plugin is not None and self.agent is not None
        await self.plugin.stop()
        await self.agent.stop()

    async def add_slice(self, body: dict) -> dict:
        path = f"{SLICES}/namespaces/team/gpuslices/{body['metadata']['name']}"
        self.api.objects[path] = body
        assert self.agent is not None
        await self.agent.handle(copy.deepcopy(body))
        # The watch then shows the agent's own Ready write.
        await self.agent.handle(copy.deepcopy(self.api.objects[path]))
        return self.api.objects[path]

    def add_claim(self, body: dict) -> None:
        meta = body["metadata"]
        self.api.objects[f"{CLAIMS}/namespaces/{meta['namespace']}/resourceclaims/{meta['name']}"] = body

    def spec_path(self, slice_uid: str) -> Path:
        return self.root / "cdi" / f"gpu.cdmo.io-slice_{slice_uid}.json"


@pytest.fixture
def root() -> Iterator[Path]:
    # Short: a unix socket path holds at most 107 bytes, and pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_registration_prepare_unprepare_repeated(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            info = await kubelet.register()
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
                ("DRAPlugin", "gpu.cdmo.io", str(root / "plug" / "dra.sock"), ["v1.DRAPlugin"])
            assert node.plugin is not None and node.plugin.registration.registered.is_set()
            # The kubelet deletes its node's ResourceSlices when it starts; registering writes it again.
            resource_slice = f"{CLAIMS}/resourceslices/{NODE}-gpu.cdmo.io"
            await asyncio.sleep(0.1)
            del node.api.objects[resource_slice]
            await kubelet.register()
            await asyncio.sleep(0.1)
            assert node.api.objects[resource_slice]["spec"]["nodeName"] == NODE

            await node.add_slice(mig_slice("s-1", "train", 0))
            node.add_claim(allocated_claim("c-1", "train", "s-1"))
            first = await kubelet.prepare(("c-1", "train"))
            assert first.claims["c-1"].error == ""
            [device] = first.claims["c-1"].devices
            assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids)) \
                == (["gpu"], NODE, "s-1", ["gpu.cdmo.io/slice=s-1"])

            # The spec names the instance's own capability files, as the driver numbers them.
            inst = node.backend().instances(0)[0]
            spec = json.loads(node.spec_path("s-1").read_text())
            expected = slice_spec(SliceDevice("s-1", "team", "train", "mig", inst.device_uuid, 10 * 2**30,
                                              tuple(device_nodes(str(root / "sim.json.devices"), 0, inst.gi_id, 0)),
                                              str(root / "shim"), str(root / "ledgers")))
            assert spec == expected
            assert not (root / "ledgers").exists()  # a MIG slice has no shim, so no ledger
            paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            assert paths[-2:] == [f"/dev/nvidia-caps/nvidia-cap{simulated_cap_minor(0, inst.gi_id)}",
                                  f"/dev/nvidia-caps/nvidia-cap{simulated_cap_minor(0, inst.gi_id, 0)}"]
            assert stat.S_IMODE(os.stat(node.spec_path("s-1")).st_mode) == 0o644
            assert [p.name for p in (root / "cdi").iterdir()] == ["gpu.cdmo.io-slice_s-1.json"]  # no temp file left

            again = await kubelet.prepare(("c-1", "train"))
            assert again == first  # idempotent
            assert json.loads((root / "owners.json").read_text())["preparedClaims"] == {
                "c-1": {"namespace": "team", "name": "train", "sliceUID": "s-1"}}

            gone = await kubelet.unprepare(("c-1", "train"))
            assert gone.claims["c-1"].error == "" and "c-1" in gone.claims
            assert not node.spec_path("s-1").exists()
            twice = await kubelet.unprepare(("c-1", "train"))
            assert twice.claims["c-1"].error == ""
            assert json.loads((root / "owners.json").read_text())["preparedClaims"] == {}
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def fraction_slice(uid: str, name: str, granted: int) -> dict:
    return {"metadata": {"uid": uid, "name": name, "namespace": "team", "resourceVersion": "1",
                         "finalizers": ["cdmo.io/agent"]},
            "status": {"phase": "Bound", "node": NODE, "gpu": 0, "mode": "fraction", "grantedBytes": granted}}


@pytest.mark.parametrize(("granted", "shim"), [(46068 * 2**20, False), (46068 * 2**20 - 2**20, True),
                                               (23034 * 2**20, True)])
def test_a_fraction_that_is_its_whole_gpu_gets_no_shim(root: Path, granted: int, shim: bool) -> None:
    """A whole GPU without MIG (fraction 1: all of the L40S's 46068 MiB) has nothing to limit; one MiB
    less is a share, limited by the shim."""
    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-1", "job", granted))
            node.add_claim(allocated_claim("c-1", "job", "f-1"))
            assert (await kubelet.prepare(("c-1", "job"))).claims["c-1"].error == ""
            edits = json.loads(node.spec_path("f-1").read_text())["devices"][0]["containerEdits"]
            preload = [e for e in edits["env"] if e.startswith(("LD_PRELOAD=", "CDMO_GPU_MEMORY_LIMIT="))]
            assert bool(preload) is shim and ("mounts" in edits) is shim
            if shim:
                assert f"CDMO_GPU_MEMORY_LIMIT={granted}" in edits["env"]
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_fraction_claim_gets_its_own_ledger_directory_until_unprepared(root: Path) -> None:
    """Issue 24: the shim's ledger is a directory per slice beside the shim's on the node, mounted at
    one fixed path into every container of every pod of the claim; it lives from prepare to unprepare,
    survives the kubelet asking again and an agent restart, and one no prepared claim names goes."""
    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        ledger = root / "ledgers" / "f-1"
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-1", "job", 8 * 2**30))
            node.add_claim(allocated_claim("c-1", "job", "f-1"))
            assert (await kubelet.prepare(("c-1", "job"))).claims["c-1"].error == ""
            assert ledger.is_dir() and stat.S_IMODE(ledger.stat().st_mode) == 0o1777  # any uid, sticky
            mounts = json.loads(node.spec_path("f-1").read_text())["devices"][0]["containerEdits"]["mounts"]
            assert mounts[1] == {"hostPath": str(ledger), "containerPath": "/run/cdmo/ledger",
                                 "options": ["rw", "nosuid", "nodev", "noexec", "bind"]}
            (ledger / "gpu-0123").write_text("in use")  # a process of the pod holds memory in it
            assert (await kubelet.prepare(("c-1", "job"))).claims["c-1"].error == ""
            assert (ledger / "gpu-0123").read_text() == "in use"  # asked again: kept as it is

            await kubelet.close()
            await node.stop()
            (root / "ledgers" / "gone-slice").mkdir()  # left by a claim unprepared while the agent was down
            await node.start()
            kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
            await kubelet.register()
            assert (ledger / "gpu-0123").exists() and not (root / "ledgers" / "gone-slice").exists()

            assert (await kubelet.unprepare(("c-1", "job"))).claims["c-1"].error == ""
            assert not ledger.exists()
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_a_ledger_path_that_is_not_a_directory_refuses_the_claim(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-1", "job", 8 * 2**30))
            node.add_claim(allocated_claim("c-1", "job", "f-1"))
            (root / "ledgers").mkdir()
            (root / "ledgers" / "f-1").symlink_to(root / "cdi")
            error = (await kubelet.prepare(("c-1", "job"))).claims["c-1"].error
            assert "f-1 is not a directory" in error, error
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_the_ledger_directories_sit_beside_the_shims() -> None:
    assert PluginSettings().ledger_host_dir == "/var/lib/mig-operator/ledgers"
    assert PluginSettings(shim_host_dir="/opt/cdmo/shim/").ledger_host_dir == "/opt/cdmo/ledgers"


def test_refuses_what_is_not_a_ready_slice_of_this_node(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            await node.add_slice(mig_slice("s-1", "train", 0))
            node.add_claim(allocated_claim("c-other", "elsewhere", "s-1", pool="node-b"))
            node.add_claim(allocated_claim("c-unknown", "unknown", "s-404"))
            node.add_claim(allocated_claim("c-pending", "pending", "s-2"))
            node.add_claim({"metadata": {"uid": "c-none", "name": "none", "namespace": "team"}, "status": {}})
            node.add_claim(allocated_claim("c-new", "recreated", "s-1"))
            # A slice bound here but not Ready: the agent has not realised it.
            node.api.objects[f"{SLICES}/namespaces/team/gpuslices/pending"] = mig_slice("s-2", "pending", 1)
            answer = await kubelet.prepare(("c-other", "elsewhere"), ("c-unknown", "unknown"),
                                           ("c-pending", "pending"), ("c-none", "none"), ("c-old", "recreated"),
                                           ("c-missing", "missing"))
            errors = {uid: r.error for uid, r in answer.claims.items()}
            assert "ResourceClaim team/elsewhere" in errors["c-other"]
            assert "device gpu.cdmo.io/node-b/s-1 is in pool 'node-b', not this node's (node-a)" in errors["c-other"]
            assert "device gpu.cdmo.io/node-a/s-404 is not a slice Ready on node node-a" in errors["c-unknown"]
            assert "device gpu.cdmo.io/node-a/s-2 is not a slice Ready on node node-a" in errors["c-pending"]
            assert "has no device of driver gpu.cdmo.io allocated" in errors["c-none"]
            assert "has uid c-new, another claim" in errors["c-old"]
            assert "team/missing (uid c-missing) does not exist" in errors["c-missing"]
            assert all(not r.devices for r in answer.claims.values())
            assert not node.spec_path("s-1").exists() and not node.spec_path("s-2").exists()

            # One device, one claim: the slice's claim made again (a new UID) while the old one is
            # still prepared is refused until the kubelet unprepares the old one.
            node.add_claim(allocated_claim("c-1", "train", "s-1"))
            assert (await kubelet.prepare(("c-1", "train"))).claims["c-1"].error == ""
            node.add_claim(allocated_claim("c-2", "train", "s-1"))
            second = await kubelet.prepare(("c-2", "train"))
            assert "is already prepared for ResourceClaim team/train (uid c-1)" in second.claims["c-2"].error
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_only_the_slices_own_claim_is_prepared(root: Path) -> None:
    """Issue 24: kube-scheduler allocates a device to any claim whose selector matches it (another
    namespace's, allocationMode All); the agent prepares only the claim of the slice's namespace and
    name that the slice controls, and the victim's own claim still works afterwards."""
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        tenant = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        thief = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"), namespace="team-b")
        try:
            await tenant.register()
            await thief.register()
            await node.add_slice(mig_slice("s-1", "train", 0))
            # Another namespace: a claim of its own, one named like the slice, one forging the owner.
            node.add_claim(allocated_claim("c-steal", "steal", "s-1", namespace="team-b", owner=None))
            node.add_claim(allocated_claim("c-same-name", "train", "s-1", namespace="team-b"))
            # The slice's namespace: another name, no controller, another slice as controller.
            node.add_claim(allocated_claim("c-other-name", "copy", "s-1"))
            stolen = await thief.prepare(("c-steal", "steal"), ("c-same-name", "train"))
            copied = await tenant.prepare(("c-other-name", "copy"))
            errors = {uid: r.error for answer in (stolen, copied) for uid, r in answer.claims.items()}
            mine = "belongs to GpuSlice team/train (uid s-1) and is prepared only for that slice's own " \
                   "ResourceClaim team/train"
            assert errors["c-steal"].startswith(
                "ResourceClaim team-b/steal (uid c-steal): device gpu.cdmo.io/node-a/s-1 " + mine)
            assert "this is ResourceClaim team-b/steal" in errors["c-steal"]
            assert errors["c-same-name"].startswith(
                "ResourceClaim team-b/train (uid c-same-name): device gpu.cdmo.io/node-a/s-1 " + mine)
            assert errors["c-other-name"].startswith(
                "ResourceClaim team/copy (uid c-other-name): device gpu.cdmo.io/node-a/s-1 " + mine)
            for uid, owner in (("c-loose", None), ("c-forged", "s-other")):
                body = allocated_claim(uid, "train", "s-1", owner=owner)
                if owner is None:
                    body["metadata"]["ownerReferences"] = [{"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
                                                            "name": "train", "uid": "s-1"}]  # not controller
                node.add_claim(body)
                errors[uid] = (await tenant.prepare((uid, "train"))).claims[uid].error
            assert "ResourceClaim team/train is not controlled by a GpuSlice" in errors["c-loose"]
            assert "ResourceClaim team/train is controlled by GpuSlice UID s-other, not by this slice" \
                in errors["c-forged"]
            assert all(mine in e for e in errors.values()), errors
            assert not node.spec_path("s-1").exists()
            assert node.agent is not None and not node.agent.store.prepared

            # The slice's own claim, after all that: prepared (not "already prepared" for a thief).
            node.add_claim(allocated_claim("c-1", "train", "s-1"))
            answer = await tenant.prepare(("c-1", "train"))
            assert answer.claims["c-1"].error == ""
            assert list(answer.claims["c-1"].devices[0].cdi_device_ids) == ["gpu.cdmo.io/slice=s-1"]
        finally:
            await tenant.close()
            await thief.close()
            await node.stop()

    asyncio.run(scenario())


def test_nvidia_toolkit_spec_adds_its_device_id(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            await node.add_slice(mig_slice("s-1", "train", 0))
            uuid = node.backend().instances(0)[0].device_uuid
            (root / "etc-cdi").mkdir()
            (root / "etc-cdi" / "nvidia.yaml").write_text(
                f"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n- name: {uuid}\n"
                "containerEdits: {}\n")
            (root / "etc-cdi" / "broken.json").write_text("{not json")
            node.add_claim(allocated_claim("c-1", "train", "s-1"))
            answer = await kubelet.prepare(("c-1", "train"))
            assert list(answer.claims["c-1"].devices[0].cdi_device_ids) == \
                ["gpu.cdmo.io/slice=s-1", f"nvidia.com/gpu={uuid}"]
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_prepared_claim_survives_a_restart_and_holds_a_deleted_slices_instance(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            body = await node.add_slice(mig_slice("s-1", "train", 0))
            node.add_claim(allocated_claim("c-1", "train", "s-1"))
            prepared = await kubelet.prepare(("c-1", "train"))
            assert prepared.claims["c-1"].error == ""
            slice_in_api = f"{SLICES}/namespaces/team/gpuslices/train"
            await asyncio.sleep(0.1)  # the coalesced publish
            assert [d["name"] for d in node.api.objects[f"{CLAIMS}/resourceslices/{NODE}-gpu.cdmo.io"]["spec"]
                    ["devices"]] == ["s-1"]

            # The slice is deleted while the pod runs: its instance stays held, offered to nobody.
            deleting = copy.deepcopy(body)
            deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            assert node.agent is not None
            await node.agent.handle(deleting)
            del node.api.objects[slice_in_api]
            await node.agent.deleted(deleting)
            record = node.agent.store.record
            assert "s-1" in record.owners and "s-1" in node.agent.store.revoked
            assert idle_instances(record, 0, [instance_state(i) for i in node.backend().instances(0)]) == []
            await asyncio.sleep(0.1)  # the coalesced publish
            assert node.api.objects[f"{CLAIMS}/resourceslices/{NODE}-gpu.cdmo.io"]["spec"]["devices"] == []

            # The agent restarts (new servers, the same record): still held, and the kubelet's calls work.
            await kubelet.close()
            await node.stop()
            await node.start()
            kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
            await kubelet.register()
            assert node.agent.store.prepared.keys() == {"c-1"} and "s-1" in node.agent.store.revoked
            assert "s-1" in node.agent.store.record.owners
            again = await kubelet.prepare(("c-1", "train"))  # the kubelet may ask again: same answer
            assert again == prepared

            await kubelet.unprepare(("c-1", "train"))
            assert not node.spec_path("s-1").exists()
            record = node.agent.store.record
            uuid = node.backend().instances(0)[0].device_uuid
            assert "s-1" not in record.owners and uuid in record.idle_since  # idle now, reusable
            assert not node.agent.store.revoked
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def owned_claim(uid: str, name: str, device: str, slice_uid: str, pods: list[str]) -> dict:
    body = allocated_claim(uid, name, device)
    body["metadata"]["ownerReferences"] = [{"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": name,
                                            "uid": slice_uid, "controller": True}]
    body["status"]["reservedFor"] = [{"resource": "pods", "name": p, "uid": f"pod-{p}"} for p in pods]
    return body


def test_a_deleted_slice_in_use_keeps_its_finalizer_and_device_until_its_claim_is_free(root: Path) -> None:
    """Issue 24: the agent removed its finalizer while a claim was prepared, so the slice, its binding
    and its quota charge vanished while the pod kept the device. Now it is kept, saying who holds it,
    until the kubelet unprepares the claim and the claim's reservation is gone."""
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            await node.add_slice(mig_slice("s-1", "train", 0))
            claim_path = f"{CLAIMS}/namespaces/team/resourceclaims/train"
            node.add_claim(owned_claim("c-1", "train", "s-1", "s-1", ["trainer"]))
            assert (await kubelet.prepare(("c-1", "train"))).claims["c-1"].error == ""
            slice_in_api = f"{SLICES}/namespaces/team/gpuslices/train"
            uuid = node.backend().instances(0)[0].device_uuid
            assert node.agent is not None

            def released() -> dict | None:
                conds = node.api.objects[slice_in_api]["status"].get("conditions") or []
                return next((c for c in conds if c["type"] == "Released"), None)

            deleting = copy.deepcopy(node.api.objects[slice_in_api])
            deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            node.api.objects[slice_in_api]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            await node.agent.handle(deleting)
            kept = node.api.objects[slice_in_api]
            assert kept["metadata"]["finalizers"] == ["cdmo.io/agent"]
            cond = released()
            assert cond is not None and (cond["status"], cond["reason"]) == ("False", "InUse")
            assert "pod team/trainer" in cond["message"] and f"prepared on node {NODE}" in cond["message"]
            assert (kept["status"]["phase"], kept["status"]["reason"]) == ("Ready", "InUse")
            record = node.agent.store.record
            assert "s-1" in record.owners and "s-1" not in node.agent.store.revoked
            assert uuid not in record.idle_since
            await asyncio.sleep(0.1)  # the coalesced publish: no longer a device anyone can claim
            assert node.api.objects[f"{CLAIMS}/resourceslices/{NODE}-gpu.cdmo.io"]["spec"]["devices"] == []

            # The pod's containers stop: the kubelet unprepares, the reservation is still there.
            await kubelet.unprepare(("c-1", "train"))
            await asyncio.sleep(0.2)
            assert node.api.objects[slice_in_api]["metadata"]["finalizers"] == ["cdmo.io/agent"]
            cond = released()
            assert cond is not None and "prepared on node" not in cond["message"]
            assert "pod team/trainer" in cond["message"]
            assert "s-1" in node.agent.store.record.owners

            # The pod is gone: kube-controller-manager drops the reservation; released within a re-check.
            node.api.objects[claim_path]["status"]["reservedFor"] = []
            deadline = asyncio.get_running_loop().time() + 5
            while node.api.objects[slice_in_api]["metadata"]["finalizers"]:
                assert asyncio.get_running_loop().time() < deadline, "the finalizer was never removed"
                await asyncio.sleep(0.05)
            record = node.agent.store.record
            assert "s-1" not in record.owners and uuid in record.idle_since  # idle now, reusable
            assert not node.agent.releaser.holding
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_a_restart_writes_prepared_specs_again_and_unprepare_removes_them(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        await kubelet.register()
        await node.add_slice(mig_slice("s-1", "train", 0))
        node.add_claim(allocated_claim("c-1", "train", "s-1"))
        assert (await kubelet.prepare(("c-1", "train"))).claims["c-1"].error == ""
        await kubelet.close()
        await node.stop()
        # While it is down the node reboots (/var/run/cdi is a tmpfs) or a spec is left from an old claim.
        written = node.spec_path("s-1").read_text()
        node.spec_path("s-1").unlink()
        node.spec_path("s-old").write_text("{}")
        (root / "cdi" / "other-vendor.json").write_text("{}")

        await node.start()
        kubelet = FakeKubelet(str(root / "reg" / "gpu.cdmo.io-reg.sock"))
        try:
            await kubelet.register()
            assert node.spec_path("s-1").read_text() == written  # written again for the prepared claim
            assert not node.spec_path("s-old").exists()  # no prepared claim names it
            assert (root / "cdi" / "other-vendor.json").exists()  # not ours
            assert (await kubelet.unprepare(("c-1", "train"))).claims["c-1"].error == ""
            assert not node.spec_path("s-1").exists()
            assert "s-1" in node.agent.store.record.owners  # the slice lives on: only its claim went
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_no_registry_dir_serves_nothing(root: Path) -> None:
    async def scenario() -> None:
        settings = PluginSettings(registry_dir=str(root / "absent"), plugin_dir=str(root / "plug"))
        plugin = KubeletPlugin(None, settings)  # type: ignore[arg-type]
        assert not await plugin.start()
        assert not (root / "plug").exists()
        assert not await KubeletPlugin(None, PluginSettings(registry_dir="")).start()  # type: ignore[arg-type]

    asyncio.run(scenario())


# ---- the agent's flags -----------------------------------------------------------------------------


def _agent(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    """``mig-operator agent`` with flags that must be refused before anything starts (so before the
    unreachable API server is ever asked)."""
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", "agent", "--node", "n1", "--backend",
                           "sim:h100-80gb", "--state-file", str(tmp / "sim.json"), "--kubeconfig", str(kubeconfig),
                           *argv], capture_output=True, text=True, timeout=20)


@pytest.mark.parametrize(("flag", "value", "fragment"), [
    ("--kubelet-plugin-dir", "plugins/gpu", "--kubelet-plugin-dir 'plugins/gpu' is not an absolute directory path; "
     "use e.g. --kubelet-plugin-dir /var/lib/kubelet/plugins/gpu.cdmo.io"),
    ("--cdi-dir", "{file}", "exists and is not a directory; use e.g. --cdi-dir /var/run/cdi"),
    ("--shim-host-dir", "", "--shim-host-dir '' is not an absolute directory path; "
     "use e.g. --shim-host-dir /var/lib/mig-operator/shim"),
    ("--kubelet-registry-dir", "/" + "r" * 100, "--kubelet-registry-dir: socket '/rrrr"),
    ("--kubelet-plugin-dir", "/" + "p" * 100, "is longer than a unix socket path may be (107 bytes); use a shorter "
     "directory, e.g. --kubelet-plugin-dir /var/lib/kubelet/plugins/gpu.cdmo.io"),
    ("--toolkit-config", "etc/config.toml", "--toolkit-config 'etc/config.toml' is not an absolute file path; "
     "use e.g. --toolkit-config /etc/nvidia-container-runtime/config.toml"),
    ("--toolkit-config", "{dir}", "is a directory, not a file; use e.g. --toolkit-config "
     "/etc/nvidia-container-runtime/config.toml"),
])
def test_bad_plugin_flags_are_refused_in_one_line(root: Path, flag: str, value: str, fragment: str) -> None:
    (root / "a-file").write_text("")
    proc = _agent(root, flag, value.replace("{file}", str(root / "a-file")).replace("{dir}", str(root)))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert fragment in proc.stderr, proc.stderr


def test_a_socket_path_of_107_bytes_fits() -> None:
    from mig_operator.kube.agent.kubelet_plugin import socket_paths_fit

    plugin_dir = "/" + "p" * (107 - len("/dra.sock") - 1)
    assert len(plugin_dir + "/dra.sock") == 107
    assert socket_paths_fit(PluginSettings(registry_dir="", plugin_dir=plugin_dir)) == []
    assert socket_paths_fit(PluginSettings(registry_dir="", plugin_dir=plugin_dir + "p")) == [plugin_dir + "p/dra.sock"]
