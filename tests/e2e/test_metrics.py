"""What an operator watching mig-operator sees: Prometheus metrics scraped over HTTP from a controller
and two agents (as the chart's ServiceAccounts), checked against what happened; and JSON logs, one
object per line. /metrics answers only callers allowed to get it: the scrapes here send the session
admin's token (tests/e2e/test_metrics_auth.py tries the others)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import OperatorHarness, wait_until
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def admin_token() -> str:
    """The token of the session's admin kubeconfig ($KUBECONFIG, set by the ``kube_cluster`` fixture)."""
    return yaml.safe_load(Path(os.environ["KUBECONFIG"]).read_text())["users"][0]["user"]["token"]


def metrics_text(port: int, token: str | None = None) -> str:
    """What /metrics on the port answers a caller with ``token`` (the admin's by default)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token or admin_token()}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def scrape(port: int) -> tuple[set[str], Samples]:
    """The metric families served at /metrics, and every sample as (name, sorted labels) -> value."""
    families, samples = set(), {}
    for family in text_string_to_metric_families(metrics_text(port)):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def settle(port: int, check: Callable[[Samples], bool], what: str, op: OperatorHarness) -> Samples:
    """Scrape until ``check`` holds (gauges follow events by a few hundred ms)."""
    seen: list[Samples] = [{}]

    def ok() -> bool:
        try:
            seen[0] = scrape(port)[1]
        except urllib.error.HTTPError as exc:
            if exc.code != 503:  # 503: the API server could not check the caller this time; ask again
                raise
            return False
        return check(seen[0])

    wait_until(ok, 20, lambda: f"{what} on :{port}; last scrape:\n" + "\n".join(
        f"  {n}{dict(lbl)} = {v}" for (n, lbl), v in sorted(seen[0].items()) if n.startswith("mig_operator"))
        + f"\n{op.logs()}")
    return seen[0]


def no_other_slices(op: OperatorHarness) -> None:
    """Wait until earlier tests' slices are gone (their namespaces finish terminating): a controller
    started now would bind them to this test's GPUs, and the counts here would not be this test's."""

    def others() -> list[str]:
        items = op.custom.list_cluster_custom_object("cdmo.io", "v1alpha1", "gpuslices")["items"]
        return [f"{s['metadata']['namespace']}/{s['metadata']['name']}" for s in items]

    wait_until(lambda: not others(), 60, lambda: f"no GpuSlices left by earlier tests: {others()[:10]}")


def test_metrics_of_the_controller_and_the_agents_match_what_happened(operator: OperatorHarness) -> None:
    no_other_slices(operator)
    mig = operator.add_node("h100-80gb")
    plain = operator.add_node("l4-24gb", labelled=False)
    ports = {"controller": free_port(), mig.name: free_port(), plain.name: free_port()}
    for node in (mig, plain):
        operator.agent(node, None, "--metrics-address", f"127.0.0.1:{ports[node.name]}")
    for node in (mig, plain):
        operator.wait_gpunode(node)
    operator.controller(None, "--metrics-address", f"127.0.0.1:{ports['controller']}")
    ns = operator.namespace()
    operator.create_slice(ns, "kept", {"memory": "4G"})
    operator.create_slice(ns, "released", {"migProfile": "2g.20gb"})
    operator.create_slice(ns, "part", {"fraction": 0.5, "nodeName": plain.name})
    kept = operator.wait_phase(ns, "kept", "Ready")["status"]
    operator.wait_phase(ns, "released", "Ready")
    part = operator.wait_phase(ns, "part", "Ready")["status"]
    assert (kept["mode"], part["mode"], part["node"]) == ("mig", "fraction", plain.name)
    # A permanent NVML error: the slice fails, and the agent counts a reconcile error and an NVML error.
    mig.backend().inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=1)
    operator.create_slice(ns, "broken", {"migProfile": "3g.40gb"})
    operator.wait_phase(ns, "broken", "Failed")
    operator.delete_slice(ns, "released")
    operator.wait_gone(ns, "released")

    # ---- the controller ----
    controller = settle(ports["controller"], lambda s: (value(s, "mig_operator_bind_seconds_count") or 0) >= 4,
                        "four bindings timed", operator)
    assert value(controller, "mig_operator_bind_seconds_sum") > 0
    assert value(controller, "mig_operator_binds_total", mode="mig") >= 3
    assert value(controller, "mig_operator_binds_total", mode="fraction") >= 1
    families = scrape(ports["controller"])[0]
    assert "mig_operator_slices" in families
    assert "mig_operator_reconcile_errors" in families  # present (no error happened in the controller)
    # nothing left waiting for a worker
    assert value(controller, "mig_operator_workqueue_depth", component="controller") == 0
    assert "mig_operator_workqueue_retries" in families  # (its retries: tests/e2e/test_fault_injection.py)
    # ---- the MIG node's agent ----
    gpu = {"node": mig.name, "gpu": "0"}
    agent = settle(ports[mig.name], lambda s: (
        value(s, "mig_operator_instances", **gpu, state="in_use") == 1
        and value(s, "mig_operator_instances", **gpu, state="idle") == 1), "one instance in use, one idle", operator)
    assert value(agent, "mig_operator_granted_bytes", **gpu) == kept["grantedBytes"]
    assert value(agent, "mig_operator_realise_seconds_count", action="create") >= 2
    assert value(agent, "mig_operator_realise_seconds_sum", action="create") > 0
    calls = {dict(labels)["call"]: v for (n, labels), v in agent.items() if n == "mig_operator_nvml_call_seconds_count"}
    assert calls["create_instance"] >= 3 and calls["instances"] >= 1 and calls["gpus"] >= 1, calls
    assert value(agent, "mig_operator_nvml_errors_total", call="create_instance", error="INSUFFICIENT_RESOURCES") == 1
    assert value(agent, "mig_operator_reconcile_errors_total", part="agent", kind="NvmlInsufficientResources") == 1

    # ---- the fraction node's agent ----
    plain_gpu = {"node": plain.name, "gpu": "0"}
    fraction = settle(ports[plain.name], lambda s: value(s, "mig_operator_granted_bytes", **plain_gpu) ==
                      part["grantedBytes"], "memory granted on the fraction GPU", operator)
    assert value(fraction, "mig_operator_realise_seconds_count", action="fraction") == 1
    assert value(fraction, "mig_operator_instances", **plain_gpu, state="in_use") == 0
    assert "create_instance" not in {dict(labels).get("call") for (_, labels) in fraction}

    # ---- slices by phase and mode ----
    def failed(s: Samples) -> float:
        # A Failed slice has no binding any more; it is counted under the mode its status names.
        return value(s, "mig_operator_slices", phase="Failed", mode="mig") or 0

    def current(s: Samples) -> bool:
        return (value(s, "mig_operator_slices", phase="Ready", mode="mig") == 1
                and value(s, "mig_operator_slices", phase="Ready", mode="fraction") == 1 and failed(s) == 1
                and sum(v for (n, _), v in s.items() if n == "mig_operator_slices") == 3)  # released is gone

    def shown() -> str:
        slices = scrape(ports["controller"])[1]
        return str({dict(lbl)["phase"] + "/" + dict(lbl)["mode"]: v for (n, lbl), v in slices.items()
                    if n == "mig_operator_slices"})

    # The gauge is published at most once a second, and once more a second after the last change.
    wait_until(lambda: current(scrape(ports["controller"])[1]), 10,
               lambda: f"mig_operator_slices to match what happened: {shown()}")


def test_json_logs_are_one_object_per_line(operator: OperatorHarness) -> None:
    no_other_slices(operator)
    node = operator.add_node("h100-80gb")
    agent = operator.agent(node, None, "--log-format", "json", "--log-level", "debug")
    operator.wait_gpunode(node)
    controller = operator.controller_with_webhook(None, "--log-format", "json")  # logs where it serves
    ns = operator.namespace()
    operator.create_slice(ns, "ok", {"memory": "4G"})
    operator.wait_phase(ns, "ok", "Ready")
    node.backend().inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=1)
    operator.create_slice(ns, "broken", {"migProfile": "3g.40gb"})  # logged as a warning by the agent
    operator.wait_phase(ns, "broken", "Failed")
    for proc in (agent, controller):
        operator.stop(proc)  # shutdown is logged too
    records: dict[str, list[dict[str, Any]]] = {}
    for proc in (agent, controller):
        lines = [line for line in proc.log.read_text().splitlines() if line.strip()]
        assert lines, f"{proc.name} logged nothing"
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                raise AssertionError(f"{proc.name}: not a JSON line: {line!r}") from None
            assert isinstance(entry, dict) and {"time", "level", "logger", "message"} <= set(entry), line
            records.setdefault(proc.name, []).append(entry)
    agent_records = records[agent.name]
    assert any(r["level"] == "warning" and "broken" in r["message"] for r in agent_records)
    assert any(r["level"] == "debug" and r["logger"].startswith("kopf") for r in agent_records)
    assert all(r["level"] != "debug" for r in records[controller.name])


def _json_lines(text: str) -> list[dict[str, Any]]:
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(entry, dict) and {"time", "level", "logger", "message"} <= set(entry), line
        entries.append(entry)
    return entries


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_an_error_that_stops_a_part_at_start_is_a_json_line_too(log_format: str, tmp_path: Path,
                                                                  kube_cluster: object) -> None:
    """The agent's most likely crash (no NVML on the node, a bad flag) is what a log pipeline must read
    most; with --log-format json it is a record like every other, with text the familiar one line. The
    cluster is there so that the agent finds credentials ($KUBECONFIG) and stops on its backend."""
    result = subprocess.run(
        [sys.executable, "-m", "mig_operator.cli", "agent", "--node", "n1", "--log-format", log_format,
         "--backend", "sim:no-such-gpu", "--state-file", str(tmp_path / "sim.json")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not result.stdout
    if log_format == "text":
        assert result.stderr.startswith("mig-operator: backend 'sim:no-such-gpu'"), result.stderr
        return
    [entry] = _json_lines(result.stderr)
    assert entry["level"] == "error" and entry["message"].startswith("mig-operator: backend 'sim:no-such-gpu'")


def test_warnings_and_a_crash_are_json_lines_with_json_logs() -> None:
    """Python warnings, a thread's exception, a process-ending exception and stray stderr writes: each
    one JSON object on its line, tracebacks inside (``error``), not spread over lines of plain text."""
    program = (
        "import logging, sys, threading, warnings\n"
        "from mig_operator.kube.common.logs import configure\n"
        "configure('json', 'info')\n"
        "logging.getLogger('mig_operator.agent').info('line one\\nline two')\n"
        "warnings.warn('deprecated thing', FutureWarning)\n"
        "t = threading.Thread(target=lambda: 1 / 0, name='worker'); t.start(); t.join()\n"
        "print('stray', 'write', file=sys.stderr)\n"
        "raise RuntimeError('the end')\n"
    )
    result = subprocess.run([sys.executable, "-W", "always", "-c", program], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and not result.stdout
    entries = _json_lines(result.stderr)
    assert [e.get("logger") for e in entries] == [
        "mig_operator.agent", "py.warnings", "mig_operator", "stderr", "mig_operator"], entries
    assert entries[0]["message"] == "line one\nline two"
    assert "FutureWarning: deprecated thing" in entries[1]["message"]
    assert "ZeroDivisionError" in entries[2]["error"] and "worker" in entries[2]["message"]
    assert entries[3] == {**entries[3], "level": "error", "message": "stray write"}
    assert entries[4]["level"] == "critical" and "RuntimeError: the end" in entries[4]["error"]
