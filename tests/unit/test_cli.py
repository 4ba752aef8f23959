import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mig_operator.cli import main
from mig_operator.cli.offline import MAX_PLAN_GPUS
from mig_operator.core.placement.profiles import CATALOG


def cli(*argv: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    """The command as a user runs it: a new process, so tracebacks and exit codes are real."""
    return subprocess.run([sys.executable, "-m", "mig_operator.cli", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and len(proc.stderr) < 500, proc.stderr[:600]
    assert fragment in proc.stderr, proc.stderr


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
    assert "l40s-48gb (NVIDIA L40S): 46068 MiB, no MIG" in out
    code, out, _ = run(capsys, "catalog", "--json")
    by_name = {m["model"]: m for m in json.loads(out)}
    assert set(by_name) == set(CATALOG)
    assert by_name["t4-16gb"] == {"model": "t4-16gb", "product": "Tesla T4", "memory_slots": 0,
                                  "memory_mib": 15360, "profiles": []}


def test_catalog_a100_40gb_2g_10gb_is_9_75_gib(capsys) -> None:
    _, out, _ = run(capsys, "catalog", "a100-40gb", "--json")
    by_name = {p["name"]: p for p in json.loads(out)["profiles"]}
    assert by_name["1g.10gb"]["memory_mib"] == by_name["2g.10gb"]["memory_mib"] == int(9.75 * 1024)


def test_inspect_gpus_without_mig(capsys) -> None:
    code, out, _ = run(capsys, "inspect", "--backend", "sim:l4-24gbx2", "--json")
    assert code == 0
    gpus = json.loads(out)["gpus"]
    assert [(g["product"], g["model"], g["mig_capable"], g["mig_enabled"], g["profiles"], g["instances"])
            for g in gpus] == [("NVIDIA L4", "l4-24gb", False, False, [], [])] * 2
    code, out, _ = run(capsys, "inspect", "--backend", "sim:l40s-48gb")
    assert code == 0 and out.startswith("GPU 0: NVIDIA L40S (l40s-48gb), 46068 MiB, no MIG, GPU-")


def test_plan_and_demo_refuse_gpus_without_mig(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path, [{"op": "alloc", "id": "a", "memory": "4G"}])
    code, out, err = run(capsys, "plan", "--gpu", "l4-24gb", "--trace", trace)
    assert code == 2 and out == "" and "l4-24gb (NVIDIA L4) has no MIG" in err and "--gpu h200-141gb" in err
    code, out, err = run(capsys, "demo", "--backend", "sim:t4-16gb", "--trace", trace,
                         "--state-file", str(tmp_path / "s.json"))
    assert code == 2 and out == "" and "no GPU in MIG mode" in err


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
    events += [{"op": "alloc", "id": "big", "profile": "7g.80gb"}, {"op": "alloc", "id": "more", "memory": "2G"}]
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


@pytest.mark.parametrize("count", ["0", "1000000000", "4097", "-1", " 2", "2_0", "\uff12", "2.0", "9" * 5000, ""])
def test_gpus_is_capped_and_checked_as_text(tmp_path, capsys, count: str) -> None:
    trace = write_trace(tmp_path, [{"op": "alloc", "id": "a", "memory": "4G"}])
    code, out, err = run(capsys, "plan", "--gpu", "h100-80gb", "--gpus", count, "--trace", trace)
    assert code == 2 and out == ""
    assert f"from 1 to {MAX_PLAN_GPUS}" in err and err.count("\n") == 1 and len(err) < 300


def test_gpus_at_the_cap_is_accepted(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path, [{"op": "alloc", "id": "a", "memory": "4G"}])
    code, out, _ = run(capsys, "plan", "--gpu", "h100-80gb", "--gpus", str(MAX_PLAN_GPUS), "--trace", trace, "--json")
    assert code == 0 and json.loads(out)[0]["profile"] == "1g.10gb"


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\x00\xff\xfe\x80binary" * 10, "is not UTF-8 text"),
        ('[{"op": "free", "id": "x"}]'.encode("utf-16"), "is not UTF-8 text"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b'[{"op": "alloc", "id": "a", "memory": ' + b"1" * 5001 + b"}]", "holds a number too long"),
        (b'[{"op": "alloc", "id": "a", "memory": ' + b"1" * 4000 + b"}]", "(4000 digits) is larger than 2^63-1"),
        (b'[{"op": "alloc", "id": "a", "memory": "' + b"1" * 5000 + b'"}]', "(5000 characters) is larger"),
        (b'[{"op": "alloc", "id": "' + b"i" * 5000 + b'", "memory": "4X"}]', "has an unknown unit"),
        (b'[{"op": "alloc", "id": "a", "fraction": "0.2_5"}]', "fraction '0.2_5' is not a number"),
        (b'[{"op": "alloc", "id": "a", "profile": "' + b"x" * 5000 + b'"}]', "is not a MIG profile name"),
        (b'[{"op": "' + b"o" * 5000 + b'", "id": "a"}]', "has op 'ooo"),
    ],
    # Short ids: a test's id is in its environment (PYTEST_CURRENT_TEST), and one string there may not
    # pass 128 KiB or no subprocess starts.
    ids=lambda value: value if isinstance(value, str) else f"{len(value)}-bytes",
)
def test_hostile_traces_exit_2_with_one_short_line(tmp_path, content: bytes, fragment: str) -> None:
    trace = _write(tmp_path, "t.json", content)
    assert_one_line_error(cli("plan", "--gpu", "h200-141gb", "--trace", trace), 2, fragment)


def test_an_endless_trace_is_cut_off(tmp_path) -> None:
    assert_one_line_error(cli("plan", "--gpu", "h200-141gb", "--trace", "/dev/zero"), 2, "larger than 16 MiB")


@pytest.mark.parametrize(
    ("state", "fragment"),
    [("/dev/null", "'/dev/null' exists and is not a regular file"),
     ("{tmp}/missing/s.json", "does not exist"),
     ("{tmp}", "is not a regular file")],
)
def test_unusable_state_files_exit_2_and_create_nothing(tmp_path, state: str, fragment: str) -> None:
    lock_existed = os.path.exists("/dev/null.lock")
    proc = cli("inspect", "--backend", "sim:h200-141gb", "--state-file", state.format(tmp=tmp_path))
    assert_one_line_error(proc, 2, fragment)
    assert os.path.exists("/dev/null.lock") == lock_existed
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_state_file_is_a_gpu_error_in_one_line(tmp_path) -> None:
    state = _write(tmp_path, "s.json", b'{"version": 1, "model": "h200-141gb", "gpus": [{"instances": 3}]}')
    assert_one_line_error(cli("inspect", "--backend", "sim:h200-141gb", "--state-file", state), 1, "is not usable")


def test_a_closed_pipe_ends_catalog_quietly() -> None:
    # A pipe nobody reads: the first write fails, as `catalog | head -1` does once head has its line.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = cli("catalog", stdout=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == ""


def test_argparse_errors_are_one_line(tmp_path) -> None:
    proc = cli("plan", "--gpu", "h200-141gb", "--trace", "x", "--bogus", "b" * 5000)
    assert_one_line_error(proc, 2, "unrecognized arguments")
    assert_one_line_error(cli("plan"), 2, "the following arguments are required")


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
    # The state file holds what the restarted backend listed: the layout above, by profile id (H200:
    # 9 = 3g.71gb, 15 = 1g.35gb, 19 = 1g.18gb, 14 = 2g.35gb), each with its compute instance.
    assert data["model"] == "h200-141gb"
    assert [sorted((i["profile_id"], i["start"], i["ci_id"]) for i in g["instances"]) for g in data["gpus"]] == [
        [(9, 4, 0), (15, 2, 0), (19, 0, 0)],
        [(14, 0, 0)],
    ]


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


@pytest.mark.parametrize("part", [["controller"], ["agent", "--node", "n1", "--backend", "sim:h100-80gb"]])
@pytest.mark.parametrize("kubeconfig", ["missing", "broken", "directory"])
def test_operator_parts_without_usable_credentials_exit_with_one_line(tmp_path, part: list[str],
                                                                      kubeconfig: str) -> None:
    # Without this check kopf retries its start-up handler for ever, printing a traceback each time.
    path = {"missing": tmp_path / "nowhere" / "config", "broken": tmp_path / "config",
            "directory": tmp_path}[kubeconfig]
    if kubeconfig == "broken":
        path.write_text("clusters: [\n")
    extra = ["--state-file", str(tmp_path / "sim.json")] if part[0] == "agent" else []
    done = subprocess.run([sys.executable, "-m", "mig_operator.cli", *part, *extra, "--kubeconfig", str(path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "KUBECONFIG": ""})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("mig-operator: no usable Kubernetes credentials from --kubeconfig")
    assert repr(str(path)) in lines[0] and "e.g. --kubeconfig ~/.kube/config" in lines[0]


# ---- start-up robustness (issue 19): every bad value is one line and exit 2, before kopf starts --------


def unreachable_kubeconfig(tmp_path: Path) -> Path:
    """Credentials that load but lead nowhere: a value check that waited for kopf would never end."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    return path


def part(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mig-operator controller|agent ...`` against an unreachable API server; a part that starts
    instead of refusing runs into the time-out, which fails the test."""
    extra = ["--state-file", str(tmp_path / "sim.json")] if argv[0] == "agent" else []
    try:
        return subprocess.run([sys.executable, "-m", "mig_operator.cli", *argv, *extra,
                               "--kubeconfig", str(unreachable_kubeconfig(tmp_path))],
                              capture_output=True, text=True, timeout=20, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} was still running after 20 s instead of refusing: {exc.stderr!r:.300}")


@pytest.mark.parametrize(("argv", "fragments"), [
    (["agent", "--node", ""], ["--node '' is not a node name", "use e.g. --node gpu-node-1"]),
    (["agent", "--node", "Bad_Node!"], ["--node 'Bad_Node!' is not a node name", "use e.g. --node gpu-node-1"]),
    (["agent", "--node", "n" * 254], ["is not a node name", "at most 253 characters"]),
    (["controller", "--peering", "Bad Peering"], ["--peering 'Bad Peering' is not a peering name",
                                                  "use e.g. --peering mig-operator"]),
    (["controller", "--peering", ""], ["--peering '' is not a peering name"]),
])
def test_bad_names_exit_2_before_kopf_starts(tmp_path, argv: list[str], fragments: list[str]) -> None:
    proc = part(tmp_path, *argv, "--backend", "sim:h100-80gb") if argv[0] == "agent" else part(tmp_path, *argv)
    assert_one_line_error(proc, 2, fragments[0])
    for fragment in fragments[1:]:
        assert fragment in proc.stderr


def test_names_at_the_length_limit_pass_the_name_check() -> None:
    from mig_operator.cli.flags import dns_label as _dns_label
    from mig_operator.cli.flags import dns_subdomain as _dns_subdomain

    assert _dns_subdomain("--node", "n" * 253, "x", "node name") == "n" * 253
    assert _dns_subdomain("--node", "gpu-node-1.example", "x", "node name") == "gpu-node-1.example"
    assert _dns_label("--namespace", "a" * 63, "x", "namespace") == "a" * 63
    with pytest.raises(Exception, match="at most 63"):
        _dns_label("--namespace", "a" * 64, "x", "namespace")


def _pem_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    from mig_operator.kube.webhook.certs import make_certificate

    bundle = make_certificate(["127.0.0.1"])
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert.write_bytes(bundle.cert_pem)
    key.write_bytes(bundle.key_pem)
    return cert, key


def test_webhook_certificate_files_are_checked_before_kopf_starts(tmp_path) -> None:
    cert, key = _pem_pair(tmp_path, "a")
    other_cert, other_key = _pem_pair(tmp_path, "b")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        (["/nope.pem", str(key)], "--webhook-cert '/nope.pem': cannot read the certificate: No such file"),
        ([str(cert), "/nope.key"], "--webhook-key '/nope.key': cannot read the private key: No such file"),
        ([str(garbage), str(key)], f"--webhook-cert {str(garbage)!r} holds no PEM certificate"),
        ([str(cert), str(garbage)], f"--webhook-key {str(garbage)!r} holds no PEM private key"),
        ([str(cert), str(cert)], f"--webhook-key {str(cert)!r} holds no PEM private key"),
        ([str(cert), str(other_key)], f"--webhook-key {str(other_key)!r} is not the key of --webhook-cert"),
    ]
    for (cert_arg, key_arg), fragment in cases:
        proc = part(tmp_path, "controller", "--webhook", "127.0.0.1:9443", "--webhook-cert", cert_arg,
                    "--webhook-key", key_arg)
        assert_one_line_error(proc, 2, fragment)
        assert "e.g. --webhook-" in proc.stderr


def test_a_matching_certificate_pair_passes_the_check(tmp_path) -> None:
    from mig_operator.kube.webhook.certs import check_pem_pair

    cert, key = _pem_pair(tmp_path, "a")
    assert check_pem_pair(str(cert), str(key)) is None


def _listening(reuse_port: bool) -> socket.socket:
    sock = socket.socket()
    if reuse_port:  # as kopf's own webhook server binds, which let two controllers share a port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("reuse_port", [False, True])
def test_ports_in_use_and_foreign_addresses_exit_2(tmp_path, reuse_port: bool) -> None:
    with _listening(reuse_port) as taken:
        port = taken.getsockname()[1]
        proc = part(tmp_path, "controller", "--metrics-address", f"127.0.0.1:{port}")
        assert_one_line_error(proc, 2, f"--metrics-address '127.0.0.1:{port}' cannot be listened on: port {port} "
                                       "is in use")
        proc = part(tmp_path, "controller", "--webhook", f"127.0.0.1:{port}")
        assert_one_line_error(proc, 2, f"--webhook '127.0.0.1:{port}' cannot be listened on: port {port} is in use")
    # 192.0.2.0/24 is reserved for documentation (RFC 5737): never an address of this host.
    proc = part(tmp_path, "controller", "--webhook", "192.0.2.1:9443")
    assert_one_line_error(proc, 2, "--webhook '192.0.2.1:9443' cannot be listened on: 192.0.2.1 is not an address "
                                   "of this host; use e.g. --webhook 127.0.0.1:9443")


def test_the_webhook_socket_holds_its_port_against_a_reuse_port_bind() -> None:
    from mig_operator.kube.common.listen import ListenError, listen

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    held = listen("--webhook", f"127.0.0.1:{port}", "127.0.0.1:9443")
    try:
        with pytest.raises(ListenError, match="in use"):
            listen("--webhook", f"127.0.0.1:{port}", "127.0.0.1:9443")
        with socket.socket() as other, pytest.raises(OSError):
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            other.bind(("127.0.0.1", port))
    finally:
        held.close()


@pytest.mark.parametrize("argv", [["--idle-timeout", "-1s"], ["--idle-timeout=-1s"], ["--idle-timeout", "-5"]])
def test_a_negative_idle_timeout_is_named_not_taken_for_a_flag(tmp_path, argv: list[str]) -> None:
    value = argv[-1].removeprefix("--idle-timeout=")
    proc = part(tmp_path, "agent", "--node", "n1", "--backend", "sim:h100-80gb", *argv)
    assert_one_line_error(proc, 2, f"--idle-timeout {value!r} is negative")
    assert "e.g. --idle-timeout 10m" in proc.stderr


def test_a_bad_idle_timeout_names_the_flag(tmp_path) -> None:
    proc = part(tmp_path, "agent", "--node", "n1", "--backend", "sim:h100-80gb", "--idle-timeout", "soon")
    assert_one_line_error(proc, 2, "--idle-timeout: duration 'soon' is not a duration")


@pytest.mark.parametrize("value", ["-5", "0", "3601", "ten", "1.5", ""])
def test_peering_lifetime_out_of_range_exits_2(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--peering-lifetime", value)
    assert_one_line_error(proc, 2, f"--peering-lifetime {value!r} must be a whole number of seconds from 1 to 3600")
    assert "e.g. --peering-lifetime 10" in proc.stderr


def test_peering_lifetime_bounds_are_accepted() -> None:
    from mig_operator.cli.flags import peering_lifetime as _peering_lifetime

    assert [_peering_lifetime(v) for v in ("1", "10", "3600")] == [1, 10, 3600]


@pytest.mark.parametrize("value", ["garbage", "ns/", "/svc", "ns/svc:", "ns/svc:0", "ns/svc:65536", "ns/svc:http",
                                   "Ns/svc", "ns/9svc", "ns/svc/x", "a" * 64 + "/svc", "ns/" + "s" * 64])
def test_webhook_service_must_be_namespace_name_port(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--webhook", "127.0.0.1:9443", "--webhook-service", value)
    assert_one_line_error(proc, 2, "is not NAMESPACE/NAME[:PORT]")
    assert repr(value[:60] + ("…" if len(value) > 60 else "")) in proc.stderr
    assert "e.g. --webhook-service mig-operator/mig-operator-webhook:443" in proc.stderr


@pytest.mark.parametrize("value", ["mig-operator/mig-operator-webhook", "ns/svc:1", "ns/svc:65535",
                                   "a" * 63 + "/" + "s" * 63 + ":443"])
def test_valid_webhook_services_are_accepted(value: str) -> None:
    from mig_operator.cli.flags import webhook_service as _webhook_service

    assert _webhook_service(value) == value


def test_demo_leaves_no_temporary_directory(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, out, _ = run(capsys, "demo")
    assert code == 0 and "removed at exit" in out
    assert list(tmp_path.iterdir()) == []


def test_demo_stopped_by_sigterm_removes_its_temporary_directory(tmp_path, monkeypatch, capsys) -> None:
    import signal

    from mig_operator.kube.agent import direct

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    realise = direct.realise_decision
    seen: list[list[Path]] = []

    def realise_then_stop(*args, **kwargs):
        made = realise(*args, **kwargs)
        seen.append(list(tmp_path.iterdir()))  # the directory exists while the demo runs
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    monkeypatch.setattr(direct, "realise_decision", realise_then_stop)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        main(["demo"])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert len(seen) == 1 and [p.name.startswith("mig-demo-") for p in seen[0]] == [True]
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before


def test_demo_explains_the_placement_notation_where_it_first_appears(capsys) -> None:
    code, out, _ = run(capsys, "demo", "--backend", "sim:h200-141gbx2")
    assert code == 0
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(r" at \{\d+\}:\d+", line))
    start, size = map(int, re.search(r" at \{(\d+)\}:(\d+)", lines[first]).groups())
    note = lines[first + 1]
    slots = CATALOG["h200-141gb"].memory_slots
    assert note.strip().startswith(f"({{{start}}}:{size} is where the instance sits on its GPU: {size} of the "
                                   f"GPU's {slots} memory slots")
    assert "the number in braces is the first slot, the one after ':' how many" in note
    assert sum("is where the instance sits" in line for line in lines) == 1  # said once


def test_inspect_without_nvml_points_to_the_simulator(monkeypatch, capsys) -> None:
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    code, out, err = run(capsys, "inspect")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in err
    assert err.rstrip().endswith("try the simulator: mig-operator inspect --backend sim:h100-80gb")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from mig_operator.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommands_help_shows_its_defaults(command: str) -> None:
    # COLUMNS wide: argparse wraps help to the terminal, and a wrap may split "(default: ...)".
    shown = subprocess.run([sys.executable, "-m", "mig_operator.cli", command, "--help"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "400"}, check=True).stdout
    options = [a for a in _subcommands()[command]._actions
               if a.option_strings and a.default not in (None, argparse.SUPPRESS) and a.default is not False]
    # One block per option: its line, and its help on the lines below when the option is long.
    blocks = [" ".join(block.split()) for block in re.split(r"\n(?=  -)", shown)]
    for action in options:
        block = next(b for b in blocks if b.startswith(action.option_strings[0] + " "))
        assert f"(default: {action.default})" in block or f"(default {action.default})" in block, block
    if command in ("controller", "agent", "demo", "inspect"):
        assert options  # these have defaults to show, so the loop above checked something


@pytest.mark.parametrize("value", ["-1s", "0", "soon", ""])
def test_a_bad_fair_hold_exits_2_naming_the_value(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--fair-hold", value)
    assert_one_line_error(proc, 2, "--fair-hold")
    assert repr(value) in proc.stderr


@pytest.mark.parametrize(("value", "seconds"), [(None, 60.0), ("90s", 90.0), ("2m", 120.0), ("0.5", 0.5)])
def test_the_fair_hold_reaches_the_controller(monkeypatch, tmp_path, capsys, value: str | None,
                                              seconds: float) -> None:
    code, err, options = controller_options(monkeypatch, tmp_path, capsys, *(["--fair-hold", value] if value else []))
    assert code is None and options.fair_hold_s == seconds, err


@pytest.mark.parametrize("value", ["Team-A", "a,b_c", "x" * 64])
def test_a_bad_mig_request_namespace_exits_2_naming_it(tmp_path, value: str) -> None:
    proc = part(tmp_path, "controller", "--webhook", "127.0.0.1:9443", "--mig-request-namespaces", value)
    assert_one_line_error(proc, 2, "--mig-request-namespaces")
    assert "is not a namespace" in proc.stderr and "e.g. --mig-request-namespaces team-a,team-b" in proc.stderr


@pytest.mark.parametrize(("argv", "fragment"), [
    ([], "the following arguments are required: --webhook"),
    (["--webhook", "127.0.0.1:99999"], "--webhook '127.0.0.1:99999' is not HOST:PORT"),
    (["--webhook", "192.0.2.1:9443"], "--webhook '192.0.2.1:9443' cannot be listened on: 192.0.2.1 is not an "
                                      "address of this host"),
    (["--webhook", "127.0.0.1:9443", "--webhook-service", "ns/svc:0"], "is not NAMESPACE/NAME[:PORT]"),
    (["--webhook", "127.0.0.1:9443", "--mig-request-namespaces", "Team-A"], "--mig-request-namespaces 'Team-A' is "
                                                                           "not a namespace"),
    (["--webhook", "127.0.0.1:9443", "--compat", "kai"], "--compat 'kai'"),
    (["--webhook", "127.0.0.1:9443", "--webhook-cert", "/nope.pem"], "--webhook-cert and --webhook-key go together"),
    (["--webhook", "127.0.0.1:9443", "--namespace", "Ops"], "--namespace 'Ops' is not a namespace"),
    (["--webhook", "127.0.0.1:9443", "--webhook-config", "Bad Name"], "--webhook-config 'Bad Name' is not a "
                                                                     "MutatingWebhookConfiguration name"),
    (["--webhook", "127.0.0.1:9443", "--peering", "x"], "unrecognized arguments: --peering x"),
])
def test_the_webhook_command_checks_the_controllers_webhook_flags_before_start(tmp_path, argv: list[str],
                                                                              fragment: str) -> None:
    """`mig-operator webhook` takes the --webhook-* flags `controller` takes, checked the same way
    before anything starts (one line, exit 2); it has no controller flags."""
    proc = part(tmp_path, "webhook", *argv)
    assert_one_line_error(proc, 2, fragment)
    if argv and argv[-2] != "--peering":
        same = part(tmp_path, "controller", *argv)
        assert_one_line_error(same, 2, fragment)


# ---- the controller's autoscaling flags ------------------------------------------------------------

POOLS_YAML = """\
- name: h200
  nodeLabels: {pool: h200, cdmo.clear.ml/gpu-partitioning: mig}
  gpuModel: h200-141gb
  gpusPerNode: 8
  cpu: "190"
  memory: 1900Gi
  maxNodes: 3
"""


def controller_options(monkeypatch, tmp_path: Path, capsys, *argv: str) -> tuple[int | None, str, object]:
    """``mig-operator controller ARGV`` in this process up to building its registry: the exit code and
    stderr of a refusal, or the ControllerOptions it would run with."""
    import mig_operator.kube.controller.main as controller_main

    seen = []

    class Built(Exception):
        pass

    def build_registry(options, *_):
        seen.append(options)
        raise Built

    monkeypatch.setattr(controller_main, "build_registry", build_registry)
    try:
        code = main(["controller", "--kubeconfig", str(unreachable_kubeconfig(tmp_path)), *argv])
    except Built:
        code = None
    return code, capsys.readouterr().err, seen[0] if seen else None


def pools_file(tmp_path: Path, data: bytes | str, name: str = "pools.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


def test_without_a_pools_file_the_controller_does_not_autoscale(monkeypatch, tmp_path, capsys) -> None:
    code, _, options = controller_options(monkeypatch, tmp_path, capsys)
    assert code is None and options.autoscaling is None


@pytest.mark.parametrize("form", ["yaml", "json", "json-object"])
def test_the_pools_file_reaches_the_controller_as_yaml_or_json(monkeypatch, tmp_path, capsys, form: str) -> None:
    entry = {"name": "h200", "nodeLabels": {"pool": "h200", "cdmo.clear.ml/gpu-partitioning": "mig"},
             "gpuModel": "h200-141gb", "gpusPerNode": 8, "cpu": "190", "memory": "1900Gi", "maxNodes": 3}
    text = {"yaml": POOLS_YAML, "json": json.dumps([entry]), "json-object": json.dumps({"pools": [entry]})}[form]
    code, err, options = controller_options(
        monkeypatch, tmp_path, capsys, "--autoscaling-pools", pools_file(tmp_path, text), "--namespace", "gpu-ops",
        "--autoscaling-backend", "placeholder", "--placeholder-priority-class", "low",
        "--placeholder-image", "example.com/pause:3.10")
    assert code is None, err
    scaling = options.autoscaling
    (pool,) = scaling.pools
    assert (pool.name, pool.gpus, pool.max_nodes, pool.memory, pool.mig) == ("h200", 8, 3, 1900 * 2**30, True)
    assert (scaling.namespace, scaling.backend, scaling.priority_class, scaling.image) == (
        "gpu-ops", "placeholder", "low", "example.com/pause:3.10")


@pytest.mark.parametrize(("argv", "fragments"), [
    (["--autoscaling-backend", "karpenter"], ["--autoscaling-backend 'karpenter' is not one of auto, "
                                              "capacitybuffer, placeholder", "--autoscaling-backend auto"]),
    (["--autoscaling-backend", ""], ["--autoscaling-backend ''"]),
    (["--placeholder-priority-class", "Low Priority"], ["--placeholder-priority-class 'Low Priority'",
                                                         "mig-operator-placeholder"]),
    (["--placeholder-image", ""], ["--placeholder-image '' is not an image reference",
                                   "--placeholder-image registry.k8s.io/pause:3.10"]),
    (["--placeholder-image", "pause 3.10"], ["--placeholder-image 'pause 3.10'"]),
    (["--placeholder-image", "pause\n:3.10"], ["--placeholder-image 'pause\\n:3.10'"]),
    (["--placeholder-image", "p\u00e1use:3.10"], ["is not an image reference"]),
    (["--placeholder-image", "x" * 513], ["is not an image reference"]),
    (["--autoscaling-pools", "pools.yaml"], ["--autoscaling-pools 'pools.yaml' is not an absolute file path",
                                             "/etc/mig-operator/autoscaling/pools.yaml"]),
    (["--autoscaling-pools", "/"], ["--autoscaling-pools '/' is not an absolute file path"]),
    (["--autoscaling-pools", "/nonexistent/pools.yaml"], ["--autoscaling-pools '/nonexistent/pools.yaml' cannot "
                                                          "be read: No such file or directory"]),
])
def test_a_bad_autoscaling_flag_is_one_line_naming_it(monkeypatch, tmp_path, capsys, argv: list[str],
                                                      fragments: list[str]) -> None:
    code, err, options = controller_options(monkeypatch, tmp_path, capsys, *argv)
    assert code == 2 and options is None
    assert err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def test_the_pools_directory_is_not_a_file(monkeypatch, tmp_path, capsys) -> None:
    code, err, _ = controller_options(monkeypatch, tmp_path, capsys, "--autoscaling-pools", str(tmp_path))
    assert code == 2 and "is a directory, not a file" in err


def hostile_pools() -> list[tuple[bytes, str]]:
    laughs = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    laughs += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 12)]
    laughs.append("pools: [*a11]")
    return [
        (POOLS_YAML.replace("gpusPerNode: 8", "gpusPerNode: 0").encode(), "autoscaling pool 0: gpusPerNode 0"),
        (POOLS_YAML.replace("cpu: \"190\"", "cpu: \"\uff11\uff19\uff10\"").encode(), "is not ASCII"),
        (POOLS_YAML.encode() + POOLS_YAML.encode(), "autoscaling pool name(s) h200 used twice"),
        (POOLS_YAML.replace("maxNodes: 3", "maxNodes: true").encode(), "maxNodes True"),
        (POOLS_YAML.replace("maxNodes: 3", "maxNodes: 3\n  zone: a").encode(), "unknown field(s) 'zone'"),
        (b"- [unclosed", "is not ASCII JSON or YAML"),
        (b"\xff\xfe- name: h200", "is not ASCII JSON or YAML"),
        (b"", "None is not a list of 1 to 32 pools"),
        (b"[" * 200_000, "is nested too deeply"),
        ("\n".join(laughs).encode(), "an alias (*name) is not taken in a pools file"),
        (b"- " + b" " * (1 << 20), "is larger than 1048576 bytes"),
    ]


@pytest.mark.parametrize(("content", "fragment"), hostile_pools(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_pools_file_is_one_line_naming_what_is_wrong(monkeypatch, tmp_path, capsys, content: bytes,
                                                           fragment: str) -> None:
    path = pools_file(tmp_path, content)
    code, err, options = controller_options(monkeypatch, tmp_path, capsys, "--autoscaling-pools", path)
    assert code == 2 and options is None
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 1500, err[:2000]
    assert "--autoscaling-pools '/" in err and fragment in err, err


def test_a_pools_file_of_exactly_the_cap_is_read(monkeypatch, tmp_path, capsys) -> None:
    text = POOLS_YAML.encode()
    path = pools_file(tmp_path, text + b" " * ((1 << 20) - len(text)))
    assert os.path.getsize(path) == 1 << 20
    code, err, options = controller_options(monkeypatch, tmp_path, capsys, "--autoscaling-pools", path)
    assert code is None, err
    assert [p.name for p in options.autoscaling.pools] == ["h200"]


def test_a_bad_pools_file_stops_the_controller_process_in_one_line(tmp_path) -> None:
    path = pools_file(tmp_path, POOLS_YAML.replace("h200-141gb", "h300"))
    proc = part(tmp_path, "controller", "--autoscaling-pools", path)
    assert_one_line_error(proc, 2, "gpuModel: unknown GPU model 'h300'")
