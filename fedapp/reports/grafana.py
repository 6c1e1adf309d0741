"""The Grafana dashboard: the saved queries as panels for the ClickHouse data source.

Built from :data:`~fedapp.reports.queries.REPORTS` rendered for Grafana (macros
``$__fromTime_ms``, ``$__toTime_ms``, ``$__interval_s`` of the grafana-clickhouse-datasource
plugin, and a ``${database}`` dashboard variable), so the dashboard and ``fedsched report`` run
the same SQL. ``deploy/grafana/fedsched-dashboard.json`` is this module's output
(``fedsched report --grafana-dashboard PATH``); a test keeps the two equal.
"""

from __future__ import annotations

import json
from typing import Any

from fedapp.reports.queries import REPORTS, SavedQuery, render

PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = {"type": PLUGIN, "uid": "${datasource}"}

#: Panel type per report (default: ``table``).
_PANEL_TYPE = {"summary": "stat", "wait_by_region": "barchart", "wait_by_kind": "barchart",
               "wait_by_tenant": "barchart", "cross_region": "barchart", "failure_by_cluster": "barchart",
               "gpu_utilisation": "timeseries", "queue_length": "timeseries"}

_UNITS = {"s": "s", "ratio": "percentunit", "jobs": "short", "GB": "decgbytes", "currency": "none"}

#: Query format of the plugin (sqlutil.FormatQueryOption): time series 0, table 1.
_FORMAT = {"timeseries": 0, "table": 1}


def _panel(q: SavedQuery, pid: int, x: int, y: int, w: int, h: int) -> dict[str, Any]:
    kind = _PANEL_TYPE.get(q.name, "table")
    target = {"refId": "A", "datasource": DATASOURCE, "editorType": "sql",
              "queryType": "timeSeries" if q.is_timeseries else "table",
              "format": _FORMAT["timeseries" if q.is_timeseries else "table"], "rawSql": render(q, database="",
                                                                                                 target="grafana")}
    panel: dict[str, Any] = {
        "id": pid, "type": kind, "title": q.title, "description": q.description, "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": [target],
        "fieldConfig": {"defaults": {"unit": _UNITS.get(q.unit, "short")}, "overrides": []},
        "options": {},
    }
    if kind == "barchart":
        panel["options"] = {"xField": q.x, "orientation": "horizontal", "showValue": "auto",
                            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        panel["transformations"] = [{"id": "organize", "options": {
            "includeByName": {q.x: True, **{c: True for c in q.y}}}}]
    elif kind == "timeseries":
        panel["options"] = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["max", "mean"]},
                            "tooltip": {"mode": "multi"}}
        panel["fieldConfig"]["defaults"]["custom"] = {"lineWidth": 2, "fillOpacity": 8, "spanNulls": True}
    elif kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "none", "graphMode": "none", "textMode": "value_and_name"}
    return panel


def dashboard() -> dict[str, Any]:
    """The dashboard model (Grafana JSON), panels in :data:`REPORTS` order."""
    panels, y = [], 0
    layout = {"summary": (24, 4), "gpu_utilisation": (24, 9), "queue_length": (24, 8), "chargeback": (24, 10),
              "approvals": (24, 7), "capacity_hints": (24, 8), "transfer_overhead": (24, 7)}
    x = 0
    for pid, q in enumerate(REPORTS, start=1):
        w, h = layout.get(q.name, (12, 8))
        if x + w > 24:
            x, y = 0, y + 8
        panels.append(_panel(q, pid, x, y, w, h))
        x += w
        if x >= 24:
            x, y = 0, y + h
    return {
        "uid": "fedsched-federation",
        "title": "fedsched · federation",
        "description": "Queue times, cross-region work, transfers, failures, utilisation, capacity hints, chargeback "
                       "and approvals from the fedsched audit log (the same SQL as `fedsched report`).",
        "tags": ["fedsched", "clickhouse"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-30d", "to": "now"},
        "refresh": "1m",
        "templating": {"list": [
            {"name": "datasource", "label": "ClickHouse", "type": "datasource", "query": PLUGIN,
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "database", "label": "Database", "type": "textbox", "query": "fedsched",
             "current": {"text": "fedsched", "value": "fedsched"}, "hide": 0},
        ]},
        "panels": panels,
    }


def dashboard_json() -> str:
    """:func:`dashboard` as the text kept in ``deploy/grafana/fedsched-dashboard.json``."""
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def grafana_macros(sql: str, *, database: str, from_ms: int, to_ms: int, interval_s: int) -> str:
    """Expand the variables and macros of a panel query the way Grafana and the ClickHouse
    data source do (``$__fromTime_ms`` -> ``fromUnixTimestamp64Milli(ms)``, ``$__interval_s`` ->
    whole seconds), e.g. to run it against another engine."""
    return (sql.replace("${database}", database)
            .replace("$__fromTime_ms", f"fromUnixTimestamp64Milli({int(from_ms)})")
            .replace("$__toTime_ms", f"fromUnixTimestamp64Milli({int(to_ms)})")
            .replace("$__interval_s", str(max(1, int(interval_s)))))
