"""Failover time: a cluster falls silent -> its running jobs run elsewhere.

Brings up the embedded system (embedded ``nats-server``; admission, scheduler and trace agents
in this process, no audit/billing) with ``--clusters`` clusters of ``--nodes`` 8-GPU nodes each
(the first clusters of the bundled split: cn-north-1-c1, cn-north-1-c2, cn-east-1-c1, ...),
a freshness limit of ``--stale-after`` wall seconds and heartbeats every ``--heartbeat`` s.
It submits ``--jobs`` 1-GPU jobs that run for an hour of business time, waits until they all
run, cuts off the cluster running most of them (``ClusterAgent.go_silent``: no heartbeats, no
status, its jobs keep running) and polls GetJob every few ms until every job that was there
runs on another cluster. Printed: for the moved jobs, p50 and max of

* ``lost``: cluster silent -> the job view shows the attempt lost (declared by the scheduler);
* ``running elsewhere``: cluster silent -> the job view shows the next attempt running.

    python bench/failover.py --jobs 40 --stale-after 2 --heartbeat 0.5

The floor is the freshness limit minus the age of the last heartbeat at the cut (0 ..
``--heartbeat``); the rest is one scheduling cycle, the placement and the agent's start,
through NATS. Figures depend on the machine (2 shared cores here).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedapp.client import aio_channel  # noqa: E402
from fedapp.runtime import System, SystemOptions  # noqa: E402
from fedsched.api.v1 import jobs_pb2 as pb  # noqa: E402
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc  # noqa: E402
from fedsched.clock import ClockState, ReplayClock  # noqa: E402
from fedsched.settings import Settings  # noqa: E402
from services.inventory.trace import CLUSTERS, TraceNode  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def run(args: argparse.Namespace) -> dict:
    names = [c.name for c in CLUSTERS[:args.clusters]]
    split = {name: [TraceNode(f"{name}-n{i}", 128000, 1048576, 8, "nvidia-t4-16gb", 16) for i in range(args.nodes)]
             for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=tmp, grpc_address="127.0.0.1:0", heartbeat_interval_s=args.heartbeat,
                            stale_after_s=args.stale_after, schedule_interval_s=0.005, reclaim_after_s=120.0)
        clock = ReplayClock(ClockState(time.time(), 1.7e9, 1.0, 1))
        system = System(SystemOptions(settings=settings, clock=clock, split=split, agent_tick_s=0.01,
                                      services=("scheduler", "agents", "admission")))
        await system.start()
        try:
            async with aio_channel(system.grpc_target, system.admin_token) as channel:
                stub = pb_grpc.JobServiceStub(channel)
                while len(system.scheduler.clusters) < len(names):
                    await asyncio.sleep(0.05)
                spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_BATCH, gpus_per_worker=1,
                                  cpu_milli=1000, estimated_duration_seconds=3600,
                                  annotations={"trace.runtime_s": "3600"})
                ids = [(await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id for _ in range(args.jobs)]

                async def jobs() -> list[pb.Job]:
                    return list(await asyncio.gather(*(stub.GetJob(pb.GetJobRequest(job_id=j)) for j in ids)))

                while not all(j.state == pb.JOB_STATE_RUNNING for j in await jobs()):
                    await asyncio.sleep(0.05)
                before = {j.job_id: j.cluster for j in await jobs()}
                victim = max(names, key=lambda n: sum(1 for c in before.values() if c == n))
                moving = [j for j, c in before.items() if c == victim]
                agent = next(a for a in system.agents if a.cluster.name == victim)
                silent_at = time.perf_counter()
                agent.go_silent()
                lost: dict[str, float] = {}
                running: dict[str, float] = {}
                while len(running) < len(moving):
                    now = time.perf_counter() - silent_at
                    for job in await asyncio.gather(*(stub.GetJob(pb.GetJobRequest(job_id=j)) for j in moving
                                                      if j not in running)):
                        if job.job_id not in lost and any(a.outcome == "lost" for a in job.attempts):
                            lost[job.job_id] = now
                        if job.state == pb.JOB_STATE_RUNNING and job.cluster != victim:
                            running[job.job_id] = now
                    if now > 120:
                        raise SystemExit(f"only {len(running)} of {len(moving)} jobs moved in 120 s")
                    await asyncio.sleep(0.005)
        finally:
            await system.stop()
    return {"clusters": len(names), "jobs": args.jobs, "moved": len(moving), "victim": victim,
            "stale_after_s": args.stale_after, "heartbeat_s": args.heartbeat,
            "lost_p50_s": statistics.median(lost.values()), "lost_max_s": max(lost.values()),
            "running_p50_s": statistics.median(running.values()), "running_p90_s": _pct(list(running.values()), 0.9),
            "running_max_s": max(running.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40, help="1-GPU jobs to run (default 40)")
    parser.add_argument("--clusters", type=int, default=2, help="clusters (2..6, default 2)")
    parser.add_argument("--nodes", type=int, default=8, help="8-GPU nodes per cluster (default 8)")
    parser.add_argument("--stale-after", type=float, default=2.0, help="freshness limit, wall s (default 2)")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat period, wall s (default 0.5)")
    args = parser.parse_args()
    if not 2 <= args.clusters <= len(CLUSTERS):
        parser.error(f"--clusters must be 2..{len(CLUSTERS)}")
    r = asyncio.run(run(args))
    print(f"command: python bench/failover.py --jobs {args.jobs} --clusters {args.clusters} --nodes {args.nodes} "
          f"--stale-after {args.stale_after:g} --heartbeat {args.heartbeat:g}")
    print(f"{r['moved']} of {r['jobs']} jobs on {r['victim']} moved (freshness limit {r['stale_after_s']:g} s, "
          f"heartbeat {r['heartbeat_s']:g} s, {r['clusters']} clusters)")
    print(f"cluster silent -> attempt declared lost:   p50 {r['lost_p50_s']:.3f} s   max {r['lost_max_s']:.3f} s")
    print(f"cluster silent -> job running elsewhere:   p50 {r['running_p50_s']:.3f} s   "
          f"p90 {r['running_p90_s']:.3f} s   max {r['running_max_s']:.3f} s")


if __name__ == "__main__":
    main()
