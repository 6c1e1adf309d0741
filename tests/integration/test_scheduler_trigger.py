"""A scheduler's cycle starts when something changes, after a short coalescing delay (issue 15).

Real nats-server, a real :class:`~services.scheduler.service.SchedulerService` running its own
loop on the system clock; one cluster's agent is stood in for by publishing its inventory and
heartbeats. A burst of submissions published together is decided in a few cycles (the
coalescing delay gathers what the follower reads with the first one), not one cycle per
submission, and a lone submission reaching an idle scheduler is placed at once -- the cycle
is woken by the submission, not by a timer (the test stops heartbeats and puts the idle
timer 60 s away).
"""

from __future__ import annotations

import asyncio
import time

from fedsched.clock import SystemClock
from fedsched.events import Envelope
from fedsched.pricing import load_price_catalog
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from services.scheduler.states import ShardState
from tests.builders import heartbeat, nodes, snapshot, spec, status_event, submitted

A, REGION = "cn-north-1-c1", "cn-north-1"


async def _until(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_a_burst_is_decided_in_a_few_cycles_and_a_lone_submission_is_placed_without_waiting_for_a_timer(bus):
    async def agent() -> None:
        while True:
            await bus.publish(bus.subjects.heartbeat(REGION, A), heartbeat(A, REGION, time.time()))
            await asyncio.sleep(0.2)

    await bus.publish(bus.subjects.inventory(REGION, A), snapshot(A, REGION, nodes("a", count=64), time.time()))
    beating = asyncio.create_task(agent())
    svc = SchedulerService(bus, SystemClock(), build_policy("federated"), load_price_catalog(),
                           stale_after_s=30.0, reclaim_after_s=60.0, interval_s=0.05, coalesce_s=0.02)
    cycles: list[int] = []  # placements so far, after every cycle
    svc.on_cycle.append(lambda: cycles.append(svc.counts[ShardState.PLACED]))
    running = asyncio.create_task(svc.run())
    try:
        await _until(lambda: svc.clusters and cycles, what="the scheduler's first cycle")
        burst = 200
        items = []
        for i in range(burst):
            job = spec(gpus=1)
            items.append((bus.subjects.job("submitted", job.tenant, job.project), submitted(f"b{i}", job, time.time()),
                          None))
        before = len(cycles)
        assert all(await bus.publish_many(items))
        await _until(lambda: svc.counts[ShardState.PLACED] == burst, what="the burst placed")
        placing = cycles[before:]
        # a few cycles for 200 submissions (what one follower fetch brings is one cycle's work)
        assert len([1 for a, b in zip([0] + placing, placing) if b > a]) <= 20, placing

        # idle, and no timer can start a cycle: heartbeats stop and the next timed wake-up is 60 s
        # away (the wait already running ends within its <= 1 s timeout first)
        beating.cancel()
        await _until(lambda: not svc.busy and not svc._dirty.is_set(), what="an idle scheduler")
        svc.next_wake_s = lambda: 60.0
        await asyncio.sleep(1.2)
        idle_cycles = len(cycles)
        await asyncio.sleep(0.3)
        assert len(cycles) == idle_cycles, "a cycle ran with nothing to wake it"
        job = spec(gpus=1)
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("lone", job, time.time()))
        # only the submission can wake a cycle now (a missed wake-up would wait out the 60 s timer)
        await _until(lambda: "lone" in svc.jobs and svc.jobs["lone"].shards[0].placed is not None,
                     timeout=20, what="the lone submission placed by the cycle its arrival woke")
    finally:
        svc.stop()
        await asyncio.wait_for(running, 10)
        beating.cancel()


async def test_a_restart_longer_than_the_freshness_limit_loses_no_running_job(bus):
    """The tryout on real NATS: a job runs on A (limit 1 s); the scheduler and A's agent stop,
    the scheduler starts again 1.5 s later (A's newest heartbeat is older than the limit) and
    A's heartbeats resume 0.3 s after that: the job keeps running, attempt 1, nothing stopped."""
    beats = asyncio.Event()

    async def agent() -> None:
        while True:
            if beats.is_set():
                await bus.publish(bus.subjects.heartbeat(REGION, A), heartbeat(A, REGION, time.time()))
            await asyncio.sleep(0.2)

    def scheduler():
        return SchedulerService(bus, SystemClock(), build_policy("federated"), load_price_catalog(),
                                stale_after_s=1.0, reclaim_after_s=60.0, interval_s=0.05, coalesce_s=0.02)
    await bus.publish(bus.subjects.inventory(REGION, A), snapshot(A, REGION, nodes("a", count=4), time.time()))
    beats.set()
    beating = asyncio.create_task(agent())
    svc = scheduler()
    running = asyncio.create_task(svc.run())
    try:
        job = spec(gpus=1)
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("r1", job, time.time()))
        await _until(lambda: "r1" in svc.jobs and svc.jobs["r1"].shards[0].placed is not None, what="r1 placed")
        msg = await bus.js.get_last_msg(bus.stream_name("EVENTS"), bus.subjects.placements(REGION, A))
        placed = Envelope.from_bytes(msg.data)
        await bus.publish(bus.subjects.status(REGION, A), status_event("job.started", placed, time.time(),
                                                                       started_at=time.time()))
        await _until(lambda: svc.jobs["r1"].shards[0].state == ShardState.RUNNING, what="r1 running")
        beats.clear()
        svc.stop()
        await asyncio.wait_for(running, 10)
        await asyncio.sleep(1.5)  # the downtime itself (the scenario), longer than the limit
        svc = scheduler()
        cycles: list[int] = []
        svc.on_cycle.append(lambda: cycles.append(1))
        running = asyncio.create_task(svc.run())
        await _until(lambda: cycles, what="the restarted scheduler's first cycle")
        await asyncio.sleep(0.3)
        beats.set()
        await asyncio.sleep(2.0)  # past the grace: a loss would have been declared by now
        shard = svc.jobs["r1"].shards[0]
        assert (shard.state, shard.attempt) == (ShardState.RUNNING, 1)
        assert svc.status()["stale"] == []
    finally:
        svc.stop()
        await asyncio.wait_for(running, 10)
        beating.cancel()
