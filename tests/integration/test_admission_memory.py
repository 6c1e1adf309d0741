"""Admission over real gRPC and NATS keeps only ``retain_ended`` ended jobs in memory, yet GetJob,
WatchJob and ExplainJob still return a job that ended long ago (from the ended-jobs KV bucket);
a new admission started from its checkpoint plus the stream after it serves the same jobs
(issue 15 items 2-3)."""

from __future__ import annotations

import asyncio
import time

import grpc

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.jobs import JobSpec
from services.admission.ended import BUCKET, EndedJobs, encode_record
from services.admission.jobview import JobRecord, ShardRecord
from services.admission.service import AdmissionService
from tests.builders import channel, placement, policy_doc, spec, status_event, store_policy, until

REGION, CLUSTER = "cn-north-1", "cn-north-1-c1"


async def _start(bus, **kw) -> tuple[AdmissionService, asyncio.Task]:
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", **kw)
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    return svc, task


async def _run_to_end(bus, job_id: str, spec: JobSpec) -> None:
    now = time.time()
    placed = placement(job_id, spec, CLUSTER, REGION, [("n1", (0,))], at=now)
    await bus.publish(bus.subjects.placements(REGION, CLUSTER), placed)
    for type_ in ("job.started", "job.finished"):
        await bus.publish(bus.subjects.status(REGION, CLUSTER), status_event(type_, placed, now + 1, started_at=now + 1))


async def test_an_ended_job_that_left_memory_is_served_and_a_restart_from_the_checkpoint_agrees(bus):
    await store_policy(bus, policy_doc())
    svc, task = await _start(bus, retain_ended=2, snapshot_every_s=3600)
    ids = []
    try:
        async with channel(svc.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            for i in range(5):
                resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
                    tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                    memory_mib=8192, card_models=["T4"]), request_id=f"r{i}"))
                ids.append(resp.job_id)
            for job_id in ids[:4]:
                await _run_to_end(bus, job_id, svc.view.jobs[job_id].spec)
            assert await until(lambda: svc.view.tombstones.keys() >= {ids[0], ids[1]} and not svc.ended.pending)
            assert ids[0] not in svc.view.jobs and len(svc.view.jobs) == 3  # 2 ended kept + 1 queued
            old = await stub.GetJob(pb.GetJobRequest(job_id=ids[0]))
            assert old.state == pb.JOB_STATE_SUCCEEDED and [a.cluster for a in old.attempts] == [CLUSTER]
            watched = [j async for j in stub.WatchJob(pb.WatchJobRequest(job_id=ids[0]))]
            assert [j.state for j in watched] == [pb.JOB_STATE_SUCCEEDED]
            explained = await stub.ExplainJob(pb.ExplainJobRequest(job_id=ids[0]))
            assert explained.job_id == ids[0]
            try:
                await stub.CancelJob(pb.CancelJobRequest(job_id=ids[0]))
                raise AssertionError("cancelled a job that ended")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "already succeeded" in e.details()
            assert await svc.maybe_snapshot(force=True)
        await _run_to_end(bus, ids[4], svc.view.jobs[ids[4]].spec)  # after the checkpoint: in the tail
        assert await until(lambda: ids[4] in svc.view.jobs and svc.view.jobs[ids[4]].state.value == "succeeded")
    finally:
        svc.stop()
        await task
    again, task = await _start(bus, retain_ended=2, snapshot_every_s=3600)
    try:
        assert again.snapshot_seq > 0  # started from the checkpoint
        assert await until(lambda: again.view.applied_seq >= svc.view.applied_seq)
        assert set(again.view.jobs) == set(svc.view.jobs)
        assert {k: r.state for k, r in again.view.jobs.items()} == {k: r.state for k, r in svc.view.jobs.items()}
        assert dict(again.view.tombstones) == dict(svc.view.tombstones)
        async with channel(again.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            for job_id in ids:
                assert (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).state in (pb.JOB_STATE_SUCCEEDED,
                                                                                     pb.JOB_STATE_QUEUED)
    finally:
        again.stop()
        await task


async def test_a_request_id_retried_after_its_job_left_memory_is_a_duplicate_from_the_bucket(bus):
    """Review item 3 on real NATS: a job ended and left memory, its tombstone gone too (many
    jobs later): a retry of its request_id answers "duplicate" with the archived job from the
    ended-jobs KV bucket before anything is published (past JetStream's duplicate window a
    second job.submitted would be stored and the job re-run; within it the old path waited for
    a job the view would never hold again and answered UNAVAILABLE)."""
    await store_policy(bus, policy_doc())
    svc, task = await _start(bus, retain_ended=1)
    try:
        async with channel(svc.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            request = pb.SubmitJobRequest(spec=pb.JobSpec(
                tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                memory_mib=8192, card_models=["T4"]), request_id="once")
            first = await stub.SubmitJob(request)
            await _run_to_end(bus, first.job_id, svc.view.jobs[first.job_id].spec)
            other = await stub.SubmitJob(pb.SubmitJobRequest(spec=request.spec, request_id="other"))
            await _run_to_end(bus, other.job_id, svc.view.jobs[other.job_id].spec)
            assert await until(lambda: first.job_id in svc.view.tombstones and not svc.ended.pending)
            del svc.view.tombstones[first.job_id]  # as if it had been pushed out by later jobs
            info = await bus.js.stream_info(bus.stream_name("EVENTS"))
            submitted_before = info.state.messages
            again = await stub.SubmitJob(request)
            assert (again.job_id, again.duplicate, again.state) == (first.job_id, True, pb.JOB_STATE_SUCCEEDED)
            info = await bus.js.stream_info(bus.stream_name("EVENTS"))
            assert info.state.messages == submitted_before  # nothing published for the retry
    finally:
        svc.stop()
        await task


async def test_a_batch_asks_the_bucket_once_and_a_retried_key_of_a_job_gone_from_memory_is_its_duplicate(bus):
    """SubmitJobs looks up all of its keys in the ended-jobs bucket with one request (a batch
    direct get), not one per item; and it stays the bucket's answer: after a restart (a new
    admission whose view never held the job, its tombstone gone as if pushed out by later jobs),
    a retry of an ended job's request_id inside a batch of new ones is "duplicate" with the
    archived job and publishes nothing for it, while the new ones are jobs."""
    await store_policy(bus, policy_doc())
    job = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                     memory_mib=8192, card_models=["T4"])
    svc, task = await _start(bus, retain_ended=1)
    try:
        async with channel(svc.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            first = await stub.SubmitJob(pb.SubmitJobRequest(spec=job, request_id="early"))
            await _run_to_end(bus, first.job_id, svc.view.jobs[first.job_id].spec)
            other = await stub.SubmitJob(pb.SubmitJobRequest(spec=job, request_id="pusher"))
            await _run_to_end(bus, other.job_id, svc.view.jobs[other.job_id].spec)
            assert await until(lambda: first.job_id in svc.view.tombstones and not svc.ended.pending)
    finally:
        svc.stop()
        await task
    again, task = await _start(bus, retain_ended=1)
    try:
        assert await until(lambda: first.job_id in again.view.tombstones)
        del again.view.tombstones[first.job_id]  # as if pushed out by later jobs
        assert first.job_id not in again.view.jobs and first.job_id not in again.ended.pending
        async with channel(again.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            before = (await bus.js.stream_info(bus.stream_name("EVENTS"))).state.messages
            lookups = again.ended.lookups
            items = [pb.SubmitJobRequest(spec=job, request_id=f"new-{i}") for i in range(30)]
            items.insert(7, pb.SubmitJobRequest(spec=job, request_id="early"))
            reply = await stub.SubmitJobs(pb.SubmitJobsRequest(items=items))
            assert again.ended.lookups - lookups == 1  # one request for the 31 keys
            assert again.ended.batch_gets is True
            assert again.ended.replicas == 1 and again.ended.leader_reads == 0  # one replica: no confirmation
            assert all(r.code == 0 for r in reply.results), [r.message for r in reply.results if r.code]
            retry = reply.results[7].response
            assert (retry.job_id, retry.duplicate, retry.state) == (first.job_id, True, pb.JOB_STATE_SUCCEEDED)
            fresh = [r.response for i, r in enumerate(reply.results) if i != 7]
            assert all(not r.duplicate and r.state == pb.JOB_STATE_QUEUED for r in fresh)
            after = (await bus.js.stream_info(bus.stream_name("EVENTS"))).state.messages
            assert after - before == 30  # the new jobs' submissions only
    finally:
        again.stop()
        await task


async def test_a_bucket_made_before_it_allowed_direct_gets_is_asked_key_by_key_with_the_same_answers(bus):
    """An ended-jobs bucket created by an older build (no ``allow_direct``): the store reads its
    stream's config when it opens the bucket and asks key by key (its gets go to the stream
    leader: no confirmation needed) -- the same records found, no batch ever sent."""
    kv = await bus.key_value(BUCKET)  # without direct gets, as before issue 15
    rec = JobRecord("j-00000000000000000001", spec(), 1.0, "root", "r1", shards=[ShardRecord(0)])
    await kv.put(rec.job_id, encode_record(rec))
    ended = EndedJobs(bus)
    found = await ended.get_many([rec.job_id, "j-00000000000000000002"])
    assert list(found) == [rec.job_id] and found[rec.job_id].request_id == "r1"
    assert ended.batch_gets is False and ended.lookups == 2  # its stream config allows no direct gets: one get per key
    found = await ended.get_many([rec.job_id])
    assert list(found) == [rec.job_id] and ended.lookups == 2 + 1 and ended.leader_reads == 0  # no batch tried
