"""kube/agent/resource_slice.py: the node's ResourceSlice content and when it is written."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from mig_operator.core.lifecycle import COMPLETED, OwnerEntry
from mig_operator.kube.agent.resource_slice import (
    ResourceSlicePublisher,
    SliceDeviceInfo,
    device_info,
    resource_slice_path,
    slice_spec,
)
from mig_operator.kube.common.client import ApiError

MIG = SliceDeviceInfo("b-uid", "team", "train", "mig", "1g.10gb", "MIG-1", 10 * 2**30)
FRACTION = SliceDeviceInfo("a-uid", "lab", "nb", "fraction", "", "GPU-1", 4_000_000_000)


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


def test_at_most_128_devices() -> None:
    many = [SliceDeviceInfo(f"u{i:03d}", "ns", "n", "fraction", "", "GPU-1", 1) for i in range(130)]
    assert len(slice_spec("node-a", many, 1)["devices"]) == 128


def test_device_info_from_owner_entries() -> None:
    mig = OwnerEntry("u1", "team/train", "mig", 0, COMPLETED, 5, 19, "1g.10gb", 0, 1, 7, 0, "MIG-1")
    fraction = OwnerEntry("u2", "lab/nb", "fraction", 0, COMPLETED, 7, profile="ignored", device_uuid="GPU-1")
    assert device_info(mig) == SliceDeviceInfo("u1", "team", "train", "mig", "1g.10gb", "MIG-1", 5)
    assert device_info(fraction) == SliceDeviceInfo("u2", "lab", "nb", "fraction", "", "GPU-1", 7)


class Api:
    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.writes: list[tuple[str, str]] = []

    async def get(self, path: str) -> dict:
        if path not in self.objects:
            raise ApiError(404, "NotFound", "no")
        return copy.deepcopy(self.objects[path])

    async def create(self, path: str, body: dict) -> dict:
        self.writes.append(("POST", path))
        self.objects[f"{path}/{body['metadata']['name']}"] = copy.deepcopy(body)
        return body

    async def request(self, method: str, path: str, body: Any = None) -> dict:
        self.writes.append((method, path))
        self.objects[path] = copy.deepcopy(body)
        return body

    async def delete(self, path: str) -> dict:
        self.writes.append(("DELETE", path))
        return self.objects.pop(path)


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
