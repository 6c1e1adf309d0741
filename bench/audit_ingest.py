"""Audit ingest throughput: events/s sustained from JetStream into the ClickHouse ``events`` table.

    python bench/audit_ingest.py [--events 100000] [--batch 2000] [--clickhouse-url URL] [--nats-url URL]

1. Start an embedded nats-server and chDB in a temporary directory (or use the given URLs).
2. Publish ``--events`` events as the federation produces them: per job a ``job.placed``
   (with bindings and scheduler evaluations, so the ``decisions`` projection is written too),
   a ``job.started`` and a ``job.finished``/``job.failed``.
3. Start the real :class:`~services.audit.service.AuditService` and time it from its start
   until every event is in ClickHouse and its consumers have no lag (the durable consumer,
   batching, key lookup, insert with deduplication token, acknowledgement -- the whole path).
4. Print the rate, and check that the table holds exactly one row per event.

This is a benchmark, not a test: run it by hand and record the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsched.bus import Bus  # noqa: E402
from fedsched.events import JobPlaced, JobStatus, WorkerBinding, business_event_id, make_event  # noqa: E402
from fedsched.jobs import JobSpec  # noqa: E402
from fedsched.natsd import EmbeddedNats  # noqa: E402
from fedsched.store import AsyncStore, open_store  # noqa: E402
from services.audit.service import AuditService  # noqa: E402

START = datetime(2023, 3, 1, tzinfo=UTC).timestamp()
CLUSTERS = [("cn-north-1", "cn-north-1-c1"), ("cn-north-1", "cn-north-1-c2"), ("cn-east-1", "cn-east-1-c1"),
            ("cn-east-1", "cn-east-1-c2"), ("cn-south-1", "cn-south-1-c1"), ("cn-south-1", "cn-south-1-c2")]
TENANTS = [("nlp", "train"), ("search", "batch"), ("ads", "serve"), ("vision", "eval")]


def job_events(bus: Bus, i: int) -> list[tuple]:
    region, cluster = CLUSTERS[i % len(CLUSTERS)]
    tenant, project = TENANTS[i % len(TENANTS)]
    job = f"j-bench-{i}"
    at = START + i * 0.5
    spec = JobSpec(tenant=tenant, project=project, home_region=region, kind="training", gpus_per_worker=1)
    routing = dict(region=region, zone=f"{region}a", cluster=cluster, tenant=tenant, project=project, job_id=job,
                   attempt=1)
    evaluations = tuple({"cluster": c, "region": r, "passed": True, "reason": "", "detail": "",
                         "scores": {"home": 1.0, "price": 0.5}, "total": 1.5} for r, c in CLUSTERS)
    placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb", score=1.5,
                                                bindings=(WorkerBinding(worker=0, node=f"node-{i % 97}",
                                                                        gpu_indices=(i % 8,), gpu_milli=1000),),
                                                explanation="home region, cheapest", evaluations=evaluations),
                        producer="scheduler", occurred_at=at, event_id=business_event_id(job, 1, 0, "placed"),
                        actor="scheduler", policy_version="bench", **routing)
    status = dict(card_model="nvidia-t4-16gb", gpu_milli=1000, cpu_milli=4000, memory_mib=16384, kind="training",
                  started_at=datetime.fromtimestamp(at + 1, UTC))
    started = make_event("job.started", JobStatus(**status), producer=f"agent/{cluster}", occurred_at=at + 1,
                         event_id=business_event_id(job, 1, 0, "started"), **routing)
    ended = make_event("job.failed" if i % 5 == 0 else "job.finished", JobStatus(**status),
                       producer=f"agent/{cluster}", occurred_at=at + 600,
                       event_id=business_event_id(job, 1, 0, "ended"), **routing)
    return [(bus.subjects.placements(region, cluster), placed, None),
            (bus.subjects.status(region, cluster), started, None),
            (bus.subjects.status(region, cluster), ended, None)]


async def main(a) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fedsched-bench-"))
    nats = None
    if not a.nats_url:
        nats = EmbeddedNats(tmp / "nats")
        nats.start()
    url = a.nats_url or nats.url
    store = open_store(url=a.clickhouse_url, chdb_path=None if a.clickhouse_url else tmp / "clickhouse",
                       database=a.database)
    bus = await Bus.connect(url, a.prefix, name="bench")
    await bus.ensure_streams()
    jobs = a.events // 3
    t0 = time.perf_counter()
    for lo in range(0, jobs, 2000):
        items = [item for i in range(lo, min(jobs, lo + 2000)) for item in job_events(bus, i)]
        assert all(await bus.publish_many(items))
    total = jobs * 3
    print(f"published {total} events in {time.perf_counter() - t0:.1f} s", flush=True)
    audit = AuditService(bus, AsyncStore(store), batch=a.batch, linger_s=a.linger)
    t1 = time.perf_counter()
    task = asyncio.create_task(audit.run())
    last = 0
    while True:
        await asyncio.sleep(0.2)
        if audit.written != last and a.verbose:
            print(f"  {audit.written} written after {time.perf_counter() - t1:.1f} s", flush=True)
        last = audit.written
        if audit.written >= total and await audit.lag() == 0:
            break
    elapsed = time.perf_counter() - t1
    audit.stop()
    await task
    rows, ids = store.query(f"SELECT count(), uniqExact(event_id) FROM {store.database}.events").rows[0]
    decisions = store.query(f"SELECT count() FROM {store.database}.decisions").scalar()
    engine = "server " + a.clickhouse_url.split("@")[-1] if a.clickhouse_url else "chDB (embedded)"
    print(f"audit ingest: {total} events in {elapsed:.2f} s = {total / elapsed:,.0f} events/s sustained "
          f"(batch {a.batch}, {engine}); events rows {rows} (distinct ids {ids}), decisions rows {decisions}")
    assert rows == ids == total and decisions == jobs
    await bus.close()
    if nats is not None:
        nats.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=60000)
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--linger", type=float, default=0.25)
    p.add_argument("--nats-url", default="")
    p.add_argument("--clickhouse-url", default="")
    p.add_argument("--database", default="fedsched_bench")
    p.add_argument("--prefix", default="bench")
    p.add_argument("--verbose", "-v", action="store_true")
    asyncio.run(main(p.parse_args()))
