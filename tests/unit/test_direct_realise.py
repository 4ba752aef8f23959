import pytest

from mig_operator.core.placement.planner import Unplaceable
from mig_operator.core.placement.planning_index import choose_mig
from mig_operator.core.requests.request import slice_request
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.simulated import SimulatedBackend
from mig_operator.kube.agent.direct import planner_view
from mig_operator.kube.agent.direct import realise_decision as realise


@pytest.fixture
def sim(tmp_path):
    backend = SimulatedBackend("h100-80gb", count=2, state_file=str(tmp_path / "sim.json"))
    yield backend
    backend.close()


def views(backend, bound):
    return [planner_view(backend, i, bound) for i in range(2)]


def test_plan_then_realise_creates_exactly_the_decision(sim) -> None:
    bound: set[int] = set()
    d = choose_mig(slice_request(memory="5G"), views(sim, bound))
    made = realise(sim, d)
    assert (made.gpu_index, made.profile_id, made.start) == (d.gpu, d.profile.id, d.start)
    assert made.device_uuid.startswith("MIG-")
    bound.add(made.gi_id)
    view = planner_view(sim, d.gpu, bound)
    assert [(i.profile_id, i.start, i.in_use) for i in view.instances] == [(d.profile.id, d.start, True)]


def test_released_instance_is_reused_without_nvml_create(sim) -> None:
    d = choose_mig(slice_request(memory="5G"), views(sim, set()))
    first = realise(sim, d)
    # Released: no slice bound any more; the instance stays.
    again = choose_mig(slice_request(memory="5G"), views(sim, set()))
    assert again.action == "reuse" and again.start == first.start
    assert realise(sim, again).device_uuid == first.device_uuid


def test_reclaim_destroys_idle_instances_then_creates(sim) -> None:
    bound: set[int] = set()
    for _ in range(3):
        bound.add(realise(sim, choose_mig(slice_request(memory="5G"), [planner_view(sim, 0, bound)])).gi_id)
    assert len(sim.instances(0)) == 3
    d = choose_mig(slice_request(profile="7g.80gb"), [planner_view(sim, 0, set())])  # all released
    assert len(d.reclaim) == 3
    realise(sim, d)
    assert [(i.profile, i.start) for i in sim.instances(0)] == [("7g.80gb", 0)]


def test_reclaim_never_destroys_an_instance_with_a_process(sim) -> None:
    idle = realise(sim, choose_mig(slice_request(memory="5G"), [planner_view(sim, 0, set())]))
    # The cluster thinks it is idle, but a process still runs on it (DCGM #276-style holders too).
    sim.set_in_use(0, idle.gi_id, True)
    view = planner_view(sim, 0, set())
    assert view.instances[0].in_use, "NVML's in_use wins over cluster state"
    with pytest.raises(Unplaceable) as info:
        choose_mig(slice_request(profile="7g.80gb"), [view])
    assert "in use" in info.value.reason


def test_realise_reports_in_use_and_leaves_everything_in_place(sim) -> None:
    idle = realise(sim, choose_mig(slice_request(memory="5G"), [planner_view(sim, 0, set())]))
    d = choose_mig(slice_request(profile="7g.80gb"), [planner_view(sim, 0, set())])
    sim.set_in_use(0, idle.gi_id, True)  # a process appeared between planning and acting
    with pytest.raises(GpuError) as info:
        realise(sim, d)
    assert info.value.name == "IN_USE" and info.value.transient
    assert [i.gi_id for i in sim.instances(0)] == [idle.gi_id]


def test_retry_after_interrupted_reclaim_finishes_the_job(sim) -> None:
    bound: set[int] = set()
    for _ in range(2):
        bound.add(realise(sim, choose_mig(slice_request(memory="5G"), [planner_view(sim, 0, bound)])).gi_id)
    d = choose_mig(slice_request(profile="7g.80gb"), [planner_view(sim, 0, set())])
    sim.inject_fault("create_compute_instance", "UNKNOWN")
    with pytest.raises(GpuError):
        realise(sim, d)
    assert sim.instances(0) == [], "the reclaim set is gone and nothing half-made is left"
    assert realise(sim, d).profile == "7g.80gb"


def test_restarted_backend_sees_what_was_created(tmp_path) -> None:
    path = str(tmp_path / "state.json")
    first = SimulatedBackend("h200-141gb", state_file=path)
    made = realise(first, choose_mig(slice_request(memory="17Gi"), [planner_view(first, 0, set())]))
    first.close()
    second = SimulatedBackend("h200-141gb", state_file=path)
    assert [(i.gi_id, i.device_uuid) for i in second.instances(0)] == [(made.gi_id, made.device_uuid)]
    second.close()
