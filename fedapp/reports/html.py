"""One self-contained HTML page of the reports: inline CSS and inline SVG charts, no scripts,
no network (it opens from a file, a mail attachment or an air-gapped laptop).

Layout: a header with the window and headline figures, a table of contents, then one section
per report with its chart(s) -- horizontal bars for comparisons, lines for time series -- and
its table. Every chart is a ``<figure class="chart">`` with ``data-chart`` (report name),
``data-kind`` (``bar`` or ``line``) and ``data-points`` (values drawn), and every drawn value
carries a ``<title>`` (the browser shows it on hover), so the page can be checked by parsing.
"""

from __future__ import annotations

import html
import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Iterable, Sequence

from fedsched.clock import as_utc
from fedapp.reports.run import ReportResult, Window

#: Series colours (Okabe-Ito, readable for colour-blind people), then a few more.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
           "#7f7f7f", "#8c564b", "#17becf", "#bcbd22")

_CSS = """
:root { --fg: #1d2330; --muted: #5d6678; --line: #dfe3ea; --bg: #f6f7f9; --card: #ffffff; --accent: #0072B2; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: var(--fg);
       background: var(--bg); }
header { background: #142033; color: #fff; padding: 24px 32px 20px; }
header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
header .window { color: #b8c4d8; }
.kpis { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 18px; }
.kpi { background: rgba(255,255,255,0.08); border-radius: 8px; padding: 10px 14px; min-width: 150px; }
.kpi .v { font-size: 20px; font-weight: 600; }
.kpi .k { color: #b8c4d8; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
nav { padding: 10px 32px; background: #fff; border-bottom: 1px solid var(--line); position: sticky; top: 0; }
nav a { color: var(--accent); text-decoration: none; margin-right: 16px; white-space: nowrap; }
main { padding: 8px 32px 40px; max-width: 1280px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 18px 22px;
          margin: 18px 0; }
section h2 { margin: 0 0 4px; font-size: 18px; }
section p.desc { margin: 0 0 12px; color: var(--muted); }
.charts { display: flex; flex-wrap: wrap; gap: 18px; }
figure.chart { margin: 0; flex: 1 1 520px; }
figure.chart figcaption { font-weight: 600; margin-bottom: 4px; }
svg text { font: 11px -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; fill: var(--fg); }
svg .axis { stroke: #9aa3b2; stroke-width: 1; }
svg .grid { stroke: var(--line); stroke-width: 1; }
svg .muted { fill: var(--muted); }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin-top: 4px; color: var(--muted); font-size: 12px; }
.legend span::before { content: ""; display: inline-block; width: 10px; height: 10px; border-radius: 2px;
                       margin-right: 5px; background: var(--c); vertical-align: -1px; }
.tablewrap { overflow-x: auto; max-height: 420px; overflow-y: auto; margin-top: 12px; border: 1px solid var(--line);
             border-radius: 6px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 5px 10px; border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; }
th { background: #f0f2f6; position: sticky; top: 0; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.badge.expand { background: #fde2d6; color: #a13a00; }
.badge.wait-bound { background: #fff1c4; color: #7a5a00; }
.badge.busy { background: #d8ecfa; color: #00507e; }
p.empty { color: var(--muted); font-style: italic; }
footer { color: var(--muted); padding: 0 32px 30px; font-size: 12px; }
"""


# --------------------------------------------------------------------------- formatting


def _num(value: Any) -> float | None:
    if value is None or isinstance(value, (tuple, list, dict)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt(value: Any, unit: str = "") -> str:
    """A value for people: ratios as percent, seconds as s/min/h, money with 2 decimals."""
    if value is None:
        return "–"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    if isinstance(value, Decimal):
        return f"{value:,.2f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    x = _num(value)
    if x is None:
        return str(value)
    if unit == "ratio":
        return f"{x * 100:.1f}%"
    if unit == "s":
        if abs(x) >= 7200:
            return f"{x / 3600:.1f} h"
        if abs(x) >= 120:
            return f"{x / 60:.1f} min"
        return f"{x:.2f} s"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:,.1f}"


def _unit_of(column: str, default: str = "") -> str:
    if column.endswith(("_ratio", "_rate", "_share")) or column in ("utilisation", "share_of_month", "share_of_tenant"):
        return "ratio"
    if column.endswith("_s") or column in ("p50", "p95"):
        return "s"
    return default


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


# --------------------------------------------------------------------------- charts


def _ticks(x: float, n: int = 4) -> tuple[float, float]:
    """(step, top) of a value axis from 0 covering ``x`` in about ``n`` round steps (1, 2, 2.5, 5 x 10^k)."""
    if x <= 0:
        return 0.25, 1.0
    raw = x / n
    exp = 10 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1, 2, 2.5, 5, 10) if raw <= m * exp)
    return step, step * math.ceil(x / step - 1e-9)


def bar_chart(name: str, title: str, categories: Sequence[str], series: dict[str, Sequence[Any]],
              unit: str = "", *, stacked: bool = False) -> str:
    """Horizontal bars: one group per category, one bar per series (or one bar of stacked
    series); None values are skipped."""
    drawn = sum(1 for vs in series.values() for v in vs if _num(v) is not None)
    if not categories or drawn == 0:
        return _empty_figure(name, "bar", title)
    if stacked:
        peak = max(sum(_num(vs[i]) or 0.0 for vs in series.values()) for i in range(len(categories)))
    else:
        peak = max(_num(v) or 0.0 for vs in series.values() for v in vs)
    step, top = _ticks(peak)
    label_w, width, bar_h, gap = 150, 720, 14, 10
    rows_per_group = 1 if stacked else len(series)
    group_h = rows_per_group * bar_h + gap
    plot_w = width - label_w - 80
    height = 28 + len(categories) * group_h + 10
    out = [f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="{_esc(title)}">']
    v = 0.0
    while v <= top + 1e-12:
        x = label_w + plot_w * v / top
        out.append(f'<line class="grid" x1="{x:.1f}" y1="18" x2="{x:.1f}" y2="{height - 8}"/>')
        out.append(f'<text class="muted" x="{x:.1f}" y="12" text-anchor="middle">{_esc(fmt(v, unit))}</text>')
        v += step
    y = 24
    for ci, cat in enumerate(categories):
        out.append(f'<text x="{label_w - 8}" y="{y + group_h / 2 - gap / 2 + 4:.1f}" text-anchor="end">'
                   f'{_esc(_short(cat, 24))}</text>')
        x0, total = float(label_w), 0.0
        for si, (sname, vs) in enumerate(series.items()):
            value = vs[ci] if ci < len(vs) else None
            x = _num(value)
            if x is None:
                continue
            w = max(0.0, plot_w * x / top)
            row_y = y if stacked else y + si * bar_h
            colour = PALETTE[si % len(PALETTE)]
            out.append(f'<rect x="{x0 if stacked else label_w:.1f}" y="{row_y:.1f}" width="{w:.1f}" '
                       f'height="{bar_h - 2}" fill="{colour}" data-series="{_esc(sname)}" data-label="{_esc(cat)}" '
                       f'data-value="{x!r}"><title>{_esc(cat)} · {_esc(sname)}: {_esc(fmt(value, unit))}</title></rect>')
            if stacked:
                x0 += w
                total += x
            else:
                out.append(f'<text class="muted" x="{label_w + w + 4:.1f}" y="{row_y + bar_h - 4:.1f}">'
                           f'{_esc(fmt(value, unit))}</text>')
        if stacked:
            out.append(f'<text class="muted" x="{x0 + 4:.1f}" y="{y + bar_h - 4:.1f}">{_esc(fmt(total, unit))}</text>')
        y += group_h
    out.append(f'<line class="axis" x1="{label_w}" y1="18" x2="{label_w}" y2="{height - 8}"/>')
    out.append("</svg>")
    return _figure(name, "bar", title, "".join(out), drawn, list(series))


#: Spacings of time-axis ticks (seconds), smallest first: round seconds, minutes, hours, days.
TICK_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600,
                12 * 3600, 86400, 2 * 86400, 7 * 86400, 14 * 86400, 30 * 86400, 90 * 86400, 180 * 86400,
                365 * 86400)


def time_ticks(t0: datetime, t1: datetime, max_ticks: int = 6) -> list[tuple[datetime, str]]:
    """Time-axis ticks for the span [``t0``, ``t1``] (naive UTC or aware): the smallest step of
    :data:`TICK_STEPS_S` giving at most ``max_ticks`` ticks, at multiples of the step since the
    Unix epoch (round minutes, hours, days), each labelled at the step's resolution
    (``%H:%M:%S`` below a minute, ``%m-%d %H:%M`` below a day, ``%Y-%m-%d`` from a day), so no
    two labels are equal. A span holding no multiple of even the largest step gets ``t0``."""
    epoch = datetime(1970, 1, 1) if t0.tzinfo is None else datetime(1970, 1, 1, tzinfo=UTC)
    a, b = (t0 - epoch).total_seconds(), (t1 - epoch).total_seconds()
    step = next((s for s in TICK_STEPS_S if math.floor(b / s) - math.ceil(a / s) + 1 <= max_ticks),
                TICK_STEPS_S[-1])
    label = "%H:%M:%S" if step < 60 else "%m-%d %H:%M" if step < 86400 else "%Y-%m-%d"
    ticks = [epoch + timedelta(seconds=k * step) for k in range(math.ceil(a / step), math.floor(b / step) + 1)]
    return [(t, t.strftime(label)) for t in ticks] or [(t0, t0.strftime(label))]


def line_chart(name: str, title: str, times: Sequence[datetime], series: dict[str, Sequence[Any]],
               unit: str = "") -> str:
    """Lines over time: one polyline per series (None values break nothing: they are skipped)."""
    drawn = sum(1 for vs in series.values() for v in vs if _num(v) is not None)
    if not times or drawn == 0:
        return _empty_figure(name, "line", title)
    width, height, left, right, top_pad, bottom = 720, 260, 56, 40, 12, 28
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    t0, t1 = times[0], times[-1]
    span = max((t1 - t0).total_seconds(), 1.0)
    step, vmax = _ticks(max((_num(v) or 0.0) for vs in series.values() for v in vs))

    def px(t: datetime) -> float:
        return left + plot_w * (t - t0).total_seconds() / span

    def py(v: float) -> float:
        return top_pad + plot_h * (1 - v / vmax)

    out = [f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="{_esc(title)}">']
    v = 0.0
    while v <= vmax + 1e-12:
        out.append(f'<line class="grid" x1="{left}" y1="{py(v):.1f}" x2="{width - right}" y2="{py(v):.1f}"/>')
        out.append(f'<text class="muted" x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{_esc(fmt(v, unit))}</text>')
        v += step
    for t, label in time_ticks(t0, t1):
        out.append(f'<text class="muted" x="{px(t):.1f}" y="{height - 8}" text-anchor="middle">'
                   f'{_esc(label)}</text>')
    out.append(f'<line class="axis" x1="{left}" y1="{top_pad + plot_h}" x2="{width - right}" y2="{top_pad + plot_h}"/>')
    for si, (sname, vs) in enumerate(series.items()):
        pts = [(px(t), py(_num(v))) for t, v in zip(times, vs) if _num(v) is not None]
        if not pts:
            continue
        peak = max((_num(v) for v in vs if _num(v) is not None), default=0.0)
        colour = PALETTE[si % len(PALETTE)]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{points}" '
                   f'data-series="{_esc(sname)}" data-count="{len(pts)}">'
                   f'<title>{_esc(sname)}: peak {_esc(fmt(peak, unit))}</title></polyline>')
    out.append("</svg>")
    return _figure(name, "line", title, "".join(out), drawn, list(series))


def _short(text: str, n: int) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "…"


def _figure(name: str, kind: str, title: str, svg: str, points: int, legend: list[str]) -> str:
    items = "".join(f'<span style="--c:{PALETTE[i % len(PALETTE)]}">{_esc(s)}</span>' for i, s in enumerate(legend))
    return (f'<figure class="chart" data-chart="{_esc(name)}" data-kind="{kind}" data-points="{points}">'
            f'<figcaption>{_esc(title)}</figcaption>{svg}<div class="legend">{items}</div></figure>')


def _empty_figure(name: str, kind: str, title: str) -> str:
    return (f'<figure class="chart" data-chart="{_esc(name)}" data-kind="{kind}" data-points="0">'
            f'<figcaption>{_esc(title)}</figcaption><p class="empty">No data in this window.</p></figure>')


# --------------------------------------------------------------------------- tables


def table(result: ReportResult, *, limit: int = 500) -> str:
    """The result as an HTML table (at most ``limit`` rows; a note says how many were left out)."""
    if not result.rows:
        return '<p class="empty">No rows in this window.</p>'
    cols = result.columns
    head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
    body = []
    for row in result.rows[:limit]:
        cells = []
        for c, v in zip(cols, row):
            if c == "hint" and v:
                cells.append(f'<td><span class="badge {_esc(v)}">{_esc(v)}</span></td>')
            elif _num(v) is not None and not isinstance(v, str):
                cells.append(f'<td class="num">{_esc(fmt(v, _unit_of(c)))}</td>')
            else:
                cells.append(f"<td>{_esc(fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = len(result.rows) - limit
    note = f'<p class="empty">{more} more rows not shown (use `fedsched report -o json`).</p>' if more > 0 else ""
    return f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>{note}'


# --------------------------------------------------------------------------- sections


def _pivot(result: ReportResult, x: str, series: str, y: str) -> tuple[list, dict[str, list]]:
    rows = result.dicts()
    xs = sorted({r[x] for r in rows})
    index = {v: i for i, v in enumerate(xs)}
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(str(r[series]), [None] * len(xs))[index[r[x]]] = r[y]
    return xs, dict(sorted(out.items()))


def _charts(result: ReportResult) -> str:
    q = result.query
    rows = result.dicts()
    if q.shape == "timeseries":
        times, series = _pivot(result, q.x, q.series, q.y[0])
        return line_chart(q.name, q.title, times, series, q.unit)
    if q.shape != "bar":
        return ""
    if q.name == "chargeback":  # cost by tenant and month: the finance view
        by: dict[tuple[str, str], Decimal] = {}
        for r in rows:
            by[(r["tenant"], r["month"])] = by.get((r["tenant"], r["month"]), Decimal(0)) + Decimal(str(r["cost"]))
        tenants = sorted({t for t, _ in by}, key=lambda t: -sum(v for (tt, _), v in by.items() if tt == t))
        months = sorted({m for _, m in by})
        series = {m: [by.get((t, m)) for t in tenants] for m in months}
        currency = rows[0].get("currency", "") if rows else ""
        return bar_chart(q.name, f"Cost by tenant, stacked by month ({currency})", tenants, series, "", stacked=True)
    cats = [str(r[q.x]) for r in rows]
    series = {y: [r.get(y) for r in rows] for y in q.y}
    return bar_chart(q.name, q.title, cats, series, q.unit)


def _kpis(summary: ReportResult | None, results: dict[str, ReportResult]) -> str:
    if summary is None or not summary.rows:
        return ""
    s = summary.dicts()[0]
    cross = results.get("cross_region")
    ratio = None
    if cross is not None and cross.rows:
        started = sum(int(r["jobs_started"]) for r in cross.dicts())
        crossed = sum(int(r["cross_region_jobs"]) for r in cross.dicts())
        ratio = crossed / started if started else None
    currency = s.get("currency") or ""
    items = [("jobs submitted", fmt(s.get("jobs_submitted"))), ("jobs started", fmt(s.get("jobs_started"))),
             ("wait p50 / p95", f"{fmt(s.get('wait_p50_s'), 's')} / {fmt(s.get('wait_p95_s'), 's')}"),
             ("cross-region", fmt(ratio, "ratio")), ("GPU-hours", fmt(s.get("gpu_hours"))),
             (f"cost ({currency})", fmt(s.get("total_cost"))), (f"transfer ({currency})", fmt(s.get("transfer_cost"))),
             ("audit events", fmt(s.get("audit_events")))]
    failovers = results.get("failovers")
    if failovers is not None:  # attempts lost with their cluster (each moved or waiting)
        items.append(("failovers", fmt(len(failovers.rows))))
    return '<div class="kpis">' + "".join(
        f'<div class="kpi"><div class="v">{_esc(v)}</div><div class="k">{_esc(k)}</div></div>' for k, v in items) + "</div>"


#: Sections of the page: (anchor, heading, reports shown together).
SECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("waits", "Submit-to-start time", ("wait_by_region", "wait_by_kind", "wait_by_tenant")),
    ("cross", "Cross-region jobs", ("cross_region",)),
    ("transfer", "Transfer overhead", ("transfer_overhead",)),
    ("failures", "Failures by cluster", ("failure_by_cluster",)),
    ("utilisation", "GPU utilisation over time", ("gpu_utilisation",)),
    ("queue", "Queue length over time", ("queue_length",)),
    ("capacity", "Capacity and expansion hints", ("capacity_hints",)),
    ("chargeback", "Chargeback", ("chargeback",)),
    ("approvals", "Who approved what", ("approvals",)),
    ("failovers", "Failovers and reconciliation", ("failovers", "reconciliation")),
)


def html_page(results: Iterable[ReportResult], window: Window, *, source: str = "",
              generated_at: datetime | None = None) -> str:
    """The whole page for ``results`` (from :func:`~fedapp.reports.run.run_reports`)."""
    by_name = {r.query.name: r for r in results}
    when = as_utc(generated_at or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC")
    span = f"{window.start:%Y-%m-%d %H:%M:%S} → {window.end:%Y-%m-%d %H:%M:%S} UTC"
    nav = "".join(f'<a href="#{a}">{_esc(h)}</a>' for a, h, names in SECTIONS if any(n in by_name for n in names))
    sections = []
    for anchor, heading, names in SECTIONS:
        shown = [by_name[n] for n in names if n in by_name]
        if not shown:
            continue
        charts = "".join(_charts(r) for r in shown)
        parts = [f'<section id="{anchor}"><h2>{_esc(heading)}</h2>']
        parts.append("".join(f'<p class="desc">{_esc(r.query.description)}</p>' for r in shown[:1]))
        if charts:
            parts.append(f'<div class="charts">{charts}</div>')
        for r in shown:
            if len(shown) > 1:
                parts.append(f"<h3>{_esc(r.query.title)}</h3>")
            parts.append(table(r))
        parts.append("</section>")
        sections.append("".join(parts))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>fedsched report · {_esc(span)}</title><style>{_CSS}</style></head><body>"
            f"<header><h1>fedsched · federation report</h1>"
            f'<div class="window">{_esc(span)} · time-series buckets of {_esc(fmt(window.bucket_s, "s"))}'
            f'{" · " + _esc(source) if source else ""}</div>{_kpis(by_name.get("summary"), by_name)}</header>'
            f"<nav>{nav}</nav><main>{''.join(sections)}</main>"
            f"<footer>Generated {when} by <code>fedsched report</code> from the ClickHouse audit log; the same SQL "
            f"powers the Grafana dashboard in deploy/grafana/.</footer></body></html>")
