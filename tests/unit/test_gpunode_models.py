"""The GpuNode status publishes each GPU model's profile table once (``status.models``) and each GPU
names its model: the agent's body (kube/agent/inventory.gpunode_status) against bodies written by hand,
and the controller's reading of it (core.placement.cluster.inventory_from_status) on nodes of several models."""

from __future__ import annotations

import json

from mig_operator.core.node.lifecycle import OwnerRecord
from mig_operator.core.placement.cluster import inventory_from_status
from mig_operator.core.placement.profiles import GpuModel, Placement, Profile, get_model
from mig_operator.gpu.protocol import GpuInfo, MigInstance
from mig_operator.kube.agent.inventory import gpunode_status

# Two small boards, so that the expected tables below can be written out in full.
BOARD_A = GpuModel("board-a", "Board A", 2, 20000, (
    Profile("1g.10gb", 19, 1, 9856, 16, 2, (Placement(0, 1), Placement(1, 1))),
    Profile("2g.20gb", 0, 2, 19968, 32, 1, (Placement(0, 2),)),
))
BOARD_B = GpuModel("board-b", "Board B", 1, 10000, (
    Profile("1g.10gb", 0, 1, 9856, 14, 1, (Placement(0, 1),)),
))
TABLE_A = [
    {"name": "1g.10gb", "id": 19, "slices": 1, "memoryMiB": 9856, "sm": 16, "maxInstances": 2,
     "placements": [{"start": 0, "size": 1}, {"start": 1, "size": 1}]},
    {"name": "2g.20gb", "id": 0, "slices": 2, "memoryMiB": 19968, "sm": 32, "maxInstances": 1,
     "placements": [{"start": 0, "size": 2}]},
]
TABLE_B = [
    {"name": "1g.10gb", "id": 0, "slices": 1, "memoryMiB": 9856, "sm": 14, "maxInstances": 1,
     "placements": [{"start": 0, "size": 1}]},
]
# Every field a GPU entry has (docs/api.md); the profile table is not one of them.
GPU_FIELDS = {"index", "uuid", "product", "model", "memoryMiB", "migCapable", "migEnabled", "serves", "servesReason",
              "instances", "fractions", "grantedBytes"}


def mixed_node() -> tuple[list[GpuInfo], dict[int, GpuModel | None]]:
    """GPU 0 and 2: board A in MIG mode; GPU 1: board B with MIG off; GPU 3: a board without MIG."""
    infos = [GpuInfo(0, "GPU-0", "Board A", 20000, True, True), GpuInfo(1, "GPU-1", "Board B", 10000, True, False),
             GpuInfo(2, "GPU-2", "Board A", 20000, True, True), GpuInfo(3, "GPU-3", "NVIDIA L4", 23034, False, False)]
    return infos, {0: BOARD_A, 1: BOARD_B, 2: BOARD_A, 3: None}


def test_each_model_is_published_once_and_each_gpu_names_its_own() -> None:
    infos, models = mixed_node()
    status = gpunode_status(infos, models, {0: [], 1: [], 2: [], 3: []}, OwnerRecord(), True, "t")
    assert status["models"] == [{"name": "board-a", "profiles": TABLE_A}, {"name": "board-b", "profiles": TABLE_B}]
    assert [(g["index"], g["model"]) for g in status["gpus"]] == [(0, "board-a"), (1, "board-b"), (2, "board-a"),
                                                                   (3, "")]
    for gpu in status["gpus"]:
        assert set(gpu) - {"compute"} == GPU_FIELDS


def test_a_node_without_mig_publishes_no_model() -> None:
    infos = [GpuInfo(0, "GPU-0", "NVIDIA L4", 23034, False, False)]
    status = gpunode_status(infos, {0: None}, {0: []}, OwnerRecord(), False, "t")
    assert status["models"] == [] and status["gpus"][0]["model"] == ""


def test_two_boards_sharing_a_name_but_not_a_table_get_names_of_their_own() -> None:
    twin = GpuModel("board-a", "Board A", 1, 10000, BOARD_B.profiles)  # NVML named it alike, its table differs
    infos = [GpuInfo(i, f"GPU-{i}", "Board A", 20000, True, True) for i in range(3)]
    status = gpunode_status(infos, {0: BOARD_A, 1: twin, 2: BOARD_A}, {0: [], 1: [], 2: []}, OwnerRecord(), True, "t")
    assert status["models"] == [{"name": "board-a", "profiles": TABLE_A}, {"name": "board-a-2", "profiles": TABLE_B}]
    assert [g["model"] for g in status["gpus"]] == ["board-a", "board-a-2", "board-a"]
    inv = inventory_from_status("n", status)
    assert [len(g.profiles) for g in inv.gpus] == [2, 1, 2]


def test_the_controller_reads_each_gpus_table_and_instances_of_a_mixed_node() -> None:
    infos, models = mixed_node()
    inst = MigInstance(2, 5, 0, 19, "1g.10gb", 1, 1, "MIG-5", False)
    status = gpunode_status(infos, models, {0: [], 1: [], 2: [inst], 3: []}, OwnerRecord(), True, "t")
    inv = inventory_from_status("n", json.loads(json.dumps(status)))  # as it comes back from the API
    assert [(g.index, g.model, g.profiles) for g in inv.gpus] == [
        (0, "board-a", BOARD_A.profiles), (1, "board-b", BOARD_B.profiles), (2, "board-a", BOARD_A.profiles),
        (3, "", ())]
    assert [(i.profile_id, i.start, i.size, i.device_uuid) for i in inv.gpus[2].instances] == [(19, 1, 1, "MIG-5")]
    # The counters see board A's 2 slots per GPU: one taken by the idle instance, three free.
    assert (status["idleSlots"], status["freeSlots"], status["idleInstances"]) == (1, 3, 1)


def test_eight_gpus_of_one_model_carry_the_table_once() -> None:
    h100 = get_model("h100-80gb")
    infos = [GpuInfo(i, f"GPU-{i}", h100.product, h100.memory_mib, True, True) for i in range(8)]
    status = gpunode_status(infos, {i: h100 for i in range(8)}, {i: [] for i in range(8)}, OwnerRecord(), True, "t")
    text = json.dumps(status)
    assert [m["name"] for m in status["models"]] == ["h100-80gb"]
    # Each profile's name appears once in the whole body, in the one table.
    for p in h100.profiles:
        assert text.count(json.dumps(p.name)) == 1
