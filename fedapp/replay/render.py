"""Showing a replay to a person: a live progress line and the final summary tables."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedapp.cli.text import money


#: Wall seconds between two plain progress lines (not a terminal: logs and pipes).
PLAIN_EVERY_S = 3.0


def progress_line(p) -> str:
    """One plain progress line: trace day, submitted of total, and the jobs in each state."""
    return (f"trace day {p.trace_now_s / 86400:6.1f}/{p.trace_end_s / 86400:.1f}: submitted "
            f"{p.submitted}/{p.total}, running {p.running}, finished {p.finished}, failed {p.failed}, "
            f"cancelled {p.cancelled}, rejected {p.rejected}, unplaceable {p.unplaceable}")


@contextlib.contextmanager
def progress_display(console: Console, *, enabled: bool = True, quiet: bool = False,
                     every_s: float = PLAIN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> Iterator[Callable]:
    """A context whose value is ``update(progress)``; renders a rich progress bar if enabled,
    else (logs and pipes) a plain line at the first update, then at most one every ``every_s``
    wall seconds (``clock``: monotonic seconds) and only when the figures changed, and the last
    figures once more at the end if they were not the last line printed; nothing if quiet."""
    if quiet:
        yield lambda p: None
        return
    if not enabled:
        state = {"at": None, "printed": "", "latest": ""}

        def plain(p) -> None:
            line = progress_line(p)
            state["latest"] = line
            now = clock()
            if line != state["printed"] and (state["at"] is None or now - state["at"] >= every_s):
                state["at"], state["printed"] = now, line
                console.print(line, highlight=False)

        yield plain
        if state["latest"] and state["latest"] != state["printed"]:
            console.print(state["latest"], highlight=False)
        return
    bar = Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
                   TimeElapsedColumn(), console=console, transient=False)
    with bar:
        task = bar.add_task("replay", total=None, detail="starting")

        def update(p) -> None:
            done = p.finished + p.failed + p.cancelled + p.rejected
            bar.update(task, total=p.total or None, completed=done,
                       detail=f"day {p.trace_now_s / 86400:.1f}/{p.trace_end_s / 86400:.0f} | submitted {p.submitted} "
                              f"running {p.running} failed {p.failed} rejected {p.rejected} unplaceable {p.unplaceable}")

        yield update


def print_report(console: Console, report: dict) -> None:
    """The summary tables of a replay report."""
    jobs = report["jobs"]
    t = Table(title=f"replay summary (policy {report['policy']}, {report['wall_seconds']} s wall)", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k in ("submitted", "placed", "started", "finished", "failed", "cancelled", "rejected"):
        t.add_row(f"jobs {k}", str(jobs[k]))
    t.add_row("jobs pending (of them: can never fit as asked)", f"{jobs['pending']} ({jobs['unplaceable']})")
    w = report["wait_seconds"]
    t.add_row("wait p50 / p95 / mean (s)", f"{w['p50']} / {w['p95']} / {w['mean']}")
    t.add_row("cross-region jobs", f"{report['cross_region_jobs']} ({report['cross_region_ratio']:.1%})")
    t.add_row("GPU utilisation (whole span / arrival window)",
              f"{report['gpu_utilization']:.1%} / {report['gpu_utilization_arrivals']:.1%} of {report['capacity_gpus']} GPUs")
    t.add_row("GPU hours", str(report["gpu_hours"]))
    t.add_row("cost total", money(report["cost_total"], report["currency"]))
    t.add_row("audit events", str(report["audit_events"]))
    over = report["capacity_check"]["over_allocated"]
    t.add_row("over-allocated clusters", "none" if not over else ", ".join(over))
    console.print(t)
    if report.get("by_region"):
        r = Table(title="by region")
        for col in ("region", "jobs_started", "cross_region_in", "gpu_hours", "cost"):
            r.add_column(col, justify="right" if col != "region" else "left")
        for row in report["by_region"]:
            r.add_row(*(str(row[c]) for c in ("region", "jobs_started", "cross_region_in", "gpu_hours")),
                      money(row["cost"]))
        console.print(r)
    if report.get("rejected_reasons"):
        r = Table(title="rejected submissions (status: field)")
        r.add_column("reason")
        r.add_column("jobs", justify="right")
        for row in report["rejected_reasons"]:
            r.add_row(row["reason"], str(row["jobs"]))
        console.print(r)
