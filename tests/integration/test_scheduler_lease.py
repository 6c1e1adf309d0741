"""Scheduler replicas on a real nats-server: the lease in NATS KV, takeover, and fencing at the agent.

Real nats-server (own subject prefix), two :class:`~services.scheduler.service.SchedulerService`
replicas on their own connections competing for the lease (TTL 1.5 s), one real
:class:`~services.inventory.agent.ClusterAgent` on one 8-T4 node (jobs run until stopped). The
active replica is killed (task cancelled, connection closed, lease not released, as ``kill -9``
leaves it); the standby must take over within the TTL plus one renewal period, place new work
with a higher fencing token, and a placement carrying the dead replica's token, published by
hand afterwards, must be dead-lettered by the agent and never started.
"""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import pytest

from fedsched.bus import Bus
from fedsched.clock import SystemClock
from fedsched.events import DeadLetter, Envelope, JobPlaced
from fedsched.lease import LeaseConflict, LeaseRecord, NatsLeaseStore, nats_lease
from fedsched.pricing import load_price_catalog
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import StaticBackend, nodes, placement, spec, submitted

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
TTL = 1.5


async def _until(check, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_nats_kv_gives_the_compare_and_set_the_lease_needs(bus) -> None:
    kv = await bus.js.create_key_value(bucket=f"{bus.prefix}_leasecas", history=1)
    store = NatsLeaseStore(kv)
    assert await store.get("scheduler") is None
    first = await store.create("scheduler", LeaseRecord("a", TTL))
    with pytest.raises(LeaseConflict):
        await store.create("scheduler", LeaseRecord("b", TTL))
    with pytest.raises(LeaseConflict):
        await store.update("scheduler", LeaseRecord("b", TTL), last=first + 100)
    second = await store.update("scheduler", LeaseRecord("b", TTL), last=first)
    assert second > first
    assert await store.get("scheduler") == LeaseRecord("b", TTL, second)
    await kv.delete("scheduler")
    assert await store.get("scheduler") is None
    assert await store.create("scheduler", LeaseRecord("c", TTL)) > second  # over the delete marker
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):  # the error nats.py raises, translated above
        await kv.update("scheduler", b"x", last=1)


async def _replica(url: str, prefix: str, name: str) -> tuple[SchedulerService, asyncio.Task, Bus]:
    b = await Bus.connect(url, prefix, name=name)
    lease = await nats_lease(b, "scheduler", name, ttl_s=TTL)
    svc = SchedulerService(b, SystemClock(), build_policy("federated"), load_price_catalog(), stale_after_s=10.0,
                           reclaim_after_s=60.0, interval_s=0.02, lease=lease)
    return svc, asyncio.create_task(svc.run(), name=name), b


async def test_the_standby_takes_over_within_the_ttl_and_the_agent_refuses_the_dead_replicas_token(
        bus, nats_server) -> None:
    placements: list[Envelope] = []

    async def on_placement(msg) -> None:
        placements.append(Envelope.from_bytes(msg.data))

    sub = await bus.nc.subscribe(f"{bus.prefix}.placements.>", cb=on_placement)
    agent_bus = await Bus.connect(nats_server.url, bus.prefix, name="agent")
    agent = ClusterAgent(agent_bus, SystemClock(), CLUSTER, StaticBackend(nodes("n"), clock=SystemClock(), runtime_s=None),
                         heartbeat_interval_s=0.2, tick_s=0.02)
    agent_task = asyncio.create_task(agent.run())
    a, a_task, a_bus = await _replica(nats_server.url, bus.prefix, "sched-a")
    b, b_task, b_bus = await _replica(nats_server.url, bus.prefix, "sched-b")
    try:
        await _until(lambda: a.leading or b.leading, what="one active replica")
        active, active_task, active_bus = (a, a_task, a_bus) if a.leading else (b, b_task, b_bus)
        standby = b if active is a else a
        assert not standby.leading
        job = spec(gpus=1)
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("j1", job, time.time()))
        await _until(lambda: ("j1", 1, 0) in agent.running, what="j1 running")
        old_token = active.fencing_token
        assert placements[-1].payload_as(JobPlaced).fencing_token == old_token > 0

        # kill -9 of the active replica: no release, its connection gone
        active.lease.abandon()
        active_task.cancel()
        await asyncio.gather(active_task, return_exceptions=True)
        await active_bus.nc.close()
        killed_at = time.monotonic()
        await _until(lambda: standby.leading, timeout=TTL * 4, what="the standby taking over")
        failover_s = time.monotonic() - killed_at
        print(f"\nfailover: standby active {failover_s:.2f} s after the kill (TTL {TTL} s)")
        assert failover_s <= TTL + standby.lease.renew_every_s + 0.5
        assert standby.fencing_token > old_token

        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted("j2", job, time.time()))
        await _until(lambda: ("j2", 1, 0) in agent.running, what="j2 running after the takeover")
        assert standby.jobs["j1"].shards[0].attempt == 1  # resumed from the events: j1 not placed again
        assert [p.job_id for p in placements].count("j1") == 1

        # the dead replica's placement arrives late, with its old token
        j3 = spec(gpus=1)
        await bus.publish(bus.subjects.job("submitted", j3.tenant, j3.project), submitted("j3", j3, time.time()))
        late = placement("j3", j3, CLUSTER.name, CLUSTER.region, [("n0", (7,))], fencing_token=old_token)
        await bus.publish(bus.subjects.placements(CLUSTER.region, CLUSTER.name), late)
        dead: list[DeadLetter] = []

        async def on_dead(msg) -> None:
            dead.append(Envelope.from_bytes(msg.data).payload_as(DeadLetter))

        dsub = await bus.js.subscribe(bus.subjects.deadletter(agent.durable), cb=on_dead)
        await _until(lambda: dead, what="the dead letter of the stale placement")
        assert "stale fencing token" in dead[0].reason and f"token {old_token}" in dead[0].reason
        assert agent.stale_refused >= 1 and ("j3", 1, 0) not in agent.running
        await dsub.unsubscribe()
    finally:
        await sub.unsubscribe()
        for svc in (a, b, agent):
            svc.stop()
        await asyncio.gather(a_task, b_task, agent_task, return_exceptions=True)
        for x in (a_bus, b_bus, agent_bus):
            await x.close()
