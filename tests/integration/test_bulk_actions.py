"""Bulk actions and priority changes through gRPC on a real bus with the real scheduler and an
agent: hold 3 of 5 jobs and only 2 are placed, release them and all 5 are; a priority change
makes a low job go before a normal one; per-job results with authorisation per job (ids the
caller may not see are NOT_FOUND, never leaked), FAILED_PRECONDITION for a placed job, dry runs
that change nothing, and audited events with who and why."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.events import Envelope
from fedsched.pricing import load_price_catalog
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import T4, StaticBackend, channel, nodes, running_admission, until

NORTH = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
OK = grpc.StatusCode.OK.value[0]


@contextlib.asynccontextmanager
async def agent(bus, gpus: int):
    clock = SystemClock()
    a = ClusterAgent(bus, clock, NORTH, StaticBackend(nodes("n", 1, gpus=gpus, model=T4), clock=clock, runtime_s=None),
                     heartbeat_interval_s=0.1, snapshot_every=1, tick_s=0.01)
    task = asyncio.create_task(a.run())
    try:
        yield a
    finally:
        a.stop()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def scheduler(bus):
    svc = SchedulerService(bus, SystemClock(), build_policy(), load_price_catalog(), interval_s=0.005)
    task = asyncio.create_task(svc.run())
    try:
        yield svc
    finally:
        svc.stop()
        await task


async def submit(stub, name: str, priority=pb.PRIORITY_CLASS_NORMAL, project="train") -> str:
    resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
        tenant="search", project=project, name=name, workers=1, gpus_per_worker=1, priority=priority)))
    return resp.job_id


async def states(stub, ids) -> list[int]:
    return [(await stub.GetJob(pb.GetJobRequest(job_id=j))).state for j in ids]


async def test_hold_three_of_five_then_release_all_five_run(bus):
    async with agent(bus, gpus=8), running_admission(bus, models=(T4,)) as adm:
        async with channel(adm.port, "alice") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            ids = [await submit(stub, f"{'held' if i < 3 else 'free'}-{i}") for i in range(5)]
            sel = pb.JobSelector(tenants=["search"], name_pattern="held-*", states=[pb.JOB_STATE_QUEUED])
            dry = await stub.HoldJobs(pb.BulkJobsRequest(selector=sel, reason="maintenance", dry_run=True))
            assert (dry.matched, dry.succeeded) == (3, 3) and {r.message for r in dry.results} == {"would hold"}
            assert await states(stub, ids[:3]) == [pb.JOB_STATE_QUEUED] * 3  # a dry run changes nothing

            held = await stub.HoldJobs(pb.BulkJobsRequest(selector=sel, reason="maintenance"))
            assert (held.matched, held.succeeded) == (3, 3)
            assert [r.job_id for r in held.results] == ids[:3]
            assert all(r.code == OK and r.state == pb.JOB_STATE_HELD for r in held.results), held
            job = await stub.GetJob(pb.GetJobRequest(job_id=ids[0]))
            assert job.state == pb.JOB_STATE_HELD and job.reason == "held by alice: maintenance"

            async with scheduler(bus) as sched:
                async def placed_or_running(which):
                    return all(s in (pb.JOB_STATE_PLACED, pb.JOB_STATE_RUNNING) for s in await states(stub, which))
                assert await until(lambda: placed_or_running(ids[3:]), timeout=20)
                # the free jobs started (the scheduler folded their starts, long after the holds)
                assert await until(lambda: all(sched.jobs[j].shards[0].state == "running" for j in ids[3:]),
                                   timeout=20)
                assert await states(stub, ids[:3]) == [pb.JOB_STATE_HELD] * 3
                assert sched.status()["held"] == 3 and sched.status()["queued"] == 0

                # holding a running job is refused per item; a held one stays held
                again = await stub.HoldJobs(pb.BulkJobsRequest(selector=pb.JobSelector(job_ids=[ids[0], ids[3]])))
                assert [(r.code, r.message) for r in again.results][0] == (OK, "already held")
                assert again.results[1].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
                assert "only a queued job can be held" in again.results[1].message

                released = await stub.ReleaseJobs(pb.BulkJobsRequest(
                    selector=pb.JobSelector(states=[pb.JOB_STATE_HELD]), reason="done"))
                assert released.succeeded == 3
                assert await until(lambda: placed_or_running(ids), timeout=20)

            # cancel by ids, one of them twice; all end
            cancelled = await stub.CancelJobs(pb.BulkJobsRequest(selector=pb.JobSelector(job_ids=ids + ids[:1]),
                                                                 reason="cleanup"))
            assert cancelled.succeeded == 5 and len(cancelled.results) == 5

    # audited with who and why: the events are in the stream for the audit writer
    sub = await bus.js.pull_subscribe(bus.subjects.all("jobs"), stream=bus.stream_name("EVENTS"))
    msgs = await sub.fetch(100, timeout=2)
    events = [Envelope.from_bytes(m.data) for m in msgs]
    held_events = [e for e in events if e.type == "job.held"]
    assert len(held_events) == 3 and all(e.actor == "alice" and e.payload["reason"] == "maintenance"
                                         for e in held_events)
    assert len([e for e in events if e.type == "job.released"]) == 3


async def test_a_priority_change_lets_a_low_job_go_before_a_normal_one(bus):
    async with agent(bus, gpus=1), running_admission(bus, models=(T4,)) as adm:
        async with channel(adm.port, "alice") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            normal = await submit(stub, "normal")
            low = await submit(stub, "low", priority=pb.PRIORITY_CLASS_LOW)
            job = await stub.SetJobPriority(pb.SetJobPriorityRequest(job_id=low, priority=pb.PRIORITY_CLASS_HIGH,
                                                                     reason="deadline"))
            assert job.spec.priority == pb.PRIORITY_CLASS_HIGH
            async with scheduler(bus):
                assert await until(lambda: _placed(stub, low), timeout=20)
                assert await states(stub, [normal]) == [pb.JOB_STATE_QUEUED]
                with pytest.raises(grpc.aio.AioRpcError) as e:  # placed: too late to change
                    await stub.SetJobPriority(pb.SetJobPriorityRequest(job_id=low, priority=pb.PRIORITY_CLASS_LOW))
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async with channel(adm.port, "alice") as ch:
                await pb_grpc.JobServiceStub(ch).SetJobPriority(pb.SetJobPriorityRequest(
                    job_id=normal, priority=pb.PRIORITY_CLASS_HIGH, reason="x" * 501))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _placed(stub, job_id) -> bool:
    return (await states(stub, [job_id]))[0] in (pb.JOB_STATE_PLACED, pb.JOB_STATE_RUNNING)


async def test_selectors_act_only_on_jobs_the_caller_may_write_and_never_leak_others(bus):
    async with running_admission(bus, models=(T4,)) as adm:
        async with channel(adm.port, "alice") as ch:
            alice = pb_grpc.JobServiceStub(ch)
            train = await submit(alice, "a-train")
            serve = await submit(alice, "a-serve", project="serve")
        async with channel(adm.port, "carol") as ch:
            ads = (await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
                tenant="ads", project="train", workers=1, gpus_per_worker=1)))).job_id
        async with channel(adm.port, "dave") as ch:  # dave may write search/train only
            dave = pb_grpc.JobServiceStub(ch)
            resp = await dave.HoldJobs(pb.BulkJobsRequest(selector=pb.JobSelector(tenants=["search", "ads"]),
                                                          dry_run=True))
            assert [r.job_id for r in resp.results] == [train]
            resp = await dave.HoldJobs(pb.BulkJobsRequest(selector=pb.JobSelector(job_ids=[ads, serve, "j-nope"]),
                                                          dry_run=True))
            codes = {r.job_id: (r.code, r.state) for r in resp.results}
            assert codes[ads] == (grpc.StatusCode.NOT_FOUND.value[0], pb.JOB_STATE_UNSPECIFIED)  # not his: unseen
            assert codes["j-nope"][0] == grpc.StatusCode.NOT_FOUND.value[0]
            assert codes[serve][0] == grpc.StatusCode.NOT_FOUND.value[0]  # search/serve: he may not read it
            assert resp.matched == 0
            empty = await dave.CancelJobs(pb.BulkJobsRequest(selector=pb.JobSelector()))
            assert (empty.matched, len(empty.results)) == (0, 0)  # an empty selector matches nothing
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await dave.CancelJobs(pb.BulkJobsRequest(selector=pb.JobSelector(job_ids=[train]), reason="r" * 501))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        async with channel(adm.port, "bob") as ch:  # approver of search: reads, may not act
            resp = await pb_grpc.JobServiceStub(ch).CancelJobs(pb.BulkJobsRequest(
                selector=pb.JobSelector(job_ids=[train])))
            assert resp.results[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0] and resp.succeeded == 0
