"""cli.flags.parse_duration, kube.common.client.resource_version and ApiError.transient."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.cli.flags import parse_duration
from mig_operator.core.requests.quantities import QuantityError
from mig_operator.kube.common.client import ApiError, resource_version

YEAR_S = 365 * 24 * 60 * 60


# --- parse_duration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1ms", 0.001),
        ("1", 1.0),
        ("30s", 30.0),
        ("10m", 600.0),
        ("1.5h", 5400.0),
        ("2d", 2 * 86400.0),
        (" 10m ", 600.0),
        ("0.5s", 0.5),
        ("365d", float(YEAR_S)),
        ("8760h", float(YEAR_S)),
        ("525600m", float(YEAR_S)),
        (str(YEAR_S), float(YEAR_S)),
        (f"{YEAR_S * 1000}ms", float(YEAR_S)),
    ],
)
def test_duration_accepted(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    "text", ["0", "0s", "0ms", "0.0h", "366d", "8761h", str(YEAR_S + 1), f"{YEAR_S}.001", f"{YEAR_S * 1000 + 1}ms"]
)
def test_duration_zero_or_over_a_year_is_refused_naming_the_value(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    "text", ["", " ", "abc", "10x", "-5s", "+5s", "1e3", "10 m", "5S", "1.s", ".5s", "1h30m", "5sec", "١٢s", "nan",
             "inf"],
)
def test_duration_garbage_is_refused_naming_the_value(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)
    assert "10m" in str(info.value)  # shows a valid example


def test_duration_very_long_text_is_refused_with_a_short_message() -> None:
    text = "9" * 10_000 + "s"
    with pytest.raises(QuantityError) as info:
        parse_duration(text)
    assert "9" * 40 in str(info.value)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("value", [None, 5, 1.5, b"10m"])
def test_duration_that_is_not_text_is_refused(value) -> None:
    with pytest.raises(QuantityError):
        parse_duration(value)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 400 * 24), st.sampled_from(["h", "m", "s"]))
def test_duration_bound_is_exactly_one_year(number: int, unit: str) -> None:
    seconds = number * {"h": 3600, "m": 60, "s": 1}[unit]
    if seconds <= YEAR_S:
        assert parse_duration(f"{number}{unit}") == seconds
    else:
        with pytest.raises(QuantityError):
            parse_duration(f"{number}{unit}")


# --- resource_version --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "version"),
    [
        ({"resourceVersion": "12345"}, 12345),
        ({"resourceVersion": "0"}, 0),
        ({"resourceVersion": "987654321987654321"}, 987654321987654321),
        ({}, 0),
        ({"resourceVersion": ""}, 0),
        ({"resourceVersion": None}, 0),
        ({"resourceVersion": "abc"}, 0),
        ({"resourceVersion": "1.5"}, 0),
    ],
)
def test_resource_version(meta: dict, version: int) -> None:
    assert resource_version(meta) == version


def test_resource_versions_compare_as_numbers_not_text() -> None:
    assert resource_version({"resourceVersion": "10"}) > resource_version({"resourceVersion": "9"})


# --- ApiError -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 429, 500, 502, 503, 504])
def test_no_answer_throttling_and_server_errors_are_transient(code: int) -> None:
    assert ApiError(code, "r", "m").transient


@pytest.mark.parametrize("code", [400, 401, 403, 404, 405, 409, 410, 415, 422])
def test_client_errors_are_not_transient(code: int) -> None:
    assert not ApiError(code, "r", "m").transient


def test_api_error_flags_and_text() -> None:
    assert ApiError(404, "Not Found", "GET /x").not_found and not ApiError(404, "", "").conflict
    assert ApiError(409, "Conflict", "PATCH /x").conflict and not ApiError(409, "", "").not_found
    assert str(ApiError(409, "Conflict", "PATCH /x")) == "PATCH /x (HTTP 409 Conflict)"
    assert str(ApiError(0, "", "GET /x: timeout")) == "GET /x: timeout"


# --- kopf settings: no diff base -------------------------------------------------------------------


def _registries() -> list:
    from mig_operator.gpu.simulated import SimulatedBackend
    from mig_operator.kube.agent.context import AgentSettings
    from mig_operator.kube.agent.main import AgentOptions
    from mig_operator.kube.agent.main import build_registry as agent_registry
    from mig_operator.kube.controller.main import ControllerOptions
    from mig_operator.kube.controller.main import build_registry as controller_registry

    backend = SimulatedBackend("h100-80gb")
    return [controller_registry(ControllerOptions()),
            agent_registry(AgentOptions(AgentSettings(node="n"), record_file="/nonexistent"), backend)]


def test_no_part_registers_a_handler_that_needs_kopfs_diff_base() -> None:
    """NoDiffBase keeps no essence, which is right only while every resource handler is on.event:
    an on.create/update/resume handler, a daemon or a timer would then see every event as new."""
    for registry in _registries():
        assert registry._watching.get_all_handlers(), "each part handles watch events"
        assert not registry._changing.get_all_handlers()
        assert not registry._spawning.get_all_handlers()


def test_no_diff_base_keeps_nothing_of_the_body() -> None:
    import kopf

    from mig_operator.kube.common.operator import NoDiffBase, tune

    settings = kopf.OperatorSettings()
    tune(settings, "x.cdmo.io")
    assert isinstance(settings.persistence.diffbase_storage, NoDiffBase)
    body = kopf.Body({"metadata": {"name": "a", "labels": {"k": "v"}}, "spec": {"memory": "4Gi"}})
    assert settings.persistence.diffbase_storage.build(body=body) == {}
    assert settings.persistence.diffbase_storage.fetch(body=body) is None


# --- on_event: a kopf.on.event handler that hands on what the kind's transform keeps -----------------


def test_on_event_is_kopfs_event_handler_and_hands_on_the_kept_body_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    import kopf

    from mig_operator.kube.common.operator import on_event

    seen: list = []
    release = asyncio.Event()

    async def pods(body: dict, type: str | None) -> None:
        if body["name"] == "slow":
            await release.wait()
        seen.append((body["name"], body["n"], type))
        if body["n"] == 1:
            raise RuntimeError("handler broke")

    registry = kopf.OperatorRegistry()
    events = on_event(registry, "", "v1", "pods", pods,
                      lambda body: {"metadata": {"name": body["metadata"]["name"], "namespace": "ns"},
                                    "name": body["metadata"]["name"], "n": body["metadata"]["n"]})
    handlers = registry._watching.get_all_handlers()
    assert len(handlers) == 1

    def raw(name: str, n: int) -> kopf.Body:
        return kopf.Body({"metadata": {"name": name, "uid": name, "n": n, "annotations": {"big": "x" * 1000}}})

    async def run() -> None:
        for n in range(3):  # kopf's handler returns at once: the slow object's events wait, in order
            await handlers[0].fn(body=raw("slow", n), type="MODIFIED")
        await handlers[0].fn(body=raw("fast", 0), type=None)
        await asyncio.sleep(0.01)
        assert seen == [("fast", 0, None)], "another object is not held up by a slow one"
        release.set()
        while events.tasks:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert seen == [("fast", 0, None), ("slow", 0, "MODIFIED"), ("slow", 1, "MODIFIED"), ("slow", 2, "MODIFIED")]
    assert "pods ns/slow: the event handler failed" in caplog.text and "handler broke" in caplog.text
    assert not events.waiting


def test_the_controller_watches_each_kind_through_kopf() -> None:
    from mig_operator.kube.controller.main import ControllerOptions, build_registry

    registry = build_registry(ControllerOptions())
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert watched == {("cdmo.io", "gpuslices"), ("cdmo.io", "gpunodes"), ("cdmo.io", "gpuquotas"),
                       ("", "nodes"), ("", "pods")}


def test_kopf_lists_in_pages_and_lets_idle_workers_go() -> None:
    import kopf

    from mig_operator.kube.common.operator import tune

    settings = kopf.OperatorSettings()
    tune(settings, "x.cdmo.io")
    # A page holds whole objects (a tenant's may carry 256 kB of annotations): ten at a time.
    assert settings.watching.chunk_size == 10
    assert settings.queueing.idle_timeout < kopf.OperatorSettings().queueing.idle_timeout


def test_the_client_reads_its_token_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token read per request cost 2 % of the controller's CPU in a burst; a rotated token still
    reaches the next request after a second."""
    from mig_operator.kube.common import client as client_module

    reads: list[str] = []
    token = ["Bearer one"]

    def bearer(config: object) -> str:
        reads.append(token[0])
        return token[0]

    now = [100.0]
    monkeypatch.setattr(client_module, "bearer_token", bearer)
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    config = type("Config", (), {"host": "https://127.0.0.1:6443"})()
    kube = client_module.KubeClient(config)  # type: ignore[arg-type]
    assert kube._headers(None)["Authorization"] == "Bearer one"
    token[0] = "Bearer two"
    now[0] += 0.5
    assert kube._headers("application/json")["Authorization"] == "Bearer one"
    now[0] += 0.6
    assert kube._headers(None)["Authorization"] == "Bearer two"
    assert reads == ["Bearer one", "Bearer two"]


def test_the_client_asks_for_answers_uncompressed(monkeypatch: pytest.MonkeyPatch) -> None:
    """kube-apiserver gzips an answer over 128 kB for a client that accepts it: CPU on both sides for
    every write answer and list page of a tenant's big object. A real HTTP server here answers in gzip
    whenever the request accepts it, as kube-apiserver does; the client's requests accept only identity."""
    import gzip

    from aiohttp import web

    from mig_operator.kube.common import client as client_module

    asked: list[str] = []
    body = json.dumps({"metadata": {"name": "big"}, "data": {"blob": "x" * 200_000}}).encode()

    async def answer(request: web.Request) -> web.Response:
        accepted = request.headers.get("Accept-Encoding", "")
        asked.append(accepted)
        if "gzip" in accepted:
            return web.Response(body=gzip.compress(body), headers={"Content-Encoding": "gzip"},
                                content_type="application/json")
        return web.Response(body=body, content_type="application/json")

    async def main() -> dict:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/configmaps/big", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        await web.SockSite(runner, listener).start()
        config = type("Config", (), {"host": f"http://127.0.0.1:{port}"})()
        kube = client_module.KubeClient(config)  # type: ignore[arg-type]
        try:
            return await kube.get("/api/v1/namespaces/ns/configmaps/big")
        finally:
            await kube.close()
            await runner.cleanup()

    monkeypatch.setattr(client_module, "bearer_token", lambda config: None)
    got = asyncio.run(main())
    assert got["data"]["blob"] == "x" * 200_000
    assert asked and all("gzip" not in a and "deflate" not in a for a in asked), asked
