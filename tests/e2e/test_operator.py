"""The operator end to end: a real kube-apiserver, the controller and node agents as processes,
GPUs on the simulator. Expected profiles and placements come from the catalog's numbers and the
slot arithmetic written here, not from the planner under test."""

from __future__ import annotations

import json
import time

import pytest
from harness import OperatorHarness, SimNode, check_invariants, wait_until

from mig_operator.core.placement.profiles import get_model

MIB = 2**20


def creates(node: SimNode) -> int:
    """NVML creates so far on a node's simulated GPUs (the simulator counts every creation)."""
    state = json.loads(node.state_file.read_text())
    return sum(int(g["generation"]) for g in state["gpus"])


def start(op: OperatorHarness, *nodes: SimNode) -> None:
    op.start_operator(*nodes)


def test_17G_and_17Gi_get_the_profiles_whose_nvml_memory_covers_them(operator: OperatorHarness) -> None:
    h200 = operator.add_node("h200-141gb")
    start(operator, h200)
    ns = operator.namespace()
    operator.create_slice(ns, "dec", {"memory": "17G"})
    operator.create_slice(ns, "bin", {"memory": "17Gi"})
    dec = operator.wait_phase(ns, "dec", "Ready")["status"]
    binary = operator.wait_phase(ns, "bin", "Ready")["status"]
    # 17G = 16212.6 MiB fits 1g.18gb (16384 MiB); 17Gi = 17408 MiB does not, 1g.35gb (33280 MiB) does.
    assert (dec["profile"], dec["grantedBytes"]) == ("1g.18gb", 16384 * MIB)
    assert (binary["profile"], binary["grantedBytes"]) == ("1g.35gb", 33280 * MIB)
    for st in (dec, binary):
        assert st["mode"] == "mig" and st["node"] == h200.name and st["deviceUUID"].startswith("MIG-")
        assert st["reused"] is False and set(st["phaseTimes"]) >= {"Bound", "Creating", "Ready"}
        assert st["gpuUUID"].startswith("GPU-")
    shown = operator.cluster.kubectl("get", "gs", "-n", ns, "--no-headers").stdout
    assert "1g.18gb" in shown and "Ready" in shown
    check_invariants(operator)


def test_slices_pack_one_gpu_before_the_next_and_keep_a_whole_gpu_free(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    start(operator, node)
    ns = operator.namespace()
    for i in range(4):
        operator.create_slice(ns, f"small-{i}", {"memory": "9Gi"})  # 1g.10gb, 9984 MiB
    gpus = {operator.wait_phase(ns, f"small-{i}", "Ready")["status"]["gpu"] for i in range(4)}
    assert len(gpus) == 1, "four 1g slices share one GPU"
    operator.create_slice(ns, "whole", {"memory": "70Gi"})  # only 7g.80gb (81152 MiB) holds it
    whole = operator.wait_phase(ns, "whole", "Ready")["status"]
    assert whole["profile"] == "7g.80gb" and whole["gpu"] not in gpus
    check_invariants(operator)


def test_a_released_instance_is_reused_with_no_nvml_create(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    operator.create_slice(ns, "first", {"migProfile": "3g.40gb"})
    first = operator.wait_phase(ns, "first", "Ready")["status"]
    made = creates(node)
    operator.delete_slice(ns, "first")
    operator.wait_gone(ns, "first")
    idle = wait_until(lambda: [i for g in operator.gpunode(node)["status"]["gpus"] for i in g["instances"]
                               if not i["sliceUID"] and i.get("idleSince")], 10, "the instance to be idle")
    assert idle[0]["deviceUUID"] == first["deviceUUID"]
    operator.create_slice(ns, "second", {"memory": "30Gi"})  # 3g.40gb is the smallest holding 30Gi
    second = operator.wait_phase(ns, "second", "Ready")["status"]
    assert second["reused"] is True and second["deviceUUID"] == first["deviceUUID"]
    assert "Creating" not in second["phaseTimes"], "a reuse makes no NVML call, so it is never Creating"
    assert creates(node) == made, "reuse made no NVML create"
    check_invariants(operator)


def test_reclaim_destroys_only_the_idle_instances_in_the_way(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    for i in range(7):
        operator.create_slice(ns, f"one-{i}", {"migProfile": "1g.10gb"})
    starts = {operator.wait_phase(ns, f"one-{i}", "Ready")["status"]["placement"]["start"]: i for i in range(7)}
    assert sorted(starts) == [0, 1, 2, 3, 4, 5, 6]
    # Release the four 1g instances of the upper half (slots 4-7): a 3g (4 slots at 4) needs only those.
    kept = {s: i for s, i in starts.items() if s < 4}
    for s, i in starts.items():
        if s >= 4:
            operator.delete_slice(ns, f"one-{i}")
    for s, i in starts.items():
        if s >= 4:
            operator.wait_gone(ns, f"one-{i}")
    kept_devices = {operator.get_slice(ns, f"one-{i}")["status"]["deviceUUID"] for i in kept.values()}
    # The controller plans reclaims from the published inventory: wait until it shows them idle.
    wait_until(lambda: sum(1 for i in operator.gpunode(node)["status"]["gpus"][0]["instances"]
                           if not i["sliceUID"]) == 3, 10, "three idle instances in the GpuNode")
    operator.create_slice(ns, "three", {"migProfile": "3g.40gb"})
    three = operator.wait_phase(ns, "three", "Ready")["status"]
    assert three["placement"] == {"start": 4, "size": 4}
    assert sorted(r["start"] for r in three["reclaim"]) == [4, 5, 6]
    left = {i.device_uuid for i in node.backend().instances(0)}
    assert kept_devices <= left, "no instance in use was destroyed"
    assert len(left) == 5  # four 1g in the lower half and the new 3g
    check_invariants(operator)


def test_too_large_stays_pending_with_a_reason_and_room_makes_it_ready(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    operator.create_slice(ns, "huge", {"memory": "100Gi"})
    huge = operator.wait_phase(ns, "huge", "Pending", reason="TooLarge")["status"]
    assert "100Gi" in huge["message"] and "7g.80gb" in huge["message"]
    operator.create_slice(ns, "holder", {"migProfile": "4g.40gb"})
    operator.wait_phase(ns, "holder", "Ready")
    operator.create_slice(ns, "waiting", {"memory": "70Gi"})  # needs the whole GPU
    waiting = operator.wait_phase(ns, "waiting", "Pending", reason="NoCapacity")
    events = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=waiting").items
    assert any(e.reason == "NoCapacity" for e in events), "a Pending slice gets an Event with its reason"
    conditions = {c["type"]: c for c in waiting["status"]["conditions"]}
    assert conditions["Bound"]["status"] == "False" and conditions["Bound"]["reason"] == "NoCapacity"
    holder = operator.get_slice(ns, "holder")["status"]["deviceUUID"]
    operator.delete_slice(ns, "holder")
    ready = operator.wait_phase(ns, "waiting", "Ready", timeout=30)["status"]
    left = node.backend().instances(0)
    assert ready["profile"] == "7g.80gb" and [i.device_uuid for i in left] == [ready["deviceUUID"]]
    assert holder not in {i.device_uuid for i in left}, "the idle 4g instance was reclaimed"
    assert operator.get_slice(ns, "huge")["status"]["phase"] == "Pending"
    check_invariants(operator)


def test_fractions_go_to_gpus_without_mig_and_to_labelled_gpus_with_mig_disabled(operator: OperatorHarness) -> None:
    plain = operator.add_node("l40s-48gb", labelled=False)
    disabled = operator.add_node("h100-80gb", labelled=True, mig=False)
    start(operator, plain, disabled)
    gn = operator.wait_gpunode(disabled)["status"]["gpus"][0]
    assert gn["serves"] == "fraction" and "MIG mode is disabled" in gn["servesReason"]
    ns = operator.namespace()
    operator.create_slice(ns, "half", {"fraction": 0.5, "nodeName": plain.name})
    operator.create_slice(ns, "mem", {"memory": "30Gi", "nodeName": disabled.name})
    half = operator.wait_phase(ns, "half", "Ready")["status"]
    mem = operator.wait_phase(ns, "mem", "Ready")["status"]
    l40s = get_model("l40s-48gb").memory_mib * MIB
    assert half["mode"] == "fraction" and half["grantedBytes"] == (l40s // 2) // MIB * MIB
    assert half["deviceUUID"].startswith("GPU-") and half["deviceUUID"] == half["gpuUUID"]
    assert mem["mode"] == "fraction" and mem["grantedBytes"] == 30 * 2**30
    operator.create_slice(ns, "too-much", {"fraction": 0.6, "nodeName": plain.name})
    operator.wait_phase(ns, "too-much", "Pending", reason="NoCapacity")
    operator.create_slice(ns, "by-name", {"migProfile": "1g.10gb"})
    st = operator.wait_phase(ns, "by-name", "Pending")["status"]
    assert st["reason"] == "NoGpu" and "MIG" in st["message"]
    check_invariants(operator)


def test_removing_the_label_stops_new_mig_slices_and_keeps_the_old(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    operator.create_slice(ns, "before", {"memory": "5Gi"})
    before = operator.wait_phase(ns, "before", "Ready")["status"]
    operator.label(node, False)
    time.sleep(1)  # the controller's node watch sees the label go (a watch event: milliseconds)
    operator.create_slice(ns, "after", {"memory": "5Gi"})
    after = operator.wait_phase(ns, "after", "Pending")["status"]
    assert after["reason"] == "NoGpu"
    still = operator.get_slice(ns, "before")["status"]
    assert still["phase"] == "Ready" and still["deviceUUID"] == before["deviceUUID"]
    operator.label(node, True)
    assert operator.wait_phase(ns, "after", "Ready")["status"]["node"] == node.name
    check_invariants(operator)


def test_transient_nvml_faults_are_retried_and_a_lasting_one_fails_the_slice(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    node.backend().inject_fault("create_instance", "TIMEOUT", times=2)  # the agent tries 3 times
    operator.create_slice(ns, "retried", {"migProfile": "1g.10gb"})
    assert operator.wait_phase(ns, "retried", "Ready")["status"]["profile"] == "1g.10gb"
    node.backend().inject_fault("create_instance", "TIMEOUT", times=10)
    operator.create_slice(ns, "failed", {"migProfile": "2g.20gb"})
    failed = operator.wait_phase(ns, "failed", "Failed", timeout=60)["status"]
    assert "NVML_ERROR_TIMEOUT" in failed["message"] and failed["reason"] == "NvmlTimeout"
    events = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=failed").items
    assert any(e.reason == "NvmlTimeout" for e in events)
    node.backend().clear_faults()
    node.backend().inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=1)
    operator.create_slice(ns, "permanent", {"migProfile": "2g.20gb"})
    st = operator.wait_phase(ns, "permanent", "Failed")["status"]
    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in st["message"]
    check_invariants(operator)


def test_an_idle_timeout_destroys_idle_instances_only(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.agent(node, None, "--idle-timeout", "2s")
    operator.wait_gpunode(node)
    operator.controller()
    ns = operator.namespace()
    operator.create_slice(ns, "kept", {"migProfile": "1g.10gb"})
    operator.create_slice(ns, "gone", {"migProfile": "1g.10gb"})
    kept = operator.wait_phase(ns, "kept", "Ready")["status"]
    operator.wait_phase(ns, "gone", "Ready")
    operator.delete_slice(ns, "gone")
    wait_until(lambda: [i.device_uuid for i in node.backend().instances(0)] == [kept["deviceUUID"]], 20,
               lambda: f"only the held instance to remain: {node.backend().instances(0)}")
    check_invariants(operator)


def test_a_restarted_agent_adopts_its_instances_and_a_lost_record_is_rebuilt(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    agent = operator.process(f"agent-{node.name}")
    ns = operator.namespace()
    for i in range(3):
        operator.create_slice(ns, f"s{i}", {"migProfile": "1g.10gb"})
    devices = {operator.wait_phase(ns, f"s{i}", "Ready")["status"]["deviceUUID"] for i in range(3)}
    operator.delete_slice(ns, "s2")
    operator.wait_gone(ns, "s2")
    operator.kill(agent)
    node.record_file.unlink()  # the record is lost: slices' bindings must be enough
    made = creates(node)
    operator.start(agent)
    operator.wait_gpunode(node)
    entries = wait_until(lambda: list((node.record().get("owners") or {}).values()), 10, "the record to be rebuilt")
    owners = {e["uid"] for e in entries}
    assert owners == {operator.get_slice(ns, f"s{i}")["metadata"]["uid"] for i in range(2)}
    assert {i.device_uuid for i in node.backend().instances(0)} == devices, "nothing destroyed on start"
    operator.create_slice(ns, "s3", {"migProfile": "1g.10gb"})
    s3 = operator.wait_phase(ns, "s3", "Ready")["status"]
    assert s3["reused"] is True and creates(node) == made
    check_invariants(operator)


@pytest.mark.parametrize("point", ["agent:after-intent", "agent:after-create", "agent:during-reclaim"])
def test_an_agent_killed_while_realising_finishes_after_restart(operator: OperatorHarness, point: str) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    agent = operator.process(f"agent-{node.name}")
    ns = operator.namespace()
    for i in range(7):
        operator.create_slice(ns, f"one-{i}", {"migProfile": "1g.10gb"})
    at = {operator.wait_phase(ns, f"one-{i}", "Ready")["status"]["placement"]["start"]: f"one-{i}" for i in range(7)}
    holder = operator.get_slice(ns, at[0])
    busy = holder["status"]
    node.backend().set_in_use(0, busy["giId"], True)  # a process runs on the instance at slot 0
    for start_slot in (4, 5, 6):
        operator.delete_slice(ns, at[start_slot])
        operator.wait_gone(ns, at[start_slot])
    operator.stop(agent)
    operator.start(agent, env={"MIG_OPERATOR_CRASHPOINT": point})
    operator.wait_gpunode(node)
    # A 3g.40gb fits only at slot 4 now (0-3 are held): the idle 1g at 4, 5, 6 must be reclaimed.
    operator.create_slice(ns, "big", {"migProfile": "3g.40gb"})
    assert operator.wait_exit(agent) == -9, f"the agent reached {point} and was killed"
    operator.start(agent, env={})
    big = operator.wait_phase(ns, "big", ("Ready", "Failed"), timeout=40)
    assert big["status"]["phase"] == "Ready", big["status"]
    assert big["status"]["placement"] == {"start": 4, "size": 4}
    assert holder["metadata"]["uid"] in node.record()["owners"]
    check_invariants(operator, in_use=[(node.name, 0, busy["deviceUUID"])])


def test_an_agent_killed_during_release_leaves_the_instance_idle_after_restart(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    agent = operator.process(f"agent-{node.name}")
    ns = operator.namespace()
    operator.create_slice(ns, "s", {"migProfile": "2g.20gb"})
    device = operator.wait_phase(ns, "s", "Ready")["status"]["deviceUUID"]
    operator.stop(agent)
    operator.start(agent, env={"MIG_OPERATOR_CRASHPOINT": "agent:during-release"})
    operator.wait_gpunode(node)
    operator.delete_slice(ns, "s")
    assert operator.wait_exit(agent) == -9
    assert operator.get_slice(ns, "s") is not None, "the finalizer holds the slice while its agent is down"
    operator.start(agent, env={})
    operator.wait_gone(ns, "s")
    operator.create_slice(ns, "t", {"migProfile": "2g.20gb"})
    t = operator.wait_phase(ns, "t", "Ready")["status"]
    assert t["reused"] is True and t["deviceUUID"] == device
    check_invariants(operator)


def test_a_controller_killed_after_binding_finishes_the_binding_after_restart(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    for n in (node,):
        operator.agent(n)
    operator.wait_gpunode(node)
    controller = operator.controller({"MIG_OPERATOR_CRASHPOINT": "controller:after-bind"})
    ns = operator.namespace()
    operator.create_slice(ns, "a", {"migProfile": "1g.10gb"})
    assert operator.wait_exit(controller) == -9
    bound = operator.get_slice(ns, "a")
    assert bound["status"]["phase"] == "Bound" and "cdmo.io/agent" not in (bound["metadata"].get("finalizers") or [])
    # Its agent sees it (status.node) but realises only a slice that carries its finalizer.
    time.sleep(1.0)
    assert operator.get_slice(ns, "a")["status"]["phase"] == "Bound"
    operator.start(controller, env={})
    operator.create_slice(ns, "b", {"migProfile": "1g.10gb"})
    a = operator.wait_phase(ns, "a", "Ready")["status"]
    b = operator.wait_phase(ns, "b", "Ready")["status"]
    assert a["placement"]["start"] != b["placement"]["start"]
    check_invariants(operator)


def test_the_standby_controller_takes_over(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    active = operator.controller(None, "--priority", "200", "--peering-lifetime", "3")
    operator.controller(None, "--priority", "100", "--peering-lifetime", "3")
    ns = operator.namespace()
    operator.create_slice(ns, "one", {"memory": "5Gi"})
    operator.wait_phase(ns, "one", "Ready")
    operator.kill(active)
    operator.create_slice(ns, "two", {"memory": "5Gi"})
    two = operator.wait_phase(ns, "two", "Ready", timeout=40)["status"]
    assert two["node"] == node.name
    check_invariants(operator)


def test_a_controller_killed_while_agents_create_release_and_reclaim_loses_nothing(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    operator.agent(node, None, "--sim-latency", "0.5")  # every NVML create or destroy takes 0.5 s
    operator.wait_gpunode(node)
    controller = operator.controller()
    ns = operator.namespace()
    for i in range(6):
        operator.create_slice(ns, f"a{i}", {"migProfile": "1g.10gb"})
    held = [operator.wait_phase(ns, f"a{i}", "Ready", timeout=60)["status"] for i in range(6)]
    # After a0-a2 go, a 3g (4 slots, at start 0 or 4) fits on every aligned quarter a3-a5 leave free.
    busy = {(st["gpu"], st["placement"]["start"]) for st in held[3:]}
    fits = sum(1 for gpu in (0, 1) for start in (0, 4) if not any((gpu, s) in busy for s in range(start, start + 4)))
    for i in range(3):
        operator.delete_slice(ns, f"a{i}")  # releases, while the agent is busy with what follows
    for i in range(4):
        operator.create_slice(ns, f"b{i}", {"migProfile": "3g.40gb"})  # creates, some after reclaims
    time.sleep(0.7)
    operator.kill(controller)  # bindings written or not, instances half way
    time.sleep(1.5)
    operator.start(controller, env={})
    for i in range(4):
        operator.wait_phase(ns, f"b{i}", ("Ready", "Pending"), timeout=90)
    want = 3 + min(4, fits)
    wait_until(lambda: sum(b["status"]["phase"] == "Ready" for b in operator.slices(ns)) == want, 60,
               lambda: f"{want} Ready: {[(b['metadata']['name'], b['status']) for b in operator.slices(ns)]}")
    check_invariants(operator)
