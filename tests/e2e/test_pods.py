"""Pods that ask for a slice with one annotation, end to end: the webhook, the gate, the slice's
ResourceClaim allocated by the controller in the node's pool, node pinning and cleanup,
on a real control plane with kube-scheduler, kube-controller-manager (garbage collection,
Deployments) and kwok nodes matching the simulated agents."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from harness import OperatorHarness, SimNode, check_invariants, wait_until
from kubernetes.client.rest import ApiException
from test_metrics import free_port, scrape, value

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "gpuslice_specs.yaml"
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists"}
GATE = "cdmo.io/gpu-slice"


def pod_body(annotations: dict[str, str] | None, name: str | None = None, **spec: Any) -> dict:
    meta: dict[str, Any] = {"annotations": annotations or {}}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = "work-"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"tolerations": [KWOK_TOLERATION], "containers": [{"name": "main", "image": "busybox"}],
                     **spec}}


def create_pod(op: OperatorHarness, ns: str, annotations: dict[str, str] | None, **kw: Any) -> dict:
    return op.core.create_namespaced_pod(ns, pod_body(annotations, **kw)).to_dict()


def running(op: OperatorHarness, ns: str, name: str, timeout: float = 40) -> Any:
    def check() -> Any:
        pod = op.core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase == "Running" and pod.spec.node_name else None

    return wait_until(check, timeout, lambda: f"pod {ns}/{name} Running: {op.core.read_namespaced_pod(name, ns).status}"
                      f"\n{op.logs()}")


def slice_of(op: OperatorHarness, pod: Any) -> dict:
    name = pod.metadata.labels["cdmo.io/gpu-slice"]
    return op.get_slice(pod.metadata.namespace, name)


def handed_device(op: OperatorHarness, pod: Any) -> dict[str, str]:
    """The device the pod gets, checked on the way: the pod names its slice's ResourceClaim (and adds
    no env, envFrom or volume of the operator's), the claim is allocated to exactly
    the slice's device on the pod's node and reserved for the pod. Returns the device's attributes as
    the agent's ResourceSlice publishes them (names without the driver prefix), plus its memory."""
    ns, name = pod.metadata.namespace, pod.metadata.labels["cdmo.io/gpu-slice"]
    assert [(c.name, c.resource_claim_name) for c in pod.spec.resource_claims or []] == [("gpu-slice", name)]
    for container in [*pod.spec.containers, *(pod.spec.init_containers or [])]:
        assert [c.name for c in container.resources.claims] == ["gpu-slice"]
        assert not container.env_from
        assert not [e for e in container.env or [] if e.name.startswith(("CDMO_", "NVIDIA_"))]
        assert not [m for m in container.volume_mounts or [] if "cdmo" in m.name]
    # The pod may run before the slice's status names its claim (the claim is the slice's by name).
    sl = wait_until(lambda: (found := op.get_slice(ns, name)) and (found.get("status") or {}).get("claim") and found,
                    30, f"slice {ns}/{name} naming its claim")
    assert sl["status"]["claim"] == name
    claim = op.custom.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", name)
    owners = [(r["kind"], r["uid"]) for r in claim["metadata"]["ownerReferences"]]
    assert owners == [("GpuSlice", sl["metadata"]["uid"])]
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (
        "gpu.cdmo.io", pod.spec.node_name, sl["metadata"]["uid"])
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod.metadata.uid]
    slices = op.custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")["items"]
    [device] = [d for s in slices if (s["spec"]["driver"], s["spec"]["nodeName"]) == ("gpu.cdmo.io", pod.spec.node_name)
                for d in s["spec"].get("devices") or [] if d["name"] == result["device"]]
    attributes = {k.removeprefix("gpu.cdmo.io/"): str(next(iter(v.values()))) for k, v in device["attributes"].items()}
    return {**attributes, "memory": str(device["capacity"]["gpu.cdmo.io/memory"]["value"])}


def start(op: OperatorHarness, *nodes: SimNode) -> None:
    op.start_operator(*nodes, webhook=True)


@pytest.mark.compat
def test_annotated_pods_run_on_their_slice_with_exactly_its_environment(operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb")
    plain = operator.add_node("l40s-48gb", labelled=False)
    start(operator, mig, plain)
    ns = operator.namespace()
    by_memory = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"})["metadata"]["name"]
    by_profile = create_pod(operator, ns, {"cdmo.io/mig-profile": "2g.20gb"}, name="by-profile")["metadata"]["name"]
    by_fraction = create_pod(operator, ns, {"cdmo.io/gpu-fraction": "0.25"},
                             nodeSelector={"kubernetes.io/hostname": plain.name},
                             initContainers=[{"name": "init", "image": "busybox"}])["metadata"]["name"]
    for name in (by_memory, by_profile):
        pod = running(operator, ns, name)
        sl = slice_of(operator, pod)
        st = sl["status"]
        assert pod.spec.node_name == mig.name == st["node"]
        assert handed_device(operator, pod) == {
            "slice": sl["metadata"]["uid"], "sliceName": sl["metadata"]["name"], "sliceNamespace": ns, "mode": "mig",
            "profile": st["profile"], "uuid": st["deviceUUID"], "memory": str(st["grantedBytes"])}
        assert st["deviceUUID"].startswith("MIG-")
        assert pod.spec.scheduling_gates is None or all(g.name != GATE for g in pod.spec.scheduling_gates)
    assert slice_of(operator, running(operator, ns, by_memory))["status"]["profile"] == "1g.10gb"
    pod = running(operator, ns, by_fraction)
    sl = slice_of(operator, pod)
    st = sl["status"]
    limit = int(46068 * 2**20 * 0.25) // 2**20 * 2**20  # a quarter of the L40S's memory, whole MiB
    assert pod.spec.node_name == plain.name and st["mode"] == "fraction" and st["grantedBytes"] == limit
    assert handed_device(operator, pod) == {
        "slice": sl["metadata"]["uid"], "sliceName": sl["metadata"]["name"], "sliceNamespace": ns, "mode": "fraction",
        "profile": "", "uuid": st["gpuUUID"], "memory": str(limit)}
    assert st["gpuUUID"].startswith("GPU-")
    check_invariants(operator)


def test_the_webhook_in_its_own_process_admits_pods_while_no_controller_runs(operator: OperatorHarness) -> None:
    """`mig-operator webhook` (the chart's webhook Deployment) changes an annotated pod at admission as
    `controller --webhook` does, with no controller running: admission never waits for the controller.
    The pod waits, gated, until a controller starts, then runs on its slice."""
    node = operator.add_node("h100-80gb")
    operator.start_operator(node, webhook="process")
    [controller] = [p for p in operator.procs if p.name == "controller"]
    operator.stop(controller)
    ns = operator.namespace()
    name = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"})["metadata"]["name"]
    pod = operator.core.read_namespaced_pod(name, ns)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE]
    assert [(c.name, c.resource_claim_name) for c in pod.spec.resource_claims] == [
        ("gpu-slice", pod.metadata.labels["cdmo.io/gpu-slice"])]
    # Admission is over (the pod is created): no controller runs, so nothing else could make a slice.
    assert not operator.custom.list_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuslices")["items"]
    operator.start(controller)
    pod = running(operator, ns, name)
    sl = slice_of(operator, pod)
    assert pod.spec.node_name == node.name == sl["status"]["node"]
    assert handed_device(operator, pod)["slice"] == sl["metadata"]["uid"]
    check_invariants(operator)


def test_a_memory_request_runs_as_a_fraction_when_every_mig_gpu_is_full(operator: OperatorHarness) -> None:
    mig = operator.add_node("a100-40gb")
    plain = operator.add_node("l4-24gb", labelled=False)
    start(operator, mig, plain)
    ns = operator.namespace()
    full = create_pod(operator, ns, {"cdmo.io/mig-profile": "7g.40gb"}, name="full")["metadata"]["name"]
    assert running(operator, ns, full).spec.node_name == mig.name
    pod = running(operator, ns, create_pod(operator, ns, {"cdmo.io/gpu-memory": "4Gi"})["metadata"]["name"])
    device = handed_device(operator, pod)
    assert pod.spec.node_name == plain.name
    assert device["uuid"].startswith("GPU-") and device["mode"] == "fraction" and device["memory"] == str(4 * 2**30)


@pytest.mark.compat
def test_bad_annotations_and_mixed_requests_are_refused_at_admission(operator: OperatorHarness) -> None:
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    corpus = yaml.safe_load(CORPUS.read_text())["invalid"]
    cases: list[tuple[dict[str, str], str]] = []
    for case in corpus:
        spec = case["spec"]
        if set(spec) == {"memory"} and isinstance(spec["memory"], str):
            cases.append(({"cdmo.io/gpu-memory": spec["memory"]}, case["message"]))
        elif set(spec) == {"migProfile"} and isinstance(spec["migProfile"], str):
            cases.append(({"cdmo.io/mig-profile": spec["migProfile"]}, case["message"]))
        elif set(spec) == {"fraction"} and isinstance(spec["fraction"], int | float):
            # Refused as out of (0, 1] or, for a sign, as not a plain decimal: either way it names the value.
            cases.append(({"cdmo.io/gpu-fraction": str(spec["fraction"])}, f"'{spec['fraction']}'"))
    assert len(cases) > 20, "the shared corpus gives the annotation cases"
    cases += [
        ({"cdmo.io/gpu-memory": "4G", "cdmo.io/gpu-fraction": "0.5"}, "only one of"),
        ({"cdmo.io/gpu-memroy": "4G"}, "not a slice annotation"),
        # Keys are case-sensitive: a key in the wrong case, or a misspelt mig- key, reaches the webhook
        # (matchConditions compare in lower case) and is refused instead of leaving the pod unsliced.
        ({"cdmo.io/GPU-memory": "4G"}, "not a slice annotation"),
        ({"cdmo.io/mig-profiles": "1g.10gb"}, "not a slice annotation"),
        ({"cdmo.io/gpu-fraction": "half"}, "not a number"),
    ]
    for given, message in cases:
        with pytest.raises(ApiException) as refused:
            create_pod(operator, ns, given, name="bad")
        text = json.loads(refused.value.body)["message"]
        assert refused.value.status == 400 and message.lower() in text.lower(), (given, text)
        assert next(iter(given)) in text, f"the refusal names the annotation: {text}"
        # ... and its value, quoted (at most about 100 characters of it), and what to write instead.
        value = next(iter(given.values()))
        assert repr(value)[:30].rstrip("'") in text and len(text) < 600, (given, text)
        assert re.search(r"(e\.g\.|such as) [^;]*'[^']+'", text), text
    with pytest.raises(ApiException) as mixed:
        create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, name="mixed",
                   containers=[{"name": "main", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}}])
    assert "nvidia.com/gpu" in mixed.value.body
    with pytest.raises(ApiException) as mig_resource:
        create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, name="mig-res",
                   containers=[{"name": "main", "image": "busybox",
                                "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}])
    assert "nvidia.com/mig-1g.10gb" in mig_resource.value.body
    # A container's own NVIDIA_VISIBLE_DEVICES=all would show the whole GPU where the runtime honours
    # the variable. It used to be admitted, and the pod ran on the whole GPU beside the others.
    with pytest.raises(ApiException) as env:
        create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, name="env",
                   containers=[{"name": "main", "image": "busybox",
                                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}])
    text = json.loads(env.value.body)["message"]
    assert env.value.status == 400 and "NVIDIA_VISIBLE_DEVICES" in text and "cdmo.io/gpu-memory: '4G'" in text
    assert operator.core.list_namespaced_pod(ns).items == []


def test_unannotated_pods_are_untouched_even_with_the_webhook_down(operator: OperatorHarness) -> None:
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    controller = operator.procs[-1]
    operator.kill(controller)  # the webhook configuration stays, its server is gone
    plain = create_pod(operator, ns, {"team": "a"}, name="plain")
    assert plain["spec"].get("scheduling_gates") is None
    assert not any(c.get("env_from") for c in plain["spec"]["containers"])
    assert "cdmo.io/gpu-slice" not in (plain["metadata"].get("labels") or {})
    running(operator, ns, "plain")
    with pytest.raises(ApiException) as down:
        create_pod(operator, ns, {"cdmo.io/gpu-memory": "4G"}, name="waits")
    assert down.value.status >= 500 or "webhook" in down.value.body, "an annotated pod is refused, not let through"


@pytest.mark.compat
def test_a_deployment_of_ten_annotated_replicas_runs(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    start(operator, node)
    ns = operator.namespace()
    apps = kubernetes.client.AppsV1Api(operator.cluster.api_client)
    template = pod_body({"cdmo.io/gpu-memory": "5Gi"})
    template["metadata"].pop("generateName")
    del template["apiVersion"], template["kind"]
    template["metadata"]["labels"] = {"app": "infer"}
    apps.create_namespaced_deployment(ns, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "infer"},
        "spec": {"replicas": 10, "selector": {"matchLabels": {"app": "infer"}}, "template": template}})

    def all_running() -> list[Any] | None:
        pods = operator.core.list_namespaced_pod(ns, label_selector="app=infer").items
        ok = [p for p in pods if p.status.phase == "Running"]
        return ok if len(ok) == 10 else None

    pods = wait_until(all_running, 90, lambda: f"10 Running replicas\n{operator.logs()}")
    devices = [handed_device(operator, p)["uuid"] for p in pods]
    assert len(set(devices)) == 10, "no instance serves two pods"
    check_invariants(operator)


@pytest.mark.compat
def test_deleting_pods_frees_their_slices_and_the_next_pods_reuse_the_instances(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    first = [running(operator, ns, create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"},
                                              name=f"a{i}")["metadata"]["name"]) for i in range(3)]
    devices = {handed_device(operator, p)["uuid"] for p in first}
    slices = [p.metadata.labels["cdmo.io/gpu-slice"] for p in first]
    for pod in first:
        operator.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
    for name in slices:
        operator.wait_gone(ns, name, timeout=60)  # garbage collection of the pod's slice
    second = [running(operator, ns, create_pod(operator, ns, {"cdmo.io/gpu-memory": "9Gi"},
                                               name=f"b{i}")["metadata"]["name"]) for i in range(3)]
    assert {handed_device(operator, p)["uuid"] for p in second} == devices
    assert all(slice_of(operator, p)["status"]["reused"] for p in second)
    check_invariants(operator)


def test_a_pod_that_cannot_be_served_stays_gated_with_a_reason_until_room_appears(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    holder = create_pod(operator, ns, {"cdmo.io/mig-profile": "7g.80gb"}, name="holder")["metadata"]["name"]
    running(operator, ns, holder)
    waiting = create_pod(operator, ns, {"cdmo.io/gpu-memory": "20Gi"}, name="waiting")["metadata"]["name"]

    def event() -> Any:
        events = operator.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={waiting}").items
        return [e for e in events if e.reason == "NoCapacity"]

    wait_until(event, 20, "a NoCapacity Event on the waiting pod")
    pod = operator.core.read_namespaced_pod(waiting, ns)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE] and pod.spec.node_name is None
    operator.core.delete_namespaced_pod(holder, ns, grace_period_seconds=0)
    assert running(operator, ns, waiting, timeout=60).spec.node_name == node.name


def test_a_waiting_pods_slice_goes_with_the_pod_though_no_agent_ever_held_it(operator: OperatorHarness) -> None:
    """A pod's slice carries the agent's finalizer from creation (binding is then one write); one
    deleted before it was bound reaches no agent, so the controller takes the finalizer off."""
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    holder = create_pod(operator, ns, {"cdmo.io/mig-profile": "7g.80gb"}, name="holder")["metadata"]["name"]
    running(operator, ns, holder)
    pod = create_pod(operator, ns, {"cdmo.io/gpu-memory": "20Gi"}, name="waiting")
    name = pod["metadata"]["labels"]["cdmo.io/gpu-slice"]
    waiting = wait_until(lambda: (s := operator.get_slice(ns, name)) and (s.get("status") or {}).get("reason")
                         == "NoCapacity" and s, 20, "the waiting pod's slice Pending with reason NoCapacity")
    assert waiting["metadata"]["finalizers"] == ["cdmo.io/agent"] and "node" not in waiting["status"]
    operator.core.delete_namespaced_pod(pod["metadata"]["name"], ns, grace_period_seconds=0)
    operator.wait_gone(ns, name, timeout=60)
    assert operator.core.read_namespaced_pod(holder, ns).status.phase == "Running"
    check_invariants(operator)


def test_pods_gated_while_the_controller_restarts_all_end_running(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb", count=2)
    start(operator, node)
    ns = operator.namespace()
    controller = operator.procs[-1]
    names = [create_pod(operator, ns, {"cdmo.io/gpu-memory": "9Gi"}, name=f"p{i}")["metadata"]["name"]
             for i in range(6)]
    operator.kill(controller)  # some pods gated, some slices bound or not
    operator.start(controller, env={})
    for name in names:
        running(operator, ns, name, timeout=60)
    check_invariants(operator)


def test_a_hundred_annotated_pods_at_once_on_four_nodes_overcommit_nothing(operator: OperatorHarness) -> None:
    nodes = [operator.add_node("h100-80gb", count=2) for _ in range(3)] + [operator.add_node("l40s-48gb",
                                                                                            labelled=False)]
    start(operator, *nodes)
    ns = operator.namespace()
    sizes = ["4G", "9Gi", "15Gi", "30Gi"]  # 1g.10gb, 1g.10gb, 1g.20gb, 3g.40gb
    for i in range(100):
        create_pod(operator, ns, {"cdmo.io/gpu-memory": sizes[i % 4]}, name=f"p{i:03d}")

    def settled() -> list[Any] | None:
        pods = operator.core.list_namespaced_pod(ns).items
        reasons = {e.involved_object.name for e in operator.core.list_namespaced_event(ns).items
                   if e.reason == "NoCapacity"}
        done = [p for p in pods
                if p.status.phase == "Running" or (p.spec.scheduling_gates and p.metadata.name in reasons)]
        return pods if len(done) == 100 else None

    pods = wait_until(settled, 180, lambda: f"100 pods Running or gated with a reason\n{operator.logs()}", interval=1)
    running_pods = [p for p in pods if p.status.phase == "Running"]
    # Each run of four asks 1+1+2+4 = 8 memory slots: a whole H100, so the six H100s hold 24 by MIG
    # alone; the L40S takes more as fractions once every MIG GPU is full.
    assert len(running_pods) > 24
    devices = [handed_device(operator, p)["uuid"] for p in running_pods]
    mig_devices = [d for d in devices if d.startswith("MIG-")]
    assert len(mig_devices) == len(set(mig_devices)), "no MIG instance given to two pods"
    for pod in running_pods:
        assert pod.spec.node_name == slice_of(operator, pod)["status"]["node"]
    check_invariants(operator)  # no overlapping placements, fractions within each GPU's memory


@pytest.mark.compat
def test_a_pod_goes_only_to_a_node_its_own_selector_and_affinity_allow(operator: OperatorHarness) -> None:
    # The slice's node used to be chosen without the pod's nodeSelector or required node affinity;
    # the pod, pinned to that node too, then stayed Pending for ever (no node matched both).
    mig = operator.add_node("h100-80gb", labels={"pool": "train"})
    infer = [operator.add_node("l40s-48gb", labelled=False, labels={"pool": "infer"}) for _ in range(2)]
    start(operator, mig, *infer)
    ns = operator.namespace()
    pooled = [create_pod(operator, ns, {"cdmo.io/gpu-memory": "30Gi"}, name=f"infer-{i}",
                         nodeSelector={"pool": "infer"})["metadata"]["name"] for i in range(2)]
    not_train = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4Gi"}, name="not-train", affinity={
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["train"]}]}]}}})
    train_term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["train"]}]}
    train = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4Gi"}, name="train", affinity={
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [train_term]},
                         "preferredDuringSchedulingIgnoredDuringExecution": [
                             {"weight": 1, "preference": {"matchExpressions": [
                                 {"key": "pool", "operator": "In", "values": ["infer"]}]}}]}})
    create_pod(operator, ns, {"cdmo.io/gpu-memory": "4Gi"}, name="later", nodeSelector={"later": "yes"})
    nodes = set()
    for name in pooled:
        pod = running(operator, ns, name)
        device = handed_device(operator, pod)
        assert pod.spec.node_name in {n.name for n in infer} and device["uuid"].startswith("GPU-")
        assert device["memory"] == str(30 * 2**30)
        nodes.add(pod.spec.node_name)
    assert len(nodes) == 2, "30 GiB twice does not fit one L40S: each eligible node takes one"
    assert running(operator, ns, not_train["metadata"]["name"]).spec.node_name in nodes
    pod = running(operator, ns, train["metadata"]["name"])
    assert pod.spec.node_name == mig.name and handed_device(operator, pod)["uuid"].startswith("MIG-")
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [e.to_dict() for e in terms[0].match_expressions] == [
        {"key": "pool", "operator": "In", "values": ["train"]},
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [mig.name]}]

    def no_node() -> Any:
        events = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=later").items
        return [e for e in events if e.reason == "NoEligibleNode"]

    wait_until(no_node, 20, lambda: f"a NoEligibleNode Event on the pod no GPU node matches\n{operator.logs()}")
    gated = operator.core.read_namespaced_pod("later", ns)
    assert [g.name for g in gated.spec.scheduling_gates] == [GATE] and gated.spec.node_name is None
    assert all(s["metadata"]["name"] != gated.metadata.labels["cdmo.io/gpu-slice"] for s in operator.slices(ns))
    operator.core.patch_node(infer[0].name, {"metadata": {"labels": {"later": "yes"}}})
    assert running(operator, ns, "later", timeout=60).spec.node_name == infer[0].name
    check_invariants(operator)


def test_a_copy_of_a_running_sliced_pod_gets_a_slice_and_a_device_of_its_own(operator: OperatorHarness) -> None:
    # `kubectl get pod -o yaml`, minus nodeName and status, created again: it carries the original's
    # slice label and claim. It must get no gate-free pass: a slice and a claim of its own, or it
    # would share the original's MIG instance.
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    original = running(operator, ns, create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"},
                                                name="original")["metadata"]["name"])
    body = operator.cluster.api_client.sanitize_for_serialization(original)
    body["metadata"] = {key: body["metadata"][key] for key in ("labels", "annotations")} | {"name": "copy"}
    del body["spec"]["nodeName"], body["status"]
    create_pod_body = operator.core.create_namespaced_pod(ns, body)
    assert create_pod_body.metadata.labels["cdmo.io/gpu-slice"] != original.metadata.labels["cdmo.io/gpu-slice"]
    copy = running(operator, ns, "copy")
    ours, theirs = handed_device(operator, copy), handed_device(operator, original)
    assert ours["uuid"] != theirs["uuid"], "one instance, two pods"
    assert slice_of(operator, copy)["metadata"]["ownerReferences"][0]["uid"] == copy.metadata.uid
    check_invariants(operator)


@pytest.mark.compat
def test_a_finished_jobs_pods_release_their_slices(operator: OperatorHarness) -> None:
    # A Job keeps its finished pods; each held its slice (here the whole GPU) until the pod object
    # went, so the Job's second pod waited, gated, for ever. kwok completes a Job's pod once Running.
    start(operator, operator.add_node("h100-80gb"))
    ns = operator.namespace()
    batch = kubernetes.client.BatchV1Api(operator.cluster.api_client)
    template = pod_body({"cdmo.io/mig-profile": "7g.80gb"})
    template["metadata"].pop("generateName")
    del template["apiVersion"], template["kind"]
    template["spec"]["restartPolicy"] = "Never"
    batch.create_namespaced_job(ns, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
                                     "spec": {"completions": 3, "parallelism": 1, "backoffLimit": 0,
                                              "template": template}})
    wait_until(lambda: batch.read_namespaced_job("train", ns).status.succeeded == 3, 90,
               lambda: f"3 completions of the Job: {batch.read_namespaced_job('train', ns).status}\n{operator.logs()}")
    pods = operator.core.list_namespaced_pod(ns).items
    assert len(pods) == 3 and all(p.status.phase == "Succeeded" for p in pods), "the finished pods stay"
    # Each pod after the first reuses the instance its predecessor's slice released: the GpuNode naming
    # the released slice as its owner a moment longer is a wait, not a mismatch.
    mismatches = [e.message for e in operator.core.list_namespaced_event(ns).items if e.reason == "DeviceMismatch"]
    assert not mismatches, mismatches
    wait_until(lambda: not operator.slices(ns), 30, lambda: (
        f"no slice left: {operator.slices(ns)}\nclaims: {[c.get('status') for c in claims(operator, ns)]}\n"
        f"pods: {[(p.metadata.name, p.status.phase) for p in operator.core.list_namespaced_pod(ns).items]}\n"
        f"{operator.logs()}"))
    check_invariants(operator)


def claims(operator: OperatorHarness, ns: str) -> list[dict]:
    return operator.custom.list_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims")["items"]


@pytest.mark.parametrize("variable", ["CDMO_SHIM_DISABLE", "NVIDIA_VISIBLE_DEVICES"])
def test_a_pod_labelled_and_gated_by_hand_then_annotated_is_checked_before_it_gets_a_slice(
        operator: OperatorHarness, variable: str) -> None:
    # The side door: no annotation at creation, so the webhook never sees the pod; the annotation
    # comes later, by update. The controller checks the pod itself before it makes a slice.
    node = operator.add_node("l40s-48gb", labelled=False)
    start(operator, node)
    ns = operator.namespace()
    body = pod_body(None, name="side-door")
    body["metadata"]["labels"] = {"cdmo.io/gpu-slice": "side-door-gs-0"}
    body["spec"]["schedulingGates"] = [{"name": GATE}]
    body["spec"]["containers"][0]["env"] = [{"name": variable, "value": "1" if variable.startswith("CDMO") else "all"}]
    operator.core.create_namespaced_pod(ns, body)
    operator.core.patch_namespaced_pod("side-door", ns, {"metadata": {"annotations": {"cdmo.io/gpu-fraction": "0.5"}}})

    def refused() -> Any:
        events = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=side-door").items
        return [e for e in events if e.reason == "Refused"]

    event = wait_until(refused, 30, lambda: f"a Refused Event on the pod\n{operator.logs()}")[0]
    assert f"sets '{variable}' in env" in event.message or f"sets {variable} in env" in event.message
    assert operator.get_slice(ns, "side-door-gs-0") is None
    pod = operator.core.read_namespaced_pod("side-door", ns)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE] and pod.spec.node_name is None
    # The same pod without the variable, through the same door, is served: the check is not a blanket refusal.
    body["metadata"]["name"] = "side-door-clean"
    body["metadata"]["labels"] = {"cdmo.io/gpu-slice": "side-door-clean-gs-0"}
    body["spec"]["containers"][0]["env"] = []
    operator.core.create_namespaced_pod(ns, body)
    operator.core.patch_namespaced_pod("side-door-clean", ns,
                                       {"metadata": {"annotations": {"cdmo.io/gpu-fraction": "0.5"}}})
    wait_until(lambda: operator.get_slice(ns, "side-door-clean-gs-0"), 30, "the clean pod's slice")


def test_a_pods_slice_goes_only_to_a_node_whose_taints_it_tolerates(operator: OperatorHarness) -> None:
    # Node a holds a slice already, so best fit alone would pack the pod's slice there; but a is
    # tainted team=a:NoSchedule, which the pod does not tolerate: the slice (and pod) must go to b.
    a = operator.add_node("h100-80gb", name=f"taint-a-{operator.namespace()[-6:]}")
    b = operator.add_node("h100-80gb", name=f"taint-b-{operator.namespace()[-6:]}")
    operator.core.patch_node(a.name, {"spec": {"taints": [
        {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"},
        {"key": "team", "value": "a", "effect": "NoSchedule"}]}})
    start(operator, a, b)
    ns = operator.namespace()
    operator.create_slice(ns, "holder", {"migProfile": "1g.10gb", "nodeName": a.name})
    operator.wait_phase(ns, "holder", "Ready")
    name = create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name="untolerated")["metadata"]["name"]
    pod = running(operator, ns, name)
    assert pod.spec.node_name == b.name == slice_of(operator, pod)["status"]["node"]
    # A pod that tolerates the taint may go to a, and does (best fit).
    tolerant = create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name="tolerant",
                          tolerations=[KWOK_TOLERATION, {"key": "team", "operator": "Exists"}])["metadata"]["name"]
    pod = running(operator, ns, tolerant)
    assert slice_of(operator, pod)["status"]["node"] == pod.spec.node_name


@pytest.mark.parametrize("count", [1, 2])
def test_a_slice_limited_by_a_taint_that_went_away_is_made_again_where_the_pod_may_go_now(
        operator: OperatorHarness, count: int) -> None:
    # Taints come and go: kube-controller-manager taints a node unreachable for a moment when its
    # heartbeat is late (it takes off at once a taint of that key that a node's conditions do not call
    # for, so a key of our own plays it here), an admin's maintenance taint ends. A pod made while one
    # node was tainted got slices limited to the other, full, node: once the taint goes they must not
    # wait there for ever (a pod of two devices: both, as one group).
    tag = operator.namespace()[-6:]
    full = operator.add_node("h100-80gb", name=f"full-{tag}")
    late = operator.add_node("h100-80gb", name=f"late-{tag}")
    start(operator, full, late)
    ns = operator.namespace()
    operator.create_slice(ns, "holder", {"migProfile": "7g.80gb", "nodeName": full.name})
    operator.wait_phase(ns, "holder", "Ready")
    operator.core.patch_node(late.name, {"spec": {"taints": [
        {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"},
        {"key": "maintenance", "effect": "NoSchedule"}]}})
    time.sleep(1)  # the controller's Node watch has the taint
    annotations = {"cdmo.io/mig-profile": "1g.10gb", **({"cdmo.io/gpu-count": str(count)} if count > 1 else {})}
    name = create_pod(operator, ns, annotations, name="in-the-moment")["metadata"]["name"]
    group = operator.core.read_namespaced_pod(name, ns).metadata.labels["cdmo.io/gpu-slice"]
    names = [group] if count == 1 else [f"{group}-{k}" for k in range(count)]

    def waiting_on_full() -> list[dict] | None:
        bodies = [operator.get_slice(ns, n) for n in names]
        waiting = [b for b in bodies if b and ((b.get("status") or {}).get("phase") == "Pending"
                                               and (b.get("status") or {}).get("reason"))]
        return waiting if len(waiting) == count else None

    first = wait_until(waiting_on_full, 30, lambda: f"the slices waiting on {full.name}\n{operator.logs()}")
    assert all(b["spec"].get("nodeName") == full.name for b in first), [b["spec"] for b in first]
    operator.core.patch_node(late.name, {"spec": {"taints": [
        {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]}})
    pod = running(operator, ns, name)
    served = [operator.get_slice(ns, n) for n in names]
    assert {b["metadata"]["uid"] for b in served}.isdisjoint({b["metadata"]["uid"] for b in first}), (
        "the waiting slices were made again")
    assert all("nodeName" not in b["spec"] and b["status"]["node"] == late.name for b in served), served
    assert pod.spec.node_name == late.name
    check_invariants(operator)


def test_a_running_pods_status_changes_never_reach_the_controller(operator: OperatorHarness) -> None:
    # A Running pod's status changes often (probes, restarts, a kubelet's heartbeat of conditions), and
    # the controller needs nothing of a Running pod: its watch leaves Running pods out. Fifty status
    # writes to a running annotated pod here come to no event in the controller.
    node = operator.add_node("h100-80gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    port = free_port()
    operator.controller_with_webhook(None, "--metrics-address", f"127.0.0.1:{port}")
    operator.wait_webhook()
    ns = operator.namespace()
    name = create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name="busy")["metadata"]["name"]
    pod = running(operator, ns, name)
    served = slice_of(operator, pod)

    def pod_events() -> float:
        return value(scrape(port)[1], "mig_operator_watch_events_total", resource="pods") or 0.0

    time.sleep(1)
    before = pod_events()
    assert before >= 1, "the controller saw the pod while it was gated"
    for i in range(50):
        operator.core.patch_namespaced_pod_status(name, ns, {"status": {"conditions": [
            {"type": "Ready", "status": "True" if i % 2 else "False"}]}})
    time.sleep(2)
    assert pod_events() - before < 5, f"{pod_events() - before} pod events for 50 status writes of a Running pod"
    assert operator.core.read_namespaced_pod(name, ns).status.phase == "Running"
    kept = operator.get_slice(ns, served["metadata"]["name"])
    assert kept is not None and kept["metadata"]["uid"] == served["metadata"]["uid"], "its slice is untouched"
    assert kept["status"]["phase"] == "Ready"
    check_invariants(operator)


def test_a_pod_whose_slice_failed_gets_a_new_slice_after_a_back_off(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    start(operator, node)
    ns = operator.namespace()
    node.backend().inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=1)  # permanent: Failed
    name = create_pod(operator, ns, {"cdmo.io/mig-profile": "2g.20gb"}, name="unlucky")["metadata"]["name"]

    def retry_event() -> Any:
        events = operator.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
        return [e for e in events if "a new slice in 5 s (try 2 of 4)" in (e.message or "")]

    event = wait_until(retry_event, 40, lambda: f"an Event announcing the second slice\n{operator.logs()}")[0]
    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in event.message
    pod = running(operator, ns, name, timeout=60)
    second = slice_of(operator, pod)
    assert second["metadata"]["annotations"]["cdmo.io/slice-try"] == "2"
    assert second["status"]["phase"] == "Ready" and second["status"]["profile"] == "2g.20gb"
    check_invariants(operator)


def test_a_gated_pods_slice_deleted_while_it_is_made_is_released_at_once_and_made_again(
        operator: OperatorHarness) -> None:
    """The controller reserves a pod's claim for the pod in the write that allocates it, at bind,
    while the pod is still gated, and a reservation holds a deleted slice (the agent releases none in
    use). So a gated pod's slice that goes (deleted by hand here; a group's part given back takes the
    same path) loses the reservation first: released at once, not held for as long as the pod lives."""
    node = operator.add_node("h100-80gb")
    operator.agent(node, None, "--sim-latency", "3")  # each create takes 3 s: the pod stays gated meanwhile
    operator.wait_gpunode(node)
    operator.controller_with_webhook()
    operator.wait_webhook()
    ns = operator.namespace()
    made = create_pod(operator, ns, {"cdmo.io/mig-profile": "1g.10gb"}, name="early")
    name = made["metadata"]["labels"]["cdmo.io/gpu-slice"]
    first = operator.wait_phase(ns, name, "Creating", timeout=20)
    claim = wait_until(lambda: (c := operator.custom.get_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaims", name))["status"].get("reservedFor") and c, 10,
        lambda: f"the claim reserved for the gated pod\n{operator.logs()}")
    # Written out by hand from resource.k8s.io/v1 (ResourceClaimConsumerReference).
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "early", "uid": made["metadata"]["uid"]}]
    gates = operator.core.read_namespaced_pod("early", ns).spec.scheduling_gates
    assert [g.name for g in gates] == ["cdmo.io/gpu-slice"]
    operator.delete_slice(ns, name)
    # Its create ends 3 s in; held for the reservation, the slice would stay while the pod lives.
    wait_until(lambda: (s := operator.get_slice(ns, name)) is None or s["metadata"]["uid"] != first["metadata"]["uid"],
               20, lambda: f"the deleted slice to be released\n{operator.get_slice(ns, name)}\n{operator.logs()}")
    pod = running(operator, ns, "early", timeout=60)
    second = slice_of(operator, pod)
    assert second["metadata"]["uid"] != first["metadata"]["uid"] and second["status"]["phase"] == "Ready"
    check_invariants(operator)
