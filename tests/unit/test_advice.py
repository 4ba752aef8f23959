"""Right sizes: MIG and fraction advice against the profile tables worked by hand, the advise report built from
API bodies (totals, whole-GPU equivalents, what a caller without GpuNodes gets), and USED/PEAK and the advice in
``top``. MiB figures below are NVML's memorySizeMB, copied from the catalog's comments, not computed by it."""

from __future__ import annotations

from typing import Any

import pytest

from mig_operator.core.placement.profiles import get_model
from mig_operator.core.usage.advice import Advice, advice_status, advise_fraction, advise_mig, parse_advice
from mig_operator.core.views.advise_view import build_report, render_text, report_json
from mig_operator.core.views.top_json import view_json
from mig_operator.core.views.top_view import build_view
from mig_operator.core.views.top_view import render_text as top_text

GIB = 2**30
MIB = 2**20
# H100 80GB: 1g.10gb 9984 MiB, 1g.20gb and 2g.20gb 20096, 3g.40gb and 4g.40gb 40448, 7g.80gb 81152.
H100 = get_model("h100-80gb")


def test_a_3g_40gb_peaking_at_3_gib_would_have_fit_a_1g_10gb() -> None:
    # 3 GiB + 10 % = 3379.2 MiB <= 9984 MiB; back 40448 - 9984 = 30464 MiB.
    advice = advise_mig(H100, "3g.40gb", 3 * GIB)
    assert advice == Advice("Smaller", "3g.40gb", "1g.10gb", 30464 * MIB, "peak 3.0Gi + 10% fits 1g.10gb (9.8Gi)")


def test_headroom_decides_between_neighbouring_profiles() -> None:
    # 9 GiB = 9216 MiB fits 9984 bare; + 10 % = 10137.6 MiB does not, and of the 20096 MiB profiles the one
    # with fewer compute slices (1g.20gb) comes first. Back: 40448 - 20096 = 20352 MiB.
    assert advise_mig(H100, "3g.40gb", 9 * GIB, 0.0).suggested == "1g.10gb"
    advice = advise_mig(H100, "3g.40gb", 9 * GIB)
    assert (advice.suggested, advice.memory_back) == ("1g.20gb", 20352 * MIB)


def test_a_whole_gpu_peaking_at_30_gib_would_have_fit_a_3g_40gb() -> None:
    # 30 GiB + 10 % = 33792 MiB; 3g.40gb (3 slices) before 4g.40gb (4); back 81152 - 40448 = 40704 MiB.
    advice = advise_mig(H100, "7g.80gb", 30 * GIB)
    assert (advice.verdict, advice.suggested, advice.memory_back) == ("Smaller", "3g.40gb", 40704 * MIB)


def test_the_four_slot_a30() -> None:
    # A30: 4g.24gb 24000 MiB, 1g.6gb 5952 MiB. 5 GiB + 10 % = 5632 MiB; back 18048 MiB; never the +me twin.
    advice = advise_mig(get_model("a30-24gb"), "4g.24gb", 5 * GIB)
    assert (advice.suggested, advice.memory_back) == ("1g.6gb", 18048 * MIB)


def test_nothing_to_say_when_the_profile_already_is_the_smallest_that_fits() -> None:
    assert advise_mig(H100, "1g.10gb", 1 * GIB) is None
    # 9800 MiB is below 99 % of 9984 (9884.16) but with its headroom needs a 20096 MiB profile.
    assert advise_mig(H100, "1g.10gb", 9800 * MIB) is None
    assert advise_mig(H100, "9g.99gb", 1 * GIB) is None  # not a profile of the model


def test_a_peak_at_the_limit_is_too_small() -> None:
    # 99 % of 9984 MiB is 9884.16 MiB.
    advice = advise_mig(H100, "1g.10gb", 9885 * MIB)
    assert (advice.verdict, advice.suggested, advice.memory_back) == ("TooSmall", None, 0)
    assert advise_mig(H100, "3g.40gb", 40448 * MIB).verdict == "TooSmall"


def test_fraction_advice_is_a_whole_gib() -> None:
    # 3 GiB + 10 % = 3.3 GiB -> 4 GiB; back 8 - 4 = 4 GiB.
    assert advise_fraction(8 * GIB, 3 * GIB, 0) == Advice("Smaller", "8Gi", "4Gi", 4 * GIB,
                                                          "peak 3.0Gi + 10% fits 4Gi")
    # No memory ever used: the least is 1 GiB.
    assert advise_fraction(8 * GIB, 0, 0).suggested == "1Gi"
    # A decimal limit: 8 G = 8e9 bytes; 1 GiB + 10 % -> 2 GiB; back 8e9 - 2 GiB.
    advice = advise_fraction(8 * 10**9, GIB, 0)
    assert (advice.current, advice.suggested, advice.memory_back) == ("8G", "2Gi", 8 * 10**9 - 2 * GIB)
    # 3.5 GiB + 10 % = 3.85 GiB -> 4 GiB, which is the limit: nothing to say.
    assert advise_fraction(4 * GIB, 3584 * MIB, 0) is None


def test_a_fraction_is_too_small_when_the_shim_refused_or_the_peak_reached_the_limit() -> None:
    refused = advise_fraction(8 * GIB, 2 * GIB, 3)
    assert (refused.verdict, refused.suggested, refused.memory_back) == ("TooSmall", None, 0)
    assert "refused 3 allocations" in refused.message
    # 99 % of 8 GiB is 8110.08 MiB.
    assert advise_fraction(8 * GIB, 8111 * MIB, 0).verdict == "TooSmall"
    assert advise_fraction(8 * GIB, 8110 * MIB, 0) is None  # 8921 MiB with headroom: 9 GiB > the limit


def test_advice_round_trips_through_the_status_and_junk_reads_as_none() -> None:
    smaller = advise_mig(H100, "3g.40gb", 3 * GIB)
    assert parse_advice({"advice": advice_status(smaller)}) == smaller
    too_small = advise_fraction(8 * GIB, 2 * GIB, 1)
    body = advice_status(too_small)
    assert "suggested" not in body and parse_advice({"advice": body}) == too_small
    for junk in (None, [], {"advice": []}, {"advice": {**body, "verdict": "Bigger"}},
                 {"advice": {**body, "current": "x" * 100_000}}, {"advice": {**body, "memoryBack": True}},
                 {"advice": {**body, "suggested": "4Gi"}}):  # TooSmall never suggests
        assert parse_advice(junk) is None


# ---- the advise report -----------------------------------------------------------------------------

H100_TABLE = [  # as an agent publishes it: NVML's figures for the profiles used below
    {"name": "1g.10gb", "id": 19, "slices": 1, "memoryMiB": 9984, "sm": 16,
     "placements": [{"start": s, "size": 1} for s in range(7)]},
    {"name": "3g.40gb", "id": 9, "slices": 3, "memoryMiB": 40448, "sm": 60,
     "placements": [{"start": 0, "size": 4}, {"start": 4, "size": 4}]},
    {"name": "7g.80gb", "id": 0, "slices": 7, "memoryMiB": 81152, "sm": 132, "placements": [{"start": 0, "size": 8}]},
]


def gpunodes() -> list[dict[str, Any]]:
    return [
        {"metadata": {"name": "gpu-a"}, "status": {
            "models": [{"name": "h100-80gb", "profiles": H100_TABLE}],
            "gpus": [{"index": 0, "uuid": "GPU-a0", "product": "NVIDIA H100 80GB HBM3", "model": "h100-80gb",
                      "memoryMiB": 81559, "migCapable": True, "migEnabled": True, "instances": []}]}},
        {"metadata": {"name": "l4-a"}, "status": {
            "gpus": [{"index": 0, "uuid": "GPU-l0", "product": "NVIDIA L4", "model": "", "memoryMiB": 23034}]}},
    ]


def measured(used: int, peak: int, refusals: int = 0) -> dict[str, Any]:
    return {"memoryUsed": used, "memoryPeak": peak, "processes": 1, "refusals": refusals,
            "observedAt": "2026-11-29T06:00:10Z", "lastActive": "2026-11-29T06:00:10Z"}


def gpuslice(ns: str, name: str, usage: dict | None, **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"phase": "Ready", **status}
    if usage is not None:
        body["usage"] = usage
    return {"metadata": {"namespace": ns, "name": name, "uid": f"u-{name}"}, "status": body}


def mig(profile: str, granted_mib: int) -> dict[str, Any]:
    return {"mode": "mig", "node": "gpu-a", "gpu": 0, "profile": profile, "grantedBytes": granted_mib * MIB,
            "placement": {"start": 0, "size": 4}}


def fraction(limit: int) -> dict[str, Any]:
    return {"mode": "fraction", "node": "l4-a", "gpu": 0, "grantedBytes": limit}


def slices() -> list[dict[str, Any]]:
    return [
        gpuslice("team-b", "train", measured(GIB, 3 * GIB), **mig("3g.40gb", 40448)),
        gpuslice("team-a", "infer", measured(GIB, 3 * GIB), **fraction(8 * GIB)),
        gpuslice("team-a", "full", measured(0, 2 * GIB, refusals=2), **fraction(4 * GIB)),
        gpuslice("team-a", "fits", measured(0, 9 * GIB), **mig("1g.10gb", 9984)),  # 9 GiB + 10 %: no smaller
        gpuslice("team-a", "new", None, **mig("3g.40gb", 40448)),  # no usage yet
    ]


def test_the_report_lists_the_advised_slices_with_totals_and_whole_gpus() -> None:
    out = report_json(build_report(slices(), gpunodes()))
    assert out["slices"] == [
        {"namespace": "team-a", "name": "full", "node": "l4-a", "mode": "fraction", "current": "4Gi",
         "peak": 2 * GIB, "verdict": "TooSmall", "suggested": None, "memoryBack": 0,
         "message": "the shim refused 2 allocations at the limit 4.0Gi"},
        {"namespace": "team-a", "name": "infer", "node": "l4-a", "mode": "fraction", "current": "8Gi",
         "peak": 3 * GIB, "verdict": "Smaller", "suggested": "4Gi", "memoryBack": 4 * GIB,
         "message": "peak 3.0Gi + 10% fits 4Gi"},
        {"namespace": "team-b", "name": "train", "node": "gpu-a", "mode": "mig", "current": "3g.40gb",
         "peak": 3 * GIB, "verdict": "Smaller", "suggested": "1g.10gb", "memoryBack": 30464 * MIB,
         "message": "peak 3.0Gi + 10% fits 1g.10gb (9.8Gi)"},
    ]
    # 4 GiB of an L4's 23034 MiB, plus 30464 MiB of an H100's 81559 MiB.
    whole = 4096 / 23034 + 30464 / 81559
    assert out["totals"] == {"memoryBack": 4 * GIB + 30464 * MIB, "wholeGpus": round(whole, 3)}


def test_the_headroom_given_is_used_not_the_agents_advice() -> None:
    body = slices()[0]
    body["status"]["usage"]["advice"] = advice_status(advise_mig(H100, "3g.40gb", 40448 * MIB))  # TooSmall, stale
    # 3 GiB + 100 % = 6 GiB still fits 1g.10gb (9984 MiB).
    out = report_json(build_report([body], gpunodes(), headroom=1.0))
    assert [(s["verdict"], s["suggested"]) for s in out["slices"]] == [("Smaller", "1g.10gb")]
    assert out["slices"][0]["message"] == "peak 3.0Gi + 100% fits 1g.10gb (9.8Gi)"


def test_without_gpunodes_a_mig_slice_is_advised_from_its_profile_and_grant() -> None:
    # 3g.40gb of 40448 MiB is an H100 80GB's (an A100 80GB's 3g.40gb holds 40192 MiB).
    report = build_report(slices()[:2], None)
    out = report_json(report)
    assert [(s["name"], s["suggested"]) for s in out["slices"]] == [("infer", "4Gi"), ("train", "1g.10gb")]
    # Whole GPUs: the H100 from the catalog (81559 MiB); the L4's memory is not known, so it counts none.
    assert out["totals"]["wholeGpus"] == round(30464 / 81559, 3)
    assert any("whole GPUs" in note for note in report.notes)


def test_without_gpunodes_an_ambiguous_profile_is_skipped_with_a_note() -> None:
    # 1g.10gb of 9984 MiB is both an H100 80GB's 1g.10gb and an A100 40GB's 1g.10gb (its 2-slot one).
    report = build_report([gpuslice("team-a", "x", measured(0, GIB), **mig("1g.10gb", 9984))], None)
    assert report.rows == () and report.measured == 1
    assert report.notes == ("1 MIG slice(s) not advised: their GPU's model is not known (the GpuNodes cannot be "
                            "read)",)


def test_the_text_has_a_line_per_slice_and_a_total() -> None:
    lines = render_text(build_report(slices(), gpunodes())).splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "NODE", "MODE", "CURRENT", "PEAK", "ADVICE", "BACK", "WHY"]
    assert lines[1].split()[:8] == ["team-a", "full", "l4-a", "fraction", "4Gi", "2.0Gi", "too", "small"]
    assert lines[3].split()[:8] == ["team-b", "train", "gpu-a", "mig", "3g.40gb", "3.0Gi", "->", "1g.10gb"]
    assert lines[-1] == "total: 33.8Gi back, 0.55 whole GPU(s); 2 slice(s) smaller, 1 too small, of 4 measured"
    assert render_text(build_report([], [])).splitlines()[0].startswith("no slice has usage figures yet")


# ---- top -------------------------------------------------------------------------------------------


def test_top_shows_used_and_peak_and_the_advice_and_its_json_the_usage() -> None:
    nodes = gpunodes()
    nodes[0]["status"]["gpus"][0]["instances"] = [
        {"giId": 1, "ciId": 0, "profileId": 9, "profile": "3g.40gb", "start": 0, "size": 4, "sliceUID": "u-train",
         "slice": "team-b/train", "deviceUUID": "MIG-1"},
        {"giId": 2, "ciId": 0, "profileId": 9, "profile": "3g.40gb", "start": 4, "size": 4, "sliceUID": "u-other",
         "slice": "team-b/other", "deviceUUID": "MIG-2"}]
    train = gpuslice("team-b", "train", measured(GIB, 3 * GIB), **mig("3g.40gb", 40448))
    train["status"]["usage"]["advice"] = advice_status(advise_mig(H100, "3g.40gb", 3 * GIB))
    other = gpuslice("team-b", "other", None, **mig("3g.40gb", 40448))
    view = build_view(nodes, [train, other], [])
    rows = [line for line in top_text(view, 100).splitlines() if "team-b/" in line]
    assert rows[0].split()[-3:] == ["1.0Gi/3.0Gi", "->1g.10gb", "team-b/train"]
    assert rows[1].split()[-2:] == ["-", "team-b/other"]
    instances = view_json(view)["nodes"][0]["gpus"][0]["instances"]
    assert instances[0]["usage"]["memoryUsed"] == GIB and instances[0]["usage"]["memoryPeak"] == 3 * GIB
    assert instances[0]["usage"]["advice"]["suggested"] == "1g.10gb"
    assert instances[1]["usage"] is None


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_top_with_usage_keeps_to_the_width(width: int) -> None:
    nodes = gpunodes()
    nodes[1]["status"]["gpus"][0]["fractions"] = [{"slice": "team-a/infer", "sliceUID": "u-infer", "bytes": 8 * GIB}]
    view = build_view(nodes, [gpuslice("team-a", "infer", measured(GIB, 3 * GIB), **fraction(8 * GIB))], [])
    assert max(len(line) for line in top_text(view, width).splitlines()) <= width
