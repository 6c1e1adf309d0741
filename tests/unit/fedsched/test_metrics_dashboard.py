"""The Grafana dashboard of the services' metrics (deploy/grafana/fedsched-metrics-dashboard.json)
queries only metrics our registries expose, and shows every one of them: it cannot drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedsched.metrics import AdmissionMetrics, AgentMetrics, SchedulerMetrics, WriterMetrics

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "fedsched-metrics-dashboard.json"
METRIC = re.compile(r"\bfedsched_[a-z0-9_]+")


def registries():
    return [AdmissionMetrics(), SchedulerMetrics(), AgentMetrics(), WriterMetrics("audit"), WriterMetrics("billing")]


def exposed() -> set[str]:
    return set().union(*(m.sample_names() for m in registries()))


def families() -> set[str]:
    return {f.name for m in registries() for f in m.registry.collect()}


def queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] if p["type"] != "row" for t in p["targets"]]


def test_every_query_names_only_exposed_metrics():
    names = exposed()
    used = [(title, name) for title, expr in queries() for name in METRIC.findall(expr)]
    assert used
    unknown = [(title, name) for title, name in used if name not in names]
    assert unknown == [], f"the dashboard queries metrics no registry has: {unknown}"


def test_every_metric_family_is_on_the_dashboard():
    used = {name for _, expr in queries() for name in METRIC.findall(expr)}
    shown = {f for f in families() if any(u == f or u.startswith(f + "_") for u in used)}
    assert families() - shown == set()


@pytest.mark.parametrize("path", sorted(p.name for p in GRAFANA.glob("*.json")))
def test_dashboards_are_valid_json_with_unique_panel_ids(path):
    d = json.loads((GRAFANA / path).read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"]


def test_panels_use_the_prometheus_datasource_variable():
    d = json.loads(DASHBOARD.read_text())
    assert {v["name"]: v["query"] for v in d["templating"]["list"]} == {"datasource": "prometheus"}
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"]["type"] == "prometheus" for t in p["targets"]), p["title"]
    provisioned = (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert "type: prometheus" in provisioned
