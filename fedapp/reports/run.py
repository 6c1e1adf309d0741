"""Running the saved queries over a window: one narrow I/O seam, everything else pure.

A report run needs only ``query(sql, parameters) -> QueryResult`` (:data:`QueryFn`): a
:class:`~fedsched.store.Store` (embedded or server) or the running system's query service over
NATS (see :mod:`fedapp.cli.reports`). The window defaults to the extent of the audit log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Callable, Iterable

from fedapp.reports.queries import BY_NAME, REPORTS, SavedQuery, render
from fedsched.store import QueryResult

#: The one I/O seam: run ``sql`` with ``{name:Type}`` parameters.
QueryFn = Callable[[str, dict[str, Any]], QueryResult]

#: Time series aim at about this many buckets over the window.
DEFAULT_POINTS = 120


@dataclass(frozen=True, slots=True)
class Window:
    """A report window [start, end) in naive UTC, and the time-series bucket size (seconds)."""

    start: datetime
    end: datetime
    bucket_s: int

    def parameters(self) -> dict[str, Any]:
        """The query parameters ``from``, ``to``, ``bucket``."""
        return {"from": self.start, "to": self.end, "bucket": self.bucket_s}


@dataclass(frozen=True, slots=True)
class ReportResult:
    """One saved query's result."""

    query: SavedQuery
    columns: tuple[str, ...]
    rows: list[tuple]

    def dicts(self) -> list[dict[str, Any]]:
        """Rows as dicts keyed by column name."""
        return [dict(zip(self.columns, r)) for r in self.rows]


def naive_utc(dt: datetime) -> datetime:
    """``dt`` as naive UTC (aware values are converted; naive ones are taken as UTC)."""
    return dt.astimezone(UTC).replace(tzinfo=None) if dt.tzinfo else dt


def bucket_for(start: datetime, end: datetime, points: int = DEFAULT_POINTS) -> int:
    """A bucket size (seconds) giving about ``points`` buckets: ``ceil(span / points)``, at least 1 s."""
    span = max((end - start).total_seconds(), 1.0)
    return max(1, math.ceil(span / points))


def data_window(query: QueryFn, database: str, *, start: datetime | None = None, end: datetime | None = None,
                points: int = DEFAULT_POINTS) -> Window:
    """The window to report on: ``start``/``end`` where given, else the first event / just after
    the last one (so every event is inside).
    """
    if start is None or end is None:
        first, last = event_span(query, database)
        if start is None:
            start = first or datetime(1970, 1, 1)
        if end is None:
            end = (last + timedelta(milliseconds=1)) if last else start + timedelta(seconds=1)
    start, end = naive_utc(start), naive_utc(end)
    if end <= start:
        end = start + timedelta(seconds=1)
    return Window(start, end, bucket_for(start, end, points))


def event_span(query: QueryFn, database: str) -> tuple[datetime | None, datetime | None]:
    """The first and last ``occurred_at`` of the audit log (naive UTC); ``(None, None)`` when it
    holds no event."""
    first, last = query(f"SELECT min(occurred_at), max(occurred_at) FROM {database}.events", {}).rows[0]
    return _as_datetime(first), _as_datetime(last)


def events_in(query: QueryFn, database: str, window: Window) -> int:
    """How many audit-log events occurred in ``window`` [start, end)."""
    sql = (f"SELECT count() FROM {database}.events WHERE occurred_at >= {{from:DateTime64(3, 'UTC')}} "
           f"AND occurred_at < {{to:DateTime64(3, 'UTC')}}")
    return int(query(sql, {"from": window.start, "to": window.end}).rows[0][0])


def _as_datetime(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return naive_utc(value) if isinstance(value, datetime) and value.year > 1970 else None
    text = str(value)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    return naive_utc(dt) if dt.year > 1970 else None


def run_report(query: QueryFn, database: str, saved: SavedQuery, window: Window) -> ReportResult:
    """Run one saved query over ``window``."""
    result = query(render(saved, database=database), window.parameters())
    return ReportResult(saved, tuple(result.columns), list(result.rows))


def run_reports(query: QueryFn, database: str, window: Window,
                names: Iterable[str] | None = None) -> list[ReportResult]:
    """Run the saved queries (all, or those named) over ``window``, in :data:`REPORTS` order.

    Raises:
        KeyError: an unknown report name.
    """
    wanted = list(names) if names else [q.name for q in REPORTS]
    for n in wanted:
        if n not in BY_NAME:
            raise KeyError(n)
    return [run_report(query, database, q, window) for q in REPORTS if q.name in wanted]
