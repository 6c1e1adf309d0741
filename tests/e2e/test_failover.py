"""Failover of running work through the whole running system (issue 10, item 4).

Real NATS, real chDB, the embedded runtime with two trace clusters A and B of one 8-GPU node
each (same region), freshness limit 1 s, heartbeats every 0.2 s, a business clock at 60x.
Jobs run on A; A's agent is cut off (``ClusterAgent.go_silent``: no heartbeats, no status, no
orders taken, its jobs keep running). Then:

* every job runs on B within the freshness limit plus a cycle (and some slack for the 2 cores);
* at every sample (GetJob every few ms) a job has at most one current attempt (placed or
  running), and after the move exactly one;
* no placement is ever sent to A while it is silent -- also by a scheduler restarted meanwhile
  (the ``restart`` case stops the scheduler right after A falls silent and starts a new one
  once A is past the limit);
* when A comes back its agent takes the ``job.stop`` (cluster_lost) that waited for it and
  reports ``job.stopped`` for its copy (same event id as the scheduler's: stored once);
* billing has exactly one closed ``compute`` interval per attempt: the lost attempt ended at
  the time it was declared lost, the second one when the job finished.

Once A's copies are stopped, the business clock jumps past the second attempts' end (the replay
driver's jump: idle wall time skipped, every end still reported at its own business time).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from fedapp.cli.jobs import attempt_history
from fedapp.client import aio_channel
from fedapp.reports import data_window, run_reports
from fedapp.runtime import System, SystemOptions
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import ClockState, ReplayClock
from fedsched.settings import Settings
from services.inventory.trace import TraceNode
from tests.builders import unique, until

pytestmark = pytest.mark.e2e

A, B = "cn-north-1-c1", "cn-north-1-c2"
SPEED = 60.0       # business seconds per wall second
RUNTIME = 900      # business seconds: 15 s of wall time
STALE_S = 1.0
BEAT_S = 0.2
OPEN = ("placed", "running", "stopping")


def _split() -> dict:
    return {name: [TraceNode(f"{prefix}-0", 64000, 262144, 8, "nvidia-t4-16gb", 16)]
            for name, prefix in ((A, "a"), (B, "b"))}


def _spec() -> pb.JobSpec:
    return pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, gpus_per_worker=2, cpu_milli=1000,
                      estimated_duration_seconds=RUNTIME, annotations={"trace.runtime_s": str(RUNTIME)})


class Sampler:
    """Reads GetJob for every job every few ms; records violations of 'one current attempt'."""

    def __init__(self, stub, job_ids) -> None:
        self.stub, self.job_ids = stub, job_ids
        self.samples = 0
        self.violations: list[str] = []
        self.current: dict[str, pb.Job] = {}

    async def run(self) -> None:
        while True:
            for job_id in self.job_ids:
                job = await self.stub.GetJob(pb.GetJobRequest(job_id=job_id))
                current = [a for a in job.attempts if a.outcome in OPEN]
                if len(current) > 1:
                    self.violations.append(f"{job_id}: {[(a.attempt, a.cluster, a.outcome) for a in current]}")
                self.current[job_id] = job
                self.samples += 1
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("case", ["steady", "scheduler-restart", "late-return"])
async def test_a_silent_clusters_running_jobs_move_once_and_are_billed_once(case, nats_server, chdb_path,
                                                                          tmp_path) -> None:
    """``late-return``: JetStream's duplicate window (0.5 s) is shorter than A's absence, so the
    agent's own ``job.stopped`` of the lost attempt is stored as a second event with the same id:
    billing, the job view and the scheduler still count the attempt once."""
    restart = case == "scheduler-restart"
    window = 0.5 if case == "late-return" else 120.0
    prefix, db = unique("fo"), unique("db")
    settings = Settings(data_dir=tmp_path, nats_url=nats_server.url, subject_prefix=prefix, clickhouse_path=chdb_path,
                        clickhouse_database=db, grpc_address="127.0.0.1:0", heartbeat_interval_s=BEAT_S,
                        schedule_interval_s=0.005, stale_after_s=STALE_S, reclaim_after_s=60.0,
                        duplicate_window_s=window)
    clock = ReplayClock(ClockState(time.time(), 1.7e9, SPEED, 1))
    system = System(SystemOptions(settings=settings, clock=clock, split=_split(), agent_tick_s=0.005))
    await system.start()
    channel = aio_channel(system.grpc_target, system.admin_token)
    sampling = None
    sent: list[tuple[float, str, str, str]] = []  # (wall, subject, type, producer) on A's subjects

    async def on_message(msg) -> None:
        body = json.loads(msg.data)
        sent.append((time.time(), msg.subject, body.get("type", ""), body.get("producer", "")))

    subs = [await system.control.nc.subscribe(f"{prefix}.placements.cn-north-1.{A}", cb=on_message),
            await system.control.nc.subscribe(f"{prefix}.status.cn-north-1.{A}", cb=on_message)]
    try:
        stub = pb_grpc.JobServiceStub(channel)
        agents = {a.cluster.name: a for a in system.agents}
        assert await until(lambda: len(system.scheduler.clusters) == 2, timeout=20)
        # B silent first, so that the jobs land on A
        agents[B].go_silent()
        assert await until(lambda: system.scheduler.status()["stale"] == [B], timeout=10)
        job_ids = [(await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec()))).job_id for _ in range(3)]

        async def all_running_on(cluster: str) -> bool:
            jobs = [await stub.GetJob(pb.GetJobRequest(job_id=j)) for j in job_ids]
            return all(j.state == pb.JOB_STATE_RUNNING and j.cluster == cluster for j in jobs)

        assert await until(lambda: all_running_on(A), timeout=20)
        agents[B].resume()
        assert await until(lambda: system.scheduler.status()["stale"] == [], timeout=10)
        sampler = Sampler(stub, job_ids)
        sampling = asyncio.create_task(sampler.run())

        silent_at = time.time()
        agents[A].go_silent()
        if restart:  # the scheduler goes down with A just silent; a new one comes up once A is past the limit
            await system.stop_scheduler()
            await asyncio.sleep(STALE_S + 0.5)
            await system.start_scheduler()
        assert await until(lambda: all_running_on(B), timeout=15)
        moved_s = time.time() - silent_at
        limit = STALE_S + BEAT_S + 1.5  # the freshness limit, the last beat's age, a cycle and the 2 cores' slack
        if restart:
            limit += STALE_S + 0.5 + 3.0  # the scheduler was down for that long, then rebuilds
        assert moved_s < limit, f"moved after {moved_s:.2f} s"
        if restart:  # right after its restart the new scheduler gave A nothing (also: a new job goes to B)
            fresh = (await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec()))).job_id
            assert await until(lambda: _running_on(stub, fresh, B), timeout=10)
        assert not [m for m in sent if m[1].startswith(f"{prefix}.placements") and m[2] == "job.placed"
                    and m[0] > silent_at], "a placement was sent to the silent cluster"
        for job in [await stub.GetJob(pb.GetJobRequest(job_id=j)) for j in job_ids]:
            assert [(a.attempt, a.cluster, a.outcome) for a in job.attempts] == [(1, A, "lost"), (2, B, "running")]
            (story,) = attempt_history(job)  # what `fedsched explain` prints under "attempts:"
            assert story.startswith(f"failover: attempt 1 lost on {A} at ") and story.endswith(
                f"; moved to {B} as attempt 2 (running)"), story

        if case == "late-return":  # A stays away past the duplicate window
            await asyncio.sleep(window + 0.5)
        returned_at = time.time()
        agents[A].resume()  # A comes back still running its copies: the stop orders wait for it
        assert await until(lambda: not agents[A].running, timeout=10)

        def stopped_by_agent() -> set:  # the captured publishes arrive asynchronously
            return {m for m in sent if m[0] > returned_at and m[2] == "job.stopped" and m[3] == f"agent/{A}"}

        await until(lambda: len(stopped_by_agent()) >= len(job_ids), timeout=10)
        assert len(stopped_by_agent()) == len(job_ids)  # its report (dropped by JetStream as a duplicate)
        # nothing is left to happen but the second attempts running to their end (~12 s of wall
        # time at 60x): the business clock jumps past it, as a replay skips idle time (the trace
        # backend reports each end at its due business time, so billing sees the same interval)
        clock.jump_to(clock.time() + RUNTIME)
        assert await until(lambda: all(j.state == pb.JOB_STATE_SUCCEEDED for j in sampler.current.values()),
                           timeout=40)
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        assert sampler.samples > 100 and not sampler.violations, sampler.violations[:5]

        await system.drain_writers()
        rows = system.sync_store.query(
            f"SELECT job_id, attempt, cluster, flag, count(), min(ended_at) FROM {db}.usage "
            f"WHERE line = 'compute' GROUP BY job_id, attempt, cluster, flag ORDER BY job_id, attempt").rows
        lost_at = dict(system.sync_store.query(
            f"SELECT job_id, min(occurred_at) FROM {db}.events WHERE type = 'job.stopped' "
            f"AND producer = 'scheduler' GROUP BY job_id").rows)
        by_job: dict[str, list] = {}
        for job_id, attempt, cluster, flag, n, ended in rows:
            by_job.setdefault(job_id, []).append((attempt, cluster, flag, n))
            if job_id in job_ids and attempt == 1:
                assert abs((ended - lost_at[job_id]).total_seconds()) < 0.002  # ended when declared lost
        for job_id in job_ids:
            assert by_job[job_id] == [(1, A, "cluster_lost", 1), (2, B, "", 1)]
        # A's status subject holds 3 starts and the scheduler's 3 ends of the lost attempts, and the
        # agent's own 3 reports of them only when they came after the duplicate window
        status = f"{prefix}.status.cn-north-1.{A}"
        info = await system.control.js.stream_info(system.control.stream_name("EVENTS"), subjects_filter=status)
        assert info.state.subjects == {status: 9 if case == "late-return" else 6}
        assert system.sync_store.query(  # the audit log keeps one row per event id
            f"SELECT count() FROM {db}.events WHERE type = 'job.stopped' AND cluster = {{c:String}}", {"c": A}
        ).scalar() == 3
        for job in [await stub.GetJob(pb.GetJobRequest(job_id=j)) for j in job_ids]:
            assert [(a.attempt, a.outcome) for a in job.attempts] == [(1, "lost"), (2, "succeeded")]
        # the report's failovers: attempt 1 lost on A, moved to B as attempt 2, resumed from 0 s
        window = data_window(system.sync_store.query, db)
        (failovers,) = run_reports(system.sync_store.query, db, window, ["failovers"])
        got = {r["job_id"]: r for r in failovers.dicts()}
        assert sorted(got) == sorted(job_ids)
        for row in got.values():
            assert (row["attempt"], row["lost_on"], row["moved_to"], row["next_attempt"], row["resume_from_s"]) \
                == (1, A, B, 2, 0.0)
            assert 0 <= row["move_s"] < 60 * SPEED  # business seconds: a few wall seconds at most
        (reconciled,) = run_reports(system.sync_store.query, db, window, ["reconciliation"])
        assert reconciled.rows == []  # every stop here was the scheduler's order
    finally:
        if sampling is not None and not sampling.done():
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
        for sub in subs:
            await sub.unsubscribe()
        await channel.close()
        await system.stop()


async def _running_on(stub, job_id: str, cluster: str) -> bool:
    job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
    return job.state == pb.JOB_STATE_RUNNING and job.cluster == cluster


async def test_a_dead_cluster_is_never_given_a_placement_right_after_a_scheduler_restart(nats_server, chdb_path,
                                                                                       tmp_path) -> None:
    """The scheduler prefers cluster P for a probe job (cancelled again); P falls silent, the
    scheduler is stopped, and a new one starts once P is past the freshness limit: the same job
    submitted right after the restart runs on the other cluster, and nothing is ever placed on P."""
    prefix = unique("fo")
    settings = Settings(data_dir=tmp_path, nats_url=nats_server.url, subject_prefix=prefix, clickhouse_path=chdb_path,
                        clickhouse_database=unique("db"), grpc_address="127.0.0.1:0", heartbeat_interval_s=BEAT_S,
                        schedule_interval_s=0.005, stale_after_s=STALE_S, reclaim_after_s=60.0)
    system = System(SystemOptions(settings=settings, clock=ReplayClock(ClockState(time.time(), 1.7e9, SPEED, 1)),
                                  split=_split(), agent_tick_s=0.005, services=("scheduler", "agents", "admission")))
    await system.start()
    channel = aio_channel(system.grpc_target, system.admin_token)
    placed: list[tuple[float, str]] = []

    async def on_placement(msg) -> None:
        if json.loads(msg.data).get("type") == "job.placed":
            placed.append((time.time(), msg.subject.rsplit(".", 1)[-1]))

    sub = await system.control.nc.subscribe(f"{prefix}.placements.>", cb=on_placement)
    try:
        stub = pb_grpc.JobServiceStub(channel)
        assert await until(lambda: len(system.scheduler.clusters) == 2, timeout=20)
        probe = (await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec()))).job_id
        assert await until(lambda: _state_is(stub, probe, pb.JOB_STATE_RUNNING), timeout=10)
        preferred = (await stub.GetJob(pb.GetJobRequest(job_id=probe))).cluster
        other = B if preferred == A else A
        await stub.CancelJob(pb.CancelJobRequest(job_id=probe))
        assert await until(lambda: _state_is(stub, probe, pb.JOB_STATE_CANCELLED), timeout=10)
        assert await until(lambda: not next(a for a in system.agents if a.cluster.name == preferred).running)

        silent_at = time.time()
        next(a for a in system.agents if a.cluster.name == preferred).go_silent()
        await system.stop_scheduler()
        await asyncio.sleep(STALE_S + 0.5)  # the preferred cluster is now past the limit
        await system.start_scheduler()
        job = (await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec()))).job_id
        assert await until(lambda: _running_on(stub, job, other), timeout=10)
        # judged stale (its work lost) only after the restarted scheduler's start-up grace
        assert await until(lambda: system.scheduler.status()["stale"] == [preferred], timeout=10)
        assert [c for t, c in placed if t > silent_at] == [other]
    finally:
        await sub.unsubscribe()
        await channel.close()
        await system.stop()


async def _state_is(stub, job_id: str, state: int) -> bool:
    return (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).state == state
