"""Admission replicas (issue 14 item 9): two admission services behind one address must answer alike.

Real nats-server; replicas A and B are two :class:`~services.admission.service.AdmissionService`
instances, each with its own NATS connection and gRPC server, on one subject prefix (as two pods
behind one Service). What a replica keeps in memory and why they agree:

* idempotency keys -- the job id is derived from the key (principal, tenant, project,
  request_id) and is the message id, so JetStream keeps one submission whichever replica
  publishes; the other answers from its view with ``duplicate=true``;
* the job view -- folded from the stream by every replica (eventually the same);
* budget holds -- each replica's in-flight holds are its own, so budgeted submissions publish
  with a compare-and-set on the tenant's submissions (``_submit_budgeted``): 200 submits spread
  over A and B against 100 CNY at 4.5 CNY each accept exactly 22, as one replica would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Bus
from tests.builders import TENANTS, channel, policy_doc, running_admission, submit_at_once

SMALL_BUDGET_TENANTS = TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                                       "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                                       "budget: {monthly: \"100\", currency: CNY}}")


@contextlib.asynccontextmanager
async def _replicas(nats_server, bus, doc):
    other = await Bus.connect(nats_server.url, bus.prefix, name="admission-b")
    try:
        async with running_admission(bus, doc, spend_poll_s=0.05) as a:
            async with running_admission(other, doc, spend_poll_s=0.05) as b:
                yield a, b
    finally:
        await other.close()


async def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _job(tenant: str = "nlp", project: str = "train", **kw) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant=tenant, project=project, cpu_milli=1000, gpus_per_worker=1,
                                               card_models=["T4"], **kw))


async def test_a_request_id_submitted_on_one_replica_is_the_same_job_on_the_other(nats_server, bus) -> None:
    async with _replicas(nats_server, bus, policy_doc()) as (a, b):
        async with channel(a.port, "carol") as ca, channel(b.port, "carol") as cb:
            sa, sb = pb_grpc.JobServiceStub(ca), pb_grpc.JobServiceStub(cb)
            request = _job()
            request.request_id = "nightly-1"
            first = await sa.SubmitJob(request, timeout=10)
            again = await sb.SubmitJob(request, timeout=10)
            assert (again.job_id, again.duplicate, first.duplicate) == (first.job_id, True, False)
            # both at once, on both replicas: one job, one first answer
            request.request_id = "nightly-2"
            both = await asyncio.gather(sa.SubmitJob(request, timeout=10), sb.SubmitJob(request, timeout=10))
            assert both[0].job_id == both[1].job_id
            assert sorted(r.duplicate for r in both) == [False, True]
            # the job view agrees: a job submitted on A is served by B
            await _until(lambda: first.job_id in b.view.jobs)
            got = await sb.GetJob(pb.GetJobRequest(job_id=first.job_id), timeout=10)
            assert got.job_id == first.job_id and got.spec.tenant == "nlp"


async def test_concurrent_budget_holds_across_two_replicas_never_exceed_the_budget(nats_server, bus) -> None:
    """200 submits at once spread over A and B, each with a worst case of 4.5 CNY, against 100
    CNY: exactly floor(100 / 4.5) = 22 accepted, the rest RESOURCE_EXHAUSTED; the two views hold
    the same 22 jobs."""
    async with _replicas(nats_server, bus, policy_doc(tenants=SMALL_BUDGET_TENANTS)) as (a, b):
        job = _job("vision", "serve", estimated_duration_seconds=3600, max_price_per_gpu_hour=4.5, retry_limit=0)
        accepted, refused = await submit_at_once([svc.port for svc in (a, b, a, b)], "carol", job, 200)
        assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused[0].details()
        assert len(accepted) == 22 and len({r.job_id for r in accepted}) == 22
        await _until(lambda: len(a.view.open_by_tenant.get("vision", ())) == 22 == len(b.view.open_by_tenant.get(
            "vision", ())))
        print(f"\ncompare-and-set rounds lost: A {a.servicer.budget_conflicts}, B {b.servicer.budget_conflicts}")
