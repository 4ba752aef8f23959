"""``mig-operator advise``: its flags (one line, exit 2), the namespace kubectl would use, and what it reads
where the caller may not list every namespace's slices or the GpuNodes (a fake client that answers as the
API server does to a tenant with ``edit`` in one namespace)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mig_operator.cli import main
from mig_operator.cli.advise import headroom_flag
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.kube.advise import AdviseError, Scope, read_report
from mig_operator.kube.common.client import ApiError, gpunodes_path, slices_path
from mig_operator.kube.common.impersonation import namespace_of

GIB = 2**30
MIB = 2**20


@pytest.mark.parametrize("text, value", [("0", 0.0), ("0.1", 0.1), ("0.25", 0.25), (".5", 0.5), ("1", 1.0),
                                         ("1.0", 1.0)])
def test_headroom_from_0_to_1(text: str, value: float) -> None:
    assert headroom_flag(text) == value


@pytest.mark.parametrize("text", ["-0.1", "1.01", "2", "nan", "inf", "1e-1", "10%", "", " 0.1", "０.１",
                                  "0." + "1" * 5000])
def test_other_headroom_is_refused(text: str) -> None:
    with pytest.raises(QuantityError, match="--headroom"):
        headroom_flag(text)


@pytest.mark.parametrize("argv", [["--headroom", "1.5"], ["--headroom", "-1"], ["-n", "Team_A"],
                                  ["-n", "a", "-A"], ["--bogus"]])
def test_bad_flags_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["advise", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mig-operator")


def test_the_namespace_is_the_current_contexts_else_default() -> None:
    docs = [{"current-context": "t", "contexts": [{"name": "t", "context": {"user": "u", "namespace": "team-a"}},
                                                  {"name": "o", "context": {"namespace": "team-b"}}]}]
    assert namespace_of(docs) == "team-a"
    assert namespace_of([{"current-context": "o", **{k: v for k, v in docs[0].items() if k != "current-context"}}]) \
        == "team-b"
    assert namespace_of([{"current-context": "t", "contexts": [{"name": "t", "context": {"user": "u"}}]}]) == "default"
    assert namespace_of([{"contexts": "junk"}]) == "default"


class TenantClient:
    """Answers lists as the API server does to a user with ``edit`` in ``namespace`` only: every namespace's
    slices and the GpuNodes are forbidden."""

    def __init__(self, namespace: str, items: dict[str, list[dict]], nodes_allowed: bool = False) -> None:
        self.namespace = namespace
        self.items = items
        self.nodes_allowed = nodes_allowed
        self.asked: list[str] = []

    async def list(self, path: str, **_: Any) -> list[dict]:
        self.asked.append(path)
        if path == slices_path(self.namespace) or (path == gpunodes_path() and self.nodes_allowed):
            return self.items.get(path, [])
        raise ApiError(403, "Forbidden", f"user cannot list {path}")


def train() -> dict[str, Any]:
    return {"metadata": {"namespace": "team-a", "name": "train", "uid": "u1"},
            "status": {"phase": "Ready", "mode": "mig", "node": "gpu-a", "gpu": 0, "profile": "3g.40gb",
                       "grantedBytes": 40448 * MIB, "placement": {"start": 0, "size": 4},
                       "usage": {"memoryUsed": GIB, "memoryPeak": 3 * GIB, "processes": 1,
                                 "observedAt": "2026-11-29T06:00:10Z"}}}


def test_a_tenant_gets_its_contexts_namespace_and_mig_advice_without_gpunodes() -> None:
    client = TenantClient("team-a", {slices_path("team-a"): [train()]})
    reading = asyncio.run(read_report(client, Scope(None, fallback="team-a"), 0.1))  # type: ignore[arg-type]
    assert client.asked.count(slices_path()) == 1 and client.asked.count(slices_path("team-a")) == 1
    assert [(r.namespace, r.name, r.advice.suggested) for r in reading.report.rows] == [("team-a", "train",
                                                                                           "1g.10gb")]
    assert any("namespace team-a only" in note for note in reading.notes)
    assert any("cannot list GpuNodes (HTTP 403" in note for note in reading.notes)


def test_asking_for_every_namespace_or_another_one_when_forbidden_is_an_error() -> None:
    client = TenantClient("team-a", {})
    with pytest.raises(AdviseError, match="all namespaces"):
        asyncio.run(read_report(client, Scope(None), 0.1))  # type: ignore[arg-type]
    with pytest.raises(AdviseError, match="namespace team-b"):
        asyncio.run(read_report(client, Scope("team-b", fallback="team-a"), 0.1))  # type: ignore[arg-type]


def test_gpunodes_that_fail_otherwise_are_an_error() -> None:
    class Broken(TenantClient):
        async def list(self, path: str, **_: Any) -> list[dict]:
            if path == gpunodes_path():
                raise ApiError(500, "Internal Server Error", "etcd is away")
            return [train()]

    with pytest.raises(AdviseError, match="GpuNodes"):
        asyncio.run(read_report(Broken("team-a", {}), Scope("team-a"), 0.1))  # type: ignore[arg-type]
