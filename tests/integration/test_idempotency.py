"""Idempotency keys over real gRPC and NATS (issue 14, item 4): a ``request_id`` is scoped to
the caller -- (principal, tenant, project) -- so two submitters, or two projects, never get each
other's job; the same key with a different spec is ALREADY_EXISTS."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedapp.client import aio_channel
from fedsched.auth import hash_token
from tests.builders import channel, policy_doc, running_admission

#: extra principals (appended to the fixtures' ``principals:`` list): a submitter of search/serve
#: only, next to dave (search/train only) and alice (all of search)
ERIN = "tok-erin-0123456789"
EXTRA = f"  - {{name: erin, token_sha256: {hash_token(ERIN)}, roles: [{{role: submitter, tenants: [search], " \
        f"projects: [serve]}}]}}\n"


@pytest.fixture
async def admission(bus):
    async with running_admission(bus, policy_doc(EXTRA)) as svc:
        yield svc


def _open(port: int, who: str) -> grpc.aio.Channel:
    return aio_channel(f"127.0.0.1:{port}", ERIN) if who == "erin" else channel(port, who)


def _request(project: str, rid: str = "nightly-7", **kw) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(request_id=rid, spec=pb.JobSpec(tenant="search", project=project, gpus_per_worker=1,
                                                               cpu_milli=4000, card_models=["T4"], **kw))


async def _submit(port: int, who: str, request: pb.SubmitJobRequest) -> pb.SubmitJobResponse:
    async with _open(port, who) as ch:
        return await pb_grpc.JobServiceStub(ch).SubmitJob(request, timeout=10)


async def _get(port: int, who: str, job_id: str) -> pb.Job:
    async with _open(port, who) as ch:
        return await pb_grpc.JobServiceStub(ch).GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)


async def test_one_request_id_in_two_projects_makes_two_jobs_each_readable_by_its_submitter(admission):
    dave = await _submit(admission.port, "dave", _request("train"))
    erin = await _submit(admission.port, "erin", _request("serve"))
    assert dave.job_id != erin.job_id and not dave.duplicate and not erin.duplicate
    assert (await _get(admission.port, "dave", dave.job_id)).spec.project == "train"
    assert (await _get(admission.port, "erin", erin.job_id)).spec.project == "serve"
    # each one's retry finds its own job
    assert (await _submit(admission.port, "erin", _request("serve"))).job_id == erin.job_id
    again = await _submit(admission.port, "dave", _request("train"))
    assert again.job_id == dave.job_id and again.duplicate


async def test_the_key_is_the_callers_principal_tenant_and_project(admission):
    alice_train = await _submit(admission.port, "alice", _request("train", rid="k"))
    alice_serve = await _submit(admission.port, "alice", _request("serve", rid="k"))  # same caller, other project
    dave_train = await _submit(admission.port, "dave", _request("train", rid="k"))  # other caller, same project
    assert len({alice_train.job_id, alice_serve.job_id, dave_train.job_id}) == 3
    by_key = {(j.submitted_by, j.spec.project) for j in admission.view.jobs.values() if j.request_id == "k"}
    assert by_key == {("alice", "train"), ("alice", "serve"), ("dave", "train")}


async def test_a_reused_key_with_another_spec_is_already_exists_naming_the_job(admission):
    first = await _submit(admission.port, "dave", _request("train", rid="r-1"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _submit(admission.port, "dave", _request("train", rid="r-1", workers=2))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"made job {first.job_id} with a different spec" in e.value.details()
    assert len([j for j in admission.view.jobs.values() if j.request_id == "r-1"]) == 1


async def test_concurrent_calls_with_one_key_and_two_specs_make_one_job(admission):
    """The calls race to publish one message id: JetStream keeps one job, the calls with that
    spec get it, the calls with the other spec get ALREADY_EXISTS."""
    specs = [_request("train", rid="race"), _request("train", rid="race", workers=2)]
    results = await asyncio.gather(*(_submit(admission.port, "dave", specs[i % 2]) for i in range(20)),
                                   return_exceptions=True)
    jobs = [j for j in admission.view.jobs.values() if j.request_id == "race"]
    assert len(jobs) == 1
    kept = 2 if jobs[0].spec.workers == 2 else 1
    for i, r in enumerate(results):
        if (2 if i % 2 else 1) == kept:
            assert isinstance(r, pb.SubmitJobResponse) and r.job_id == jobs[0].job_id, r
        else:
            assert isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.ALREADY_EXISTS, r
