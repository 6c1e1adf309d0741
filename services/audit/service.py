"""The audit service: every bus event into the append-only ``events`` table.

Three durable consumers (one per stream: events, inventory, dead letters) hand batches to
:meth:`AuditService.write`, which inserts the batch and its projections --
``decisions`` (placements and pending reasons) and ``inventory`` (capacity per cluster x card
model) -- and returns only once ClickHouse committed them; the consumer acknowledges after that.
Rows are keyed on the event id and inserted with :meth:`~fedsched.store.Store.insert_new`, so a
redelivered or replayed event never becomes a second row. When ClickHouse is unavailable the
consumer backs off and the backlog stays in JetStream.

Events of a type this build does not know (a newer producer) are stored like any other: the
log keeps what was said even when no reader here understands it yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime

from fedsched.bus import Bus, Delivery, DurableConsumer
from fedsched.clock import as_utc
from fedsched.dispatch import EventTable
from fedsched.events import Envelope, EventType, InventorySnapshot, JobPending, JobPlaced
from fedsched.metrics import WriterMetrics
from fedsched.store import AsyncStore

log = logging.getLogger(__name__)

EVENT_COLUMNS = ("event_id", "type", "schema_version", "occurred_at", "producer", "actor", "region", "zone", "cluster",
                 "tenant", "project", "job_id", "attempt", "policy_version", "trace_id", "subject", "payload")
DECISION_COLUMNS = ("event_id", "decided_at", "job_id", "attempt", "tenant", "project", "outcome", "region", "cluster",
                    "reason", "fits_empty", "cross_region", "score", "policy_version", "detail")
INVENTORY_COLUMNS = ("event_id", "at", "region", "zone", "cluster", "card_model", "nodes", "healthy_nodes", "gpus",
                     "gpu_milli_free", "whole_gpus_free", "cpu_milli_free", "memory_mib_free")


def _naive_utc(dt: datetime) -> datetime:
    """The instant ``dt`` as aware UTC (an offset is converted, never dropped; see
    :func:`~fedsched.clock.as_utc`), as the ``DateTime64(3, 'UTC')`` columns take it."""
    return as_utc(dt)


def event_row(d: Delivery) -> list:
    """The ``events`` row of a delivery (columns :data:`EVENT_COLUMNS`)."""
    e = d.envelope
    return [e.event_id, e.type, e.schema_version, _naive_utc(e.occurred_at), e.producer, e.actor, e.region, e.zone,
            e.cluster, e.tenant, e.project, e.job_id, e.attempt, e.policy_version, d.trace_id, d.subject,
            json.dumps(e.payload, separators=(",", ":"), default=str)]


def decision_row(e: Envelope) -> list | None:
    """The ``decisions`` row of a ``job.placed`` / ``job.pending`` event, else None."""
    row = DECISION_ROWS.route(e.type)
    return row(e) if row is not None else None


def _placed_row(e: Envelope) -> list:
    p = e.payload_as(JobPlaced)
    return [e.event_id, _naive_utc(e.occurred_at), e.job_id, e.attempt, e.tenant, e.project, "placed", e.region,
            e.cluster, p.explanation, 1, int(p.cross_region), p.score, e.policy_version,
            json.dumps(p.evaluations, default=str)]


def _pending_row(e: Envelope) -> list:
    p = e.payload_as(JobPending)
    return [e.event_id, _naive_utc(e.occurred_at), e.job_id, e.attempt, e.tenant, e.project, "pending", "", "",
            p.reason, int(p.fits_empty), 0, 0.0, e.policy_version, json.dumps(p.evaluations, default=str)]


#: Which events have a ``decisions`` row (every event, of a known type or not, has an ``events`` row).
DECISION_ROWS: EventTable = EventTable({EventType.JOB_PLACED: _placed_row, EventType.JOB_PENDING: _pending_row})


def inventory_rows(e: Envelope) -> list[list]:
    """The ``inventory`` rows (one per card model) of an ``inventory.snapshot`` event."""
    if e.type != EventType.INVENTORY_SNAPSHOT:
        return []
    snap = e.payload_as(InventorySnapshot)
    by_model: dict[str, list[int]] = {}
    for n in snap.nodes:
        acc = by_model.setdefault(n.card_model, [0] * 7)
        acc[0] += 1
        acc[1] += int(n.healthy)
        acc[2] += n.gpus
        acc[3] += sum(n.gpu_free_milli)
        acc[4] += sum(1 for g in n.gpu_free_milli if g >= 1000)
        acc[5] += n.cpu_free_milli
        acc[6] += n.memory_free_mib
    return [[e.event_id, _naive_utc(e.occurred_at), e.region, e.zone, e.cluster, model, *acc]
            for model, acc in sorted(by_model.items())]


class AuditService:
    """Writes every event of the federation to ClickHouse.

    Args:
        bus: NATS connection.
        store: the ClickHouse store (async wrapper).
        batch: maximum events per insert.
        max_wait_s: how long an idle fetch waits.
        linger_s: time bound of a batch (collect up to ``batch`` events for this long).
        ack_wait_s: JetStream redelivers a batch not acknowledged within this long (a writer
            that died mid-batch).
        metrics: where insert latency per table is timed (default: a registry of its own).
    """

    def __init__(self, bus: Bus, store: AsyncStore, *, batch: int = 2000, max_wait_s: float = 0.5,
                 linger_s: float = 0.25, ack_wait_s: float = 60.0, metrics: WriterMetrics | None = None) -> None:
        self.bus = bus
        self.store = store
        self.metrics = metrics if metrics is not None else WriterMetrics("audit")
        self.consumers = [
            DurableConsumer(bus, suffix, f"audit-{suffix.lower()}", [bus.subjects.all()], self.write,
                            batch=batch, max_wait_s=max_wait_s, linger_s=linger_s, ack_wait_s=ack_wait_s)
            for suffix in ("EVENTS", "INVENTORY", "DLQ")
        ]
        self.written = 0

    async def write(self, deliveries: list[Delivery]) -> None:
        """Insert the batch and its projections; return only after ClickHouse committed them.

        Raises:
            UnavailableError: ClickHouse cannot be reached (the consumer backs off and retries).
            DecodeError: a payload does not validate (dead-lettered by the consumer).
        """
        events = [event_row(d) for d in deliveries]
        decisions = [r for d in deliveries if (r := decision_row(d.envelope)) is not None]
        inventory = [r for d in deliveries for r in inventory_rows(d.envelope)]
        # Projections first: if we crash between inserts, the redelivered batch fills what is missing.
        if decisions:
            with self.metrics.time_insert("decisions"):
                await self.store.insert_new("decisions", decisions, DECISION_COLUMNS, "event_id")
        if inventory:
            with self.metrics.time_insert("inventory"):
                await self.store.insert_new("inventory", inventory, INVENTORY_COLUMNS, ("event_id", "card_model"))
        with self.metrics.time_insert("events"):
            self.written += await self.store.insert_new("events", events, EVENT_COLUMNS, "event_id")

    async def lag(self) -> int:
        """Events not yet written (all three consumers)."""
        return sum([await c.lag() for c in self.consumers])

    async def run(self) -> None:
        """Consume until cancelled/stopped."""
        await asyncio.gather(*(c.run() for c in self.consumers))

    def stop(self) -> None:
        """Stop all consumers after their current batch."""
        for c in self.consumers:
            c.stop()
