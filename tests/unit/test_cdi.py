"""core/node/cdi.py: the CDI spec of one slice, checked against specs written out by hand."""

from __future__ import annotations

import pytest

from mig_operator.core.node.cdi import (
    DeviceNode,
    SliceDevice,
    cdi_version,
    device_id,
    ledger_dir,
    limit_dir,
    names_device,
    nvidia_device_id,
    slice_spec,
    spec_file_name,
)

MIG_NODES = (
    DeviceNode("/dev/nvidiactl", 195, 255), DeviceNode("/dev/nvidia-uvm", 509, 0),
    DeviceNode("/dev/nvidia-uvm-tools", 509, 1), DeviceNode("/dev/nvidia1", 195, 1),
    DeviceNode("/dev/nvidia-caps/nvidia-cap201", 510, 201), DeviceNode("/dev/nvidia-caps/nvidia-cap202", 510, 202),
)


def test_mig_slice_gets_its_device_nodes_and_no_widening_variable() -> None:
    spec = slice_spec(SliceDevice("a1b2c3d4-0000-4000-8000-000000000001", "team-a", "train", "mig",
                                  "MIG-11111111-2222-3333-4444-555555555555", 10 * 2**30, MIG_NODES))
    assert spec == {
        "cdiVersion": "0.3.0",  # the name starts with a letter: nothing newer is needed
        "kind": "gpu.cdmo.io/slice",
        "devices": [{
            "name": "a1b2c3d4-0000-4000-8000-000000000001",
            "containerEdits": {
                "env": ["NVIDIA_VISIBLE_DEVICES=void"],
                "deviceNodes": [
                    {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                    {"path": "/dev/nvidia-uvm", "type": "c", "major": 509, "minor": 0},
                    {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 509, "minor": 1},
                    {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1},
                    {"path": "/dev/nvidia-caps/nvidia-cap201", "type": "c", "major": 510, "minor": 201},
                    {"path": "/dev/nvidia-caps/nvidia-cap202", "type": "c", "major": 510, "minor": 202},
                ],
            },
        }],
    }


def test_fraction_slice_gets_the_shim_read_only_its_ledger_read_write_and_its_limit() -> None:
    nodes = (DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia0", 195, 0))
    spec = slice_spec(SliceDevice("9f000000-0000-4000-8000-000000000002", "ns", "nb", "fraction",
                                  "GPU-abc", 5_500_000_000, nodes, shim_host_dir="/opt/shim/",
                                  ledger_host_dir="/opt/ledgers/", limits_host_dir="/opt/limits/"))
    assert spec["cdiVersion"] == "0.5.0"  # a device name starting with a digit needs CDI 0.5.0
    edits = spec["devices"][0]["containerEdits"]
    # For display only: no LD_PRELOAD (the shim comes from /etc/ld.so.preload), and the shim reads
    # its limit from the mounted file, not from CDMO_GPU_MEMORY_LIMIT.
    assert edits["env"] == [
        "NVIDIA_VISIBLE_DEVICES=void",
        "CDMO_GPU_MEMORY_LIMIT=5500000000",
        "CDMO_SLICE=ns/nb",
        "GPU_MEM_LIMIT_GB=5.5",
    ]
    # A node whose numbers are unknown leaves them to the runtime (it reads the host's file).
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl"},
                                    {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
    # The ledger: the slice's own directory on the node, at the one path the shim has built in (issue
    # 24), so every process of every pod of the claim shares one limit; no variable names it. The limit
    # and /etc/ld.so.preload: files of the slice's own directory in another tree, each read-only.
    assert edits["mounts"] == [{"hostPath": "/opt/shim/libgpuslice.so",
                                "containerPath": "/usr/local/lib/cdmo/libgpuslice.so",
                                "options": ["ro", "nosuid", "nodev", "bind"]},
                               {"hostPath": "/opt/ledgers/9f000000-0000-4000-8000-000000000002",
                                "containerPath": "/run/cdmo/ledger",
                                "options": ["rw", "nosuid", "nodev", "noexec", "bind"]},
                               {"hostPath": "/opt/limits/9f000000-0000-4000-8000-000000000002/limit",
                                "containerPath": "/run/cdmo/limit",
                                "options": ["ro", "nosuid", "nodev", "noexec", "bind"]},
                               {"hostPath": "/opt/limits/9f000000-0000-4000-8000-000000000002/ld.so.preload",
                                "containerPath": "/etc/ld.so.preload",
                                "options": ["ro", "nosuid", "nodev", "noexec", "bind"]}]
    assert not any(v.startswith(("CDMO_SHIM_", "LD_PRELOAD=")) for v in edits["env"])


def test_the_default_ledger_and_limit_directories_are_beside_the_shims() -> None:
    nodes = (DeviceNode("/dev/nvidia0", 195, 0),)
    spec = slice_spec(SliceDevice("u7", "ns", "nb", "fraction", "GPU-abc", 2**30, nodes))
    mounts = spec["devices"][0]["containerEdits"]["mounts"]
    assert [m["hostPath"] for m in mounts] == ["/var/lib/mig-operator/shim/libgpuslice.so",
                                              "/var/lib/mig-operator/ledgers/u7",
                                              "/var/lib/mig-operator/limits/u7/limit",
                                              "/var/lib/mig-operator/limits/u7/ld.so.preload"]


@pytest.mark.parametrize("uid", ["../x", "a/b", "", ".", ".."])
def test_a_ledger_or_limit_directory_is_one_path_component(uid: str) -> None:
    with pytest.raises(ValueError, match="not a directory name"):
        ledger_dir("/var/lib/mig-operator/ledgers", uid)
    with pytest.raises(ValueError, match="not a directory name"):
        limit_dir("/var/lib/mig-operator/limits", uid)


def test_a_whole_gpu_fraction_gets_the_gpu_with_no_limit_and_no_shim() -> None:
    nodes = (DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia1", 195, 1))
    spec = slice_spec(SliceDevice("w1", "ns", "job", "fraction", "GPU-l40s", 46068 * 2**20, nodes, whole_gpu=True))
    edits = spec["devices"][0]["containerEdits"]
    assert edits == {"env": ["NVIDIA_VISIBLE_DEVICES=void"],
                     "deviceNodes": [{"path": "/dev/nvidiactl"},
                                     {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}


def test_mig_slice_mounts_nothing() -> None:
    spec = slice_spec(SliceDevice("u1", "n", "s", "mig", "MIG-x", 1, MIG_NODES))
    assert "mounts" not in spec["devices"][0]["containerEdits"]


@pytest.mark.parametrize("name, version", [("a", "0.3.0"), ("z9", "0.3.0"), ("0a", "0.5.0"), ("9", "0.5.0")])
def test_cdi_version_is_the_lowest_the_name_needs(name: str, version: str) -> None:
    assert cdi_version(name) == version


def test_ids_and_file_name() -> None:
    assert device_id("u-1") == "gpu.cdmo.io/slice=u-1"
    assert nvidia_device_id("MIG-1") == "nvidia.com/gpu=MIG-1"
    assert spec_file_name("u-1") == "gpu.cdmo.io-slice_u-1.json"


@pytest.mark.parametrize("device, message", [
    (SliceDevice("bad/name", "n", "s", "mig", "MIG-x", 1, MIG_NODES), "not a CDI device name"),
    (SliceDevice("", "n", "s", "mig", "MIG-x", 1, MIG_NODES), "not a CDI device name"),
    (SliceDevice("u", "n", "s", "whole", "GPU-x", 1, MIG_NODES), "not 'mig' or 'fraction'"),
    (SliceDevice("u", "n", "s", "mig", "MIG-x", 1, ()), "no device nodes"),
])
def test_refuses_what_cdi_cannot_carry(device: SliceDevice, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slice_spec(device)


def test_names_device_matches_kind_and_name_only() -> None:
    spec = {"kind": "nvidia.com/gpu", "devices": [{"name": "0"}, {"name": "GPU-a"}]}
    assert names_device(spec, "nvidia.com/gpu", "GPU-a")
    assert not names_device(spec, "nvidia.com/gpu", "GPU-b")
    assert not names_device(spec, "other.com/gpu", "GPU-a")
    assert not names_device(None, "nvidia.com/gpu", "GPU-a")
    assert not names_device({"kind": "nvidia.com/gpu", "devices": "GPU-a"}, "nvidia.com/gpu", "GPU-a")
