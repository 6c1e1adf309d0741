"""The agents of one runtime (``up --processes`` runs every cluster's agent in one process, each on
a NATS connection of its own) read the scheduler lease through one shared reader (issue 15), and
fencing still holds: placements of the active scheduler run on every cluster."""

from __future__ import annotations

import asyncio
import time

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from services.inventory.trace import TraceNode
from tests.builders import embedded_federation

pytestmark = pytest.mark.e2e


async def test_a_runtimes_agents_share_one_reader_of_the_scheduler_lease(nats_server, chdb_path, tmp_path):
    split = {c: [TraceNode(f"{c}-n{i}", 64000, 262144, 8, "nvidia-t4-16gb", 16) for i in range(2)]
             for c in ("cn-north-1-c1", "cn-east-1-c1")}
    async with embedded_federation(nats_server.url, chdb_path, tmp_path, split) as (system, stub):
        assert len(system.agents) == 2 and system.lease_reads is not None
        assert all(a._read_tenure.func is system.lease_reads for a in system.agents)
        assert len({a.bus.nc for a in system.agents}) == 2  # a connection each
        ids = []
        for home in ("cn-north-1", "cn-east-1"):
            spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, gpus_per_worker=1,
                              cpu_milli=1000, estimated_duration_seconds=600, home_region=home,
                              allowed_regions=[home], annotations={"trace.runtime_s": "600"})
            ids.append((await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id)
        deadline = time.monotonic() + 30
        while not all(any(k[0] == job_id for a in system.agents for k in a.running) for job_id in ids):
            assert time.monotonic() < deadline, "the placements did not run"
            await asyncio.sleep(0.05)
        assert {a.cluster.name for a in system.agents for k in a.running} == set(split)
        assert system.lease_reads.calls >= 1 and all(a.stale_refused == 0 for a in system.agents)
