"""Restart time and memory of the scheduler and admission against queued jobs, with and
without snapshots (issue 15 item 3, issue 14 item 8).

For each size N (cumulative: the stream grows from one size to the next) the bench

1. publishes job submissions until N jobs are queued (straight onto the events stream, not
   through gRPC, with the bytes and headers admission would publish: ``job.submitted`` per job,
   see :func:`seed`; the jobs ask for a card model no cluster has, so they stay queued and the
   scheduler publishes a ``job.pending`` for each, as it does live);
2. runs a *seeder* scheduler and admission that fold the whole stream (``seeder_*``: a full
   read's figures, in the bench's own process), let the scheduler make its first cycle (the
   pending decisions), then write a checkpoint each (:func:`checkpoint_figures`: the fork alone,
   the loop's longest stall while the checkpoint is written against an idle baseline, seconds
   until written, bytes, and the seconds the same walk takes on the loop -- what a checkpoint
   held the loop for before it was forked);
3. publishes one probe job that fits (1 T4 GPU) and measures, each in a fresh process (so RSS is
   the service's own), a restart of
   * the scheduler: seconds to catch up with the stream (it would then accept a submit) and to
     place the probe, RSS after the placement;
   * admission: seconds until it serves gRPC (accepts a submit), RSS then;
   once from the checkpoint plus the stream after it (``snapshot``), then once reading the whole
   stream (``full``; last, because its first cycle publishes every pending reason again).

Figures depend on the machine (2 cores here, shared). Run::

    python bench/restart.py --sizes 10000 100000 [--modes full snapshot] [--keep] [--profile DIR]

1,000,000 jobs (``--sizes 1000000 --modes snapshot``) needs ~10 GB for the seeders (a full
read holds ~9 KiB per queued job in the scheduler) plus the forked child's copy-on-write pages
while it walks the book; ``--profile DIR`` writes each child's cProfile stats.

A child is this script with ``--child scheduler|admission``; it prints one JSON line.

Measured 2026-11-30 on the project's 2-core machine, shared with other work (load average
6-12, so every figure is pessimistic and noisy); seconds after the start of a fresh process:

=========  ======================================  ======================================
queued     scheduler: accept / place / RSS          admission: serves / RSS
=========  ======================================  ======================================
10k full   1.6 / 1.6 / 117 MiB                     2.8 / 132 MiB
10k ckpt   0.2 / 0.4 / 93 MiB                      0.5 / 108 MiB
100k full  21.4 / 33.1 / 947 MiB                   27.3 / 664 MiB
100k ckpt  1.7 / 6.9 / 311 MiB                     2.5 / 389 MiB
1M full    163 / 451 (seeder, 5.8 GiB)             244 (seeder, in-process)
1M ckpt    21.5 / 44.8 / 2.4 GiB                   21.7 / 3.1 GiB
=========  ======================================  ======================================

At 1M the checkpoints are 38 MB (scheduler) and 11 MB (admission); restoring them takes 15.4
and 18.2 s, the scheduler's first cycle over 1M queued jobs the remaining 23 s to the probe's
placement. A checkpoint holds the loop for the fork: 268 / 244 ms at 5.5 / 6.0 GiB RSS
(longest loop stall while writing: 169 / 264 ms; idle baseline 27 / 3 ms), against 5.8 / 21 s
for the walk on the loop at 100k (linear: about a minute at 1M).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats.errors  # noqa: E402

from fedsched import snapshots  # noqa: E402
from fedsched.bus import Bus  # noqa: E402
from fedsched.clock import SystemClock  # noqa: E402
from fedsched.events import InventorySnapshot, JobSubmitted, NodeInventory, business_event_id, make_event  # noqa: E402
from fedsched.jobs import JobSpec  # noqa: E402
from fedsched.natsd import EmbeddedNats  # noqa: E402

REGION, CLUSTER = "cn-north-1", "cn-north-1-c1"
T4 = "nvidia-t4-16gb"
ABSENT = "nvidia-a100-80gb"  # asked for by the queued jobs; no cluster has it


def rss_mib() -> float:
    """Resident set size of this process (MiB), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def queued_spec() -> JobSpec:
    return JobSpec(tenant="search", project="train", home_region=REGION, gpus_per_worker=1, cpu_milli=1000,
                   card_models=(ABSENT,), estimated_duration_s=600)


def probe_spec() -> JobSpec:
    return JobSpec(tenant="search", project="train", home_region=REGION, gpus_per_worker=1, cpu_milli=1000,
                   card_models=(T4,), estimated_duration_s=600)


def submitted(job_id: str, spec: JobSpec):
    return make_event("job.submitted", JobSubmitted(spec=spec, submitted_by="bench"), producer="admission",
                      occurred_at=time.time(), event_id=business_event_id(job_id, "submitted"), tenant=spec.tenant,
                      project=spec.project, job_id=job_id, actor="bench")


async def last_seq(bus: Bus) -> int:
    """The events stream's last sequence (retried: a seeder's long first cycle holds this
    process's loop for longer than a request's timeout)."""
    for _ in range(60):
        try:
            return (await bus.js.stream_info(bus.stream_name("EVENTS"))).state.last_seq
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
    raise RuntimeError("the events stream does not answer")


async def connect(url: str, prefix: str) -> Bus:
    bus = await Bus.connect(url, prefix, name="bench-restart")
    await bus.ensure_streams()
    return bus


async def seed(bus: Bus, start: int, stop: int, batch: int = 20_000) -> float:
    """Publish submissions of queued jobs ``start..stop-1``; seconds taken.

    Straight into the events stream, not through gRPC (the bench measures restarts, not
    admission's throughput: a million gRPC submits take the better part of an hour here), and
    exactly as admission publishes them: the same envelope bytes (one
    :func:`~fedsched.events.make_event` serialised once, its job id and business event id
    substituted per job: the same JSON ``Envelope.to_bytes`` gives, checked below for the
    first job), ``Nats-Msg-Id`` = the event id, a W3C ``traceparent`` each, on
    ``<prefix>.jobs.submitted.<tenant>.<project>``; pipelined in batches of ``batch`` with
    every ack awaited.
    """
    t0 = time.perf_counter()
    spec = queued_spec()
    subject = bus.subjects.job("submitted", spec.tenant, spec.project)
    tmpl = submitted("J" * 8, spec)
    head, tail = tmpl.to_bytes().replace(tmpl.event_id.encode(), b"\0").split(b"J" * 8)
    ev_a, ev_b = head.split(b"\0")

    def body(job_id: str, event_id: str) -> bytes:
        return b"".join((ev_a, event_id.encode(), ev_b, job_id.encode(), tail))

    first = f"q{start:07d}"  # the bytes are the envelope admission would publish (but for its time)
    ours, theirs = (json.loads(b) for b in (body(first, business_event_id(first, "submitted")),
                                            submitted(first, spec).to_bytes()))
    assert {**ours, "occurred_at": ""} == {**theirs, "occurred_at": ""}, (ours, theirs)
    stream = bus.stream_name("EVENTS")
    have = (await bus.js.stream_info(stream)).state.messages
    for lo in range(start, stop, batch):
        hi = min(stop, lo + batch)
        for i in range(lo, hi):
            job_id = f"q{i:07d}"
            event_id = business_event_id(job_id, "submitted")
            headers = {"Nats-Msg-Id": event_id, "traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}
            await bus.nc.publish(subject, body(job_id, event_id), headers=headers)
        await bus.nc.flush(timeout=120)
        have += hi - lo  # core publishes (no per-message ack round-trip): the stream's count is checked
        deadline = time.monotonic() + 120
        while (n := (await bus.js.stream_info(stream)).state.messages) < have:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stream holds {n} messages, {have} were published")
            await asyncio.sleep(0.05)
    return time.perf_counter() - t0


def scheduler(bus: Bus, snapshots_on: bool):
    from fedsched.pricing import load_price_catalog
    from services.scheduler.core import build_policy
    from services.scheduler.service import SchedulerService

    return SchedulerService(bus, SystemClock(), build_policy("federated"), load_price_catalog(), stale_after_s=3600,
                            reclaim_after_s=3600, snapshot_every_s=1e9 if snapshots_on else 0.0,
                            snapshot_every_events=10**12)


def admission(bus: Bus, snapshots_on: bool):
    from services.admission.service import AdmissionService

    return AdmissionService(bus, SystemClock(), address="127.0.0.1:0", snapshot_every_s=1e9 if snapshots_on else 0.0,
                            snapshot_every_events=10**12, retain_ended=10_000)


class StallMeter:
    """The longest time this process's event loop went without running a 1 ms ticker (ms):
    how long something held the loop."""

    def __init__(self) -> None:
        self.max_ms = 0.0
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.max_ms = max(self.max_ms, (time.perf_counter() - t) * 1000 - 1.0)

    async def __aenter__(self) -> "StallMeter":
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def checkpoint_figures(svc, name: str, out: dict, walk: bool = True) -> None:
    """Write ``svc``'s checkpoint and note: seconds until written, the loop's longest stall
    meanwhile (the fork; the child walks and encodes), the bytes, and -- for comparison -- the
    seconds the same walk and encoding take when done on the loop (how long a checkpoint held
    the loop before the fork)."""
    async with StallMeter() as idle:  # the baseline: the machine's own scheduling noise
        await asyncio.sleep(1.0)
    out[f"{name}_idle_loop_stall_ms"] = round(idle.max_ms, 1)
    t0 = time.perf_counter()
    forked = snapshots.ForkedCapture(lambda: b"")  # the fork alone, at this process's size
    out[f"{name}_fork_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    await forked.result()
    async with StallMeter() as meter:
        t0 = time.perf_counter()
        assert await svc.maybe_snapshot(force=True)
        out[f"{name}_snapshot_s"] = round(time.perf_counter() - t0, 2)
    out[f"{name}_snapshot_loop_stall_ms"] = round(meter.max_ms, 1)
    if walk:
        t0 = time.perf_counter()
        out[f"{name}_snapshot_bytes"] = len(svc.snapshot_bytes())
        out[f"{name}_walk_on_loop_s"] = round(time.perf_counter() - t0, 2)
    out[f"{name}_rss_mib"] = round(rss_mib(), 1)


async def write_checkpoints(bus: Bus, n: int) -> dict:
    """Seeder: fold everything, the scheduler's first cycle, then a checkpoint of each service."""
    out: dict = {}
    sched = scheduler(bus, True)
    sched.snapshot_every_s = 1e9
    cycled = asyncio.Event()
    sched.on_cycle.append(cycled.set)
    t0 = time.perf_counter()  # the seeders read the whole stream: a full read's figures too
    task = asyncio.create_task(sched.run())
    while not hasattr(sched, "_events"):
        await asyncio.sleep(0.01)
    await asyncio.wait_for(sched._events.caught_up.wait(), 7200)
    out["seeder_scheduler_read_s"] = round(time.perf_counter() - t0, 1)
    sched.interval_s = 3600  # one cycle only: each walks every queued job (a minute at 1M), and the
    await asyncio.wait_for(cycled.wait(), 7200)  # follower would read its decisions back between
    out["seeder_scheduler_first_cycle_done_s"] = round(time.perf_counter() - t0, 1)
    out["seeder_scheduler_rss_mib"] = round(rss_mib(), 1)
    last = await last_seq(bus)
    while sched.busy or sched.applied_seq < last:  # its first cycle's pending decisions read back
        await asyncio.sleep(0.05)
        last = await last_seq(bus)
    sched.stop()  # (its periodic cycles would hold the loop too: measure the checkpoint alone)
    task.cancel()  # (it sleeps interval_s after a cycle before it looks at stop())
    await asyncio.gather(task, return_exceptions=True)
    await checkpoint_figures(sched, "scheduler", out, walk=n <= 100_000)
    del sched, task  # (its memory is reused by the admission seeder: 1M jobs take GBs each)
    gc.collect()
    adm = admission(bus, True)
    t0 = time.perf_counter()
    task = asyncio.create_task(adm.run())
    await asyncio.wait_for(adm.ready.wait(), 7200)
    out["seeder_admission_ready_s"] = round(time.perf_counter() - t0, 1)
    last = await last_seq(bus)
    while adm.view.applied_seq < last - 5:  # (the follower filters subjects: close to the last is caught up)
        await asyncio.sleep(0.1)
    await checkpoint_figures(adm, "admission", out, walk=n <= 100_000)
    adm.stop()
    await task
    return out


async def child(kind: str, url: str, prefix: str, snapshots_on: bool, probe: str) -> dict:
    base = rss_mib()
    bus = await Bus.connect(url, prefix, name=f"bench-{kind}")
    t0 = time.perf_counter()
    if kind == "scheduler":
        svc = scheduler(bus, snapshots_on)
        task = asyncio.create_task(svc.run())
        while not hasattr(svc, "_events"):
            await asyncio.sleep(0.005)
        loaded_s = time.perf_counter() - t0  # checkpoint read and restored (or none)
        await svc._events.caught_up.wait()
        accept_s = time.perf_counter() - t0
        while not (probe in svc.jobs and svc.jobs[probe].shards[0].placed is not None):
            await asyncio.sleep(0.01)
        place_s = time.perf_counter() - t0
        rss = rss_mib()
        jobs = len(svc.jobs)
        svc.stop()
        await task
        result = {"loaded_s": round(loaded_s, 2), "accept_s": round(accept_s, 2), "place_s": round(place_s, 2)}
    else:
        svc = admission(bus, snapshots_on)
        task = asyncio.create_task(svc.run())
        while not svc._events.caught_up.is_set():
            await asyncio.sleep(0.005)
        caught_s = time.perf_counter() - t0  # checkpoint restored and the stream after it read
        await svc.ready.wait()
        accept_s = time.perf_counter() - t0
        rss = rss_mib()
        jobs = len(svc.view.jobs)
        svc.stop()
        await task
        result = {"caught_up_s": round(caught_s, 2), "accept_s": round(accept_s, 2)}
    await bus.close()
    return {**result, "jobs": jobs, "rss_mib": round(rss, 1), "rss_base_mib": round(base, 1),
            "kib_per_job": round((rss - base) * 1024 / max(1, jobs), 2)}


def run_child(kind: str, url: str, prefix: str, mode: str, probe: str, profile: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--url", url, "--prefix", prefix, "--mode", mode, "--probe", probe]
    if profile:
        cmd += ["--profile", os.path.join(profile, f"{kind}-{mode}-{probe}.prof")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=7200)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{out.stderr[-3000:]}")
    notes = [line.split(": ", 1)[-1] for line in out.stderr.splitlines() if "snapshot" in line]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), **({"log": notes} if notes else {})}


async def main(args) -> None:
    from tests.builders import policy_doc, store_policy

    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    server = EmbeddedNats(tmp / "nats")
    server.start()
    prefix = "br"
    try:
        bus = await connect(server.url, prefix)
        await store_policy(bus, policy_doc())
        nodes = tuple(NodeInventory(name=f"n{i}", card_model=T4, gpus=8, gpu_memory_gib=16,
                                    gpu_free_milli=(1000,) * 8, cpu_milli=64000, cpu_free_milli=64000,
                                    memory_mib=262144, memory_free_mib=262144) for i in range(4))
        await bus.publish(bus.subjects.inventory(REGION, CLUSTER),
                          make_event("inventory.snapshot", InventorySnapshot(nodes=nodes), producer=f"agent/{CLUSTER}",
                                     occurred_at=time.time(), region=REGION, zone=REGION + "a", cluster=CLUSTER))
        have = 0
        for n in args.sizes:
            seed_s = await seed(bus, have, n)
            have = n
            ck = await write_checkpoints(bus, n)
            probe = f"probe{n}"
            spec = probe_spec()
            await bus.publish(bus.subjects.job("submitted", spec.tenant, spec.project), submitted(probe, spec))
            last = await last_seq(bus)
            print(json.dumps({"queued": n, "stream_events": last, "seed_s": round(seed_s, 1), **ck}), flush=True)
            for mode in sorted(args.modes, reverse=True):  # snapshot first: a full read's first cycle
                for kind in ("scheduler", "admission"):  # publishes every pending reason again (a tail)
                    r = run_child(kind, server.url, prefix, mode, probe, args.profile)
                    print(json.dumps({"queued": n, "service": kind, "mode": mode, **r}), flush=True)
        await bus.close()
    finally:
        server.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--modes", nargs="+", default=["full", "snapshot"], choices=["full", "snapshot"])
    p.add_argument("--keep", action="store_true", help="keep the NATS data directory")
    p.add_argument("--child", choices=["scheduler", "admission"])
    p.add_argument("--url")
    p.add_argument("--prefix")
    p.add_argument("--mode", choices=["full", "snapshot"])
    p.add_argument("--probe")
    p.add_argument("--profile", default="", help="a directory: each child writes its cProfile stats there")
    a = p.parse_args()
    if a.child:
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        work = child(a.child, a.url, a.prefix, a.mode == "snapshot", a.probe)
        if a.profile:
            import cProfile

            with cProfile.Profile() as prof:
                result = asyncio.run(work)
            prof.dump_stats(a.profile)
        else:
            result = asyncio.run(work)
        print(json.dumps(result))
    else:
        asyncio.run(main(a))
