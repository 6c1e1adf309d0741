"""``JobService.GetJobLogs`` end to end: admission proxies the request over NATS to the agent of
the attempt's cluster (real NATS, real agents on the trace backend, a compressed clock)."""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.logs import request_logs
from services.inventory.trace import TraceNode
from tests.builders import embedded_federation

pytestmark = pytest.mark.e2e

CLUSTER = "cn-north-1-c1"


@pytest.fixture
async def running_job(nats_server, chdb_path, tmp_path):
    """A one-cluster federation with a 2-worker job running on it: (system, stub, job id)."""
    split = {CLUSTER: [TraceNode(f"a-{i}", 64000, 262144, 2, "nvidia-t4-16gb", 16) for i in range(2)]}
    async with embedded_federation(nats_server.url, chdb_path, tmp_path, split) as (system, stub):
        spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, gpus_per_worker=2, workers=2,
                          cpu_milli=1000, estimated_duration_seconds=36000, annotations={"trace.runtime_s": "36000"})
        job_id = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id
        deadline = time.monotonic() + 30
        while (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).state != pb.JOB_STATE_RUNNING:
            assert time.monotonic() < deadline, "the job never ran"
            await asyncio.sleep(0.05)
        yield system, stub, job_id


async def _logs(stub, **kw) -> list[pb.LogChunk]:
    return [c async for c in stub.GetJobLogs(pb.GetJobLogsRequest(**kw))]


async def test_logs_of_a_trace_job_say_the_backend_keeps_none(running_job):
    _, stub, job_id = running_job
    for kw in ({}, {"attempt": 1}, {"attempt": 1, "worker": 1}):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _logs(stub, job_id=job_id, **kw)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "trace backend keeps no logs" in e.value.details() and CLUSTER in e.value.details()


@pytest.mark.parametrize("kw, missing", [
    (dict(job_id="j-00000000000000000000"), "job"),
    (dict(attempt=2), "attempt"),
    (dict(worker=2), "worker"),
    (dict(shard=1), "shard"),
])
async def test_unknown_job_attempt_worker_or_shard_is_not_found(running_job, kw, missing):
    _, stub, job_id = running_job
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _logs(stub, **{"job_id": job_id, **kw})
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing in e.value.details()


async def test_an_agent_that_does_not_answer_is_unavailable(running_job):
    system, stub, job_id = running_job
    agent = system.agents[0]
    agent.stop()  # the agent process is gone: nobody listens on its logs subject
    deadline = time.monotonic() + 10
    while True:
        system.admission.servicer.request_logs = functools.partial(request_logs, system.admission.bus.nc,
                                                                  timeout_s=0.5)
        started = time.monotonic()
        try:
            await _logs(stub, job_id=job_id)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert time.monotonic() - started < 5
            return
        assert time.monotonic() < deadline, "the stopped agent kept answering"
        await asyncio.sleep(0.1)
