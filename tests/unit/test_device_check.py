"""core.books.device_check: the controller hands a Ready slice's device on only when its node's GpuNode has it.

Each refusal is shown beside the one-field change that makes the same slice acceptable, so a check
that refused everything (or nothing) fails here.
"""

from __future__ import annotations

import pytest

from mig_operator.core.books.device_check import (
    ACCEPT,
    DEVICE_MISMATCH,
    DEVICE_NOT_LISTED,
    REFUSE,
    WAIT,
    check_bound_device,
    check_ready_device,
)
from mig_operator.core.placement.cluster import MODE_FRACTION, MODE_MIG, Binding, GpuState, InstanceState, NodeInventory

UID, OTHER_UID = "uid-of-the-slice", "uid-of-another-slice"
MIG_DEVICE = "MIG-0b5f0c5e-aaaa-bbbb-cccc-000000000001"
# The 1g.18gb profile of an H200 (id 19) at slot 2, one slot wide; 3g.71gb (id 9) spans four.
PROFILE_ID, PROFILE, START, SIZE = 19, "1g.18gb", 2, 1


def instance(device: str = MIG_DEVICE, owner: str = "", profile_id: int = PROFILE_ID, start: int = START,
             size: int = SIZE) -> InstanceState:
    return InstanceState(gi_id=3, ci_id=0, profile_id=profile_id, profile=PROFILE, start=start, size=size,
                         device_uuid=device, slice_uid=owner, slice="team/other" if owner else "")


def node(*instances: InstanceState, mig: bool = True) -> NodeInventory:
    gpus = (GpuState(0, "GPU-node-a-0", mig_enabled=mig, instances=instances),
            GpuState(1, "GPU-node-a-1", mig_enabled=mig,
                     instances=(instance("MIG-on-gpu-1"),) if mig else ()))
    return NodeInventory("node-a", gpus)


MIG = Binding(UID, "node-a", 0, MODE_MIG, 16384 * 2**20, PROFILE_ID, PROFILE, START, SIZE)
FRACTION = Binding(UID, "node-a", 0, MODE_FRACTION, 4 * 2**30)


def test_a_mig_device_the_gpunode_lists_at_the_bound_placement_is_accepted_owned_or_not_yet() -> None:
    assert check_ready_device(UID, MIG_DEVICE, MIG, node(instance(owner=UID))).action == ACCEPT
    # The agent writes Ready before it republishes its GpuNode: an idle (reused) instance shows no owner yet.
    assert check_ready_device(UID, MIG_DEVICE, MIG, node(instance(owner=""))).action == ACCEPT


def test_a_mig_device_of_another_slice_is_refused() -> None:
    verdict = check_ready_device(UID, MIG_DEVICE, MIG, node(instance(owner=OTHER_UID)))
    assert (verdict.action, verdict.reason) == (REFUSE, DEVICE_MISMATCH)
    assert MIG_DEVICE in verdict.message and "team/other" in verdict.message


def test_a_mig_device_the_gpunode_still_lists_as_a_released_slices_is_waited_for_not_refused() -> None:
    # The agent released the other slice and reused its idle instance for this one; its GpuNode's next
    # publish names the new owner. Until then nothing is handed on, and no mismatch is reported.
    released = {OTHER_UID: False, UID: True}
    verdict = check_ready_device(UID, MIG_DEVICE, MIG, node(instance(owner=OTHER_UID)), released.__getitem__)
    assert (verdict.action, verdict.reason) == (WAIT, DEVICE_NOT_LISTED)
    assert MIG_DEVICE in verdict.message and "released" in verdict.message
    held = {OTHER_UID: True, UID: True}
    assert check_ready_device(UID, MIG_DEVICE, MIG, node(instance(owner=OTHER_UID)), held.__getitem__).action == REFUSE


@pytest.mark.parametrize(("profile_id", "start", "size"), [(9, START, SIZE), (PROFILE_ID, START + 1, SIZE),
                                                            (PROFILE_ID, START - 1, SIZE), (PROFILE_ID, START, 2)])
def test_a_mig_device_at_another_placement_or_profile_is_refused(profile_id: int, start: int, size: int) -> None:
    verdict = check_ready_device(UID, MIG_DEVICE, MIG, node(instance(profile_id=profile_id, start=start, size=size)))
    assert verdict.action == REFUSE
    assert f"{start}:{size}" in verdict.message and f"{START}:{SIZE}" in verdict.message


def test_a_device_elsewhere_on_the_node_is_refused_and_one_listed_nowhere_is_waited_for() -> None:
    inventory = node(instance(owner=UID))
    for elsewhere in ("MIG-on-gpu-1", "GPU-node-a-0", "GPU-node-a-1"):
        verdict = check_ready_device(UID, elsewhere, MIG, inventory)
        assert (verdict.action, verdict.reason) == (REFUSE, DEVICE_MISMATCH), elsewhere
        assert elsewhere in verdict.message
    # Another node's device, or one just made: not listed here (yet). Waited for, never handed on.
    verdict = check_ready_device(UID, "MIG-not-published-yet", MIG, inventory)
    assert (verdict.action, verdict.reason) == (WAIT, DEVICE_NOT_LISTED)
    assert "MIG-not-published-yet" in verdict.message and "node-a" in verdict.message


def test_a_fraction_device_must_be_its_bound_gpu_not_in_mig_mode() -> None:
    fractions = node(mig=False)
    assert check_ready_device(UID, "GPU-node-a-0", FRACTION, fractions).action == ACCEPT
    for wrong in ("GPU-node-a-1", "GPU-of-node-b", MIG_DEVICE):
        verdict = check_ready_device(UID, wrong, FRACTION, fractions)
        assert (verdict.action, verdict.reason) == (REFUSE, DEVICE_MISMATCH), wrong
        assert wrong in verdict.message and "GPU-node-a-0" in verdict.message
    verdict = check_ready_device(UID, "GPU-node-a-0", FRACTION, node(mig=True))
    assert verdict.action == REFUSE and "MIG mode" in verdict.message


def test_a_gpu_the_gpunode_lacks_no_gpunode_and_no_device() -> None:
    beyond = Binding(UID, "node-a", 2, MODE_FRACTION, 2**30)  # node-a has GPUs 0 and 1
    verdict = check_ready_device(UID, "GPU-node-a-2", beyond, node(mig=False))
    assert verdict.action == REFUSE and "no GPU 2" in verdict.message
    last = Binding(UID, "node-a", 1, MODE_FRACTION, 2**30)
    assert check_ready_device(UID, "GPU-node-a-1", last, node(mig=False)).action == ACCEPT
    verdict = check_ready_device(UID, "GPU-node-a-0", FRACTION, None)
    assert (verdict.action, verdict.reason) == (WAIT, DEVICE_NOT_LISTED) and "node-a" in verdict.message
    assert check_ready_device(UID, "", FRACTION, node(mig=False)).action == REFUSE


# A slice bound and not yet Ready: handed on at once only where its agent takes the device without an
# NVML call, and only onto what the GpuNode lists as free for it; else its Ready is waited for.
def test_a_bound_mig_slice_onto_an_idle_instance_at_its_placement_is_handed_on_before_its_ready() -> None:
    assert check_bound_device(UID, MIG, node(instance(owner=""))).action == ACCEPT
    assert check_bound_device(UID, MIG, node(instance(owner=UID))).action == ACCEPT  # recorded, not yet Ready


@pytest.mark.parametrize("change", ["another owner", "no instance", "other placement", "other profile", "in use",
                                    "no device", "no gpunode", "no such gpu"])
def test_a_bound_mig_slice_waits_for_its_ready_unless_its_idle_instance_is_listed(change: str) -> None:
    inst = {"another owner": instance(owner=OTHER_UID),
            "other placement": instance(start=START + 1),
            "other profile": instance(profile_id=9),
            "in use": InstanceState(3, 0, PROFILE_ID, PROFILE, START, SIZE, MIG_DEVICE, in_use=True),
            "no device": instance(device="")}.get(change)
    inventory = None if change == "no gpunode" else node(*(() if inst is None else (inst,)))
    binding = Binding(UID, "node-a", 7, MODE_MIG, 16384 * 2**20, PROFILE_ID, PROFILE, START, SIZE) \
        if change == "no such gpu" else MIG
    assert check_bound_device(UID, binding, inventory).action == WAIT


def test_a_bound_fraction_is_handed_on_before_its_ready_only_without_a_compute_share() -> None:
    assert check_bound_device(UID, FRACTION, node(mig=False)).action == ACCEPT
    shared = Binding(UID, "node-a", 0, MODE_FRACTION, 4 * 2**30, compute=0.25)  # MPS: its daemon may start
    assert check_bound_device(UID, shared, node(mig=False)).action == WAIT
    assert check_bound_device(UID, FRACTION, node(mig=True)).action == WAIT  # in MIG mode: the agent refuses it
