"""Submit throughput through admission: accepted jobs/s and p50/p99 latency of SubmitJob.

Brings up an embedded ``nats-server`` and the admission service as its own process
(``fedsched service admission``: authentication, validation, governance checks, publish to
JetStream with ``Nats-Msg-Id``, the job view), then submits ``--jobs`` valid jobs from
``--concurrency`` concurrent callers over one gRPC channel, each with its own request id and the
bootstrap admin's bearer token, and prints what was accepted per second and the latency
percentiles. A warm-up (``--warmup`` jobs) is excluded from the figures.

    python bench/submit_throughput.py --jobs 5000 --concurrency 64

``--batch N`` submits N jobs per ``SubmitJobs`` call instead of one ``SubmitJob`` each (latency
is then per call of N jobs). ``--quota`` first applies a quota and a budget for the tenant (``fedsched policy apply`` through
the API), so the quota and budget checks do real work. ``--open N`` first submits N jobs of the
same tenant, untimed; no scheduler runs, so they all stay open (queued) while the measured jobs
are submitted -- the per-submit work must not grow with them (issue 14 item 8)::

    python bench/submit_throughput.py --quota --open 2000 --jobs 2000
    python bench/submit_throughput.py --quota --open 20000 --jobs 2000
 Figures depend on the machine; the client and the server each get one
process (the NATS server a third).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsched.api.v1 import governance_pb2 as gpb  # noqa: E402
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc  # noqa: E402
from fedsched.api.v1 import jobs_pb2 as pb  # noqa: E402
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc  # noqa: E402
from fedapp.client import aio_channel  # noqa: E402
from fedsched.natsd import EmbeddedNats, free_port  # noqa: E402
from fedsched.auth import TOKEN_FILE, read_token_file  # noqa: E402

def _spec(i: int) -> pb.JobSpec:
    return pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                      memory_mib=8192, card_models=["T4"], estimated_duration_seconds=600,
                      annotations={"trace.runtime_s": "600"}, name=f"bench-{i}")


async def _wait_serving(target: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"admission at {target} did not come up")
            await asyncio.sleep(0.2)


async def _load(target: str, token: str, jobs: int, concurrency: int, offset: int,
                batch: int = 0) -> tuple[list[float], int, float, int]:
    latencies: list[float] = []
    errors = 0
    accepted = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(offset, offset + jobs, batch or 1):
        queue.put_nowait(i)
    async with aio_channel(target, token) as ch:
        stub = pb_grpc.JobServiceStub(ch)

        async def worker() -> None:
            nonlocal errors, accepted
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                try:
                    if batch:
                        items = [pb.SubmitJobRequest(spec=_spec(k), request_id=f"bench-{k}")
                                 for k in range(i, min(i + batch, offset + jobs))]
                        resp = await stub.SubmitJobs(pb.SubmitJobsRequest(items=items), timeout=120)
                        bad = [r for r in resp.results if r.code]
                        accepted += len(items) - len(bad)
                        errors += len(bad)
                        if bad and errors <= 3:
                            print(f"  item error: {bad[0].code}: {bad[0].message}", file=sys.stderr)
                    else:
                        await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(i), request_id=f"bench-{i}"), timeout=30)
                        accepted += 1
                    latencies.append(time.perf_counter() - t0)
                except grpc.aio.AioRpcError as e:
                    errors += 1
                    if errors <= 3:
                        print(f"  error: {e.code().name}: {e.details()}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, errors, wall, accepted


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="fedsched-bench-"))
    nats = EmbeddedNats(work / "nats")
    nats.start()
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "fedapp.cli", "service", "admission", "--nats-url", nats.url,
                             "--data-dir", str(work), "--grpc-address", target],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        await _wait_serving(target)
        token = read_token_file(work / TOKEN_FILE)
        if args.quota:
            async with aio_channel(target, token) as ch:
                policy = gpb_grpc.PolicyServiceStub(ch)
                doc = yaml.safe_load((await policy.GetPolicy(gpb.GetPolicyRequest())).yaml)
                doc["quotas"] = [{"tenant": "search", "card": "*", "region": "*", "guaranteed_gpus": 100000}]
                for tenant in doc["tenants"]:
                    if tenant["name"] == "search":
                        tenant["budget"] = {"monthly": "1000000000", "currency": "CNY"}
                await policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=yaml.safe_dump(doc)))
        if args.warmup:
            await _load(target, token, args.warmup, args.concurrency, 10**9, args.batch)
        if args.open:
            t0 = time.perf_counter()
            _, open_errors, _, _ = await _load(target, token, args.open, args.concurrency, 2 * 10**9, args.batch)
            print(f"  {args.open} open jobs submitted first ({open_errors} errors) in {time.perf_counter() - t0:.1f} s")
        latencies, errors, wall, ok = await _load(target, token, args.jobs, args.concurrency, 0, args.batch)
        print(f"submit throughput through admission ({args.jobs} jobs, concurrency {args.concurrency}, "
              f"{f'SubmitJobs of {args.batch}, ' if args.batch else ''}"
              f"{'quota + budget + ' if args.quota else ''}auth on, {args.open + args.warmup} open jobs of the "
              f"tenant before, {os.cpu_count()} CPUs)")
        print(f"  accepted:       {ok} ({errors} errors) in {wall:.2f} s")
        print(f"  accepted jobs/s: {ok / wall:.0f}")
        if latencies:
            print(f"  latency p50:    {_pct(latencies, 0.50) * 1000:.1f} ms")
            print(f"  latency p99:    {_pct(latencies, 0.99) * 1000:.1f} ms")
            print(f"  latency mean:   {statistics.fmean(latencies) * 1000:.1f} ms")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        nats.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--batch", type=int, default=0, help="jobs per SubmitJobs call (0 = SubmitJob, one each)")
    parser.add_argument("--quota", action="store_true", help="apply a policy with a quota for the tenant first")
    parser.add_argument("--open", type=int, default=0, help="jobs submitted (and left open) before the measured ones")
    asyncio.run(main(parser.parse_args()))
