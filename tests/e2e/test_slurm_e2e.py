"""End to end through gRPC on a real Slurm: the embedded system with a topology of one ``slurm``
cluster (the session's ``slurm_cluster``) and one trace cluster, 24 real jobs run as Slurm jobs.

Every job runs concurrently so the whole test takes about as long as its slowest job: the one
that sleeps past its one-minute time limit (Slurm enforces limits at whole minutes, 60-90 s).
Checked: each job's final state and exit code (GetJob, the ``job.finished``/``job.failed``
events), billing's usage rows against Slurm's own start/end times (``squeue --json``), a gang's
ranks from ``SLURM_PROCID`` (its output), and an agent restart while Slurm jobs run: no job is
submitted twice (Slurm jobs per attempt tag) and each attempt's end is reported once.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from fedapp.client import aio_channel
from fedapp.runtime import System, SystemOptions
from fedapp.topology import build_backend, cluster_def
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.settings import Settings
from fedsched.store import open_store
from fedsched.topology import parse_topology
from services.inventory.agent import ClusterAgent
from services.inventory.slurm_json import parse_jobs
from tests.builders import unique

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SLURM = "cn-north-1-slurm"
TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}


def _topology(cluster, root):
    (root / "nodes.csv").write_text("sn,cpu_milli,memory_mib,num_gpu,gpu,model\n"
                                    "east-1,64000,262144,,8,T4\neast-2,64000,262144,,8,T4\n")
    return parse_topology({
        "regions": [{"name": "cn-north-1", "zones": ["cn-north-1a"]}, {"name": "cn-east-1", "zones": ["cn-east-1a"]}],
        "clusters": [
            {"name": SLURM, "region": "cn-north-1", "zone": "cn-north-1a", "backend": "slurm",
             "slurm": {"partition": cluster.partition, "conf": cluster.env["SLURM_CONF"],
                       "jobcomp_log": str(cluster.dir / "jobcomp.log"), "output_dir": str(root / "out"),
                       "poll_s": 0.5, "time_margin_s": 0}},
            {"name": "cn-east-1-a", "region": "cn-east-1", "zone": "cn-east-1a", "backend": "trace",
             "trace": {"nodes": "nodes.csv"}},
        ],
    }, base_dir=root)


def _spec(script: str, *, gpus: int = 0, workers: int = 1, estimate_s: float = 0.0) -> pb.JobSpec:
    """A job for the Slurm cluster (region cn-north-1 only; A100s there, T4s elsewhere)."""
    return pb.JobSpec(
        tenant="search", project="train", kind=pb.JOB_KIND_BATCH, home_region="cn-north-1",
        allowed_regions=["cn-north-1"], workers=workers, gpus_per_worker=gpus, cpu_milli=1000, memory_mib=512,
        card_models=["nvidia-a100-40gb"] if gpus else [], estimated_duration_seconds=estimate_s,
        workload=pb.Workload(image="ignored-by-slurm", command=["/bin/sh", "-c", script]))


def _squeue(cluster) -> list:
    return parse_jobs(json.loads(cluster.run("squeue", "--json").stdout))


async def _wait(stub, job_ids, states, timeout_s: float) -> dict[str, pb.Job]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = {j: await stub.GetJob(pb.GetJobRequest(job_id=j)) for j in job_ids}
        if all(job.state in states for job in jobs.values()):
            return jobs
        assert time.monotonic() < deadline, {j: pb.JobState.Name(job.state) for j, job in jobs.items()}
        await asyncio.sleep(0.25)


async def test_real_jobs_through_grpc_on_slurm(slurm_cluster, nats_server, chdb_path, tmp_path):
    topo = _topology(slurm_cluster, tmp_path)
    settings = Settings(data_dir=tmp_path / "data", nats_url=nats_server.url, subject_prefix=unique("sl"),
                        clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.5, schedule_interval_s=0.01)
    system = System(SystemOptions(settings=settings, topology=topo, agent_tick_s=0.05))
    await system.start()
    channel = aio_channel(system.grpc_target, system.admin_token)
    restarted: list[ClusterAgent] = []
    try:
        stub = pb_grpc.JobServiceStub(channel)
        deadline = time.monotonic() + 30
        while SLURM not in system.scheduler.clusters:
            assert time.monotonic() < deadline, "the Slurm cluster never reported its inventory"
            await asyncio.sleep(0.05)

        async def submit(spec) -> str:
            return (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id

        ok = [await submit(_spec(f"echo ok-{i}; sleep 1", gpus=1)) for i in range(8)]
        three = [await submit(_spec("echo failing; exit 3", gpus=1)) for _ in range(3)]
        cpu_ok = [await submit(_spec("echo cpu; sleep 2")) for _ in range(4)]
        timeout = await submit(_spec("echo long; sleep 300", estimate_s=1))  # --time=1 (minute)
        cancel = await submit(_spec("echo cancel me; sleep 300"))
        gang = await submit(_spec('echo "rank $RANK of $WORLD_SIZE local $LOCAL_RANK master $MASTER_ADDR"; sleep 2',
                                  gpus=1, workers=2))
        # jobs running across the agent restart: some end while the agent is down, some after
        survive = [await submit(_spec(f"echo survive; sleep {s}")) for s in (6, 6, 25, 25, 25)]
        every = [*ok, *three, *cpu_ok, timeout, cancel, gang, *survive]
        assert len(every) >= 20

        await _wait(stub, [cancel, *survive], {pb.JOB_STATE_RUNNING}, 60)
        await stub.CancelJob(pb.CancelJobRequest(job_id=cancel, reason="e2e"))
        await _wait(stub, [cancel], {pb.JOB_STATE_CANCELLED}, 30)

        # kill the Slurm agent while its jobs run, bring up a fresh one (a new process: new backend)
        old = next(a for a in system.agents if a.cluster.name == SLURM)
        old.stop()
        await old.backend.close()  # the old process is gone: nobody polls for it
        await asyncio.sleep(8)  # two survivors end while no agent watches
        backend = build_backend(topo.cluster(SLURM), topo)
        agent = ClusterAgent(await system._bus("agent-slurm-2"), system.options.clock, cluster_def(topo, SLURM),
                             backend, heartbeat_interval_s=settings.heartbeat_interval_s, tick_s=0.05)
        restarted.append(agent)
        system._spawn(agent.run(), "agent-slurm-2")

        jobs = await _wait(stub, every, TERMINAL, 150)
        # the new agent adopted what ran and submitted only placements the old one never saw
        assert len(old.backend.submitted) + len(backend.submitted) == len(every)

        def state(j):
            return pb.JobState.Name(jobs[j].state)

        assert {state(j) for j in [*ok, *cpu_ok, gang, *survive]} == {"JOB_STATE_SUCCEEDED"}
        assert {state(j) for j in [*three, timeout]} == {"JOB_STATE_FAILED"}
        assert state(cancel) == "JOB_STATE_CANCELLED"
        assert all("exit code 3" in jobs[j].reason for j in three), [jobs[j].reason for j in three]
        assert "timeout" in jobs[timeout].reason
        assert all(jobs[j].cluster == SLURM for j in every)

        # one Slurm job per attempt (nothing submitted twice), Slurm's times
        slurm_jobs = [sj for sj in _squeue(slurm_cluster) if sj.tag is not None and sj.tag.job_id in set(every)]
        per_tag: dict = {}
        for sj in slurm_jobs:
            per_tag.setdefault(sj.tag, []).append(sj)
        assert sorted(t.job_id for t in per_tag) == sorted(every)
        assert all(len(v) == 1 for v in per_tag.values()), {t: len(v) for t, v in per_tag.items() if len(v) > 1}
        by_job = {t.job_id: v[0] for t, v in per_tag.items()}
        assert by_job[timeout].state == "TIMEOUT" and by_job[cancel].state == "CANCELLED"
        assert by_job[three[0]].exit_code == 3

        # the gang's two tasks got their ranks from Slurm
        text = "".join([c.data async for c in stub.GetJobLogs(pb.GetJobLogsRequest(job_id=gang))])
        assert "rank 0 of 2" in text and "rank 1 of 2" in text, text

        await system.drain_writers()
        store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)
        db = store.database
        # each attempt's end reported once (finished or failed), across the restart
        ends = store.query(f"SELECT job_id, attempt, count() FROM {db}.events WHERE type IN "
                           f"('job.finished', 'job.failed') GROUP BY job_id, attempt").rows
        counts = {r[0]: r[2] for r in ends}
        assert all(counts.get(j) == 1 for j in every if j != cancel), {j: counts.get(j) for j in every}
        codes = dict(store.query(f"SELECT job_id, JSONExtract(payload, 'exit_code', 'Nullable(Int64)') FROM {db}.events "
                                 f"WHERE type = 'job.finished'").rows)
        assert all(codes[j] == 0 for j in [*ok, *cpu_ok, *survive])
        # usage rows bill what Slurm recorded (within a second)
        usage = store.query(f"SELECT job_id, toUnixTimestamp(started_at), toUnixTimestamp(ended_at) "
                            f"FROM {db}.usage WHERE cluster = '{SLURM}'").rows
        billed = {r[0]: (r[1], r[2]) for r in usage}
        gpu_jobs = [*ok, *three, gang]
        assert set(gpu_jobs) <= set(billed), sorted(set(gpu_jobs) - set(billed))
        for j, (start, end) in billed.items():
            sj = by_job[j]
            assert abs(start - sj.start_time.timestamp()) <= 1 and abs(end - sj.end_time.timestamp()) <= 1, (j, sj)
            assert abs((end - start) - sj.elapsed_s) <= 1
    finally:
        for a in restarted:
            a.stop()
        await channel.close()
        await system.stop()
        for a in restarted:
            await a.backend.close()
        live = [str(j.job_id) for j in _squeue(slurm_cluster) if j.tag is not None and not j.finished]
        if live:
            slurm_cluster.run("scancel", *live, check=False)
