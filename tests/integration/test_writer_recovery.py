"""Issue 14: audit and billing recover promptly after a writer dies mid-batch, on real NATS +
chDB, without a live writer's batch being handed to another replica while it is written.

A writer whose ``events`` insert is held (a fake of our :class:`~fedsched.store.AsyncStore`
around the real one) stands for a slow chDB insert; a writer "killed with -9" is one whose task
is cancelled and whose NATS connection is closed with its batch unacknowledged. The writers'
durable consumers use a short ack wait with progress reports (:class:`~fedsched.bus.DurableConsumer`).
"""

from __future__ import annotations

import asyncio
import time

from fedsched.bus import Bus
from fedsched.store import AsyncStore
from fedsched.pricing import load_price_catalog
from services.audit.service import AuditService
from services.billing.service import BillingService
from tests.builders import placement, spec, status_event, submitted, until

ACK_WAIT = 2.0
N = 40


class _HeldStore:
    """The real store, except that an insert into ``table`` waits until :attr:`release` is set.

    Attributes:
        held: sizes of the batches that reached that insert.
    """

    def __init__(self, real: AsyncStore, table: str = "events") -> None:
        self.real = real
        self.store = real.store
        self.table = table
        self.release = asyncio.Event()
        self.held: list[int] = []

    async def insert_new(self, table, rows, columns, key) -> int:
        if table == self.table:
            self.held.append(len(rows))
            await self.release.wait()
        return await self.real.insert_new(table, rows, columns, key)

    async def query(self, sql, params=None):
        return await self.real.query(sql, params)


def _spy(audit: AuditService) -> list[tuple[int, int]]:
    """(stream sequence, delivery count) of every delivery audit's events consumer hands over."""
    seen: list[tuple[int, int]] = []
    consumer = audit.consumers[0]
    handler = consumer.handler

    async def spying(deliveries):
        seen.extend((d.stream_sequence, d.deliveries) for d in deliveries)
        return await handler(deliveries)
    consumer.handler = spying
    return seen


async def _publish(bus: Bus, n: int) -> None:
    job = spec(gpus=1)
    for i in range(n):
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(f"r{i}", job, 1.7e9 + i))


def _events(store) -> int:
    return store.query(f"SELECT count() FROM {store.database}.events").scalar()


async def _kill(task: asyncio.Task, bus: Bus) -> None:
    """As ``kill -9`` leaves a writer: its work stops where it is and its connection drops,
    nothing acknowledged or handed back."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await bus.nc.close()


async def _successor_writes_what_the_dead_writer_held(nats_server, bus, store, ack_waits: dict) -> float:
    """A writer (ack wait ``ack_waits["first"]``, default if absent) dies holding a batch; its
    successor (``ack_waits["successor"]``) writes everything. Returns the successor's ack wait."""
    await _publish(bus, N)
    real = AsyncStore(store)
    held = _HeldStore(real)
    dead_bus = await Bus.connect(nats_server.url, bus.prefix, name="audit-1")
    first = AuditService(dead_bus, held, linger_s=0.05,
                         **({"ack_wait_s": ack_waits["first"]} if "first" in ack_waits else {}))
    first_task = asyncio.create_task(first.run())
    assert await until(lambda: held.held, timeout=20)
    in_hand = held.held[0]
    await _kill(first_task, dead_bus)
    killed_at = time.monotonic()
    successor = AuditService(bus, real, linger_s=0.05,
                             **({"ack_wait_s": ack_waits["successor"]} if "successor" in ack_waits else {}))
    seen = _spy(successor)
    task = asyncio.create_task(successor.run())
    ack_wait = successor.consumers[0].ack_wait_s
    try:
        assert await until(lambda: _events(store) == N, timeout=30, interval=0.05)
        took = time.monotonic() - killed_at
        # the successor got the dead writer's batch again (delivered twice; a message a fetch of
        # the dead writer was handed as it died comes again too) and the rest once
        redelivered = [seq for seq, n in seen if n > 1]
        assert len(redelivered) >= in_hand and len({seq for seq, _ in seen}) == N
        assert took < ack_wait + 5, took  # before: the old ack wait, 60 s
        assert store.query(f"SELECT count(DISTINCT event_id) FROM {store.database}.events").scalar() == N
    finally:
        successor.stop()
        await asyncio.gather(task, return_exceptions=True)
    return ack_wait


async def test_a_successor_writes_a_killed_writers_batch_within_the_default_ack_wait(nats_server, bus, store) -> None:
    """Both writers with the defaults: the batch the dead one held comes back within a few
    seconds (the writers' ack wait, 5 s), not the minute it took before."""
    ack_wait = await _successor_writes_what_the_dead_writer_held(nats_server, bus, store, {})
    assert ack_wait <= 10


async def test_a_durable_left_with_the_old_ack_wait_is_shortened_by_its_successor(nats_server, bus, store) -> None:
    """The predecessor ran a build with a 60 s ack wait: the successor updates the durable, and
    the dead writer's batch comes back within the short one."""
    await _successor_writes_what_the_dead_writer_held(nats_server, bus, store,
                                                      {"first": 60.0, "successor": ACK_WAIT})
    c = AuditService(bus, AsyncStore(store)).consumers[0]
    info = await bus.js.consumer_info(c.stream, c.durable)
    assert abs(info.config.ack_wait - ACK_WAIT) < 1e-3


async def test_a_slow_insert_keeps_its_batch_while_another_replica_runs(nats_server, bus, store) -> None:
    """Two replicas share the durable; one's insert takes several ack waits: its progress reports
    keep the batch, the other replica is never handed it, and nothing is written twice."""
    await _publish(bus, N)
    real = AsyncStore(store)
    held = _HeldStore(real)
    slow_bus = await Bus.connect(nats_server.url, bus.prefix, name="audit-slow")
    slow = AuditService(slow_bus, held, linger_s=0.05, ack_wait_s=ACK_WAIT)
    in_slow = _spy(slow)
    slow_task = asyncio.create_task(slow.run())
    assert await until(lambda: held.held, timeout=20)
    other = AuditService(bus, real, linger_s=0.05, ack_wait_s=ACK_WAIT)
    seen = _spy(other)
    other_task = asyncio.create_task(other.run())
    try:
        in_hand = held.held[0]
        # the slow insert lasts at least 3 ack waits (12 progress reports, one per ack_wait / 4)
        reports = slow.consumers[0]
        # (or until the other replica is handed a message again: what happened without them)
        assert await until(lambda: reports.progress_reports >= 12 * in_hand or any(n > 1 for _, n in seen),
                           timeout=30, interval=0.05)
        # it wrote what the slow one did not hold, and was never handed the held batch
        batch = {seq for seq, _ in in_slow}
        assert len(batch) == in_hand
        assert await until(lambda: batch | {seq for seq, _ in seen} == set(range(1, N + 1)), timeout=20,
                           interval=0.05)
        assert not batch & {seq for seq, _ in seen}
        held.release.set()
        assert await until(lambda: _events(store) == N, timeout=20, interval=0.05)
        assert await until(lambda: _lag_zero(slow), timeout=20, interval=0.05)
        assert store.query(f"SELECT count() FROM {store.database}.events").scalar() == N
        assert held.held == [in_hand]  # the slow writer's batch was inserted once, by it
    finally:
        held.release.set()  # a failed check must not leave the slow writer waiting for good
        for svc in (slow, other):
            svc.stop()
        await asyncio.wait_for(asyncio.gather(slow_task, other_task, return_exceptions=True), 30)
        await slow_bus.close()


async def _lag_zero(audit: AuditService) -> bool:
    return await audit.lag() == 0


async def test_billing_killed_mid_insert_is_completed_by_its_successor_once(nats_server, bus, store) -> None:
    """Billing dies holding a batch of ended attempts (its ``usage`` insert in progress); its
    successor (defaults: 5 s ack wait) is handed them again and bills every attempt exactly
    once, with the month's spend recomputed from the lines."""
    t0 = 1.7e9
    jobs = 20
    job = spec(gpus=1)
    for i in range(jobs):
        placed = placement(f"b{i}", job, "cn-north-1-c1", "cn-north-1", [("n0", (0,))], at=t0)
        await bus.publish(bus.subjects.placements("cn-north-1", "cn-north-1-c1"), placed)
    real = AsyncStore(store)
    dead_bus = await Bus.connect(nats_server.url, bus.prefix, name="billing-1")
    held = _HeldStore(real, "usage")
    first = BillingService(dead_bus, held, load_price_catalog(), linger_s=0.05)
    first_task = asyncio.create_task(first.run())
    assert await until(lambda: first.transfer_consumer.processed == jobs, timeout=20, interval=0.05)
    for i in range(jobs):  # the ends arrive once every placement is booked
        placed = placement(f"b{i}", job, "cn-north-1-c1", "cn-north-1", [("n0", (0,))], at=t0)
        await bus.publish(bus.subjects.status("cn-north-1", "cn-north-1-c1"),
                          status_event("job.finished", placed, t0 + 3601, started_at=t0 + 1))
    assert await until(lambda: held.held, timeout=20, interval=0.05)
    in_hand = held.held[0]
    await _kill(first_task, dead_bus)
    successor = BillingService(bus, real, load_price_catalog(), linger_s=0.05)
    consumer = successor.consumer
    seen: list[int] = []
    handler = consumer.handler

    async def spying(deliveries):
        seen.extend(d.deliveries for d in deliveries)
        return await handler(deliveries)
    consumer.handler = spying
    task = asyncio.create_task(successor.run())
    db = store.database
    try:
        assert await until(lambda: store.query(f"SELECT count() FROM {db}.usage").scalar() == jobs,
                           timeout=30, interval=0.05)
        assert await until(lambda: _billing_lag_zero(successor), timeout=20, interval=0.05)
        assert sum(1 for n in seen if n > 1) >= in_hand  # the dead writer's batch, handed over again
        assert store.query(f"SELECT count(DISTINCT usage_id) FROM {db}.usage").scalar() == jobs
        month = store.query(f"SELECT sum(cost) FROM {db}.usage").scalar()
        kv = await bus.key_value("spend")
        key = next(k for k in await kv.keys())
        assert (await kv.get(key)).value.decode() == f"{month:.6f}"
    finally:
        successor.stop()
        await asyncio.gather(task, return_exceptions=True)


async def _billing_lag_zero(billing: BillingService) -> bool:
    return await billing.lag() == 0
