"""`mig-operator top` on an autoscaled cluster: the slices waiting for a new node, counted by the pool their
status names (``status.pool``), in the text (written by hand) and in ``--json``'s ``waitingForNode``."""

from __future__ import annotations

import json

from test_top import gpuslice

from mig_operator.core.views.top_json import view_json
from mig_operator.core.views.top_view import build_view, namespace_view, render_text


def slices() -> list[dict]:
    """Two slices of team-a and one of team-b wait for a gpu-h200 node, one of team-b for an l40s node;
    team-c waits on its quota; team-c/done is Bound yet carries a pool: only WaitingForNode counts."""
    return [
        gpuslice("team-a/nb", "u1", "Pending", "WaitingForNode", pool="gpu-h200"),
        gpuslice("team-b/train", "u2", "Pending", "WaitingForNode", pool="gpu-h200"),
        gpuslice("team-a/dev", "u3", "Pending", "WaitingForNode", pool="gpu-h200"),
        gpuslice("team-b/infer", "u4", "Pending", "WaitingForNode", pool="l40s"),
        gpuslice("team-c/big", "u5", "Pending", "QuotaExceeded"),
        gpuslice("team-c/done", "u6", "Bound", "Bound", pool="gpu-h200", mode="fraction", node="n", gpu=0),
    ]


def test_the_cluster_picture_counts_the_waiting_slices_by_pool() -> None:
    view = build_view([], slices(), [])
    assert render_text(view) == (
        "0 node(s), 0 GPU(s); slots and memory: # in use, ~ creating, - idle, . free\n"
        "no GpuNodes: no mig-operator agent has published its GPUs (kubectl get gn)\n"
        "\n"
        "pending slices: 5 (QuotaExceeded 1, WaitingForNode 4)\n"
        "waiting for a new node: pool gpu-h200: 3 slices, pool l40s: 1 slice\n"
        "quotas: none (no GpuQuota: every namespace may take any free GPU memory)\n")
    out = view_json(view)
    assert json.loads(json.dumps(out))["waitingForNode"] == {"gpu-h200": 3, "l40s": 1}


def test_no_slice_waiting_for_a_node_draws_no_line_and_an_empty_map() -> None:
    view = build_view([], [gpuslice("team-c/big", "u5", "Pending", "NoCapacity")], [])
    assert not any(line.startswith("waiting for a new node") for line in render_text(view).splitlines())
    assert view_json(view)["waitingForNode"] == {}


def test_one_namespaces_picture_counts_its_own() -> None:
    mine = [s for s in slices() if s["metadata"]["namespace"] == "team-b"]
    view = namespace_view("team-b", mine, [])
    assert "waiting for a new node: pool gpu-h200: 1 slice, pool l40s: 1 slice" in render_text(view).splitlines()
    assert view_json(view)["waitingForNode"] == {"gpu-h200": 1, "l40s": 1}


def test_a_narrow_terminal_wraps_the_line_without_cutting_it() -> None:
    many = [gpuslice(f"team-a/s{i}", f"u{i}", "Pending", "WaitingForNode", pool=f"pool-number-{i}")
            for i in range(4)]
    lines = render_text(build_view([], many, []), width=60).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("waiting for a new node"))
    end = next(i for i, line in enumerate(lines) if line.startswith("quotas"))
    assert all(len(line) <= 60 for line in lines[start:end])
    assert " ".join(line.strip() for line in lines[start:end]) == (
        "waiting for a new node: pool pool-number-0: 1 slice, pool pool-number-1: 1 slice, "
        "pool pool-number-2: 1 slice, pool pool-number-3: 1 slice")
