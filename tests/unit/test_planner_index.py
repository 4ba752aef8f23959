"""PlanningIndex decides exactly as choose_mig, and both exactly as the rule written out plainly
(tests/unit/planner_reference.py), on every cluster state hypothesis can build."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_reference import reference_choose_mig

from mig_operator.core.placement.planner import InstanceSlot, MigDecision, MigGpu, PlannerSettings, Unplaceable
from mig_operator.core.placement.planning_index import PlanningIndex, choose_mig
from mig_operator.core.placement.profiles import CATALOG, GpuModel, Placement, Profile, get_model
from mig_operator.core.requests.request import SliceRequest, slice_request

H200 = get_model("h200-141gb")
H100 = get_model("h100-80gb")
MIB = 2**20

# Boards the catalog does not have, so the properties also meet them: no MIG at all, a profile NVML
# lists without placements, and a smallest profile with fewer placements than a larger one.
NO_MIG = GpuModel("no-mig-16gb", "NVIDIA T4", 0, 15360, ())
ODD = GpuModel(
    "odd-4gb", "Odd GPU", 4, 4096,
    (
        Profile("1g.1gb", 1, 1, 1024, 10, 1, (Placement(0, 1),)),
        Profile("1g.2gb", 3, 1, 2048, 10, 2, ()),
        Profile("2g.2gb", 2, 2, 2048, 20, 2, (Placement(0, 2), Placement(2, 2))),
        Profile("4g.4gb", 4, 4, 4096, 40, 1, (Placement(0, 4),)),
    ),
)
MODELS = [CATALOG[n] for n in ("h200-141gb", "h100-80gb", "a100-40gb", "a30-24gb")] + [ODD, NO_MIG]
NODES = ("n0", "n1", "n2")
PROFILE_NAMES = sorted({p.name for m in MODELS for p in m.profiles} | {"3g.40gb", "7g.94gb"})
EDGES = sorted({p.memory_mib * MIB + d for m in MODELS for p in m.profiles for d in (-1, 0, 1)} | {1})

requests = st.one_of(
    st.sampled_from(EDGES).map(lambda b: SliceRequest(memory_bytes=b)),
    st.sampled_from([0.1, 0.125, 0.25, 0.3, 0.5, 0.51, 0.75, 1.0]).map(lambda f: SliceRequest(fraction=f)),
    st.sampled_from(PROFILE_NAMES).map(lambda n: SliceRequest(profile=n)),
)


def build_instances(model: GpuModel, attempts: list[tuple[int, int, bool]]) -> tuple[InstanceSlot, ...]:
    """A legal layout: each attempt (profile, placement, in use) is kept if it overlaps nothing."""
    if not model.profiles:
        return ()
    taken, out = 0, []
    for p_pick, pl_pick, in_use in attempts:
        profile = model.profiles[p_pick % len(model.profiles)]
        if not profile.placements:
            continue
        pl = profile.placements[pl_pick % len(profile.placements)]
        if pl.mask & taken or sum(1 for i in out if i.profile_id == profile.id) >= profile.max_instances:
            continue
        taken |= pl.mask
        out.append(InstanceSlot(profile.id, pl.start, pl.size, in_use))
    return tuple(sorted(out, key=lambda i: i.start))


layouts = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.booleans()), max_size=6)
gpu_specs = st.lists(
    st.tuples(st.sampled_from(NODES), st.integers(0, 3), st.integers(0, len(MODELS) - 1), layouts),
    min_size=0, max_size=10,
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("choose"), requests, st.booleans()),
        st.tuples(st.just("pinned"), requests, st.sets(st.sampled_from(NODES + ("n9",)), max_size=2)),
        st.tuples(st.just("release"), st.integers(0, 99), st.booleans()),
        st.tuples(st.just("put"), st.integers(0, 99), st.tuples(st.integers(0, len(MODELS) - 1), layouts)),
        st.tuples(st.just("remove"), st.integers(0, 99), st.none()),
    ),
    max_size=25,
)


def outcome(fn, *args):
    try:
        return fn(*args)
    except Unplaceable as exc:
        return ("refused", exc.reason)


@settings(max_examples=150, deadline=None)
@given(gpu_specs, operations)
def test_index_choose_mig_and_reference_agree(specs, ops) -> None:
    cluster: dict[tuple[str, int], MigGpu] = {}
    for node, index, m, layout in specs:
        model = MODELS[m]
        cluster[(node, index)] = MigGpu(node, index, model, build_instances(model, layout))
    index = PlanningIndex(cluster.values())
    held: list[tuple[str, int, int]] = []
    for op, a, b in ops:
        gpus = list(cluster.values())
        if op in ("choose", "pinned"):
            settings_ = PlannerSettings(allow_larger_profile=not (op == "choose" and b))
            pool = gpus if op == "choose" else [g for g in gpus if g.node in b]
            got = outcome(index.choose, a, settings_, None if op == "choose" else b)
            if op == "pinned" and not pool:
                assert isinstance(got, tuple), "nothing to choose from on those nodes"
                assert ("no MIG-enabled GPU on node" in got[1]) if b else got[1] == "no node given"
                continue
            expected = outcome(choose_mig, a, pool, settings_)
            assert got == expected
            plain = outcome(reference_choose_mig, a, pool, settings_.allow_larger_profile)
            if isinstance(expected, MigDecision):
                assert plain == expected
                index.apply(expected)
                key = (expected.node, expected.gpu)
                cluster[key] = cluster[key].with_decision(expected)
                held.append((expected.node, expected.gpu, expected.start))
            else:
                assert not isinstance(plain, MigDecision), f"reference places it: {plain}"
        elif op == "release" and held:
            node, gpu, start = held.pop(a % len(held))
            if (node, gpu) in cluster:
                index.release(node, gpu, start, destroy=b)
                cluster[(node, gpu)] = cluster[(node, gpu)].with_released(start, destroy=b)
        elif op == "put" and cluster:
            key = sorted(cluster)[a % len(cluster)]
            model = MODELS[b[0]]
            cluster[key] = MigGpu(key[0], key[1], model, build_instances(model, b[1]))
            index.put(cluster[key])
        elif op == "remove" and cluster:
            key = sorted(cluster)[a % len(cluster)]
            del cluster[key]
            index.remove(*key)
        assert len(index) == len(cluster)
        assert list(index.gpus()) == sorted(cluster.values(), key=lambda g: (g.node, g.index))


# --- the API ----------------------------------------------------------------------------------


def h200(node: str, index: int, *instances: InstanceSlot) -> MigGpu:
    return MigGpu(node, index, H200, instances)


def test_apply_and_release_keep_the_index_current() -> None:
    index = PlanningIndex([h200("a", 0), h200("a", 1)])
    d = index.choose(slice_request(memory="10G"))
    assert (d.node, d.gpu, d.action) == ("a", 0, "create")
    after = index.apply(d)
    assert [(i.start, i.in_use) for i in after.instances] == [(d.start, True)]
    # Lazy: released, the instance stays idle and the next request of that size reuses it.
    index.release("a", 0, d.start)
    again = index.choose(slice_request(memory="10G"))
    assert (again.gpu, again.action, again.start) == (0, "reuse", d.start)
    index.release("a", 0, d.start, destroy=True)  # eager: nothing left
    assert index.get("a", 0) == h200("a", 0)


def test_put_replaces_and_remove_forgets() -> None:
    index = PlanningIndex([h200("a", 0)])
    index.put(h200("a", 0, InstanceSlot(0, 0, 8, True)))  # an inventory: the GPU is now full
    assert len(index) == 1 and index.state_count() == 1
    with pytest.raises(Unplaceable, match="every GPU is held"):
        index.choose(slice_request(memory="1G"))
    index.put(h200("b", 2))
    assert index.choose(slice_request(memory="1G")).node == "b"
    index.remove("b", 2)
    index.remove("b", 2)  # twice is fine
    index.remove("nowhere", 0)
    assert [g.node for g in index.gpus()] == ["a"]
    index.remove("a", 0)
    with pytest.raises(Unplaceable, match="no MIG-enabled GPU is available"):
        index.choose(slice_request(memory="1G"))
    assert index.stats().gpus == 0 and index.stats().states == 0


def test_states_are_shared_and_ties_go_to_the_lowest_gpu() -> None:
    index = PlanningIndex([h200(f"node-{n}", i) for n in (3, 1, 2) for i in (5, 4)])
    assert index.state_count() == 1
    d = index.choose(slice_request(memory="1G"))
    assert (d.node, d.gpu) == ("node-1", 4)
    index.remove("node-1", 4)
    d = index.choose(slice_request(memory="1G"))
    assert (d.node, d.gpu) == ("node-1", 5)


def test_nodes_pin_the_choice() -> None:
    index = PlanningIndex([h200("a", 0, InstanceSlot(0, 0, 8, True)), h200("b", 0), h200("c", 0)])
    assert index.choose(slice_request(memory="1G"), nodes=["c"]).node == "c"
    assert index.choose(slice_request(memory="1G"), nodes={"c", "b"}).node == "b"
    with pytest.raises(Unplaceable, match="every GPU is held"):
        index.choose(slice_request(memory="1G"), nodes=["a"])
    with pytest.raises(Unplaceable, match="no MIG-enabled GPU on node gone"):
        index.choose(slice_request(memory="1G"), nodes=["gone"])
    with pytest.raises(TypeError, match=r"not the string 'b'; e.g. nodes=\['b'\]"):
        index.choose(slice_request(memory="1G"), nodes="b")


def test_unknown_gpu_is_a_clear_error() -> None:
    index = PlanningIndex()
    with pytest.raises(KeyError, match=r"GPU 3 of node 'x' is not in the planning index; put\(\) it first"):
        index.release("x", 3, 0)


def test_many_gpus_few_states() -> None:
    gpus = [MigGpu(f"n{i // 8}", i % 8, H100, (InstanceSlot(19, i % 7, 1, i % 3 == 0),)) for i in range(4096)]
    index = PlanningIndex(gpus)
    assert len(index) == 4096 and index.state_count() == 14  # 7 starts, in use or idle
    assert index.choose(slice_request(memory="5G")) == choose_mig(slice_request(memory="5G"), gpus)
