"""Dead letters and consumer lag on a real nats-server land in a service's metrics: the bus's
dead-letter hook counts by consumer and reason code, and lag sampling reads JetStream's consumer
info."""

from __future__ import annotations

import asyncio
import time

from fedsched.bus import DurableConsumer
from fedsched.events import JobStatus, business_event_id, make_event
from fedsched.metrics import WriterMetrics


def _event(i: int):
    return make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000), producer="test",
                      occurred_at=time.time(), event_id=business_event_id("metrics", i, "started"),
                      region="cn-north-1", cluster="cn-north-1-c1", tenant="search", project="train", job_id=f"j-{i}",
                      attempt=1)


async def _until(pred, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_dead_letters_counted_by_consumer_and_reason_code(bus):
    m = WriterMetrics("audit")
    bus.on_dead_letter = m.dead_letter
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    await bus.js.publish(subject, b"{not json")
    await bus.publish(subject, _event(1))
    await bus.publish(subject, _event(2))

    async def fails_on_two(ds):
        if any(d.envelope.job_id == "j-2" for d in ds):
            raise ValueError("bug in handler")

    c = DurableConsumer(bus, "EVENTS", "metrics-dlq", [subject], fails_on_two, batch=10, max_wait_s=0.1,
                        max_failures=2)
    task = asyncio.create_task(c.run())
    try:
        assert await _until(lambda: c.dead_lettered == 2)
    finally:
        c.stop()
        await task
    get = m.registry.get_sample_value
    assert get("fedsched_dead_letters_total", {"consumer": "metrics-dlq", "reason": "undecodable"}) == 1
    assert get("fedsched_dead_letters_total", {"consumer": "metrics-dlq", "reason": "handler_failed"}) == 1


async def test_lag_is_sampled_from_jetstream(bus):
    m = WriterMetrics("billing")
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    for i in range(5):
        await bus.publish(subject, _event(10 + i))
    c = DurableConsumer(bus, "EVENTS", "metrics-lag", [subject], lambda ds: asyncio.sleep(0), max_wait_s=0.1)
    stop = asyncio.Event()

    async def lag_then_stop() -> int:
        stop.set()
        return await c.lag()

    await m.sample_lag(lambda: [(c.durable, lag_then_stop)], stop)
    assert m.registry.get_sample_value("fedsched_consumer_lag_messages", {"consumer": "metrics-lag"}) == 5
    assert m.registry.get_sample_value("fedsched_store_backlog_events") == 5
