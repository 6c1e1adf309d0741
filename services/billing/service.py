"""The billing service: job start/stop events -> priced usage rows in ClickHouse.

Every attempt that ends (``job.finished``, ``job.failed``, ``job.stopped``) becomes one
``usage`` row for the interval [started_at, ended_at]:

* GPU work: ``gpu_seconds = gpu_milli / 1000 * (ended_at - started_at)``;
  ``cost = gpu_seconds / 3600 * price(region, card model, at start)``;
* CPU-only work: ``cost = cpu_milli / 1000 * seconds / 3600 * cpu_core_hour(region)``.

Prices come from the versioned :class:`~fedsched.pricing.PriceCatalog`; every row records the
catalog version. Money is Decimal (6 places). The row's id is the ending event's id, inserted
with :meth:`~fedsched.store.Store.insert_new`, so redelivery never bills twice. After the insert
the service publishes ``usage.recorded`` (id derived from the row's, so a retry is
deduplicated) for budgets.
"""

from __future__ import annotations

import logging
from datetime import UTC
from decimal import Decimal

from fedsched.bus import Bus, Delivery, DurableConsumer
from fedsched.errors import UnavailableError
from fedsched.events import JobStatus, UsageRecorded, business_event_id, make_event
from fedsched.pricing import PriceCatalog, money
from fedsched.store import AsyncStore

log = logging.getLogger(__name__)

USAGE_COLUMNS = ("usage_id", "job_id", "attempt", "shard", "tenant", "project", "region", "zone", "cluster",
                 "card_model", "kind", "outcome", "cross_region", "started_at", "ended_at", "gpu_milli", "gpu_seconds",
                 "unit_price", "price_version", "cost", "currency")

ENDINGS = {"job.finished": "finished", "job.failed": "failed", "job.stopped": "stopped"}


def usage_row(d: Delivery, prices: PriceCatalog) -> list | None:
    """The ``usage`` row for an ending status event (None for other events or never-started attempts)."""
    e = d.envelope
    outcome = ENDINGS.get(e.type)
    if outcome is None:
        return None
    s = e.payload_as(JobStatus)
    if s.started_at is None:
        return None
    start, end = s.started_at, e.occurred_at
    seconds = max(0.0, (end - start).total_seconds())
    if s.gpu_milli > 0:
        unit = prices.gpu_hour(e.region, s.card_model, start)
        gpu_seconds = s.gpu_milli / 1000 * seconds
        cost = money(Decimal(str(gpu_seconds)) / Decimal(3600) * unit)
    else:
        unit = prices.cpu_core_hour_in(e.region, start)
        gpu_seconds = 0.0
        cost = money(Decimal(s.cpu_milli) / Decimal(1000) * Decimal(str(seconds)) / Decimal(3600) * unit)
    if outcome == "stopped" and s.reason:
        outcome = f"stopped:{s.reason}"
    return [e.event_id, e.job_id, e.attempt, s.shard, e.tenant, e.project, e.region, e.zone, e.cluster, s.card_model,
            s.kind, outcome, int(s.cross_region), start.replace(tzinfo=None), end.replace(tzinfo=None), s.gpu_milli,
            gpu_seconds, unit, prices.version, cost, prices.currency]


class BillingService:
    """Prices ended attempts.

    Args:
        bus: NATS connection.
        store: the ClickHouse store (async wrapper).
        prices: the price catalog.
    """

    def __init__(self, bus: Bus, store: AsyncStore, prices: PriceCatalog, *, batch: int = 1000,
                 max_wait_s: float = 0.5, linger_s: float = 0.25) -> None:
        self.bus = bus
        self.store = store
        self.prices = prices
        self.consumer = DurableConsumer(bus, "EVENTS", "billing", [bus.subjects.all("status")], self.write,
                                        batch=batch, max_wait_s=max_wait_s, linger_s=linger_s)
        self.rows = 0

    async def write(self, deliveries: list[Delivery]) -> None:
        """Insert usage rows for the batch's ending events, then publish ``usage.recorded``.

        Raises:
            UnavailableError: ClickHouse or NATS unreachable (retried by the consumer).
        """
        rows = [r for d in deliveries if (r := usage_row(d, self.prices)) is not None]
        if not rows:
            return
        self.rows += await self.store.insert_new("usage", rows, USAGE_COLUMNS, "usage_id")
        items = []
        for r in rows:
            usage = UsageRecorded(gpu_seconds=r[16], cost=str(r[19]), currency=r[20])
            event = make_event("usage.recorded", usage, producer="billing",
                               occurred_at=r[14].replace(tzinfo=UTC).timestamp(),
                               event_id=business_event_id(r[0], "usage"), region=r[6], zone=r[7], cluster=r[8],
                               tenant=r[4], project=r[5], job_id=r[1], attempt=r[2], actor="billing")
            items.append((self.bus.subjects.usage(r[4]), event, None))
        ok = await self.bus.publish_many(items)
        if not all(ok):
            raise UnavailableError("could not publish usage.recorded; will retry (rows are already idempotent)")

    async def run(self) -> None:
        """Consume until stopped."""
        await self.consumer.run()

    def stop(self) -> None:
        """Stop after the current batch."""
        self.consumer.stop()
