"""`mig-operator check`'s verdicts from observed objects (core/views/check.py), its text and JSON, and its
flags refused before anything starts."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mig_operator.cli import main
from mig_operator.core.views.check import (
    FAIL,
    OK,
    WARN,
    Check,
    DryRun,
    controller_verdict,
    crds_verdict,
    node_verdicts,
    passed,
    render_checks,
    report_json,
    slice_verdict,
    webhook_verdict,
)

NOW = datetime(2026, 11, 24, 15, 0, 0, tzinfo=UTC)
LABEL = "cdmo.clear.ml/gpu-partitioning"
WANTED = {"cdmo.io/v1alpha1": ("gpuslices", "gpunodes", "gpuquotas"), "kopf.dev/v1": ("clusterkopfpeerings",)}


def stamp(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


def test_crds_all_served_is_ok_and_a_missing_one_is_named() -> None:
    served = {"cdmo.io/v1alpha1": {"gpuslices", "gpuslices/status", "gpunodes", "gpuquotas"},
              "kopf.dev/v1": {"clusterkopfpeerings"}}
    assert crds_verdict(WANTED, served).status == OK
    missing = crds_verdict(WANTED, {"cdmo.io/v1alpha1": {"gpuslices", "gpunodes"}})
    assert missing.status == FAIL
    assert missing.message == "the API server does not serve gpuquotas.cdmo.io, clusterkopfpeerings.kopf.dev"
    assert "crds/" in missing.fix


@pytest.mark.parametrize(("configs", "run", "status", "words"), [
    ([], DryRun(), FAIL, "no MutatingWebhookConfiguration has the webhook pods.cdmo.io"),
    (["mig-operator"], DryRun(mutated=True), OK, "got its scheduling gate and slice label"),
    (["mig-operator"], DryRun(), FAIL, "admitted without the webhook's scheduling gate"),
    (["mig-operator"], DryRun(status=500, message='Internal error occurred: failed calling webhook "pods.cdmo.io": '
                              "connection refused"), FAIL, "cannot call the webhook"),
    (["mig-operator"], DryRun(status=400, message='admission webhook "pods.cdmo.io" denied the request: no quota'),
     WARN, "refused the test pod"),
    (["mig-operator"], DryRun(status=403, message='pods is forbidden: User "x" cannot create'), WARN,
     "could not be tried"),
])
def test_webhook_verdicts(configs: list[str], run: DryRun, status: str, words: str) -> None:
    found = webhook_verdict(configs, "pods.cdmo.io", "default", run)
    assert (found.status, words in found.message) == (status, True), found
    assert bool(found.fix) == (status != OK)


def peering(*peers: tuple[float, int]) -> dict[str, Any]:
    return {"metadata": {"name": "mig-operator"},
            "status": {f"peer-{i}": {"priority": i, "lifetime": life, "lastseen": stamp(ago).replace("Z", "+00:00")}
                       for i, (ago, life) in enumerate(peers)}}


@pytest.mark.parametrize(("body", "status", "words"), [
    (None, FAIL, "no ClusterKopfPeering mig-operator: no controller has started"),
    ({"metadata": {"name": "mig-operator"}}, FAIL, "last seen never"),
    (peering((3, 10)), OK, "1 controller replica(s) alive in peering mig-operator (last seen 3 s ago)"),
    (peering((3, 10), (8, 10), (40, 10)), OK, "2 controller replica(s) alive"),
    (peering((11, 10)), FAIL, "no live controller in peering mig-operator (last seen 11 s ago)"),
])
def test_controller_verdicts(body: dict | None, status: str, words: str) -> None:
    found = controller_verdict("mig-operator", body, NOW)
    assert found.status == status and words in found.message, found
    assert ("kubectl get pods" in found.fix) == (status == FAIL)


def node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {LABEL: "mig", **(labels or {})}}}


def gpunode(name: str, ago: float, trusted: str | None) -> dict[str, Any]:
    conditions = [] if trusted is None else [{"type": "RuntimeTrusted", "status": trusted, "reason": "R",
                                              "message": f"toolkit says {trusted}"}]
    return {"metadata": {"name": name}, "status": {"observedAt": stamp(ago), "gpus": [{}, {}],
                                                   "conditions": conditions}}


def test_node_verdicts_per_gpu_node() -> None:
    nodes = [node("a"), node("b"), node("c"), node("d", {"cdmo.io/runtime-trust": "accepted"}), node("e"),
             node("f")]
    gpunodes = [gpunode("a", 5, "True"), gpunode("c", 200, "True"), gpunode("d", 5, "False"),
                gpunode("e", 5, "False"), gpunode("f", 5, None), gpunode("g", 5, "Unknown")]
    found = {c.name: c for c in node_verdicts(nodes, gpunodes, LABEL, NOW, 90)}
    assert {name: c.status for name, c in found.items()} == {
        "node/a": OK, "node/b": FAIL, "node/c": FAIL, "node/d": WARN, "node/e": FAIL, "node/f": WARN, "node/g": WARN}
    assert found["node/a"].message == "GpuNode a: 2 GPU(s), published 5 s ago, RuntimeTrusted True"
    assert "has no GpuNode" in found["node/b"].message and "spec.nodeName=b" in found["node/b"].fix
    assert "last published 200 s ago" in found["node/c"].message
    assert "toolkit says False" in found["node/e"].message and "cdmo.io/runtime-trust=accepted" in found["node/e"].fix
    assert "not published" in found["node/f"].message


def test_no_gpu_node_at_all_is_a_warning_saying_how_to_label_one() -> None:
    [found] = node_verdicts([], [], LABEL, NOW, 90)
    assert found.status == WARN and f"kubectl label node NODE {LABEL}=mig" in found.fix


READY = {"status": {"phase": "Ready", "node": "n1", "gpu": 0, "profile": "1g.18gb"}}


@pytest.mark.parametrize(("body", "gone", "refused", "status", "words", "fix"), [
    (READY, True, "", OK, "Ready in 1.5 s on n1 GPU 0, 1g.18gb, and deleted", ""),
    (READY, False, "", FAIL, "it is still there", "agent on n1"),
    ({"metadata": {}}, True, "", FAIL, "not Ready within 5 s: Pending", "controller never looked at it"),
    ({"status": {"phase": "Pending", "reason": "NoCapacity", "message": "no GPU has room"}}, True, "", FAIL,
     "Pending (NoCapacity): no GPU has room", "kubectl get gn"),
    ({"status": {"phase": "Creating", "node": "n2"}}, False, "", FAIL, "Creating", "agent on n2"),
    (None, True, "namespaces \"x\" not found", FAIL, "could not be made: namespaces \"x\" not found", "--namespace"),
])
def test_slice_verdicts(body: dict | None, gone: bool, refused: str, status: str, words: str, fix: str) -> None:
    found = slice_verdict("ns/mig-operator-check-abc", "memory 1Gi", body, 1.5, 5, gone, refused)
    assert found.status == status and words in found.message and fix in found.fix, found


def test_the_report_passes_with_warnings_and_fails_with_a_fail() -> None:
    good = [Check("crds", OK, "fine"), Check("node/a", WARN, "hm", "look")]
    bad = [*good, Check("slice", FAIL, "broken", "mend it")]
    assert passed(good) and not passed(bad)
    assert report_json(bad) == {"ok": False, "checks": [
        {"name": "crds", "status": "ok", "message": "fine", "fix": ""},
        {"name": "node/a", "status": "warn", "message": "hm", "fix": "look"},
        {"name": "slice", "status": "fail", "message": "broken", "fix": "mend it"}]}
    assert render_checks(bad) == ("ok    crds: fine\n"
                                  "warn  node/a: hm\n"
                                  "      fix: look\n"
                                  "FAIL  slice: broken\n"
                                  "      fix: mend it\n"
                                  "FAIL: 3 checks, 1 failed, 1 warned\n")


@pytest.mark.parametrize(("args", "named"), [
    (["--timeout", "0"], "--timeout '0'"),
    (["--timeout", "-5"], "--timeout '-5'"),
    (["--timeout", "soon"], "--timeout 'soon'"),
    (["--timeout", "2h"], "--timeout '2h'"),
    (["--namespace", "Not_A_Namespace"], "--namespace 'Not_A_Namespace'"),
    (["--peering", "UPPER"], "--peering 'UPPER'"),
    (["--as", "jane\nroot"], "'jane\\nroot'"),
])
def test_bad_flags_are_one_line_and_exit_2_before_anything_starts(
        args: list[str], named: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # A kubeconfig naming a server nothing serves: a flag check that came after a call would hang or fail 1.
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    assert main(["check", "--kubeconfig", str(config), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
