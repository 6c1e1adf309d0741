"""A job that can never run as asked, on real NATS with the real scheduler service: it stays
queued while no cluster could hold it, and ends (CANCELLED, reason ``unschedulable_timeout``)
once it has been unplaceable for ``unschedulable_timeout_s`` of business time; a placeable job
is unaffected, and a restarted scheduler does not queue the ended job again."""

from __future__ import annotations

import asyncio
import time

from fedsched.events import (Envelope, InventorySnapshot, JobSubmitted, NodeInventory, business_event_id,
                             make_event)
from fedsched.jobs import JobSpec
from fedsched.pricing import load_price_catalog
from services.admission.jobview import JobView
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import policy_doc, store_policy, until

DAY = 86400.0


class ManualClock:
    """Business time that moves only when the test says so."""

    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t


async def _submit(bus, job_id: str, card: str, at: float) -> Envelope:
    spec = JobSpec(tenant="search", project="train", card_models=(card,), home_region="cn-north-1",
                   estimated_duration_s=600)
    event = make_event("job.submitted", JobSubmitted(spec=spec, submitted_by="alice"), producer="admission",
                       occurred_at=at, event_id=business_event_id(job_id, "submitted"), tenant="search",
                       project="train", job_id=job_id, actor="alice")
    await bus.publish(bus.subjects.job("submitted", "search", "train"), event)
    return event


async def _events(bus, job_id: str, kind: str) -> list[Envelope]:
    sub = await bus.js.pull_subscribe(bus.subjects.decisions("search", "train"), stream=bus.stream_name("EVENTS"))
    try:
        msgs = await sub.fetch(100, timeout=0.5)
    except Exception:  # noqa: BLE001 - nats TimeoutError: nothing there
        msgs = []
    finally:
        await sub.unsubscribe()
    return [e for m in msgs if (e := Envelope.from_bytes(m.data)).type == kind and e.job_id == job_id]


async def test_an_unplaceable_job_ends_after_the_timeout_and_stays_ended_after_a_restart(bus):
    await store_policy(bus, policy_doc())
    snap = InventorySnapshot(nodes=tuple(NodeInventory(name=f"n{i}", card_model="nvidia-t4-16gb", gpus=4,
                                                       gpu_memory_gib=16) for i in range(2)))
    await bus.publish(bus.subjects.inventory("cn-north-1", "cn-north-1-c1"), make_event(
        "inventory.snapshot", snap, producer="agent", occurred_at=time.time(), region="cn-north-1",
        cluster="cn-north-1-c1"))
    clock = ManualClock(time.time())
    never = await _submit(bus, "j-" + "a" * 20, "nvidia-a100-80gb", clock.t)  # no cluster has an A100
    fine = await _submit(bus, "j-" + "b" * 20, "nvidia-t4-16gb", clock.t)
    svc = SchedulerService(bus, clock, build_policy(), load_price_catalog(), unschedulable_timeout_s=DAY)
    task = asyncio.create_task(svc.run())
    try:
        assert await until(lambda: never.job_id in svc.jobs and svc.jobs[never.job_id].shards[0].unplaceable)
        assert await until(lambda: fine.job_id in svc.jobs and svc.jobs[fine.job_id].shards[0].state == "placed")
        clock.t += DAY - 1  # one second short of the timeout: still queued
        cycles = svc.cycles
        assert await until(lambda: svc.cycles >= cycles + 2)
        assert svc.jobs[never.job_id].shards[0].state == "queued" and not await _events(bus, never.job_id,
                                                                                      "job.cancelled")
        clock.t += 1
        assert await until(lambda: svc.jobs[never.job_id].done)
    finally:
        svc.stop()
        await task
    ended, = await _events(bus, never.job_id, "job.cancelled")
    assert ended.payload["reason"].startswith("unschedulable_timeout: no cluster could hold it as asked for 86400 s")
    assert not await _events(bus, fine.job_id, "job.cancelled")
    view = JobView()  # what admission shows
    for env in (never, ended):
        view.apply(env)
    rec = view.jobs[never.job_id]
    assert rec.state.value == "cancelled" and rec.reason.startswith("unschedulable_timeout")

    again = SchedulerService(bus, clock, build_policy(), load_price_catalog(), unschedulable_timeout_s=DAY)
    task = asyncio.create_task(again.run())
    try:
        assert await until(lambda: never.job_id in again.jobs and again.jobs[never.job_id].done)
        assert (never.job_id, 0) not in again.queued and again.jobs[never.job_id].shards[0].outcome == "cancelled"
        assert len(await _events(bus, never.job_id, "job.cancelled")) == 1  # not ended a second time
    finally:
        again.stop()
        await task
