"""``fedsched report``: the saved reports as tables, one HTML page, JSON, or the Grafana dashboard.

Where the data comes from, as for ``fedsched sql``: the server at ``--clickhouse-url``; the
running system over ``--nats-url`` (the process holding the embedded store answers
``<prefix>.svc.store.query``), or found through ``--data-dir`` while it runs there; else the
embedded store in ``--data-dir``.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from fedapp.cli.sql import ask_store, running_system
from fedsched.errors import FedError, UnavailableError
from fedsched.store import QueryResult

from fedapp.cli.when import time_option
from fedapp.cli.text import Output, console, err, error_line, strict_json, styled


def store_query(data_dir: Path, clickhouse_url: str, database: str):
    """A read-only :data:`~fedapp.reports.QueryFn` on the embedded store or a server.

    Raises:
        UnavailableError: no embedded store in ``data_dir``, or it is held by a running system.
    """
    from fedsched.settings import Settings
    from fedsched.store import open_store_from

    if not clickhouse_url and not (Path(data_dir) / "clickhouse").exists():
        raise UnavailableError(f"no embedded store in {data_dir}/clickhouse; run `fedsched up --data-dir {data_dir}` "
                               f"or pass --clickhouse-url / --nats-url")
    # credentials and TLS for a server come from FEDSCHED_CLICKHOUSE_* like the services'
    settings = Settings(data_dir=Path(data_dir), clickhouse_url=clickhouse_url, clickhouse_database=database)
    reader = open_store_from(settings, migrate=False).reader()
    return lambda sql, params: reader.query(sql, params)


def nats_query(nats_url: str, prefix: str, token: str | None = None):
    """A :data:`~fedapp.reports.QueryFn` asking the running system over NATS (an admin's
    ``token``; default :func:`~fedapp.client.resolve_token`)."""

    def run(sql: str, params: dict[str, Any]) -> QueryResult:
        return asyncio.run(_ask(nats_url, prefix, sql, params, token))

    return run


async def _ask(nats_url: str, prefix: str, sql: str, params: dict[str, Any], token: str | None) -> QueryResult:
    wire = {k: (v.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if isinstance(v, datetime) else v) for k, v in params.items()}
    body = await ask_store(nats_url, prefix, sql, wire, inbox_prefix=os.environ.get("FEDSCHED_INBOX_PREFIX", ""),
                           token=token)
    columns = tuple(body["columns"])
    rows = [tuple(_revive(c, v) for c, v in zip(columns, r)) for r in body["rows"]]
    return QueryResult(columns, rows)


def _revive(column: str, value: Any) -> Any:
    """JSON gave strings for times and money: make them datetimes and Decimals again."""
    if isinstance(value, str):
        if column in ("time", "at"):
            try:
                return datetime.fromisoformat(value).replace(tzinfo=None)
            except ValueError:
                return value
        if column.endswith("cost"):
            try:
                return Decimal(value)
            except ArithmeticError:
                return value
    return value


def _print_report(result) -> None:
    from fedapp.reports.html import _unit_of, fmt

    q = result.query
    if not result.rows:
        console.print(styled((q.title, "bold"), ": no rows in this window"))
        return
    if q.is_timeseries:  # hundreds of buckets: per series, the figures a person looks for
        table = Table(q.series, "buckets", f"mean {q.y[0]}", f"peak {q.y[0]}", "peak at", title=q.title,
                      caption="full series: --html or -o json")
        by: dict[str, list] = {}
        for r in result.dicts():
            by.setdefault(str(r[q.series]), []).append((r[q.x], r[q.y[0]]))
        unit = _unit_of(q.y[0], q.unit)
        for name, points in sorted(by.items()):
            values = [float(v or 0) for _, v in points]
            at, peak = max(points, key=lambda p: float(p[1] or 0))
            table.add_row(name, str(len(points)), fmt(sum(values) / len(values), unit), fmt(peak, unit), fmt(at))
        console.print(table)
        return
    table = Table(*result.columns, title=q.title)
    for row in result.rows:
        table.add_row(*(fmt(v, _unit_of(c)) for c, v in zip(result.columns, row)))
    console.print(table)


def _utc_text(at: datetime) -> str:
    """``at`` (aware, or naive UTC) as ``2026-11-30 22:55:00 UTC``."""
    return f"{(at.astimezone(UTC) if at.tzinfo else at):%Y-%m-%d %H:%M:%S} UTC"


def _iso_utc(at: datetime) -> str:
    """``at`` (aware, or naive UTC) as ISO 8601 with its offset: ``2026-11-30T22:55:00+00:00``
    (``-o json`` says the zone whether the window came from the data or from the caller)."""
    return (at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)).isoformat()


def _no_data(start: datetime | None, end: datetime | None, first: datetime | None, last: datetime | None,
             as_json: bool) -> None:
    """``report`` over a window without data: the window asked (UTC; an unset end is the first or
    last event) and the audit log's extent on stderr; stdout gets nothing (with ``-o json`` the
    asked window and no reports), as a ``jobs`` filter that matches nothing (README: exit 0)."""
    asked_from = _utc_text(start) if start else "the first event"
    asked_to = _utc_text(end) if end else "just after the last event"
    held = (f"the audit log holds events from {_utc_text(first)} to {_utc_text(last)}" if first and last
            else "the audit log holds no event")
    if as_json:
        console.print_json(strict_json({"window": {"from": _iso_utc(start) if start else None,
                                                   "to": _iso_utc(end) if end else None},
                                        "reports": {}}))
    err.print(f"no data in the window from {asked_from} to {asked_to} (end exclusive); {held}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``report`` to ``app``."""

    @app.command()
    def report(
        start_text: str = typer.Option("", "--from", show_default=False,
                                       help="Window start: ISO-8601 (2026-11-30, 2026-11-30T22:55:00Z, "
                                            "...+09:00; no zone = UTC) or an age (2h, 1.5d); default: the "
                                            "first event."),
        end_text: str = typer.Option("", "--to", show_default=False,
                                     help="Window end (exclusive), same forms; a date alone = the end of that "
                                          "day (--from 2026-11-30 --to 2026-11-30 is that day); default: just "
                                          "after the last event."),
        html: Optional[Path] = typer.Option(None, "--html", help="Also write one self-contained HTML page with charts."),
        only: list[str] = typer.Option([], "--only", help="Only this report (repeatable); see --list."),
        bucket: Optional[int] = typer.Option(None, "--bucket", min=1,
                                             help="Time-series bucket in seconds (default: window / 120)."),
        output: Output = typer.Option(Output.table, "--output", "-o", help="table (for people) or json (for scripts)"),
        data_dir: Path = typer.Option(Path(".fedsched"), "--data-dir", envvar="FEDSCHED_DATA_DIR",
                                      help="Data dir of the embedded store (while `fedsched up` holds it, the "
                                           "running system answers)."),
        nats_url: str = typer.Option("", "--nats-url", envvar="FEDSCHED_NATS_URL",
                                     help="Ask the running system over this NATS instead of opening the store."),
        clickhouse_url: str = typer.Option("", "--clickhouse-url", envvar="FEDSCHED_CLICKHOUSE_URL",
                                           help="Read this ClickHouse server (http://user:pw@host:8123) instead."),
        database: str = typer.Option("fedsched", "--database", envvar="FEDSCHED_CLICKHOUSE_DATABASE",
                                     help="ClickHouse database of the federation's tables."),
        prefix: str = typer.Option("fed", "--prefix", envvar="FEDSCHED_SUBJECT_PREFIX",
                                   help="Subject prefix of the running system (with --nats-url)."),
        token: str = typer.Option("", "--token", envvar="FEDSCHED_TOKEN", show_default=False,
                                  help="With --nats-url: an admin's token (default: <FEDSCHED_DATA_DIR or "
                                       ".fedsched>/admin.token)."),
        list_reports: bool = typer.Option(False, "--list", help="List the reports and exit."),
        grafana_dashboard: Optional[Path] = typer.Option(None, "--grafana-dashboard",
                                                         help="Write the Grafana dashboard JSON (same SQL) and exit."),
    ):
        """Print the federation's reports -- waits, cross-region work, transfers, failures,
        utilisation, queues, capacity hints, chargeback, approvals -- for a time window.

        Every figure is SQL over the ClickHouse audit log (the saved queries in
        fedapp/reports/queries.py, also behind the Grafana dashboard).
        """
        from fedapp.reports import REPORTS, data_window, run_reports
        from fedapp.reports.grafana import dashboard_json
        from fedapp.reports.html import html_page
        from fedapp.reports.run import Window, event_span, events_in, naive_utc

        now = datetime.now(UTC)
        start = time_option(start_text, "--from", now)
        end = time_option(end_text, "--to", now, end_of_day=True, future=True)
        if start is not None and end is not None and start >= end:
            err.print(error_line("--from", f"{start:%Y-%m-%d %H:%M:%S} UTC is not before --to "
                                           f"{end:%Y-%m-%d %H:%M:%S} UTC"))
            raise typer.Exit(2)
        if list_reports:
            for q in REPORTS:
                console.print(styled((q.name, "bold"), f": {q.description}"), highlight=False)
            return
        unknown = [n for n in only if n not in {q.name for q in REPORTS}]
        if unknown:  # before any query: a window without data must not hide a typo
            err.print(error_line("error:", f"unknown report {unknown[0]!r}; `fedsched report --list` shows them"))
            raise typer.Exit(2)
        if grafana_dashboard is not None:
            grafana_dashboard.write_text(dashboard_json(), "utf-8")
            console.print(f"Grafana dashboard written to {grafana_dashboard}")
            return
        try:
            running = None if nats_url or clickhouse_url else running_system(data_dir, token or None)
            if nats_url:
                query, source = nats_query(nats_url, prefix, token or None), f"running system at {nats_url}"
            elif running is not None:  # `fedsched up` holds the embedded store: ask it
                url, running_prefix, running_token = running
                query, source = nats_query(url, running_prefix, running_token), f"running system on {data_dir}"
            else:
                query = store_query(data_dir, clickhouse_url, database)
                source = clickhouse_url.split("@")[-1] if clickhouse_url else f"chDB {data_dir}/clickhouse"
            first, last = event_span(query, database)
            lo = start or first
            hi = end or (last + timedelta(milliseconds=1) if last else None)
            results = []
            if lo is not None and hi is not None and naive_utc(lo) < naive_utc(hi):
                window = data_window(query, database, start=lo, end=hi)
                if bucket:
                    window = Window(window.start, window.end, bucket)
                if events_in(query, database, window):
                    results = run_reports(query, database, window, only or None)
        except KeyError as e:
            err.print(error_line("error:", f"unknown report {e}; `fedsched report --list` shows them"))
            raise typer.Exit(2) from None
        except FedError as e:
            err.print(error_line("error:", e))
            raise typer.Exit(1) from None
        if not results:  # nothing in the window asked: say so, never invent one
            _no_data(start, end, first, last, output == "json")
            if html is not None:
                err.print(f"no HTML report written to {html}")
            return
        if output == "json":
            body = {"window": {"from": _iso_utc(window.start), "to": _iso_utc(window.end),
                               "bucket_s": window.bucket_s},
                    "reports": {r.query.name: {"columns": list(r.columns), "rows": [list(x) for x in r.rows]}
                                for r in results}}
            console.print_json(strict_json(body))
        else:
            console.print(f"window {window.start:%Y-%m-%d %H:%M:%S} -> {window.end:%Y-%m-%d %H:%M:%S} UTC, "
                          f"buckets of {window.bucket_s} s, from {source}", highlight=False)
            for r in results:
                _print_report(r)
        if html is not None:
            html.write_text(html_page(results, window, source=source), "utf-8")
            (err if output == "json" else console).print(f"HTML report written to {html}")
