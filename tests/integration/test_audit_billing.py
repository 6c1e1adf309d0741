"""Audit and billing on real NATS + real chDB: one row per event, whatever is delivered twice."""

import asyncio
import time
from datetime import UTC, datetime
from decimal import Decimal

from fedsched.bus import Delivery
from fedsched.events import JobStatus, business_event_id, make_event
from fedsched.pricing import load_price_catalog
from fedsched.store import AsyncStore
from services.audit.service import AuditService
from services.billing.service import BillingService
from tests.builders import until

START = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()


def _status(type_, job="j-1", attempt=1, at=START, started=START, gpu_milli=2000):
    step = "started" if type_ == "job.started" else "ended"
    return make_event(type_, JobStatus(card_model="nvidia-t4-16gb", gpu_milli=gpu_milli, cpu_milli=8000,
                                       started_at=datetime.fromtimestamp(started, UTC), kind="training"),
                      producer="agent/cn-east-1-c1", occurred_at=at,
                      event_id=business_event_id(job, attempt, 0, step), region="cn-east-1", zone="cn-east-1a",
                      cluster="cn-east-1-c1", tenant="nlp", project="train", job_id=job, attempt=attempt)


async def test_same_event_twice_gives_one_audit_row_and_one_usage_row(bus, store):
    astore = AsyncStore(store)
    audit, billing = AuditService(bus, astore, linger_s=0.05), BillingService(bus, astore, load_price_catalog(),
                                                                              linger_s=0.05)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    started, finished = _status("job.started"), _status("job.finished", at=START + 3600)
    for e in (started, finished):
        await bus.publish(subject, e)
        # the same event again, under another message id: JetStream cannot dedup it, the writers must
        await bus.js.publish(subject, e.to_bytes(), headers={"Nats-Msg-Id": e.event_id + "-again"})

    async def written():
        n = store.query(f"SELECT count() FROM {store.database}.usage").scalar()
        return n >= 1 and await audit.lag() == 0 and await billing.consumer.lag() == 0

    assert await until(written, timeout=15, interval=0.05)
    audit.stop(), billing.stop()
    await asyncio.gather(*tasks)
    db = store.database
    rows = store.query(f"SELECT type, count() FROM {db}.events WHERE job_id = 'j-1' AND type LIKE 'job.%' GROUP BY type ORDER BY type").rows
    assert rows == [("job.finished", 1), ("job.started", 1)]
    (usage,) = store.query(f"SELECT gpu_seconds, unit_price, cost, outcome FROM {db}.usage").rows
    # 2 GPUs x 3600 s in cn-east-1 (T4: 6.0 x 0.9 = 5.4 per GPU-hour) = 10.8
    assert usage == (7200.0, Decimal("5.400000"), Decimal("10.800000"), "finished")
    recorded = store.query(f"SELECT count() FROM {db}.events WHERE type = 'usage.recorded'").scalar()
    assert recorded == 1


async def test_a_batch_written_twice_after_a_crash_is_not_doubled(bus, store):
    """The writer inserted, then died before acking: the redelivered batch changes nothing."""
    astore = AsyncStore(store)
    audit = AuditService(bus, astore)
    billing = BillingService(bus, astore, load_price_catalog())
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    events = [_status("job.finished", job=f"j-{i}", at=START + 60 * (i + 1)) for i in range(20)]
    deliveries = [Delivery(e, subject, {}, i + 1, 1) for i, e in enumerate(events)]
    await audit.write(deliveries)
    await billing.write(deliveries)
    await audit.write(deliveries[:7] + deliveries)  # redelivered, partly twice in one batch
    await billing.write(deliveries)
    db = store.database
    assert store.query(f"SELECT count() FROM {db}.events WHERE type = 'job.finished'").scalar() == 20
    assert store.query(f"SELECT count(), uniqExact(usage_id) FROM {db}.usage").rows == [(20, 20)]
    total = store.query(f"SELECT sum(cost) FROM {db}.usage").scalar()
    expected = sum(Decimal("5.4") * 2 * Decimal(60 * (i + 1)) / 3600 for i in range(20))
    assert total == expected.quantize(Decimal("0.000001"))


async def test_migrations_are_idempotent_and_recorded(store):
    assert store.migrate() == []
    assert store.schema_version() >= 1


def _placed(job="j-9", attempt=1, transfer_bytes=4_000_000_000):
    from fedsched.events import JobPlaced, WorkerBinding
    from fedsched.jobs import Dataset, JobSpec

    spec = JobSpec(tenant="nlp", project="train", home_region="cn-north-1", kind="training",
                   datasets=(Dataset(name="nlp/corpus", home_region="cn-north-1", size_bytes=transfer_bytes),))
    payload = JobPlaced(spec=spec, card_model="nvidia-t4-16gb", bindings=(WorkerBinding(worker=0, node="n1"),),
                        cross_region=True, transfer_bytes=transfer_bytes)
    return make_event("job.placed", payload, producer="scheduler", occurred_at=START,
                      event_id=business_event_id(job, attempt, 0, "placed"), region="cn-east-1", zone="cn-east-1a",
                      cluster="cn-east-1-c1", tenant="nlp", project="train", job_id=job, attempt=attempt)


async def test_transfer_is_its_own_line_billed_once_and_spend_is_recomputed_not_added(bus, store):
    """Egress: one line per placement event id; the spend KV equals sum(usage) however often a batch comes."""
    astore = AsyncStore(store)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.05)
    task = asyncio.create_task(billing.run())
    placed = _placed()
    finished = _status("job.finished", job="j-9", at=START + 3600)
    placements = bus.subjects.placements("cn-east-1", "cn-east-1-c1")
    await bus.publish(placements, placed)
    await bus.js.publish(placements, placed.to_bytes(), headers={"Nats-Msg-Id": placed.event_id + "-again"})
    await bus.publish(bus.subjects.status("cn-east-1", "cn-east-1-c1"), finished)
    db = store.database

    async def billed():
        n = store.query(f"SELECT count() FROM {db}.usage").scalar()
        return n >= 2 and await billing.lag() == 0

    assert await until(billed, timeout=15, interval=0.05)
    billing.stop()
    await task
    rows = store.query(f"SELECT line, usage_id, transfer_bytes, cost FROM {db}.usage ORDER BY line").rows
    # 4 GB x 0.5 per GB = 2.0; compute: 2 T4 x 1 h x 5.4 = 10.8
    assert rows == [("compute", finished.event_id, 0, Decimal("10.800000")),
                    ("transfer", placed.event_id, 4_000_000_000, Decimal("2.000000"))]
    kv = await bus.key_value("spend")
    assert (await kv.get("nlp.2023-03")).value == b"12.800000"
    # the same batch again (a redelivery after a crash): no new row, the same spend
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    await billing.write([Delivery(finished, subject, {}, 1, 2), Delivery(placed, placements, {}, 2, 2)])
    assert store.query(f"SELECT count(), sum(cost) FROM {db}.usage").rows == [(2, Decimal("12.800000"))]
    assert (await kv.get("nlp.2023-03")).value == b"12.800000"


async def test_lag_counts_the_backlog_even_before_the_writers_first_run(bus, store):
    astore = AsyncStore(store)
    audit, billing = AuditService(bus, astore), BillingService(bus, astore, load_price_catalog())
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    for e in (_status("job.started"), _status("job.finished", at=START + 60)):
        await bus.publish(subject, e)
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), _placed())
    assert await audit.lag() == 3 and await billing.lag() == 3
