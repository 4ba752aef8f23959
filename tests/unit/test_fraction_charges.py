"""A namespace pays for what it denies others: a fraction GPU it holds alone is charged whole, once.

The expected charges are written out by hand from the GPUs' sizes (an L40S is 46068 MiB), never read
from the code under test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mig_operator.core.books.ledger import Ledger, NodeLabels, NodeRecord, SliceRecord
from mig_operator.core.books.quota import QUOTA_EXCEEDED, QUOTA_NAME, Usage
from mig_operator.core.placement.cluster import MODE_FRACTION, GpuState, NodeInventory
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.placement.tenancy import OTHER_NAMESPACE
from mig_operator.core.requests.quantities import MIB
from mig_operator.core.requests.request import SliceRequest, slice_request

L40S_MIB = 46068  # NVML's memory of an L40S, as the catalog has it
L40S = L40S_MIB * MIB
GIB = 2**30


def l40s(index: int) -> GpuState:
    model = get_model("l40s-48gb")
    return GpuState(index, f"GPU-l40s-{index}", model.product, model.name, model.memory_mib, False, False, ())


def ledger_with(gpus: int = 3, sharing: bool = False) -> Ledger:
    ledger = Ledger()
    ledger.put_inventory(NodeInventory("n1", tuple(l40s(i) for i in range(gpus))))
    if sharing:
        ledger.put_node("n1", NodeRecord(flags=NodeLabels(sharing=True)))
    return ledger


def quota(ledger: Ledger, namespace: str, memory: str, slices: int | None = None) -> None:
    spec: dict = {"memory": memory} if slices is None else {"memory": memory, "slices": slices}
    assert ledger.put_quota({"metadata": {"namespace": namespace, "name": QUOTA_NAME}, "spec": spec})


def ask(ledger: Ledger, uid: str, namespace: str, request: SliceRequest, pinned: str | None = None) -> str:
    """Make the slice and plan it; a binding is written at once. Returns 'n1/<gpu>' or the refusal code."""
    info = SliceRecord(uid=uid, namespace=namespace, name=uid, created=f"2026-11-27T00:00:{len(ledger.slices):02d}Z",
                       version=1, body={"metadata": {"uid": uid}}, request=request, invalid="", pinned=pinned,
                       phase=None, binding=None, deleting=False, marked=False)
    ledger.put_slice(info)
    decision = ledger.decide(uid)
    if decision.kind == "refuse":
        assert decision.refusal is not None
        ask.messages[uid] = decision.refusal.message  # type: ignore[attr-defined]
        return decision.refusal.code
    (binding,) = decision.bindings
    ledger.put_slice(replace(info, version=2, phase="Bound", binding=binding))
    ledger.commit(uid)
    assert binding.mode == MODE_FRACTION
    return f"{binding.node}/{binding.gpu}"


ask.messages = {}  # type: ignore[attr-defined]
ONE_GIB_ALONE = slice_request(memory="1Gi", compute=1.0)  # a compute share of 1 takes a GPU alone
ONE_GIB = slice_request(memory="1Gi")


def test_three_gib_of_quota_cannot_keep_another_namespace_off_every_fraction_gpu() -> None:
    ledger = ledger_with(3)
    quota(ledger, "team-b", "3Gi", 3)
    got = [ask(ledger, f"b{i}", "team-b", ONE_GIB_ALONE) for i in range(3)]
    # Each would hold a 46068 MiB GPU alone: past 3Gi, so none binds.
    assert got == [QUOTA_EXCEEDED] * 3
    message = ask.messages["b0"]  # type: ignore[attr-defined]
    for part in ("fraction tenancy rule", "GPU 0 of node n1", "its whole memory", "46068Mi",
                 "cdmo.io/fraction-sharing=cross-namespace"):
        assert part in message, message
    assert ledger.used("team-b") == Usage()
    assert ask(ledger, "a0", "team-a", slice_request(memory="40Gi")) == "n1/0"


def test_a_quota_that_holds_one_gpu_holds_one_and_no_more() -> None:
    ledger = ledger_with(3)
    quota(ledger, "team-b", "50Gi", 3)
    got = [ask(ledger, f"b{i}", "team-b", ONE_GIB_ALONE) for i in range(3)]
    assert got == ["n1/0", QUOTA_EXCEEDED, QUOTA_EXCEEDED]
    assert ledger.used("team-b") == Usage(L40S, 1, 1)
    assert ledger.held_whole("team-b") == {("n1", 0): L40S}
    assert "GPU 1 of node n1" in ask.messages["b1"]  # type: ignore[attr-defined]
    # The other GPUs stay for team-a; its refusal-free binding goes to one team-b does not hold.
    assert ask(ledger, "a0", "team-a", slice_request(memory="40Gi")) in ("n1/1", "n1/2")


def test_fractions_of_a_namespace_go_to_the_gpu_it_holds_first_and_are_charged_it_once() -> None:
    ledger = ledger_with(3)
    quota(ledger, "team-b", "50Gi", 8)
    assert [ask(ledger, f"b{i}", "team-b", ONE_GIB, pinned="n1") for i in range(5)] == ["n1/0"] * 5
    assert ledger.used("team-b") == Usage(L40S, 5, 1)
    # Released one by one, the GPU stays charged until its last fraction goes.
    for i in range(4):
        ledger.remove_slice(f"b{i}")
        assert ledger.used("team-b") == Usage(L40S, 4 - i, 1)
    ledger.remove_slice("b4")
    assert ledger.used("team-b") == Usage() and ledger.held_whole("team-b") == {}


def test_a_namespace_prefers_its_own_gpu_over_a_better_fit_it_would_take_whole() -> None:
    ledger = ledger_with(2)
    assert ask(ledger, "b0", "team-b", slice_request(memory="4Gi")) == "n1/0"
    assert ask(ledger, "a0", "team-a", slice_request(memory="40Gi")) == "n1/1"
    ledger.remove_slice("a0")  # GPU 1 free again, GPU 0 held by team-b with 4Gi used
    # Best fit alone would pick either; the one it holds adds nothing to its charge.
    assert ask(ledger, "b1", "team-b", slice_request(memory="30Gi")) == "n1/0"
    assert ledger.used("team-b") == Usage(L40S, 2, 1)


def test_on_a_sharing_node_each_fraction_is_charged_its_own_grant() -> None:
    ledger = ledger_with(3, sharing=True)
    quota(ledger, "team-b", "3Gi", 3)
    assert [ask(ledger, f"b{i}", "team-b", ONE_GIB) for i in range(3)] == ["n1/0"] * 3
    assert ledger.used("team-b") == Usage(3 * GIB, 3, 0)
    assert ask(ledger, "b3", "team-b", ONE_GIB) == QUOTA_EXCEEDED  # the slice count, 3


@pytest.mark.parametrize("to_sharing", [True, False])
def test_a_change_of_the_sharing_label_charges_the_node_s_fractions_again(to_sharing: bool) -> None:
    ledger = ledger_with(2, sharing=not to_sharing)
    for i in range(3):
        ask(ledger, f"b{i}", "team-b", ONE_GIB)
    changed = ledger.put_node("n1", NodeRecord(flags=NodeLabels(sharing=to_sharing)))
    assert changed == {"team-b"}
    assert ledger.used("team-b") == (Usage(3 * GIB, 3, 0) if to_sharing else Usage(L40S, 3, 1))


def test_a_refusal_for_tenancy_names_nothing_of_the_other_namespace() -> None:
    ledger = ledger_with(1)
    assert ask(ledger, "b0", "team-b", ONE_GIB) == "n1/0"
    assert ask(ledger, "a0", "team-a", ONE_GIB) == OTHER_NAMESPACE
    message = ask.messages["a0"]  # type: ignore[attr-defined]
    assert "held by another namespace" in message
    for secret in ("team-b", "n1", "GPU 0"):
        assert secret not in message, message


def test_fractions_bound_before_their_gpu_is_known_are_charged_its_size_once_it_is() -> None:
    from books import BodyLedger

    def bound(uid: str, gpu: int) -> dict:
        return {"metadata": {"uid": uid, "namespace": "team-b", "name": uid, "resourceVersion": "1",
                             "creationTimestamp": "2026-11-27T00:00:00Z"},
                "spec": {"memory": "4Gi"},
                "status": {"phase": "Ready", "node": "n1", "gpu": gpu, "mode": "fraction", "grantedBytes": 4 * GIB}}

    state = BodyLedger()
    for uid in ("x", "y"):
        state.put_slice(bound(uid, 0))
    state.put_slice(bound("z", 1))
    # No GpuNode yet: each GPU charged the largest grant there, once.
    assert state.used("team-b") == Usage(2 * 4 * GIB, 3, 2)
    gpus = [{"index": i, "uuid": f"GPU-{i}", "memoryMiB": L40S_MIB} for i in range(2)]
    assert state.put_inventory({"metadata": {"name": "n1"}, "spec": {"nodeName": "n1"},
                                "status": {"gpus": gpus}}) == {"team-b"}
    assert state.used("team-b") == Usage(2 * L40S, 3, 2)
    state.remove_slice("x")
    assert state.used("team-b") == Usage(2 * L40S, 2, 2)
    state.remove_slice("y")
    assert state.used("team-b") == Usage(L40S, 1, 1)
