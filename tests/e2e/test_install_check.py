"""`mig-operator check` against the real API server: on a running operator (agent on simulated GPUs,
controller, webhook) every check passes and the test slice is gone afterwards; without a controller
and with a labelled node that runs no agent it fails, naming what to do; a bad flag is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import GROUP, REPO_ROOT, SLICES, VERSION, OperatorHarness


def check(op: OperatorHarness, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", "check", "--kubeconfig",
                           str(op.cluster.kubeconfig), "--peering", op.peering, *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_a_running_operator_passes_every_check_and_the_test_slice_is_gone(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")
    operator.start_operator(node, webhook=True)
    ns = operator.namespace()
    done = check(operator, "--namespace", ns, "--timeout", "30", "--json")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{operator.logs()}"
    report = json.loads(done.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] is True
    assert set(statuses) == {"crds", "webhook", "controller", f"node/{node.name}", "slice"}, report
    assert {statuses[k] for k in ("crds", "webhook", "controller", "slice")} == {"ok"}, report
    # The simulated node has no toolkit config to read: RuntimeTrusted Unknown, a warning, not a failure.
    assert statuses[f"node/{node.name}"] in ("ok", "warn"), report
    assert all(set(c) == {"name", "status", "message", "fix"} for c in report["checks"])
    # The test slice, seen through the API: none left in the namespace.
    assert operator.custom.list_namespaced_custom_object(GROUP, VERSION, ns, SLICES)["items"] == []

    text = check(operator, "--namespace", ns, "--timeout", "30")
    assert text.returncode == 0, text.stdout
    lines = text.stdout.splitlines()
    assert lines[-1].startswith("ok: 5 checks, 0 failed") and any(line.startswith("ok    slice: ") for line in lines)


def test_no_controller_and_a_node_without_agent_fail_with_what_to_do(operator: OperatorHarness) -> None:
    node = operator.add_node("h100-80gb")  # labelled, no agent; no controller, no webhook
    ns = operator.namespace()
    done = check(operator, "--namespace", ns, "--timeout", "2", "--json")
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    found = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert found["crds"]["status"] == "ok"
    assert found["controller"]["status"] == "fail" and operator.peering in found["controller"]["message"]
    assert "kubectl get pods" in found["controller"]["fix"]
    agent = found[f"node/{node.name}"]
    assert agent["status"] == "fail" and "has no GpuNode" in agent["message"]
    assert f"spec.nodeName={node.name}" in agent["fix"]
    assert found["slice"]["status"] == "fail" and "controller never looked at it" in found["slice"]["fix"]
    assert operator.custom.list_namespaced_custom_object(GROUP, VERSION, ns, SLICES)["items"] == []

    text = check(operator, "--namespace", ns, "--timeout", "2")
    assert text.returncode == 1
    lines = text.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("FAIL  controller: ")))
    assert lines[at + 1].startswith("      fix: ")


def test_a_bad_flag_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "mig_operator.cli", "check", "--timeout", "soon"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--timeout 'soon'" in done.stderr
