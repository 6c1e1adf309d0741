"""Audit and billing write every event exactly once -- through duplicates, an outage of the
store, and a kill -9 in the middle of a batch -- on every engine (see ``conftest.engine``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal

from fedsched.events import JobPlaced, JobStatus, WorkerBinding, business_event_id, make_event
from fedsched.jobs import Dataset, JobSpec
from fedsched.pricing import load_price_catalog
from fedsched.store import AsyncStore
from services.audit.service import AuditService
from services.billing.service import BillingService

START = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()
REGION, CLUSTER = "cn-east-1", "cn-east-1-c1"
# per job: 2 T4 GPUs for one hour in cn-east-1 (6.0 x 0.9 = 5.4 per GPU-hour) = 10.8;
# every third job also moves 3 GB into the region (0.5 per GB) = 1.5
COMPUTE, TRANSFER = Decimal("10.8"), Decimal("1.5")


def _job_events(i: int) -> list:
    job = f"j-{i}"
    moves = 3_000_000_000 if i % 3 == 0 else 0
    spec = JobSpec(tenant="nlp", project="train", home_region="cn-north-1", kind="training", gpus_per_worker=2,
                   datasets=(Dataset(name="nlp/corpus", home_region="cn-north-1", size_bytes=moves),) if moves else ())
    routing = dict(region=REGION, zone="cn-east-1a", cluster=CLUSTER, tenant="nlp", project="train", job_id=job,
                   attempt=1)
    at = START + i
    placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb", cross_region=True,
                                                bindings=(WorkerBinding(worker=0, node="n1", gpu_indices=(0, 1)),),
                                                transfer_bytes=moves),
                        producer="scheduler", occurred_at=at, event_id=business_event_id(job, 1, 0, "placed"),
                        **routing)
    status = dict(card_model="nvidia-t4-16gb", gpu_milli=2000, cpu_milli=8000, kind="training",
                  started_at=datetime.fromtimestamp(at, UTC), cross_region=True)
    started = make_event("job.started", JobStatus(**status), producer="agent/x", occurred_at=at,
                         event_id=business_event_id(job, 1, 0, "started"), **routing)
    ended = make_event("job.failed" if i % 4 == 0 else "job.finished", JobStatus(**status), producer="agent/x",
                       occurred_at=at + 3600, event_id=business_event_id(job, 1, 0, "ended"), **routing)
    return [placed, started, ended]


def _expected(jobs: int) -> dict:
    transfers = sum(1 for i in range(jobs) if i % 3 == 0)
    usage = jobs + transfers
    return {"events": 3 * jobs + usage, "usage": usage, "transfer_lines": transfers,
            "cost": (COMPUTE * jobs + TRANSFER * transfers).quantize(Decimal("0.000001"))}


async def _publish(bus, jobs: range, duplicates: int = 0) -> None:
    """Publish the jobs' events; the first ``duplicates`` events go out twice under another message
    id, which JetStream cannot deduplicate (the writers must)."""
    items = []
    for i in jobs:
        placed, started, ended = _job_events(i)
        items += [(bus.subjects.placements(REGION, CLUSTER), placed, None),
                  (bus.subjects.status(REGION, CLUSTER), started, None),
                  (bus.subjects.status(REGION, CLUSTER), ended, None)]
    assert all(await bus.publish_many(items))
    for subject, event, _ in items[:duplicates]:
        await bus.js.publish(subject, event.to_bytes(), headers={"Nats-Msg-Id": event.event_id + "-again"})


async def _until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not reached within {timeout}s")


def _counts(store) -> dict:
    db = store.database
    ev = store.query(f"SELECT count(), uniqExact(event_id) FROM {db}.events").rows[0]
    us = store.query(f"SELECT count(), uniqExact(usage_id), sum(cost), countIf(line = 'transfer') "
                     f"FROM {db}.usage").rows[0]
    return {"events": ev[0], "event_ids": ev[1], "usage": us[0], "usage_ids": us[1], "cost": us[2],
            "transfer_lines": us[3]}


async def _spend(bus) -> bytes:
    kv = await bus.key_value("spend")
    return (await kv.get("nlp.2023-03")).value


async def test_an_outage_of_the_store_loses_and_doubles_nothing(engine, bus):
    store = engine.open()
    astore = AsyncStore(store)
    audit = AuditService(bus, astore, batch=50, linger_s=0.02)
    billing = BillingService(bus, astore, load_price_catalog(), batch=50, linger_s=0.02)
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    try:
        await _publish(bus, range(30))

        async def lag() -> int:
            return await audit.lag() + await billing.lag()

        async def caught_up(expect: dict):
            return await lag() == 0 and _counts(store)["events"] >= expect["events"]

        await _until(lambda: caught_up(_expected(30)))
        engine.down()
        await _publish(bus, range(30, 90), duplicates=15)
        lags = []
        for _ in range(10):  # 1 s down: the backlog waits in JetStream and shows as lag
            await asyncio.sleep(0.1)
            lags.append(await lag())
        assert min(lags) > 0 and max(lags) >= 180
        assert audit.written == _expected(30)["events"]
        engine.up()
        await _until(lambda: caught_up(_expected(90)))
        await asyncio.sleep(0.3)  # anything still in flight would show up as an extra row now
        expect = _expected(90)
        assert _counts(store) == {"events": expect["events"], "event_ids": expect["events"], "usage": expect["usage"],
                                  "usage_ids": expect["usage"], "cost": expect["cost"],
                                  "transfer_lines": expect["transfer_lines"]}
        assert await _spend(bus) == str(expect["cost"]).encode()
    finally:
        audit.stop(), billing.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)


async def test_audit_and_billing_killed_mid_batch_then_restarted(engine, bus, tmp_path):
    jobs = 100
    await _publish(bus, range(jobs), duplicates=20)
    database = f"k{os.urandom(5).hex()}"
    where = ["--chdb", str(tmp_path / "clickhouse")] if engine.kind == "chdb" else ["--url", engine.url]
    args = [sys.executable, "-m", "tests.contract.writer_proc", "--nats", bus.nc.connected_url.geturl(),
            "--prefix", bus.prefix, "--database", database, *where]
    crash = await asyncio.create_subprocess_exec(*args, "--crash-mid-batch", stdout=asyncio.subprocess.PIPE)
    seen: dict[str, int] = {}
    try:
        async with asyncio.timeout(60):
            while len(seen) < 2:
                line = (await crash.stdout.readline()).decode()
                assert line, "the writer exited before reaching the middle of a batch"
                if line.startswith("MID-BATCH"):
                    _, service, n = line.split()
                    seen[service] = int(n)
    finally:
        crash.send_signal(signal.SIGKILL)
        await crash.wait()
    assert seen["audit"] > 0 and seen["billing"] > 0  # rows of the unfinished batches were committed
    restart = await asyncio.create_subprocess_exec(*args, "--expect", str(_expected(jobs)["events"]),
                                                   stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(restart.communicate(), 90)
    assert restart.returncode == 0
    got = json.loads(out.decode().strip().splitlines()[-1])
    expect = _expected(jobs)
    assert got == {"events": expect["events"], "event_ids": expect["events"], "usage": expect["usage"],
                   "usage_ids": expect["usage"], "cost": str(expect["cost"]), "transfer_lines": expect["transfer_lines"]}
    assert await _spend(bus) == str(expect["cost"]).encode()
    if engine.kind == "server":
        assert _counts(engine.open(database))["events"] == expect["events"]
