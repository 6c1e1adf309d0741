"""``GetStatus`` for the writers (audit, billing): a writer that pulls with nothing to do -- billing
between job starts and stops -- is ``idle, caught up`` with lag 0 and seen now, however long ago
its last message came; one nobody pulls from shows that age and is down. Real nats-server and
the real :class:`~fedsched.bus.DurableConsumer` under billing's durable names; the wall clock of
the status call is a fake set 600 s after the last message (no waiting for ages to grow)."""

from __future__ import annotations

import asyncio
import re
import time

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.bus import DurableConsumer
from services.admission.clusterview import ClusterView
from services.admission.ops_servicers import DURABLES, SystemServicer
from tests.builders import FakeClock, placement, spec, status_event, until

REGION, CLUSTER = "cn-north-1", "cn-north-1-c1"


async def _own():
    return "admission", 0


async def _billing(bus, wall: FakeClock) -> pb.ServiceStatus:
    svc = SystemServicer(bus, ClusterView(), wall, _own, timeout_s=2.0)
    return {s.name: s for s in (await svc.GetStatus(pb.GetStatusRequest(), None)).services}["billing"]


async def _waiting(bus, durable: str) -> int:
    return int((await bus.js.consumer_info(bus.stream_name("EVENTS"), durable)).num_waiting or 0)


async def _none_waiting(bus, durable: str) -> bool:
    return await _waiting(bus, durable) == 0


async def test_an_idle_writer_that_is_caught_up_is_not_taken_for_a_silent_one(bus):
    handled = []

    async def handle(deliveries):
        handled.extend(deliveries)

    subject = bus.subjects.status(REGION, CLUSTER)
    consumers = [DurableConsumer(bus, "EVENTS", durable, [subject], handle, max_wait_s=1.0)
                 for _, durable in DURABLES["billing"]]
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    try:
        placed = placement("j1", spec(), CLUSTER, REGION, [("n-0", (0,))], at=time.time())
        await bus.publish(subject, status_event("job.started", placed, time.time(), started_at=time.time()))
        assert await until(lambda: len(handled) == len(consumers), 10), "each durable handles the start"
        for c in consumers:
            assert await until(lambda: _waiting(bus, c.durable), 10), f"{c.durable} pulls again"
        wall = FakeClock(time.time() + 600)  # ten minutes without work

        idle = await _billing(bus, wall)
        assert (idle.state, idle.consumer_lag, idle.last_seen_age_seconds) == ("ok", 0, 0.0), idle
        for c in consumers:
            assert re.search(rf"{c.durable} lag 0, idle, caught up \(last message 6\d\d s ago\)", idle.detail), idle
    finally:
        for c in consumers:
            c.stop()
        await asyncio.gather(*tasks)

    for c in consumers:  # nobody pulls once the pull requests still waiting on the server expire
        assert await until(lambda: _none_waiting(bus, c.durable), 10), f"{c.durable} still has a pull waiting"
    silent = await _billing(bus, wall)
    assert silent.state == "down" and 600 <= silent.last_seen_age_seconds < 700, silent
    assert "nobody pulling for 6" in silent.detail and "idle" not in silent.detail
