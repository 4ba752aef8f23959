"""What a user sees, end to end: why a slice waits (`kubectl get gs` REASON, a node that does not
exist), the GpuNode's figures against the slices' own statuses and the simulated GPUs, one INFO line
per decision in the parts' logs, refused pods at INFO, and the MIG label reflected at once.

Where a user acts (makes a slice or a pod, reads `kubectl get gs`), the user is played: a user holding
only the built-in ``edit`` role in its namespace (tests/e2e/tenants.py), through the API server's RBAC."""

from __future__ import annotations

import json
import re
import time

import kubernetes
import pytest
from harness import GROUP, VERSION, OperatorHarness, SimNode, unique, wait_until
from kubernetes.client.rest import ApiException
from tenants import edit_tenant

SUMMARY = ("inUseInstances", "idleInstances", "usedSlots", "idleSlots", "freeSlots")


def table(output: str) -> list[list[str]]:
    """kubectl's table as rows of cells, cut where the header's columns start."""
    lines = output.rstrip().splitlines()
    starts = [match.start() for match in re.finditer(r"\S+(?: \S+)*", lines[0])]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [[line[start:end].strip() for start, end in bounds] for line in lines]


def expected_summary(op: OperatorHarness, node: SimNode) -> dict[str, int]:
    """The GpuNode's figures computed from elsewhere: instances from the simulated GPUs, who holds
    them from the slices' statuses (Creating or Ready MIG slices on this node)."""
    held = {(s["status"]["gpu"], s["status"].get("giId")) for s in op.slices()
            if (s.get("status") or {}).get("phase") in ("Creating", "Ready")
            and s["status"].get("node") == node.name and s["status"].get("mode") == "mig"}
    backend = node.backend()
    figures = dict.fromkeys(SUMMARY, 0)
    for gpu in backend.gpus():
        if not gpu.mig_enabled:
            continue
        slots = 8  # every catalog model used here has eight memory slots
        for inst in backend.instances(gpu.index):
            kind = "inUse" if (gpu.index, inst.gi_id) in held else "idle"
            figures[f"{kind}Instances"] += 1
            figures["usedSlots" if kind == "inUse" else "idleSlots"] += inst.size
            slots -= inst.size
        figures["freeSlots"] += slots
    return figures


def published(op: OperatorHarness, node: SimNode) -> dict[str, int]:
    status = (op.gpunode(node) or {}).get("status") or {}
    return {k: status.get(k, -1) for k in SUMMARY}


def log_lines(op: OperatorHarness, part: str, needle: str) -> list[str]:
    return [line for proc in op.procs if proc.name.startswith(part) and proc.log.exists()
            for line in proc.log.read_text(errors="replace").splitlines() if needle in line]


def test_a_slice_pinned_to_a_missing_node_says_so_and_binds_when_the_node_comes(operator: OperatorHarness) -> None:
    operator.controller()
    ns = operator.namespace()
    late = unique("late")
    user = kubernetes.client.CustomObjectsApi(edit_tenant(operator.cluster, ns, "viewing-user"))
    user.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice", "metadata": {"name": "pinned"},
        "spec": {"memory": "20Gi", "nodeName": late}})
    operator.wait_phase(ns, "pinned", "Pending", reason="NoSuchNode")
    st = user.get_namespaced_custom_object(GROUP, VERSION, ns, "gpuslices", "pinned")["status"]
    assert st["message"] == (f"node {late} does not exist or runs no mig-operator agent (there is no GpuNode "
                             f"{late}): memory 20Gi waits for it")
    rows = table(operator.cluster.kubectl("get", "gs", "-n", ns, "--as=viewing-user").stdout)
    assert rows[0][:4] == ["NAME", "REQUEST", "PHASE", "REASON"]
    assert rows[1][:4] == ["pinned", "memory 20Gi", "Pending", "NoSuchNode"]
    assert len(log_lines(operator, "controller", f"slice {ns}/pinned waits (NoSuchNode)")) == 1
    node = operator.add_node("h100-80gb", name=late)  # the node and its agent come; nothing restarts
    operator.agent(node)
    st = operator.wait_phase(ns, "pinned", "Ready")["status"]
    assert st["node"] == late and st["profile"] == "3g.40gb"


def test_gpunode_figures_agree_with_the_slices_and_every_decision_is_logged_once(
        operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node)
    ns = operator.namespace()

    def settled(what: str) -> None:
        wait_until(lambda: published(operator, node) == expected_summary(operator, node), 10,
                   lambda: f"GpuNode figures {what}: {published(operator, node)}, from the slices and GPUs "
                           f"{expected_summary(operator, node)}\n{operator.logs()}")

    for name, profile in (("a", "3g.40gb"), ("b", "1g.10gb"), ("c", "1g.10gb")):
        operator.create_slice(ns, name, {"migProfile": profile})
    for name in "abc":
        operator.wait_phase(ns, name, "Ready")
    settled("with three slices Ready")
    operator.delete_slice(ns, "b")  # its instance becomes idle
    operator.wait_gone(ns, "b")
    settled("after one release")
    # By hand: 3g (4 slots) and 1g (1) in use, 1g (1) idle, 2 slots under no instance.
    assert published(operator, node) == {"inUseInstances": 2, "idleInstances": 1, "usedSlots": 5, "idleSlots": 1,
                                         "freeSlots": 2}
    rows = table(operator.cluster.kubectl("get", "gn", node.name).stdout)
    assert rows[0][3:8] == ["INSTANCES IN USE", "IDLE INSTANCES", "SLOTS IN USE", "IDLE SLOTS", "FREE SLOTS"]
    assert rows[1][3:8] == ["2", "1", "5", "1", "2"]

    operator.create_slice(ns, "d", {"migProfile": "1g.10gb"})  # takes b's idle instance
    assert operator.wait_phase(ns, "d", "Ready")["status"]["reused"] is True
    settled("after a reuse")
    for name in "acd":
        operator.delete_slice(ns, name)
    for name in "acd":
        operator.wait_gone(ns, name)
    settled("with every instance idle")
    operator.create_slice(ns, "e", {"migProfile": "7g.80gb"})  # reclaims the three idle instances
    operator.wait_phase(ns, "e", "Ready")
    settled("after a reclaim")

    for name in "acde":
        bound = log_lines(operator, "controller", f"INFO mig_operator.controller: slice {ns}/{name} (profile ")
        assert len(bound) == 1 and " bound to " in bound[0] and f"on {node.name} GPU 0" in bound[0], bound
    for name in "ace":
        assert len(log_lines(operator, "agent", f"slice {ns}/{name}: creating ")) == 1
        ready = log_lines(operator, "agent", f"slice {ns}/{name} ready: created ")
        assert len(ready) == 1 and f"on {node.name} GPU 0: MIG-" in ready[0], ready
    assert len(log_lines(operator, "agent", f"slice {ns}/d ready: reused idle 1g.10gb at ")) == 1
    assert not log_lines(operator, "agent", f"slice {ns}/d: creating ")
    for name in "abcd":
        released = log_lines(operator, "agent", f"slice {ns}/{name} released: ")
        assert len(released) == 1 and "stays as an idle instance (MIG-" in released[0], released
    assert len(log_lines(operator, "agent", f"slice {ns}/e: reclaimed idle ")) == 3
    assert "7g.80gb at {0}:8" in log_lines(operator, "agent", f"slice {ns}/e ready: created ")[0]


def test_a_refused_pod_is_an_info_line_not_an_error(operator: OperatorHarness) -> None:
    operator.start_operator(operator.add_node("h100-80gb"), webhook=True)
    ns = operator.namespace()
    user = kubernetes.client.CoreV1Api(edit_tenant(operator.cluster, ns, "pod-user"))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "bad", "annotations": {"cdmo.io/gpu-memory": "4X"}},
           "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                    "containers": [{"name": "main", "image": "busybox"}]}}
    with pytest.raises(ApiException) as refused:
        user.create_namespaced_pod(ns, pod)
    assert refused.value.status == 400 and "'4X'" in json.loads(refused.value.body)["message"]
    needle = f"INFO mig_operator.webhook: pod {ns}/bad refused at admission: "
    wait_until(lambda: log_lines(operator, "controller", needle), 5, lambda: f"{needle!r} in\n{operator.logs()}")
    assert "'4X'" in log_lines(operator, "controller", needle)[0]
    assert not log_lines(operator, "controller", "ERROR"), operator.logs()


def test_removing_the_mig_label_shows_in_the_gpunode_at_once(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.agent(node)
    assert operator.wait_gpunode(node)["status"]["gpus"][0]["serves"] == "mig"
    for labelled, serves in ((False, "none"), (True, "mig")):
        operator.label(node, labelled)
        changed = time.monotonic()
        # 2 s: a bound on the reaction (watch event + the agent's 1 s write coalescing), well under the
        # 30 s heartbeat that used to carry it; not a performance figure.
        wait_until(lambda s=serves: operator.gpunode(node)["status"]["gpus"][0]["serves"] == s, 2,
                   lambda s=serves: f"GpuNode serving {s} after the label change\n{operator.logs()}")
        print(f"label {'added' if labelled else 'removed'}: GpuNode says {serves} after "
              f"{time.monotonic() - changed:.2f} s")


def test_an_annotated_pod_as_large_as_the_api_server_takes_is_served_by_the_webhook(
        operator: OperatorHarness) -> None:
    """The API server takes a request body of up to 3 MiB; the webhook reads the review it sends for
    such a pod (past the 1 MiB its HTTP server would take by default) and serves it. A dry run, so the
    pod need not fit etcd's own limit."""
    operator.start_operator(operator.add_node("h100-80gb"), webhook=True)
    ns = operator.namespace()
    user = kubernetes.client.CoreV1Api(edit_tenant(operator.cluster, ns, "large-pod-user"))
    padding = "x" * (2 * 2**20 + 512 * 1024)  # 2.5 MiB of one container's environment
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "large", "annotations": {"cdmo.io/gpu-memory": "4G"}},
           "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                    "containers": [{"name": "main", "image": "busybox", "env": [{"name": "PAD", "value": padding}]}]}}
    made = user.create_namespaced_pod(ns, pod, dry_run="All")
    assert [c.name for c in made.spec.resource_claims or []] == ["gpu-slice"], made.spec.resource_claims
    assert not log_lines(operator, "controller", "ERROR"), operator.logs()
