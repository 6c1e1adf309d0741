"""Issue 14 item 1 on real NATS + real chDB: billing prices only what the federation placed, and
audit records what agents say for others as security events, attributed to the sender."""

import asyncio
from datetime import UTC, datetime
from decimal import Decimal

from fedsched.events import DeadLetter, Envelope, JobStatus, business_event_id, make_event
from fedsched.pricing import load_price_catalog
from fedsched.store import AsyncStore
from services.audit.service import AuditService
from services.billing.service import BillingService
from fedapp.web.reads import Reads
from fedsched.bus import Bus
from tests.builders import placement_of, unique, until

START = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()
R = "cn-east-1"
C1, C2 = "cn-east-1-c1", "cn-east-1-c2"


def _status(type_, *, job="j-1", cluster=C1, at=START, gpu_milli=2000, card="nvidia-t4-16gb", tenant="nlp"):
    step = "started" if type_ == "job.started" else "ended"
    return make_event(type_, JobStatus(card_model=card, gpu_milli=gpu_milli, cpu_milli=8000, kind="training",
                                       started_at=datetime.fromtimestamp(START, UTC)),
                      producer=f"agent/{cluster}", occurred_at=at, event_id=business_event_id(job, 1, 0, step),
                      region=R, zone=R + "a", cluster=cluster, tenant=tenant, project="train", job_id=job, attempt=1)


async def test_forged_ends_bill_nothing_and_the_real_end_is_billed_once(bus, store):
    """The issue's two examples: the agent of c2 reports c1's running job SUCCEEDED (with the id
    the real end will have), and reports an invented job of 512 H100s for 30 days."""
    astore = AsyncStore(store)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)
    audit = AuditService(bus, astore, linger_s=0.02)
    tasks = [asyncio.create_task(billing.run()), asyncio.create_task(audit.run())]
    real_end = _status("job.finished", at=START + 3600)
    await bus.publish(bus.subjects.placements(R, C1), placement_of(real_end, at=START - 60))
    await bus.publish(bus.subjects.status(R, C1), _status("job.started"))
    # c2's agent, on its own subject (all its NATS user may publish on)
    forged_success = _status("job.finished", at=START + 60)
    forged_success_c2 = _status("job.finished", cluster=C2, at=START + 60)
    invented = _status("job.finished", job="invented", cluster=C2, at=START + 30 * 86400, gpu_milli=512_000,
                       card="nvidia-h100-80gb", tenant="victim")
    for forged in (forged_success, forged_success_c2, invented):
        # another message id than the real end's (JetStream would otherwise drop the real one
        # inside its duplicate window -- see the report)
        await bus.js.publish(bus.subjects.status(R, C2), forged.to_bytes(),
                             headers={"Nats-Msg-Id": "forged-" + forged.event_id + forged.cluster})

    async def refused():
        return billing.rejected == 3 and await billing.lag() == 0
    assert await until(refused, timeout=20, interval=0.05)
    db = store.database
    assert store.query(f"SELECT count() FROM {db}.usage").scalar() == 0
    # the real end arrives later, from where the job runs: billed once, at the placement's size
    await bus.publish(bus.subjects.status(R, C1), real_end)

    async def billed():
        return store.query(f"SELECT count() FROM {db}.usage").scalar() == 1 and await billing.lag() == 0
    assert await until(billed, timeout=20, interval=0.05)
    rows = store.query(f"SELECT usage_id, tenant, cluster, card_model, gpu_milli, cost FROM {db}.usage").rows
    assert rows == [(real_end.event_id, "nlp", C1, "nvidia-t4-16gb", 2000, Decimal("10.800000"))]
    kv = await bus.key_value("spend")
    assert (await kv.get("nlp.2023-03")).value == b"10.800000"
    assert not [k async for k in _keys(kv) if k.startswith("victim.")]

    async def audited():
        # billing's three dead letters are written: its security records were read by audit too
        dead = store.query(f"SELECT count() FROM {db}.events WHERE type = 'bus.dead_letter' "
                           f"AND producer = 'billing'").scalar()
        return dead == 3 and await audit.lag() == 0
    assert await until(audited, timeout=20, interval=0.05)
    billing.stop(), audit.stop()
    await asyncio.gather(*tasks)
    sec = store.query(f"SELECT producer, cluster, JSONExtractString(payload, 'sender'), "
                      f"JSONExtractString(payload, 'reason'), actor FROM {db}.events "
                      f"WHERE type = 'security.rejected_message' ORDER BY producer, payload").rows
    # one security event per forged message, though billing and audit both refused each: attributed
    # to c2's agent (the sender its subject names), whichever consumer's record came first
    assert len(sec) == 3 and all(r[0] == f"agent/{R}/{C2}" and r[1] == C2 and r[2] == f"agent/{R}/{C2}"
                                 and r[4] in ("billing", "audit") for r in sec)
    assert {r[3] for r in sec} == {
        f"envelope claims {R}/{C1} but arrived on status subject of {R}/{C2}",
        f"attempt 1 of j-1 was placed on {R}/{C1}, not on {R}/{C2}",
        "attempt 1 (shard 0) of invented was never placed"}
    # ... and never as the event it claims to be: by job id the log holds only what happened
    assert store.query(f"SELECT type, cluster FROM {db}.events WHERE job_id = 'j-1' "
                       f"ORDER BY occurred_at, type").rows == [
        ("job.placed", C1), ("job.started", C1), ("job.finished", C1), ("usage.recorded", C1)]
    assert store.query(f"SELECT count() FROM {db}.events WHERE job_id = 'invented' OR tenant = 'victim'").scalar() == 0
    claimed = store.query(f"SELECT JSONExtractString(payload, 'event_type'), JSONExtractString(payload, 'job_id') "
                          f"FROM {db}.events WHERE type = 'security.rejected_message' AND producer = 'agent/{R}/{C2}' "
                          f"ORDER BY 2, 1").rows
    assert claimed == [("job.finished", "invented"), ("job.finished", "j-1"), ("job.finished", "j-1")]
    # the console's job page counts the same
    events, total = await Reads(store.query, db).job_events("j-1")
    assert total == 4 and sorted(e.type for e in events) == ["job.finished", "job.placed", "job.started", "usage.recorded"]
    assert not [e for e in events if e.type.startswith("REFUSED")]


async def _keys(kv):
    try:
        for k in await kv.keys():
            yield k
    except Exception:  # noqa: BLE001 - no keys at all
        return


async def test_an_agents_dead_letter_subject_cannot_put_events_into_the_audit_log(bus, store):
    """An agent publishes a job.finished envelope 'from the scheduler' and a dead letter with a real
    event's id on its dead-letter subject: audit records both only as bus.dead_letter rows
    attributed to that agent, under ids of their own."""
    astore = AsyncStore(store)
    audit = AuditService(bus, astore, linger_s=0.02)
    task = asyncio.create_task(audit.run())
    fake = _status("job.finished", at=START + 60)
    fake = Envelope.model_validate({**fake.model_dump(), "producer": "scheduler"})
    dead = make_event("bus.dead_letter", DeadLetter(consumer="scheduler-events", subject="fed.x", reason="spoof"),
                      producer="scheduler", occurred_at=START, event_id=fake.event_id, tenant="nlp", job_id="j-1")
    subject = bus.subjects.deadletter("agent-" + C2)
    await bus.js.publish(subject, fake.to_bytes(), headers={"Nats-Msg-Id": "a"})
    await bus.js.publish(subject, dead.to_bytes(), headers={"Nats-Msg-Id": "b"})

    async def written():
        n = store.query(f"SELECT count() FROM {store.database}.events").scalar()
        return await audit.lag() == 0 and n == 2
    assert await until(written, timeout=20, interval=0.05)
    audit.stop()
    await task
    rows = store.query(f"SELECT type, producer, tenant, job_id, event_id != '{fake.event_id}' "
                       f"FROM {store.database}.events ORDER BY type").rows
    assert rows == [("bus.dead_letter", "agent-" + C2, "", "", 1)] * 2


async def _count(store, where: str) -> int:
    return store.query(f"SELECT count() FROM {store.database}.events WHERE {where}").scalar()


async def test_a_refusal_repeated_after_a_restart_adds_no_audit_row(nats_server, store):
    """Issue 14: billing refuses an invented end, then (restarted with its durable reset) reads
    the stream again and refuses it again -- past JetStream's duplicate window, so the second
    refusal really reaches the dead-letter stream. Audit still holds one dead letter of billing
    and one security record of the message, which audit refused too (before: 3 -> 5 rows)."""
    window = 0.3
    bus = await Bus.connect(nats_server.url, unique("t"), name="test", duplicate_window_s=window)
    await bus.ensure_streams()
    astore = AsyncStore(store)
    audit = AuditService(bus, astore, linger_s=0.02)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    invented = _status("job.finished", job="invented", cluster=C2, at=START + 600)
    await bus.publish(bus.subjects.status(R, C2), invented)
    dlq = f"{bus.prefix.upper()}_DLQ"
    by_billing = "producer = 'billing' AND type = 'bus.dead_letter'"
    security = "type = 'security.rejected_message'"

    async def recorded():
        return (await _count(store, by_billing) == 1 and await audit.lag() == 0
                and (await bus.js.stream_info(dlq)).state.messages == 2)
    try:
        assert await until(recorded, timeout=20, interval=0.05)
        billing.stop()
        await tasks.pop()
        await bus.js.delete_consumer(billing.consumer.stream, billing.consumer.durable)
        await asyncio.sleep(2 * window)  # past the duplicate window: JetStream no longer drops the repeat
        again = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)
        tasks.append(asyncio.create_task(again.run()))

        async def refused_again():
            return again.rejected == 1 and (await bus.js.stream_info(dlq)).state.messages == 4
        assert await until(refused_again, timeout=20, interval=0.05)

        async def drained():
            return await audit.lag() == 0
        assert await until(drained, timeout=20, interval=0.05)
        assert await _count(store, by_billing) == 1 and await _count(store, security) == 1
    finally:
        audit.stop()
        for c in (billing, *([again] if "again" in locals() else [])):
            c.stop()
        await asyncio.gather(*tasks)
        await bus.close()


async def test_repeated_ends_of_an_ended_attempt_bill_one_compute_line_across_a_restart(bus, store):
    """The tryout: j-1's attempt 1 ends (job.finished, billed); billing restarts; the agent of the
    cluster it ran on (its own subject) sends another job.finished with another time and a
    job.failed for that attempt: still one compute line, both refused with the first end's time."""
    astore = AsyncStore(store)
    db = store.database
    real_end = _status("job.finished", at=START + 3600)
    await bus.publish(bus.subjects.placements(R, C1), placement_of(real_end, at=START - 60))
    await bus.publish(bus.subjects.status(R, C1), _status("job.started"))
    await bus.publish(bus.subjects.status(R, C1), real_end)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)
    task = asyncio.create_task(billing.run())

    async def billed():
        return store.query(f"SELECT count() FROM {db}.usage").scalar() == 1 and await billing.lag() == 0
    assert await until(billed, timeout=20, interval=0.05)
    billing.stop()
    await task
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.02)  # a restart: memory empty
    audit = AuditService(bus, astore, linger_s=0.02)
    tasks = [asyncio.create_task(billing.run()), asyncio.create_task(audit.run())]
    again = make_event("job.finished", real_end.payload_as(JobStatus), producer=real_end.producer,
                       occurred_at=START + 7200, event_id="f" * 32, region=R, zone=R + "a",
                       cluster=C1, tenant="nlp", project="train", job_id="j-1", attempt=1)
    failed = make_event("job.failed", real_end.payload_as(JobStatus), producer=real_end.producer,
                        occurred_at=START + 9000, event_id="e" * 32, region=R, zone=R + "a",
                        cluster=C1, tenant="nlp", project="train", job_id="j-1", attempt=1)
    for forged in (again, failed):
        await bus.publish(bus.subjects.status(R, C1), forged)

    async def refused():
        dead = store.query(f"SELECT count() FROM {db}.events WHERE type = 'bus.dead_letter' "
                           f"AND producer = 'billing'").scalar()
        return billing.rejected == 2 and await billing.lag() == 0 and dead == 2 and await audit.lag() == 0
    assert await until(refused, timeout=20, interval=0.05)
    billing.stop(), audit.stop()
    await asyncio.gather(*tasks)
    assert store.query(f"SELECT usage_id, line, cost FROM {db}.usage").rows == [
        (real_end.event_id, "compute", Decimal("10.800000"))]
    reasons = store.query(f"SELECT JSONExtractString(payload, 'reason') FROM {db}.events "
                          f"WHERE type = 'bus.dead_letter' AND producer = 'billing'").rows
    assert ["attempt already ended at 2023-03-01T13:00:00" in r[0] for r in reasons] == [True, True], reasons
    # audit: the log of j-1 holds the one end; the repeated ones only as security records
    assert store.query(f"SELECT type FROM {db}.events WHERE job_id = 'j-1' ORDER BY occurred_at, type").rows == [
        ("job.placed",), ("job.started",), ("job.finished",), ("usage.recorded",)]
    assert store.query(f"SELECT count() FROM {db}.events WHERE type = 'security.rejected_message' "
                       f"AND JSONExtractString(payload, 'job_id') = 'j-1'").scalar() == 2
