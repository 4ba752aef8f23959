"""The agent's kubelet plugin driven as the kubelet drives it: over the real unix sockets, with the
kubelet's own protos (the vendored stubs), against a real NodeAgent on simulated GPUs.

The API server here is an in-memory stand-in holding the few objects the agent reads and writes
(the Node, GpuSlices, ResourceClaims); the e2e tests use the real one.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
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

from mig_operator.core.node.cdi import SliceDevice, slice_spec
from mig_operator.gpu.device_files import device_nodes, simulated_cap_minor
from mig_operator.kube.agent.kubelet.settings import PluginSettings
from mig_operator.kube.agent.kubelet.transport import KubeletPlugin


def test_registration_prepare_unprepare_repeated(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = node.kubelet()
        try:
            info = await kubelet.register()
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
                ("DRAPlugin", "gpu.cdmo.io", str(root / "plug" / "dra.sock"),
                 ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
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
        kubelet = node.kubelet()
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-1", "job", granted))
            node.add_claim(allocated_claim("c-1", "job", "f-1"))
            assert (await kubelet.prepare(("c-1", "job"))).claims["c-1"].error == ""
            edits = json.loads(node.spec_path("f-1").read_text())["devices"][0]["containerEdits"]
            limit = [e for e in edits["env"] if e.startswith("CDMO_GPU_MEMORY_LIMIT=")]
            assert bool(limit) is shim and ("mounts" in edits) is shim
            assert not any(e.startswith("LD_PRELOAD=") for e in edits["env"])
            assert (root / "limits" / "f-1").exists() is shim
            if shim:
                assert f"CDMO_GPU_MEMORY_LIMIT={granted}" in edits["env"]
                assert (root / "limits" / "f-1" / "limit").read_text() == f"{granted}\n"
                assert "/etc/ld.so.preload" in {m["containerPath"] for m in edits["mounts"]}
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_fraction_claim_gets_its_limit_and_preload_files_read_only_until_unprepared(root: Path) -> None:
    """The shim's limit is a file the agent writes per slice beside the ledgers on the node, and
    /etc/ld.so.preload another one naming the shim: the spec mounts both read-only, so no process of
    the container changes them or loads without the shim; they live from prepare to unprepare,
    survive the kubelet asking again and an agent restart, and one no prepared claim names goes."""
    granted = 5 * 10**9

    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = node.kubelet()
        files = root / "limits" / "f-2"
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-2", "job", granted))
            node.add_claim(allocated_claim("c-2", "job", "f-2"))
            assert (await kubelet.prepare(("c-2", "job"))).claims["c-2"].error == ""
            # What the shim reads (a decimal byte count, one newline) and what glibc's loader reads (the
            # shim's path in the container, where the spec mounts it), worked out here by hand.
            assert sorted(p.name for p in files.iterdir()) == ["ld.so.preload", "limit"]  # no temp file left
            assert (files / "limit").read_text() == "5000000000\n"
            assert (files / "ld.so.preload").read_text() == "/usr/local/lib/cdmo/libgpuslice.so\n"
            assert stat.S_IMODE(files.stat().st_mode) == 0o755
            assert {stat.S_IMODE((files / n).stat().st_mode) for n in ("limit", "ld.so.preload")} == {0o644}
            edits = json.loads(node.spec_path("f-2").read_text())["devices"][0]["containerEdits"]
            by_path = {m["containerPath"]: m for m in edits["mounts"]}
            read_only = ["ro", "nosuid", "nodev", "noexec", "bind"]
            assert by_path["/run/cdmo/limit"] == {"hostPath": str(files / "limit"), "containerPath": "/run/cdmo/limit",
                                                  "options": read_only}
            assert by_path["/etc/ld.so.preload"] == {"hostPath": str(files / "ld.so.preload"),
                                                     "containerPath": "/etc/ld.so.preload", "options": read_only}
            assert by_path["/usr/local/lib/cdmo/libgpuslice.so"]["hostPath"] == str(root / "shim" / "libgpuslice.so")
            # The environment shows the limit; nothing in it loads the shim or sets the limit.
            assert "CDMO_GPU_MEMORY_LIMIT=5000000000" in edits["env"] and "GPU_MEM_LIMIT_GB=5" in edits["env"]
            assert not any(e.startswith("LD_PRELOAD=") for e in edits["env"])
            assert (await kubelet.prepare(("c-2", "job"))).claims["c-2"].error == ""
            assert (files / "limit").read_text() == "5000000000\n"  # asked again: the same

            await kubelet.close()
            await node.stop()
            (root / "limits" / "gone-slice").mkdir()  # left by a claim unprepared while the agent was down
            await node.start()
            kubelet = node.kubelet()
            await kubelet.register()
            assert (files / "limit").exists() and not (root / "limits" / "gone-slice").exists()

            assert (await kubelet.unprepare(("c-2", "job"))).claims["c-2"].error == ""
            assert not files.exists()
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_a_limit_path_that_is_not_a_directory_refuses_the_claim(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = node.kubelet()
        try:
            await kubelet.register()
            await node.add_slice(fraction_slice("f-3", "job", 2**30))
            node.add_claim(allocated_claim("c-3", "job", "f-3"))
            (root / "limits").mkdir()
            (root / "limits" / "f-3").write_text("not a directory")
            error = (await kubelet.prepare(("c-3", "job"))).claims["c-3"].error
            assert f"{root / 'limits' / 'f-3'} is not a directory: the slice's limit cannot be written" in error
            assert not node.spec_path("f-3").exists()
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())


def test_a_fraction_claim_gets_its_own_ledger_directory_until_unprepared(root: Path) -> None:
    """Issue 24: the shim's ledger is a directory per slice beside the shim's on the node, mounted at
    one fixed path into every container of every pod of the claim; it lives from prepare to unprepare,
    survives the kubelet asking again and an agent restart, and one no prepared claim names goes."""
    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = node.kubelet()
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
            kubelet = node.kubelet()
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
        kubelet = node.kubelet()
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
    assert PluginSettings().limits_host_dir == "/var/lib/mig-operator/limits"
    assert PluginSettings(shim_host_dir="/opt/cdmo/shim/").limits_host_dir == "/opt/cdmo/limits"


def test_refuses_what_is_not_a_ready_slice_of_this_node(root: Path) -> None:
    async def scenario() -> None:
        node = Node(root)
        await node.start()
        kubelet = node.kubelet()
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
        tenant = node.kubelet()
        thief = node.kubelet("team-b")
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
        kubelet = node.kubelet()
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
    from mig_operator.kube.agent.kubelet.settings import socket_paths_fit

    plugin_dir = "/" + "p" * (107 - len("/dra.sock") - 1)
    assert len(plugin_dir + "/dra.sock") == 107
    assert socket_paths_fit(PluginSettings(registry_dir="", plugin_dir=plugin_dir)) == []
    assert socket_paths_fit(PluginSettings(registry_dir="", plugin_dir=plugin_dir + "p")) == [plugin_dir + "p/dra.sock"]


def test_a_prepare_that_comes_while_its_slice_is_realised_here_waits_for_it(root: Path, monkeypatch) -> None:
    """A pod whose device needs no NVML call is let go at its slice's binding, so the kubelet can ask
    before the agent has recorded the slice: the prepare waits for that realisation, then serves it.
    A slice not being realised here is refused at once, as before."""
    from mig_operator.kube.agent import realise as realise_module

    async def scenario() -> None:
        node = Node(root, "l40s-48gb")
        await node.start()
        kubelet = node.kubelet()
        release = asyncio.Event()
        real = realise_module.Realiser._realise_fraction

        async def held(self, *args, **kwargs):  # the realisation, held until the prepare waits
            await release.wait()
            return await real(self, *args, **kwargs)

        monkeypatch.setattr(realise_module.Realiser, "_realise_fraction", held)
        try:
            await kubelet.register()
            body = fraction_slice("f-9", "job", 2**30)
            node.api.objects[f"{SLICES}/namespaces/team/gpuslices/job"] = body
            realising = asyncio.create_task(event(node.agent, body))
            node.add_claim(allocated_claim("c-9", "job", "f-9"))
            preparing = asyncio.create_task(kubelet.prepare(("c-9", "job")))
            await asyncio.sleep(0.2)
            assert not preparing.done()  # waiting for the slice, not refused
            release.set()
            await realising
            assert (await preparing).claims["c-9"].error == ""
            assert node.spec_path("f-9").exists()
            # A claim whose slice nothing realises here: refused at once.
            node.add_claim(allocated_claim("c-10", "other", "f-10"))
            started = asyncio.get_running_loop().time()
            error = (await kubelet.prepare(("c-10", "other"))).claims["c-10"].error
            assert "is not a slice Ready on node" in error
            assert asyncio.get_running_loop().time() - started < 1.0
        finally:
            await kubelet.close()
            await node.stop()

    asyncio.run(scenario())
