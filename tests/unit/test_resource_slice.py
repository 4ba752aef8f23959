"""kube/agent/resource_slice.py: the node's ResourceSlices' content and when they are written."""

from __future__ import annotations

import asyncio
import copy
import uuid
from typing import Any

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry
from mig_operator.kube.agent.resource_slice import (
    ResourceSlicePublisher,
    SliceDeviceInfo,
    device_info,
    pool_specs,
    resource_slice_path,
)
from mig_operator.kube.common.client import ApiError

MIG = SliceDeviceInfo("b-uid", "team", "train", "mig", "1g.10gb", "MIG-1", 10 * 2**30)
FRACTION = SliceDeviceInfo("a-uid", "lab", "nb", "fraction", "", "GPU-1", 4_000_000_000)


def slice_spec(node: str, devices: list[SliceDeviceInfo], generation: int) -> dict:
    [spec] = pool_specs(node, devices, generation)
    return spec


def test_devices_carry_the_contracts_attributes() -> None:
    spec = slice_spec("node-a", [MIG, FRACTION], 3)
    assert spec == {
        "driver": "gpu.cdmo.io", "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 1},
        "devices": [  # by name
            {"name": "a-uid", "attributes": {
                "gpu.cdmo.io/slice": {"string": "a-uid"}, "gpu.cdmo.io/sliceName": {"string": "nb"},
                "gpu.cdmo.io/sliceNamespace": {"string": "lab"}, "gpu.cdmo.io/mode": {"string": "fraction"},
                "gpu.cdmo.io/profile": {"string": ""}, "gpu.cdmo.io/uuid": {"string": "GPU-1"}},
             "capacity": {"gpu.cdmo.io/memory": {"value": "4000000000"}}},
            {"name": "b-uid", "attributes": {
                "gpu.cdmo.io/slice": {"string": "b-uid"}, "gpu.cdmo.io/sliceName": {"string": "train"},
                "gpu.cdmo.io/sliceNamespace": {"string": "team"}, "gpu.cdmo.io/mode": {"string": "mig"},
                "gpu.cdmo.io/profile": {"string": "1g.10gb"}, "gpu.cdmo.io/uuid": {"string": "MIG-1"}},
             "capacity": {"gpu.cdmo.io/memory": {"value": str(10 * 2**30)}}},
        ],
    }


def test_a_name_longer_than_an_attribute_may_be_is_left_out() -> None:
    long_name = "n" * 65
    spec = slice_spec("node-a", [SliceDeviceInfo("u", "ns", long_name, "mig", "1g.10gb", "MIG-1", 1)], 1)
    assert "gpu.cdmo.io/sliceName" not in spec["devices"][0]["attributes"]
    ok = slice_spec("node-a", [SliceDeviceInfo("u", "ns", "n" * 64, "mig", "1g.10gb", "MIG-1", 1)], 1)
    assert ok["devices"][0]["attributes"]["gpu.cdmo.io/sliceName"] == {"string": "n" * 64}


def test_at_most_128_devices_a_slice_and_every_device_in_one_of_them() -> None:
    many = [SliceDeviceInfo(f"u{i:03d}", "ns", "n", "fraction", "", "GPU-1", 1) for i in range(130)]
    specs = pool_specs("node-a", many, 4)
    assert [len(s["devices"]) for s in specs] == [128, 2]
    assert [s["pool"] for s in specs] == [{"name": "node-a", "generation": 4, "resourceSliceCount": 2}] * 2
    assert [d["name"] for s in specs for d in s["devices"]] == [f"u{i:03d}" for i in range(130)]
    assert [len(s["devices"]) for s in pool_specs("node-a", many[:128], 1)] == [128]
    assert [s["devices"] for s in pool_specs("node-a", [], 1)] == [[]]  # an empty pool is one empty slice


def test_device_info_from_owner_entries() -> None:
    mig = OwnerEntry("u1", "team/train", "mig", 0, COMPLETED, 5, 19, "1g.10gb", 0, 1, 7, 0, "MIG-1")
    fraction = OwnerEntry("u2", "lab/nb", "fraction", 0, COMPLETED, 7, profile="ignored", device_uuid="GPU-1")
    assert device_info(mig) == SliceDeviceInfo("u1", "team", "train", "mig", "1g.10gb", "MIG-1", 5)
    assert device_info(fraction) == SliceDeviceInfo("u2", "lab", "nb", "fraction", "", "GPU-1", 7)


SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


class Api:
    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.writes: list[tuple[str, str]] = []
        self.after_write: list[dict[str, dict]] = []  # the ResourceSlices after each write

    def _wrote(self, method: str, path: str) -> None:
        self.writes.append((method, path))
        self.after_write.append(copy.deepcopy({p: o for p, o in self.objects.items() if p.startswith(SLICES_PATH)}))

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: object = None) -> list:
        assert path == SLICES_PATH and field_selector == "spec.nodeName=node-a"
        return [copy.deepcopy(o) for p, o in self.objects.items()
                if p.startswith(f"{path}/") and o["spec"].get("nodeName") == "node-a"]

    async def get(self, path: str) -> dict:
        if path not in self.objects:
            raise ApiError(404, "NotFound", "no")
        return copy.deepcopy(self.objects[path])

    async def create(self, path: str, body: dict) -> dict:
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "AlreadyExists", full)
        self.objects[full] = copy.deepcopy(body)
        self._wrote("POST", path)
        return body

    async def request(self, method: str, path: str, body: Any = None) -> dict:
        self.objects[path] = copy.deepcopy(body)
        self._wrote(method, path)
        return body

    async def delete(self, path: str) -> dict:
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        gone = self.objects.pop(path)
        self._wrote("DELETE", path)
        return gone


def test_generation_goes_up_only_when_the_devices_change() -> None:
    async def scenario() -> None:
        api = Api()
        publisher = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        path = resource_slice_path("node-a")
        assert not await publisher.publish([MIG], "")  # no Node, no ResourceSlice
        assert api.writes == []
        assert await publisher.publish([MIG], "node-uid")
        body = api.objects[path]
        assert body["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-uid"}]
        assert body["spec"]["pool"]["generation"] == 1
        assert not await publisher.publish([MIG], "node-uid")  # unchanged: no write
        assert await publisher.publish([MIG, FRACTION], "node-uid")
        assert api.objects[path]["spec"]["pool"]["generation"] == 2
        assert [d["name"] for d in api.objects[path]["spec"]["devices"]] == ["a-uid", "b-uid"]
        assert await publisher.publish([], "node-uid")
        assert api.objects[path]["spec"]["pool"]["generation"] == 3 and api.objects[path]["spec"]["devices"] == []
        assert api.writes == [("POST", "/apis/resource.k8s.io/v1/resourceslices"), ("PUT", path), ("PUT", path)]

        # A new Node of the same name: the old one's ResourceSlice is replaced by one it owns.
        assert await publisher.publish([], "node-uid-2")
        assert api.writes[-2:] == [("DELETE", path), ("POST", "/apis/resource.k8s.io/v1/resourceslices")]
        assert api.objects[path]["metadata"]["ownerReferences"][0]["uid"] == "node-uid-2"

    asyncio.run(scenario())


def test_verify_rewrites_a_resource_slice_the_kubelet_deleted_and_reads_canonical_quantities() -> None:
    async def scenario() -> None:
        api = Api()
        publisher = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        path = resource_slice_path("node-a")
        assert await publisher.publish([MIG], "node-uid")
        # The API server stores quantities canonically: the same devices, no write.
        api.objects[path]["spec"]["devices"][0]["capacity"]["gpu.cdmo.io/memory"]["value"] = "10Gi"
        writes = len(api.writes)
        assert not await publisher.publish([MIG], "node-uid", verify=True)
        assert len(api.writes) == writes
        # A different value there is a change.
        api.objects[path]["spec"]["devices"][0]["capacity"]["gpu.cdmo.io/memory"]["value"] = "9Gi"
        assert await publisher.publish([MIG], "node-uid", verify=True)
        assert api.objects[path]["spec"]["pool"]["generation"] == 2
        # The kubelet deleted it (at its start): unchanged here, so only a verifying publish sees it.
        del api.objects[path]
        assert not await publisher.publish([MIG], "node-uid")
        assert await publisher.publish([MIG], "node-uid", verify=True)
        assert [d["name"] for d in api.objects[path]["spec"]["devices"]] == ["b-uid"]

    asyncio.run(scenario())


def scheduler_view(slices: dict[str, dict], pool: str = "node-a") -> tuple[list[str], bool]:
    """What kube-scheduler makes of a pool (its GatherPools, written from the API's documentation):
    only the slices of the highest generation count; the pool is complete when there are
    resourceSliceCount of them. Returns the devices it sees and whether the pool is complete."""
    mine = [o["spec"] for o in slices.values() if o["spec"]["pool"]["name"] == pool]
    if not mine:
        return [], False
    top = max(s["pool"]["generation"] for s in mine)
    newest = [s for s in mine if s["pool"]["generation"] == top]
    complete = all(s["pool"]["resourceSliceCount"] == len(newest) for s in newest)
    return [d["name"] for s in newest for d in s["devices"]], complete


def many(count: int) -> list[SliceDeviceInfo]:
    return [SliceDeviceInfo(str(uuid.uuid4()), "ns", f"s{i}", "fraction", "", "GPU-1", 2**30) for i in range(count)]


def test_300_devices_spread_over_three_resource_slices_and_the_scheduler_never_sees_a_mixed_pool() -> None:
    """Issue 24: 140 Ready slices gave 128 devices. Checked against a count by hand (300 = 128 + 128 +
    44) and against kube-scheduler's reading of a pool after every single write."""
    async def scenario() -> None:
        api = Api()
        publisher = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        names = ["node-a-gpu.cdmo.io", "node-a-gpu.cdmo.io-1", "node-a-gpu.cdmo.io-2"]
        devices = many(300)
        uids = {d.uid for d in devices}

        def check(expected: set[str], slices: int, generation: int) -> None:
            found = {p.rsplit("/", 1)[1]: o for p, o in api.objects.items()}
            assert sorted(found) == names[:slices]
            assert {o["spec"]["pool"]["generation"] for o in found.values()} == {generation}
            assert {o["spec"]["pool"]["resourceSliceCount"] for o in found.values()} == {slices}
            assert all(len(o["spec"]["devices"]) <= 128 for o in found.values())
            seen, complete = scheduler_view(api.objects)
            assert complete and len(seen) == len(expected) and set(seen) == expected
            # Between two publishes, the scheduler saw each generation's own devices only: never a
            # device of the old set that the new one dropped, never one twice.
            for state in api.after_write:
                visible, _ = scheduler_view(state)
                assert len(visible) == len(set(visible)), "a device listed twice"
                assert set(visible) <= expected or set(visible) <= previous, "devices of two generations"
            api.after_write.clear()

        previous: set[str] = set()
        assert await publisher.publish(devices, "node-uid")
        assert [len(o["spec"]["devices"]) for _, o in sorted(api.objects.items())] == [128, 128, 44]
        check(uids, 3, 1)

        # Shrink to 100: one slice left, generation 2, the two surplus ones deleted after it.
        previous, kept = uids, devices[:100]
        assert await publisher.publish(kept, "node-uid")
        check({d.uid for d in kept}, 1, 2)
        assert api.writes[-3:] == [("PUT", resource_slice_path("node-a")), ("DELETE", f"{SLICES_PATH}/{names[1]}"),
                                   ("DELETE", f"{SLICES_PATH}/{names[2]}")]

        # Grow to 257 (two full slices and one device): three slices at generation 3.
        previous, grown = {d.uid for d in kept}, kept + many(157)
        assert await publisher.publish(grown, "node-uid")
        check({d.uid for d in grown}, 3, 3)

        # A restarted agent (a new publisher) reads the pool: unchanged, no write.
        writes = len(api.writes)
        again = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        assert not await again.publish(grown, "node-uid")
        assert len(api.writes) == writes
        # ... and changes it from what it read: the next generation.
        previous = {d.uid for d in grown}
        assert await again.publish(grown[1:], "node-uid")
        check({d.uid for d in grown[1:]}, 2, 4)  # 256: two full slices, the third deleted

    asyncio.run(scenario())


def test_a_pool_left_half_written_is_completed_at_the_next_generation() -> None:
    """A crash between two writes leaves slices of two generations; the next publish reads them all
    and writes every slice at a generation above both, then deletes what is surplus."""
    async def scenario() -> None:
        api = Api()
        devices = many(200)
        assert await ResourceSlicePublisher(api, "node-a").publish(devices, "node-uid")  # type: ignore[arg-type]
        # As if a publisher had written only the first slice of generation 2 (count 1) and died.
        first = resource_slice_path("node-a")
        api.objects[first]["spec"] = pool_specs("node-a", devices[:10], 2)[0]
        publisher = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        assert await publisher.publish(devices[:10], "node-uid")
        assert list(api.objects) == [first]
        assert api.objects[first]["spec"]["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
        assert scheduler_view(api.objects) == (sorted(d.uid for d in devices[:10]), True)

    asyncio.run(scenario())


SICK = SliceDeviceInfo("b-uid", "team", "train", "mig", "1g.10gb", "MIG-1", 10 * 2**30, "Xid79", "NoExecute")


def test_a_device_of_an_unhealthy_gpu_is_tainted_with_its_reason_and_effect() -> None:
    [device] = slice_spec("node-a", [SICK], 1)["devices"]
    assert device["taints"] == [{"key": "gpu.cdmo.io/unhealthy", "value": "Xid79", "effect": "NoExecute"}]
    [healthy] = slice_spec("node-a", [MIG], 1)["devices"]
    assert "taints" not in healthy


class DroppingApi(Api):
    """An API server that does not serve device taints: it drops the field, as a disabled feature does."""

    def _drop(self, body: dict) -> dict:
        body = copy.deepcopy(body)
        for device in body["spec"]["devices"]:
            device.pop("taints", None)
        return body

    async def create(self, path: str, body: dict) -> dict:
        return await super().create(path, self._drop(body))

    async def request(self, method: str, path: str, body: Any = None) -> dict:
        return await super().request(method, path, self._drop(body))


def test_taints_are_written_where_served_and_given_up_where_dropped() -> None:
    async def scenario(api: Api) -> ResourceSlicePublisher:
        publisher = ResourceSlicePublisher(api, "node-a")  # type: ignore[arg-type]
        assert await publisher.publish([MIG], "node-uid")
        assert await publisher.publish([SICK], "node-uid")  # the GPU turned unhealthy: a new generation
        return publisher

    served = Api()
    publisher = asyncio.run(scenario(served))
    assert publisher.taints_served is True
    [device] = served.objects[resource_slice_path("node-a")]["spec"]["devices"]
    assert device["taints"][0]["value"] == "Xid79"

    dropped = DroppingApi()
    publisher = asyncio.run(scenario(dropped))
    assert publisher.taints_served is False
    writes = len(dropped.writes)

    async def again() -> bool:
        # Read back, the untainted devices are what is wanted now: nothing more is written.
        return await publisher.publish([SICK], "node-uid", verify=True)

    assert not asyncio.run(again())
    assert len(dropped.writes) == writes
