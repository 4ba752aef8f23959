"""tools/cdi-validate: the official CDI library (tags.cncf.io/container-device-interface) loads CDI
specs, validates them as a container runtime does, applies devices to an OCI runtime spec, and the
tool prints what a container gets. These tests pin down its contract with specs written here by
hand, and what the library does with device nodes this host lacks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

SLICE_UID = "4f9c1e2a-0b7d-4c55-9a7e-2f1d3c4b5a6e"
SLICE_DEVICE = f"gpu.cdmo.io/slice={SLICE_UID}"
SHIM_HOST = "/var/lib/cdmo/shim/libcdmo-shim.so"
SHIM_CONTAINER = "/usr/local/lib/cdmo/libcdmo-shim.so"


def slice_spec() -> dict[str, Any]:
    """A spec of the shape issue 16 asks the agent to write for a MIG slice (plus the shim of a
    fraction), with every device node fully given: none of them exists on this machine."""
    nodes = [
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 508, "minor": 0},
        {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 508, "minor": 1},
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
        {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 237, "minor": 21},
        {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": 237, "minor": 22, "permissions": "r"},
    ]
    return {
        "cdiVersion": "0.6.0",
        "kind": "gpu.cdmo.io/slice",
        "devices": [{
            "name": SLICE_UID,
            "containerEdits": {
                "env": [
                    "NVIDIA_VISIBLE_DEVICES=void",
                    f"CDMO_SLICE_UID={SLICE_UID}",
                    "GPU_MEM_LIMIT_GB=10",
                    f"LD_PRELOAD={SHIM_CONTAINER}",
                ],
                "deviceNodes": nodes,
                "mounts": [{"hostPath": SHIM_HOST, "containerPath": SHIM_CONTAINER,
                            "options": ["ro", "nosuid", "nodev", "bind"]}],
            },
        }],
    }


def write_spec(directory: Path, name: str, spec: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(spec))
    return path


def validate(tool: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=60)


def applied(tool: Path, *args: str) -> dict[str, Any]:
    result = validate(tool, *args)
    assert result.returncode == 0, f"cdi-validate exited {result.returncode}: {result.stderr}"
    assert result.stderr == ""
    return json.loads(result.stdout)


def test_valid_slice_spec_gives_its_env_mounts_and_device_nodes(cdi_validate, tmp_path):
    spec = slice_spec()
    write_spec(tmp_path / "cdi", "gpu.cdmo.io-slice.json", spec)
    out = applied(cdi_validate, "--cdi-dir", str(tmp_path / "cdi"), SLICE_DEVICE)

    edits = spec["devices"][0]["containerEdits"]
    assert out["cdiDevices"] == [SLICE_DEVICE]
    assert out["env"] == edits["env"]
    assert out["mounts"] == [{"destination": m["containerPath"], "source": m["hostPath"], "options": m["options"]}
                             for m in edits["mounts"]]
    # Fully given nodes are taken as written: no host lookup, so no file mode, no owner.
    assert out["deviceNodes"] == [{k: n[k] for k in ("path", "type", "major", "minor")} for n in edits["deviceNodes"]]
    # Each node is also allowed in the device cgroup, "rwm" unless the spec narrows it.
    assert out["deviceCgroup"] == [
        {"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": n.get("permissions", "rwm")}
        for n in edits["deviceNodes"]
    ]
    assert "hooks" not in out


def test_spec_files_and_a_second_vendor_apply_together(cdi_validate, tmp_path):
    """The slice's device and the NVIDIA toolkit's device for the same GPU, as the agent returns
    both where the toolkit's spec exists; spec-wide edits come with each spec."""
    gpu0 = {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}
    nvidia = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "containerEdits": {"env": ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"],
                           "mounts": [{"hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                                       "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                                       "options": ["ro", "nosuid", "nodev", "bind"]}]},
        "devices": [{"name": "GPU-0f5b1d9e-6a7c-4e1b-9d3f-2a8c7b6e5d4f",
                     "containerEdits": {"deviceNodes": [gpu0]}}],
    }
    slice_path = write_spec(tmp_path / "a", "slice.json", slice_spec())
    nvidia_path = write_spec(tmp_path / "b", "nvidia.yaml", nvidia)  # JSON is YAML: the library reads both
    out = applied(cdi_validate, "--spec", str(slice_path), "--spec", str(nvidia_path),
                  SLICE_DEVICE, "nvidia.com/gpu=GPU-0f5b1d9e-6a7c-4e1b-9d3f-2a8c7b6e5d4f")

    assert out["env"] == slice_spec()["devices"][0]["containerEdits"]["env"] + nvidia["containerEdits"]["env"]
    assert sorted(m["destination"] for m in out["mounts"]) == sorted(
        [SHIM_CONTAINER, nvidia["containerEdits"]["mounts"][0]["containerPath"]])
    paths = [n["path"] for n in out["deviceNodes"]]
    # /dev/nvidia0 is in both specs: the OCI spec gets it once.
    assert sorted(paths) == sorted({n["path"] for n in slice_spec()["devices"][0]["containerEdits"]["deviceNodes"]})


def test_a_node_given_by_path_only_is_read_from_the_host(cdi_validate, tmp_path):
    """The library stats the host's node for what the spec leaves out (here /dev/null), and then
    also copies its file mode."""
    spec = slice_spec()
    spec["devices"][0]["containerEdits"] = {"deviceNodes": [{"path": "/dev/null"}]}
    write_spec(tmp_path, "s.json", spec)
    out = applied(cdi_validate, "--cdi-dir", str(tmp_path), SLICE_DEVICE)
    host = os.stat("/dev/null")
    assert out["deviceNodes"] == [{"path": "/dev/null", "type": "c", "major": os.major(host.st_rdev),
                                   "minor": os.minor(host.st_rdev), "fileMode": host.st_mode & 0o7777}]


def test_a_node_missing_on_the_host_needs_type_and_numbers(cdi_validate, tmp_path):
    """What a spec written on a machine without the NVIDIA driver (the simulator) must do: a node
    given by path only is looked up on the host, and a missing one fails the injection."""
    spec = slice_spec()
    spec["devices"][0]["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia-cdmo-absent"}]
    write_spec(tmp_path, "s.json", spec)
    result = validate(cdi_validate, "--cdi-dir", str(tmp_path), SLICE_DEVICE)
    assert result.returncode == 1
    assert 'failed to stat CDI host device "/dev/nvidia-cdmo-absent"' in result.stderr
    assert '"type": "c", "major": 195' in result.stderr  # the hint shows a complete node
    assert result.stdout == ""


def test_the_container_user_owns_the_nodes(cdi_validate, tmp_path):
    """Starting from a given OCI spec: its env stays, and nodes get the process's uid/gid."""
    write_spec(tmp_path / "cdi", "s.json", slice_spec())
    oci = {"ociVersion": "1.2.0", "process": {"user": {"uid": 1000, "gid": 2000}, "env": ["PATH=/usr/bin"], "cwd": "/"}}
    (tmp_path / "config.json").write_text(json.dumps(oci))
    full = tmp_path / "out.json"
    out = applied(cdi_validate, "--cdi-dir", str(tmp_path / "cdi"), "--oci-spec", str(tmp_path / "config.json"),
                  "--oci-out", str(full), SLICE_DEVICE)
    assert out["env"] == ["PATH=/usr/bin", *slice_spec()["devices"][0]["containerEdits"]["env"]]
    assert {(n["uid"], n["gid"]) for n in out["deviceNodes"]} == {(1000, 2000)}
    written = json.loads(full.read_text())
    assert written["process"]["env"] == out["env"]
    assert written["linux"]["devices"] == out["deviceNodes"]


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = slice_spec()
    spec.update(changes)
    return spec


def duplicate_device() -> dict[str, Any]:
    spec = slice_spec()
    spec["devices"].append(json.loads(json.dumps(spec["devices"][0])))
    return spec


def bad_device_name() -> dict[str, Any]:
    spec = slice_spec()
    spec["devices"][0]["name"] = "slice one"
    return spec


def unknown_field() -> dict[str, Any]:
    spec = slice_spec()
    spec["devices"][0]["containerEdits"]["envs"] = ["A=1"]
    return spec


def relative_mount() -> dict[str, Any]:
    spec = slice_spec()
    spec["devices"][0]["containerEdits"]["mounts"][0]["containerPath"] = ""
    return spec


@pytest.mark.parametrize(("spec", "message"), [
    (spec_with(kind="gpu.cdmo.io"), "invalid vendor"),
    (spec_with(kind="gpu.cdmo.io/sl!ce"), "invalid character '!' in name \"sl!ce\""),
    (duplicate_device(), f'multiple device "{SLICE_UID}"'),
    (bad_device_name(), "invalid character ' ' in device name \"slice one\""),
    (unknown_field(), "field envs not found"),
    (relative_mount(), "empty container path"),
    (spec_with(cdiVersion="9.9.9"), 'invalid version "9.9.9"'),
], ids=["kind-without-class", "bad-class", "duplicate-device", "bad-device-name", "unknown-field",
        "empty-mount-path", "unknown-version"])
def test_invalid_spec_is_refused(cdi_validate, tmp_path, spec, message):
    path = write_spec(tmp_path, "bad.json", spec)
    result = validate(cdi_validate, "--cdi-dir", str(tmp_path), SLICE_DEVICE)
    assert result.returncode == 1, result.stdout
    assert result.stdout == ""
    assert str(path) in result.stderr and message in result.stderr, result.stderr


def test_one_device_in_two_specs_is_a_conflict(cdi_validate, tmp_path):
    write_spec(tmp_path, "one.json", slice_spec())
    write_spec(tmp_path, "two.json", slice_spec())
    result = validate(cdi_validate, "--cdi-dir", str(tmp_path), SLICE_DEVICE)
    assert result.returncode == 1
    assert f'conflicting device "{SLICE_DEVICE}"' in result.stderr


def test_a_device_no_spec_defines_is_refused(cdi_validate, tmp_path):
    write_spec(tmp_path, "s.json", slice_spec())
    other = "gpu.cdmo.io/slice=00000000-0000-0000-0000-000000000000"
    result = validate(cdi_validate, "--cdi-dir", str(tmp_path), other)
    assert result.returncode == 1
    assert f"unresolvable CDI devices {other}" in result.stderr
    assert SLICE_DEVICE in result.stderr  # the ones it knows


@pytest.mark.parametrize("args", [
    ["gpu.cdmo.io/slice=x"],                      # no spec source
    ["--cdi-dir", "/nonexistent-cdi-dir", "gpu.cdmo.io/slice=x"],
    ["--cdi-dir", "/tmp"],                       # no device
    ["--cdi-dir", "/tmp", "slice-without-kind"],
], ids=["no-source", "missing-dir", "no-device", "unqualified-device"])
def test_bad_usage_exits_2_with_an_example(cdi_validate, args):
    result = validate(cdi_validate, *args)
    assert result.returncode == 2
    assert "example: cdi-validate --cdi-dir /var/run/cdi gpu.cdmo.io/slice=" in result.stderr
