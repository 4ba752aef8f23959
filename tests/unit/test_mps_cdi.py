"""The CDI edits of a fraction with a compute share (issue 26): what an MPS client needs, as NVIDIA's
DRA driver gives it (the daemon's pipe directory, its shm at /dev/shm), and its own limits. Expected
values are worked out by hand here."""

from __future__ import annotations

import pytest

from mig_operator.core.node.cdi import DeviceNode, SliceDevice, slice_spec
from mig_operator.core.node.environment import pinned_limit, thread_percentage

GIB = 2**30
PIPE, SHM = "/var/lib/mig-operator/mps/GPU-aaaa/pipe", "/var/lib/mig-operator/mps/GPU-aaaa/shm"
NODES = (DeviceNode("/dev/nvidiactl", 195, 255), DeviceNode("/dev/nvidia0", 195, 0))


def device(compute: float | None, granted: int = 8 * GIB, whole: bool = False, mode: str = "fraction",
           pipe: str = PIPE, shm: str = SHM) -> SliceDevice:
    return SliceDevice("a3f0c9d2-4b5e-4c6d-8e7f-0a1b2c3d4e5f", "team-a", "infer", mode, "GPU-aaaa", granted, NODES,
                       whole_gpu=whole, compute=compute, mps_pipe_dir=pipe, mps_shm_dir=shm)


def edits(dev: SliceDevice) -> tuple[dict[str, str], dict[str, tuple[str, list[str]]]]:
    [spec_device] = slice_spec(dev)["devices"]
    body = spec_device["containerEdits"]
    env = dict(v.split("=", 1) for v in body["env"])
    mounts = {m["containerPath"]: (m["hostPath"], m["options"]) for m in body.get("mounts", [])}
    return env, mounts


def test_a_compute_share_is_an_mps_client_with_its_share_and_memory() -> None:
    env, mounts = edits(device(0.25))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"  # 8 GiB = 8192 MiB, device 0 of the container
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"  # MPS's own default, where the pipe is mounted
    assert mounts["/tmp/nvidia-mps"] == (PIPE, ["rw", "nosuid", "nodev", "noexec", "bind"])
    assert mounts["/dev/shm"] == (SHM, ["rw", "nosuid", "nodev", "noexec", "bind"])
    # the shim stays, preloaded through the mounted /etc/ld.so.preload: memory is limited by both
    assert "LD_PRELOAD" not in env
    assert env["CDMO_GPU_MEMORY_LIMIT"] == str(8 * GIB)
    assert {"/usr/local/lib/cdmo/libgpuslice.so", "/run/cdmo/ledger", "/run/cdmo/limit",
            "/etc/ld.so.preload"} <= set(mounts)


def test_a_shared_fraction_gets_nothing_of_mps() -> None:
    env, mounts = edits(device(None, pipe="", shm=""))
    assert not [k for k in env if k.startswith("CUDA_MPS_")]
    assert set(mounts) == {"/usr/local/lib/cdmo/libgpuslice.so", "/run/cdmo/ledger", "/run/cdmo/limit",
                           "/etc/ld.so.preload"}


def test_a_whole_gpu_with_a_share_has_no_shim_but_is_an_mps_client() -> None:
    env, mounts = edits(device(1.0, granted=24 * GIB, whole=True))
    assert "LD_PRELOAD" not in env
    assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("100", "0=24576M")
    assert set(mounts) == {"/tmp/nvidia-mps", "/dev/shm"}


@pytest.mark.parametrize(("share", "percent"), [(0.25, 25), (0.75, 75), (1.0, 100), (0.333, 33), (0.125, 12),
                                                  (0.126, 13), (0.001, 1), (0.0001, 1)])
def test_thread_percentage_is_the_nearest_whole_percent_at_least_one(share: float, percent: int) -> None:
    assert thread_percentage(share) == percent


@pytest.mark.parametrize(("granted", "limit"), [(4 * GIB, "0=4096M"), (4 * 10**9, "0=3814M"),  # 3814.697 MiB
                                                (2**20 + 1, "0=1M"), (1000, "0=1M")])
def test_pinned_limit_is_whole_mib_rounded_down(granted: int, limit: str) -> None:
    assert pinned_limit(granted) == limit


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_thread_percentage_refuses_a_share_outside_zero_to_one(share: float) -> None:
    with pytest.raises(ValueError, match=f"compute {share!r} is not in"):
        thread_percentage(share)


def test_a_share_needs_a_fraction_and_the_daemon_directories() -> None:
    with pytest.raises(ValueError, match="only a fraction has a share"):
        slice_spec(device(0.5, mode="mig"))
    with pytest.raises(ValueError, match="MPS pipe and shm directories"):
        slice_spec(device(0.5, pipe=""))
