"""Billing's pure core: which usage lines an event makes, and what they cost.

No I/O, no clock: every function maps an event (and the price catalog) to values.

Two kinds of line (``usage.line``):

* ``compute`` -- one per attempt interval that ended (``job.finished``, ``job.failed``,
  ``job.stopped``) after it had started. Only the times come from the agent's status (its
  ``started_at`` and the ending event's time); what ran, for whom, where and how big -- tenant,
  project, region, zone, cluster, card model, kind, GPU and CPU demand, cross-region -- come from
  the federation's own placement of that attempt (:class:`PlacementRecord`, from the
  scheduler's ``job.placed``), never from the status payload (issue 14: an agent speaks only for
  the attempts placed on its cluster; :mod:`fedsched.trust`). The start is never before the
  placement. The interval [started_at, ended_at] is taken at millisecond precision (what the
  store keeps), ``ms = ended_at - started_at``:

  - GPU work:  ``gpu_seconds = gpu_milli / 1000 * ms / 1000`` and
    ``cost = sum over price segments of gpu_milli / 1000 * segment_ms / 3_600_000 * gpu_hour(region, card, segment)``;
  - CPU-only work: ``cost = sum of cpu_milli / 1000 * segment_ms / 3_600_000 * cpu_core_hour(region, segment)``.

  A price segment is a stretch of the interval with one time-of-day factor (the whole interval
  when the catalog has none). ``unit_price`` is the GPU-hour (or core-hour) price when it was
  the same over the whole interval, else the effective average ``cost / hours``. Failed and
  stopped attempts are billed like finished ones and flagged (``flag``: ``failed``,
  ``preempted``, ``reclaimed``, ``cancelled``, ``cluster_lost`` -- ended by the scheduler when its cluster
  fell silent); a finished attempt has ``flag = ''``.
  ``usage_id`` = the ending event's id.

* ``transfer`` -- one per placement (``job.placed``) that moves data between regions
  (``transfer_bytes > 0``: the job's datasets that live outside the chosen cluster's region),
  ``cost = transfer_bytes / 1e9 * egress_per_gb``, at the placement's time (started_at = ended_at
  = placed at). ``usage_id`` = the placement event's id, so each attempt's transfer is billed once.

Money is Decimal, rounded half-even to 6 places once per line (:func:`fedsched.pricing.money`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from fedsched.clock import as_utc
from fedsched.dispatch import EventTable
from fedsched.events import Envelope, EventType, JobPlaced, JobStatus
from fedsched.pricing import PriceCatalog, money

#: Ending event type -> usage outcome.
ENDINGS = {EventType.JOB_FINISHED: "finished", EventType.JOB_FAILED: "failed", EventType.JOB_STOPPED: "stopped"}

USAGE_COLUMNS = ("usage_id", "line", "job_id", "attempt", "shard", "tenant", "project", "region", "zone", "cluster",
                 "card_model", "kind", "outcome", "flag", "cross_region", "started_at", "ended_at", "gpu_milli",
                 "gpu_seconds", "transfer_bytes", "unit_price", "price_version", "cost", "currency")

_MS_PER_HOUR = Decimal(3_600_000)
_BYTES_PER_GB = Decimal(1_000_000_000)


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One priced ``usage`` row (field order = :data:`USAGE_COLUMNS`).

    Times are aware UTC at millisecond precision; money is Decimal with 6 places.
    """

    usage_id: str
    line: str
    job_id: str
    attempt: int
    shard: int
    tenant: str
    project: str
    region: str
    zone: str
    cluster: str
    card_model: str
    kind: str
    outcome: str
    flag: str
    cross_region: int
    started_at: datetime
    ended_at: datetime
    gpu_milli: int
    gpu_seconds: float
    transfer_bytes: int
    unit_price: Decimal
    price_version: str
    cost: Decimal
    currency: str

    def row(self) -> list:
        """The row in :data:`USAGE_COLUMNS` order."""
        return [getattr(self, c) for c in USAGE_COLUMNS]

    @property
    def month(self) -> str:
        """``YYYY-MM`` of the interval's end (UTC): the month the line counts against."""
        return self.ended_at.strftime("%Y-%m")


def to_ms(dt: datetime) -> datetime:
    """``dt`` as aware UTC truncated to whole milliseconds (what a DateTime64(3, 'UTC') column
    keeps); a naive ``dt`` is taken to be UTC (:func:`~fedsched.clock.as_utc`), never local time."""
    dt = as_utc(dt)
    return dt.replace(microsecond=dt.microsecond // 1000 * 1000)


def _ms(a: datetime, b: datetime) -> int:
    return max(0, (b - a) // timedelta(milliseconds=1))


def price_segments(start: datetime, end: datetime, catalog: PriceCatalog) -> list[tuple[datetime, int]]:
    """Split [start, end) into stretches of one time-of-day factor: (segment start, milliseconds).

    Without time-of-day factors the whole interval is one segment. Boundaries are whole UTC
    hours (the catalog's factors are hour ranges).
    """
    total = _ms(start, end)
    if not catalog.time_of_day or total == 0:
        return [(start, total)]
    out: list[tuple[datetime, int]] = []
    t = start
    while t < end:
        nxt = min(end, t.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1))
        out.append((t, _ms(t, nxt)))
        t = nxt
    return out


def flag_of(outcome: str, reason: str) -> str:
    """The interruption flag of an attempt: '' finished, 'failed', or the stop reason."""
    if outcome == "finished":
        return ""
    if outcome == "failed":
        return "failed"
    return reason or "stopped"


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    """The federation's record of one placed attempt (from the scheduler's ``job.placed``):
    what billing prices an attempt by.

    Attributes:
        event_id: the ``job.placed`` event's id.
        job_id, attempt, shard: which attempt.
        tenant, project: its owners.
        region, zone, cluster: where it was placed.
        card_model: canonical card model ("" for CPU-only).
        kind: the job's kind.
        gpu_milli: milli-GPUs of the whole gang (``spec.total_gpu_milli``).
        cpu_milli: milli-cores of the whole gang (``spec.cpu_milli * spec.workers``).
        cross_region: placed outside the job's home region.
        placed_at: business time of the placement (aware UTC).
    """

    event_id: str
    job_id: str
    attempt: int
    shard: int
    tenant: str
    project: str
    region: str
    zone: str
    cluster: str
    card_model: str
    kind: str
    gpu_milli: int
    cpu_milli: int
    cross_region: bool
    placed_at: datetime

    @property
    def key(self) -> str:
        """Its key in billing's placement book: ``<job>.<attempt>.<shard>`` (:func:`placement_key`)."""
        return placement_key(self.job_id, self.attempt, self.shard)

    def to_json(self) -> dict:
        """JSON form (the placement book's value)."""
        return {**{f: getattr(self, f) for f in self.__slots__ if f != "placed_at"},
                "placed_at": self.placed_at.isoformat()}

    @classmethod
    def from_json(cls, data: dict) -> "PlacementRecord":
        """Parse :meth:`to_json`'s form.

        Raises:
            KeyError, ValueError, TypeError: not a placement record.
        """
        return cls(**{**{f: data[f] for f in cls.__slots__ if f != "placed_at"},
                      "placed_at": as_utc(datetime.fromisoformat(data["placed_at"]))})


def placement_key(job_id: str, attempt: int, shard: int) -> str:
    """Key of one attempt in the placement book: ``<job>.<attempt>.<shard>`` (job ids hold no dots)."""
    return f"{job_id}.{attempt}.{shard}"


def placement_record(e: Envelope) -> PlacementRecord | None:
    """The placement record of a ``job.placed`` event, else None.

    Raises:
        DecodeError: the payload does not validate.
    """
    if e.type != EventType.JOB_PLACED:
        return None
    p = e.payload_as(JobPlaced)
    spec = p.spec
    return PlacementRecord(
        event_id=e.event_id, job_id=e.job_id, attempt=e.attempt, shard=p.shard, tenant=e.tenant, project=e.project,
        region=e.region, zone=e.zone, cluster=e.cluster, card_model=p.card_model, kind=spec.kind.value,
        gpu_milli=spec.total_gpu_milli, cpu_milli=spec.cpu_milli * spec.workers, cross_region=p.cross_region,
        placed_at=to_ms(e.occurred_at))


def compute_line(e: Envelope, placed: PlacementRecord, catalog: PriceCatalog) -> UsageLine | None:
    """The ``compute`` line of an ending status event of the attempt ``placed``; None for other
    events or attempts that never started.

    Only ``e``'s times are used (``started_at``, not before the placement; the event's time as
    the end); everything else is the placement's. The caller has checked that ``e`` is about
    ``placed`` (:func:`fedsched.trust.check_placement`).

    Raises:
        DecodeError: the payload does not validate.
    """
    outcome = ENDINGS.get(e.type)
    if outcome is None:
        return None
    s = e.payload_as(JobStatus)
    if s.started_at is None:
        return None
    start, end = max(to_ms(s.started_at), placed.placed_at), to_ms(e.occurred_at)
    end = max(start, end)
    ms = _ms(start, end)
    cost = Decimal(0)
    prices = set()
    for seg_start, seg_ms in price_segments(start, end, catalog):
        at = seg_start
        if placed.gpu_milli > 0:
            unit = catalog.gpu_hour(placed.region, placed.card_model, at)
            cost += Decimal(placed.gpu_milli) / 1000 * Decimal(seg_ms) / _MS_PER_HOUR * unit
        else:
            unit = catalog.cpu_core_hour_in(placed.region, at)
            cost += Decimal(placed.cpu_milli) / 1000 * Decimal(seg_ms) / _MS_PER_HOUR * unit
        prices.add(unit)
    cost = money(cost)
    if len(prices) == 1:
        unit_price = prices.pop()
    else:  # several time-of-day prices: the effective average per GPU- (or core-) hour
        amount = Decimal(placed.gpu_milli or placed.cpu_milli) / 1000 * Decimal(ms) / _MS_PER_HOUR
        unit_price = money(cost / amount) if amount else Decimal(0)
    if outcome == "stopped" and s.reason:
        outcome = f"stopped:{s.reason}"
    return UsageLine(
        usage_id=e.event_id, line="compute", job_id=placed.job_id, attempt=placed.attempt, shard=placed.shard,
        tenant=placed.tenant, project=placed.project, region=placed.region, zone=placed.zone, cluster=placed.cluster,
        card_model=placed.card_model, kind=placed.kind, outcome=outcome, flag=flag_of(ENDINGS[e.type], s.reason),
        cross_region=int(placed.cross_region), started_at=start, ended_at=end, gpu_milli=placed.gpu_milli,
        gpu_seconds=placed.gpu_milli * ms / 1_000_000, transfer_bytes=0,
        unit_price=money(unit_price), price_version=catalog.version, cost=cost, currency=catalog.currency)


def transfer_line(e: Envelope, catalog: PriceCatalog) -> UsageLine | None:
    """The ``transfer`` line of a ``job.placed`` event that moves data between regions, else None.

    Raises:
        DecodeError: the payload does not validate.
    """
    if e.type != EventType.JOB_PLACED:
        return None
    p = e.payload_as(JobPlaced)
    if p.transfer_bytes <= 0:
        return None
    at = to_ms(e.occurred_at)
    unit = catalog.egress_per_gb
    return UsageLine(
        usage_id=e.event_id, line="transfer", job_id=e.job_id, attempt=e.attempt, shard=p.shard, tenant=e.tenant,
        project=e.project, region=e.region, zone=e.zone, cluster=e.cluster, card_model=p.card_model,
        kind=p.spec.kind.value, outcome="placed", flag="", cross_region=int(p.cross_region), started_at=at, ended_at=at,
        gpu_milli=0, gpu_seconds=0.0, transfer_bytes=p.transfer_bytes, unit_price=unit, price_version=catalog.version,
        cost=money(Decimal(p.transfer_bytes) / _BYTES_PER_GB * unit), currency=catalog.currency)


def spend_key(tenant: str, month: str) -> str:
    """The budget KV key of a tenant's spend in a month: ``<tenant>.<YYYY-MM>``."""
    return f"{tenant}.{month}"


#: Billing's dispatch table: event type -> the function that prices its line
#: (``compute_line(event, placement, catalog)`` for an ending status, whose placement the
#: service looks up; ``transfer_line(event, catalog)`` for a placement). ``job.rejected`` ends an
#: attempt that never started and ``job.cancelled`` a job never placed: no interval, nothing to bill.
BILLING_EVENTS: EventTable = EventTable({
    **{t: compute_line for t in ENDINGS},
    EventType.JOB_PLACED: transfer_line,
}, ignores=frozenset({EventType.JOB_STARTED, EventType.JOB_REJECTED, EventType.JOB_CANCELLED, EventType.JOB_STOP,
                      EventType.AGENT_RECONCILED}))
