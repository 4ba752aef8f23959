"""`mig-operator top` against the real API server, agents on simulated GPUs and a controller: the text
shows each instance at the slots its slice's status names (columns computed here from the placements,
not by the renderer), the fraction bar and the counts agree with the GpuNode and with the agent's
mig_operator_slots; a bound slice whose instance is not made yet is drawn as creating; --json's shape;
--watch draws again until Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from harness import REPO_ROOT, OperatorHarness, wait_until
from test_metrics import free_port, scrape, value

SLOT_CELL, MAP_INDENT = 7, 10  # the map's geometry, as docs/operations.md describes it
LEGEND = re.compile(r"^      (\S)  \{(\d+)\}:(\d+)  (\S+)\s+(\d+/\d+)\s+(in use|idle|creating)\s+(.*)$")
# An H100's compute slices per profile, of its 7 (NVIDIA's MIG user guide), as the COMPUTE column shows them.
H100_COMPUTE = {"1g.10gb": "1/7", "1g.20gb": "1/7", "3g.40gb": "3/7", "7g.80gb": "7/7"}
MIB = 2**20


def top(op: OperatorHarness, *args: str) -> subprocess.CompletedProcess:
    # 100 columns, the width of the documented geometry (top follows COLUMNS, which a test runner may set).
    result = subprocess.run([sys.executable, "-m", "mig_operator.cli", "top", "--kubeconfig",
                             str(op.cluster.kubeconfig), *args], capture_output=True, text=True, timeout=60,
                            cwd=REPO_ROOT, env={**os.environ, "COLUMNS": "100"})
    assert result.returncode == 0, f"top exited {result.returncode}: {result.stderr}"
    return result


def gpu_block(text: str, node: str) -> list[str]:
    """The lines of ``node``'s GPU 0, from its header to the next GPU, node or blank line."""
    lines = text.splitlines()
    at = lines.index(next(line for line in lines if line.startswith(f"node {node}  ")))
    block = [lines[at + 1]]
    for line in lines[at + 2:]:
        if not line or line.startswith("  GPU ") or line.startswith("node "):
            break
        block.append(line)
    return block


def legend(block: list[str]) -> dict[str, tuple[str, int, int, str, str]]:
    """owner ('-' for an instance no slice holds) -> (label, start, size, profile, state)."""
    found = {}
    for line in block:
        match = LEGEND.match(line)
        if match:
            label, start, size, profile, compute, state, owner = match.groups()
            assert compute == H100_COMPUTE[profile], line
            found[owner.split(" (")[0]] = (label, int(start), int(size), profile, state)
    return found


def assert_box(map_line: str, label: str, start: int, size: int) -> None:
    left, right = MAP_INDENT + SLOT_CELL * start, MAP_INDENT + SLOT_CELL * (start + size) - 1
    assert map_line[left:left + 2] == "[" + label and map_line[right] == "]", (
        f"{label} should span columns {left}-{right} (slots {start}-{start + size - 1}):\n{map_line}")


def assert_free(map_line: str, slot: int) -> None:
    column = MAP_INDENT + SLOT_CELL * slot + SLOT_CELL // 2
    assert map_line[column - 3:column + 4].strip() == ".", f"slot {slot} should be free:\n{map_line}"


def test_top_draws_the_layout_the_operator_made(operator: OperatorHarness) -> None:
    mig = operator.add_node("h100-80gb")
    plain = operator.add_node("l4-24gb", labelled=False)
    port = free_port()
    # Usage off: the rows below are drawn without the used/peak columns a measured slice adds.
    agent = operator.agent(mig, None, "--metrics-address", f"127.0.0.1:{port}", "--usage-interval", "0")
    operator.agent(plain, None, "--usage-interval", "0")
    for node in (mig, plain):
        operator.wait_gpunode(node)
    operator.controller()
    ns = operator.namespace()
    operator.create_slice(ns, "big", {"migProfile": "3g.40gb"})
    operator.create_slice(ns, "small", {"migProfile": "1g.10gb"})
    operator.create_slice(ns, "gone", {"migProfile": "1g.20gb"})
    operator.create_slice(ns, "part", {"fraction": 0.5, "nodeName": plain.name})
    ready = {name: operator.wait_phase(ns, name, "Ready")["status"] for name in ("big", "small", "gone", "part")}
    operator.delete_slice(ns, "gone")
    operator.wait_gone(ns, "gone")
    idle = ready.pop("gone")["placement"]
    # 4 + 1 slots in use, the released 1g.20gb's 2 idle, 1 free (whatever placements the planner chose).
    wait_until(lambda: (st := (operator.gpunode(mig) or {}).get("status", {})) and
               (st.get("usedSlots"), st.get("idleSlots"), st.get("freeSlots")) == (5, 2, 1), 20,
               lambda: f"the GpuNode's slot columns at 5/2/1: {(operator.gpunode(mig) or {}).get('status')}")
    operator.create_slice(ns, "huge", {"migProfile": "7g.80gb"})  # the whole GPU: it waits
    operator.wait_phase(ns, "huge", "Pending", reason="NoCapacity")

    text = top(operator).stdout
    assert text.isascii() and max(len(line) for line in text.splitlines()) <= 100
    block = gpu_block(text, mig.name)
    assert block[0] == "  GPU 0  NVIDIA H100 80GB HBM3 (h100-80gb)  MIG, 8 slots: 5 in use, 0 creating, 2 idle, 1 free"
    assert block[1] == "    slot     0      1      2      3      4      5      6      7"
    rows = legend(block)
    assert set(rows) == {f"{ns}/big", f"{ns}/small", "-"}, block
    taken = set()
    for name in ("big", "small"):
        st = ready[name]
        label, start, size, profile, state = rows[f"{ns}/{name}"]
        assert (start, size, profile, state) == (st["placement"]["start"], st["placement"]["size"], st["profile"],
                                                 "in use")
        assert_box(block[2], label, start, size)
        taken |= set(range(start, start + size))
    label, start, size, profile, state = rows["-"]
    assert (start, size, profile, state) == (idle["start"], idle["size"], "1g.20gb", "idle")
    assert_box(block[2], label, start, size)
    taken |= set(range(start, start + size))
    [free] = set(range(8)) - taken
    assert_free(block[2], free)

    # The fraction (the GpuNode names no model for a GPU without MIG): 0.5 of the L4's 23034 MiB is
    # 11517 MiB, 25 of the bar's 50 columns.
    assert ready["part"]["grantedBytes"] == 11517 * MIB
    assert gpu_block(text, plain.name) == [
        "  GPU 0  NVIDIA L4  fractions, 11.2 GiB of 22.5 GiB granted, compute shared: 1 in use, 0 creating",
        "    memory |A" + "#" * 24 + "." * 25 + "|",
        f"      A  11.2 GiB   50%  shared  in use    {ns}/part",
    ]
    assert "pending slices: 1 (NoCapacity 1)" in text.splitlines()
    quota_crd = operator.cluster.kubectl("get", "crd", "gpuquotas.cdmo.io", check=False).returncode == 0
    if not quota_crd:
        assert text.splitlines()[-1] == "quotas: the GpuQuota CRD is not installed (no namespace is limited)"

    # --json: the same picture for scripts; the counts are the GpuNode's and the agent's gauge's.
    out = json.loads(top(operator, "--json").stdout)
    assert set(out) == {"nodes", "pending", "waitingForNode", "quotas"}
    [node] = [n for n in out["nodes"] if n["name"] == mig.name]
    [gpu] = node["gpus"]
    expected = ["free"] * 8
    for st in (ready["big"], ready["small"]):
        for slot in range(st["placement"]["start"], st["placement"]["start"] + st["placement"]["size"]):
            expected[slot] = "in_use"
    for slot in range(idle["start"], idle["start"] + idle["size"]):
        expected[slot] = "idle"
    assert gpu["slotStates"] == expected
    assert gpu["slotCounts"] == {"in_use": 5, "creating": 0, "idle": 2, "free": 1}
    assert (gpu["mode"], gpu["model"], gpu["slots"], gpu["memoryBytes"]) == ("mig", "h100-80gb", 8, 81559 * MIB)
    by_slice = {i["slice"]: i for i in gpu["instances"]}
    assert by_slice[f"{ns}/big"]["deviceUUID"] == ready["big"]["deviceUUID"]
    assert by_slice[f"{ns}/small"]["sliceUID"] == operator.get_slice(ns, "small")["metadata"]["uid"]
    assert set(by_slice[""]) == {"label", "start", "size", "profile", "state", "slice", "sliceUID", "deviceUUID",
                                 "drawn", "compute", "usage"}
    # Compute: each slice's status says its profile's share, and the GPU's is the instances in use (3 + 1 of 7).
    assert (ready["big"]["compute"], ready["small"]["compute"], ready["part"]["compute"]) == ("3/7", "1/7", "shared")
    assert gpu["compute"] == "4/7" and (operator.gpunode(mig) or {})["status"]["gpus"][0]["compute"] == "4/7"
    assert out["pending"] == {"total": 1, "byReason": {"NoCapacity": 1}}
    assert out["quotas"]["state"] in ("listed", "absent") and isinstance(out["quotas"]["items"], list)
    samples = scrape(port)[1]
    slots = {s: value(samples, "mig_operator_slots", node=mig.name, gpu="0", model="h100-80gb", state=s)
             for s in ("in_use", "idle", "free")}
    assert slots == {"in_use": 5, "idle": 2, "free": 1}

    # A slice bound while its node's agent is down: drawn as creating at its placement (or, when it
    # reclaims the idle instance, listed as waiting for that), then in use once the agent is back.
    # (huge goes first: an older waiting slice has the first call on its namespace's room for a while.)
    operator.delete_slice(ns, "huge")
    operator.wait_gone(ns, "huge")
    operator.kill(agent)
    operator.create_slice(ns, "late", {"migProfile": "1g.10gb"})
    late = operator.wait_phase(ns, "late", "Bound")["status"]
    block = gpu_block(top(operator).stdout, mig.name)
    label, start, size, profile, state = legend(block)[f"{ns}/late"]
    assert (start, size, profile, state) == (late["placement"]["start"], late["placement"]["size"], "1g.10gb",
                                             "creating")
    line = next(line for line in block if line.startswith(f"      {label}  "))
    if late.get("reclaim"):
        assert line.endswith("(waits for the instances there to be reclaimed)")
    else:
        assert_box(block[2], label, start, size)
        assert "1 creating" in block[0]
    operator.start(agent)
    operator.wait_phase(ns, "late", "Ready", timeout=60)
    wait_until(lambda: any(i["slice"] == f"{ns}/late" and i["state"] == "in_use" for n in
                           json.loads(top(operator, "--json").stdout)["nodes"] if n["name"] == mig.name
                           for i in n["gpus"][0]["instances"]), 20, "late in use in top --json")


def test_top_shows_a_namespaces_quota_and_its_use(operator: OperatorHarness) -> None:
    if operator.cluster.kubectl("get", "crd", "gpuquotas.cdmo.io", check=False).returncode != 0:
        # Until the GpuQuota CRD is in crds/, the table is one line and top still works.
        text = top(operator).stdout
        assert text.splitlines()[-1] == "quotas: the GpuQuota CRD is not installed (no namespace is limited)"
        return
    node = operator.add_node("h100-80gb")
    operator.start_operator(node)
    ns = operator.namespace()
    operator.custom.create_namespaced_custom_object("cdmo.io", "v1alpha1", ns, "gpuquotas", {
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuQuota", "metadata": {"name": "quota"},
        "spec": {"memory": "40Gi", "slices": 3}})
    operator.create_slice(ns, "one", {"migProfile": "1g.10gb"})  # 9984 MiB granted
    operator.wait_phase(ns, "one", "Ready")

    def item() -> dict | None:
        found = [q for q in json.loads(top(operator, "--json").stdout)["quotas"]["items"] if q["namespace"] == ns]
        return found[0] if found and found[0]["usedSlices"] == 1 else None

    quota = wait_until(item, 20, "the quota's use in top --json")
    assert quota == {"namespace": ns, "name": "quota", "usedBytes": 9984 * MIB, "hardBytes": 40 * 2**30,
                     "usedSlices": 1, "hardSlices": 3, "waiting": 0, "wholeGpus": 0}
    text = top(operator).stdout
    [row] = [line for line in text.splitlines() if line.startswith(f"  {ns} ")]
    # 9984 MiB is 9.75 GiB (9.8 at one decimal), 24 % of 40 GiB.
    # A MIG slice holds no fraction GPU whole: the last column is 0.
    assert row.split() == [ns, "9.8", "GiB", "/", "40", "GiB", "24%", "1", "/", "3", "0", "0"], row


def interrupt_after(proc: subprocess.Popen, enough: Callable[[str], bool], timeout: float = 30) -> tuple[str, str]:
    """A ``--watch`` run's stdout read as it comes until ``enough`` of it, then Ctrl-C (SIGINT): its
    whole stdout and stderr. A run that draws too little is killed after ``timeout``."""
    assert proc.stdout is not None and proc.stderr is not None
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        out = ""
        while not enough(out) and (line := proc.stdout.readline()):
            out += line
        assert enough(out), f"the watch drew too little in {timeout} s:\n{out[-2000:]}"
        proc.send_signal(signal.SIGINT)
        out += proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(20)
    finally:
        watchdog.cancel()
    return out, err


def test_watch_draws_again_until_ctrl_c(operator: OperatorHarness) -> None:
    node = operator.add_node("a30-24gb")
    operator.agent(node)
    operator.wait_gpunode(node)
    proc = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", "top", "--kubeconfig",
                             str(operator.cluster.kubeconfig), "--watch", "0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env={**os.environ, "COLUMNS": "100"})
    out, err = interrupt_after(proc, lambda out: out.count("  GPU 0  NVIDIA A30 (a30-24gb)  MIG, 4 slots") >= 3)
    assert proc.returncode == 0, err
    assert err == "" and "\x1b" not in out  # not a terminal: no screen clearing, no colours
    frames = [line for line in out.splitlines() if line.startswith("--- mig-operator top at ")]
    assert len(frames) >= 3, out[-2000:]
    assert all(line.endswith(", every 0.5 s (Ctrl-C stops)") for line in frames)
    assert out.count(f"node {node.name}  ") == len(frames)
    assert out.count("  GPU 0  NVIDIA A30 (a30-24gb)  MIG, 4 slots: 0 in use, 0 creating, 0 idle, 4 free") >= 3


def _json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_watch_with_json_is_one_object_per_line(operator: OperatorHarness) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mig_operator.cli", "top", "--kubeconfig",
                             str(operator.cluster.kubeconfig), "--watch", "0.5", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    out, err = interrupt_after(proc, lambda out: out.count("\n") >= 2)  # two objects, one a line
    assert proc.returncode == 0, err
    objects = _json_lines(out)
    assert len(objects) >= 2 and all(set(o) == {"nodes", "pending", "waitingForNode", "quotas"} for o in objects)
