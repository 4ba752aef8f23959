"""A fraction's compute share, end to end on the real API server with simulated agents: the controller
places by compute (shares on a GPU sum to at most 1; shares and shared fractions never share a GPU),
writes the share in status.compute, which `kubectl get gs` shows in its COMPUTE column and the GpuNode
sums per GPU; `--default-compute proportional` gives a fraction its memory share; a pod's
`cdmo.io/gpu-compute` reaches its slice; the agent refuses a binding its compute cannot take.

Expected shares and sums are worked out here with Decimal from the requests, never read from the code."""

from __future__ import annotations

import json
from decimal import ROUND_FLOOR, Decimal

import pytest
from harness import OperatorHarness, check_invariants, wait_until
from kubernetes.client.rest import ApiException
from test_crds import _table
from test_pods import create_pod, running, slice_of

GROUP, VERSION, SLICES = "cdmo.io", "v1alpha1", "gpuslices"
L4_MIB = 23034  # an L4's memory as NVML reports it (the simulator's catalog)
GIB = 2**30


def gpu_of(op: OperatorHarness, node, index: int = 0) -> dict:
    return next(g for g in (op.gpunode(node) or {})["status"]["gpus"] if g["index"] == index)


def gpunode_compute(op: OperatorHarness, node, want: str) -> dict:
    return wait_until(lambda: (g := gpu_of(op, node)).get("compute") == want and g, 20,
                      lambda: f"GpuNode {node.name} GPU 0 compute {want!r}: {gpu_of(op, node)}")


def test_two_halves_fill_a_gpu_and_a_third_waits_naming_it_then_binds_when_room_appears(
        operator: OperatorHarness) -> None:
    node = operator.add_node("l4-24gb", labelled=False)
    operator.start_operator(node)
    ns = operator.namespace()
    for name in ("a", "b"):
        operator.create_slice(ns, name, {"memory": "4Gi", "compute": 0.5})
    ready = {n: operator.wait_phase(ns, n, "Ready")["status"] for n in ("a", "b")}
    assert [(s["node"], s["gpu"], s["compute"]) for s in ready.values()] == [(node.name, 0, "0.5")] * 2
    # The GpuNode: each fraction's share, and the GPU's sum (0.5 + 0.5 = 1).
    gpu = gpunode_compute(operator, node, "1")
    assert sorted((f["slice"], f["compute"]) for f in gpu["fractions"]) == [(f"{ns}/a", 0.5), (f"{ns}/b", 0.5)]

    operator.create_slice(ns, "c", {"memory": "4Gi", "compute": 0.5})
    waiting = operator.wait_phase(ns, "c", "Pending", reason="NoCapacity")["status"]
    # The same words go to every namespace (a pass reuses them for an equal request): no GPU named.
    assert "one GPU has" in waiting["message"] and node.name not in waiting["message"], waiting
    assert "compute 0 of 1 left, not 0.5" in waiting["message"], waiting
    # Memory alone would fit (8 of 22.5 GiB taken): compute is what keeps it waiting.
    assert 3 * 4 * GIB <= L4_MIB * 2**20

    operator.delete_slice(ns, "a")
    operator.wait_gone(ns, "a")
    st = operator.wait_phase(ns, "c", "Ready")["status"]
    assert (st["node"], st["gpu"], st["compute"]) == (node.name, 0, "0.5")
    check_invariants(operator)


def test_shares_and_shared_fractions_never_meet_on_a_gpu(operator: OperatorHarness) -> None:
    node = operator.add_node("l4-24gb", count=2, labelled=False)
    operator.start_operator(node)
    ns = operator.namespace()
    operator.create_slice(ns, "mps", {"fraction": 0.25, "compute": 0.25})
    mps = operator.wait_phase(ns, "mps", "Ready")["status"]
    operator.create_slice(ns, "plain", {"fraction": 0.25})
    plain = operator.wait_phase(ns, "plain", "Ready")["status"]
    assert (mps["compute"], plain["compute"]) == ("0.25", "shared") and mps["gpu"] != plain["gpu"]
    # Both GPUs now serve one kind each: another of each kind joins its own, and with a second shared
    # fraction's GPU full, a third waits rather than join the GPU serving shares.
    operator.create_slice(ns, "plain2", {"fraction": 0.75})
    assert operator.wait_phase(ns, "plain2", "Ready")["status"]["gpu"] == plain["gpu"]
    operator.create_slice(ns, "plain3", {"fraction": 0.25})
    st = operator.wait_phase(ns, "plain3", "Pending", reason="ComputeMode")["status"]
    assert f"GPU {mps['gpu']} of node {node.name} has room for it but serves compute shares through MPS" in (
        st["message"]), st
    want = {mps["gpu"]: "0.25", plain["gpu"]: "shared"}
    wait_until(lambda: {g["index"]: g.get("compute") for g in operator.gpunode(node)["status"]["gpus"]} == want, 20,
               lambda: f"the GpuNode's compute per GPU {want}: {operator.gpunode(node)['status']['gpus']}")
    check_invariants(operator)


def test_the_proportional_default_gives_each_fraction_its_memory_share(operator: OperatorHarness) -> None:
    node = operator.add_node("l4-24gb", labelled=False)
    operator.agent(node)
    operator.wait_gpunode(node)
    operator.controller(None, "--default-compute", "proportional")
    ns = operator.namespace()
    operator.create_slice(ns, "by-memory", {"memory": "4Gi"})
    operator.create_slice(ns, "asked", {"memory": "4Gi", "compute": 0.5})
    shares = {n: operator.wait_phase(ns, n, "Ready")["status"]["compute"] for n in ("by-memory", "asked")}
    # 4 GiB of the L4's 23034 MiB, rounded down to four places.
    expected = (Decimal(4 * 1024) / Decimal(L4_MIB)).quantize(Decimal("0.0001"), rounding=ROUND_FLOOR)
    assert shares == {"by-memory": str(expected), "asked": "0.5"} and expected == Decimal("0.1778")
    gpunode_compute(operator, node, str(expected + Decimal("0.5")))
    # What is left, 1 - 0.6778 = 0.3222, is less than 10 GiB's share (0.4445): it waits, memory to spare.
    left = 1 - expected - Decimal("0.5")
    ten = (Decimal(10 * 1024) / Decimal(L4_MIB)).quantize(Decimal("0.0001"), rounding=ROUND_FLOOR)
    assert ten > left
    operator.create_slice(ns, "ten", {"memory": "10Gi"})
    st = operator.wait_phase(ns, "ten", "Pending", reason="NoCapacity")["status"]
    assert f"has compute {left} of 1 left, not {ten}" in st["message"], st


def test_kubectl_get_gs_shows_the_compute_column(operator: OperatorHarness) -> None:
    node = operator.add_node("l4-24gb", labelled=False)
    operator.start_operator(node)
    ns = operator.namespace()
    operator.create_slice(ns, "quarter", {"fraction": 0.5, "compute": 0.25})
    operator.wait_phase(ns, "quarter", "Ready")
    header, row = _table(operator.cluster.kubectl("get", "gs", "quarter", "-n", ns).stdout)
    assert header[header.index("PROFILE") + 1] == "COMPUTE"
    cells = dict(zip(header, row, strict=True))
    assert (cells["REQUEST"], cells["PHASE"], cells["COMPUTE"]) == ("fraction 0.5, compute 0.25", "Ready", "0.25")


def test_a_pods_gpu_compute_annotation_reaches_its_slice_and_bad_ones_are_refused(
        operator: OperatorHarness) -> None:
    node = operator.add_node("l4-24gb", labelled=False)
    operator.start_operator(node, webhook=True)
    ns = operator.namespace()
    name = create_pod(operator, ns, {"cdmo.io/gpu-memory": "4Gi", "cdmo.io/gpu-compute": "0.25"})["metadata"]["name"]
    sl = slice_of(operator, running(operator, ns, name))
    assert sl["spec"] == {"memory": "4Gi", "compute": 0.25} and sl["status"]["compute"] == "0.25"
    for asked, words in (
        ({"cdmo.io/gpu-fraction": "0.5", "cdmo.io/gpu-compute": "1.0000001"}, "compute '1.0000001' must be in (0, 1]"),
        ({"cdmo.io/gpu-fraction": "0.5", "cdmo.io/gpu-compute": "0"}, "compute '0' must be in (0, 1]"),
        ({"cdmo.io/gpu-compute": "0.5"}, "goes beside cdmo.io/gpu-memory or cdmo.io/gpu-fraction"),
        ({"cdmo.io/mig-profile": "1g.10gb", "cdmo.io/gpu-compute": "0.5"}, "cannot go beside cdmo.io/mig-profile"),
    ):
        with pytest.raises(ApiException) as refused:
            create_pod(operator, ns, asked, name="bad")
        text = json.loads(refused.value.body)["message"]
        assert refused.value.status == 400 and words in text and "cdmo.io/gpu-compute" in text, text
        assert "e.g." in text and "'0.25'" in text, text


def test_the_agent_refuses_a_binding_its_gpus_compute_cannot_take(operator: OperatorHarness) -> None:
    # No controller: bindings written by hand, as a controller that had lost count would write them.
    node = operator.add_node("l4-24gb", labelled=False)
    operator.agent(node)
    uuid = operator.wait_gpunode(node)["status"]["gpus"][0]["uuid"]
    ns = operator.namespace()

    def bind(name: str, compute: str | None) -> None:
        spec = {"memory": "4Gi", **({"compute": float(compute)} if compute else {})}
        operator.custom.create_namespaced_custom_object(GROUP, VERSION, ns, SLICES, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "GpuSlice",
            "metadata": {"name": name, "finalizers": ["cdmo.io/agent"]}, "spec": spec})
        operator.custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, SLICES, name, {"status": {
            "phase": "Bound", "reason": "Bound", "mode": "fraction", "node": node.name, "gpu": 0, "gpuUUID": uuid,
            "grantedBytes": 4 * GIB, "compute": compute or "shared"}})

    bind("first", "0.75")
    operator.wait_phase(ns, "first", "Ready")
    bind("second", "0.5")
    st = operator.wait_phase(ns, "second", "Failed")["status"]
    assert st["reason"] == "Conflict" and "has compute 0.25 of 1 left, not 0.5" in st["message"], st
    bind("third", None)
    st = operator.wait_phase(ns, "third", "Failed")["status"]
    assert "serves compute shares through MPS (0.75 of 1 given out)" in st["message"], st
    assert operator.get_slice(ns, "first")["status"]["phase"] == "Ready"
