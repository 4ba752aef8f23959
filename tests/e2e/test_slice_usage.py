"""What a Ready slice uses, as its node's agent measures it (the simulator's usage, set through its state
file): status.usage's figures and the peak that stays, kubectl's USED and PEAK columns, the agent's
per-slice metrics, Active=False (NoProcess) with an Idle Event once no process has used it for the idle
time, and a tenant with ``edit`` refused a write of status.usage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes
from harness import OperatorHarness, wait_until
from tenants import edit_tenant, forbidden
from test_metrics import free_port, scrape, value

GIB = 2**30
GROUP, VERSION, SLICES = "cdmo.io", "v1alpha1", "gpuslices"


def usage(operator: OperatorHarness, ns: str, name: str) -> dict:
    return ((operator.get_slice(ns, name) or {}).get("status") or {}).get("usage") or {}


def active(operator: OperatorHarness, ns: str, name: str) -> dict:
    status = (operator.get_slice(ns, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "Active"), {})


def test_a_slices_usage_shows_in_its_status_columns_and_metrics_and_idle_turns_active_false(
        operator: OperatorHarness, kubectl: Callable[..., Any]) -> None:
    node = operator.add_node("h100-80gb")
    port = free_port()
    operator.agent(node, None, "--usage-interval", "0.5", "--idle-after", "2",
                   "--metrics-address", f"127.0.0.1:{port}")
    operator.wait_gpunode(node)
    operator.controller()
    ns = operator.namespace()
    operator.create_slice(ns, "nb", {"migProfile": "3g.40gb"})
    ready = operator.wait_phase(ns, "nb", "Ready")["status"]
    device = ready["deviceUUID"]

    # Nothing runs on it: Active turns False after the idle time (2 s), with an Idle Event.
    idle = wait_until(lambda: (c := active(operator, ns, "nb")).get("status") == "False" and c, 20,
                      lambda: f"Active=False on nb: {operator.get_slice(ns, 'nb')}\n{operator.logs()}")
    assert idle["reason"] == "NoProcess"
    assert usage(operator, ns, "nb")["processes"] == 0 and "lastActive" not in usage(operator, ns, "nb")

    def events() -> list[Any]:
        listed = operator.core.list_namespaced_event(ns, field_selector="involvedObject.name=nb")
        return [e for e in listed.items if e.reason == "Idle"]

    event = wait_until(events, 20, "an Idle Event on nb")[0]
    assert event.type == "Normal" and event.involved_object.kind == "GpuSlice"

    # A process holds 3 GiB: the figures appear, Active is True again.
    node.backend().set_usage(device, 3 * GIB, [4242], None)
    wait_until(lambda: usage(operator, ns, "nb").get("memoryUsed") == 3 * GIB, 20,
               lambda: f"memoryUsed 3 GiB on nb: {usage(operator, ns, 'nb')}\n{operator.logs()}")
    shown = usage(operator, ns, "nb")
    assert (shown["memoryPeak"], shown["processes"], shown["used"], shown["peak"]) == (3 * GIB, 1, "3.0Gi", "3.0Gi")
    assert "activePercent" not in shown  # none for a MIG device
    # 3 GiB + 10 % fits 1g.10gb on an H100: the 3g.40gb could have been one.
    assert shown["advice"]["verdict"] == "Smaller" and shown["advice"]["suggested"] == "1g.10gb"
    wait_until(lambda: active(operator, ns, "nb").get("status") == "True", 20, "Active=True on nb")
    assert active(operator, ns, "nb")["reason"] == "Running"

    # kubectl get gs -o wide shows USED and PEAK.
    table = kubectl("get", "gs", "-n", ns, "-o", "wide").stdout.splitlines()
    assert "USED" in table[0].split() and "PEAK" in table[0].split(), table

    def column(name: str) -> str:  # kubectl aligns each value under its header's first letter
        return table[1][f"{table[0]} ".index(f" {name} ") + 1:].split()[0]

    assert (column("USED"), column("PEAK")) == ("3.0Gi", "3.0Gi"), table
    assert "USED" not in kubectl("get", "gs", "-n", ns).stdout.split()  # priority 1: only with -o wide

    labels = {"namespace": ns, "slice": "nb", "pod": ""}
    samples = scrape(port)[1]
    assert value(samples, "mig_operator_slice_memory_used_bytes", **labels) == 3 * GIB
    assert value(samples, "mig_operator_slice_processes", **labels) == 1

    # The process frees most of it: memoryUsed follows, the peak stays.
    node.backend().set_usage(device, GIB, [4242], None)
    wait_until(lambda: usage(operator, ns, "nb").get("memoryUsed") == GIB, 20,
               lambda: f"memoryUsed 1 GiB on nb: {usage(operator, ns, 'nb')}")
    assert usage(operator, ns, "nb")["memoryPeak"] == 3 * GIB
    wait_until(lambda: value(scrape(port)[1], "mig_operator_slice_memory_peak_bytes", **labels) == 3 * GIB, 20,
               "the peak metric at 3 GiB")

    # A tenant with edit in the namespace cannot write status.usage (the status subresource).
    tenant = kubernetes.client.CustomObjectsApi(edit_tenant(operator.cluster, ns))
    message = forbidden(lambda: tenant.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, SLICES, "nb", {"status": {"usage": {"memoryUsed": 0, "memoryPeak": 0}}}))
    assert "gpuslices/status" in message
    assert usage(operator, ns, "nb")["memoryPeak"] == 3 * GIB

    # The slice goes: so does its series.
    operator.delete_slice(ns, "nb")
    operator.wait_gone(ns, "nb")
    wait_until(lambda: value(scrape(port)[1], "mig_operator_slice_memory_used_bytes", **labels) is None, 20,
               "the slice's series to go with it")
