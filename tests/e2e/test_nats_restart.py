"""The bus goes away and comes back: every service reconnects and resumes, nothing is lost or
doubled (nats.py pull consumers are known to stall after server restarts: issues #504, #986)."""

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
from tests.builders import unique

pytestmark = pytest.mark.e2e


async def _state(stub, job_id, states, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            job = await stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=5)
            if job.state in states:
                return job
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < deadline, f"{job_id} never reached {states}"
        await asyncio.sleep(0.1)


async def test_services_survive_a_nats_server_restart(tmp_path, chdb_path):
    settings = Settings(data_dir=tmp_path, clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2, schedule_interval_s=0.005,
                        stale_after_s=30)
    clock = ReplayClock(ClockState(time.time(), 1.7e9, 100.0, 1))
    split = {"cn-north-1-c1": [TraceNode("n1", 64000, 262144, 4, "nvidia-t4-16gb", 16)]}
    system = System(SystemOptions(settings=settings, clock=clock, split=split, agent_tick_s=0.005))
    await system.start()
    try:
        async with aio_channel(system.grpc_target, system.admin_token) as channel:
            stub = pb_grpc.JobServiceStub(channel)
            spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000,
                              annotations={"trace.runtime_s": "600"})
            before = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id="before"))).job_id
            await _state(stub, before, {pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED})
            system.nats.kill()                    # abrupt: no goodbye to any client
            for _ in range(100):                  # the system's watchdog restarts it: same port and store
                if system.nats_restarts == 1 and system.nats.running:
                    break
                await asyncio.sleep(0.1)
            assert system.nats_restarts == 1 and system.nats.running
            after = None
            for _ in range(50):  # admission publishes again once its connection is back
                try:
                    after = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id="after"), timeout=5)).job_id
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)
            assert after is not None
            done_before = await _state(stub, before, {pb.JOB_STATE_SUCCEEDED})
            done_after = await _state(stub, after, {pb.JOB_STATE_SUCCEEDED})
            assert len(done_before.attempts) == 1 and len(done_after.attempts) == 1
        await system.drain_writers(timeout_s=60)
        db = settings.clickhouse_database
        rows = system.sync_store.query(
            f"SELECT job_id, type, count() FROM {db}.events WHERE job_id IN {{ids:Array(String)}} "
            f"GROUP BY job_id, type HAVING count() > 1", {"ids": [before, after]}).rows
        assert rows == []  # nothing doubled
        kinds = {r[0] for r in system.sync_store.query(
            f"SELECT type FROM {db}.events WHERE job_id = {{j:String}}", {"j": after}).rows}
        assert {"job.submitted", "job.placed", "job.started", "job.finished"} <= kinds  # nothing lost
    finally:
        await system.stop()
