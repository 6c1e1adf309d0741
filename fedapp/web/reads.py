"""What the console reads from ClickHouse: a job's audited events and billed cost, and usage per
tenant over time -- through the same narrow seam as ``fedsched report``
(:data:`fedapp.reports.QueryFn`: the embedded store's read-only handle, a ClickHouse server, or the
running system's query service over NATS).

Authorisation is not decided here: the handlers first ask the gRPC API with the user's token
(``GetJob`` for a job's events and cost; ``ListTenants`` for the tenants whose usage is charted)
and pass only what the API let the user read. Every value reaches SQL as a server-side query
parameter (``{name:Type}``); the database name is a validated identifier from settings.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Sequence

from fedapp.reports.run import QueryFn, bucket_for, naive_utc

#: Events of one job shown on its page (newest last); older ones are counted, not listed.
MAX_JOB_EVENTS = 500

#: Payload keys left out of an event's one-line summary (the job page shows the spec itself).
SUMMARY_SKIP = frozenset({"spec"})

#: Buckets a usage chart aims at over its window.
CHART_POINTS = 60

#: The longest window a usage chart covers (ending at the newest usage line), so a refresh reads
#: a bounded slice of the table however long the federation has run.
CHART_SPAN = timedelta(days=7)


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One audited event of a job (``events`` table): business time (naive UTC), type, who
    produced it, for whom, where, the attempt it concerns, and a one-line summary of its payload."""

    at: datetime
    type: str
    producer: str
    actor: str
    region: str
    cluster: str
    attempt: int
    summary: str


@dataclass(frozen=True, slots=True)
class CostLine:
    """One billed usage line of a job (``usage`` table): compute per attempt interval or the
    egress of a transfer; ``gpu_hours`` = GPU-seconds / 3600; ``cost`` exact (Decimal)."""

    line: str
    attempt: int
    shard: int
    cluster: str
    card_model: str
    outcome: str
    gpu_hours: float
    cost: Decimal
    currency: str


@dataclass(frozen=True, slots=True)
class UsageSeries:
    """GPU-hours and cost per tenant per time bucket.

    Attributes:
        times: bucket starts (naive UTC), ascending, every bucket of the window.
        gpu_hours: tenant -> GPU-hours of the usage lines that ended in each bucket (one value
            per entry of ``times``).
        cost: tenant -> cost of those lines (Decimal, currency units), one per bucket.
        totals: tenant -> (GPU-hours, cost) over the window.
        currency: the lines' currency ("" when there are none).
        bucket_s: bucket size, seconds.
    """

    times: list[datetime]
    gpu_hours: dict[str, list[float]]
    cost: dict[str, list[Decimal]]
    totals: dict[str, tuple[float, Decimal]]
    currency: str
    bucket_s: int


class Reads:
    """The console's ClickHouse reads (see the module docstring).

    Args:
        query: run ``sql`` with parameters (blocking; called in a worker thread).
        database: the ClickHouse database (an identifier validated by settings).
    """

    def __init__(self, query: QueryFn, database: str) -> None:
        if not database.replace("_", "").isalnum():
            raise ValueError(f"not a database identifier: {database!r}")
        self.query = query
        self.database = database

    async def _run(self, sql: str, params: dict[str, Any]):
        return await asyncio.to_thread(self.query, sql, params)

    async def job_events(self, job_id: str, limit: int = MAX_JOB_EVENTS) -> tuple[list[JobEvent], int]:
        """The job's audited events in business-time order: the last ``limit`` of them and how
        many there are in all."""
        db = self.database
        total = (await self._run(f"SELECT count() FROM {db}.events WHERE job_id = {{job:String}}",
                                 {"job": job_id})).rows[0][0]
        # audit stores a refused message only as a security.rejected_message without the job id
        # (services.audit.service); a log written before it did may hold one as what it claimed
        # to be, named by (event id, subject) in such a record: shown as refused, never as the job's own
        rows = (await self._run(
            f"SELECT occurred_at AS at, type, producer, actor, region, cluster, attempt, payload, "
            f"(event_id, subject) IN (SELECT JSONExtractString(payload, 'event_id'), "
            f"JSONExtractString(payload, 'subject') FROM {db}.events WHERE type = 'security.rejected_message' "
            f"AND JSONExtractString(payload, 'job_id') = {{job:String}}) AS refused FROM "
            f"(SELECT * FROM {db}.events WHERE job_id = {{job:String}} ORDER BY occurred_at DESC, event_id DESC "
            f"LIMIT {{limit:UInt32}}) ORDER BY occurred_at, event_id", {"job": job_id, "limit": limit})).rows
        return [JobEvent(_time(r[0]), f"REFUSED {r[1]} (forged or misrouted; see security.rejected_message)"
                         if r[8] else str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), int(r[6]),
                         summarize_payload(str(r[7]))) for r in rows], int(total)

    async def job_cost(self, job_id: str) -> list[CostLine]:
        """The job's billed usage lines, by attempt and shard (compute first, then transfers)."""
        rows = (await self._run(
            f"SELECT line, attempt, shard, cluster, card_model, outcome, gpu_seconds / 3600 AS gpu_hours, "
            f"cost, currency FROM {self.database}.usage WHERE job_id = {{job:String}} "
            f"ORDER BY attempt, shard, line, started_at", {"job": job_id})).rows
        return [CostLine(str(r[0]), int(r[1]), int(r[2]), str(r[3]), str(r[4]), str(r[5]), float(r[6] or 0.0),
                         _money(r[7]), str(r[8])) for r in rows]

    async def usage_by_tenant(self, tenants: Sequence[str], *, start: datetime | None = None,
                              end: datetime | None = None, points: int = CHART_POINTS,
                              span: timedelta = CHART_SPAN) -> UsageSeries:
        """GPU-hours and cost of the usage lines of ``tenants`` by the bucket their interval ended
        in (lines land when an attempt ends, so a running job shows once it stops).

        The window is [``start``, ``end``) where given, else the extent of those lines cut to the
        last ``span`` before the newest one; the bucket is ``ceil(window / points)`` seconds
        (:func:`fedapp.reports.run.bucket_for`).
        """
        db = self.database
        names = sorted(set(tenants))
        if not names:
            return UsageSeries([], {}, {}, {}, "", 1)
        if start is None or end is None:
            first, last = (await self._run(
                f"SELECT min(ended_at), max(ended_at) FROM {db}.usage WHERE tenant IN {{tenants:Array(String)}}",
                {"tenants": names})).rows[0]
            first, last = _time_or_none(first), _time_or_none(last)
            if first is None or last is None:
                return UsageSeries([], {}, {}, {}, "", 1)
            end = end if end is not None else last + timedelta(milliseconds=1)
            start = start if start is not None else max(first, naive_utc(end) - span)
        start, end = naive_utc(start), naive_utc(end)
        bucket = bucket_for(start, end, points)
        rows = (await self._run(
            f"SELECT intDiv(toUInt64(dateDiff('millisecond', {{from:DateTime64(3)}}, ended_at)), "
            f"{{bucket_ms:UInt64}}) AS slot, tenant, sum(gpu_seconds) / 3600 AS gpu_hours, sum(cost) AS cost, "
            f"any(currency) AS currency FROM {db}.usage WHERE tenant IN {{tenants:Array(String)}} "
            f"AND ended_at >= {{from:DateTime64(3)}} AND ended_at < {{to:DateTime64(3)}} "
            f"GROUP BY slot, tenant ORDER BY slot, tenant",
            {"tenants": names, "from": start, "to": end, "bucket_ms": bucket * 1000})).rows
        slots = max(1, -(-int((end - start).total_seconds() * 1000) // (bucket * 1000)))
        times = [start + timedelta(seconds=bucket * i) for i in range(slots)]
        seen = sorted({str(r[1]) for r in rows})
        hours = {t: [0.0] * slots for t in seen}
        cost = {t: [Decimal(0)] * slots for t in seen}
        currency = ""
        for slot, tenant, gpu_h, c, cur in rows:
            i = min(int(slot), slots - 1)
            hours[str(tenant)][i] += float(gpu_h or 0.0)
            cost[str(tenant)][i] += _money(c)
            currency = currency or str(cur)
        totals = {t: (sum(hours[t]), sum(cost[t], Decimal(0))) for t in seen}
        return UsageSeries(times, hours, cost, totals, currency, bucket)


def cumulative(values: Sequence[float | Decimal]) -> list[float]:
    """Running totals of ``values`` (as floats, for drawing)."""
    out, total = [], 0.0
    for v in values:
        total += float(v)
        out.append(total)
    return out


def summarize_payload(payload: str, limit: int = 160) -> str:
    """A one-line ``key=value`` summary of an event's JSON payload (empty values and
    :data:`SUMMARY_SKIP` keys left out, long text cut with an ellipsis)."""
    try:
        body = json.loads(payload) if payload else {}
    except ValueError:
        body = payload
    if isinstance(body, dict):
        text = ", ".join(f"{k}={_short_value(v)}" for k, v in body.items()
                         if k not in SUMMARY_SKIP and v not in (None, "", [], {}, 0, 0.0))
    else:
        text = str(body)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short_value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        text = json.dumps(v, separators=(",", ":"), default=str)
    else:
        text = str(v)
    return text if len(text) <= 60 else text[:59] + "…"


def _money(value: Any) -> Decimal:
    if value is None:
        return Decimal(0)
    return value if isinstance(value, Decimal) else Decimal(str(value))


def _time(value: Any) -> datetime:
    t = _time_or_none(value)
    return t if t is not None else datetime(1970, 1, 1)


def _time_or_none(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        t = value
    elif value is None:
        return None
    else:
        try:
            t = datetime.fromisoformat(str(value))
        except ValueError:
            return None
    t = t.astimezone(UTC).replace(tzinfo=None) if t.tzinfo else t
    return t if t.year > 1970 else None
