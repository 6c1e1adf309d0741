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



async def _agent_collecting_dead_letters(bus, nats_server):
    """A running agent of ``CLUSTER`` on its own connection, and the dead letters of its
    consumer as they arrive: ``(agent, agent_bus, agent_task, dead letters, their subscription)``."""
    dead: list[DeadLetter] = []

    async def on_dead(msg) -> None:
        dead.append(Envelope.from_bytes(msg.data).payload_as(DeadLetter))

    agent_bus = await Bus.connect(nats_server.url, bus.prefix, name="agent")
    agent = ClusterAgent(agent_bus, SystemClock(), CLUSTER, StaticBackend(nodes("n"), clock=SystemClock(), runtime_s=None),
                         heartbeat_interval_s=0.2, tick_s=0.02)
    dsub = await bus.js.subscribe(bus.subjects.deadletter(agent.durable), cb=on_dead)
    return agent, agent_bus, asyncio.create_task(agent.run()), dead, dsub


async def _order_receivers(bus, store):
    """Billing, audit (on ``store``) and admission (with the default policy stored) running on
    ``bus``: the other receivers of the scheduler's orders. ``((billing, audit, admission), their tasks)``."""
    from fedsched.store import AsyncStore
    from services.admission.service import AdmissionService
    from services.audit.service import AuditService
    from services.billing.service import BillingService
    from tests.builders import policy_doc, store_policy

    astore = AsyncStore(store)
    services = (BillingService(bus, astore, load_price_catalog(), linger_s=0.02), AuditService(bus, astore, linger_s=0.02))
    tasks = tuple(asyncio.create_task(svc.run()) for svc in services)
    await store_policy(bus, policy_doc())
    admission = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    return (*services, admission), (*tasks, asyncio.create_task(admission.run()))

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

        # the dead replica's placement of j3 arrives late, with its old token, while the standby places
        # j3 itself: both orders are stored (their event ids differ by token; one id made whichever
        # came second a dropped duplicate), the agent refuses the late one and runs the standby's
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
        assert agent.stale_refused >= 1
        await _until(lambda: ("j3", 1, 0) in agent.running, what="j3 running on the standby's order")
        def j3_orders() -> list[int]:
            return sorted(p.payload_as(JobPlaced).fencing_token for p in placements if p.job_id == "j3")

        await _until(lambda: j3_orders() == sorted([old_token, standby.fencing_token]),
                     what="both orders of j3 stored and delivered")
        await dsub.unsubscribe()
    finally:
        await sub.unsubscribe()
        for svc in (a, b, agent):
            svc.stop()
        await asyncio.gather(a_task, b_task, agent_task, return_exceptions=True)
        for x in (a_bus, b_bus, agent_bus):
            await x.close()


async def test_an_agent_that_saw_no_order_of_the_new_holder_refuses_the_former_holders_late_order(
        bus, nats_server, store) -> None:
    """Issue 14: A holds the lease, B takes it; A's order published afterwards reaches an agent
    that has seen no order of B (nor any at all) -- it reads B's tenure from the lease KV and
    refuses it ("stale fencing token", dead-lettered, never started). A's order published while
    A held the lease and read only now is carried out. A billing and an admission started
    afterwards (nothing seen, no checkpoint) judge both the same way."""
    from fedsched.jobs import JobState
    from services.billing.usage import placement_key

    a = await nats_lease(bus, "scheduler", "sched-a", ttl_s=TTL)
    assert await a.step()
    job = spec(gpus=1)
    now = time.time()
    for job_id in ("early", "late"):
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(job_id, job, now))
    sub = bus.subjects.placements(CLUSTER.region, CLUSTER.name)
    await bus.publish(sub, placement("early", job, CLUSTER.name, CLUSTER.region, [("n0", (0,))],
                                     fencing_token=a.token))
    await a.release()
    b = await nats_lease(bus, "scheduler", "sched-b", ttl_s=TTL)
    assert await b.step() and b.token > a.token
    await bus.publish(sub, placement("late", job, CLUSTER.name, CLUSTER.region, [("n0", (1,))],
                                     fencing_token=a.token))
    agent, agent_bus, agent_task, dead, dsub = await _agent_collecting_dead_letters(bus, nats_server)
    (billing, audit, admission), (billing_task, audit_task, admission_task) = await _order_receivers(bus, store)
    try:
        await _until(lambda: dead and ("early", 1, 0) in agent.running, what="the agent's two verdicts")
        assert agent.highest_token == 0 or agent.highest_token == a.token
        assert "stale fencing token" in dead[0].reason and f"below {b.token}" in dead[0].reason
        assert ("late", 1, 0) not in agent.running and agent.stale_refused >= 1  # (a batch, then alone)

        async def billed() -> bool:
            return await billing.lag() == 0
        deadline = time.monotonic() + 15
        while not await billed():
            assert time.monotonic() < deadline, "billing did not catch up"
            await asyncio.sleep(0.02)
        book = await bus.key_value("placements")
        keys = set(await book.keys())
        assert placement_key("early", 1, 0) in keys and placement_key("late", 1, 0) not in keys
        assert billing.stale_orders == 1

        await asyncio.wait_for(admission.ready.wait(), 20)
        view = admission.view
        await _until(lambda: "early" in view.jobs and view.jobs["early"].state == JobState.RUNNING,
                     what="admission folding the early order (and its start)")
        assert view.jobs["late"].state == JobState.QUEUED and view.jobs["late"].current is None
        assert view.stale_orders == 1

        # the audit log holds the late order only as a dead letter of audit, never as a placement
        deadline = time.monotonic() + 15
        while await audit.lag():
            assert time.monotonic() < deadline, "audit did not catch up"
            await asyncio.sleep(0.02)
        db = store.database
        assert store.query(f"SELECT job_id FROM {db}.events WHERE type = 'job.placed' ORDER BY job_id").rows == [
            ("early",)]
        assert store.query(f"SELECT count() FROM {db}.events WHERE job_id = 'late'").scalar() == 1  # its submit
        reasons = store.query(f"SELECT JSONExtractString(payload, 'reason') FROM {db}.events "
                              f"WHERE type = 'bus.dead_letter' AND producer = 'scheduler'").rows
        assert len(reasons) == 1 and f"below {b.token}" in reasons[0][0]
    finally:
        await dsub.unsubscribe()
        for svc in (agent, billing, admission, audit):
            svc.stop()
        await asyncio.gather(agent_task, billing_task, admission_task, audit_task, return_exceptions=True)
        await b.release()
        await agent_bus.close()


async def test_receivers_read_the_same_tenure_before_and_after_a_renewal(bus) -> None:
    """read_tenure on real NATS KV: the acquiring write is its own token and time; a renewal
    (a new revision) names the same tenure and start, copied from the server."""
    from fedsched.lease import read_tenure

    assert await read_tenure(bus) is None  # no lease bucket yet
    lease = await nats_lease(bus, "scheduler", "sched-a", ttl_s=TTL)
    assert await read_tenure(bus) is None  # bucket, no key
    assert await lease.step()
    first = await read_tenure(bus)
    assert first is not None and (first.token, first.holder) == (lease.token, "sched-a") and first.since > 0
    assert abs(first.since - lease.since) < 1e-3
    lease.renewed_at -= 10 * TTL  # due: the next step renews
    await lease.step()
    assert lease.revision > lease.token  # a new revision of the same tenure
    assert await read_tenure(bus) == first
    await lease.release()
    released = await read_tenure(bus)
    assert released.holder == "" and released.token > lease.token and released.since >= first.since


async def test_an_order_stored_between_two_takeovers_is_refused_by_an_agent_that_saw_neither(bus, nats_server) -> None:
    """Issue 14: three holders A, B, C. A dies (no release) and B takes over after the TTL; A's
    order published now is stored in B's tenure; B hands over to C. An agent started only then
    (it saw no order of B, nor any) reads C's tenure -- which began after A's order was stored --
    and, from the history the lease record carries, B's: the order is refused ("below B's
    token"), never started. A's order stored while A held the lease is carried out."""
    from fedsched.lease import read_tenure

    a = await nats_lease(bus, "scheduler", "sched-a", ttl_s=TTL)
    assert await a.step()
    job = spec(gpus=1)
    now = time.time()
    for job_id in ("early", "between"):
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(job_id, job, now))
    sub = bus.subjects.placements(CLUSTER.region, CLUSTER.name)
    await bus.publish(sub, placement("early", job, CLUSTER.name, CLUSTER.region, [("n0", (0,))],
                                     fencing_token=a.token))
    a.abandon()  # killed: no release, B waits the TTL out
    b = await nats_lease(bus, "scheduler", "sched-b", ttl_s=TTL)
    deadline = time.monotonic() + 4 * TTL
    while not await b.step():
        assert time.monotonic() < deadline, "B did not take over"
        await asyncio.sleep(0.05)
    await bus.publish(sub, placement("between", job, CLUSTER.name, CLUSTER.region, [("n0", (1,))],
                                     fencing_token=a.token))
    await b.release()
    c = await nats_lease(bus, "scheduler", "sched-c", ttl_s=TTL)
    assert await c.step() and c.token > b.token > a.token
    tenure = await read_tenure(bus)
    assert tenure.token == c.token and [t for t, _ in tenure.history][:2] == [a.token, b.token]
    agent, agent_bus, agent_task, dead, dsub = await _agent_collecting_dead_letters(bus, nats_server)
    try:
        await _until(lambda: dead and ("early", 1, 0) in agent.running, what="the agent's two verdicts")
        assert agent.highest_token in (0, a.token)  # it saw no order of B or C
        assert "stale fencing token" in dead[0].reason and f"below {b.token}" in dead[0].reason, dead[0].reason
        assert ("between", 1, 0) not in agent.running and agent.stale_refused >= 1
    finally:
        await dsub.unsubscribe()
        agent.stop()
        await asyncio.gather(agent_task, return_exceptions=True)
        await c.release()
        await agent_bus.close()


async def test_a_forged_token_far_above_the_lease_fences_nothing(bus, nats_server, store) -> None:
    """The tryout (attack2.py): one ``job.placed`` with ``fencing_token`` 2^62, published with the
    scheduler's credentials, then the real holder's placements. The forged token was issued by no
    tenure (the lease's current token is below it): the agent, billing, audit and admission refuse
    it with that reason and carry out, bill, record and fold every real placement -- and so does
    the agent after a restart, which re-reads the forged order from the stream."""
    from fedsched.jobs import JobState
    from services.billing.usage import placement_key

    forged = 2 ** 62
    a = await nats_lease(bus, "scheduler", "sched-a", ttl_s=TTL)
    assert await a.step() and 0 < a.token < forged
    why = f"fencing token {forged} was issued by no tenure (the lease's current token is {a.token})"
    job = spec(gpus=1)
    now = time.time()
    for job_id in ("forged", "j1", "j2", "j3"):
        await bus.publish(bus.subjects.job("submitted", job.tenant, job.project), submitted(job_id, job, now))
    sub = bus.subjects.placements(CLUSTER.region, CLUSTER.name)
    await bus.publish(sub, placement("forged", job, CLUSTER.name, CLUSTER.region, [("n0", (0,))],
                                     fencing_token=forged))
    for gpu, job_id in enumerate(("j1", "j2"), start=1):
        await bus.publish(sub, placement(job_id, job, CLUSTER.name, CLUSTER.region, [("n0", (gpu,))],
                                         fencing_token=a.token))
    agent, agent_bus, agent_task, dead, dsub = await _agent_collecting_dead_letters(bus, nats_server)
    (billing, audit, admission), (billing_task, audit_task, admission_task) = await _order_receivers(bus, store)
    agent2 = agent2_bus = agent2_task = None
    try:
        await _until(lambda: dead and {("j1", 1, 0), ("j2", 1, 0)} <= set(agent.running),
                     what="the agent refusing the forged order and running the real ones")
        assert len(dead) == 1 and why in dead[0].reason
        assert ("forged", 1, 0) not in agent.running and agent.highest_token == a.token

        deadline = time.monotonic() + 15
        while await billing.lag():
            assert time.monotonic() < deadline, "billing did not catch up"
            await asyncio.sleep(0.02)
        keys = set(await (await bus.key_value("placements")).keys())
        assert {placement_key("j1", 1, 0), placement_key("j2", 1, 0)} <= keys
        assert placement_key("forged", 1, 0) not in keys
        assert billing.stale_orders == 1 and billing.highest_token == a.token

        await asyncio.wait_for(admission.ready.wait(), 20)
        view = admission.view
        await _until(lambda: all(j in view.jobs and view.jobs[j].state == JobState.RUNNING for j in ("j1", "j2")),
                     what="admission folding the real orders (and their starts)")
        assert view.jobs["forged"].state == JobState.QUEUED and view.highest_token == a.token
        assert view.stale_orders == 1

        deadline = time.monotonic() + 15
        while await audit.lag():
            assert time.monotonic() < deadline, "audit did not catch up"
            await asyncio.sleep(0.02)
        db = store.database
        assert store.query(f"SELECT job_id FROM {db}.events WHERE type = 'job.placed' ORDER BY job_id").rows == [
            ("j1",), ("j2",)]
        reasons = store.query(f"SELECT JSONExtractString(payload, 'reason') FROM {db}.events "
                              f"WHERE type = 'bus.dead_letter' AND producer = 'scheduler'").rows
        assert len(reasons) == 1 and why in reasons[0][0]

        # the agent restarts: it re-reads the forged order from the stream and still runs real ones
        agent.stop()
        await asyncio.gather(agent_task, return_exceptions=True)
        await dsub.unsubscribe()
        await agent_bus.close()
        agent2, agent2_bus, agent2_task, dead2, dsub = await _agent_collecting_dead_letters(bus, nats_server)
        await bus.publish(sub, placement("j3", job, CLUSTER.name, CLUSTER.region, [("n0", (3,))],
                                         fencing_token=a.token))
        await _until(lambda: ("j3", 1, 0) in agent2.running, what="the restarted agent running j3")
        assert agent2.highest_token == a.token and ("forged", 1, 0) not in agent2.running
        assert agent2.stale_refused == 0  # (dead2 replays the first agent's dead letter)
        await _until(lambda: "j3" in view.jobs and view.jobs["j3"].state == JobState.RUNNING,
                     what="admission folding j3")
    finally:
        await dsub.unsubscribe()
        for svc in (agent, agent2, billing, admission, audit):
            if svc is not None:
                svc.stop()
        await asyncio.gather(*(t for t in (agent_task, agent2_task, billing_task, admission_task, audit_task)
                               if t is not None), return_exceptions=True)
        await a.release()
        for b_ in (agent_bus, agent2_bus):
            if b_ is not None:
                await b_.close()
