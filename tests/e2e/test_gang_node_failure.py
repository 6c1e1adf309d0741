"""A node failing under one member of a running gang, through the whole system: the whole gang
is stopped, reported ``job.failed`` reason ``node_failed``, and requeued as one unit (a new
attempt with every worker) within its retry limit; no worker of the failed attempt keeps running."""

from __future__ import annotations

import asyncio
import time

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from services.inventory.trace import TraceNode
from tests.builders import embedded_federation

pytestmark = pytest.mark.e2e


async def _wait(stub, job_id, check, what, timeout=30.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if check(job):
            return job
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {job}"
        await asyncio.sleep(0.05)


async def test_a_failed_node_requeues_the_whole_gang(nats_server, chdb_path, tmp_path):
    split = {"cn-north-1-c1": [TraceNode(f"a-{i}", 64000, 262144, 2, "nvidia-t4-16gb", 16) for i in range(3)]}
    async with embedded_federation(nats_server.url, chdb_path, tmp_path, split) as (system, stub):
        spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=2, workers=2,
                          cpu_milli=1000, estimated_duration_seconds=1200, retry_limit=1,
                          annotations={"trace.runtime_s": "1200"})
        job_id = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id
        await _wait(stub, job_id, lambda j: j.state == pb.JOB_STATE_RUNNING, "the gang to run")
        agent = system.agents[0]
        (key, running), = agent.running.items()
        victim = running.placed.bindings[1].node  # worker 1's node
        agent.set_node_health(victim, False)
        job = await _wait(stub, job_id, lambda j: len(j.attempts) >= 2, "a second attempt")
        first = job.attempts[0]
        assert (first.attempt, first.outcome, first.reason) == (1, "failed", "node_failed")
        # the failed attempt holds nothing on the cluster: no partial gang
        assert all(k[1] != 1 for k in agent.running if k[0] == job_id)
        assert not [o for o in await agent.backend.list_attempts() if o.key.job_id == job_id and o.key.attempt == 1]
        job = await _wait(stub, job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED, "the requeued gang to finish")
        # the gang ran again as one unit; placements made before the scheduler heard of the failed
        # node may have been refused by the agent (rejected: not a retry), never run partially
        assert job.attempts[-1].outcome == "succeeded"
        assert {a.outcome for a in job.attempts[1:-1]} <= {"rejected"}
        assert all(victim in a.reason for a in job.attempts[1:-1])
