"""ClusterPlanner (incremental, indexed) decides exactly as plan_binding on build_view of the same
inputs, through any sequence of inventories (some with RuntimeTrusted=False), labels (MIG, fraction
sharing, runtime trust accepted), bindings of several namespaces and releases."""

from __future__ import annotations

from dataclasses import replace

from cluster_reference import build_view, plan_binding
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mig_operator.core.node.health import xid_health
from mig_operator.core.placement.cluster import MODE_MIG, Binding, GpuState, InstanceState, NodeInventory, Refusal
from mig_operator.core.placement.cluster_planner import ClusterPlanner
from mig_operator.core.placement.profiles import get_model
from mig_operator.core.requests.request import slice_request

MODELS = ["h100-80gb", "a100-40gb", "h200-141gb", "l40s-48gb"]
NODES = ["n0", "n1", "n2"]
REQUESTS = [
    slice_request(memory=m) for m in ("4G", "9Gi", "10000Mi", "17Gi", "30Gi", "70Gi", "200Gi")
] + [slice_request(fraction=f) for f in (0.1, 0.5, 1.0)] + [slice_request(profile=p) for p in ("1g.10gb", "3g.71gb")]
# With a compute share: fractions only, and shares and shared fractions not on one GPU.
REQUESTS += [slice_request(fraction=0.25, compute=0.5), slice_request(memory="9Gi", compute=0.34)]


def gpu(model_name: str, index: int, mig: bool, instances: tuple[InstanceState, ...] = ()) -> GpuState:
    model = get_model(model_name)
    return GpuState(index, f"GPU-{model_name}-{index}", model.product, model.name, model.memory_mib,
                    model.mig_capable, mig and model.mig_capable, model.profiles if model.mig_capable else (),
                    instances if mig and model.mig_capable else ())


@st.composite
def inventory(draw: st.DrawFn, node: str) -> NodeInventory:
    model = draw(st.sampled_from(MODELS))
    count = draw(st.integers(1, 2))
    gpus = []
    for i in range(count):
        mig = draw(st.booleans())
        instances: list[InstanceState] = []
        m = get_model(model)
        if mig and m.mig_capable:
            taken = 0
            for profile in draw(st.lists(st.sampled_from([p for p in m.profiles if "+" not in p.name]), max_size=3)):
                for pl in profile.placements:
                    if not pl.mask & taken:
                        taken |= pl.mask
                        gi = len(instances) + 1
                        instances.append(InstanceState(gi, 0, profile.id, profile.name, pl.start, pl.size,
                                                       f"MIG-{node}-{i}-{gi}", in_use=draw(st.booleans())))
                        break
        made = gpu(model, i, mig, tuple(instances))
        if draw(st.integers(0, 5)) == 0:  # now and then a GPU with a critical Xid: no new slice there
            made = replace(made, health=xid_health(i, 79))
        gpus.append(made)
    return NodeInventory(node, tuple(gpus), runtime_untrusted=draw(st.sampled_from([None, None, "untrusted"])))


NAMESPACES = ["team-a", "team-b"]
bind = st.tuples(st.just("bind"), st.sampled_from(range(len(REQUESTS))), st.sampled_from([None, None, *NODES]),
                 st.sampled_from(NAMESPACES))
ops = st.lists(st.one_of(
    bind, bind, bind, bind,
    st.tuples(st.just("inventory"), st.sampled_from(NODES)),
    st.tuples(st.just("label"), st.sampled_from(NODES), st.booleans()),
    st.tuples(st.just("sharing"), st.sampled_from(NODES), st.booleans()),
    st.tuples(st.just("accepted"), st.sampled_from(NODES), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("drop-node"), st.sampled_from(NODES)),
), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(ops, st.data())
def test_the_incremental_planner_decides_as_plan_binding_on_a_fresh_view(steps, data) -> None:
    planner = ClusterPlanner()
    inventories: dict[str, NodeInventory] = {}
    labelled: set[str] = set()
    sharing: set[str] = set()
    accepted: set[str] = set()
    for node in NODES:  # a cluster to start from: every node has GPUs, most are labelled
        inventories[node] = data.draw(inventory(node))
        planner.set_inventory(inventories[node])
        if data.draw(st.integers(0, 3)) > 0:
            labelled.add(node)
            planner.set_labelled(node, True)
    bindings: dict[str, Binding] = {}
    serial = 0
    for step in steps:
        kind = step[0]
        if kind == "inventory":
            inv = data.draw(inventory(step[1]))
            inventories[step[1]] = inv
            planner.set_inventory(inv)
        elif kind == "label":
            (labelled.add if step[2] else labelled.discard)(step[1])
            planner.set_labelled(step[1], step[2])
        elif kind == "sharing":
            (sharing.add if step[2] else sharing.discard)(step[1])
            planner.set_fraction_sharing(step[1], step[2])
        elif kind == "accepted":
            (accepted.add if step[2] else accepted.discard)(step[1])
            planner.set_runtime_accepted(step[1], step[2])
        elif kind == "drop-node":
            inventories.pop(step[1], None)
            planner.remove_inventory(step[1])
        elif kind == "release":
            if bindings:
                uid = sorted(bindings)[step[1] % len(bindings)]
                del bindings[uid]
                planner.drop_binding(uid)
        else:
            request, node, namespace = REQUESTS[step[1]], step[2], step[3]
            view = build_view(inventories.values(), labelled, bindings.values(), sharing, accepted)
            try:
                expected: Binding | str = plan_binding(request, view, node, namespace=namespace)
            except Refusal as refusal:
                expected = refusal.code
            try:
                got: Binding | str = planner.plan(request, node, namespace=namespace)
            except Refusal as refusal:
                got = refusal.code
            assert got == expected, (request, node)
            event(f"decision: {got if isinstance(got, str) else got.mode}")  # shown by --hypothesis-show-statistics
            if isinstance(got, Binding):
                serial += 1
                bound = Binding(f"u{serial}", got.node, got.gpu, got.mode, got.granted_bytes, got.profile_id,
                                got.profile, got.start, got.size, namespace)
                bindings[bound.uid] = bound
                planner.put_binding(bound)
                assert bound.mode != MODE_MIG or labelled.issuperset({bound.node})
                assert inventories[bound.node].runtime_untrusted is None or bound.node in accepted
                assert next(g for g in inventories[bound.node].gpus if g.index == bound.gpu).health.healthy
