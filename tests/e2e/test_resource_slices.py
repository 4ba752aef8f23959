"""Each agent publishes its node's ResourceSlice for driver gpu.cdmo.io: one device per Ready slice,
described as the GpuSlice's status says, and no device for an idle instance (issue 16 item 1); and
the agent's kubelet plugin, called as the kubelet calls it, writes CDI specs the official CDI library
accepts and applies (issue 16 items 4 and 5)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes
import pytest
from harness import OperatorHarness, SimNode, wait_until
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from mig_operator.kube.agent.kubeletapi import dra_v1_pb2 as dra
from mig_operator.kube.agent.kubeletapi import dra_v1_pb2_grpc as dra_grpc
from mig_operator.kube.agent.kubeletapi import pluginregistration_v1_pb2 as reg
from mig_operator.kube.agent.kubeletapi import pluginregistration_v1_pb2_grpc as reg_grpc

# Also run on the oldest supported Kubernetes release (make compat).
pytestmark = pytest.mark.compat

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


# ---- the kubelet plugin ----------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A unix socket path holds at most 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="dra-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Kubelet:
    """The calls the kubelet's plugin watcher and DRA manager make, from the kubelet's own protos."""

    def __init__(self, registry_dir: Path) -> None:
        self.registry_dir = registry_dir
        self.channels: list[grpc.Channel] = []

    def register(self) -> dra_grpc.DRAPluginStub:
        socket = self.registry_dir / "gpu.cdmo.io-reg.sock"
        wait_until(socket.exists, 30, f"the registration socket {socket}")
        channel = grpc.insecure_channel(f"unix://{socket}")
        self.channels.append(channel)
        registration = reg_grpc.RegistrationStub(channel)
        info = registration.GetInfo(reg.InfoRequest(), timeout=10)
        assert (info.type, info.name, list(info.supported_versions)) == \
            ("DRAPlugin", DRIVER, ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
        registration.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
        service = grpc.insecure_channel(f"unix://{info.endpoint}")
        self.channels.append(service)
        return dra_grpc.DRAPluginStub(service)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def allocated_claim(operator: OperatorHarness, ns: str, name: str, node: SimNode, device: str,
                    create: bool = False) -> dict:
    """A ResourceClaim allocated as kube-scheduler would (status written with the admin's credentials):
    the slice's own, written by the controller, or (``create``) one the admin writes."""
    api = kubernetes.client.CustomObjectsApi(operator.custom.api_client)
    if create:
        api.create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuslice.cdmo.io"}}]}}})
    else:
        def written() -> bool:
            try:
                api.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        wait_until(written, 30, lambda: f"the controller's ResourceClaim {ns}/{name}\n{operator.logs()}")
    return api.patch_namespaced_custom_object_status("resource.k8s.io", "v1", ns, "resourceclaims", name, {
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": node.name, "device": device}]}}}})


def claim_of(body: dict) -> dra.Claim:
    meta = body["metadata"]
    return dra.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def test_kubelet_plugin_prepares_specs_the_cdi_library_applies(operator: OperatorHarness, cdi_validate: Path,
                                                               short_dir: Path) -> None:
    mig = operator.add_node("h100-80gb")
    plain = operator.add_node("l4-24gb", labelled=False)
    flags = {}
    for node in (mig, plain):
        (short_dir / node.name / "reg").mkdir(parents=True)
        flags[node.name] = ["--kubelet-registry-dir", str(short_dir / node.name / "reg"),
                            "--kubelet-plugin-dir", str(short_dir / node.name / "plug"),
                            "--cdi-dir", str(short_dir / node.name / "cdi"),
                            "--shim-host-dir", str(short_dir / node.name / "shim")]
    agents = {node.name: operator.agent(node, None, *flags[node.name]) for node in (mig, plain)}
    for node in (mig, plain):
        operator.wait_gpunode(node)
    operator.controller()
    ns = operator.namespace()
    operator.create_slice(ns, "train", {"migProfile": "1g.10gb", "nodeName": mig.name})
    operator.create_slice(ns, "notebook", {"fraction": 0.25, "nodeName": plain.name})
    train = operator.wait_phase(ns, "train", "Ready")
    notebook = operator.wait_phase(ns, "notebook", "Ready")
    train_uid, notebook_uid = train["metadata"]["uid"], notebook["metadata"]["uid"]

    mig_claim = allocated_claim(operator, ns, "train", mig, train_uid)
    fraction_claim = allocated_claim(operator, ns, "notebook", plain, notebook_uid)
    stolen = allocated_claim(operator, ns, "stolen", mig, notebook_uid, create=True)  # another node's device

    kubelets = {name: Kubelet(short_dir / name / "reg") for name in (mig.name, plain.name)}
    try:
        service = kubelets[mig.name].register()
        answer = service.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim_of(mig_claim)]),
                                              timeout=30)
        result = answer.claims[mig_claim["metadata"]["uid"]]
        assert result.error == ""
        assert list(result.devices[0].cdi_device_ids) == [f"{DRIVER}/slice={train_uid}"]
        seen = json.loads(subprocess.run(
            [str(cdi_validate), "--cdi-dir", str(short_dir / mig.name / "cdi"), f"{DRIVER}/slice={train_uid}"],
            check=True, capture_output=True, text=True).stdout)
        assert "NVIDIA_VISIBLE_DEVICES=void" in seen["env"]
        assert not any(e.startswith("LD_PRELOAD=") for e in seen["env"]) and not seen["mounts"]
        paths = sorted(d["path"] for d in seen["deviceNodes"])
        caps = [p for p in paths if p.startswith("/dev/nvidia-caps/")]
        assert len(caps) == 2, paths  # the GPU instance's and the compute instance's
        assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= set(paths)

        refused = service.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim_of(stolen)]),
                                               timeout=30).claims[stolen["metadata"]["uid"]]
        assert f"device {DRIVER}/{mig.name}/{notebook_uid} is not a slice Ready on node {mig.name}" in refused.error

        fraction_service = kubelets[plain.name].register()
        answer = fraction_service.NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=[claim_of(fraction_claim)]), timeout=30)
        assert answer.claims[fraction_claim["metadata"]["uid"]].error == ""
        seen = json.loads(subprocess.run(
            [str(cdi_validate), "--cdi-dir", str(short_dir / plain.name / "cdi"), f"{DRIVER}/slice={notebook_uid}"],
            check=True, capture_output=True, text=True).stdout)
        granted = notebook["status"]["grantedBytes"]
        assert {"NVIDIA_VISIBLE_DEVICES=void", f"CDMO_GPU_MEMORY_LIMIT={granted}",
                f"CDMO_SLICE={ns}/notebook"} <= set(seen["env"])
        assert not any(e.startswith("LD_PRELOAD=") for e in seen["env"])  # /etc/ld.so.preload loads the shim
        ledger = short_dir / plain.name / "ledgers" / notebook_uid  # made at prepare, beside the shim's directory
        limits = short_dir / plain.name / "limits" / notebook_uid  # written at prepare, beside the ledgers
        # (the CDI library orders mounts by container path)
        mounts = {m["destination"]: m for m in seen["mounts"]}
        assert {d: m["source"] for d, m in mounts.items()} == {
            "/usr/local/lib/cdmo/libgpuslice.so": str(short_dir / plain.name / "shim" / "libgpuslice.so"),
            "/run/cdmo/ledger": str(ledger), "/run/cdmo/limit": str(limits / "limit"),
            "/etc/ld.so.preload": str(limits / "ld.so.preload")}
        for read_only in ("/usr/local/lib/cdmo/libgpuslice.so", "/run/cdmo/limit", "/etc/ld.so.preload"):
            assert "ro" in mounts[read_only]["options"], mounts[read_only]
        assert "rw" in mounts["/run/cdmo/ledger"]["options"]
        assert ledger.is_dir()
        assert (limits / "limit").read_text() == f"{granted}\n"
        assert (limits / "ld.so.preload").read_text() == "/usr/local/lib/cdmo/libgpuslice.so\n"

        # SIGKILL the MIG node's agent; the restarted one still knows the prepared claim.
        operator.kill(agents[mig.name])
        operator.start(agents[mig.name])
        kubelets[mig.name].close()
        kubelets[mig.name] = Kubelet(short_dir / mig.name / "reg")
        spec_file = short_dir / mig.name / "cdi" / f"{DRIVER}-slice_{train_uid}.json"
        assert spec_file.exists()
        service = wait_until(lambda: _registered(kubelets[mig.name]), 30, lambda: operator.logs())
        again = service.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim_of(mig_claim)]),
                                             timeout=30).claims[mig_claim["metadata"]["uid"]]
        assert again == result
        gone = service.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[claim_of(mig_claim)]),
                                              timeout=30)
        assert gone.claims[mig_claim["metadata"]["uid"]].error == ""
        assert not spec_file.exists()
    finally:
        for kubelet in kubelets.values():
            kubelet.close()


def _registered(kubelet: Kubelet) -> dra_grpc.DRAPluginStub | None:
    """The restarted agent's plugin, once it answers (its socket file may be the dead one's until then)."""
    try:
        return kubelet.register()
    except grpc.RpcError:
        return None


# ---- more than 128 devices on one node ------------------------------------------------------------


def node_resource_slices(operator: OperatorHarness, node: SimNode) -> list[dict]:
    api = kubernetes.client.CustomObjectsApi(operator.custom.api_client)
    items = api.list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices",
                                           field_selector=f"spec.nodeName={node.name}")["items"]
    return sorted(items, key=lambda b: b["metadata"]["name"])


def test_300_devices_on_one_node_spread_over_resource_slices_kube_scheduler_allocates(
        operator: OperatorHarness) -> None:
    """Issue 24: one ResourceSlice holds 128 devices; 140 Ready slices left 12 pods unschedulable.
    The agent's publisher (with the chart's agent credentials) writes 300 devices; the API server
    accepts three ResourceSlices of one pool (128 + 128 + 44, counted by hand), kube-scheduler
    allocates a claim whose device is in the third one, and shrinking deletes the surplus slices."""
    import asyncio
    import uuid

    from mig_operator.kube.agent.resource_slice import ResourceSlicePublisher, SliceDeviceInfo
    from mig_operator.kube.common.client import KubeClient

    node = operator.add_node("l40s-48gb", labelled=False)
    node_uid = operator.core.read_node(node.name).metadata.uid
    ns = operator.namespace()
    devices = [SliceDeviceInfo(str(uuid.uuid4()), ns, f"s{i}", "fraction", "", "GPU-1", 2**28) for i in range(300)]

    async def publish(infos: list[SliceDeviceInfo]) -> bool:
        client = KubeClient.from_environment(str(operator.kubeconfigs.get("agent", operator.cluster.kubeconfig)))
        try:
            return await ResourceSlicePublisher(client, node.name).publish(infos, node_uid)
        finally:
            await client.close()

    assert asyncio.run(publish(devices))
    slices = node_resource_slices(operator, node)
    base = f"{node.name}-{DRIVER}"
    assert [b["metadata"]["name"] for b in slices] == [base, f"{base}-1", f"{base}-2"]
    assert [len(b["spec"]["devices"]) for b in slices] == [128, 128, 44]
    assert all(b["spec"]["pool"] == {"name": node.name, "generation": 1, "resourceSliceCount": 3} for b in slices)
    names = [d["name"] for b in slices for d in b["spec"]["devices"]]
    assert sorted(names) == sorted(d.uid for d in devices) and len(set(names)) == 300

    # kube-scheduler reads the whole pool: a claim for the last device (in the third slice) is allocated.
    last = max(d.uid for d in devices)
    assert last in {d["name"] for d in slices[2]["spec"]["devices"]}
    api = kubernetes.client.CustomObjectsApi(operator.custom.api_client)
    api.create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "last"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpuslice.cdmo.io",
            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].slice == "{last}"'}}]}}]}}})
    operator.core.create_namespaced_pod(ns, {
        "metadata": {"name": "last"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node.name},
                 "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": "last"}],
                 "containers": [{"name": "main", "image": "fake", "resources": {"claims": [{"name": "gpu"}]}}]}})

    def allocated() -> list | None:
        claim = api.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", "last")
        return ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")

    [result] = wait_until(allocated, 60, lambda: f"claim {ns}/last allocated: "
                          f"{operator.core.read_namespaced_pod('last', ns).status}")
    assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node.name, last)

    # Fewer devices: one slice left at the next generation, the surplus ones deleted.
    assert asyncio.run(publish(devices[:100]))
    slices = node_resource_slices(operator, node)
    assert [b["metadata"]["name"] for b in slices] == [base]
    assert slices[0]["spec"]["pool"] == {"name": node.name, "generation": 2, "resourceSliceCount": 1}
    assert sorted(d["name"] for d in slices[0]["spec"]["devices"]) == sorted(d.uid for d in devices[:100])
