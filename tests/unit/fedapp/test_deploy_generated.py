"""The generated deployment files match their generators (schema DDL, Grafana dashboard)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedapp.cli import app
from fedapp.reports import REPORTS
from fedapp.reports.grafana import PLUGIN, dashboard, dashboard_json

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


@pytest.mark.parametrize("args,name", [([], "schema.sql"), (["--cluster", "fedsched"], "schema-cluster.sql")],
                         ids=["single-node", "cluster"])
def test_clickhouse_ddl_is_regenerated(tmp_path, args, name):
    out = tmp_path / name
    result = CliRunner().invoke(app, ["schema", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (DEPLOY / "clickhouse" / name).read_text() == out.read_text(), \
        f"regenerate: fedsched schema {' '.join(args)} --out deploy/clickhouse/{name}"


def test_grafana_dashboard_is_regenerated():
    assert (DEPLOY / "grafana" / "fedsched-dashboard.json").read_text() == dashboard_json(), \
        "regenerate: fedsched report --grafana-dashboard deploy/grafana/fedsched-dashboard.json"


def test_grafana_panels_are_one_per_saved_query_on_the_clickhouse_datasource():
    d = dashboard()
    json.dumps(d)
    assert [p["title"] for p in d["panels"]] == [q.title for q in REPORTS]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in d["panels"]:
        (t,) = p["targets"]
        assert t["datasource"]["type"] == PLUGIN and t["editorType"] == "sql"
        assert "{{" not in t["rawSql"] and "${database}." in t["rawSql"]
        assert "$__fromTime_ms" in t["rawSql"]
    kinds = {p["type"] for p in d["panels"]}
    assert {"timeseries", "barchart", "table", "stat"} <= kinds
