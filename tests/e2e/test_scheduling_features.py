"""End-to-end slices, one per scheduling feature, through the whole running system.

Each test brings up a small federation (explicit nodes per cluster, real NATS, real chDB, a
compressed business clock) and states: submit these jobs, expect these events.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedapp.client import aio_channel
from fedsched.clock import ClockState, ReplayClock
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from services.inventory.trace import TraceNode
from tests.builders import unique, until

pytestmark = pytest.mark.e2e

SPEED = 600.0  # business seconds per wall second: an hour in 6 s


def _nodes(prefix: str, model: str, count: int, gpus: int) -> list[TraceNode]:
    return [TraceNode(f"{prefix}-{i}", 64000, 262144, gpus, model, 16) for i in range(count)]


@pytest.fixture
async def federation(nats_server, chdb_path, tmp_path):
    systems = []

    async def start(split, **settings_kw) -> tuple[System, pb_grpc.JobServiceStub]:
        settings = Settings(data_dir=tmp_path, nats_url=nats_server.url, subject_prefix=unique("f"),
                            clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                            heartbeat_interval_s=0.2, schedule_interval_s=0.005, **settings_kw)
        clock = ReplayClock(ClockState(time.time(), 1.7e9, SPEED, 1))
        system = System(SystemOptions(settings=settings, clock=clock, split=split, agent_tick_s=0.005))
        await system.start()
        systems.append(system)
        while len(system.scheduler.clusters) < len([c for c, n in split.items() if n]):
            await asyncio.sleep(0.05)
        channel = aio_channel(system.grpc_target, system.admin_token)
        systems.append(channel)
        return system, pb_grpc.JobServiceStub(channel)

    yield start
    for s in reversed(systems):
        if isinstance(s, System):
            await s.stop()
        else:
            await s.close()


def spec(**kw) -> pb.JobSpec:
    runtime = kw.pop("runtime", 600)
    annotations = {"trace.runtime_s": str(runtime), **kw.pop("annotations", {})}
    base = dict(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, gpus_per_worker=1, cpu_milli=1000,
                estimated_duration_seconds=runtime, annotations=annotations)
    base.update(kw)
    return pb.JobSpec(**base)


async def wait_for(stub, job_id, states, timeout=30.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if job.state in states:
            return job
        assert time.monotonic() < deadline, f"{job_id} stuck in {pb.JobState.Name(job.state)}: {job.reason}"
        await asyncio.sleep(0.05)


async def submit(stub, **kw) -> str:
    return (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec(**kw)))).job_id


async def test_failed_attempt_fails_over_to_another_cluster(federation):
    _, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2),
                                "cn-north-1-c2": _nodes("b", "nvidia-t4-16gb", 1, 2)})
    job_id = await submit(stub, retry_limit=2, runtime=300, annotations={"trace.fail_attempts": "1",
                                                                          "trace.fail_after_s": "60"})
    job = await wait_for(stub, job_id, {pb.JOB_STATE_SUCCEEDED})
    first, second = job.attempts
    assert first.outcome == "failed" and second.outcome == "succeeded"
    assert first.cluster != second.cluster  # failover, not a retry in place


async def test_failures_beyond_the_retry_limit_fail_the_job(federation):
    _, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2)})
    job_id = await submit(stub, retry_limit=1, annotations={"trace.fail_attempts": "5"})
    job = await wait_for(stub, job_id, {pb.JOB_STATE_FAILED})
    assert [a.outcome for a in job.attempts] == ["failed", "failed"]


async def test_a_placement_never_started_is_reclaimed_and_placed_elsewhere(federation):
    system, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2),
                                     "cn-north-1-c2": _nodes("b", "nvidia-t4-16gb", 1, 2)}, reclaim_after_s=1.0)
    stuck = next(a for a in system.agents if a.cluster.name == "cn-north-1-c1")
    stuck.hold_placements()
    job_id = await submit(stub, gpus_per_worker=2, runtime=120)  # equal scores: the tie goes to c1, the stuck one
    job = await wait_for(stub, job_id, {pb.JOB_STATE_SUCCEEDED}, timeout=40)
    assert [a.cluster for a in job.attempts] == ["cn-north-1-c1", "cn-north-1-c2"]
    first, second = job.attempts
    assert first.started_at.seconds == 0  # never started there
    assert (first.outcome, first.reason) == ("reclaimed", "not started within 1 s")  # not "placed" forever
    assert first.placed_at.ToDatetime() < first.ended_at.ToDatetime() <= second.placed_at.ToDatetime()
    assert second.outcome == "succeeded" and job.cluster == "cn-north-1-c2"


async def test_a_stale_cluster_is_excluded_and_its_unstarted_placements_move(federation):
    system, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 4),
                                     "cn-east-1-c1": _nodes("b", "nvidia-t4-16gb", 1, 4)}, stale_after_s=1.0)
    silent = next(a for a in system.agents if a.cluster.name == "cn-north-1-c1")
    silent.paused = True  # no more heartbeats
    silent.hold_placements()
    # time passing is the behaviour here: stale_after_s (1 s) plus a margin for a heartbeat in flight;
    # the scheduler marks a cluster stale only in a cycle with a queue, so there is no state to await
    await asyncio.sleep(1.5)
    job_id = await submit(stub, runtime=60)  # home is cn-north-1, but its only cluster is stale
    job = await wait_for(stub, job_id, {pb.JOB_STATE_SUCCEEDED})
    assert [a.cluster for a in job.attempts] == ["cn-east-1-c1"]
    explain = await stub.ExplainJob(pb.ExplainJobRequest(job_id=job_id))
    verdicts = {c.cluster: c for c in explain.decisions[0].clusters}
    assert verdicts["cn-north-1-c1"].reason == "inventory_stale"


async def test_preemption_evicts_checkpointable_work_which_resumes_from_its_checkpoint(federation):
    system, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2)})
    low = await submit(stub, gpus_per_worker=2, runtime=7200, priority=pb.PRIORITY_CLASS_LOW, preemptible=True,
                       checkpointable=True, kind=pb.JOB_KIND_TRAINING)
    await wait_for(stub, low, {pb.JOB_STATE_RUNNING})
    # ~70 business minutes pass: two 30-minute checkpoints done. The clock jumps there (as a replay
    # skips idle time) instead of 7 s of sleep; the third checkpoint is 20 business minutes (2 s
    # at 600x) away, as after the sleep
    clock = system.options.clock
    clock.jump_to(clock.time() + 4200)
    high = await submit(stub, gpus_per_worker=2, runtime=600, priority=pb.PRIORITY_CLASS_HIGH)
    placed = await wait_for(stub, high, {pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED})
    assert "preempting" in (await stub.ExplainJob(pb.ExplainJobRequest(job_id=high))).decisions[0].summary

    async def resumed() -> bool:  # the second attempt runs (after the high job's 600 s)
        job = await stub.GetJob(pb.GetJobRequest(job_id=low))
        return len(job.attempts) == 2 and job.attempts[1].started_at.seconds > 0

    assert await until(resumed, timeout=30)
    clock.jump_to(clock.time() + 3600)  # the rest of its run (6 s of wall time) skipped; it ends at its due time
    done = await wait_for(stub, low, {pb.JOB_STATE_SUCCEEDED}, timeout=40)
    first, second = done.attempts
    assert first.outcome == "preempted" and first.reason == f"preempted for {high}"
    await system.drain_writers()
    db = system.settings.clickhouse_database
    progress, resume = system.sync_store.query(
        f"""SELECT maxIf(JSONExtractFloat(payload, 'progress_s'), type = 'job.stopped'),
                   maxIf(JSONExtractFloat(payload, 'resume_from_s'), type = 'job.placed')
            FROM {db}.events WHERE job_id = {{j:String}}""", {"j": low}).rows[0]
    assert progress == resume == 3600.0  # two whole checkpoints, resumed there
    ran = (second.ended_at.ToDatetime() - second.started_at.ToDatetime()).total_seconds()
    assert ran == pytest.approx(7200 - 3600, abs=5)  # only the rest was run again
    assert placed.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED)


async def test_a_split_batch_job_runs_its_shards_in_several_regions(federation):
    _, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 4),
                                "cn-east-1-c1": _nodes("b", "nvidia-t4-16gb", 1, 4),
                                "cn-south-1-c1": _nodes("c", "nvidia-t4-16gb", 1, 4)})
    job_id = await submit(stub, shards=3, gpus_per_worker=4, runtime=300)
    job = await wait_for(stub, job_id, {pb.JOB_STATE_SUCCEEDED})
    assert sorted(a.shard for a in job.attempts) == [0, 1, 2]
    assert len({a.region for a in job.attempts}) == 3
    assert all(a.outcome == "succeeded" for a in job.attempts)


async def test_cancel_of_a_running_job_stops_it_on_its_agent(federation):
    _, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2)})
    job_id = await submit(stub, runtime=36000)
    await wait_for(stub, job_id, {pb.JOB_STATE_RUNNING})
    await stub.CancelJob(pb.CancelJobRequest(job_id=job_id))
    job = await wait_for(stub, job_id, {pb.JOB_STATE_CANCELLED})
    assert job.attempts[0].outcome == "cancelled" and job.attempts[0].reason == "cancelled by admin"
    assert job.reason == "cancelled by admin" and job.ended_at == job.attempts[0].ended_at


async def test_explain_gives_verdicts_scores_and_a_counterfactual(federation):
    _, stub = await federation({"cn-north-1-c1": _nodes("a", "nvidia-t4-16gb", 1, 2) + _nodes("v", "nvidia-v100-32gb",
                                                                                             1, 8),
                                "cn-east-1-c1": _nodes("b", "nvidia-v100-32gb", 1, 8)})
    with pytest.raises(grpc.aio.AioRpcError) as e:  # no cluster at home has an A100: refused at submit
        await submit(stub, card_models=["A100"], runtime=600, locality=pb.LOCALITY_MUST_LOCAL)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "could never run as asked" in e.value.details()
    blocker = await submit(stub, card_models=["V100M32"], gpus_per_worker=8, runtime=36000,
                           locality=pb.LOCALITY_MUST_LOCAL)
    await wait_for(stub, blocker, {pb.JOB_STATE_RUNNING})
    waiting = await submit(stub, card_models=["V100M32"], gpus_per_worker=8, runtime=600,
                           locality=pb.LOCALITY_MUST_LOCAL)

    async def counterfactual() -> bool:  # a job that waited 60 business seconds gets one
        d = (await stub.ExplainJob(pb.ExplainJobRequest(job_id=waiting))).decisions
        return bool(d) and bool(d[0].counterfactual)

    await until(counterfactual, timeout=10)
    d = (await stub.ExplainJob(pb.ExplainJobRequest(job_id=waiting))).decisions[0]
    assert d.outcome == "pending" and d.policy_version.startswith("federated@")
    reasons = {c.cluster: c.reason for c in d.clusters}
    assert reasons == {"cn-north-1-c1": "insufficient_free_resources", "cn-east-1-c1": "outside_home_region"}
    assert "allowing region cn-east-1 would start it now" in d.counterfactual
    placed = await submit(stub, runtime=600)
    await wait_for(stub, placed, {pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED})
    d = (await stub.ExplainJob(pb.ExplainJobRequest(job_id=placed))).decisions[0]
    fit = [c for c in d.clusters if c.passed]
    assert d.outcome == "placed" and fit and {"home", "start", "cost", "fragmentation", "packing"} <= set(fit[0].scores)
