"""Audit and billing on real NATS + real chDB: one row per event, whatever is delivered twice."""

import asyncio
import json
import time
from datetime import UTC, datetime
from decimal import Decimal

import yaml

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Delivery
from fedapp.client import aio_channel
from fedsched.clock import ClockState, ReplayClock
from fedsched.events import DeadLetter, Envelope, JobStatus, business_event_id, make_event
from nats.js.api import DeliverPolicy
from fedapp.cli.jobs import Api
from fedsched.pricing import load_price_catalog
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from fedsched.store import AsyncStore
from fedsched.telemetry import trace_id_of
from services.audit.service import AuditService
from services.billing.service import BillingService
from services.inventory.trace import TraceNode
from tests.builders import placement_of, unique, until

START = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()


def _status(type_, job="j-1", attempt=1, at=START, started=START, gpu_milli=2000):
    step = "started" if type_ == "job.started" else "ended"
    return make_event(type_, JobStatus(card_model="nvidia-t4-16gb", gpu_milli=gpu_milli, cpu_milli=8000,
                                       started_at=datetime.fromtimestamp(started, UTC), kind="training"),
                      producer="agent/cn-east-1-c1", occurred_at=at,
                      event_id=business_event_id(job, attempt, 0, step), region="cn-east-1", zone="cn-east-1a",
                      cluster="cn-east-1-c1", tenant="nlp", project="train", job_id=job, attempt=attempt)


async def test_same_event_twice_gives_one_audit_row_and_one_usage_row(bus, store):
    astore = AsyncStore(store)
    audit, billing = AuditService(bus, astore, linger_s=0.05), BillingService(bus, astore, load_price_catalog(),
                                                                              linger_s=0.05)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    started, finished = _status("job.started"), _status("job.finished", at=START + 3600)
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), placement_of(finished, at=START - 60))
    for e in (started, finished):
        await bus.publish(subject, e)
        # the same event again, under another message id: JetStream cannot dedup it, the writers must
        await bus.js.publish(subject, e.to_bytes(), headers={"Nats-Msg-Id": e.event_id + "-again"})

    async def written():
        n = store.query(f"SELECT count() FROM {store.database}.usage").scalar()
        # billing first: its usage.recorded is published before it acknowledges, and audit must have read it
        return n >= 1 and await billing.consumer.lag() == 0 and await audit.lag() == 0

    assert await until(written, timeout=15, interval=0.05)
    audit.stop(), billing.stop()
    await asyncio.gather(*tasks)
    db = store.database
    rows = store.query(f"SELECT type, count() FROM {db}.events WHERE job_id = 'j-1' AND type LIKE 'job.%' GROUP BY type ORDER BY type").rows
    assert rows == [("job.finished", 1), ("job.placed", 1), ("job.started", 1)]
    (usage,) = store.query(f"SELECT gpu_seconds, unit_price, cost, outcome FROM {db}.usage").rows
    # 2 GPUs x 3600 s in cn-east-1 (T4: 6.0 x 0.9 = 5.4 per GPU-hour) = 10.8
    assert usage == (7200.0, Decimal("5.400000"), Decimal("10.800000"), "finished")
    recorded = store.query(f"SELECT count() FROM {db}.events WHERE type = 'usage.recorded'").scalar()
    assert recorded == 1


async def test_an_unknown_event_type_is_stored_by_audit_and_skipped_by_billing_not_dead_lettered(bus, store):
    """Rolling upgrade: a newer agent publishes a type this build does not know, between two it does."""
    astore = AsyncStore(store)
    audit, billing = AuditService(bus, astore, linger_s=0.05), BillingService(bus, astore, load_price_catalog(),
                                                                              linger_s=0.05)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    future = Envelope(event_id=business_event_id("j-1", 1, 0, "future"), type="job.future_thing",
                      occurred_at=datetime.fromtimestamp(START + 60, UTC), producer="agent/cn-east-1-c1",
                      region="cn-east-1", cluster="cn-east-1-c1", tenant="nlp", project="train", job_id="j-1",
                      attempt=1, payload={"checkpoint": "s3://ckpt/7", "gpu_milli": 2000})
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), placement_of(_status("job.finished")))
    for e in (_status("job.started"), future, _status("job.finished", at=START + 3600)):
        await bus.publish(subject, e)

    async def written():
        n = store.query(f"SELECT count() FROM {store.database}.usage").scalar()
        # billing first: its usage.recorded is published before it acknowledges, and audit must have read it
        return n >= 1 and await billing.consumer.lag() == 0 and await audit.lag() == 0

    assert await until(written, timeout=15, interval=0.05)
    audit.stop(), billing.stop()
    await asyncio.gather(*tasks)
    db = store.database
    # billing skipped it, counted it, and went on to bill the attempt
    assert billing.skipped.as_dict() == {"job.future_thing": 1}
    assert store.query(f"SELECT outcome, cost FROM {db}.usage").rows == [("finished", Decimal("10.800000"))]
    # nobody dead-lettered it
    assert billing.consumer.dead_lettered == 0 and all(c.dead_lettered == 0 for c in audit.consumers)
    assert (await bus.js.stream_info(bus.stream_name("DLQ"))).state.messages == 0
    # the audit log kept it as it came
    rows = store.query(f"SELECT event_id, payload FROM {db}.events WHERE type = 'job.future_thing'").rows
    assert rows == [(future.event_id, '{"checkpoint":"s3://ckpt/7","gpu_milli":2000}')]


async def test_a_batch_written_twice_after_a_crash_is_not_doubled(bus, store):
    """The writer inserted, then died before acking: the redelivered batch changes nothing."""
    astore = AsyncStore(store)
    audit = AuditService(bus, astore)
    billing = BillingService(bus, astore, load_price_catalog())
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    events = [_status("job.finished", job=f"j-{i}", at=START + 60 * (i + 1)) for i in range(20)]
    deliveries = [Delivery(e, subject, {}, i + 1, 1) for i, e in enumerate(events)]
    placements = bus.subjects.placements("cn-east-1", "cn-east-1-c1")
    placed = [Delivery(placement_of(e), placements, {}, 100 + i, 1) for i, e in enumerate(events)]
    await billing.write(placed)
    await audit.write(placed)  # audit stores an agent's status only for an attempt placed there
    await audit.write(deliveries)
    await billing.write(deliveries)
    await audit.write(deliveries[:7] + deliveries)  # redelivered, partly twice in one batch
    await billing.write(deliveries)
    db = store.database
    assert store.query(f"SELECT count() FROM {db}.events WHERE type = 'job.finished'").scalar() == 20
    assert store.query(f"SELECT count(), uniqExact(usage_id) FROM {db}.usage").rows == [(20, 20)]
    total = store.query(f"SELECT sum(cost) FROM {db}.usage").scalar()
    expected = sum(Decimal("5.4") * 2 * Decimal(60 * (i + 1)) / 3600 for i in range(20))
    assert total == expected.quantize(Decimal("0.000001"))


async def test_a_batch_redelivered_to_a_restarted_writer_is_not_doubled(bus, store):
    """The writers remember the keys they wrote lately (no lookup for a batch written again a
    moment ago); a restarted writer remembers nothing, and the engine's answer keeps every event
    and usage line once."""
    from fedsched.store import Store

    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    events = [_status("job.finished", job=f"j-{i}", at=START + 60 * (i + 1)) for i in range(12)]
    deliveries = [Delivery(e, subject, {}, i + 1, 1) for i, e in enumerate(events)]
    placements = bus.subjects.placements("cn-east-1", "cn-east-1-c1")
    placed = [Delivery(placement_of(e), placements, {}, 100 + i, 1) for i, e in enumerate(events)]

    async def write_all(astore: AsyncStore) -> None:
        audit = AuditService(bus, astore)
        billing = BillingService(bus, astore, load_price_catalog())
        await billing.write(placed)
        await audit.write(placed)
        await audit.write(deliveries)
        await billing.write(deliveries)

    await write_all(AsyncStore(store))
    restarted = Store(store.client, store.database, embedded=store.embedded, cluster=store.cluster)
    await write_all(AsyncStore(restarted))
    db = store.database
    assert store.query(f"SELECT type, count(), uniqExact(event_id) FROM {db}.events WHERE type IN "
                       f"('job.finished', 'job.placed') GROUP BY type ORDER BY type").rows == [
        ("job.finished", 12, 12), ("job.placed", 12, 12)]
    assert store.query(f"SELECT count(), uniqExact(event_id) FROM {db}.decisions").rows == [(12, 12)]
    assert store.query(f"SELECT count(), uniqExact(usage_id) FROM {db}.usage").rows == [(12, 12)]


async def test_migrations_are_idempotent_and_recorded(store):
    assert store.migrate() == []
    assert store.schema_version() >= 1


def _placed(job="j-9", attempt=1, transfer_bytes=4_000_000_000):
    from fedsched.events import JobPlaced, WorkerBinding
    from fedsched.jobs import Dataset, JobSpec

    spec = JobSpec(tenant="nlp", project="train", home_region="cn-north-1", kind="training", gpus_per_worker=2,
                   cpu_milli=8000, datasets=(Dataset(name="nlp/corpus", home_region="cn-north-1", size_bytes=transfer_bytes),))
    payload = JobPlaced(spec=spec, card_model="nvidia-t4-16gb", bindings=(WorkerBinding(worker=0, node="n1"),),
                        cross_region=True, transfer_bytes=transfer_bytes)
    return make_event("job.placed", payload, producer="scheduler", occurred_at=START,
                      event_id=business_event_id(job, attempt, 0, "placed"), region="cn-east-1", zone="cn-east-1a",
                      cluster="cn-east-1-c1", tenant="nlp", project="train", job_id=job, attempt=attempt)


async def test_transfer_is_its_own_line_billed_once_and_spend_is_recomputed_not_added(bus, store):
    """Egress: one line per placement event id; the spend KV equals sum(usage) however often a batch comes."""
    astore = AsyncStore(store)
    billing = BillingService(bus, astore, load_price_catalog(), linger_s=0.05)
    task = asyncio.create_task(billing.run())
    placed = _placed()
    finished = _status("job.finished", job="j-9", at=START + 3600)
    placements = bus.subjects.placements("cn-east-1", "cn-east-1-c1")
    await bus.publish(placements, placed)
    await bus.js.publish(placements, placed.to_bytes(), headers={"Nats-Msg-Id": placed.event_id + "-again"})
    await bus.publish(bus.subjects.status("cn-east-1", "cn-east-1-c1"), finished)
    db = store.database

    async def billed():
        n = store.query(f"SELECT count() FROM {db}.usage").scalar()
        return n >= 2 and await billing.lag() == 0

    assert await until(billed, timeout=15, interval=0.05)
    billing.stop()
    await task
    rows = store.query(f"SELECT line, usage_id, transfer_bytes, cost FROM {db}.usage ORDER BY line").rows
    # 4 GB x 0.5 per GB = 2.0; compute: 2 T4 x 1 h x 5.4 = 10.8
    assert rows == [("compute", finished.event_id, 0, Decimal("10.800000")),
                    ("transfer", placed.event_id, 4_000_000_000, Decimal("2.000000"))]
    kv = await bus.key_value("spend")
    assert (await kv.get("nlp.2023-03")).value == b"12.800000"
    # the same batch again (a redelivery after a crash): no new row, the same spend
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    await billing.write([Delivery(finished, subject, {}, 1, 2), Delivery(placed, placements, {}, 2, 2)])
    assert store.query(f"SELECT count(), sum(cost) FROM {db}.usage").rows == [(2, Decimal("12.800000"))]
    assert (await kv.get("nlp.2023-03")).value == b"12.800000"


async def test_lag_counts_the_backlog_even_before_the_writers_first_run(bus, store):
    astore = AsyncStore(store)
    audit, billing = AuditService(bus, astore), BillingService(bus, astore, load_price_catalog())
    subject = bus.subjects.status("cn-east-1", "cn-east-1-c1")
    for e in (_status("job.started"), _status("job.finished", at=START + 60)):
        await bus.publish(subject, e)
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), _placed())
    assert await audit.lag() == 3 and await billing.lag() == 3


async def test_every_audited_event_has_a_trace_and_usage_recorded_is_in_its_causes(nats_server, chdb_path, tmp_path):
    """Issue 13 item 10, on a small run of the whole system (real NATS, real chDB, a trace agent):
    every row of ``events`` has a trace id; ``usage.recorded`` has the trace of the status event it
    prices; ``policy.applied`` has the trace of the CLI command's call that applied it;
    heartbeats and snapshots each start a trace of their own."""
    settings = Settings(data_dir=tmp_path, nats_url=nats_server.url, subject_prefix=unique("tr"),
                        clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.1, schedule_interval_s=0.005)
    nodes = [TraceNode("a-0", 64000, 262144, 2, "nvidia-t4-16gb", 16)]
    system = System(SystemOptions(settings=settings, clock=ReplayClock(ClockState(time.time(), 1.7e9, 600.0, 1)),
                                  split={"cn-north-1-c1": nodes}, agent_tick_s=0.005))
    await system.start()
    try:
        async with aio_channel(system.grpc_target, system.admin_token) as ch:
            jobs = pb_grpc.JobServiceStub(ch)

            async def submit(runtime_s: int) -> str:
                spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000,
                                  estimated_duration_seconds=runtime_s,
                                  annotations={"trace.runtime_s": str(runtime_s)})
                return (await jobs.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id

            async def until_state(job_id: str, states) -> None:
                async def reached():
                    return (await jobs.GetJob(pb.GetJobRequest(job_id=job_id))).state in states
                assert await until(reached, timeout=30, interval=0.05), job_id

            short, long = await submit(60), await submit(36000)
            await until_state(short, {pb.JOB_STATE_SUCCEEDED})
            await until_state(long, {pb.JOB_STATE_RUNNING})
            await jobs.CancelJob(pb.CancelJobRequest(job_id=long))
            await until_state(long, {pb.JOB_STATE_CANCELLED})
        shown = yaml.safe_load((await asyncio.to_thread(_cli_call, system, "GetPolicy", gpb.GetPolicyRequest()))[1].yaml)
        shown["approvals"] = {**(shown.get("approvals") or {}), "timeout_s": 4321}
        cli_trace, applied = await asyncio.to_thread(_cli_call, system, "ApplyPolicy",
                                                     gpb.ApplyPolicyRequest(yaml=yaml.safe_dump(shown)))
        assert applied.applied
        await asyncio.sleep(0.3)  # a few more heartbeats
        await system.drain_writers(timeout_s=30)
        rows = system.sync_store.query(f"SELECT event_id, type, trace_id, payload FROM "
                                       f"{settings.clickhouse_database}.events").rows
    finally:
        await system.stop()
    trace = {event_id: trace_id for event_id, _, trace_id, _ in rows}
    types = {t for _, t, _, _ in rows}
    assert {"job.submitted", "job.placed", "job.started", "job.finished", "job.stopped", "usage.recorded",
            "inventory.snapshot", "inventory.heartbeat", "policy.applied"} <= types
    assert [(t, e) for e, t, trace_id, _ in rows if not trace_id] == []  # every event has a trace
    ended = [(e, trace_id) for e, t, trace_id, _ in rows if t in ("job.finished", "job.stopped", "job.failed")]
    assert len(ended) == 2
    for event_id, cause_trace in ended:  # usage.recorded's id is derived from the priced event's
        assert trace[business_event_id(event_id, "usage")] == cause_trace
    policy = {json.loads(p)["source"]: trace_id for _, t, trace_id, p in rows if t == "policy.applied"}
    assert policy["apply"] == cli_trace and policy["bootstrap"] not in ("", cli_trace)
    beats = [trace_id for _, t, trace_id, _ in rows if t == "inventory.heartbeat"]
    assert len(beats) >= 3 and len(set(beats)) == len(beats)  # each its own root trace


def _cli_call(system, method: str, request):
    """A PolicyService call the way a CLI command makes it (its Api: one root trace per command)."""
    with Api(system.grpc_target, system.admin_token) as api:
        resp = api.call(getattr(gpb_grpc.PolicyServiceStub(api.channel), method), request)
        return trace_id_of(api.trace), resp


async def test_a_malformed_payload_of_any_known_type_is_dead_lettered_by_audit_not_stored_as_that_event(bus, store):
    """Issue 14 tryout: a ``usage.recorded`` with payload ``{}`` was stored as an ordinary usage
    row on its job while admission dead-lettered it, and a malformed ``job.placed`` was
    dead-lettered by audit: one rule now, every known type's payload against its model."""
    from fedsched.events import UsageRecorded

    astore = AsyncStore(store)
    audit = AuditService(bus, astore, linger_s=0.05)
    task = asyncio.create_task(audit.run())
    routing = dict(tenant="nlp", project="train", job_id="j-2", attempt=1, region="cn-east-1", cluster="cn-east-1-c1")
    good = make_event("usage.recorded", UsageRecorded(gpu_seconds=7200.0, cost="10.8"), producer="billing",
                      occurred_at=START + 3600, event_id=business_event_id("usage", "j-2", 1), **routing)
    empty_usage = good.model_copy(update=dict(event_id=business_event_id("forged", 1), payload={}))
    bad_usage = good.model_copy(update=dict(event_id=business_event_id("forged", 2),
                                            payload={"gpu_seconds": "many", "cost": "1"}))
    placed = placement_of(_status("job.finished", job="j-2"))
    bad_placed = placed.model_copy(update=dict(payload={"shard": 0}))
    await bus.publish(bus.subjects.usage("nlp"), empty_usage)
    await bus.publish(bus.subjects.usage("nlp"), good)
    await bus.publish(bus.subjects.usage("nlp"), bad_usage)
    await bus.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"), bad_placed)
    db = store.database

    def dead_letters():
        return store.query(f"SELECT JSONExtractString(payload, 'reason') AS reason FROM {db}.events "
                           f"WHERE type = 'bus.dead_letter' ORDER BY reason").rows

    assert await until(lambda: len(dead_letters()) == 3, timeout=20, interval=0.05), dead_letters()
    audit.stop()
    await task
    reasons = [r for (r,) in dead_letters()]
    assert reasons == ["job.placed payload invalid: spec: Field required",
                       "usage.recorded payload invalid: gpu_seconds: Field required",
                       "usage.recorded payload invalid: gpu_seconds: Input should be a valid number, unable to parse "
                       "string as a number"], reasons
    # counting the job's usage in the log sees the valid record only; no placement of j-2 is shown
    rows = store.query(f"SELECT type, event_id FROM {db}.events WHERE job_id = 'j-2' ORDER BY type").rows
    assert rows == [("usage.recorded", good.event_id)]
    assert store.query(f"SELECT count() FROM {db}.decisions WHERE job_id = 'j-2'").scalar() == 0
    # dead-lettered once each, on audit's own dead-letter subjects (the consumer's name)
    info = await bus.js.stream_info(bus.stream_name("DLQ"), subjects_filter=bus.subjects.all("deadletter"))
    assert info.state.subjects == {bus.subjects.deadletter("audit-events"): 3}
    assert audit.malformed == 3


async def test_a_row_the_store_cannot_hold_is_dead_lettered_alone_and_the_rest_of_its_batch_is_stored_once(bus, store):
    """Tryout: a ``job.placed`` with ``attempt`` 2^32 (the events table's UInt32 cannot hold it)
    failed audit's whole batch until every event of it, valid ones included, was dead-lettered.
    The envelope now refuses it; should such a row still reach the insert (built here without
    validation), audit bisects the batch: the others are stored once, only it is dead-lettered."""
    from fedsched.events import UsageRecorded

    audit = AuditService(bus, AsyncStore(store), linger_s=0.05)
    routing = dict(tenant="nlp", project="train", attempt=1, region="cn-east-1", cluster="cn-east-1-c1")
    good = [make_event("usage.recorded", UsageRecorded(gpu_seconds=60.0, cost="0.1"), producer="billing",
                       occurred_at=START, event_id=business_event_id("usage", i), job_id=f"j-{i}", **routing)
            for i in range(7)]
    bad_env = Envelope.model_construct(**{**good[3].model_dump(), "attempt": 2 ** 32,
                                          "event_id": business_event_id("too-big", 1)})
    subject = bus.subjects.usage("nlp")
    batch = [Delivery(e, subject, {}, i + 1, 1) for i, e in enumerate(good)]
    batch.insert(4, Delivery(bad_env, subject, {}, 99, 1))
    await audit.write(batch)
    await audit.write(batch)  # redelivered: nothing twice
    db = store.database
    rows = store.query(f"SELECT event_id, count() FROM {db}.events WHERE type = 'usage.recorded' "
                       f"GROUP BY event_id").rows
    assert sorted(rows) == sorted((e.event_id, 1) for e in good)
    assert audit.unstorable == 2
    sub = await bus.js.subscribe(bus.subjects.deadletter("audit"), deliver_policy=DeliverPolicy.ALL)
    msg = await sub.next_msg(timeout=5)
    dead = Envelope.from_bytes(msg.data).payload_as(DeadLetter)
    assert dead.reason.startswith("audit cannot store it: "), dead.reason
    assert json.loads(dead.data)["attempt"] == 2 ** 32
    await sub.unsubscribe()


async def test_tryout_values_past_the_bounds_are_dead_lettered_naming_the_field_and_the_valid_event_is_stored(bus,
                                                                                                              store):
    """The tryout's messages on a real bus: a placement with attempt 2^32, ``usage.recorded`` with
    cost "NaN" / "1e400" / "-Infinity" and gpu_seconds 1e308 / -1, a ``job.finished`` at
    9999-12-31. Each is dead-lettered by audit with the field named; the valid event beside them
    is stored once."""
    from fedsched.events import UsageRecorded

    audit = AuditService(bus, AsyncStore(store), linger_s=0.05)
    task = asyncio.create_task(audit.run())
    routing = dict(tenant="nlp", project="train", job_id="j-9", attempt=1, region="cn-east-1", cluster="cn-east-1-c1")
    good = make_event("usage.recorded", UsageRecorded(gpu_seconds=7200.0, cost="10.8"), producer="billing",
                      occurred_at=START, event_id=business_event_id("usage", "j-9", 1), **routing)
    wire = good.model_dump(mode="json")
    bad = [{**wire, "payload": {**wire["payload"], "cost": c}} for c in ("NaN", "1e400", "-Infinity")]
    bad += [{**wire, "payload": {**wire["payload"], "gpu_seconds": g}} for g in (1e308, -1)]
    placed = placement_of(_status("job.finished", job="j-9")).model_dump(mode="json")
    finished = _status("job.finished", job="j-9").model_dump(mode="json")
    for i, body in enumerate(bad):
        body["event_id"] = business_event_id("bad", i)
        await bus.js.publish(bus.subjects.usage("nlp"), json.dumps(body).encode(), headers={"Nats-Msg-Id": str(i)})
    await bus.js.publish(bus.subjects.placements("cn-east-1", "cn-east-1-c1"),
                         json.dumps({**placed, "attempt": 2 ** 32}).encode())
    await bus.js.publish(bus.subjects.status("cn-east-1", "cn-east-1-c1"),
                         json.dumps({**finished, "occurred_at": "9999-12-31T23:59:59Z"}).encode())
    await bus.publish(bus.subjects.usage("nlp"), good)
    db = store.database

    def dead_letters():
        return store.query(f"SELECT JSONExtractString(payload, 'reason') AS reason FROM {db}.events "
                           f"WHERE type = 'bus.dead_letter' ORDER BY reason").rows

    assert await until(lambda: len(dead_letters()) == 7, timeout=20, interval=0.05), dead_letters()
    audit.stop()
    await task
    reasons = [r for (r,) in dead_letters()]
    assert sum(r.startswith("usage.recorded payload invalid: cost: ") for r in reasons) == 3, reasons
    assert sum(r.startswith("usage.recorded payload invalid: gpu_seconds: ") for r in reasons) == 2, reasons
    assert sum(r.startswith("not a valid envelope: attempt: ") for r in reasons) == 1, reasons
    assert sum(r.startswith("not a valid envelope: occurred_at: ") and "supported time range" in r
               for r in reasons) == 1, reasons
    rows = store.query(f"SELECT type, event_id FROM {db}.events WHERE job_id = 'j-9'").rows
    assert rows == [("usage.recorded", good.event_id)]
