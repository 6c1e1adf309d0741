"""The embedded system stops and starts again on the same data dir with its state kept."""

import asyncio

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedapp.client import aio_channel
from fedsched.clock import ClockState, ReplayClock
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from tests.builders import DATA, unique

pytestmark = pytest.mark.e2e


def _system(data_dir, chdb_path, database, clock) -> System:
    # writer_ack_wait_s: the first system stops (its embedded NATS with it) while audit and billing
    # hold a just-fetched batch; the restarted NATS redelivers it only after the ack wait (60 s default)
    settings = Settings(data_dir=data_dir, clickhouse_path=chdb_path, clickhouse_database=database,
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.2, writer_ack_wait_s=3.0)
    return System(SystemOptions(settings=settings, clock=clock, nodes_csv=DATA / "openb_node_list_gpu_node.csv"))


async def _wait_state(stub, job_id, states, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if job.state in states:
            return job
        assert asyncio.get_running_loop().time() < deadline, f"job stuck in {pb.JobState.Name(job.state)}"
        await asyncio.sleep(0.05)


async def test_second_start_resumes_with_jobs_running_and_history_kept(tmp_path, chdb_path):
    database = unique("db")
    # a clock at 60 business seconds per wall second, so the job ends a few seconds after the restart
    clock = ReplayClock(ClockState(anchor_wall=__import__("time").time(), anchor_business=1.7e9, speed=60.0, generation=1))
    spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=2, cpu_milli=8000,
                      annotations={"trace.runtime_s": "300"}, card_models=["G2"])
    async with _system(tmp_path, chdb_path, database, clock) as first:
        assert {c.ack_wait_s for c in (*first.audit.consumers, *first.billing.consumers)} == {3.0}
        async with aio_channel(first.grpc_target, first.admin_token) as channel:
            stub = pb_grpc.JobServiceStub(channel)
            done = await stub.SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
                tenant="nlp", project="batch", gpus_per_worker=1, gpu_milli=250, cpu_milli=1000,
                annotations={"trace.runtime_s": "1"})))
            long = await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id="survives-restart"))
            await _wait_state(stub, done.job_id, {pb.JOB_STATE_SUCCEEDED})
            running = await _wait_state(stub, long.job_id, {pb.JOB_STATE_RUNNING})
            cluster = running.cluster
    async with _system(tmp_path, chdb_path, database, clock) as second:
        assert second.admin_token == first.admin_token  # read back from <data_dir>/admin.token
        async with aio_channel(second.grpc_target, second.admin_token) as channel:
            stub = pb_grpc.JobServiceStub(channel)
            assert (await stub.GetJob(pb.GetJobRequest(job_id=done.job_id))).state == pb.JOB_STATE_SUCCEEDED
            again = await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id="survives-restart"))
            assert again.job_id == long.job_id and again.duplicate
            finished = await _wait_state(stub, long.job_id, {pb.JOB_STATE_SUCCEEDED}, timeout=30)
            assert finished.cluster == cluster and len(finished.attempts) == 1  # resumed, not re-placed
        await second.drain_writers()
        starts = second.sync_store.query(
            f"SELECT count() FROM {database}.events WHERE job_id = {{j:String}} AND type = 'job.started'",
            {"j": long.job_id}).scalar()
        assert starts == 1
