"""Each agent publishes its node's ResourceSlice for driver gpu.cdmo.io: one device per Ready slice,
described as the GpuSlice's status says, and no device for an idle instance (issue 16 item 1)."""

from __future__ import annotations

from typing import Any

import kubernetes
from harness import OperatorHarness, SimNode, wait_until
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

DRIVER = "gpu.cdmo.io"


def resource_slice(operator: OperatorHarness, node: SimNode) -> dict | None:
    api = kubernetes.client.CustomObjectsApi(operator.custom.api_client)
    try:
        return api.get_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", f"{node.name}-{DRIVER}")
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def devices_of(operator: OperatorHarness, node: SimNode) -> dict[str, dict]:
    body = resource_slice(operator, node) or {}
    return {d["name"]: d for d in (body.get("spec") or {}).get("devices") or []}


def expected_device(body: dict) -> dict[str, Any]:
    """What the contract says a Ready GpuSlice's device is, from the slice itself."""
    st = body["status"]
    return {
        "attributes": {
            f"{DRIVER}/slice": {"string": body["metadata"]["uid"]},
            f"{DRIVER}/sliceName": {"string": body["metadata"]["name"]},
            f"{DRIVER}/sliceNamespace": {"string": body["metadata"]["namespace"]},
            f"{DRIVER}/mode": {"string": st["mode"]},
            f"{DRIVER}/profile": {"string": st.get("profile", "") if st["mode"] == "mig" else ""},
            f"{DRIVER}/uuid": {"string": st["deviceUUID"]},
        },
        "memory": st["grantedBytes"],
    }


def as_seen(device: dict) -> dict[str, Any]:
    return {"attributes": device["attributes"],
            "memory": int(parse_quantity(device["capacity"][f"{DRIVER}/memory"]["value"]))}


def test_resource_slices_list_the_ready_slices_and_no_idle_instance(operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb")
    plain = operator.add_node("l4-24gb", labelled=False)
    operator.start_operator(mig, plain)
    ns = operator.namespace()
    for name, spec in (("small", {"migProfile": "1g.10gb", "nodeName": mig.name}),
                       ("big", {"migProfile": "3g.40gb", "nodeName": mig.name}),
                       ("gone", {"migProfile": "2g.20gb", "nodeName": mig.name}),
                       ("half", {"fraction": 0.5, "nodeName": plain.name})):
        operator.create_slice(ns, name, spec)
    ready = {name: operator.wait_phase(ns, name, "Ready") for name in ("small", "big", "gone", "half")}
    # Deleted: its instance stays on the GPU as an idle instance, which is no device.
    idle_uuid = ready["gone"]["status"]["deviceUUID"]
    operator.delete_slice(ns, "gone")
    operator.wait_gone(ns, "gone")
    del ready["gone"]

    want_mig = {ready[n]["metadata"]["uid"]: expected_device(ready[n]) for n in ("small", "big")}
    wait_until(lambda: devices_of(operator, mig).keys() == want_mig.keys(), 15,
               lambda: f"ResourceSlice of {mig.name}: {resource_slice(operator, mig)}\n{operator.logs()}")
    body = resource_slice(operator, mig)
    assert body is not None
    node_uid = operator.core.read_node(mig.name).metadata.uid
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": mig.name, "uid": node_uid}]
    spec = body["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == \
        (DRIVER, mig.name, mig.name, 1)
    assert {name: as_seen(d) for name, d in devices_of(operator, mig).items()} == want_mig
    idle = [i for g in operator.gpunode(mig)["status"]["gpus"] for i in g["instances"] if not i["sliceUID"]]
    assert [i["deviceUUID"] for i in idle] == [idle_uuid], "the deleted slice's instance is idle"
    uuids = {d["attributes"][f"{DRIVER}/uuid"]["string"] for d in devices_of(operator, mig).values()}
    assert idle_uuid not in uuids
    generation = spec["pool"]["generation"]

    half = ready["half"]
    wait_until(lambda: devices_of(operator, plain).keys() == {half["metadata"]["uid"]}, 15,
               lambda: f"ResourceSlice of {plain.name}: {resource_slice(operator, plain)}\n{operator.logs()}")
    [device] = devices_of(operator, plain).values()
    assert as_seen(device) == expected_device(half)
    assert device["attributes"][f"{DRIVER}/uuid"]["string"].startswith("GPU-")

    # Deleting a slice takes its device away, in a newer generation of the pool.
    operator.delete_slice(ns, "small")
    operator.wait_gone(ns, "small")
    wait_until(lambda: devices_of(operator, mig).keys() == {ready["big"]["metadata"]["uid"]}, 15,
               lambda: f"ResourceSlice of {mig.name}: {resource_slice(operator, mig)}\n{operator.logs()}")
    assert resource_slice(operator, mig)["spec"]["pool"]["generation"] > generation
