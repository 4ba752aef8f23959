"""The agent's MPS keeper against a recording control: which GPUs get a daemon, the ceiling each holds
(worked out here from the shares), stopping, adoption, and what it tells the slices and the GpuNode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry, OwnerRecord
from mig_operator.gpu.mps import MpsDirs, MpsError
from mig_operator.gpu.protocol import GpuInfo
from mig_operator.kube.agent.mps_keeper import MpsKeeper
from mig_operator.kube.common import status

GIB = 2**30
GPUS = [GpuInfo(0, "GPU-aaaa", "L4", 23034, False, False, 0), GpuInfo(1, "GPU-bbbb", "L4", 23034, False, False, 1)]


@dataclass
class Control:
    """Records what the keeper asks; ``broken`` GPUs cannot start."""

    running_now: set[str] = field(default_factory=set)
    broken: set[str] = field(default_factory=set)
    calls: list[tuple] = field(default_factory=list)

    def dirs(self, gpu_uuid: str) -> MpsDirs:
        return MpsDirs(f"/m/{gpu_uuid}", f"/m/{gpu_uuid}/pipe", f"/m/{gpu_uuid}/log", f"/m/{gpu_uuid}/shm")

    def running(self, gpu_uuid: str) -> bool:
        return gpu_uuid in self.running_now

    def start(self, gpu_uuid: str) -> None:
        self.calls.append(("start", gpu_uuid))
        if gpu_uuid in self.broken:
            raise MpsError(f"cannot start the MPS control daemon of {gpu_uuid}: broken")
        self.running_now.add(gpu_uuid)

    def hold(self, gpu_uuid: str, thread_percentage: int, pinned_bytes: int) -> None:
        self.calls.append(("hold", gpu_uuid, thread_percentage, pinned_bytes))

    def stop(self, gpu_uuid: str) -> None:
        self.calls.append(("stop", gpu_uuid))
        self.running_now.discard(gpu_uuid)


def entry(uid: str, gpu: int, compute: float | None, granted: int) -> OwnerEntry:
    return OwnerEntry(uid, f"team/{uid}", "fraction", gpu, COMPLETED, granted, device_uuid=GPUS[gpu].uuid,
                      compute=compute)


def keeper(control: Control, *entries: OwnerEntry) -> tuple[MpsKeeper, SimpleNamespace]:
    store = SimpleNamespace(record=OwnerRecord(owners={e.uid: e for e in entries}))
    return MpsKeeper(SimpleNamespace(all=GPUS), store, control, lambda: "T"), store  # type: ignore[arg-type]


def test_a_daemon_only_where_a_share_is_and_it_holds_the_largest_share_and_grant() -> None:
    control = Control()
    keep, store = keeper(control, entry("a", 0, 0.25, 4 * GIB), entry("b", 0, 0.5, 2 * GIB),
                         entry("c", 1, None, 8 * GIB))
    asyncio.run(keep.settle())
    # GPU 0: 50 % (0.5 is the largest share) and 4 GiB (the largest grant); GPU 1 holds no share
    assert control.calls == [("start", "GPU-aaaa"), ("hold", "GPU-aaaa", 50, 4 * GIB)]
    assert keep.condition()["status"] == "True" and keep.condition()["reason"] == "MPSDaemonsRunning"
    asyncio.run(keep.settle())  # nothing changed: nothing asked again but whether it answers
    assert len(control.calls) == 2
    del store.record.owners["b"]  # the largest share goes: the ceiling comes down
    asyncio.run(keep.settle())
    assert control.calls[-1] == ("hold", "GPU-aaaa", 25, 4 * GIB)
    del store.record.owners["a"]
    asyncio.run(keep.settle())
    assert control.calls[-1] == ("stop", "GPU-aaaa") and not control.running_now
    assert keep.condition()["reason"] == "NoComputeShares"


def test_a_daemon_that_answers_is_adopted_not_restarted_and_one_left_behind_is_stopped() -> None:
    control = Control(running_now={"GPU-aaaa", "GPU-bbbb"})
    keep, _ = keeper(control, entry("a", 0, 0.75, GIB))
    asyncio.run(keep.settle())
    assert ("start", "GPU-aaaa") not in control.calls
    assert ("hold", "GPU-aaaa", 75, GIB) in control.calls
    assert ("stop", "GPU-bbbb") in control.calls  # no share on GPU 1: the daemon an earlier agent left goes


def test_a_daemon_that_dies_and_cannot_start_is_told_to_the_slices_and_the_gpunode() -> None:
    control = Control()
    keep, _ = keeper(control, entry("a", 0, 0.25, GIB))
    told: list[tuple[str, bool, str]] = []

    async def on_change(uuid: str, ok: bool, why: str) -> None:
        told.append((uuid, ok, why))

    keep.on_change = on_change
    asyncio.run(keep.settle())
    assert told == [] and keep.condition()["status"] == "True"
    control.running_now.clear()
    control.broken.add("GPU-aaaa")
    asyncio.run(keep.settle())
    asyncio.run(keep.settle())  # said once
    assert told == [("GPU-aaaa", False, "cannot start the MPS control daemon of GPU-aaaa: broken")]
    cond = keep.condition()
    assert (cond["status"], cond["reason"]) == ("False", "MPSDaemonFailed") and "GPU 0 (GPU-aaaa)" in cond["message"]
    assert not keep.ready("GPU-aaaa")
    control.broken.clear()
    asyncio.run(keep.settle())
    assert told[-1][:2] == ("GPU-aaaa", True) and keep.ready("GPU-aaaa")
    assert keep.condition()["status"] == "True"


def test_no_condition_before_a_share_and_no_daemons_without_mps() -> None:
    keep, _ = keeper(Control())
    asyncio.run(keep.settle())
    assert keep.condition() is None
    none, _ = keeper(None, entry("a", 0, 0.25, GIB))  # type: ignore[arg-type]
    asyncio.run(none.settle())
    try:
        asyncio.run(none.ensure("GPU-aaaa", (25, GIB)))
    except MpsError as exc:
        assert "runs no MPS control daemons" in str(exc)
    else:
        raise AssertionError("a keeper without MPS started a daemon")


def test_a_ready_slice_says_its_daemon_is_down_and_keeps_its_phase() -> None:
    previous = status.ready(None, "GPU-aaaa", GIB, False, "ready")
    body = status.serving(previous, False, "MPSUnavailable", "the MPS control daemon of GPU-aaaa does not answer")
    assert "phase" not in body  # a merge patch: the phase stays Ready
    ready = next(c for c in body["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "MPSUnavailable")
    assert [c["type"] for c in body["conditions"]] == ["Bound", "Ready"]
    assert body["reason"] == "MPSUnavailable"
