"""`mig-operator top` fits the terminal: no line longer than the width (60 at least), sentences wrapped
whole, the slot map's cells narrowed only when 7 columns a slot do not fit; COLUMNS is honoured."""

from __future__ import annotations

import re
from typing import Any

import pytest
from test_top import GOLDEN, gpunode, gpuslice, h100, instance, layout

from mig_operator.cli import main
from mig_operator.core.views.top_view import build_view, render_text

MAP_INDENT = 10


def words(text: str) -> list[str]:
    return text.split()


def written(text: str) -> list[str]:
    """The words of a picture but its drawings (slot numbers and maps, memory bars), whose columns differ by width."""
    drawings = ("    slot", "    memory |", MAP_INDENT * " " + "[", MAP_INDENT * " " + " ")
    return words("\n".join(line for line in text.splitlines() if not line.startswith(drawings)))


@pytest.mark.parametrize("width", [60, 100, 200])
def test_no_line_is_longer_than_the_width_and_no_word_of_a_sentence_is_lost(width: int) -> None:
    text = render_text(build_view(*layout()), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    # Nothing is cut, and every word of the 100-column picture is there, in order, at any width; at 60
    # the quota table has its short headings (the golden picture's headings line aside).
    assert not any(line.endswith("...") and not line.endswith(".|") for line in lines)
    headings = "  namespace  memory used / hard    %  slices used / hard  waiting  whole GPUs"
    expected = GOLDEN if width > 60 else GOLDEN.replace(headings, "  namespace memory % slices waiting whole")
    assert written(text) == written(expected)
    for needle in ("team-a/train", "team-b/nb", "team-b/new", "team-c/big", "team-a/infer", "team-c/dev",
                   "NoCapacity 2", "QuotaExceeded 1", "4 in use, 1 creating, 2 idle, 1 free"):
        assert needle in " ".join(" ".join(lines).split()), (width, needle)


def test_at_100_and_200_the_picture_is_the_golden_one() -> None:
    view = build_view(*layout())
    assert render_text(view, 100) == render_text(view) == GOLDEN
    assert render_text(view, 200) == GOLDEN  # nothing in it is wider than 100: nothing changes


def test_at_60_the_slot_map_narrows_its_cells_and_keeps_every_box_over_its_slots() -> None:
    lines = render_text(build_view(*layout()), 60).splitlines()
    cell = (60 - MAP_INDENT) // 8  # 8 slots in 50 columns: 6 a slot
    header = next(line for line in lines if line.startswith("    slot"))
    assert header == ("    slot  " + "".join(str(i).center(cell) for i in range(8))).rstrip()
    slot_map = lines[lines.index(header) + 1]
    # Boxes computed here from the layout's placements: A {0}:4, B {4}:2, C {6}:1; slot 7 free.
    for label, start, size in (("A", 0, 4), ("B", 4, 2), ("C", 6, 1)):
        left, right = MAP_INDENT + cell * start, MAP_INDENT + cell * (start + size) - 1
        assert slot_map[left:left + 2] == "[" + label and slot_map[right] == "]", (label, slot_map)
    assert slot_map[MAP_INDENT + cell * 7:].strip() == "."
    bar = next(line for line in lines if line.startswith("    memory |"))
    assert len(bar) <= 60 and bar.endswith("|")


def test_a_long_name_is_cut_at_100_and_whole_at_200() -> None:
    ref = "n" * 40 + "/" + "s" * 100
    gpu = h100(0, [instance("1g.10gb", 0, 1, ref, "u")])
    view = build_view([gpunode("node-1", "t", [gpu])], [gpuslice(ref, "u", "Ready")], [])
    assert not any(ref in line for line in render_text(view, 100).splitlines())
    assert any(line.endswith(ref) for line in render_text(view, 200).splitlines())


def test_a_long_sentence_wraps_under_its_indent() -> None:
    reason = "MIG mode is enabled but the node is not labelled cdmo.clear.ml/gpu-partitioning=mig: " * 2
    gpu = h100(0, []) | {"serves": "none", "servesReason": reason.strip()}
    lines = render_text(build_view([gpunode("n", "t", [gpu])], [], []), 60).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("      takes no new slices: "))
    wrapped = [lines[at]] + [line for line in lines[at + 1:] if line.startswith("          ") and line.strip()]
    assert len(wrapped) > 1 and all(len(line) <= 60 for line in wrapped)
    assert words(" ".join(wrapped)) == words("takes no new slices: " + reason)


@pytest.mark.parametrize(("columns", "widest"), [("70", 70), ("30", 60), ("200", 100)])
def test_top_reads_the_width_from_columns(columns: str, widest: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from mig_operator.kube import top as kube_top

    async def read_view(client: Any, *_: Any) -> Any:
        return build_view(*layout())

    config = tmp_path / "kubeconfig"
    config.write_text(re.sub(r"\s+", " ", """{"apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}"""))
    monkeypatch.setattr(kube_top, "read_view", read_view)
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["top", "--kubeconfig", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= max(int(columns), 60)
    # The golden picture's widest line is 99 columns: at 200 it is drawn as at 100.
    assert max(len(line) for line in lines) <= widest
    if columns == "200":
        assert "\n".join(lines) + "\n" == GOLDEN
