"""fedsched into Slurm against plain ``sbatch``, on the same local Slurm in the same run.

Starts a local Slurm (``deploy/slurm/local-slurm.sh``, fresh directory, free ports), then:

1. plain Slurm: ``--single`` jobs one at a time (sbatch -> ``squeue --json`` shows it started),
   then ``--jobs`` trivial jobs (``--wrap true``), one sbatch after another, until all are final;
2. through fedsched: the embedded system (NATS, chDB, every service) on a topology of that Slurm
   cluster plus one trace cluster; ``--single`` jobs one at a time (SubmitJob -> GetJob shows
   RUNNING or later), then ``--jobs`` trivial jobs (``true``, CPU only) submitted over gRPC one
   after another, until GetJob shows every one ended.

Prints JSON: per path ``submit_to_running_p50_s`` / ``_max_s`` and ``jobs_per_s`` (jobs / wall
time from the first submit until all ended), plus the agent's poll interval.

    sudo python bench/slurm_through_fedsched.py --jobs 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from slurm_baseline import SCRIPT, free_port  # noqa: E402

from services.inventory.slurm_json import parse_jobs  # noqa: E402


def squeue(env) -> list:
    return parse_jobs(json.loads(subprocess.run(["squeue", "--json"], env=env, check=True, capture_output=True,
                                                text=True).stdout))


def plain(env, directory: Path, jobs: int, single: int) -> dict:
    latencies = []
    for i in range(single):
        t = time.monotonic()
        r = subprocess.run(["sbatch", "--parsable", f"--job-name=single-{i}", f"--output={directory}/out/%j.out",
                            "--wrap=true"], env=env, check=True, capture_output=True, text=True)
        job_id = int(r.stdout.strip().split(";")[0])
        while not any(j.job_id == job_id and j.started for j in squeue(env)):
            time.sleep(0.02)
        latencies.append(time.monotonic() - t)
    t0 = time.monotonic()
    ids = set()
    for i in range(jobs):
        r = subprocess.run(["sbatch", "--parsable", f"--job-name=bench-{i}", f"--output={directory}/out/%j.out",
                            "--wrap=true"], env=env, check=True, capture_output=True, text=True)
        ids.add(int(r.stdout.strip().split(";")[0]))
    while True:
        done = [j for j in squeue(env) if j.job_id in ids and j.finished]
        if len(done) == len(ids):
            break
        time.sleep(0.2)
    wall = time.monotonic() - t0
    return {"submit_to_running_p50_s": round(statistics.median(latencies), 3),
            "submit_to_running_max_s": round(max(latencies), 3), "jobs_per_s": round(jobs / wall, 2),
            "wall_s": round(wall, 1)}


async def through_fedsched(env, directory: Path, jobs: int, single: int, poll_s: float) -> dict:
    from fedapp.client import aio_channel
    from fedapp.runtime import System, SystemOptions
    from fedsched.api.v1 import jobs_pb2 as pb
    from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
    from fedsched.natsd import EmbeddedNats
    from fedsched.settings import Settings
    from fedsched.topology import parse_topology

    (directory / "nodes.csv").write_text("sn,cpu_milli,memory_mib,num_gpu,gpu,model\neast-1,64000,262144,,8,T4\n")
    topo = parse_topology({
        "regions": [{"name": "cn-north-1", "zones": ["cn-north-1a"]}, {"name": "cn-east-1", "zones": ["cn-east-1a"]}],
        "clusters": [
            {"name": "cn-north-1-slurm", "region": "cn-north-1", "zone": "cn-north-1a", "backend": "slurm",
             "slurm": {"partition": "gpu", "conf": env["SLURM_CONF"], "jobcomp_log": str(directory / "jobcomp.log"),
                       "output_dir": str(directory / "fs-out"), "poll_s": poll_s}},
            {"name": "cn-east-1-a", "region": "cn-east-1", "zone": "cn-east-1a", "backend": "trace",
             "trace": {"nodes": "nodes.csv"}}]}, base_dir=directory)
    nats = EmbeddedNats(directory / "nats")
    nats.start()
    os.environ.update({"SLURM_CONF": env["SLURM_CONF"], "PATH": env["PATH"]})
    settings = Settings(data_dir=directory / "data", nats_url=nats.url, subject_prefix="bench",
                        clickhouse_path=directory / "chdb", clickhouse_database="bench", grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.5, schedule_interval_s=0.005)
    system = System(SystemOptions(settings=settings, topology=topo, agent_tick_s=0.02))
    await system.start()
    channel = aio_channel(system.grpc_target, system.admin_token)
    try:
        stub = pb_grpc.JobServiceStub(channel)
        while "cn-north-1-slurm" not in system.scheduler.clusters:
            await asyncio.sleep(0.05)

        def spec(script: str) -> pb.JobSpec:
            return pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, home_region="cn-north-1",
                              allowed_regions=["cn-north-1"], workers=1, gpus_per_worker=0, cpu_milli=1000,
                              memory_mib=256, workload=pb.Workload(image="ignored", command=["/bin/sh", "-c", script]))

        started_or_later = {pb.JOB_STATE_RUNNING, pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED}
        latencies = []
        for _ in range(single):
            t = time.monotonic()
            job_id = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec("sleep 1")))).job_id
            while (await stub.GetJob(pb.GetJobRequest(job_id=job_id))).state not in started_or_later:
                await asyncio.sleep(0.02)
            latencies.append(time.monotonic() - t)
        t0 = time.monotonic()
        ids = [(await stub.SubmitJob(pb.SubmitJobRequest(spec=spec("true")))).job_id for _ in range(jobs)]
        submit_wall = time.monotonic() - t0
        pending = set(ids)
        while pending:
            for j in list(pending):
                if (await stub.GetJob(pb.GetJobRequest(job_id=j))).state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
                    pending.discard(j)
            await asyncio.sleep(0.1)
        wall = time.monotonic() - t0
        states = {}
        for j in ids:
            s = pb.JobState.Name((await stub.GetJob(pb.GetJobRequest(job_id=j))).state)
            states[s] = states.get(s, 0) + 1
    finally:
        await channel.close()
        await system.stop()
        nats.stop()
    return {"submit_to_running_p50_s": round(statistics.median(latencies), 3),
            "submit_to_running_max_s": round(max(latencies), 3), "jobs_per_s": round(jobs / wall, 2),
            "wall_s": round(wall, 1), "submit_per_s": round(jobs / submit_wall, 1), "states": states}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--single", type=int, default=5)
    ap.add_argument("--poll-s", type=float, default=0.5, help="the Slurm agent's squeue interval")
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="fs-slurm-vs-"))
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
           "FEDSCHED_SLURM_CTLD_PORT": str(free_port()), "FEDSCHED_SLURMD_PORT": str(free_port())}
    started = subprocess.run([str(SCRIPT), "start", str(directory)], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f"local Slurm did not start: {started.stderr.strip()}")
    client = {**env, "SLURM_CONF": str(directory / "slurm.conf")}
    try:
        result = {"jobs": args.jobs, "single": args.single, "poll_s": args.poll_s, "cpus": os.cpu_count(),
                  "plain_sbatch": plain(client, directory, args.jobs, args.single),
                  "through_fedsched": asyncio.run(through_fedsched(client, directory, args.jobs, args.single,
                                                                   args.poll_s))}
    finally:
        subprocess.run([str(SCRIPT), "stop", str(directory)], env=env, capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
