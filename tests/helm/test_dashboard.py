"""The chart's Grafana dashboard (dashboards/mig-operator.json, templates/grafana-dashboard.yaml), offline:
every query of every panel names only metrics the operator exports (checked against a scrape of the real
metrics registry), the panels issue 18 asks for are there, and the ConfigMap the Grafana sidecar loads
renders only when enabled, with the sidecar's label."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
from helm_chart import CHART_DIR
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mig_operator.kube.common import metrics

DASHBOARD = CHART_DIR / "dashboards" / "mig-operator.json"
K8S_SCHEMA_VERSION = "1.34.0"

# PromQL words that are neither functions (those are followed by "(") nor metrics.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    grouping clauses, function names and keywords are taken out."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or re.match(r"\s*\(", text[match.end():]):
            continue
        names.add(word)
    return names


@pytest.mark.parametrize(("expr", "names"), [
    ("sum by (model, state) (mig_operator_slots)", {"mig_operator_slots"}),
    ('rate(a_total{action=~"create|reuse", x="y"}[$__rate_interval]) * 60', {"a_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m])))", {"b_bucket"}),
    ("max by (namespace) (u) / on (namespace) group_left max by (namespace) (h) > bool 0.5", {"u", "h"}),
    ('label_replace(up, "a", "$1", "b", "(.*)") offset 1h or vector(1e3)', {"up"}),
])
def test_the_query_reader_finds_exactly_the_metrics(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels") or []  # a collapsed row keeps its panels inside


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, and every query variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in _panels(dashboard) for t in p.get("targets") or []]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append((f"${variable['name']}", query if isinstance(query, str) else query["query"]))
    return queries


def exported_names() -> set[str]:
    """Every sample name the operator's registry serves once each labelled metric has one child: a
    scrape of the real registry (histograms as _bucket, _sum, _count; counters as _total)."""
    probes = []
    for collector in vars(metrics).values():
        if not isinstance(collector, (Counter, Gauge, Histogram)) or not collector._labelnames:
            continue
        labels = ("probe",) * len(collector._labelnames)
        child = collector.labels(*labels)
        probes.append((collector, labels))
        if isinstance(collector, Gauge):
            child.set(1)
        elif isinstance(collector, Counter):
            child.inc()
        else:
            child.observe(0.1)
    try:
        text = generate_latest(REGISTRY).decode()
    finally:
        for collector, labels in probes:
            collector.remove(*labels)
    assert len(probes) >= 10, "the probe reached too few of the operator's metrics"
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_panel_query_names_only_metrics_the_operator_exports() -> None:
    exported = exported_names()
    assert {"mig_operator_bind_seconds_bucket", "mig_operator_binds_total", "mig_operator_slots"} <= exported
    queries = dashboard_queries()
    assert len(queries) >= 10
    missing = []
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title!r}: no metric in {expr!r}"
        missing.extend(f"{title!r}: {name}" for name in sorted(names - exported))
    assert not missing, "queries naming metrics nobody exports:\n" + "\n".join(missing)


def test_a_misspelt_metric_would_be_caught() -> None:
    # The check above is only worth something if a name off by a letter is not exported.
    exported = exported_names()
    assert "mig_operator_slot" not in exported and "mig_operator_bind_seconds" not in exported
    assert "mig_operator_realise_seconds_count" in exported


def test_the_dashboard_has_the_panels_issue_18_asks_for() -> None:
    used = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    # Slots per GPU model, creates and reuses, bind and Ready latency, pending by reason, quota use.
    assert {"mig_operator_slots", "mig_operator_realise_seconds_count", "mig_operator_bind_seconds_bucket",
            "mig_operator_realise_seconds_bucket", "mig_operator_pending_slices", "mig_operator_quota_used_bytes",
            "mig_operator_quota_hard_bytes", "mig_operator_quota_whole_gpus"} <= used
    exprs = " ".join(expr for _, expr in dashboard_queries())
    assert "sum by (model, state) (mig_operator_slots)" in exprs
    assert "by (reason)" in exprs and "by (le, action)" in exprs


def test_the_dashboard_shows_the_unhealthy_gpus() -> None:
    health = [expr for _, expr in dashboard_queries() if "mig_operator_gpu_healthy" in metric_names(expr)]
    assert any("by (node, gpu)" in expr for expr in health), health  # which GPU, not only how many
    assert any("== 0" in expr for expr in health), health  # 0 is unhealthy (kube/common/metrics.py)


def test_the_dashboard_is_one_grafana_dashboard_with_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40 and dashboard["title"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": f"${{{variable['name']}}}"}, panel["title"]


# ---- the ConfigMap -----------------------------------------------------------------------------------------


def _dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap"
            and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboard"]


def test_the_configmap_renders_only_when_enabled_with_the_sidecar_label(render: Any) -> None:
    assert _dashboards(render()) == []
    [config] = _dashboards(render("--set", "grafana.dashboard.enabled=true", namespace="gpu-system"))
    assert config["metadata"]["namespace"] == "gpu-system"
    assert config["metadata"]["name"] == "mig-operator-dashboard"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in config["metadata"]
    [(key, text)] = config["data"].items()
    assert key.endswith(".json")
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(config, K8S_SCHEMA_VERSION, strict=True)


def test_the_label_namespace_and_annotations_follow_the_values(render: Any) -> None:
    [config] = _dashboards(render(
        "--set", "grafana.dashboard.enabled=true", "--set", "grafana.dashboard.label=dashboards",
        "--set", "grafana.dashboard.labelValue=mig", "--set", "grafana.dashboard.namespace=monitoring",
        "--set", "grafana.dashboard.annotations.grafana_folder=GPUs", release="gpu"))
    meta = config["metadata"]
    assert (meta["name"], meta["namespace"]) == ("gpu-mig-operator-dashboard", "monitoring")
    assert meta["labels"]["dashboards"] == "mig" and "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "GPUs"}
    kubernetes_validate.validate(config, K8S_SCHEMA_VERSION, strict=True)


def test_the_dashboard_shows_asked_against_used_and_idle_memory_per_namespace() -> None:
    panels = {title: [expr for t, expr in dashboard_queries() if t == title] for title, _ in dashboard_queries()}
    [asked_used] = [exprs for exprs in panels.values()
                    if {"mig_operator_quota_used_bytes", "mig_operator_used_memory_bytes"}
                    <= {n for e in exprs for n in metric_names(e)}]
    assert all("by (namespace)" in expr for expr in asked_used)  # one pair of lines per namespace
    idle = [expr for _, expr in dashboard_queries() if "mig_operator_idle_memory_bytes" in metric_names(expr)]
    assert idle and all("by (namespace)" in expr for expr in idle)
