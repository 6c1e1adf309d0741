"""The replay summary, computed by SQL from ClickHouse (never from a service's memory).

Definitions (all times on the business clock):

* ``jobs.submitted`` = accepted (``job.submitted`` events) + refused (``submission.rejected``);
  ``placed`` = jobs with at least one ``job.placed``; ``pending`` = accepted jobs never placed;
  so ``placed + rejected + pending == submitted``.
* ``wait_seconds`` = first ``job.started`` minus ``job.submitted``, per started job.
* ``cross_region_jobs`` = jobs that started at least once outside their home region.
* ``gpu_utilization`` = GPU-seconds of all usage rows / (GPU capacity x span), capacity from the
  latest inventory of every cluster, span from the first submission to the last attempt end;
  ``gpu_utilization_arrivals`` the same over the arrival window only (first to last submission,
  usage clipped to it), which a long-running straggler cannot dilute.
* ``cost_total`` = sum of ``usage.cost``, compute and transfer lines (Decimal, as a string);
  ``usage_rows`` = compute lines (one per ended attempt).
* ``capacity_check`` = per cluster, the most milli-GPUs in use at once (from started/ended
  events) against its capacity: ``over_allocated`` must be empty.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from fedsched.store import Store


def _q(store: Store, sql: str, **params: Any):
    return store.query(sql.replace("{db}", store.database), params)


def build_report(store: Store, *, policy: str, wall_seconds: float, **extra: Any) -> dict:
    """The replay report (see the module docstring for each figure's definition)."""
    accepted = int(_q(store, "SELECT uniqExact(job_id) FROM {db}.events WHERE type = 'job.submitted'").scalar() or 0)
    refused = int(_q(store, "SELECT count() FROM {db}.events WHERE type = 'submission.rejected'").scalar() or 0)
    counts = _q(store, """
        SELECT uniqExactIf(job_id, type = 'job.placed'), uniqExactIf(job_id, type = 'job.started'),
               uniqExactIf(job_id, type = 'job.finished'), uniqExactIf(job_id, type = 'job.failed'),
               uniqExactIf(job_id, type IN ('job.cancelled')) + uniqExactIf(job_id, type = 'job.stopped'
                   AND JSONExtractString(payload, 'reason') = 'cancelled')
        FROM {db}.events WHERE type IN ('job.placed', 'job.started', 'job.finished', 'job.failed', 'job.cancelled',
                                        'job.stopped')""").rows[0]
    placed, started, finished, failed, cancelled = (int(x) for x in counts)
    # jobs ended before any placement (cancelled while queued, or unschedulable_timeout): not pending
    ended_unplaced = int(_q(store, """
        SELECT uniqExact(job_id) FROM {db}.events WHERE type = 'job.cancelled'
          AND job_id NOT IN (SELECT job_id FROM {db}.events WHERE type = 'job.placed')""").scalar() or 0)
    waits = _q(store, """
        WITH s AS (SELECT job_id, min(occurred_at) AS at FROM {db}.events WHERE type = 'job.submitted' GROUP BY job_id),
             r AS (SELECT job_id, min(occurred_at) AS at FROM {db}.events WHERE type = 'job.started' GROUP BY job_id)
        SELECT count(), quantileExact(0.5)(w), quantileExact(0.95)(w), avg(w), max(w)
        FROM (SELECT dateDiff('millisecond', s.at, r.at) / 1000.0 AS w FROM s INNER JOIN r USING job_id)""").rows[0]
    cross = int(_q(store, """
        SELECT uniqExact(job_id) FROM {db}.events
        WHERE type = 'job.started' AND JSONExtractBool(payload, 'cross_region')""").scalar() or 0)
    usage = _q(store, """
        SELECT sum(gpu_seconds), sum(cost), any(currency), min(started_at), max(ended_at), countIf(line = 'compute')
        FROM {db}.usage""").rows[0]
    gpu_seconds = float(usage[0] or 0.0)
    cost = usage[1] if usage[1] is not None else Decimal(0)
    capacity = _q(store, """
        SELECT cluster, argMax(gpus, at) FROM (
            SELECT cluster, at, sum(gpus) AS gpus FROM {db}.inventory GROUP BY cluster, at)
        GROUP BY cluster ORDER BY cluster""").rows
    total_gpus = sum(int(g) for _, g in capacity)
    span = _q(store, """
        SELECT dateDiff('millisecond', (SELECT min(occurred_at) FROM {db}.events WHERE type = 'job.submitted'),
                        (SELECT max(occurred_at) FROM {db}.events
                         WHERE type IN ('job.finished', 'job.failed', 'job.stopped'))) / 1000.0""").scalar()
    span = float(span or 0.0)
    utilization = gpu_seconds / (total_gpus * span) if total_gpus and span > 0 else 0.0
    window = _q(store, """
        WITH w AS (SELECT min(occurred_at) AS a, max(occurred_at) AS b FROM {db}.events WHERE type = 'job.submitted')
        SELECT sum(gpu_milli / 1000 * greatest(0, dateDiff('millisecond', greatest(started_at, (SELECT a FROM w)),
                                                                         least(ended_at, (SELECT b FROM w))) / 1000.0)),
               dateDiff('millisecond', (SELECT a FROM w), (SELECT b FROM w)) / 1000.0
        FROM {db}.usage""").rows[0]
    window_util = float(window[0] or 0) / (total_gpus * float(window[1])) if total_gpus and window[1] else 0.0
    audit_events = int(_q(store, "SELECT count() FROM {db}.events").scalar() or 0)
    by_region = [dict(zip(("region", "jobs_started", "cross_region_in", "gpu_hours", "cost"), row)) for row in _q(store, """
        SELECT region, uniqExact(job_id), uniqExactIf(job_id, cross_region = 1), round(sum(gpu_seconds) / 3600, 1),
               toString(sum(cost))
        FROM {db}.usage GROUP BY region ORDER BY region""").rows]
    return {
        "jobs": {"submitted": accepted + refused, "placed": placed, "started": started, "finished": finished,
                 "failed": failed, "cancelled": cancelled, "rejected": refused, "pending": accepted - placed - ended_unplaced,
                 "unplaceable": int(extra.get("unplaceable", 0))},
        "wait_seconds": {"count": int(waits[0] or 0), "p50": _round(waits[1]), "p95": _round(waits[2]),
                         "mean": _round(waits[3]), "max": _round(waits[4])},
        "cross_region_jobs": cross,
        "cross_region_ratio": round(cross / started, 4) if started else 0.0,
        "gpu_utilization": round(utilization, 4),
        "gpu_utilization_arrivals": round(window_util, 4),
        "gpu_hours": round(gpu_seconds / 3600, 1),
        "cost_total": str(cost),
        "currency": usage[2] or "",
        "audit_events": audit_events,
        "usage_rows": int(usage[5] or 0),
        "capacity_gpus": total_gpus,
        "span_seconds": round(span, 1),
        "capacity_check": capacity_check(store),
        "by_region": by_region,
        "policy": policy,
        "wall_seconds": round(wall_seconds, 1),
        "replay": {k: v for k, v in extra.items() if k not in ("unplaceable",)},
    }


def _round(x) -> float:
    return round(float(x), 1) if x is not None else 0.0


def capacity_check(store: Store) -> dict:
    """Per cluster, peak milli-GPUs in use (from the event log) vs capacity; over-allocations listed.

    Usage at time t = sum of ``gpu_milli`` of attempts started at or before t and not yet ended
    (ends are applied before starts at the same instant, as the agent frees before it admits).
    """
    rows = _q(store, """
        WITH deltas AS (
            SELECT cluster, occurred_at AS t, if(type = 'job.started', 1, 0) AS is_start,
                   if(type = 'job.started', 1, -1) * JSONExtractInt(payload, 'gpu_milli') AS d
            FROM {db}.events
            WHERE type IN ('job.started', 'job.finished', 'job.failed', 'job.stopped')),
        running AS (
            SELECT cluster, sum(d) OVER (PARTITION BY cluster ORDER BY t, is_start
                                         ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS in_use
            FROM deltas)
        SELECT cluster, max(in_use) FROM running GROUP BY cluster ORDER BY cluster""").rows
    capacity = dict(_q(store, """
        SELECT cluster, argMax(gpus, at) * 1000 FROM (
            SELECT cluster, at, sum(gpus) AS gpus FROM {db}.inventory GROUP BY cluster, at)
        GROUP BY cluster""").rows)
    peak = {c: int(v) for c, v in rows}
    over = {c: {"peak_milli": v, "capacity_milli": int(capacity.get(c, 0))}
            for c, v in peak.items() if v > int(capacity.get(c, 0))}
    return {"peak_milli": peak, "capacity_milli": {c: int(v) for c, v in capacity.items()}, "over_allocated": over}
