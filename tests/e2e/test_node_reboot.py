"""A node that reboots (simulated: the GPUs' instances gone, a new boot id) while slices and a pod hold
instances there: every slice is realised again on a live instance or fails with a reason, and no slice
stays Ready naming an instance that does not exist."""

from __future__ import annotations

from harness import OperatorHarness, check_invariants, wait_until
from test_pods import create_pod, running


def live_uuids(node) -> set[str]:
    backend = node.backend()
    return {inst.device_uuid for gpu in backend.gpus() for inst in backend.instances(gpu.index) if inst.complete}


def test_after_a_reboot_every_slice_is_realised_again_or_fails_and_none_stays_ready_without_an_instance(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    operator.start_operator(node, webhook=True)
    agent = operator.process(f"agent-{node.name}")
    ns = operator.namespace()
    for i, profile in enumerate(("1g.10gb", "2g.20gb", "3g.40gb")):
        operator.create_slice(ns, f"s{i}", {"migProfile": profile})
    create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name="work")
    running(operator, ns, "work", timeout=60)
    before = {s["metadata"]["name"]: operator.wait_phase(ns, s["metadata"]["name"], "Ready")["status"]["deviceUUID"]
              for s in operator.slices(ns)}
    assert set(before.values()) <= live_uuids(node)

    operator.kill(agent)
    node.backend().reboot()
    assert live_uuids(node) == set()
    operator.start(agent, env={})

    def settled() -> dict[str, dict] | None:
        now = {s["metadata"]["name"]: s["status"] for s in operator.slices(ns)}
        live = live_uuids(node)
        done = all(st.get("phase") == "Failed" or (st.get("phase") == "Ready" and st.get("deviceUUID") in live)
                   for st in now.values())
        return now if done and len(now) == len(before) else None

    after = wait_until(settled, 60, lambda: f"every slice Ready on a live instance or Failed: "
                       f"{[(s['metadata']['name'], s['status']) for s in operator.slices(ns)]}\n{operator.logs()}")
    for name, status in after.items():
        if status["phase"] == "Ready":
            assert status["deviceUUID"] != before[name], f"{name} names its instance of the last boot"
        else:
            assert status.get("message"), f"{name} failed without a reason"
    print({name: (st["phase"], st.get("reason")) for name, st in after.items()})
    check_invariants(operator)
