"""`mig-operator top` on a GPU serving compute shares: each fraction's share in the COMPUTE column and
the GPU's sum on its line (text written by hand), and the --json keys."""

from __future__ import annotations

from test_top import GIB, gpunode, gpuslice

from mig_operator.core.views.top_json import view_json
from mig_operator.core.views.top_view import build_view, render_text


def layout() -> tuple[list[dict], list[dict], list[dict]]:
    """An L4 serving shares: team-a/a (8Gi, 0.25) and team-a/b (4Gi, 0.5) listed by its agent, team-a/c
    (2Gi, 0.125) bound and not yet listed."""
    node = gpunode("l4-a", "t", [{
        "index": 0, "product": "NVIDIA L4", "model": "", "memoryMiB": 23034, "serves": "fraction",
        "instances": [], "grantedBytes": 12 * GIB, "compute": "0.75",
        "fractions": [{"slice": "team-a/a", "sliceUID": "a", "bytes": 8 * GIB, "compute": 0.25},
                      {"slice": "team-a/b", "sliceUID": "b", "bytes": 4 * GIB, "compute": 0.5}]}])
    slices = [
        gpuslice("team-a/a", "a", "Ready", mode="fraction", node="l4-a", gpu=0, grantedBytes=8 * GIB,
                 compute="0.25"),
        gpuslice("team-a/b", "b", "Ready", mode="fraction", node="l4-a", gpu=0, grantedBytes=4 * GIB,
                 compute="0.5"),
        gpuslice("team-a/c", "c", "Bound", mode="fraction", node="l4-a", gpu=0, grantedBytes=2 * GIB,
                 compute="0.125"),
    ]
    return [node], slices, []


def test_each_share_and_the_gpus_sum_are_drawn() -> None:
    lines = render_text(build_view(*layout())).splitlines()
    at = lines.index("node l4-a  (observed t)")
    # 0.25 + 0.5 + 0.125 = 0.875 given out; the creating slice counts as its bar does.
    assert lines[at + 1] == ("  GPU 0  NVIDIA L4  fractions, 14 GiB of 22.5 GiB granted, compute 0.875 of 1: "
                             "2 in use, 1 creating")
    assert lines[at + 3:at + 6] == [
        "      A  8 GiB   36%  0.25   in use    team-a/a",
        "      B  4 GiB   18%  0.5    in use    team-a/b",
        "      C  2 GiB    9%  0.125  creating  team-a/c",
    ]


def test_json_gives_each_share_as_a_number_and_the_sum_as_text() -> None:
    [gpu] = view_json(build_view(*layout()))["nodes"][0]["gpus"]
    assert gpu["compute"] == "0.875"
    assert [(f["slice"], f["compute"]) for f in gpu["fractions"]] == [
        ("team-a/a", 0.25), ("team-a/b", 0.5), ("team-a/c", 0.125)]
