"""The billing service: job events -> priced usage lines in ClickHouse, and budget spend.

Two durable consumers feed one writer:

* ``billing`` on ``<p>.status.>``: ended attempts -> ``compute`` lines;
* ``billing-transfer`` on ``<p>.placements.>``: placements that move data -> ``transfer`` lines.
  A placement whose scheduler-lease ``fencing_token`` is below the highest seen (a former
  active scheduler's late order, refused by its agent too) is not billed; the highest token is
  kept in memory (after a billing restart the durable consumer resumes past what it
  acknowledged, so only orders newer than that are judged).

What a line is and costs is the pure core's business (:mod:`services.billing.usage`). The cycle
of one batch (:meth:`BillingService.write`):

1. price the batch's events into lines (pure);
2. insert the lines not yet in ``usage`` (:meth:`~fedsched.store.Store.insert_new`, keyed on
   ``usage_id`` = the event id), so redelivery, restarts and replays never bill twice;
3. for every (tenant, month) the batch touches, recompute the month-to-date spend from
   ``usage`` and put it in the NATS KV bucket ``<p>_spend`` under ``<tenant>.<YYYY-MM>`` (a
   decimal string): recomputed, never incremented, so a redelivered batch cannot double it;
4. publish ``usage.recorded`` per line (event id derived from the line's, so JetStream drops a
   repeat) in the trace of the event it prices (its ``traceparent`` handed on);
5. return -- the consumer acknowledges only now.

A ClickHouse or NATS outage raises :class:`~fedsched.errors.UnavailableError`: the consumer
backs off and redelivers, the backlog waits in JetStream (:meth:`BillingService.lag`). The two
consumers share one lock, so spend is always computed after the insert it must include.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from decimal import Decimal

import nats.errors

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, DurableConsumer
from fedsched.dispatch import SkippedTypes
from fedsched.errors import UnavailableError
from fedsched.events import EventType, JobPlaced, UsageRecorded, business_event_id, make_event
from fedsched.pricing import PriceCatalog, money
from fedsched.store import AsyncStore
from services.billing.usage import BILLING_EVENTS, USAGE_COLUMNS, UsageLine, spend_key

log = logging.getLogger(__name__)

#: KV bucket (``<prefix>_spend``) holding month-to-date spend per tenant.
SPEND_BUCKET = "spend"

_SPEND_SQL = """
    SELECT sum(cost) FROM {db}.usage
    WHERE tenant = {tenant:String}
      AND ended_at >= {start:DateTime64(3, 'UTC')} AND ended_at < {end:DateTime64(3, 'UTC')}"""


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """[first instant, first instant of the next month) of ``YYYY-MM`` (aware UTC)."""
    year, mon = (int(x) for x in month.split("-"))
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=UTC)
    return start, end


class BillingService:
    """Prices ended attempts and data transfers; publishes budget spend.

    Args:
        bus: NATS connection.
        store: the ClickHouse store (async wrapper).
        prices: the price catalog.
        batch / max_wait_s / linger_s / ack_wait_s: consumer batching (size and time bounds)
            and redelivery (see :class:`~fedsched.bus.DurableConsumer`).
    """

    def __init__(self, bus: Bus, store: AsyncStore, prices: PriceCatalog, *, batch: int = 1000,
                 max_wait_s: float = 0.5, linger_s: float = 0.25, ack_wait_s: float = 60.0) -> None:
        self.bus = bus
        self.store = store
        self.prices = prices
        kw = dict(batch=batch, max_wait_s=max_wait_s, linger_s=linger_s, ack_wait_s=ack_wait_s)
        self.consumer = DurableConsumer(bus, "EVENTS", "billing", [bus.subjects.all("status")], self.write, **kw)
        self.transfer_consumer = DurableConsumer(bus, "EVENTS", "billing-transfer", [bus.subjects.all("placements")],
                                                 self.write, **kw)
        self.consumers = [self.consumer, self.transfer_consumer]
        self.rows = 0
        self.skipped = SkippedTypes("billing")  #: events of unknown types (newer producers) skipped
        self._lock = asyncio.Lock()
        self._kv = None
        self.highest_token = 0  #: scheduler-lease fencing of placements (see the module docstring)
        self.stale_orders = 0

    def lines(self, deliveries: list[Delivery]) -> list[UsageLine]:
        """The priced lines of a batch (step 1; pure)."""
        out = []
        for d in deliveries:
            if d.envelope.type == EventType.JOB_PLACED:
                token = d.envelope.payload_as(JobPlaced).fencing_token
                if token < self.highest_token:
                    self.stale_orders += 1
                    continue
                self.highest_token = token
            price = BILLING_EVENTS.route(d.envelope.type, self.skipped)
            line = price(d.envelope, self.prices) if price is not None else None
            if line is not None:
                out.append(line)
        return out

    async def write(self, deliveries: list[Delivery]) -> None:
        """Bill one batch (steps 1-4 of the module docstring); return only once all is committed.

        Raises:
            UnavailableError: ClickHouse or NATS unreachable (retried by the consumer).
            DecodeError: a payload does not validate (dead-lettered by the consumer).
        """
        lines = self.lines(deliveries)
        if not lines:
            return
        async with self._lock:
            self.rows += await self.store.insert_new("usage", [ln.row() for ln in lines], USAGE_COLUMNS, "usage_id")
            await self.publish_spend({(ln.tenant, ln.month) for ln in lines})
        # a line's usage_id is the id of the event it prices: that event's trace is the line's
        causes = {d.envelope.event_id: telemetry.trace_headers(d.headers) for d in deliveries}
        await self._publish_recorded(lines, causes)

    async def spend(self, tenant: str, month: str) -> Decimal:
        """Month-to-date spend of ``tenant`` in ``month`` (``YYYY-MM``), from ``usage``.

        Raises:
            UnavailableError: ClickHouse unreachable.
        """
        start, end = month_bounds(month)
        total = (await self.store.query(_SPEND_SQL.replace("{db}", self.store.store.database),
                                        {"tenant": tenant, "start": start, "end": end})).scalar()
        return money(total or 0)

    async def publish_spend(self, keys: set[tuple[str, str]]) -> None:
        """Recompute and put the spend of each (tenant, month) in the KV bucket (step 3).

        Raises:
            UnavailableError: ClickHouse or NATS unreachable.
        """
        for tenant, month in sorted(keys):
            amount = await self.spend(tenant, month)
            try:
                if self._kv is None:
                    self._kv = await self.bus.key_value(SPEND_BUCKET)
                await self._kv.put(spend_key(tenant, month), format(amount, "f").encode())
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
                self._kv = None
                raise UnavailableError(f"cannot publish spend of {tenant} {month}: {e!r}") from e

    async def _publish_recorded(self, lines: list[UsageLine], causes: dict[str, dict[str, str]]) -> None:
        items = []
        for ln in lines:
            usage = UsageRecorded(gpu_seconds=ln.gpu_seconds, cost=str(ln.cost), currency=ln.currency)
            event = make_event(EventType.USAGE_RECORDED, usage, producer="billing",
                               occurred_at=ln.ended_at.timestamp(),
                               event_id=business_event_id(ln.usage_id, "usage"), region=ln.region, zone=ln.zone,
                               cluster=ln.cluster, tenant=ln.tenant, project=ln.project, job_id=ln.job_id,
                               attempt=ln.attempt, actor="billing")
            items.append((self.bus.subjects.usage(ln.tenant), event, causes.get(ln.usage_id)))
        ok = await self.bus.publish_many(items)
        if not all(ok):
            raise UnavailableError("could not publish usage.recorded; will retry (rows are already idempotent)")

    async def lag(self) -> int:
        """Events not yet billed (both consumers), from the server's consumer info."""
        return sum([await c.lag() for c in self.consumers])

    async def run(self) -> None:
        """Consume until stopped."""
        await asyncio.gather(*(c.run() for c in self.consumers))

    def stop(self) -> None:
        """Stop after the current batches."""
        for c in self.consumers:
            c.stop()
