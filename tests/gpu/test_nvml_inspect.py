"""On a real GPU, our NVML inventory must say what ``nvidia-smi mig -lgip`` / ``-lgipp`` say.

Read-only: profiles and placements answer with MIG mode disabled (h200-nvml-capture.md), so this
test changes nothing on the GPU. It calls ``describe(open_backend("nvml"))`` directly rather than the
CLI, so it checks the backend whatever state the CLI is in.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest

from mig_operator.gpu import open_backend
from mig_operator.gpu.inventory import describe

# "|   0  MIG 1g.18gb       19     7/7        16.00      No     16     1     0   |"
_LGIP_ROW = re.compile(
    r"^\|\s*(?P<gpu>\d+)\s+MIG\s+(?P<name>\S+)\s+(?P<id>\d+)\s+(?P<free>\d+)/(?P<total>\d+)\s+(?P<gib>\d+\.\d+)\s"
)
# "GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1" and "GPU  0 Profile ID  5 Placement : {0}:4"
_LGIPP_ROW = re.compile(
    r"GPU\s+(?P<gpu>\d+)\s+Profile ID\s+(?P<id>\d+)\s+Placements?\s*:\s*\{(?P<starts>[0-9,]+)\}:(?P<size>\d+)"
)


def _smi(*args: str) -> str:
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"nvidia-smi {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def parse_lgip(text: str) -> dict[int, dict[int, dict[str, Any]]]:
    """GPU index -> profile id -> {name, instances, gib} from ``nvidia-smi mig -lgip``."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for line in text.splitlines():
        match = _LGIP_ROW.match(line)
        if match:
            found.setdefault(int(match["gpu"]), {})[int(match["id"])] = {
                "name": match["name"],
                "instances": int(match["total"]),
                "gib": float(match["gib"]),
            }
    return found


def parse_lgipp(text: str) -> dict[int, dict[int, list[list[int]]]]:
    """GPU index -> profile id -> [[start, size], ...] from ``nvidia-smi mig -lgipp``."""
    found: dict[int, dict[int, list[list[int]]]] = {}
    for line in text.splitlines():
        match = _LGIPP_ROW.search(line)
        if match:
            size = int(match["size"])
            starts = [int(s) for s in match["starts"].split(",") if s]
            found.setdefault(int(match["gpu"]), {})[int(match["id"])] = [[s, size] for s in starts]
    return found


def test_parsers_read_the_captured_format() -> None:
    # Guards the regexes themselves, so a silent parse of nothing cannot pass the real comparison.
    lgip = "|   0  MIG 1g.18gb       19     7/7        16.00      No     16     1     0   |"
    lgipp = "GPU  0 Profile ID  5 Placement : {0}:4\nGPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1"
    assert parse_lgip(lgip) == {0: {19: {"name": "1g.18gb", "instances": 7, "gib": 16.0}}}
    assert parse_lgipp(lgipp) == {0: {5: [[0, 4]], 19: [[s, 1] for s in range(7)]}}


@pytest.fixture
def inventory(gpu: str) -> dict[str, Any]:
    pytest.importorskip("pynvml")
    backend = open_backend("nvml")
    try:
        return describe(backend)
    finally:
        backend.close()


def test_nvml_inventory_matches_nvidia_smi(inventory: dict[str, Any]) -> None:
    mig_gpus = [g for g in inventory["gpus"] if g["mig_capable"]]
    if not mig_gpus:
        pytest.skip("no MIG-capable GPU on this machine")
    lgip_text, lgipp_text = _smi("mig", "-lgip"), _smi("mig", "-lgipp")
    lgip, lgipp = parse_lgip(lgip_text), parse_lgipp(lgipp_text)
    # A MIG-capable GPU is here, so nvidia-smi lists its profiles (it does with MIG disabled too, H200
    # capture): rows the parsers cannot read mean its format changed, which must fail, not skip.
    for gpu in mig_gpus:
        assert gpu["index"] in lgip, (
            f"could not parse a profile row of GPU {gpu['index']} from `nvidia-smi mig -lgip`:\n{lgip_text[:2000]}"
        )
        assert gpu["index"] in lgipp, (
            f"could not parse a placement row of GPU {gpu['index']} from `nvidia-smi mig -lgipp`:\n{lgipp_text[:2000]}"
        )
    for gpu in mig_gpus:
        ours = {p["id"]: p for p in gpu["profiles"]}
        smi = lgip[gpu["index"]]
        assert sorted(ours) == sorted(smi), f"GPU {gpu['index']}: profile ids differ"
        for pid, row in smi.items():
            mine = ours[pid]
            assert mine["name"] == row["name"], f"profile {pid}: name {mine['name']} vs {row['name']}"
            assert mine["max_instances"] == row["instances"], f"profile {pid}: instance count"
            # nvidia-smi prints GiB with two decimals; allow its rounding and nothing more.
            assert abs(mine["memory_mib"] / 1024 - row["gib"]) <= 0.0051, f"profile {pid}: memory"
            assert mine["placements"] == lgipp[gpu["index"]].get(pid), f"profile {pid}: placements"


def test_models_are_consistent(inventory: dict[str, Any]) -> None:
    for gpu in inventory["gpus"]:
        if not gpu["mig_capable"]:
            assert gpu["profiles"] == [] and gpu["instances"] == [] and not gpu["mig_enabled"]
            continue
        assert gpu["model"], "every MIG GPU gets a model name (catalog or slug)"
        slots = max(s + n for p in gpu["profiles"] for s, n in p["placements"])
        full = [p for p in gpu["profiles"] if p["placements"] == [[0, slots]]]
        assert full, "one profile spans the whole GPU"
        assert all(p["memory_mib"] <= gpu["memory_mib"] for p in gpu["profiles"])
