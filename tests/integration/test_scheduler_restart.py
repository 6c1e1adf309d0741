"""A restarted scheduler judges cluster freshness by when heartbeats were produced (issue 13 item 3a).

Real nats-server, a real :class:`~services.scheduler.service.SchedulerService` on the system
clock; the two clusters' agents are stood in for by publishing their inventory and heartbeats.
Freshness limit 1 s; cluster A (which wins ties) falls silent; 2 s later a new scheduler rebuilds
from the streams and an 8-GPU job that A's last inventory could hold is submitted: it must go
to B. Before the fix the rebuilt scheduler took A's old heartbeat as just heard and placed it
on A.
"""

from __future__ import annotations

import asyncio
import time

from fedsched.clock import SystemClock
from fedsched.pricing import load_price_catalog
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import heartbeat, nodes, snapshot, spec, submitted

A, B, REGION = "cn-north-1-c1", "cn-north-1-c2", "cn-north-1"


async def _until(check, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _scheduler(bus) -> tuple[SchedulerService, list]:
    """A scheduler and the list its run loop appends to after every cycle (empty ones too)."""
    svc = SchedulerService(bus, SystemClock(), build_policy("federated"), load_price_catalog(),
                           stale_after_s=1.0, reclaim_after_s=20.0, interval_s=0.02)
    cycles: list = []
    svc.on_cycle.append(lambda: cycles.append(1))
    return svc, cycles


async def test_a_restarted_scheduler_places_nothing_on_a_cluster_silent_past_the_limit(bus) -> None:
    alive = {A, B}

    async def agents() -> None:  # heartbeats every 0.2 s from the clusters still alive
        while True:
            for name in sorted(alive):
                await bus.publish(bus.subjects.heartbeat(REGION, name), heartbeat(name, REGION, time.time()))
            await asyncio.sleep(0.2)

    for name, prefix in ((A, "a"), (B, "b")):
        await bus.publish(bus.subjects.inventory(REGION, name), snapshot(name, REGION, nodes(prefix), time.time()))
    beating = asyncio.create_task(agents())
    placements: list = []

    async def on_placement(msg) -> None:
        placements.append(msg)

    sub = await bus.nc.subscribe(f"{bus.prefix}.placements.>", cb=on_placement)
    first, cycled = _scheduler(bus)
    running = asyncio.create_task(first.run())
    try:
        await _until(lambda: len(first.clusters) == 2 and cycled, what="the first scheduler")
        first.stop()
        await running
        alive.discard(A)  # A falls silent
        silent_since = time.time()
        await _until(lambda: time.time() - silent_since >= 2.0, timeout=5.0, what="A silent for 2 s")

        second, cycled = _scheduler(bus)  # the restart: rebuilds from the streams
        running = asyncio.create_task(second.run())
        await _until(lambda: len(second.clusters) == 2 and cycled, what="the rebuilt scheduler")
        job = spec(gpus=8)
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("j1", job, time.time()))
        await _until(lambda: "j1" in second.jobs and second.jobs["j1"].shards[0].placed is not None,
                     what="a placement of j1")
        shard = second.jobs["j1"].shards[0]
        assert shard.cluster == B
        # the view skips A (its own heartbeat age); judged stale only after the start-up grace
        await _until(lambda: second.status()["stale"] == [A], timeout=5.0, what="A judged stale after the grace")
        await _until(lambda: placements, what="the placement on the bus")
        assert [m.subject for m in placements] == [bus.subjects.placements(REGION, B)]
        second.stop()
        await running
    finally:
        beating.cancel()
        await sub.unsubscribe()
        if not running.done():
            running.cancel()
        await asyncio.gather(beating, running, return_exceptions=True)
