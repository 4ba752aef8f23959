import json
import subprocess
import sys
from pathlib import Path

import pytest

from mig_operator.cli import main
from mig_operator.core.profiles import CATALOG


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_trace(tmp_path: Path, events: object) -> str:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    return str(path)


def test_catalog_json_shape(capsys) -> None:
    code, out, _ = run(capsys, "catalog", "h200-141gb", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["model"] == "h200-141gb" and data["memory_slots"] == 8
    first = data["profiles"][0]
    assert set(first) == {"name", "id", "slices", "memory_mib", "sm", "max_instances", "placements"}
    by_name = {p["name"]: p for p in data["profiles"]}
    assert by_name["1g.35gb"]["placements"] == [[0, 2], [2, 2], [4, 2], [6, 2]]
    assert by_name["7g.141gb"] == {
        "name": "7g.141gb", "id": 0, "slices": 7, "memory_mib": 143360, "sm": 132, "max_instances": 1,
        "placements": [[0, 8]],
    }


def test_catalog_lists_every_model(capsys) -> None:
    code, out, _ = run(capsys, "catalog")
    assert code == 0
    for name in CATALOG:
        assert name in out


def test_plan_17G_and_17Gi_on_h200(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path, [
        {"op": "alloc", "id": "a", "memory": "17G"},
        {"op": "alloc", "id": "b", "memory": "17Gi"},
    ])
    code, out, _ = run(capsys, "plan", "--gpu", "h200-141gb", "--trace", trace, "--json")
    assert code == 0
    a, b = json.loads(out)
    assert (a["profile"], a["profile_id"], a["action"]) == ("1g.18gb", 19, "create")
    assert (b["profile"], b["profile_id"]) == ("1g.35gb", 15)
    assert set(a) == {"id", "gpu", "profile", "profile_id", "start", "size", "action", "reclaimed"}


def test_plan_lazy_reuse_versus_eager(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path, [
        {"op": "alloc", "id": "a", "memory": "4G"},
        {"op": "free", "id": "a"},
        {"op": "alloc", "id": "b", "memory": "4G"},
    ])
    _, out, _ = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", trace, "--json")
    assert [r["action"] for r in json.loads(out)] == ["create", "reuse"]
    _, out, _ = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", trace, "--json", "--eager")
    assert [r["action"] for r in json.loads(out)] == ["create", "create"]


def test_plan_reports_reclaim_and_refusal(tmp_path, capsys) -> None:
    events = [{"op": "alloc", "id": f"s{i}", "profile": "1g.10gb"} for i in range(7)]
    events += [{"op": "free", "id": f"s{i}"} for i in range(7)]
    events += [{"op": "alloc", "id": "big", "profile": "7g.80gb"}, {"op": "alloc", "id": "more", "memory": "1G"}]
    code, out, _ = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", write_trace(tmp_path, events), "--json")
    assert code == 0
    results = json.loads(out)
    big = results[7]
    assert big["action"] == "create" and len(big["reclaimed"]) == 7
    assert {r["start"] for r in big["reclaimed"]} == set(range(7))
    assert "held by slices in use" in results[8]["error"]


def test_plan_text_output(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path, [{"op": "alloc", "id": "a", "memory": "900G"}])
    code, out, _ = run(capsys, "plan", "--gpu", "a30-24gb", "--trace", trace)
    assert code == 0 and "a: refused: memory 900G" in out


@pytest.mark.parametrize(
    ("events", "fragment"),
    [
        ({"op": "alloc"}, "JSON list"),
        ([{"op": "grow", "id": "a"}], "op 'grow'"),
        ([{"op": "alloc", "id": "a", "memory": "4X"}], "memory '4X'"),
        ([{"op": "alloc", "id": "a", "memory": "4G", "fraction": 0.5}], "exactly one"),
        ([{"op": "alloc", "id": "a", "fraction": 2}], "fraction 2"),
        ([{"op": "alloc", "id": "a", "profile": "big"}], "migProfile 'big'"),
        ([{"op": "free", "id": "ghost"}], "never allocated"),
        ([{"op": "alloc", "id": "a", "memory": "1G"}, {"op": "alloc", "id": "a", "memory": "1G"}], "again"),
        ([{"op": "alloc", "memory": "1G"}], "'id'"),
        ([{"op": "alloc", "id": "a", "memory": "1G", "colour": "red"}], "unknown fields"),
    ],
)
def test_malformed_traces_exit_2_with_one_line(tmp_path, capsys, events, fragment) -> None:
    code, out, err = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", write_trace(tmp_path, events))
    assert code == 2
    assert out == ""
    assert fragment in err
    assert err.count("\n") == 1


def test_bad_model_missing_file_and_bad_json_exit_2(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "catalog", "b300")
    assert code == 2 and "unknown GPU model 'b300'" in err
    code, _, err = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read trace" in err
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    code, _, err = run(capsys, "plan", "--gpu", "h100-80gb", "--trace", str(bad))
    assert code == 2 and "not JSON" in err
    code, _, err = run(capsys, "plan", "--gpu", "h100-80gb", "--gpus", "0", "--trace", str(bad))
    assert code == 2 and "--gpus 0" in err


def test_console_entry_point_never_prints_a_traceback(tmp_path) -> None:
    trace = write_trace(tmp_path, [{"op": "alloc", "id": "a", "memory": "-1G"}])
    proc = subprocess.run(
        [sys.executable, "-m", "mig_operator.cli", "plan", "--gpu", "h200-141gb", "--trace", trace],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "memory '-1G' must be greater than zero" in proc.stderr


def test_demo_realises_the_plan_and_survives_a_restart(tmp_path, capsys) -> None:
    state = tmp_path / "state.json"
    code, out, _ = run(capsys, "demo", "--backend", "sim:h200-141gbx2", "--trace", "examples/trace-h200.json",
                       "--state-file", str(state))
    assert code == 0
    assert "notebook-c: memory 10G -> reuse 1g.18gb on GPU 0 at {0}:1" in out
    assert "too-big: memory 200G stays Pending" in out
    restart = out.split("after a restart")[1]
    # trainer 3g, notebook-b 1g.35gb, notebook-c's 1g.18gb on GPU 0; inference 2g.35gb on GPU 1.
    assert restart.count("MIG-") == 4
    data = json.loads(state.read_text())
    assert data, "the simulator kept its state in the file"


def test_demo_bad_backend_exits_2(capsys) -> None:
    code, _, err = run(capsys, "demo", "--backend", "sim:h900")
    assert code == 2 and "sim:h900" in err


def test_nvml_failure_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    code, out, err = run(capsys, "inspect", "--backend", "nvml")
    assert code == 1 and out == ""
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in err and "initialise NVML" in err
    assert err.count("\n") == 1
