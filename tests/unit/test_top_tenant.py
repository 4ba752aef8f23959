"""`mig-operator top` for a caller refused the cluster-wide lists (a tenant with ``edit`` in one namespace):
the picture of one namespace's slices and quota, no GPUs, and a line on stderr saying why (a fake client
that answers as the API server does to such a tenant)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_advise_cli import TenantClient
from test_top import _kubeconfig, gpuslice, layout

from mig_operator.cli import main
from mig_operator.core.views.top_json import view_json
from mig_operator.core.views.top_view import build_view, render_text
from mig_operator.kube.advise import Scope
from mig_operator.kube.common.client import ApiError, gpunodes_path, slices_path
from mig_operator.kube.top import TopError, quotas_path, read_view

GIB = 2**30
MIB = 2**20


class QuotaReader(TenantClient):
    """A tenant who may also read its own namespace's GpuQuotas."""

    async def list(self, path: str, **kw: Any) -> list[dict]:
        if path == quotas_path(self.namespace):
            self.asked.append(path)
            return self.items.get(path, [])
        return await super().list(path, **kw)


def team_a() -> dict[str, list[dict]]:
    """team-a's train (3g.40gb on gpu-a's GPU 0, 1 GiB used of a 3 GiB peak, advised 1g.10gb), infer (8 GiB
    on l4-a's GPU 0, not measured yet) and wait (Pending on its quota); its GpuQuota of 40 GiB."""
    advice = {"verdict": "Smaller", "current": "3g.40gb", "suggested": "1g.10gb", "memoryBack": 30 * GIB,
              "message": "peak 3.0Gi + 10% fits 1g.10gb (9.8Gi)"}
    slices = [
        gpuslice("team-a/wait", "u-wait", "Pending", "QuotaExceeded"),
        gpuslice("team-a/train", "u-train", "Ready", mode="mig", node="gpu-a", gpu=0, profile="3g.40gb",
                 grantedBytes=40448 * MIB, placement={"start": 0, "size": 4},
                 usage={"memoryUsed": GIB, "memoryPeak": 3 * GIB, "processes": 1,
                        "observedAt": "2026-11-29T06:00:10Z", "advice": advice}),
        gpuslice("team-a/infer", "u-infer", "Ready", mode="fraction", node="l4-a", gpu=0, grantedBytes=8 * GIB),
    ]
    quota = {"metadata": {"namespace": "team-a", "name": "gpus"}, "spec": {"memory": "40Gi", "slices": 4},
             "status": {"used": {"memory": "40448Mi", "slices": 1}, "waiting": 1}}
    return {slices_path("team-a"): slices, quotas_path("team-a"): [quota]}


# Written by hand from team_a(): the slices by name, each bound slice's node, GPU and size.
TENANT = """\
namespace team-a: 3 slice(s); GPUs not drawn (that needs the cluster-wide lists)

  node   gpu  size     phase                    used/peak    advice     slice
  l4-a   0    8 GiB    Ready                    -            -          infer
  gpu-a  0    3g.40gb  Ready                    1.0Gi/3.0Gi  ->1g.10gb  train
  -      -    -        Pending (QuotaExceeded)  -            -          wait

used/peak: GPU memory in use now and its peak since Ready; ->SIZE: that smaller size would have held
    the peak (mig-operator advise)
pending slices: 1 (QuotaExceeded 1)
quotas (GpuQuota; memory counts each slice's grant, and a fraction GPU held alone whole)
  namespace  memory used / hard    %  slices used / hard  waiting  whole GPUs
  team-a     39.5 GiB / 40 GiB   99%  1 / 4                     1  0
"""


def test_a_tenant_refused_the_cluster_wide_lists_sees_its_contexts_namespace() -> None:
    client = QuotaReader("team-a", team_a())
    view = asyncio.run(read_view(client, Scope(None, fallback="team-a")))  # type: ignore[arg-type]
    assert {gpunodes_path(), slices_path(), slices_path("team-a"), quotas_path("team-a")} <= set(client.asked)
    assert view.nodes == () and view.namespace == "team-a"
    assert view.note == ("the view is limited to namespace team-a: the cluster-wide lists of GpuNodes and "
                         "GpuSlices are refused (-n NAMESPACE for another)")
    assert render_text(view) == TENANT, "\n" + render_text(view)
    assert all(len(line) <= 60 for line in render_text(view, 60).splitlines())


def test_its_json_keeps_the_keys_with_no_nodes_and_adds_the_slices() -> None:
    view = asyncio.run(read_view(QuotaReader("team-a", team_a()), Scope(None, fallback="team-a")))  # type: ignore[arg-type]
    out = json.loads(json.dumps(view_json(view)))
    assert set(out) == {"nodes", "pending", "waitingForNode", "quotas", "slices"} and out["nodes"] == []
    assert [(s["namespace"], s["name"], s["node"], s["gpu"], s["mode"], s["phase"]) for s in out["slices"]] == [
        ("team-a", "infer", "l4-a", 0, "fraction", "Ready"), ("team-a", "train", "gpu-a", 0, "mig", "Ready"),
        ("team-a", "wait", "", None, "", "Pending")]
    train = out["slices"][1]
    assert (train["profile"], train["bytes"], train["usage"]["memoryPeak"], train["usage"]["advice"]["suggested"]) \
        == ("3g.40gb", 40448 * MIB, 3 * GIB, "1g.10gb")
    assert out["slices"][0]["usage"] is None
    assert out["pending"] == {"total": 1, "byReason": {"QuotaExceeded": 1}}
    assert [q["namespace"] for q in out["quotas"]["items"]] == ["team-a"]


def test_a_quota_it_may_not_read_costs_only_the_table() -> None:
    view = asyncio.run(read_view(TenantClient("team-a", team_a()), Scope(None, fallback="team-a")))  # type: ignore[arg-type]
    assert render_text(view).splitlines()[-1] == "quotas: cannot list GpuQuotas (HTTP 403 Forbidden): table left out"
    assert [s.ref for s in view.slices] == ["team-a/infer", "team-a/train", "team-a/wait"]


def test_asked_for_a_namespace_it_reads_only_that_one_and_says_nothing_on_stderr() -> None:
    client = QuotaReader("team-a", team_a())
    view = asyncio.run(read_view(client, Scope("team-a")))  # type: ignore[arg-type]
    assert sorted(client.asked) == sorted([slices_path("team-a"), quotas_path("team-a")])
    assert view.note == "" and render_text(view) == TENANT


def test_a_namespace_refused_too_is_an_error_naming_it() -> None:
    with pytest.raises(TopError, match="cannot list GpuSlices in namespace team-b: .*403"):
        asyncio.run(read_view(TenantClient("team-a", {}), Scope(None, fallback="team-b")))  # type: ignore[arg-type]
    with pytest.raises(TopError, match="cannot list GpuSlices in namespace team-b"):
        asyncio.run(read_view(TenantClient("team-a", {}), Scope("team-b")))  # type: ignore[arg-type]


def test_only_a_refusal_falls_back_and_the_admin_gets_the_whole_cluster() -> None:
    class Broken(TenantClient):
        async def list(self, path: str, **_: Any) -> list[dict]:
            if path == gpunodes_path():
                raise ApiError(500, "Internal Server Error", "etcd is away")
            return []

    with pytest.raises(TopError, match="cannot list GpuNodes"):
        asyncio.run(read_view(Broken("team-a", {}), Scope(None, fallback="team-a")))  # type: ignore[arg-type]

    nodes, slices, quotas = layout()

    class Admin:
        async def list(self, path: str, **_: Any) -> list[dict]:
            return {gpunodes_path(): nodes, slices_path(): slices, quotas_path(): quotas}[path]

    view = asyncio.run(read_view(Admin(), Scope(None, fallback="team-a")))  # type: ignore[arg-type]
    assert view == build_view(nodes, slices, quotas)


def tenant_kubeconfig(tmp_path: Any) -> str:
    """A kubeconfig whose context names namespace team-a."""
    import yaml

    config = yaml.safe_load(open(_kubeconfig(tmp_path, "http://127.0.0.1:9")).read())
    config["contexts"][0]["context"]["namespace"] = "team-a"
    path = tmp_path / "tenant"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_command_falls_back_to_the_contexts_namespace_and_says_so_once(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mig_operator.kube import top as kube_top

    scopes: list[Scope] = []

    async def tenant_read(client: Any, scope: Scope) -> Any:
        scopes.append(scope)
        if len(scopes) == 4:  # one picture, then two of the watch
            raise KeyboardInterrupt
        return await read_view(QuotaReader("team-a", team_a()), scope)  # type: ignore[arg-type]

    monkeypatch.setattr(kube_top, "read_view", tenant_read)
    monkeypatch.setenv("COLUMNS", "100")
    config = tenant_kubeconfig(tmp_path)
    assert main(["top", "--kubeconfig", config]) == 0
    out, err = capsys.readouterr()
    assert scopes == [Scope(None, fallback="team-a")]
    assert out == TENANT and err.count("\n") == 1 and "limited to namespace team-a" in err
    assert main(["top", "--kubeconfig", config, "--json", "--watch", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and err.count("\n") == 1  # the same limit said once per watch
    scopes.clear()
    assert main(["top", "--kubeconfig", config, "-n", "team-a"]) == 0
    out, err = capsys.readouterr()
    assert scopes == [Scope("team-a")] and out == TENANT and err == ""


def test_a_bad_namespace_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "-n", "Team_A"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--namespace" in err
