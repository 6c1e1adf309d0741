"""The store process's CPU per job: audit + billing into chDB, as ``fedsched up --processes`` runs them.

    python bench/store_cpu.py [--jobs 5000] [--rate 0] [--ended 0.0]

1. Start an embedded nats-server and chDB in a temporary directory.
2. A publisher (a child process, so its CPU is not counted) publishes per job what the
   federation publishes for a placed job (issue 15's e2e mix: ``job.submitted`` from admission,
   a ``job.placed`` with its scheduler evaluations, a ``job.started`` from the agent; with
   ``--ended F`` a fraction F of the jobs also ends, so billing prices a usage line) -- all before
   the services start (``--rate 0``: a backlog, large batches) or at ``--rate`` jobs/s while they
   run (batches as the live system makes them).
3. This process runs the real :class:`~services.audit.service.AuditService` and
   :class:`~services.billing.service.BillingService` (the store process's services) until every
   event is written and their consumers have no lag, and prints this process's CPU seconds
   (every thread: the event loop and chDB's) per job, the wall time, and the rows written (it
   checks one ``events`` row per event -- and per ``usage.recorded`` billing published -- one
   ``decisions`` row per job and one ``usage`` row per ended job).
4. It also splits the CPU: garbage collection (CPU seconds of the thread that collected, and
   the wall seconds, which on a busy machine include time the collector waited for a core), the
   store calls on the writer thread, the main thread, and the embedded engine's own threads
   (chDB's query and merge pools: the rest of the process's CPU).

The collector: ``fedsched up --processes`` lets the store process tune it
(:func:`fedsched.gctune.enable_for_process`: the services freeze the start-up heap and raise the
young threshold); this benchmark does not, unless ``--service-gc`` is given, so by default the
collector runs with CPython's settings and ``--no-gc-tuning`` / ``--gc-young`` change nothing
without ``--service-gc``.

A benchmark, not a test: run it by hand and record the figure with ``uptime`` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsched.bus import Bus  # noqa: E402
from fedsched.events import (JobPlaced, JobStatus, JobSubmitted, WorkerBinding, business_event_id,  # noqa: E402
                             make_event)
from fedsched.jobs import JobSpec  # noqa: E402
from fedsched.natsd import EmbeddedNats  # noqa: E402
from fedsched.pricing import load_price_catalog  # noqa: E402
from fedsched.store import AsyncStore, open_store  # noqa: E402
from services.audit.service import AuditService  # noqa: E402
from services.billing.service import BillingService  # noqa: E402

START = datetime(2026, 11, 1, tzinfo=UTC).timestamp()
CLUSTERS = [("cn-north-1", "cn-north-1-c1"), ("cn-north-1", "cn-north-1-c2"), ("cn-east-1", "cn-east-1-c1"),
            ("cn-east-1", "cn-east-1-c2"), ("cn-south-1", "cn-south-1-c1"), ("cn-south-1", "cn-south-1-c2")]
TENANTS = [("nlp", "train"), ("search", "batch"), ("ads", "serve"), ("vision", "eval")]


def job_events(bus: Bus, i: int, ended: bool) -> list[tuple]:
    """The events of job ``i`` as (subject, envelope, headers)."""
    region, cluster = CLUSTERS[i % len(CLUSTERS)]
    tenant, project = TENANTS[i % len(TENANTS)]
    job = f"j-bench-{i}"
    at = START + i * 0.01
    spec = JobSpec(tenant=tenant, project=project, home_region=region, kind="training", gpus_per_worker=1)
    submitted = make_event("job.submitted", JobSubmitted(spec=spec, request_id=f"r-{i}", submitted_by="bench"),
                           producer="admission", occurred_at=at, event_id=business_event_id(job, "submitted"),
                           tenant=tenant, project=project, job_id=job, actor="bench", policy_version="bench")
    routing = dict(region=region, zone=f"{region}a", cluster=cluster, tenant=tenant, project=project, job_id=job,
                   attempt=1)
    evaluations = tuple({"cluster": c, "region": r, "passed": True, "reason": "", "detail": "",
                         "scores": {"home": 1.0, "price": 0.5, "wait": 0.25}, "total": 1.75} for r, c in CLUSTERS)
    placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb", score=1.5,
                                                bindings=(WorkerBinding(worker=0, node=f"node-{i % 97}",
                                                                        gpu_indices=(i % 8,), gpu_milli=1000),),
                                                explanation="home region, cheapest", evaluations=evaluations),
                        producer="scheduler", occurred_at=at + 0.05, event_id=business_event_id(job, 1, 0, "placed"),
                        actor="scheduler", policy_version="bench", **routing)
    status = dict(card_model="nvidia-t4-16gb", gpu_milli=1000, cpu_milli=4000, memory_mib=16384, kind="training",
                  started_at=datetime.fromtimestamp(at + 1, UTC))
    started = make_event("job.started", JobStatus(**status), producer=f"agent/{cluster}", occurred_at=at + 1,
                         event_id=business_event_id(job, 1, 0, "started"), **routing)
    out = [(bus.subjects.job("submitted", tenant, project), submitted, None),
           (bus.subjects.placements(region, cluster), placed, None),
           (bus.subjects.status(region, cluster), started, None)]
    if ended:
        finished = make_event("job.finished", JobStatus(**status),
                              producer=f"agent/{cluster}", occurred_at=at + 601,
                              event_id=business_event_id(job, 1, 0, "finished"), **routing)
        out.append((bus.subjects.status(region, cluster), finished, None))
    return out


async def publish(a) -> None:
    """The publisher (child process): every job's events, at ``a.rate`` jobs/s (0: as fast as possible)."""
    bus = await Bus.connect(a.nats_url, a.prefix, name="bench")
    every = max(1, round(1 / a.ended)) if a.ended > 0 else 0
    chunk = 100 if a.rate <= 0 else max(1, int(a.rate / 50))  # 20 ms of jobs per publish_many at a rate
    t0 = time.monotonic()
    for lo in range(0, a.jobs, chunk):
        items = [item for i in range(lo, min(a.jobs, lo + chunk)) for item in job_events(bus, i, bool(every)
                                                                                        and i % every == 0)]
        assert all(await bus.publish_many(items))
        if a.rate > 0:
            due = t0 + (lo + chunk) / a.rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
    await bus.close()


def cpu_s() -> float:
    """This process's CPU seconds (user + system, every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main(a) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fedsched-storecpu-"))
    nats = EmbeddedNats(tmp / "nats")
    nats.start()
    store = open_store(chdb_path=tmp / "clickhouse", database="fedsched_bench")
    bus = await Bus.connect(nats.url, a.prefix, name="store")
    await bus.ensure_streams()
    every = max(1, round(1 / a.ended)) if a.ended > 0 else 0
    n_ended = sum(1 for i in range(a.jobs) if every and i % every == 0)
    total = a.jobs * 3 + n_ended
    cmd = [sys.executable, __file__, "--publish-only", "--nats-url", nats.url, "--prefix", a.prefix,
           "--jobs", str(a.jobs), "--rate", str(a.rate), "--ended", str(a.ended)]
    publisher = subprocess.Popen(cmd)
    if a.rate <= 0:
        publisher.wait()
    astore = AsyncStore(store)
    calls: dict[str, list[int]] = {}  # table -> [inserts, rows offered]
    insert_new = store.insert_new

    def counted(table, rows, columns, key):
        c = calls.setdefault(table, [0, 0])
        c[0] += 1
        c[1] += len(rows)
        return insert_new(table, rows, columns, key)

    store.insert_new = counted
    engine = [0.0]  # CPU seconds of the calls into the store (on its worker thread)
    call = store._call

    def timed(fn):
        c = time.thread_time()
        try:
            return call(fn)
        finally:
            engine[0] += time.thread_time() - c

    store._call = timed
    kw = {} if a.linger is None else {"linger_s": a.linger}
    if a.no_gc_tuning:
        kw["gc_young_threshold"] = 0
    elif a.gc_young:
        kw["gc_young_threshold"] = a.gc_young
    audit = AuditService(bus, astore, **kw)
    billing = BillingService(bus, astore, load_price_catalog(), **kw)
    gc_time = [0.0, 0, 0.0]  # wall seconds in collections, full collections, wall seconds in full ones
    gc_cpu = [0.0, 0.0]  # CPU seconds in collections (the collecting thread's), of which in full ones
    started = [0.0, 0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            started[1] = time.thread_time()
        else:
            d = time.perf_counter() - started[0]
            c = time.thread_time() - started[1]
            gc_time[0] += d
            gc_cpu[0] += c
            if info["generation"] == 2:
                gc_time[1] += 1
                gc_time[2] += d
                gc_cpu[1] += c

    gc.callbacks.append(on_gc)
    if a.service_gc:
        from fedsched.gctune import enable_for_process

        enable_for_process()  # as the store process of `fedsched up --processes` does
    c0, t0, m0 = cpu_s(), time.monotonic(), time.thread_time()
    tasks = [asyncio.create_task(audit.run()), asyncio.create_task(billing.run())]
    deadline = t0 + a.timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        if audit.written >= total + n_ended and publisher.poll() is not None and await audit.lag() == 0 \
                and await billing.lag() == 0:
            break
    c1, t1 = cpu_s(), time.monotonic()
    main_cpu = time.thread_time() - m0
    audit.stop()
    billing.stop()
    await asyncio.gather(*tasks)
    publisher.wait()
    db = store.database
    rows, ids = store.query(f"SELECT count(), uniqExact(event_id) FROM {db}.events").rows[0]
    decisions = store.query(f"SELECT count() FROM {db}.decisions").scalar()
    usage = store.query(f"SELECT count() FROM {db}.usage").scalar()
    print(f"store: {a.jobs} jobs ({total} events, {n_ended} ended) {'backlog' if a.rate <= 0 else f'at {a.rate:g}/s'}: "
          f"cpu {c1 - c0:.2f} s = {1000 * (c1 - c0) / a.jobs:.3f} ms/job, wall {t1 - t0:.1f} s; rows events {rows} "
          f"(distinct {ids}), decisions {decisions}, usage {usage}; load {os.getloadavg()[0]:.1f}")
    gc.callbacks.remove(on_gc)
    cpu = c1 - c0
    print(f"  garbage collection: {gc_time[0]:.2f} s, of which {gc_time[1]} full collections {gc_time[2]:.2f} s (wall); "
          f"CPU {gc_cpu[0]:.2f} s, of which full {gc_cpu[1]:.2f} s; without it {cpu - gc_cpu[0]:.2f} s = "
          f"{1000 * (cpu - gc_cpu[0]) / a.jobs:.3f} ms/job")
    print(f"  store calls: {engine[0]:.2f} s CPU on the writer thread; main thread {main_cpu:.2f} s; "
          f"the engine's own threads (the rest) {max(0.0, cpu - main_cpu - engine[0]):.2f} s")
    print("  inserts per table (calls, rows offered): " + ", ".join(f"{t} {c[0]} ({c[1]})" for t, c in calls.items()))
    await bus.close()
    nats.stop()
    assert rows == ids == total + n_ended and decisions == a.jobs and usage == n_ended, "rows missing or doubled"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--rate", type=float, default=0.0, help="jobs/s offered while the services run (0: backlog)")
    p.add_argument("--ended", type=float, default=0.0, help="fraction of jobs that also end (billed)")
    p.add_argument("--linger", type=float, default=None, help="the writers' linger_s (default: theirs)")
    p.add_argument("--service-gc", action="store_true",
                   help="let the services tune the collector, as in `fedsched up --processes` (default: CPython's)")
    p.add_argument("--no-gc-tuning", action="store_true", help="the services leave the collector alone")
    p.add_argument("--gc-young", type=int, default=0, help="the services' young threshold (default: theirs)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--prefix", default="bench")
    p.add_argument("--nats-url", default="")
    p.add_argument("--publish-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    asyncio.run(publish(args) if args.publish_only else main(args))
