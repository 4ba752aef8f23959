"""cli.flags.parse_duration, kube.common.client.resource_version and ApiError.transient."""

from __future__ import annotations

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


# --- on_event: watch events handed to the handler past kopf's per-event processing ------------------


def _direct_registry(seen: list, fail: bool = False):  # type: ignore[no-untyped-def]
    import kopf

    from mig_operator.kube.common.operator import on_event

    async def pods(body: dict, type: str | None) -> None:
        seen.append((body, type))
        if fail:
            raise RuntimeError("handler broke")

    registry = kopf.OperatorRegistry()
    on_event(registry, "", "v1", "pods", pods)
    return registry


def _watch_through(registry, resource, events, monkeypatch, processor=None):  # type: ignore[no-untyped-def]
    """Run the watcher kopf's orchestration calls (``queueing.watcher``, as direct_watch installs it)
    on ``events`` instead of a real stream."""
    import asyncio
    import functools

    import kopf
    from kopf._cogs.clients import watching
    from kopf._core.reactor import processing, queueing

    from mig_operator.kube.common import direct_watch

    async def stream(**_: object):  # type: ignore[no-untyped-def]
        for event in events:
            yield event

    monkeypatch.setattr(watching, "infinite_watch", stream)
    assert direct_watch.install() and direct_watch.install(), "installed once, and found installed again"
    processor = processor or functools.partial(
        functools.partial(processing.process_resource_event, registry=registry), resource=resource)

    async def run() -> None:
        await queueing.watcher(settings=kopf.OperatorSettings(), resource=resource, namespace=None,
                               processor=processor)

    asyncio.run(run())


def test_on_event_resources_go_from_kopfs_watch_straight_to_their_handler(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kopf._cogs.clients import watching
    from kopf._cogs.structs.references import Resource

    seen: list = []
    registry = _direct_registry(seen, fail=True)
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {}}
    events = [{"type": None, "object": body}, watching.Bookmark.LISTED, {"type": "ADDED", "object": body},
              {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
              {"type": "DELETED", "object": body}]
    _watch_through(registry, Resource("", "v1", "pods"), events, monkeypatch)
    # In order, bookmarks left out; each handler call failed and the next event came anyway.
    assert seen == [(body, None), (body, "ADDED"), (body, "DELETED")]
    assert seen[0][0] is body, "the body as the watch parsed it: no copy, no kopf wrapper"
    assert caplog.text.count("pods ns/p: the event handler failed") == 3 and "handler broke" in caplog.text


def test_other_resources_still_go_through_kopfs_own_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from kopf._cogs.structs.references import Resource

    seen: list = []
    registry = _direct_registry(seen)
    processed: list = []

    async def kopf_processor(*, raw_event: dict, **_: object) -> None:  # what kopf's workers call
        processed.append(raw_event["type"])

    node = {"metadata": {"name": "n", "uid": "n-uid"}}
    _watch_through(registry, Resource("", "v1", "nodes"), [{"type": "ADDED", "object": node}], monkeypatch,
                   processor=kopf_processor)
    assert processed == ["ADDED"] and seen == []


def test_on_event_is_also_an_ordinary_kopf_handler() -> None:
    """Where the direct path cannot be installed, kopf calls the same function through on.event."""
    import asyncio

    import kopf

    seen: list = []
    registry = _direct_registry(seen)
    handlers = registry._watching.get_all_handlers()
    assert len(handlers) == 1
    asyncio.run(handlers[0].fn(body=kopf.Body({"metadata": {"name": "p"}}), type="MODIFIED"))
    assert seen == [({"metadata": {"name": "p"}}, "MODIFIED")] and type(seen[0][0]) is dict


def test_the_controller_takes_every_watched_resource_directly() -> None:
    from mig_operator.kube.controller.main import ControllerOptions, build_registry

    registry = build_registry(ControllerOptions())
    direct = registry._mig_operator_direct
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert set(direct) == watched == {("cdmo.io", "gpuslices"), ("cdmo.io", "gpunodes"), ("cdmo.io", "gpuquotas"),
                                      ("", "nodes"), ("", "pods")}


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
