"""A scheduler restarted on real NATS loads its checkpoint from the object store, reads only the
stream after it, holds the book a full read holds, and takes in a job submitted while it was down
(issue 15 item 3)."""

from __future__ import annotations

import asyncio
import time

from fedsched.clock import SystemClock
from fedsched.pricing import load_price_catalog
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import heartbeat, nodes, snapshot, spec, submitted, until

A, REGION = "cn-north-1-c1", "cn-north-1"


def _scheduler(bus, snapshots: bool) -> SchedulerService:
    return SchedulerService(bus, SystemClock(), build_policy("federated"), load_price_catalog(), stale_after_s=60.0,
                            reclaim_after_s=60.0, interval_s=0.02, snapshot_every_s=3600.0 if snapshots else 0.0)


def _book(svc: SchedulerService) -> dict:
    return {"jobs": {j.job_id: [(s.state, s.attempt, s.cluster) for s in j.shards] for j in svc.jobs.values()},
            "queued": sorted(svc.queued), "active": sorted(svc.active)}


async def _submit(bus, job_id: str, **kw) -> None:
    job = spec(**kw)
    await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(job_id, job, time.time()))


async def test_restart_from_the_checkpoint_reads_only_the_tail_and_agrees_with_a_full_read(bus):
    await bus.publish(bus.subjects.inventory(REGION, A), snapshot(A, REGION, nodes("a", count=1), time.time()))
    await bus.publish(bus.subjects.heartbeat(REGION, A), heartbeat(A, REGION, time.time()))
    for i in range(6):
        await _submit(bus, f"j{i}", gpus=2)  # 8 GPUs: four run, two wait
    first = _scheduler(bus, True)
    task = asyncio.create_task(first.run())
    try:
        assert await until(lambda: len(first.active) == 4 and len(first.queued) == 2)
        last = (await bus.js.stream_info(bus.stream_name("EVENTS"))).state.last_seq
        assert await until(lambda: first.applied_seq >= last)  # its own decisions read back
        assert await first.maybe_snapshot(force=True)
        seq = first.snapshot_seq
    finally:
        first.stop()
        await task
    await _submit(bus, "late", gpus=8)  # while no scheduler runs
    second = _scheduler(bus, True)
    task = asyncio.create_task(second.run())
    try:
        assert await until(lambda: "late" in second.jobs)
        assert second.snapshot_seq == seq
        assert second._events.handled <= second.applied_seq - seq  # only the tail was read
        full = _scheduler(bus, False)
        ftask = asyncio.create_task(full.run())
        try:
            assert await until(lambda: full.applied_seq >= second.applied_seq and not full.busy)
            second.stop()
            await task
            full.stop()
            await ftask
            assert full._events.handled > second._events.handled
            assert _book(second) == _book(full)
            assert ("late", 0) in second.queued  # (8 GPUs: waits for the running ones)
        finally:
            full.stop()
            await asyncio.gather(ftask, return_exceptions=True)
    finally:
        second.stop()
        await asyncio.gather(task, return_exceptions=True)
