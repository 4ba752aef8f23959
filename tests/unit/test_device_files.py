"""gpu/device_files.py: NVIDIA's device files read as its tools read them, and the simulator's copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from mig_operator.core.node.cdi import DeviceNode
from mig_operator.gpu.device_files import (
    DeviceFileError,
    capability_path,
    device_nodes,
    read_device_file_minor,
    read_majors,
    simulated_cap_minor,
    write_simulated_files,
)
from mig_operator.gpu.simulated import SimulatedBackend

PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
195 nvidia
236 nvidia-uvm
237 nvidia-caps
254 gpiochip

Block devices:
237 ignored-block
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_minor_from_a_real_access_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "access", "DeviceFileMinor: 12\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    assert read_device_file_minor(str(path)) == 12


@pytest.mark.parametrize("text", ["", "DeviceFileMode: 292\n", "DeviceFileMinor: \n", "DeviceFileMinor: -3\n",
                                  "DeviceFileMinor: twelve\n", "XDeviceFileMinor: 4\n"])
def test_bad_access_file_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "access", text)
    with pytest.raises(DeviceFileError, match=str(path)):
        read_device_file_minor(str(path))


def test_missing_access_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(DeviceFileError, match="does not exist"):
        read_device_file_minor(str(tmp_path / "nope"))


def test_majors_only_from_character_devices(tmp_path: Path) -> None:
    _write(tmp_path / "proc/devices", PROC_DEVICES)
    majors = read_majors(str(tmp_path))
    assert majors["nvidia-frontend"] == 195 and majors["nvidia-uvm"] == 236 and majors["nvidia-caps"] == 237
    assert "ignored-block" not in majors
    assert read_majors(str(tmp_path / "elsewhere")) == {}


def test_mig_device_nodes_name_both_capabilities(tmp_path: Path) -> None:
    _write(tmp_path / "proc/devices", PROC_DEVICES)
    _write(tmp_path / "proc/driver/nvidia/capabilities/gpu2/mig/gi3/access", "DeviceFileMinor: 30\n")
    _write(tmp_path / "proc/driver/nvidia/capabilities/gpu2/mig/gi3/ci0/access", "DeviceFileMinor: 31\n")
    assert device_nodes(str(tmp_path), 2, 3, 0) == [
        DeviceNode("/dev/nvidiactl", 195, 255), DeviceNode("/dev/nvidia-uvm", 236, 0),
        DeviceNode("/dev/nvidia-uvm-tools", 236, 1), DeviceNode("/dev/nvidia2", 195, 2),
        DeviceNode("/dev/nvidia-caps/nvidia-cap30", 237, 30), DeviceNode("/dev/nvidia-caps/nvidia-cap31", 237, 31),
    ]


def test_whole_gpu_without_proc_devices_leaves_dynamic_majors_to_the_runtime(tmp_path: Path) -> None:
    assert device_nodes(str(tmp_path), 0) == [
        DeviceNode("/dev/nvidiactl", 195, 255), DeviceNode("/dev/nvidia-uvm"), DeviceNode("/dev/nvidia-uvm-tools"),
        DeviceNode("/dev/nvidia0", 195, 0),
    ]


def test_mig_device_without_its_compute_instance_file_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig/gi1/access", "DeviceFileMinor: 12\n")
    with pytest.raises(DeviceFileError, match="gi1/ci0/access does not exist"):
        device_nodes(str(tmp_path), 0, 1, 0)
    with pytest.raises(DeviceFileError, match="no compute instance"):
        device_nodes(str(tmp_path), 0, 1, -1)
    with pytest.raises(DeviceFileError, match="not a device minor"):
        device_nodes(str(tmp_path), -1)


def test_simulated_minors_follow_the_drivers_table() -> None:
    # /proc/driver/nvidia-caps/mig-minors: gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, gpu0/gi1/access 12,
    # gpu1/gi0/access 138 (15 GPU instances of 9 minors per GPU).
    assert simulated_cap_minor(0, 0) == 3
    assert simulated_cap_minor(0, 0, 0) == 4
    assert simulated_cap_minor(0, 0, 7) == 11
    assert simulated_cap_minor(0, 1) == 12
    assert simulated_cap_minor(1, 0) == 138


def test_simulator_files_follow_its_instances(tmp_path: Path) -> None:
    write_simulated_files(str(tmp_path), [0, 1], [(1, 7, 0), (0, 3, -1)])
    assert read_device_file_minor(capability_path(str(tmp_path), 1, 7)) == 3 + 135 + 63
    assert read_device_file_minor(capability_path(str(tmp_path), 1, 7, 0)) == 3 + 135 + 63 + 1
    assert Path(capability_path(str(tmp_path), 0, 3)).exists()
    write_simulated_files(str(tmp_path), [0, 1], [(0, 3, 0)])  # GI 7 destroyed, GI 3 completed
    assert not Path(capability_path(str(tmp_path), 1, 7)).exists()
    assert not Path(capability_path(str(tmp_path), 1, 7, 0)).exists()
    assert read_device_file_minor(capability_path(str(tmp_path), 0, 3, 0)) == 3 + 27 + 1


def test_simulated_backend_lays_out_the_files_beside_its_state(tmp_path: Path) -> None:
    backend = SimulatedBackend("h100-80gb", count=2, state_file=str(tmp_path / "state.json"))
    profile = next(p for p in backend.model(1).profiles if p.name.startswith("1g"))
    inst = backend.create_instance(1, profile.id, 0)
    root = backend.device_root()
    assert root == str(tmp_path / "state.json.devices")
    assert [g.minor for g in backend.gpus()] == [0, 1]
    nodes = device_nodes(root, 1, inst.gi_id, inst.ci_id)
    assert nodes[-2:] == [
        DeviceNode(f"/dev/nvidia-caps/nvidia-cap{simulated_cap_minor(1, inst.gi_id)}", 510,
                   simulated_cap_minor(1, inst.gi_id)),
        DeviceNode(f"/dev/nvidia-caps/nvidia-cap{simulated_cap_minor(1, inst.gi_id, 0)}", 510,
                   simulated_cap_minor(1, inst.gi_id, 0)),
    ]
    backend.destroy_instance(1, inst.gi_id)
    backend.device_root()
    with pytest.raises(DeviceFileError):
        device_nodes(root, 1, inst.gi_id, inst.ci_id)
