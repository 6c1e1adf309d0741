"""Fuzzing admission over real gRPC and NATS: no request -- random job specs, random request
ids, random raw bytes, random credentials -- crashes the server or gets UNKNOWN / INTERNAL."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Bus
from fedsched.clock import SystemClock
from fedapp.client import aio_channel
from services.admission.service import AdmissionService
from tests.builders import TOKENS, channel, policy_doc, store_policy, unique

BAD_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
U32, U64 = 2**32 - 1, 2**64 - 1

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
names = st.one_of(st.sampled_from(["search", "ads", "nlp", "vision", "recsys", "Search", "", "-x", "a" * 40]), text)
regions = st.one_of(st.sampled_from(["cn-north-1", "cn-east-1", "cn-south-1", "us-west-9", "CN", ""]), text)
cards = st.one_of(st.sampled_from(["T4", "A100", "V100M32", "G2", "nvidia-a100-80gb", "", "Quantum-9"]), text)
floats = st.floats(allow_nan=True, allow_infinity=True)

images = st.one_of(st.sampled_from(["busybox", "ghcr.io/acme/t:1", "Ubuntu", "", "python@sha256:abc"]), text)
env_names = st.one_of(st.sampled_from(["RANK", "FEDSCHED_JOB_ID", "EPOCHS", "1X", "", "A=B"]), text)
workloads = st.one_of(st.none(), st.builds(
    pb.Workload, image=images, command=st.lists(text, max_size=4), args=st.lists(text, max_size=4),
    env=st.dictionaries(env_names, text, max_size=4),
    secret_env=st.dictionaries(env_names, st.one_of(st.sampled_from(["db/pw", "Db/pw", "hunter2"]), text), max_size=3),
    workdir=st.one_of(st.just("/w"), text), checkpoint_uri=st.one_of(st.just("s3://b/c"), text)))

specs = st.builds(
    pb.JobSpec,
    tenant=names, project=st.one_of(st.sampled_from(["train", "serve", "batch", ""]), text), name=text,
    kind=st.integers(0, 9), priority=st.integers(0, 9), workers=st.integers(0, U32),
    gpus_per_worker=st.integers(0, U32), gpu_milli=st.integers(0, U32), cpu_milli=st.integers(0, U64),
    memory_mib=st.integers(0, U64), card_models=st.lists(cards, max_size=4), min_gpu_memory_gib=st.integers(0, U32),
    requires_rdma=st.booleans(), home_region=regions, locality=st.integers(0, 6),
    allowed_regions=st.lists(regions, max_size=3), forbidden_regions=st.lists(regions, max_size=3),
    residency_tags=st.lists(text, max_size=3),
    datasets=st.lists(st.builds(pb.Dataset, name=text, home_region=regions, size_bytes=st.integers(0, U64)),
                      max_size=3),
    max_price_per_gpu_hour=floats, preemptible=st.booleans(), checkpointable=st.booleans(),
    estimated_duration_seconds=floats, retry_limit=st.integers(0, U32), shards=st.integers(0, U32),
    annotations=st.dictionaries(text, text, max_size=4), workload=workloads,
)
requests = st.builds(pb.SubmitJobRequest, spec=specs, request_id=st.one_of(st.just(""), text))
callers = st.sampled_from(["root", "alice", "carol", "bob", "agent1", None, "bogus"])


@pytest.fixture(scope="module")
async def fuzz_target(nats_server):
    bus = await Bus.connect(nats_server.url, unique("t"), name="test-fuzz")
    await bus.ensure_streams()
    await store_policy(bus, policy_doc("quotas: [{tenant: nlp, guaranteed_gpus: 8}]\n"))
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", max_message_bytes=64 * 1024)
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    channels = {who: (aio_channel(f"127.0.0.1:{svc.port}", "tok-bogus") if who == "bogus"
                      else channel(svc.port, who)) for who in ["root", "alice", "carol", "bob", "agent1", None, "bogus"]}
    yield svc, channels
    for ch in channels.values():
        await ch.close()
    svc.stop()
    await task
    await bus.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=requests, who=callers)
async def test_no_job_spec_crashes_admission_or_returns_unknown_or_internal(fuzz_target, request, who):
    svc, channels = fuzz_target
    try:
        await pb_grpc.JobServiceStub(channels[who]).SubmitJob(request, timeout=10)
    except grpc.aio.AioRpcError as e:
        assert e.code() not in BAD_CODES, (e.code(), e.details(), request)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300), method=st.sampled_from(["SubmitJob", "GetJob", "ListJobs", "CancelJob"]),
       who=callers)
async def test_no_byte_string_crashes_admission_or_returns_unknown_or_internal(fuzz_target, body, method, who):
    svc, channels = fuzz_target
    call = channels[who].unary_unary(f"/fedsched.api.v1.JobService/{method}", request_serializer=None,
                                     response_deserializer=None)
    try:
        await call(body, timeout=10)
    except grpc.aio.AioRpcError as e:
        assert e.code() not in BAD_CODES, (e.code(), e.details(), body)


async def test_admission_still_serves_after_the_fuzzing(fuzz_target):
    svc, channels = fuzz_target
    spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000, card_models=["T4"])
    resp = await pb_grpc.JobServiceStub(channels["root"]).SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=10)
    assert resp.job_id.startswith("j-") and TOKENS["root"]
