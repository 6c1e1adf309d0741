"""Admission over real gRPC and real NATS: validation, idempotency, reflection, health."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.tenancy import load_tenants
from services.admission.service import AdmissionService


@pytest.fixture
async def admission(bus):
    svc = AdmissionService(bus, SystemClock(), load_tenants(), address="127.0.0.1:0")
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    yield svc
    svc.stop()
    await task


@pytest.fixture
async def stub(admission):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admission.port}") as channel:
        yield pb_grpc.JobServiceStub(channel)


def good(**kw) -> pb.JobSpec:
    spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                      memory_mib=8192, card_models=["T4"])
    for k, v in kw.items():
        if isinstance(v, list):
            del getattr(spec, k)[:]
            getattr(spec, k).extend(v)
        else:
            setattr(spec, k, v)
    return spec


BAD = [
    ("unknown tenant", good(tenant="nobody"), "spec.tenant"),
    ("tenant breaks the naming rule", good(tenant="Search"), "spec.tenant"),
    ("unknown project", good(project="nope"), "spec.project"),
    ("zero workers", good(workers=0), "spec.workers"),
    ("too many workers", good(workers=100000), "spec.workers"),
    ("too many gpus per worker", good(gpus_per_worker=65), "spec.gpus_per_worker"),
    ("share above a whole card", good(gpu_milli=1500), "spec.gpu_milli"),
    ("fractional share over two cards", good(gpus_per_worker=2, gpu_milli=500), "spec.gpu_milli"),
    ("cpu-only job without cpu", good(gpus_per_worker=0, cpu_milli=0), "spec.cpu_milli"),
    ("unknown card model", good(card_models=["T4", "Quantum-9"]), "spec.card_models[1]"),
    ("bad home region", good(home_region="North"), "spec.home_region"),
    ("unknown home region", good(home_region="us-west-9"), "spec.home_region"),
    ("region both allowed and forbidden", good(allowed_regions=["cn-east-1"], forbidden_regions=["cn-east-1"]),
     "spec"),
    ("NaN duration", good(estimated_duration_seconds=float("nan")), "spec.estimated_duration_seconds"),
    ("negative price ceiling", good(max_price_per_gpu_hour=-1.0), "spec.max_price_per_gpu_hour"),
    ("unknown enum", good(kind=42), "spec.kind"),
    ("bad job name", good(name="My Job"), "spec.name"),
]


@pytest.mark.parametrize("name,spec,field", BAD, ids=[b[0] for b in BAD])
async def test_bad_submission_is_invalid_argument_naming_the_field(stub, name, spec, field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()
    assert dict(e.value.trailing_metadata()).get("fedsched-field") == field


async def test_missing_spec_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitJob(pb.SubmitJobRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("spec:")


async def test_accepted_job_is_canonical_and_readable(stub):
    resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=good(card_models=["Tesla-T4"])))
    job = await stub.GetJob(pb.GetJobRequest(job_id=resp.job_id))
    assert job.state == pb.JOB_STATE_QUEUED
    assert list(job.spec.card_models) == ["nvidia-t4-16gb"]
    assert job.spec.home_region == "cn-north-1"  # the tenant's default


async def test_same_request_id_from_20_concurrent_tasks_makes_one_job(stub, admission, bus):
    req = pb.SubmitJobRequest(spec=good(), request_id="retry-me-42")
    answers = await asyncio.gather(*(stub.SubmitJob(req) for _ in range(20)))
    assert len({a.job_id for a in answers}) == 1
    info = await bus.js.stream_info(bus.stream_name("EVENTS"))
    submitted = [j for j in admission.view.jobs.values() if j.request_id == "retry-me-42"]
    assert len(submitted) == 1
    assert info.state.messages == 1


async def test_unknown_job_is_not_found_and_finished_job_cannot_be_cancelled(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GetJob(pb.GetJobRequest(job_id="j-doesnotexist"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_list_filters_and_pages(stub):
    for i in range(5):
        await stub.SubmitJob(pb.SubmitJobRequest(spec=good(project="serve" if i % 2 else "train")))
    page = await stub.ListJobs(pb.ListJobsRequest(tenant="search", project="train", page_size=2))
    assert page.total == 3 and len(page.jobs) == 2 and page.next_page_token
    rest = await stub.ListJobs(pb.ListJobsRequest(tenant="search", project="train", page_size=2,
                                                  page_token=page.next_page_token))
    assert len(rest.jobs) == 1 and not rest.next_page_token
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ListJobs(pb.ListJobsRequest(page_token="garbage"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancel_of_a_queued_job_and_watch_sees_it(stub):
    resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=good()))
    watch = stub.WatchJob(pb.WatchJobRequest(job_id=resp.job_id))
    first = await watch.read()
    assert first.state == pb.JOB_STATE_QUEUED
    await stub.CancelJob(pb.CancelJobRequest(job_id=resp.job_id, reason="test"))
    update = await asyncio.wait_for(watch.read(), 5)
    assert update.reason == "cancel requested"
    watch.cancel()


async def test_health_and_reflection_are_served(admission):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admission.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service="fedsched.api.v1.JobService"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        answer = await call.read()
        await call.done_writing()
        names = {s.name for s in answer.list_services_response.service}
        assert "fedsched.api.v1.JobService" in names and "grpc.health.v1.Health" in names


async def test_rejections_are_published_for_the_audit_trail(stub, bus):
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.SubmitJob(pb.SubmitJobRequest(spec=good(workers=0)))
    info = await bus.js.stream_info(bus.stream_name("EVENTS"), subjects_filter=f"{bus.prefix}.admission.>")
    assert info.state.messages == 1
