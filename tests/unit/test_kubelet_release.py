"""The agent's kubelet plugin across restarts and releases: a prepared claim holds its slice's
instance, a deleted slice in use keeps its finalizer until its claim is free, and specs are
written again on start (driven as the kubelet drives it, see test_kubelet_plugin.py)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

from kubelet_harness import (
    CLAIMS,
    NODE,
    SLICES,
    Node,
    allocated_claim,
    event,
    mig_slice,
    root_fixture,  # noqa: F401 (the fixture ``root``)
)

from mig_operator.core.node.lifecycle import idle_instances
from mig_operator.kube.agent.inventory import instance_state


def test_prepared_claim_survives_a_restart_and_holds_a_deleted_slices_instance(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = node.kubelet()
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
            await event(node.agent, deleting)
            del node.api.objects[slice_in_api]
            await event(node.agent, deleting, deleted=True)
            record = node.agent.store.record
            assert "s-1" in record.owners and "s-1" in node.agent.store.revoked
            assert idle_instances(record, 0, [instance_state(i) for i in node.backend().instances(0)]) == []
            await asyncio.sleep(0.1)  # the coalesced publish
            assert node.api.objects[f"{CLAIMS}/resourceslices/{NODE}-gpu.cdmo.io"]["spec"]["devices"] == []

            # The agent restarts (new servers, the same record): still held, and the kubelet's calls work.
            await kubelet.close()
            await node.stop()
            await node.start()
            kubelet = node.kubelet()
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
        kubelet = node.kubelet()
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
            node.agent.saw(deleting)
            deadline = asyncio.get_running_loop().time() + 5
            while released() is None:  # its key runs from the agent's work queue
                assert asyncio.get_running_loop().time() < deadline, "the slice never said it is kept"
                await asyncio.sleep(0.01)
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
        kubelet = node.kubelet()
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
        kubelet = node.kubelet()
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
