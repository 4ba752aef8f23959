"""Whether a Ready slice's device is really on its node, before the controller hands it to a pod.

An agent writes ``status.deviceUUID``; the admission policy limits each agent to its own node's slices,
and this check keeps a wrong or forged UUID from reaching a pod: the device must be on the bound GPU
of the bound node's GpuNode, as that node's agent published it. A fraction's device is the GPU
itself (a GPU not in MIG mode); a MIG slice's device is an instance at the bound placement owned by
this slice, or by no slice yet (the agent writes Ready about a second before it republishes its
GpuNode). A device the GpuNode does not list yet is waited for, never handed on.

A pod's slice bound where its device needs no NVML call (an idle instance at exactly its placement,
or a fraction without a compute share on a GPU not in MIG mode) is handed on before its Ready
(``check_bound_device``): the node's GpuNode lists the device already, and the agent's kubelet plugin
waits for the slice's realisation, which records it and takes no GPU call, before it prepares the claim.

``check_slice_device`` is the one check the controller makes (through ``Ledger.check_device``), for
the slice's claim and for its pod alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..node.lifecycle import BOUND, READY
from ..placement.cluster import MODE_FRACTION, Binding, NodeInventory

ACCEPT = "accept"
WAIT = "wait"
REFUSE = "refuse"

# Event reasons (CamelCase, as Kubernetes reasons are).
DEVICE_MISMATCH = "DeviceMismatch"
DEVICE_NOT_LISTED = "DeviceNotListed"


@dataclass(frozen=True)
class DeviceVerdict:
    """``ACCEPT``: hand the device on; ``WAIT``: the GpuNode may not list it yet; ``REFUSE``: never."""

    action: str
    reason: str = ""
    message: str = ""


def _always_held(uid: str) -> bool:
    return True


def check_ready_device(uid: str, device_uuid: str, binding: Binding, inventory: NodeInventory | None,
                       held: Callable[[str], bool] = _always_held) -> DeviceVerdict:
    """Is ``device_uuid`` (a Ready slice's status) the device of slice ``uid``'s ``binding`` on
    ``inventory`` (the GpuNode of ``binding.node``, None when there is none)? ``held(owner)``: whether
    the slice a GpuNode names as an instance's owner still holds it (it exists and is not being
    deleted); one that does not was released, and its agent's next publish names the new owner."""
    where = f"GPU {binding.gpu} of node {binding.node}"
    if not device_uuid:
        return DeviceVerdict(REFUSE, DEVICE_MISMATCH, f"the slice is Ready on {where} but names no device")
    if inventory is None:
        return DeviceVerdict(WAIT, DEVICE_NOT_LISTED, f"node {binding.node} has no GpuNode yet to check "
                                                      f"device {device_uuid} against")
    gpu = next((g for g in inventory.gpus if g.index == binding.gpu), None)
    if gpu is None:
        return DeviceVerdict(REFUSE, DEVICE_MISMATCH, f"the GpuNode of node {binding.node} lists no GPU {binding.gpu}")
    if binding.mode == MODE_FRACTION:
        if gpu.mig_enabled:
            return DeviceVerdict(REFUSE, DEVICE_MISMATCH, f"{where} is in MIG mode; it serves no fractions")
        if device_uuid != gpu.uuid:
            return DeviceVerdict(REFUSE, DEVICE_MISMATCH,
                                 f"the slice names device {device_uuid}, but {where} is {gpu.uuid}")
        return DeviceVerdict(ACCEPT)
    instance = next((i for i in gpu.instances if i.device_uuid == device_uuid), None)
    if instance is None:
        # Elsewhere on the node (another GPU, or a whole GPU): wrong, whatever the lag.
        elsewhere = any(g.uuid == device_uuid or any(i.device_uuid == device_uuid for i in g.instances)
                        for g in inventory.gpus)
        if elsewhere:
            return DeviceVerdict(REFUSE, DEVICE_MISMATCH, f"device {device_uuid} is not an instance of {where}")
        return DeviceVerdict(WAIT, DEVICE_NOT_LISTED, f"the GpuNode of node {binding.node} does not list "
                                                      f"device {device_uuid} on GPU {binding.gpu} (yet)")
    if instance.slice_uid and instance.slice_uid != uid:
        if not held(instance.slice_uid):
            return DeviceVerdict(WAIT, DEVICE_NOT_LISTED, (
                f"the GpuNode of node {binding.node} still lists device {device_uuid} as released slice "
                f"{instance.slice or instance.slice_uid}'s"))
        return DeviceVerdict(REFUSE, DEVICE_MISMATCH, f"device {device_uuid} on {where} belongs to slice "
                                                      f"{instance.slice or instance.slice_uid}")
    if (instance.profile_id, instance.start, instance.size) != (binding.profile_id, binding.start, binding.size):
        return DeviceVerdict(REFUSE, DEVICE_MISMATCH, (
            f"device {device_uuid} is a {instance.profile or instance.profile_id} at {instance.start}:{instance.size}, "
            f"not the bound {binding.profile or binding.profile_id} at {binding.start}:{binding.size}"))
    return DeviceVerdict(ACCEPT)


def check_bound_device(uid: str, binding: Binding, inventory: NodeInventory | None) -> DeviceVerdict:
    """Whether slice ``uid``, bound by ``binding`` and not yet Ready, has a device its agent will take
    without an NVML call, listed as free for it on ``inventory`` (the GpuNode of ``binding.node``):
    ``ACCEPT`` for an idle instance (or one recorded for this slice) at exactly the bound placement, or
    a fraction without a compute share on a GPU not in MIG mode; ``WAIT`` for anything else (a new
    instance, an MPS share, a GpuNode that lists the instance with another owner yet): the slice's
    Ready and ``check_ready_device`` then decide."""
    gpu = None if inventory is None else next((g for g in inventory.gpus if g.index == binding.gpu), None)
    if gpu is None:
        return DeviceVerdict(WAIT)
    if binding.mode == MODE_FRACTION:
        free = binding.compute is None and not gpu.mig_enabled and bool(gpu.uuid)
        return DeviceVerdict(ACCEPT if free else WAIT)
    idle = any((i.profile_id, i.start, i.size) == (binding.profile_id, binding.start, binding.size)
               and i.device_uuid and i.slice_uid in ("", uid) and not i.in_use for i in gpu.instances)
    return DeviceVerdict(ACCEPT if idle else WAIT)


def check_slice_device(uid: str, phase: str | None, device_uuid: str, binding: Binding,
                       inventory: NodeInventory | None, early: bool,
                       held: Callable[[str], bool] = _always_held) -> DeviceVerdict:
    """Whether slice ``uid``, in ``phase`` with ``binding``, may have its device handed on: Ready with
    ``device_uuid`` checked (``check_ready_device``), or, a pod's slice (``early``), Bound onto a device
    its agent takes without an NVML call (``check_bound_device``); ``WAIT`` in any other phase."""
    if phase == READY:
        return check_ready_device(uid, device_uuid, binding, inventory, held)
    if phase == BOUND and early:
        return check_bound_device(uid, binding, inventory)
    return DeviceVerdict(WAIT)
