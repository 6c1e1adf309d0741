"""A lingering durable consumer (the audit and billing writers: ``linger_s``) collects its batch
with a few pull requests per linger window, not one per message trickling in (issue 15: each pull
request is a message to the server and a status reply back), and still hands over exactly the
messages published, in order, in as few batches."""

import asyncio
import time

import pytest

from fedsched.bus import Bus, DurableConsumer
from fedsched.events import JobStatus, business_event_id, make_event
from tests.builders import until


def _event(i: int):
    return make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000), producer="test",
                      occurred_at=time.time(), event_id=business_event_id("linger", i, "started"),
                      region="cn-north-1", cluster="cn-north-1-c1", tenant="search", project="train", job_id=f"j-{i}",
                      attempt=1)


@pytest.mark.parametrize("gap_s,most", [(0.005, 8), (0.05, 9)], ids=["trickle", "slow-trickle"])
async def test_a_lingering_batch_takes_a_few_pull_requests_per_window_not_one_per_message(bus, gap_s, most):
    own = await Bus.connect(bus.nc.connected_url.geturl(), bus.prefix, name="writer-under-test")
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    batches: list[list[str]] = []

    async def handler(deliveries) -> None:
        batches.append([d.envelope.job_id for d in deliveries])

    consumer = DurableConsumer(own, "EVENTS", "linger", [subject], handler, batch=100, max_wait_s=0.5,
                               linger_s=0.6 if gap_s < 0.01 else 3.0)
    task = asyncio.create_task(consumer.run())
    try:
        await bus.publish(subject, _event(0))  # the consumer exists and has read everything so far
        assert await until(lambda: consumer.processed == 1, timeout=10)
        sent0 = own.nc.stats["out_msgs"]
        for i in range(1, 31):  # trickling in, within one linger window (over ~0.15 s, or ~1.5 s)
            await bus.publish(subject, _event(i))
            await asyncio.sleep(gap_s)
        assert await until(lambda: consumer.processed == 31, timeout=10)
        sent = own.nc.stats["out_msgs"] - sent0
    finally:
        consumer.stop()
        await asyncio.gather(task, return_exceptions=True)
        await own.close()
    assert [j for b in batches for j in b] == [f"j-{i}" for i in range(31)]
    assert len(batches) <= 3  # the first message alone, then one window (maybe split at its end)
    requests = sent - 30  # beyond the 30 acks
    print(f"pull requests for 30 messages {gap_s} s apart in one linger window: {requests}")
    assert requests <= most  # before: ~1 per message (31 and 30)
