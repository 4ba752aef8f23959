"""core.placement.cluster: the controller's cluster view and the binding of one slice to a GPU.

Expected values are computed here from the catalog (placements, MiB figures), never read back from
the code under test: slot masks are built slot by slot, bytes from MiB times 2**20.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
from cluster_reference import build_view, plan_binding
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry, OwnerRecord
from mig_operator.core.placement.cluster import (
    MAX_MESSAGE,
    MODE_FRACTION,
    MODE_MIG,
    NO_CAPACITY,
    NO_GPU,
    NO_SUCH_PROFILE,
    ROLE_NONE,
    TOO_LARGE,
    Binding,
    GpuState,
    InstanceState,
    NodeInventory,
    Refusal,
    binding_from_status,
    gpu_role,
    inventory_from_status,
    model_of,
)
from mig_operator.core.placement.profiles import CATALOG, Placement, Profile, get_model
from mig_operator.core.requests.request import SliceRequest
from mig_operator.gpu.protocol import GpuInfo, MigInstance
from mig_operator.kube.agent.inventory import gpunode_status

MiB = 2**20
GiB = 2**30
H200 = get_model("h200-141gb")
H100 = get_model("h100-80gb")
A30 = get_model("a30-24gb")
L4 = get_model("l4-24gb")
L40S = get_model("l40s-48gb")
REFUSAL_CODES = {NO_GPU, TOO_LARGE, NO_SUCH_PROFILE, NO_CAPACITY, "TooSmall", "NoSuchNode"}


# --- helpers ------------------------------------------------------------------------------------


def slots(start: int, size: int) -> int:
    """The slots of a placement as a bit mask, built one slot at a time."""
    mask = 0
    for s in range(start, start + size):
        mask |= 1 << s
    return mask


def gpu(model, index: int = 0, *, mig_enabled: bool | None = None, instances=()) -> GpuState:
    enabled = bool(model.profiles) if mig_enabled is None else mig_enabled
    return GpuState(index=index, uuid=f"GPU-{model.name}-{index}", product=model.product, model=model.name,
                    memory_mib=model.memory_mib, mig_capable=bool(model.profiles), mig_enabled=enabled,
                    profiles=model.profiles, instances=tuple(instances))


def inst(model, name: str, start: int, gi: int, *, uid: str = "", in_use: bool = False, ci: int = 0,
         device: str | None = None) -> InstanceState:
    p = model.profile(name)
    assert start in [pl.start for pl in p.placements], "test set-up: not a legal placement"
    return InstanceState(gi_id=gi, ci_id=ci, profile_id=p.id, profile=p.name, start=start, size=p.placements[0].size,
                         device_uuid=f"MIG-{gi}" if device is None else device, in_use=in_use, slice_uid=uid,
                         slice=f"ns/{uid}" if uid else "")


def mig_binding(uid: str, node: str, index: int, model, name: str, start: int) -> Binding:
    p = model.profile(name)
    return Binding(uid, node, index, MODE_MIG, p.memory_mib * MiB, p.id, p.name, start, p.placements[0].size)


def mem(n: int) -> SliceRequest:
    return SliceRequest(memory_bytes=n)


def plan(request, inventories, labelled, bindings=(), node=None) -> Binding:
    return plan_binding(request, build_view(inventories, labelled, bindings), node)


def refusal(request, inventories, labelled, bindings=(), node=None) -> Refusal:
    with pytest.raises(Refusal) as info:
        plan(request, inventories, labelled, bindings, node)
    assert len(info.value.message) <= MAX_MESSAGE
    return info.value


def slot_view(view, node: str, index: int) -> set[tuple[int, int, int, bool]]:
    g = next(g for g in view.mig if g.node == node and g.index == index)
    return {(s.profile_id, s.start, s.size, s.in_use) for s in g.instances}


def largest_plain_mib(model) -> int:
    return max(p.memory_mib for p in model.profiles if p.placements)


# --- bindings in flight ---------------------------------------------------------------------------


def test_binding_not_yet_in_inventory_holds_its_placement() -> None:
    nodes = [NodeInventory("a", (gpu(H200),))]
    first = plan(mem(100 * GiB), nodes, {"a"})  # only 7g.141gb holds 102400 MiB
    assert (first.mode, first.profile, first.start) == (MODE_MIG, "7g.141gb", 0)
    held = Binding("u1", first.node, first.gpu, first.mode, first.granted_bytes, first.profile_id, first.profile,
                   first.start, first.size)
    # The inventory still shows an empty GPU; the binding alone must keep the next request off it.
    r = refusal(mem(1), nodes, {"a"}, [held])
    assert r.code == NO_CAPACITY


def test_binding_in_flight_shows_as_an_in_use_slot_in_the_view() -> None:
    b = mig_binding("u1", "a", 0, H200, "2g.35gb", 2)
    view = build_view([NodeInventory("a", (gpu(H200),))], {"a"}, [b])
    assert slot_view(view, "a", 0) == {(14, 2, 2, True)}


def test_inventory_instance_overlapped_by_a_binding_is_treated_as_reclaimed() -> None:
    # Idle 1g instances at slots 0 and 5; a binding of 3g.71gb at 0 (slots 0..3) reclaims the first only.
    insts = (inst(H200, "1g.18gb", 0, 1), inst(H200, "1g.18gb", 5, 2))
    b = mig_binding("u1", "a", 0, H200, "3g.71gb", 0)
    view = build_view([NodeInventory("a", (gpu(H200, instances=insts),))], {"a"}, [b])
    p19 = H200.profile("1g.18gb").id
    p9 = H200.profile("3g.71gb").id
    assert slot_view(view, "a", 0) == {(p9, 0, 4, True), (p19, 5, 1, False)}


def test_binding_on_another_gpu_does_not_reclaim() -> None:
    insts = (inst(H200, "1g.18gb", 0, 1),)
    b = mig_binding("u1", "a", 1, H200, "7g.141gb", 0)
    view = build_view([NodeInventory("a", (gpu(H200, 0, instances=insts), gpu(H200, 1)))], {"a"}, [b])
    assert slot_view(view, "a", 0) == {(H200.profile("1g.18gb").id, 0, 1, False)}


def test_instance_owned_by_a_live_binding_is_in_use() -> None:
    insts = (inst(H200, "1g.18gb", 0, 1, uid="owner"),)
    live = mig_binding("owner", "a", 0, H200, "1g.18gb", 0)
    nodes = [NodeInventory("a", (gpu(H200, instances=insts),))]
    got = plan(mem(GiB), nodes, {"a"}, [live])
    assert got.profile == "1g.18gb"
    assert not slots(got.start, got.size) & slots(0, 1), "handed out the live slice's instance"


def test_instance_whose_owner_is_live_elsewhere_is_still_in_use() -> None:
    # The record names "owner"; its binding (a lagging status) is on GPU 1. The UID alone keeps it.
    insts = (inst(H200, "1g.18gb", 0, 1, uid="owner"),)
    live = mig_binding("owner", "a", 1, H200, "1g.18gb", 3)
    view = build_view([NodeInventory("a", (gpu(H200, 0, instances=insts), gpu(H200, 1)))], {"a"}, [live])
    assert slot_view(view, "a", 0) == {(H200.profile("1g.18gb").id, 0, 1, True)}


def test_instance_whose_owner_is_gone_is_idle_and_reused() -> None:
    insts = (inst(H200, "1g.18gb", 3, 7, uid="gone"),)
    nodes = [NodeInventory("a", (gpu(H200, instances=insts),))]
    view = build_view(nodes, {"a"}, [])
    assert slot_view(view, "a", 0) == {(H200.profile("1g.18gb").id, 3, 1, False)}
    got = plan(mem(GiB), nodes, {"a"})
    assert (got.profile, got.start) == ("1g.18gb", 3)


@pytest.mark.parametrize(("ci", "device"), [(-1, "MIG-x"), (0, ""), (-1, "")])
def test_incomplete_instance_is_never_reused(ci: int, device: str) -> None:
    insts = (inst(H200, "1g.18gb", 0, 1, ci=ci, device=device),)
    nodes = [NodeInventory("a", (gpu(H200, instances=insts),))]
    got = plan(mem(GiB), nodes, {"a"})
    assert not slots(got.start, got.size) & slots(0, 1)


def test_incomplete_instance_is_not_reclaimed_either() -> None:
    # An A30's 4g.24gb spans all 4 slots; half-made, it leaves no room at all.
    insts = (inst(A30, "4g.24gb", 0, 1, ci=-1, device=""),)
    r = refusal(mem(GiB), [NodeInventory("a", (gpu(A30, instances=insts),))], {"a"})
    assert r.code == NO_CAPACITY


def test_instance_nvml_reports_in_use_is_not_reclaimed() -> None:
    insts = (inst(A30, "4g.24gb", 0, 1, in_use=True),)
    r = refusal(mem(GiB), [NodeInventory("a", (gpu(A30, instances=insts),))], {"a"})
    assert r.code == NO_CAPACITY


def test_idle_complete_instances_are_reclaimed_rather_than_falling_back_to_fractions() -> None:
    idle = tuple(inst(H200, "1g.18gb", s, s + 1) for s in range(7))
    nodes = [NodeInventory("a", (gpu(H200, instances=idle),)), NodeInventory("f", (gpu(L4),))]
    got = plan(mem(20 * GiB), nodes, {"a"})
    assert got.mode == MODE_MIG and got.node == "a"


# --- roles ------------------------------------------------------------------------------------------


def test_role_mig_enabled_and_labelled_serves_mig() -> None:
    role, _ = gpu_role(True, gpu(H200, mig_enabled=True))
    assert role == MODE_MIG


def test_role_mig_enabled_but_unlabelled_serves_nothing_new() -> None:
    role, why = gpu_role(False, gpu(H200, mig_enabled=True))
    assert role == ROLE_NONE
    assert "label" in why
    r = refusal(mem(GiB), [NodeInventory("a", (gpu(H200, mig_enabled=True),))], set())
    assert r.code == NO_GPU


def test_role_labelled_with_mig_disabled_serves_fractions_and_says_why() -> None:
    role, why = gpu_role(True, gpu(H200, 3, mig_enabled=False))
    assert role == MODE_FRACTION
    assert "MIG mode is disabled" in why and "3" in why
    got = plan(mem(GiB), [NodeInventory("a", (gpu(H200, 3, mig_enabled=False),))], {"a"})
    assert (got.mode, got.gpu, got.granted_bytes) == (MODE_FRACTION, 3, GiB)


@pytest.mark.parametrize("labelled", [True, False])
def test_role_gpu_without_mig_serves_fractions(labelled: bool) -> None:
    role, _ = gpu_role(labelled, gpu(L4))
    assert role == MODE_FRACTION


# --- MIG first, then fractions ------------------------------------------------------------------------


def test_memory_request_prefers_mig_and_falls_back_to_fractions_when_mig_is_full() -> None:
    nodes = [NodeInventory("mig", (gpu(H200),)), NodeInventory("frac", (gpu(L40S),))]
    first = plan(mem(4 * GiB), nodes, {"mig"})
    assert (first.mode, first.node) == (MODE_MIG, "mig")
    full = mig_binding("whole", "mig", 0, H200, "7g.141gb", 0)
    second = plan(mem(4 * GiB), nodes, {"mig"}, [full])
    assert (second.mode, second.node, second.granted_bytes) == (MODE_FRACTION, "frac", 4 * GiB)


def test_fraction_request_prefers_mig_with_that_share_of_slots() -> None:
    nodes = [NodeInventory("mig", (gpu(H200),)), NodeInventory("frac", (gpu(L40S),))]
    got = plan(SliceRequest(fraction=0.5), nodes, {"mig"})
    assert got.mode == MODE_MIG
    assert got.size >= math.ceil(0.5 * 8)


def test_profile_request_never_goes_to_a_fraction_gpu() -> None:
    full = mig_binding("whole", "mig", 0, H200, "7g.141gb", 0)
    nodes = [NodeInventory("mig", (gpu(H200),)), NodeInventory("frac", (gpu(L40S),))]
    r = refusal(SliceRequest(profile="1g.18gb"), nodes, {"mig"}, [full])
    assert r.code == NO_CAPACITY
    r = refusal(SliceRequest(profile="1g.18gb"), [NodeInventory("frac", (gpu(L40S),))], set())
    assert r.code == NO_GPU


def test_mig_grant_is_the_profile_memory_in_bytes() -> None:
    got = plan(SliceRequest(profile="2g.35gb"), [NodeInventory("a", (gpu(H200),))], {"a"})
    assert got.granted_bytes == 33280 * MiB  # H200 2g.35gb: memorySizeMB 33280
    assert got.profile_id == H200.profile("2g.35gb").id


# --- nodeName ---------------------------------------------------------------------------------------------


def test_node_name_pins_the_choice() -> None:
    nodes = [NodeInventory("a", (gpu(H200),)), NodeInventory("b", (gpu(H200),)), NodeInventory("f", (gpu(L4),))]
    busy_a = mig_binding("x", "a", 0, H200, "1g.18gb", 0)  # best fit would pick node a
    assert plan(mem(GiB), nodes, {"a", "b"}, [busy_a]).node == "a"
    assert plan(mem(GiB), nodes, {"a", "b"}, [busy_a], node="b").node == "b"
    pinned = plan(mem(GiB), nodes, {"a", "b"}, [busy_a], node="f")
    assert (pinned.node, pinned.mode) == ("f", MODE_FRACTION)


def test_node_name_of_a_node_without_gpus_is_refused_no_gpu() -> None:
    r = refusal(mem(GiB), [NodeInventory("a", (gpu(H200),)), NodeInventory("elsewhere", ())], {"a"},
                node="elsewhere")
    assert r.code == NO_GPU
    assert "elsewhere" in r.message


def test_node_name_pinned_to_a_full_node_does_not_spill_over() -> None:
    nodes = [NodeInventory("a", (gpu(A30),)), NodeInventory("b", (gpu(A30),))]
    full = mig_binding("x", "a", 0, A30, "4g.24gb", 0)
    r = refusal(mem(GiB), nodes, {"a", "b"}, [full], node="a")
    assert r.code == NO_CAPACITY


# --- refusal codes and profile boundaries ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "profile"),
    [(-1, "1g.18gb"), (0, "1g.18gb"), (1, "1g.35gb")],
)
def test_one_byte_either_side_of_a_profile_memory(delta: int, profile: str) -> None:
    need = H200.profile("1g.18gb").memory_mib * MiB + delta
    got = plan(mem(need), [NodeInventory("a", (gpu(H200),))], {"a"})
    assert got.profile == profile
    assert got.granted_bytes >= need


def test_largest_profile_exactly_fits_and_one_byte_more_is_too_large() -> None:
    nodes = [NodeInventory("a", (gpu(H200),))]
    top = largest_plain_mib(H200) * MiB
    assert plan(mem(top), nodes, {"a"}).profile == "7g.141gb"
    r = refusal(mem(top + 1), nodes, {"a"})
    assert r.code == TOO_LARGE


def test_fraction_gpu_takes_exactly_its_memory_and_not_one_byte_more() -> None:
    nodes = [NodeInventory("f", (gpu(L4),))]
    exact = L4.memory_mib * MiB
    got = plan(mem(exact), nodes, set())
    assert (got.mode, got.granted_bytes) == (MODE_FRACTION, exact)
    assert refusal(mem(exact + 1), nodes, set()).code == TOO_LARGE


def test_request_too_large_for_mig_but_fitting_a_fraction_gpu_goes_there() -> None:
    nodes = [NodeInventory("a", (gpu(A30),)), NodeInventory("f", (gpu(L40S),))]
    need = (largest_plain_mib(A30) + 1) * MiB
    got = plan(mem(need), nodes, {"a"})
    assert (got.mode, got.node, got.granted_bytes) == (MODE_FRACTION, "f", need)
    assert refusal(mem(L40S.memory_mib * MiB + 1), nodes, {"a"}).code == TOO_LARGE


def test_too_large_for_mig_and_fraction_gpus_full_is_no_capacity() -> None:
    nodes = [NodeInventory("a", (gpu(A30),)), NodeInventory("f", (gpu(L40S),))]
    taken = Binding("x", "f", 0, MODE_FRACTION, granted_bytes=L40S.memory_mib * MiB)
    r = refusal(mem((largest_plain_mib(A30) + 1) * MiB), nodes, {"a"}, [taken])
    assert r.code == NO_CAPACITY


def test_fractions_on_one_gpu_never_exceed_its_memory() -> None:
    nodes = [NodeInventory("f", (gpu(L4),))]
    half_plus = Binding("x", "f", 0, MODE_FRACTION, granted_bytes=L4.memory_mib * MiB // 2 + 1)
    r = refusal(mem(L4.memory_mib * MiB // 2), nodes, set(), [half_plus])
    assert r.code == NO_CAPACITY
    fits = plan(mem(L4.memory_mib * MiB - half_plus.granted_bytes), nodes, set(), [half_plus])
    assert fits.granted_bytes + half_plus.granted_bytes == L4.memory_mib * MiB


def test_unknown_profile_is_no_such_profile() -> None:
    nodes = [NodeInventory("a", (gpu(H200),))]
    assert refusal(SliceRequest(profile="5g.99gb"), nodes, {"a"}).code == NO_SUCH_PROFILE
    # An A30 profile on a cluster of H200s.
    assert refusal(SliceRequest(profile="1g.6gb"), nodes, {"a"}).code == NO_SUCH_PROFILE


def test_known_profile_on_a_full_gpu_is_no_capacity() -> None:
    full = mig_binding("x", "a", 0, H200, "7g.141gb", 0)
    r = refusal(SliceRequest(profile="1g.18gb"), [NodeInventory("a", (gpu(H200),))], {"a"}, [full])
    assert r.code == NO_CAPACITY


def test_media_extension_profile_is_limited_to_its_max_instances() -> None:
    nodes = [NodeInventory("a", (gpu(H200),))]
    first = plan(SliceRequest(profile="1g.18gb+me"), nodes, {"a"})
    held = Binding("u1", first.node, first.gpu, first.mode, first.granted_bytes, first.profile_id, first.profile,
                   first.start, first.size)
    assert H200.profile("1g.18gb+me").max_instances == 1
    assert refusal(SliceRequest(profile="1g.18gb+me"), nodes, {"a"}, [held]).code == NO_CAPACITY


def test_no_inventory_at_all_is_no_gpu() -> None:
    assert refusal(mem(GiB), [], set()).code == NO_GPU
    assert refusal(SliceRequest(fraction=0.5), [], set()).code == NO_GPU


def test_full_cluster_fraction_request_is_no_capacity() -> None:
    nodes = [NodeInventory("f", (gpu(L4),))]
    taken = Binding("x", "f", 0, MODE_FRACTION, granted_bytes=L4.memory_mib * MiB)
    assert refusal(SliceRequest(fraction=0.1), nodes, set(), [taken]).code == NO_CAPACITY


def _big_cluster(n: int) -> tuple[list[NodeInventory], list[Binding], set[str]]:
    inventories, bindings, labelled = [], [], set()
    for i in range(n):
        name = f"node-{i:05d}-" + "x" * 240
        if i % 2:
            inventories.append(NodeInventory(name, (gpu(H200),)))
            labelled.add(name)
            bindings.append(mig_binding(f"u{i}", name, 0, H200, "7g.141gb", 0))
        else:
            inventories.append(NodeInventory(name, (gpu(L4),)))
            bindings.append(Binding(f"u{i}", name, 0, MODE_FRACTION, granted_bytes=L4.memory_mib * MiB))
    return inventories, bindings, labelled


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (mem(4 * GiB), NO_CAPACITY),
        (SliceRequest(fraction=0.25), NO_CAPACITY),
        (SliceRequest(profile="1g.18gb"), NO_CAPACITY),
        (SliceRequest(profile="9g.999gb"), NO_SUCH_PROFILE),
        (mem(10**15), TOO_LARGE),
    ],
)
def test_refusal_message_fits_a_status_with_thousands_of_gpus(request_: SliceRequest, code: str) -> None:
    inventories, bindings, labelled = _big_cluster(3000)
    r = refusal(request_, inventories, labelled, bindings)
    assert r.code == code
    assert 0 < len(r.message) <= MAX_MESSAGE


def test_no_gpu_message_fits_with_a_huge_pinned_node_name() -> None:
    r = refusal(mem(GiB), [NodeInventory("n" * 10_000, ())], set(), node="n" * 10_000)
    assert r.code == NO_GPU and len(r.message) <= MAX_MESSAGE


# --- sequential binding: the property ------------------------------------------------------------------

MIG_MODELS = ("h200-141gb", "h100-80gb", "a30-24gb", "a100-40gb")
FRACTION_MODELS = ("l4-24gb", "t4-16gb")
PROFILE_NAMES = sorted({p.name for m in CATALOG.values() for p in m.profiles} | {"9g.999gb"})


@dataclass
class Cluster:
    inventories: list[NodeInventory]
    labelled: set[str]
    bindings: list[Binding]


@st.composite
def clusters(draw) -> Cluster:
    inventories, labelled, bindings = [], set(), []
    uids = itertools.count()
    for n in range(draw(st.integers(1, 3))):
        node = f"node-{n}"
        if draw(st.booleans()):
            labelled.add(node)
        gpus = []
        for index in range(draw(st.integers(1, 3))):
            model = CATALOG[draw(st.sampled_from(MIG_MODELS + FRACTION_MODELS))]
            enabled = bool(model.profiles) and draw(st.booleans())
            instances: list[InstanceState] = []
            if enabled:
                taken = 0
                for _ in range(draw(st.integers(0, 5))):
                    profile = draw(st.sampled_from(model.profiles))
                    if sum(1 for i in instances if i.profile_id == profile.id) >= profile.max_instances:
                        continue
                    free = [pl for pl in profile.placements if not slots(pl.start, pl.size) & taken]
                    if not free:
                        continue
                    pl = draw(st.sampled_from(free))
                    taken |= slots(pl.start, pl.size)
                    kind = draw(st.sampled_from(["idle", "live", "gone", "busy", "half"]))
                    uid = ""
                    if kind == "live":
                        uid = f"live-{next(uids)}"
                        bindings.append(Binding(uid, node, index, MODE_MIG, profile.memory_mib * MiB, profile.id,
                                                profile.name, pl.start, pl.size))
                    elif kind == "gone":
                        uid = f"gone-{next(uids)}"
                    gi = len(instances) + 1
                    instances.append(InstanceState(
                        gi_id=gi, ci_id=-1 if kind == "half" else 0, profile_id=profile.id, profile=profile.name,
                        start=pl.start, size=pl.size, device_uuid="" if kind == "half" else f"MIG-{node}-{index}-{gi}",
                        in_use=kind == "busy", slice_uid=uid,
                    ))
            elif not model.profiles or not enabled:
                used = draw(st.integers(0, model.memory_mib)) * MiB if draw(st.booleans()) else 0
                if used:
                    bindings.append(Binding(f"frac-{next(uids)}", node, index, MODE_FRACTION, granted_bytes=used))
            gpus.append(gpu(model, index, mig_enabled=enabled, instances=instances))
        inventories.append(NodeInventory(node, tuple(gpus)))
    return Cluster(inventories, labelled, bindings)


requests = st.one_of(
    st.integers(1, 150 * GiB).map(lambda b: SliceRequest(memory_bytes=b)),
    st.sampled_from([0.05, 0.1, 0.125, 0.25, 1 / 3, 0.5, 0.75, 1.0]).map(lambda f: SliceRequest(fraction=f)),
    st.sampled_from(PROFILE_NAMES).map(lambda p: SliceRequest(profile=p)),
)


def _held(g: GpuState, node: str, bindings: list[Binding]) -> int:
    """Slots of inventory instances nobody may take: in use, half-made, owned by a live slice, or reused."""
    live = {b.uid for b in bindings}
    mine = [b for b in bindings if b.node == node and b.gpu == g.index and b.mode == MODE_MIG]
    mask = 0
    for i in g.instances:
        complete = i.ci_id >= 0 and i.device_uuid != ""
        reused = any(b.start == i.start and b.profile_id == i.profile_id for b in mine)
        if i.in_use or not complete or (i.slice_uid and i.slice_uid in live) or reused:
            mask |= slots(i.start, i.size)
    return mask


def _empty_mig_gpus(c: Cluster) -> list[tuple[str, GpuState]]:
    out = []
    for inv in c.inventories:
        for g in inv.gpus:
            if inv.node in c.labelled and g.mig_enabled and not g.instances and not any(
                    b.node == inv.node and b.gpu == g.index for b in c.bindings):
                out.append((inv.node, g))
    return out


def _check_decision(c: Cluster, req: SliceRequest, b: Binding) -> None:
    inv = next(i for i in c.inventories if i.node == b.node)
    g = next(x for x in inv.gpus if x.index == b.gpu)
    model = CATALOG[g.model]
    labelled = b.node in c.labelled
    if b.mode == MODE_MIG:
        assert labelled and g.mig_enabled, "MIG slice on a GPU that does not serve MIG"
        p = model.profile(b.profile)
        assert p.id == b.profile_id
        assert (b.start, b.size) in {(pl.start, pl.size) for pl in p.placements}, "illegal placement"
        assert b.granted_bytes == p.memory_mib * MiB
        new = slots(b.start, b.size)
        for other in c.bindings:
            if other.node == b.node and other.gpu == b.gpu and other.mode == MODE_MIG:
                assert not new & slots(other.start, other.size), f"{b} overlaps {other}"
        assert not new & _held(g, b.node, c.bindings), f"{b} takes an instance that is held"
        if req.profile is not None:
            assert b.profile == req.profile
        elif req.memory_bytes is not None:
            assert p.memory_mib * MiB >= req.memory_bytes
            assert not p.media_extension
        else:
            assert p.placements[0].size >= req.fraction * model.memory_slots - 1e-9
        # Instances of one profile never exceed its maximum once the bindings are carried out.
        on_gpu = [o for o in c.bindings + [b] if o.node == b.node and o.gpu == b.gpu and o.mode == MODE_MIG]

        def same(o: Binding, i: InstanceState) -> bool:
            return o.start == i.start and o.profile_id == i.profile_id

        kept = [i for i in g.instances
                if not any(slots(o.start, o.size) & slots(i.start, i.size) and not same(o, i) for o in on_gpu)]
        occupants = [i.profile_id for i in kept] + [o.profile_id for o in on_gpu if not any(same(o, i) for i in kept)]
        assert occupants.count(p.id) <= p.max_instances
    else:
        assert req.profile is None
        assert not g.mig_enabled, "fraction slice on a MIG-enabled GPU"
        total = g.memory_mib * MiB
        others = sum(o.granted_bytes for o in c.bindings
                     if o.node == b.node and o.gpu == b.gpu and o.mode == MODE_FRACTION)
        assert others + b.granted_bytes <= total
        if req.memory_bytes is not None:
            assert b.granted_bytes == req.memory_bytes
        else:
            assert total * req.fraction - MiB < b.granted_bytes <= total * req.fraction
            assert b.granted_bytes >= 2**30, "a fraction granted less than the 1 GiB floor"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(requests, min_size=1, max_size=10))
def test_bindings_made_one_after_another_never_overlap(c: Cluster, reqs: list[SliceRequest]) -> None:
    for n, req in enumerate(reqs):
        view = build_view(c.inventories, c.labelled, c.bindings)
        try:
            got = plan_binding(req, view)
        except Refusal as r:
            assert r.code in REFUSAL_CODES and len(r.message) <= MAX_MESSAGE
            # A request that an empty MIG GPU could take outright is never refused.
            for _node, g in _empty_mig_gpus(c):
                model = CATALOG[g.model]
                if req.profile is not None:
                    assert not model.has_profile(req.profile), f"{req} refused with an empty {model.name}"
                elif req.memory_bytes is not None:
                    assert req.memory_bytes > largest_plain_mib(model) * MiB, f"{req} refused ({r.message})"
                else:
                    raise AssertionError(f"{req} refused with an empty MIG GPU") from r
            continue
        _check_decision(c, req, got)
        c.bindings.append(Binding(f"req-{n}", got.node, got.gpu, got.mode, got.granted_bytes, got.profile_id,
                                  got.profile, got.start, got.size))


# --- reading statuses back ------------------------------------------------------------------------------


def test_binding_from_status_reads_mig_and_fraction_bindings() -> None:
    mig = {"phase": "Ready", "node": "a", "gpu": 2, "mode": "mig", "grantedBytes": 16384 * MiB,
           "profileId": 19, "profile": "1g.18gb", "placement": {"start": 5, "size": 1}}
    assert binding_from_status("u", mig) == Binding("u", "a", 2, MODE_MIG, 16384 * MiB, 19, "1g.18gb", 5, 1)
    frac = {"phase": "Creating", "node": "f", "gpu": 0, "mode": "fraction", "grantedBytes": 123}
    assert binding_from_status("v", frac) == Binding("v", "f", 0, MODE_FRACTION, 123)


@pytest.mark.parametrize("phase", [None, "Pending", "Failed", "Released", "bound"])
def test_binding_from_status_without_a_bound_phase_is_none(phase) -> None:
    status = {"phase": phase, "node": "f", "gpu": 0, "mode": "fraction", "grantedBytes": 1}
    assert binding_from_status("u", status) is None


@pytest.mark.parametrize(
    "status",
    [
        None,
        {},
        {"phase": "Bound", "gpu": 0, "mode": "fraction"},  # no node
        {"phase": "Bound", "node": "", "gpu": 0, "mode": "fraction"},
        {"phase": "Bound", "node": "a", "mode": "fraction"},  # no gpu
        {"phase": "Bound", "node": "a", "gpu": "zero", "mode": "fraction"},
        {"phase": "Bound", "node": "a", "gpu": None, "mode": "fraction"},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "vgpu"},
        {"phase": "Bound", "node": "a", "gpu": 0},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "mig", "profileId": 19},  # no placement
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "mig", "profileId": 19, "placement": {"start": 0}},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "mig", "profileId": 19, "placement": [0, 1]},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "mig", "profileId": 19, "placement": "0:1"},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "mig", "placement": {"start": 0, "size": 1}},
        {"phase": "Bound", "node": "a", "gpu": 0, "mode": "fraction", "grantedBytes": "lots"},
    ],
)
def test_binding_from_malformed_status_is_none(status) -> None:
    assert binding_from_status("u", status) is None


GOOD_GPU = {"index": 1, "uuid": "GPU-good", "memoryMiB": 23034}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "gpu",
        7,
        [],
        {},
        {"uuid": "GPU-x"},  # no index
        {"index": 0},  # no uuid
        {"index": "zero", "uuid": "GPU-x"},
        {"index": 0, "uuid": "GPU-x", "memoryMiB": "lots"},
        {"index": 0, "uuid": "GPU-x", "model": "no-such-model"},  # names a model the status does not publish
        {"index": 0, "uuid": "GPU-x", "model": "nameless"},  # its model's profile has no name
        {"index": 0, "uuid": "GPU-x", "model": "half-placed"},  # its model's placement has no size
        {"index": 0, "uuid": "GPU-x", "instances": [{"profileId": 19, "start": 0}]},  # no size
        {"index": 0, "uuid": "GPU-x", "instances": [{"profileId": "x", "start": 0, "size": 1}]},
    ],
)
def test_inventory_skips_malformed_gpu_entries(bad) -> None:
    models = [{"name": "nameless", "profiles": [{"id": 19}]},
              {"name": "half-placed", "profiles": [{"name": "1g", "id": 19, "placements": [{"start": 0}]}]}]
    inv = inventory_from_status("n", {"models": models, "gpus": [bad, GOOD_GPU]})
    assert [(g.index, g.uuid, g.memory_mib) for g in inv.gpus] == [(1, "GPU-good", 23034)]


@pytest.mark.parametrize("entry", ["x", 5, None, ["start", 0]])
def test_inventory_skips_gpu_whose_sub_entries_are_not_objects(entry) -> None:
    bad_instance = {"index": 0, "uuid": "GPU-x", "instances": [entry]}
    inv = inventory_from_status("n", {"gpus": [bad_instance, GOOD_GPU]})
    assert [g.index for g in inv.gpus] == [1]
    bad_profile = {"index": 0, "uuid": "GPU-x", "model": "m"}
    inv = inventory_from_status("n", {"models": [{"name": "m", "profiles": [entry]}], "gpus": [bad_profile, GOOD_GPU]})
    assert [g.index for g in inv.gpus] == [1]


# Written by hand, two profiles each of an H200 and an A30 with the numbers NVML reports for them,
# what a status publishes once per model and what the controller must read for each GPU.
H200_TABLE = [
    {"name": "1g.18gb", "id": 19, "slices": 1, "memoryMiB": 16384, "sm": 16, "maxInstances": 7,
     "placements": [{"start": s, "size": 1} for s in range(7)]},
    {"name": "7g.141gb", "id": 0, "slices": 7, "memoryMiB": 143360, "sm": 132, "maxInstances": 1,
     "placements": [{"start": 0, "size": 8}]},
]
A30_TABLE = [
    {"name": "1g.6gb", "id": 14, "slices": 1, "memoryMiB": 5952, "sm": 14, "maxInstances": 4,
     "placements": [{"start": s, "size": 1} for s in range(4)]},
    {"name": "4g.24gb", "id": 0, "slices": 4, "memoryMiB": 24000, "sm": 56, "maxInstances": 1,
     "placements": [{"start": 0, "size": 4}]},
]


def test_each_gpu_reads_the_profile_table_its_model_names() -> None:
    status = {
        "models": [{"name": "a30-24gb", "profiles": A30_TABLE}, {"name": "h200-141gb", "profiles": H200_TABLE}],
        "gpus": [
            {"index": 0, "uuid": "GPU-0", "model": "h200-141gb", "migCapable": True, "migEnabled": True},
            {"index": 1, "uuid": "GPU-1", "model": "a30-24gb", "migCapable": True, "migEnabled": True},
            {"index": 2, "uuid": "GPU-2", "model": "h200-141gb", "migCapable": True, "migEnabled": False},
            {"index": 3, "uuid": "GPU-3", "model": "", "memoryMiB": 23034},  # an L4: no MIG, no table
        ],
    }
    inv = inventory_from_status("n", status)
    h200 = (Profile("1g.18gb", 19, 1, 16384, 16, 7, tuple(Placement(s, 1) for s in range(7))),
            Profile("7g.141gb", 0, 7, 143360, 132, 1, (Placement(0, 8),)))
    a30 = (Profile("1g.6gb", 14, 1, 5952, 14, 4, tuple(Placement(s, 1) for s in range(4))),
           Profile("4g.24gb", 0, 4, 24000, 56, 1, (Placement(0, 4),)))
    assert [(g.index, g.model, g.profiles) for g in inv.gpus] == [
        (0, "h200-141gb", h200), (1, "a30-24gb", a30), (2, "h200-141gb", h200), (3, "", ())]
    # The planner sees each GPU's own board: 8 memory slots on the H200s, 4 on the A30.
    assert [model_of(g.model, g.product, g.memory_mib, g.profiles).memory_slots for g in inv.gpus[:3]] == [8, 4, 8]


@pytest.mark.parametrize("models", [None, "h200", 7, {"h200-141gb": H200_TABLE}, [None, "x", {"profiles": H200_TABLE}],
                                    [{"name": "", "profiles": H200_TABLE}], [{"name": 7, "profiles": H200_TABLE}]])
def test_a_gpu_whose_model_is_not_published_is_skipped_and_one_without_mig_is_kept(models) -> None:
    status = {"models": models, "gpus": [{"index": 0, "uuid": "GPU-0", "model": "h200-141gb", "migEnabled": True},
                                         GOOD_GPU]}
    inv = inventory_from_status("n", status)
    assert [(g.index, g.profiles) for g in inv.gpus] == [(1, ())]


def test_inventory_gpu_with_a_malformed_instance_never_offers_that_instance_slots() -> None:
    # Dropping just the instance would show its slots as free: the whole GPU must go.
    raw = {"index": 0, "uuid": "GPU-x", "model": "h200-141gb", "memoryMiB": H200.memory_mib, "migCapable": True,
           "migEnabled": True, "instances": [{"profileId": 0, "start": 0, "size": "eight", "inUse": True}]}
    inv = inventory_from_status("n", {"models": [{"name": "h200-141gb", "profiles": H200_TABLE}], "gpus": [raw]})
    assert inv.gpus == ()
    assert refusal(mem(GiB), [inv], {"n"}).code == NO_GPU


@pytest.mark.parametrize("status", [None, {}, {"gpus": None}, {"gpus": []}, {"gpus": {"0": GOOD_GPU}}])
def test_inventory_of_empty_or_odd_status_has_no_gpus(status) -> None:
    assert inventory_from_status("n", status).gpus == ()


def test_inventory_gpus_are_sorted_by_index() -> None:
    raw = [{"index": i, "uuid": f"GPU-{i}"} for i in (3, 0, 2)]
    assert [g.index for g in inventory_from_status("n", {"gpus": raw}).gpus] == [0, 2, 3]


# --- the agent writes, the controller reads ---------------------------------------------------------------


@st.composite
def node_states(draw):
    """GPUs with legal, non-overlapping instances, some owned by record entries, some idle since a time."""
    infos, models, instances = [], {}, {}
    owners: dict[str, OwnerEntry] = {}
    idle: dict[str, str] = {}
    for index in range(draw(st.integers(1, 3))):
        model = CATALOG[draw(st.sampled_from(MIG_MODELS + FRACTION_MODELS))]
        enabled = bool(model.profiles) and draw(st.booleans())
        infos.append(GpuInfo(index, f"GPU-{index}", model.product, model.memory_mib, bool(model.profiles), enabled))
        models[index] = model if model.profiles else None
        insts = []
        if enabled:
            taken = 0
            for _ in range(draw(st.integers(0, 6))):
                p = draw(st.sampled_from(model.profiles))
                free = [pl for pl in p.placements if not slots(pl.start, pl.size) & taken]
                if not free or sum(1 for i in insts if i.profile_id == p.id) >= p.max_instances:
                    continue
                pl = draw(st.sampled_from(free))
                taken |= slots(pl.start, pl.size)
                gi = len(insts) + 3
                half = draw(st.booleans()) and draw(st.booleans())
                mi = MigInstance(index, gi, -1 if half else 0, p.id, p.name, pl.start, pl.size,
                                 "" if half else f"MIG-{index}-{gi}", draw(st.booleans()))
                insts.append(mi)
                who = draw(st.sampled_from(["owned", "idle", "none"]))
                if who == "owned":
                    uid = f"uid-{index}-{gi}"
                    owners[uid] = OwnerEntry(uid, f"ns/s-{index}-{gi}", MODE_MIG, index, COMPLETED,
                                             p.memory_mib * MiB, p.id, p.name, pl.start, pl.size, gi,
                                             mi.ci_id, mi.device_uuid)
                    if mi.device_uuid and draw(st.booleans()):  # a stale idle time: never shown for an owner
                        idle[mi.device_uuid] = "2000-01-01T00:00:00.000Z"
                elif who == "idle" and mi.device_uuid:
                    idle[mi.device_uuid] = f"2024-05-0{index + 1}T00:00:{gi:02d}.000Z"
        instances[index] = insts
    return infos, models, instances, OwnerRecord("boot", owners, idle)


@settings(max_examples=40, deadline=None)
@given(node_states(), st.booleans())
def test_gpunode_status_round_trips_through_inventory_from_status(state, labelled: bool) -> None:
    infos, models, instances, record = state
    status = gpunode_status(infos, models, instances, record, labelled, "2024-01-01T00:00:00.000Z")
    inv = inventory_from_status("node", status)
    assert [g.index for g in inv.gpus] == [i.index for i in infos]
    for info, g in zip(infos, inv.gpus, strict=True):
        model = models[info.index]
        assert (g.uuid, g.product, g.memory_mib) == (info.uuid, info.product, info.memory_mib)
        assert (g.mig_capable, g.mig_enabled) == (info.mig_capable, info.mig_enabled)
        assert g.model == (model.name if model else "")
        expected_profiles = model.profiles if model else ()
        assert g.profiles == expected_profiles
        if model is not None:
            derived = model_of(g.model, g.product, g.memory_mib, g.profiles)
            assert derived.memory_slots == model.memory_slots
        expected = []
        for mi in instances[info.index]:
            owner = next((e for e in record.owners.values() if e.gpu == info.index and e.gi_id == mi.gi_id), None)
            idle_since = record.idle_since.get(mi.device_uuid) if owner is None and mi.device_uuid else None
            expected.append(InstanceState(
                gi_id=mi.gi_id, ci_id=mi.ci_id, profile_id=mi.profile_id, profile=mi.profile, start=mi.start,
                size=mi.size, device_uuid=mi.device_uuid, in_use=mi.in_use,
                slice_uid=owner.uid if owner else "", slice=owner.slice if owner else "", idle_since=idle_since,
            ))
        assert list(g.instances) == expected


def test_round_trip_keeps_a_live_owner_in_use_in_the_controller_view() -> None:
    info = GpuInfo(0, "GPU-0", H200.product, H200.memory_mib, True, True)
    mi = MigInstance(0, 5, 0, H200.profile("1g.18gb").id, "1g.18gb", 2, 1, "MIG-5", False)
    owner = OwnerEntry("u1", "ns/a", MODE_MIG, 0, COMPLETED, 16384 * MiB, mi.profile_id, "1g.18gb", 2, 1, 5, 0, "MIG-5")
    status = gpunode_status([info], {0: H200}, {0: [mi]}, OwnerRecord("b", {"u1": owner}), True, "t")
    inv = inventory_from_status("a", status)
    live = Binding("u1", "a", 0, MODE_MIG, 16384 * MiB, mi.profile_id, "1g.18gb", 2, 1)
    assert slot_view(build_view([inv], {"a"}, [live]), "a", 0) == {(mi.profile_id, 2, 1, True)}
    # Once the slice is gone, the instance is idle capacity.
    assert slot_view(build_view([inv], {"a"}, []), "a", 0) == {(mi.profile_id, 2, 1, False)}


def test_a_gone_slices_instance_a_prepared_claim_holds_stays_in_use_in_the_controller_view() -> None:
    # Issue 16 item 7: the slice was deleted while a pod's claim on it is prepared; the agent keeps the
    # instance until the kubelet unprepares it, and the controller must neither reuse nor reclaim it.
    info = GpuInfo(0, "GPU-0", H200.product, H200.memory_mib, True, True)
    mi = MigInstance(0, 5, 0, H200.profile("1g.18gb").id, "1g.18gb", 2, 1, "MIG-5", False)
    owner = OwnerEntry("u1", "ns/a", MODE_MIG, 0, COMPLETED, 16384 * MiB, mi.profile_id, "1g.18gb", 2, 1, 5, 0, "MIG-5")
    record = OwnerRecord("b", {"u1": owner})
    held = gpunode_status([info], {0: H200}, {0: [mi]}, record, True, "t", frozenset({"u1"}))
    assert held["gpus"][0]["instances"][0]["inUse"] is True
    assert slot_view(build_view([inventory_from_status("a", held)], {"a"}, []), "a", 0) == {
        (mi.profile_id, 2, 1, True)}
    other = gpunode_status([info], {0: H200}, {0: [mi]}, record, True, "t", frozenset({"u2"}))
    assert other["gpus"][0]["instances"][0]["inUse"] is False


def test_profile_round_trip_keeps_placements_memory_and_limits() -> None:
    info = GpuInfo(0, "GPU-0", A30.product, A30.memory_mib, True, True)
    status = gpunode_status([info], {0: A30}, {0: []}, OwnerRecord(), True, "t")
    (g,) = inventory_from_status("a", status).gpus
    by_name = {p.name: p for p in g.profiles}
    assert by_name["2g.12gb"] == Profile("2g.12gb", 5, 2, 11968, 28, 2, A30.profile("2g.12gb").placements)
    assert [(pl.start, pl.size) for pl in by_name["1g.6gb"].placements] == [(0, 1), (1, 1), (2, 1), (3, 1)]


def test_half_made_instance_reads_back_incomplete_and_is_never_offered() -> None:
    info = GpuInfo(0, "GPU-0", A30.product, A30.memory_mib, True, True)
    half = MigInstance(0, 4, -1, A30.profile("4g.24gb").id, "4g.24gb", 0, 4, "", False)
    status = gpunode_status([info], {0: A30}, {0: [half]}, OwnerRecord(), True, "t")
    (g,) = inventory_from_status("a", status).gpus
    (i,) = g.instances
    assert (i.gi_id, i.ci_id, i.device_uuid, i.complete) == (4, -1, "", False)
    assert refusal(mem(GiB), [NodeInventory("a", (g,))], {"a"}).code == NO_CAPACITY
