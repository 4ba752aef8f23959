"""`mig-operator top`: a known layout drawn as text (golden text written by hand from the layout), its
JSON shape, the edge cases of the drawing, and the command's flags."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from mig_operator.cli import main
from mig_operator.core.views.top_json import view_json
from mig_operator.core.views.top_view import (
    BAR_WIDTH,
    QUOTAS_ABSENT,
    WIDTH,
    build_view,
    memory_bar,
    render_text,
)

GIB = 2**30
MIB = 2**20
# A profile table whose placements span 8 memory slots (an H100's); top reads the slot count from it.
H100_PROFILES = [{"name": "7g.80gb", "placements": [{"start": 0, "size": 8}]},
                 {"name": "1g.10gb", "placements": [{"start": s, "size": 1} for s in range(7)]}]


def gpunode(name: str, observed: str, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """A GpuNode publishing the H100 profile table once if any of its GPUs names that model."""
    models = [{"name": "h100-80gb", "profiles": H100_PROFILES}] if any(g.get("model") == "h100-80gb"
                                                                       for g in gpus) else []
    return {"metadata": {"name": name}, "status": {"observedAt": observed, "models": models, "gpus": gpus}}


def h100(index: int, instances: list[dict[str, Any]], granted: int = 0) -> dict[str, Any]:
    return {"index": index, "product": "NVIDIA H100 80GB HBM3", "model": "h100-80gb", "memoryMiB": 81559,
            "migCapable": True, "migEnabled": True, "serves": "mig",
            "instances": instances, "fractions": [], "grantedBytes": granted}


def instance(profile: str, start: int, size: int, slice_ref: str = "", uid: str = "", in_use: bool = False,
             complete: bool = True) -> dict[str, Any]:
    return {"giId": start + 1, "profile": profile, "start": start, "size": size, "inUse": in_use,
            "slice": slice_ref, "sliceUID": uid, "complete": complete, "deviceUUID": f"MIG-{start}-{profile}"}


def gpuslice(ref: str, uid: str, phase: str, reason: str = "", **status: Any) -> dict[str, Any]:
    namespace, name = ref.split("/")
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid},
            "status": {"phase": phase, "reason": reason, **status}}


def mig_binding(node: str, gpu: int, profile: str, start: int, size: int) -> dict[str, Any]:
    return {"mode": "mig", "node": node, "gpu": gpu, "profile": profile, "placement": {"start": start, "size": size}}


def layout() -> tuple[list[dict], list[dict], list[dict]]:
    """Two nodes. gpu-a's GPU 0: team-a/train's 3g.40gb on slots 0-3 (Ready), an idle 1g.20gb on 4-5,
    team-b/nb's 1g.10gb on 6 (Creating), slot 7 free. Its GPU 1: team-b/new bound to 1g.20gb at {0}:2
    (no instance yet), an idle 1g.20gb on 4-5 that team-c/big's 3g.40gb at {4}:4 will reclaim, and a
    1g.10gb on 7 that a process uses outside any slice. l4-a's L4: team-a/infer holds 8Gi, team-c/dev is
    bound to 4Gi. Three slices wait; two namespaces have quotas."""
    nodes = [
        gpunode("gpu-a", "2026-11-24T15:00:00.000Z", [
            h100(0, [instance("3g.40gb", 0, 4, "team-a/train", "u-train"), instance("1g.20gb", 4, 2),
                     instance("1g.10gb", 6, 1, "team-b/nb", "u-nb")], granted=(40448 + 9984) * MIB),
            h100(1, [instance("1g.20gb", 4, 2), instance("1g.10gb", 7, 1, in_use=True)]),
        ]),
        gpunode("l4-a", "2026-11-24T15:00:01.000Z", [
            {"index": 0, "product": "NVIDIA L4", "model": "", "memoryMiB": 23034, "migCapable": False,
             "migEnabled": False, "serves": "fraction", "instances": [],
             "fractions": [{"slice": "team-a/infer", "sliceUID": "u-infer", "bytes": 8 * GIB}],
             "grantedBytes": 8 * GIB},
        ]),
    ]
    slices = [
        gpuslice("team-a/train", "u-train", "Ready", **mig_binding("gpu-a", 0, "3g.40gb", 0, 4)),
        gpuslice("team-b/nb", "u-nb", "Creating", **mig_binding("gpu-a", 0, "1g.10gb", 6, 1)),
        gpuslice("team-b/new", "u-new", "Bound", **mig_binding("gpu-a", 1, "1g.20gb", 0, 2)),
        gpuslice("team-c/big", "u-big", "Bound", **mig_binding("gpu-a", 1, "3g.40gb", 4, 4)),
        gpuslice("team-a/infer", "u-infer", "Ready", mode="fraction", node="l4-a", gpu=0, grantedBytes=8 * GIB),
        gpuslice("team-c/dev", "u-dev", "Bound", mode="fraction", node="l4-a", gpu=0, grantedBytes=4 * GIB),
        gpuslice("team-a/wait", "u-wait", "Pending", "QuotaExceeded"),
        gpuslice("team-c/huge", "u-huge", "Pending", "NoCapacity"),
        gpuslice("team-c/huge2", "u-huge2", "Pending", "NoCapacity"),
    ]
    quotas = [
        {"metadata": {"namespace": "team-b", "name": "gpus"}, "spec": {"memory": "20Gi"},
         "status": {"used": {"memory": "9984Mi", "slices": 1}, "waiting": 0}},
        {"metadata": {"namespace": "team-a", "name": "gpus"}, "spec": {"memory": "40Gi", "slices": 4},
         "status": {"used": {"memory": "40448Mi", "slices": 1, "wholeGpus": 1}, "waiting": 1}},
    ]
    return nodes, slices, quotas


# Written by hand from the layout: 7 columns per slot, each box "[" label (profile if it fits) fill "]";
# an H100's profiles have 1, 3 or 7 of its 7 compute slices; the L4's fractions ask no compute share.
GOLDEN = """\
2 node(s), 3 GPU(s); slots and memory: # in use, ~ creating, - idle, . free

node gpu-a  (observed 2026-11-24T15:00:00.000Z)
  GPU 0  NVIDIA H100 80GB HBM3 (h100-80gb)  MIG, 8 slots: 4 in use, 1 creating, 2 idle, 1 free
    slot     0      1      2      3      4      5      6      7
          [A 3g.40gb ################][B 1g.20gb --][C~~~~]   .
      A  {0}:4  3g.40gb  3/7  in use    team-a/train
      B  {4}:2  1g.20gb  1/7  idle      -
      C  {6}:1  1g.10gb  1/7  creating  team-b/nb
  GPU 1  NVIDIA H100 80GB HBM3 (h100-80gb)  MIG, 8 slots: 1 in use, 2 creating, 2 idle, 3 free
    slot     0      1      2      3      4      5      6      7
          [A 1g.20gb ~~]   .      .   [B 1g.20gb --]   .   [D####]
      A  {0}:2  1g.20gb  1/7  creating  team-b/new
      B  {4}:2  1g.20gb  1/7  idle      -
      C  {4}:4  3g.40gb  3/7  creating  team-c/big (waits for the instances there to be reclaimed)
      D  {7}:1  1g.10gb  1/7  in use    - (a process outside any slice)

node l4-a  (observed 2026-11-24T15:00:01.000Z)
  GPU 0  NVIDIA L4  fractions, 12 GiB of 22.5 GiB granted, compute shared: 1 in use, 1 creating
    memory |A#################B~~~~~~~~.......................|
      A  8 GiB   36%  shared  in use    team-a/infer
      B  4 GiB   18%  shared  creating  team-c/dev

pending slices: 3 (NoCapacity 2, QuotaExceeded 1)
quotas (GpuQuota; memory counts each slice's grant, and a fraction GPU held alone whole)
  namespace  memory used / hard    %  slices used / hard  waiting  whole GPUs
  team-a     39.5 GiB / 40 GiB   99%  1 / 4                     1  1
  team-b     9.8 GiB / 20 GiB    49%  1 / -                     0  0
"""


def test_a_known_layout_renders_to_the_golden_text() -> None:
    text = render_text(build_view(*layout()))
    assert text == GOLDEN, "\n" + text
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert text.isascii()  # no colours, no box-drawing characters: the same in a terminal and a log


def test_the_slot_counts_agree_with_the_gpunode_rule() -> None:
    """in use + creating (held by a slice or a process) + idle + free = the GPU's slots, per GPU; the
    instances that exist count as the GpuNode columns count them (SLOTS IN USE, IDLE SLOTS)."""
    view = build_view(*layout())
    gpu0, gpu1 = view.nodes[0].gpus
    assert gpu0.slot_states == ("in_use",) * 4 + ("idle",) * 2 + ("creating", "free")
    assert gpu1.slot_states == ("creating",) * 2 + ("free",) * 2 + ("idle",) * 2 + ("free", "in_use")
    for gpu in (gpu0, gpu1):
        assert sum(gpu.slot_counts().values()) == gpu.slots == 8


def test_json_has_the_documented_shape() -> None:
    out = view_json(build_view(*layout()))
    json.dumps(out)  # serialisable as it is
    assert set(out) == {"nodes", "pending", "waitingForNode", "quotas"}
    assert out["waitingForNode"] == {}  # always there; no slice of the layout waits for a new node
    assert [n["name"] for n in out["nodes"]] == ["gpu-a", "l4-a"]
    gpu0 = out["nodes"][0]["gpus"][0]
    assert set(gpu0) == {"index", "product", "model", "memoryBytes", "mode", "serves", "servesReason", "slots",
                         "slotStates", "slotCounts", "grantedBytes", "compute", "instances", "fractions",
                         "healthy", "unhealthyReason"}
    assert (gpu0["healthy"], gpu0["unhealthyReason"]) == (True, "")
    assert (gpu0["mode"], gpu0["slots"], gpu0["memoryBytes"]) == ("mig", 8, 81559 * MIB)
    assert gpu0["slotCounts"] == {"in_use": 4, "creating": 1, "idle": 2, "free": 1}
    assert gpu0["instances"][0] == {"label": "A", "start": 0, "size": 4, "profile": "3g.40gb", "state": "in_use",
                                    "slice": "team-a/train", "sliceUID": "u-train", "deviceUUID": "MIG-0-3g.40gb",
                                    "drawn": True, "compute": "3/7", "usage": None}
    big = out["nodes"][0]["gpus"][1]["instances"][2]
    assert (big["slice"], big["state"], big["drawn"], big["deviceUUID"]) == ("team-c/big", "creating", False, "")
    l4 = out["nodes"][1]["gpus"][0]
    assert (l4["mode"], l4["slots"], l4["slotStates"], l4["slotCounts"], l4["grantedBytes"]) == (
        "fraction", 0, [], {}, 12 * GIB)
    assert l4["fractions"] == [
        {"label": "A", "slice": "team-a/infer", "sliceUID": "u-infer", "bytes": 8 * GIB, "state": "in_use",
         "compute": None, "usage": None},
        {"label": "B", "slice": "team-c/dev", "sliceUID": "u-dev", "bytes": 4 * GIB, "state": "creating",
         "compute": None, "usage": None}]
    assert l4["compute"] == "shared"
    assert out["pending"] == {"total": 3, "byReason": {"NoCapacity": 2, "QuotaExceeded": 1}}
    assert out["quotas"]["state"] == "listed"
    assert out["quotas"]["items"] == [
        {"namespace": "team-a", "name": "gpus", "usedBytes": 40448 * MIB, "hardBytes": 40 * GIB, "usedSlices": 1,
         "hardSlices": 4, "waiting": 1, "wholeGpus": 1},
        {"namespace": "team-b", "name": "gpus", "usedBytes": 9984 * MIB, "hardBytes": 20 * GIB, "usedSlices": 1,
         "hardSlices": None, "waiting": 0, "wholeGpus": 0}]


def test_without_the_quota_crd_the_table_is_one_line_and_the_rest_is_drawn() -> None:
    nodes, slices, _ = layout()
    view = build_view(nodes, slices, None, QUOTAS_ABSENT, "the GpuQuota CRD is not installed (no namespace is limited)")
    lines = render_text(view).splitlines()
    assert lines[-1] == "quotas: the GpuQuota CRD is not installed (no namespace is limited)"
    assert lines[:-1] == GOLDEN.splitlines()[:-4]
    assert view_json(view)["quotas"] == {"state": "absent", "note": lines[-1].removeprefix("quotas: "),
                                         "items": []}


def test_no_quota_objects_and_no_nodes() -> None:
    text = render_text(build_view([], [], []))
    assert text == ("0 node(s), 0 GPU(s); slots and memory: # in use, ~ creating, - idle, . free\n"
                    "no GpuNodes: no mig-operator agent has published its GPUs (kubectl get gn)\n"
                    "\n"
                    "pending slices: none\n"
                    "quotas: none (no GpuQuota: every namespace may take any free GPU memory)\n")


def test_an_empty_mig_gpu_is_all_free_and_a_gpu_taking_no_new_slices_says_why() -> None:
    gpu = h100(0, []) | {"serves": "none", "servesReason": "MIG mode is enabled but the node is not labelled"}
    lines = render_text(build_view([gpunode("n", "t", [gpu])], [], [])).splitlines()
    at = lines.index("node n  (observed t)")
    assert lines[at + 1:at + 6] == [
        "  GPU 0  NVIDIA H100 80GB HBM3 (h100-80gb)  MIG, 8 slots: 0 in use, 0 creating, 0 idle, 8 free",
        "    slot     0      1      2      3      4      5      6      7",
        "             .      .      .      .      .      .      .      .",
        "      no instances",
        "      takes no new slices: MIG mode is enabled but the node is not labelled",
    ]


def test_an_unhealthy_gpu_says_so_with_its_reason() -> None:
    sick = [{"type": "Healthy", "status": "False", "reason": "Xid79", "message": "GPU 1 reported Xid 79"}]
    gpus = [h100(0, []) | {"conditions": [{"type": "Healthy", "status": "True", "reason": "Healthy"}]},
            h100(1, []) | {"index": 1, "conditions": sick}]
    view = build_view([gpunode("n", "t", gpus)], [], [])
    lines = render_text(view).splitlines()
    assert lines.count("      UNHEALTHY (Xid79), takes no new slices: GPU 1 reported Xid 79") == 1
    assert lines.index("      UNHEALTHY (Xid79), takes no new slices: GPU 1 reported Xid 79") > lines.index(
        "  GPU 1  NVIDIA H100 80GB HBM3 (h100-80gb)  MIG, 8 slots: 0 in use, 0 creating, 0 idle, 8 free")
    out = [(g["healthy"], g["unhealthyReason"]) for g in view_json(view)["nodes"][0]["gpus"]]
    assert out == [(True, ""), (False, "Xid79")]


def test_a_whole_gpu_instance_fills_the_map_to_the_last_column() -> None:
    gpu = h100(0, [instance("7g.80gb", 0, 8, "a/b", "u")])
    view = build_view([gpunode("n", "t", [gpu])], [gpuslice("a/b", "u", "Ready")], [])
    line = render_text(view).splitlines()[5]
    assert line == "          [A 7g.80gb " + "#" * (8 * 7 - 2 - len("A 7g.80gb ")) + "]"
    assert len(line) == 10 + 8 * 7


@pytest.mark.parametrize(("shares", "bar"), [
    ([], "." * BAR_WIDTH),
    ([GIB // 2], "A" + "." * (BAR_WIDTH - 1)),  # 0.5 of 20 GiB is 1.25 columns: 1
    ([20 * GIB], "A" + "#" * (BAR_WIDTH - 1)),  # 20 of 20 GiB: every column, none free
    ([10 * GIB, 10 * GIB], "A" + "#" * 24 + "B" + "#" * 24),
    ([MIB] * 3, "ABC" + "." * (BAR_WIDTH - 3)),  # slivers still show: a column each
])
def test_the_memory_bar_gives_each_share_its_columns(shares: list[int], bar: str) -> None:
    gpu = {"index": 0, "product": "GPU", "model": "", "memoryMiB": 20 * 1024, "migEnabled": False,
           "serves": "fraction", "instances": [],
           "fractions": [{"slice": f"ns/s{i}", "sliceUID": f"u{i}", "bytes": b} for i, b in enumerate(shares)]}
    view = build_view([gpunode("n", "t", [gpu])], [], [])
    assert memory_bar(view.nodes[0].gpus[0]) == f"    memory |{bar}|"
    assert len(bar) == BAR_WIDTH


def test_long_names_are_clipped_to_the_width() -> None:
    ref = "n" * 63 + "/" + "s" * 200
    gpu = h100(0, [instance("1g.10gb", 0, 1, ref, "u")])
    view = build_view([gpunode("x" * 200, "t", [gpu])], [gpuslice(ref, "u", "Ready")], [])
    lines = render_text(view).splitlines()
    assert max(len(line) for line in lines) == WIDTH
    assert any(line.endswith("...") and "A  {0}:1  1g.10gb  1/7  in use    nnn" in line for line in lines)


# ---- the command line --------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "words"), [
    (["--watch", "0"], "--watch '0'"),
    (["--watch", "-1"], "--watch '-1'"),
    (["--watch", "soon"], "--watch 'soon'"),
    (["--watch", "7200"], "--watch '7200'"),
    (["--color"], "unrecognized arguments: --color"),
])
def test_bad_flags_are_one_line_with_a_valid_example(args: list[str], words: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["top", *args])  # a value's own check
    except SystemExit as stopped:  # argparse's
        code = stopped.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
    assert "--watch 2" in err or "--help" in err


def test_a_missing_kubeconfig_is_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--kubeconfig", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kubeconfig" in err and "e.g." in err


# ---- mig_operator_slots: the agent's gauge of the same counts ------------------------------------------


def _published_gpu() -> tuple[dict[str, Any], Any]:
    """One H200 as its agent publishes it: a slice's 2g.35gb on 0-1, an idle 1g.18gb on 2, a 1g.18gb a
    process uses on 3 (no slice), the rest free."""
    from mig_operator.core.node.lifecycle import COMPLETED, OwnerEntry, OwnerRecord
    from mig_operator.core.placement.profiles import get_model
    from mig_operator.gpu.protocol import GpuInfo, MigInstance
    from mig_operator.kube.agent.inventory import gpunode_status

    h200 = get_model("h200-141gb")
    p2, p1 = h200.profile("2g.35gb"), h200.profile("1g.18gb")
    insts = [MigInstance(0, 1, 0, p2.id, p2.name, 0, 2, "MIG-a", False),
             MigInstance(0, 2, 0, p1.id, p1.name, 2, 1, "MIG-b", False),
             MigInstance(0, 3, 0, p1.id, p1.name, 3, 1, "MIG-c", True)]
    owner = OwnerEntry("u1", "ns/a", "mig", 0, COMPLETED, p2.memory_mib * MIB, p2.id, p2.name, 0, 2, 1, 0, "MIG-a")
    info = GpuInfo(0, "GPU-0", h200.product, h200.memory_mib, True, True)
    status = gpunode_status([info], {0: h200}, {0: insts}, OwnerRecord("b", {"u1": owner}), True, "t")
    return status, h200


def test_the_slots_gauge_counts_what_the_gpunode_columns_and_top_count() -> None:
    from mig_operator.kube.agent.publish import slot_states

    status, h200 = _published_gpu()
    counts = slot_states(status["gpus"][0], h200.memory_slots)
    assert counts == {"in_use": 3, "idle": 1, "free": 4}  # by hand: slots 0, 1, 3 / 2 / 4-7
    assert (counts["in_use"], counts["idle"], counts["free"]) == (
        status["usedSlots"], status["idleSlots"], status["freeSlots"])
    view = build_view([{"metadata": {"name": "n"}, "status": status}],
                      [gpuslice("ns/a", "u1", "Ready", **mig_binding("n", 0, "2g.35gb", 0, 2))], [])
    top = view.nodes[0].gpus[0].slot_counts()
    assert (top["in_use"] + top["creating"], top["idle"], top["free"]) == (3, 1, 4)


def test_the_agent_sets_the_slots_gauge_and_drops_it_when_the_gpu_leaves_mig() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from mig_operator.kube.agent.publish import Publisher

    status, h200 = _published_gpu()
    agent = SimpleNamespace(settings=SimpleNamespace(node="slots-node"), _slot_models={})

    def sample(state: str, model: str = "h200-141gb") -> float | None:
        return REGISTRY.get_sample_value("mig_operator_slots", {"node": "slots-node", "gpu": "0", "model": model,
                                                                "state": state})

    Publisher.publish_slots(agent, status["gpus"][0], h200)  # type: ignore[arg-type]
    assert [sample(s) for s in ("in_use", "idle", "free")] == [3, 1, 4]
    Publisher.publish_slots(agent, status["gpus"][0] | {"migEnabled": False}, h200)  # type: ignore[arg-type]
    assert [sample(s) for s in ("in_use", "idle", "free")] == [None, None, None]


def test_an_unreachable_api_server_is_one_line_and_exit_1(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    import yaml

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    assert main(["top", "--kubeconfig", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("mig-operator: cannot list GpuNodes: ")
    assert f"127.0.0.1:{port}" in captured.err


def _kubeconfig(tmp_path: Any, server: str) -> str:
    import yaml

    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": server}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("terminal", [True, False])
def test_watch_redraws_clears_only_a_terminal_and_survives_an_unreadable_moment(
        terminal: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Three reads: a picture, an API failure (one line on stderr, then it goes on), a picture; Ctrl-C
    during the fourth ends it with status 0."""
    from mig_operator.kube import top as kube_top

    reads = []

    async def read_view(client: Any, *_: Any) -> Any:
        reads.append(client)
        if len(reads) == 2:
            raise kube_top.TopError("cannot list GpuNodes: refused\nby the server")
        if len(reads) == 4:
            raise KeyboardInterrupt
        return build_view(*layout())

    monkeypatch.setattr(kube_top, "read_view", read_view)
    monkeypatch.setattr("sys.stdout.isatty", lambda: terminal)
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # the golden picture's width, whatever runs the test
    assert main(["top", "--kubeconfig", _kubeconfig(tmp_path, "http://127.0.0.1:9"), "--watch", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert err == "mig-operator: cannot list GpuNodes: refused by the server; trying again in 0.5 s\n"
    frames = out.split("--- mig-operator top at ")
    assert len(frames) == 3 and frames[0] == ("\x1b[H\x1b[2J" if terminal else "")
    # On a terminal each picture starts by clearing the screen; in a log a blank line parts them.
    pictures = [GOLDEN + "\x1b[H\x1b[2J", GOLDEN] if terminal else [GOLDEN + "\n", GOLDEN + "\n"]
    for frame, picture in zip(frames[1:], pictures, strict=True):
        header, _, rest = frame.partition("\n")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ, every 0.5 s \(Ctrl-C stops\)", header)
        assert rest == picture
    assert len({id(c) for c in reads}) == 1  # one client, one connection pool, for the whole watch


def test_json_once_is_indented_and_with_watch_one_line_each(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from mig_operator.kube import top as kube_top

    calls = []

    async def read_view(client: Any, *_: Any) -> Any:
        calls.append(1)
        if len(calls) == 4:  # the single picture, then two of the watch
            raise KeyboardInterrupt
        return build_view(*layout())

    monkeypatch.setattr(kube_top, "read_view", read_view)
    config = _kubeconfig(tmp_path, "http://127.0.0.1:9")
    assert main(["top", "--kubeconfig", config, "--json"]) == 0
    once = capsys.readouterr().out
    assert json.loads(once) == view_json(build_view(*layout())) and once.startswith("{\n  ")
    assert main(["top", "--kubeconfig", config, "--json", "--watch", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line) == json.loads(once) for line in lines)


def test_each_gpu_of_a_mixed_node_is_drawn_with_its_own_models_slots() -> None:
    # An A30's table spans 4 memory slots, an H100's 8: each GPU reads the table its model names.
    a30_profiles = [{"name": "4g.24gb", "slices": 4, "placements": [{"start": 0, "size": 4}]},
                    {"name": "1g.6gb", "slices": 1, "placements": [{"start": s, "size": 1} for s in range(4)]}]
    a30 = {"index": 1, "product": "NVIDIA A30", "model": "a30-24gb", "memoryMiB": 24576, "migCapable": True,
           "migEnabled": True, "serves": "mig", "instances": [instance("1g.6gb", 3, 1, "a/b", "u")],
           "fractions": [], "grantedBytes": 0}
    node = gpunode("n", "t", [h100(0, []), a30])
    node["status"]["models"].append({"name": "a30-24gb", "profiles": a30_profiles})
    [h, a] = view_json(build_view([node], [gpuslice("a/b", "u", "Ready")], []))["nodes"][0]["gpus"]
    assert (h["model"], h["mode"], h["slots"], h["slotStates"]) == ("h100-80gb", "mig", 8, ["free"] * 8)
    assert (a["model"], a["mode"], a["slots"], a["slotStates"]) == ("a30-24gb", "mig", 4,
                                                                    ["free", "free", "free", "in_use"])
    assert a["instances"][0]["compute"] == "1/4"  # the A30's whole GPU has 4 compute slices, not the H100's 7


def test_a_gpu_naming_a_model_the_node_does_not_publish_has_no_slot_map() -> None:
    node = gpunode("n", "t", [h100(0, [])])
    node["status"]["models"] = []
    [gpu] = view_json(build_view([node], [], []))["nodes"][0]["gpus"]
    assert (gpu["slots"], gpu["slotStates"]) == (0, [])
