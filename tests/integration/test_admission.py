"""Admission over real gRPC and real NATS: validation, idempotency, reflection, health.

The bad-request table (:data:`BAD`) pairs every kind of bad submission -- each field's invalid
forms, oversize, wrong wire types, unknown card models, names breaking the rules, widening the
tenant's policy, a quota it can never fit, missing or foreign credentials -- with its exact
status code and the field (or limit) the error names.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Bus
from fedsched.clock import SystemClock
from fedsched.events import Envelope, EventType, InventorySnapshot, NodeInventory, make_event
from fedsched.pricing import load_price_catalog
from services.admission.service import AdmissionService
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import TOKENS, channel, policy_doc, store_policy, unique

QUOTAS = """
quotas:
  - {tenant: nlp, card: "*", region: "*", guaranteed_gpus: 8}
"""
MAX_MESSAGE = 256 * 1024


async def _start(bus: Bus) -> tuple[AdmissionService, asyncio.Task]:
    await store_policy(bus, policy_doc(QUOTAS))
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", max_message_bytes=MAX_MESSAGE)
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    return svc, task


@pytest.fixture
async def admission(bus):
    svc, task = await _start(bus)
    yield svc
    svc.stop()
    await task


@pytest.fixture(scope="module")
async def shared_admission(nats_server):
    """One admission for the read-only table tests of this module (its own subject prefix)."""
    bus = await Bus.connect(nats_server.url, unique("t"), name="test-shared")
    await bus.ensure_streams()
    svc, task = await _start(bus)
    yield svc
    svc.stop()
    await task
    await bus.close()


@pytest.fixture
async def stub(admission):
    async with channel(admission.port, "root") as ch:
        yield pb_grpc.JobServiceStub(ch)


def good(**kw) -> pb.JobSpec:
    spec = pb.JobSpec(tenant="search", project="train", kind=pb.JOB_KIND_TRAINING, gpus_per_worker=1, cpu_milli=4000,
                      memory_mib=8192, card_models=["T4"])
    for k, v in kw.items():
        if isinstance(v, list):
            del getattr(spec, k)[:]
            getattr(spec, k).extend(v)
        elif isinstance(v, dict):
            getattr(spec, k).update(v)
        elif k == "datasets":
            spec.datasets.append(v)
        elif isinstance(v, (Timestamp, pb.Workload)):
            getattr(spec, k).CopyFrom(v)
        else:
            setattr(spec, k, v)
    return spec


def wl(**kw) -> pb.Workload:
    """A valid workload, changed by ``kw``."""
    return pb.Workload(**({"image": "ghcr.io/acme/trainer:1.4"} | kw))


def req(spec: pb.JobSpec | None = None, **kw) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(spec=spec, **kw) if spec is not None else pb.SubmitJobRequest(**kw)


def with_len(body: bytes) -> bytes:
    """``body`` prefixed by its length (a one-byte varint: < 128 bytes)."""
    assert len(body) < 128
    return bytes([len(body)]) + body


def raw_spec(body: bytes) -> bytes:
    """A SubmitJobRequest whose field 1 (spec) holds ``body`` verbatim."""
    return b"\x0a" + with_len(body)


IA, RE, PD, UA = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
FAR = Timestamp(seconds=10**13)  # year ~318857: not a datetime

#: (id, request (message or raw bytes), caller, expected code, expected field/limit or None)
BAD = [
    # tenant and project: unknown, naming rules, empty
    ("unknown tenant", req(good(tenant="nobody")), "root", IA, "spec.tenant"),
    ("tenant breaks the naming rule", req(good(tenant="Search")), "root", IA, "spec.tenant"),
    ("tenant too long", req(good(tenant="s" * 40)), "root", IA, "spec.tenant"),
    ("tenant empty", req(good(tenant="")), "root", IA, "spec.tenant"),
    ("unknown project", req(good(project="nope")), "root", IA, "spec.project"),
    ("project breaks the naming rule", req(good(project="Train!")), "root", IA, "spec.project"),
    ("project empty", req(good(project="")), "root", IA, "spec.project"),
    # gang shape and resources
    ("zero workers", req(good(workers=0)), "root", IA, "spec.workers"),
    ("workers beyond any gang", req(good(workers=100000)), "root", IA, "spec.workers"),
    ("workers above the policy limit", req(good(workers=1025)), "root", IA, "spec.workers"),
    ("gpus per worker beyond a node", req(good(gpus_per_worker=65)), "root", IA, "spec.gpus_per_worker"),
    ("gpus per worker above the policy limit", req(good(gpus_per_worker=17)), "root", IA, "spec.gpus_per_worker"),
    ("share above a whole card", req(good(gpu_milli=1500)), "root", IA, "spec.gpu_milli"),
    ("zero share of a card", req(good(gpu_milli=0)), "root", IA, "spec.gpu_milli"),
    ("fractional share over two cards", req(good(gpus_per_worker=2, gpu_milli=500)), "root", IA, "spec.gpu_milli"),
    ("cpu-only job without cpu", req(good(gpus_per_worker=0, cpu_milli=0)), "root", IA, "spec.cpu_milli"),
    ("cpu above the limit", req(good(cpu_milli=10**9)), "root", IA, "spec.cpu_milli"),
    ("memory above the limit", req(good(memory_mib=10**9)), "root", IA, "spec.memory_mib"),
    ("min gpu memory absurd", req(good(min_gpu_memory_gib=5000)), "root", IA, "spec.min_gpu_memory_gib"),
    # card models
    ("unknown card model", req(good(card_models=["T4", "Quantum-9"])), "root", IA, "spec.card_models[1]"),
    ("empty card model", req(good(card_models=[""])), "root", IA, "spec.card_models[0]"),
    ("card model name oversize", req(good(card_models=["A" * 200])), "root", IA, "spec.card_models[0]"),
    # regions
    ("home region breaks the naming rule", req(good(home_region="North")), "root", IA, "spec.home_region"),
    ("unknown home region", req(good(home_region="us-west-9")), "root", IA, "spec.home_region"),
    ("allowed region breaks the naming rule", req(good(allowed_regions=["CN"])), "root", IA, "spec.allowed_regions"),
    ("unknown allowed region", req(good(allowed_regions=["us-west-9"])), "root", IA, "spec.allowed_regions"),
    ("forbidden region breaks the naming rule", req(good(forbidden_regions=["cn_east"])), "root", IA,
     "spec.forbidden_regions"),
    ("region both allowed and forbidden", req(good(allowed_regions=["cn-east-1"], forbidden_regions=["cn-east-1"])),
     "root", IA, "spec"),
    # numbers
    ("NaN duration", req(good(estimated_duration_seconds=float("nan"))), "root", IA,
     "spec.estimated_duration_seconds"),
    ("infinite duration", req(good(estimated_duration_seconds=float("inf"))), "root", IA,
     "spec.estimated_duration_seconds"),
    ("negative duration", req(good(estimated_duration_seconds=-1.0)), "root", IA, "spec.estimated_duration_seconds"),
    ("duration above the limit", req(good(estimated_duration_seconds=1e10)), "root", IA,
     "spec.estimated_duration_seconds"),
    ("negative price ceiling", req(good(max_price_per_gpu_hour=-1.0)), "root", IA, "spec.max_price_per_gpu_hour"),
    ("NaN price ceiling", req(good(max_price_per_gpu_hour=float("nan"))), "root", IA, "spec.max_price_per_gpu_hour"),
    ("retry limit above 100", req(good(retry_limit=101)), "root", IA, "spec.retry_limit"),
    ("zero shards", req(good(kind=pb.JOB_KIND_BATCH, shards=0)), "root", IA, "spec.shards"),
    ("shards of a training job", req(good(shards=2)), "root", IA, "spec"),
    ("start deadline out of range", req(good(start_deadline=FAR)), "root", IA, "spec.start_deadline"),
    ("start deadline in the past", req(good(start_deadline=Timestamp(seconds=1_600_000_000))), "root", IA,
     "spec.start_deadline"),
    # enums
    ("unknown kind", req(good(kind=42)), "root", IA, "spec.kind"),
    ("unknown priority", req(good(priority=42)), "root", IA, "spec.priority"),
    ("unknown locality", req(good(locality=9)), "root", IA, "spec.locality"),
    # other names and collections
    ("job name breaks the naming rule", req(good(name="My Job")), "root", IA, "spec.name"),
    ("residency tag breaks the naming rule", req(good(residency_tags=["PII data"])), "root", IA,
     "spec.residency_tags"),
    ("dataset name breaks the naming rule", req(good(datasets=pb.Dataset(name="Data Set", home_region="cn-east-1"))),
     "root", IA, "spec.datasets[0].name"),
    ("dataset region breaks the naming rule", req(good(datasets=pb.Dataset(name="d1", home_region="East"))),
     "root", IA, "spec.datasets[0].home_region"),
    ("too many datasets", req(good(datasets=[pb.Dataset(name=f"d{i}", home_region="cn-east-1") for i in range(65)])),
     "root", IA, "spec.datasets"),
    ("too many annotations", req(good(annotations={f"k{i}": "v" for i in range(65)})), "root", IA,
     "spec.annotations"),
    # size limits of every repeated field and of the whole spec (README "Limits")
    ("65 allowed regions", req(good(allowed_regions=[f"cn-r{i}" for i in range(65)])), "root", IA,
     "spec.allowed_regions"),
    ("65 forbidden regions", req(good(forbidden_regions=[f"cn-r{i}" for i in range(65)])), "root", IA,
     "spec.forbidden_regions"),
    ("33 residency tags", req(good(residency_tags=[f"t{i}" for i in range(33)])), "root", IA, "spec.residency_tags"),
    ("33 card models", req(good(card_models=["T4"] * 33)), "root", IA, "spec.card_models"),
    ("job name of 64 characters", req(good(name="n" * 64)), "root", IA, "spec.name"),
    ("annotation key over 128 characters", req(good(annotations={"k" * 129: "v"})), "root", IA, "spec.annotations"),
    ("annotation value over 1024 characters", req(good(annotations={"k": "v" * 1025})), "root", IA,
     "spec.annotations[k]"),
    ("spec over 128 KiB", req(good(annotations={f"k{i}": "v" * 1024 for i in range(64)},
                                   datasets=[pb.Dataset(name=f"d{i:0250d}", home_region="cn-east-1")
                                             for i in range(64)],
                                   workload=wl(env={f"V{i}": "v" * 30000 for i in range(2)}))), "root", IA, "spec"),
    ("spec over 128 KiB as the bus carries it", req(good(annotations={f"k{i}": "\x01" * 1024 for i in range(64)})),
     "root", IA, "spec"),
    # the workload: image, argv, env, secret references, paths, sizes (fedsched/workload.py)
    ("workload without an image", req(good(workload=wl(image=""))), "root", IA, "spec.workload.image"),
    ("image with an uppercase path", req(good(workload=wl(image="Acme/Trainer"))), "root", IA, "spec.workload.image"),
    ("image with a shell command", req(good(workload=wl(image="ubuntu; rm -rf /"))), "root", IA,
     "spec.workload.image"),
    ("image reference too long", req(good(workload=wl(image="a" * 513))), "root", IA, "spec.workload.image"),
    ("image digest too short", req(good(workload=wl(image="python@sha256:abc"))), "root", IA, "spec.workload.image"),
    ("257 argv items", req(good(workload=wl(command=["python"], args=["x"] * 256))), "root", IA, "spec.workload.args"),
    ("command item over 4096 bytes", req(good(workload=wl(command=["python", "x" * 4097]))), "root", IA,
     "spec.workload.command[1]"),
    ("args item over 4096 bytes", req(good(workload=wl(args=["a", "b", "x" * 4097]))), "root", IA,
     "spec.workload.args[2]"),
    ("NUL in an argument", req(good(workload=wl(args=["a\x00b"]))), "root", IA, "spec.workload.args[0]"),
    ("129 environment variables", req(good(workload=wl(env={f"V{i}": "" for i in range(129)}))), "root", IA,
     "spec.workload.env"),
    ("env name starting with a digit", req(good(workload=wl(env={"1X": "v"}))), "root", IA, "spec.workload.env"),
    ("env name with '='", req(good(workload=wl(env={"A=B": "v"}))), "root", IA, "spec.workload.env"),
    ("env sets RANK", req(good(workload=wl(env={"RANK": "3"}))), "root", IA, "spec.workload.env[RANK]"),
    ("env sets MASTER_ADDR", req(good(workload=wl(env={"MASTER_ADDR": "evil"}))), "root", IA,
     "spec.workload.env[MASTER_ADDR]"),
    ("env sets a FEDSCHED_ variable", req(good(workload=wl(env={"FEDSCHED_ATTEMPT": "9"}))), "root", IA,
     "spec.workload.env[FEDSCHED_ATTEMPT]"),
    ("env value over 32 KiB", req(good(workload=wl(env={"BIG": "v" * (32 * 1024 + 1)}))), "root", IA,
     "spec.workload.env[BIG]"),
    ("secret env sets WORLD_SIZE", req(good(workload=wl(secret_env={"WORLD_SIZE": "s/k"}))), "root", IA,
     "spec.workload.secret_env[WORLD_SIZE]"),
    ("secret env given a value, not a reference", req(good(workload=wl(secret_env={"DB_PASSWORD": "hunter2"}))),
     "root", IA, "spec.workload.secret_env[DB_PASSWORD]"),
    ("secret reference with a space", req(good(workload=wl(secret_env={"T": "db creds/password"}))), "root", IA,
     "spec.workload.secret_env[T]"),
    ("variable both plain and secret", req(good(workload=wl(env={"T": "x"}, secret_env={"T": "db/pw"}))), "root", IA,
     "spec.workload.secret_env[T]"),
    ("relative working directory", req(good(workload=wl(workdir="work"))), "root", IA, "spec.workload.workdir"),
    ("checkpoint that is not a URI", req(good(workload=wl(checkpoint_uri="/ckpt"))), "root", IA,
     "spec.workload.checkpoint_uri"),
    ("workload over 64 KiB", req(good(workload=wl(env={f"V{i}": "v" * 30000 for i in range(3)}))), "root", IA,
     "spec.workload"),
    ("unknown field in the workload", raw_spec(good().SerializeToString() + b"\xe2\x01" + with_len(
        wl(image="busybox").SerializeToString() + b"\x40\x01")), "root", IA, "spec.workload.8"),
    ("request id too long", req(good(), request_id="r" * 129), "root", IA, "request_id"),
    ("request id not printable", req(good(), request_id="a\x00b"), "root", IA, "request_id"),
    ("missing spec", req(), "root", IA, "spec"),
    # wrong wire types and oversize
    ("truncated message", b"\x0a\x05ab", "root", IA, "request"),
    ("tenant not UTF-8", raw_spec(b"\x0a\x02\xff\xfe"), "root", IA, "request"),
    ("tenant sent as a number", raw_spec(b"\x08\x05"), "root", IA, "spec.1"),
    ("min gpu memory (field 12) sent as a string",
     raw_spec(good(min_gpu_memory_gib=0).SerializeToString() + b"\x62\x0280"), "root", IA, "spec.12"),
    ("unknown field in the spec", raw_spec(good().SerializeToString() + b"\xb8\x3e\x01"), "root", IA, "spec.999"),
    ("unknown field in the request", req(good()).SerializeToString() + b"\xa0\x06\x01", "root", IA, "100"),
    ("unknown field in a dataset", raw_spec(good().SerializeToString() + b"\x9a\x01" + with_len(
        pb.Dataset(name="d1", home_region="cn-east-1").SerializeToString() + b"\x20\x01")), "root", IA,
     "spec.datasets[0].4"),
    ("request larger than the server accepts", req(good(name="n" * (MAX_MESSAGE + 10))), "root", RE, None),
    # widening the tenant's policy
    ("global job of a tenant that forbids cross-region", req(good(tenant="recsys", locality=pb.LOCALITY_GLOBAL)),
     "root", IA, "spec.locality"),
    ("foreign region for a tenant that forbids cross-region",
     req(good(tenant="recsys", locality=pb.LOCALITY_MUST_LOCAL, allowed_regions=["cn-north-1"])), "root", IA,
     "spec.allowed_regions"),
    ("home region outside the tenant's regions", req(good(tenant="recsys", home_region="cn-north-1")), "root", IA,
     "spec.home_region"),
    ("finance job (forbidden class) asking prefer_local",
     req(good(tenant="ads", residency_tags=["finance"], locality=pb.LOCALITY_PREFER_LOCAL)), "root", IA,
     "spec.locality"),
    # quota, credentials
    ("gang that can never fit the tenant's quota", req(good(tenant="nlp", workers=3, gpus_per_worker=4)), "root",
     RE, "quota.nlp/*/*"),
    ("submitter of another tenant", req(good(tenant="ads")), "alice", PD, None),
    ("submitter of another project", req(good(project="serve")), "dave", PD, None),
    ("no token", req(good()), None, UA, None),
]


@pytest.mark.parametrize("name,request_,who,code,field", BAD, ids=[b[0] for b in BAD])
async def test_bad_submission_gets_its_exact_status_naming_the_field(shared_admission, name, request_, who, code,
                                                                     field):
    async with channel(shared_admission.port, who) as ch:
        if isinstance(request_, bytes):
            call = ch.unary_unary("/fedsched.api.v1.JobService/SubmitJob", request_serializer=None,
                                  response_deserializer=pb.SubmitJobResponse.FromString)
        else:
            call = pb_grpc.JobServiceStub(ch).SubmitJob
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(request_, timeout=10)
    assert e.value.code() == code, e.value.details()
    if field is not None:
        assert e.value.details().startswith(field + ":"), e.value.details()
        key = "fedsched-limit" if code == RE else "fedsched-field"
        assert dict(e.value.trailing_metadata()).get(key) == field


@pytest.mark.parametrize("tenant, who, hint", [
    ("s\u0435arch", "root", "(did you mean 'search'?)"),  # a Cyrillic е: the tenant that exists
    ("s\u0435arch", "dave", "(did you mean 'search'?)"),  # dave submits to search
    ("\u0430ds", "dave", None),  # ads exists, but dave may not see it: no suggestion
    ("s\u0435\u0430\u0433\u0441h", "root", None),  # nothing close exists
], ids=["root", "submitter-of-it", "tenant-not-visible", "nothing-close"])
async def test_an_invalid_tenant_name_suggests_only_a_tenant_the_caller_may_see(shared_admission, tenant, who, hint):
    async with channel(shared_admission.port, who) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(req(good(tenant=tenant)), timeout=10)
    details = e.value.details()
    assert e.value.code() == IA and details.startswith("spec.tenant:"), details
    assert (hint in details) if hint else ("did you mean" not in details), details


def test_the_bad_request_table_is_big_enough():
    assert len(BAD) >= 40 and len({b[0] for b in BAD}) == len(BAD)


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


#: A workload with every field set (the round trip checks that no field is left out of it).
FULL_WORKLOAD = dict(image="nvcr.io/nvidia/pytorch:24.05-py3", command=["torchrun", "train.py"],
                     args=["--lr", "0.1", "--note", "ünïcode and spaces"], env={"EPOCHS": "3", "EMPTY": ""},
                     secret_env={"HF_TOKEN": "hf-credentials/token"}, workdir="/workspace",
                     checkpoint_uri="s3://ckpt/run-1")


async def test_every_workload_field_round_trips_through_submit_and_get(stub):
    sent = pb.Workload(**FULL_WORKLOAD)
    assert {f.name for f, _ in sent.ListFields()} == set(pb.Workload.DESCRIPTOR.fields_by_name)
    resp = await stub.SubmitJob(req(good(workload=sent, checkpointable=True)))
    job = await stub.GetJob(pb.GetJobRequest(job_id=resp.job_id))
    assert job.spec.HasField("workload") and job.spec.workload == sent
    listed = await stub.ListJobs(pb.ListJobsRequest(tenant="search"))
    assert next(j for j in listed.jobs if j.job_id == resp.job_id).spec.workload == sent
    trace = await stub.SubmitJob(req(good()))  # a job without a workload has none
    assert not (await stub.GetJob(pb.GetJobRequest(job_id=trace.job_id))).spec.HasField("workload")


async def test_a_secret_is_named_by_reference_and_a_value_cannot_even_be_submitted(stub, bus):
    # secret_env is the only field that names a secret, and it holds references
    assert [f for f in pb.Workload.DESCRIPTOR.fields_by_name if "secret" in f] == ["secret_env"]
    resp = await stub.SubmitJob(req(good(workload=wl(secret_env={"HF_TOKEN": "hf-credentials/token"}))))
    job = await stub.GetJob(pb.GetJobRequest(job_id=resp.job_id))
    assert dict(job.spec.workload.secret_env) == {"HF_TOKEN": "hf-credentials/token"}
    values = ("hf_AbCdEf0123456789", "s3cr3t pass", "user:pa$$w0rd@db", "KEY=abc/def", "ghp_x/../../etc")
    for value in values:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(req(good(workload=wl(secret_env={"HF_TOKEN": value}))))
        assert e.value.code() == IA and e.value.details().startswith("spec.workload.secret_env[HF_TOKEN]:")
        assert value not in e.value.details()
    # neither the accepted job's event nor the rejections' audit events carry any of them
    sub = await bus.js.pull_subscribe(f"{bus.prefix}.>", stream=bus.stream_name("EVENTS"))
    events = [m.data for m in await sub.fetch(100, timeout=5)]
    rejected = [e for e in events if b"spec.workload.secret_env[HF_TOKEN]" in e]
    assert len(rejected) == len(values) and any(b"hf-credentials/token" in e for e in events)
    assert not any(v.encode() in e for v in values for e in events)


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


async def test_health_and_reflection_are_served_without_a_token(admission):
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
        assert {"fedsched.api.v1.JobService", "fedsched.api.v1.TenantService", "fedsched.api.v1.ApprovalService",
                "fedsched.api.v1.PolicyService", "grpc.health.v1.Health"} <= names


async def test_rejections_are_published_for_the_audit_trail(stub, bus):
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.SubmitJob(pb.SubmitJobRequest(spec=good(workers=0)))
    info = await bus.js.stream_info(bus.stream_name("EVENTS"), subjects_filter=f"{bus.prefix}.admission.>")
    assert info.state.messages == 1


async def test_accepted_job_records_the_submitter_and_the_policy_version(admission, bus):
    async with channel(admission.port, "alice") as ch:
        resp = await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=good()))
        job = await pb_grpc.JobServiceStub(ch).GetJob(pb.GetJobRequest(job_id=resp.job_id))
    assert job.submitted_by == "alice"
    rec = admission.view.jobs[resp.job_id]
    assert rec.spec.locality.value == "global"  # the tenant's default
    sub = await bus.js.pull_subscribe(bus.subjects.job("submitted", "search", "train"), stream=bus.stream_name("EVENTS"))
    from fedsched.events import Envelope
    env = Envelope.from_bytes((await sub.fetch(1, timeout=5))[0].data)
    assert env.actor == "alice" and env.policy_version == admission.policy.version != ""


async def test_a_forbidden_tenants_job_defaults_to_must_local(admission):
    async with channel(admission.port, "carol") as ch:
        resp = await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=good(tenant="recsys")))
    spec = admission.view.jobs[resp.job_id].spec
    assert spec.locality.value == "must_local" and spec.allowed_regions == ("cn-east-1",)


async def test_tokens_never_reach_the_log(admission, caplog):
    caplog.set_level("DEBUG")
    async with channel(admission.port, "alice") as ch:
        await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=good()))
        with pytest.raises(grpc.aio.AioRpcError):
            await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=good(tenant="ads")))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admission.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).GetJob(pb.GetJobRequest(job_id="j-x"),
                                                    metadata=(("authorization", "Bearer tok-guess-123"),))
    assert e.value.code() == UA and "tok-guess-123" not in e.value.details()
    text = caplog.text
    assert all(token not in text for token in TOKENS.values()) and "tok-guess-123" not in text


def _raw_call(ch, method: str, response):
    return ch.unary_unary(method, request_serializer=None, response_deserializer=response.FromString)


async def test_mutating_calls_refuse_unknown_fields_and_read_only_calls_ignore_them(admission, bus):
    from fedsched.api.v1 import governance_pb2 as gpb
    from fedsched.policystore import read_policy

    before = (await read_policy(bus)).version
    spec = good(min_gpu_memory_gib=0).SerializeToString() + b"\x62\x0280"  # field 12 as the string "80"
    quota = gpb.SetQuotaRequest(quota=gpb.Quota(tenant="search", card="T4", guaranteed_gpus=2)).SerializeToString()
    refused = [  # (method, request bytes, response type, field named)
        ("/fedsched.api.v1.JobService/SubmitJob", raw_spec(spec), pb.SubmitJobResponse, "spec.12"),
        ("/fedsched.api.v1.TenantService/SetQuota", quota + b"\xa0\x06\x01", gpb.SetQuotaResponse, "100"),
        # Quota field 4 (guaranteed_gpus, a double) sent as a varint: parsed, the quota would read 0 GPUs
        ("/fedsched.api.v1.TenantService/SetQuota",
         b"\x0a" + with_len(gpb.Quota(tenant="search", card="T4").SerializeToString() + b"\x20\x02"),
         gpb.SetQuotaResponse, "quota.4"),
        ("/fedsched.api.v1.TenantService/PutTenant",
         b"\x0a" + with_len(gpb.Tenant(name="search", projects=["train"]).SerializeToString() + b"\xf8\x01\x07"),
         gpb.PutTenantResponse, "tenant.31"),
        ("/fedsched.api.v1.JobService/CancelJob",
         pb.CancelJobRequest(job_id="j-" + "0" * 20).SerializeToString() + b"\xfa\x01\x01x", pb.CancelJobResponse,
         "31"),
    ]
    async with channel(admission.port, "root") as ch:
        for method, body, response, field in refused:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _raw_call(ch, method, response)(body, timeout=10)
            assert e.value.code() == IA, (method, e.value.details())
            assert e.value.details().startswith(field + ":"), e.value.details()
            assert dict(e.value.trailing_metadata()).get("fedsched-field") == field
        # read-only: the unknown field is ignored and the call answers
        listed = await _raw_call(ch, "/fedsched.api.v1.TenantService/ListQuotas", gpb.ListQuotasResponse)(
            gpb.ListQuotasRequest(tenant="nlp").SerializeToString() + b"\xa0\x06\x01", timeout=10)
        jobs = await _raw_call(ch, "/fedsched.api.v1.JobService/ListJobs", pb.ListJobsResponse)(
            b"\xa0\x06\x01", timeout=10)
    assert [q.tenant for q in listed.quotas] == ["nlp"] and jobs.total == 0
    assert not admission.view.jobs  # nothing was submitted
    assert (await read_policy(bus)).version == before  # nothing was changed


async def _cli(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI in a child process (the servers run on this test's event loop, so never block it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSCHED_TOKEN", "FEDSCHED_DATA_DIR")}
    env["COLUMNS"] = "250"  # wide enough that rich does not wrap the table's cells
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fedapp.cli", *args], capture_output=True,
                                   text=True, timeout=60, env=env)


def _table_row(text: str, key: str) -> dict[str, str]:
    """The first row of a rich table (as the CLI prints it) containing ``key``, by column header."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    row = next(line for line in lines if line.startswith("│") and key in line)
    return dict(zip((c.strip() for c in header.strip("┃").split("┃")), (c.strip() for c in row.strip("│").split("│"))))


async def test_a_queued_job_cancelled_ends_at_the_cancel_with_its_reason_in_job_and_jobs(admission, bus):
    """Issue 13 item 8: ended_at = the time of the scheduler's job.cancelled (not the submit time),
    and the cancel's actor and reason replace the pending reason in GetJob, `job` and `jobs`."""
    # a T4 node that is down: the job could run on this cluster some day (admission accepts it),
    # but the scheduler cannot place it now, so it stays queued with a reason
    down_t4 = NodeInventory(name="n0", card_model="nvidia-t4-16gb", gpus=8, gpu_memory_gib=16,
                            gpu_free_milli=(1000,) * 8, cpu_milli=64000, cpu_free_milli=64000, memory_mib=262144,
                            memory_free_mib=262144, healthy=False)
    await bus.publish(bus.subjects.inventory("cn-north-1", "cn-north-1-c1"),
                      make_event(EventType.INVENTORY_SNAPSHOT, InventorySnapshot(nodes=(down_t4,)), producer="test",
                                 occurred_at=time.time(), region="cn-north-1", zone="cn-north-1a",
                                 cluster="cn-north-1-c1"))
    scheduler = SchedulerService(bus, SystemClock(), build_policy(), load_price_catalog(), interval_s=0.01)
    task = asyncio.create_task(scheduler.run())
    try:
        async with channel(admission.port, "alice") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            job_id = (await stub.SubmitJob(pb.SubmitJobRequest(spec=good()))).job_id  # its node is down: stays queued
            deadline = asyncio.get_running_loop().time() + 10
            while not (job := await stub.GetJob(pb.GetJobRequest(job_id=job_id))).reason:
                assert asyncio.get_running_loop().time() < deadline, "the scheduler never gave a pending reason"
                await asyncio.sleep(0.02)
            assert job.state == pb.JOB_STATE_QUEUED and "cancel" not in job.reason
            await stub.CancelJob(pb.CancelJobRequest(job_id=job_id, reason="wrong dataset"))
            while (job := await stub.GetJob(pb.GetJobRequest(job_id=job_id))).state != pb.JOB_STATE_CANCELLED:
                assert asyncio.get_running_loop().time() < deadline, f"not cancelled: {job.reason}"
                await asyncio.sleep(0.02)
        sub = await bus.js.pull_subscribe(bus.subjects.decisions("search", "train"), stream=bus.stream_name("EVENTS"))
        cancelled = [e for e in (Envelope.from_bytes(m.data) for m in await sub.fetch(50, timeout=5))
                     if e.type == "job.cancelled" and e.job_id == job_id]
        assert len(cancelled) == 1
        assert job.ended_at.ToDatetime(tzinfo=UTC) == cancelled[0].occurred_at
        assert job.ended_at.ToDatetime() > job.submitted_at.ToDatetime()
        assert job.reason == "cancelled by alice: wrong dataset"
        ended = job.ended_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
        server = ("--server", f"127.0.0.1:{admission.port}", "--token", TOKENS["alice"])
        one, listed = await asyncio.gather(_cli("job", job_id, *server), _cli("jobs", "--tenant", "search", *server))
        for out in (one, listed):
            assert out.returncode == 0, out.stderr
            row = _table_row(out.stdout, job_id)
            assert (row["state"], row["ended UTC"], row["reason"]) == ("cancelled", ended, "cancelled by alice: wrong dataset")
    finally:
        scheduler.stop()
        await task


async def test_submit_sets_the_workload_from_flags_and_job_shows_it_with_secrets_by_reference(admission):
    server = ("--server", f"127.0.0.1:{admission.port}", "--token", TOKENS["alice"])
    base = ("submit", "--tenant", "search", "--project", "train", "-o", "json", *server)
    full, tail_only, reserved, malformed = await asyncio.gather(
        _cli(*base, "--image", "ghcr.io/acme/trainer:1.4", "--command", "python", "--command", "train.py",
             "--env", "EPOCHS=3", "--env", "NOTE=a=b c", "--secret-env", "HF_TOKEN=hf-credentials/token",
             "--workdir", "/workspace", "--checkpoint", "s3://ckpt/run-1", "--", "--lr", "0.1"),
        _cli(*base, "--image", "busybox", "--", "sh", "-c", "echo $RANK"),
        _cli(*base, "--image", "busybox", "--env", "RANK=3"),
        _cli(*base, "--image", "busybox", "--env", "NOEQUALS"))
    assert full.returncode == 0 and tail_only.returncode == 0, full.stderr + tail_only.stderr
    assert reserved.returncode == 1 and "INVALID_ARGUMENT" in reserved.stderr
    assert "spec.workload.env[RANK]" in reserved.stderr
    assert malformed.returncode == 2 and "--env" in malformed.stderr
    async with channel(admission.port, "alice") as ch:
        stub = pb_grpc.JobServiceStub(ch)
        one = await stub.GetJob(pb.GetJobRequest(job_id=json.loads(full.stdout)["job_id"]))
        two = await stub.GetJob(pb.GetJobRequest(job_id=json.loads(tail_only.stdout)["job_id"]))
    assert one.spec.workload == pb.Workload(
        image="ghcr.io/acme/trainer:1.4", command=["python", "train.py"], args=["--lr", "0.1"],
        env={"EPOCHS": "3", "NOTE": "a=b c"}, secret_env={"HF_TOKEN": "hf-credentials/token"},
        workdir="/workspace", checkpoint_uri="s3://ckpt/run-1")
    assert two.spec.workload == pb.Workload(image="busybox", command=["sh", "-c", "echo $RANK"])
    shown = await _cli("job", one.job_id, *server)
    assert shown.returncode == 0, shown.stderr
    for text in ("ghcr.io/acme/trainer:1.4", '["python", "train.py", "--lr", "0.1"]', "EPOCHS", "/workspace",
                 "secret hf-credentials/token", "s3://ckpt/run-1"):
        assert text in shown.stdout, (text, shown.stdout)
    no_image = await _cli(*base, "--env", "A=1")
    assert no_image.returncode == 2 and "--image" in no_image.stderr


class _LostFirstAck:
    """The real bus whose first acknowledgement of each publish is lost: the event is stored,
    then the same publish is sent again (as :meth:`fedsched.bus.Bus.publish` retries after a
    timeout, same message id) and JetStream answers with its duplicate acknowledgement."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.acks: list = []

    async def publish(self, subject, event, *, headers=None):
        await self.bus.publish(subject, event, headers=headers)  # stored; its ack "timed out"
        ack = await self.bus.publish(subject, event, headers=headers)
        self.acks.append(ack)
        return ack

    async def publish_many(self, items):
        return await self.bus.publish_many(items)


async def test_a_submission_whose_ack_was_lost_is_answered_accepted_and_its_retry_is_the_same_job(admission, stub,
                                                                                                  bus):
    """Issue 15 follow-up: a slow ack made the bus retry; JetStream's duplicate ack then made
    admission answer as if another call had made the job (UNAVAILABLE while its view lagged,
    else ``duplicate``), so the client never saw its job accepted."""
    admission.servicer.publisher = _LostFirstAck(bus)
    req = pb.SubmitJobRequest(spec=good(), request_id="slow-ack-1")
    first = await stub.SubmitJob(req)
    assert admission.servicer.publisher.acks[0].duplicate  # the path under test was taken
    assert (first.state, first.duplicate) == (pb.JOB_STATE_QUEUED, False)
    again = await stub.SubmitJob(req)
    assert (again.job_id, again.duplicate) == (first.job_id, True)
    sub = await bus.js.pull_subscribe(f"{bus.prefix}.jobs.submitted.>", stream=bus.stream_name("EVENTS"))
    stored = [Envelope.from_bytes(m.data) for m in await sub.fetch(10, timeout=2)]
    assert [e.job_id for e in stored] == [first.job_id]
