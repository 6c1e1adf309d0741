"""SubmitJobs, dry runs and the submit's trace id over real gRPC and real NATS (issue 15 item 4,
issue 16 items 1 and 8): per-item results with SubmitJob's validation, governance and
idempotency; a dry run that queues nothing, holds nothing, publishes no job event and asks the
scheduler for its what-if (and still answers when no scheduler does)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.events import Envelope, EventType, InventorySnapshot, make_event
from fedsched.pricing import load_price_catalog
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import TENANTS, channel, nodes, policy_doc, running_admission, until

QUOTAS = """
quotas:
  - {tenant: nlp, card: "*", region: "*", guaranteed_gpus: 8}
"""
BUDGET = TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                         "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                         "budget: {monthly: \"100\", currency: CNY}}")
OK, IA, RE, AE, PD = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED)


@pytest.fixture
async def admission(bus):
    async with running_admission(bus, policy_doc(QUOTAS, tenants=BUDGET), spend_poll_s=0.05,
                                 what_if_timeout_s=0.5) as svc:
        yield svc


def _spec(**kw) -> pb.JobSpec:
    kw.setdefault("tenant", "search")
    kw.setdefault("project", "train")
    kw.setdefault("card_models", ["T4"])
    return pb.JobSpec(gpus_per_worker=kw.pop("gpus", 1), cpu_milli=1000, **kw)


def _vision(**kw) -> pb.JobSpec:  # 1 GPU x 1 h x 4.5 CNY/GPU-h: 22 fit the 100 CNY budget
    return _spec(tenant="vision", project="serve", estimated_duration_seconds=3600, max_price_per_gpu_hour=4.5, **kw)


def _codes(resp: pb.SubmitJobsResponse) -> list[grpc.StatusCode]:
    return [next(c for c in grpc.StatusCode if c.value[0] == r.code) for r in resp.results]


async def _events(bus) -> list[Envelope]:
    info = await bus.js.stream_info(bus.stream_name("EVENTS"))
    if not info.state.messages:
        return []
    sub = await bus.js.pull_subscribe(f"{bus.prefix}.>", stream=bus.stream_name("EVENTS"))
    msgs = await sub.fetch(info.state.messages, timeout=5)
    await sub.unsubscribe()
    return [Envelope.from_bytes(m.data) for m in msgs]


async def test_a_batch_gets_per_item_codes_and_the_same_request_ids_again_are_duplicates(admission, bus):
    items = [pb.SubmitJobRequest(spec=_spec(name="good"), request_id="r-good"),
             pb.SubmitJobRequest(spec=_spec(workers=0), request_id="r-bad"),            # invalid
             pb.SubmitJobRequest(spec=_spec(name="good"), request_id="r-good"),         # same key, same spec
             pb.SubmitJobRequest(spec=_spec(name="other"), request_id="r-good"),        # same key, other spec
             pb.SubmitJobRequest(spec=_spec(tenant="nlp", workers=3, gpus=4), request_id="r-quota"),  # never fits
             pb.SubmitJobRequest(spec=_spec(tenant="ads"), request_id="r-denied")]      # dave: search/train only
    items += [pb.SubmitJobRequest(spec=_vision(), request_id=f"r-v{i}") for i in range(25)]  # 22 fit the budget
    async with channel(admission.port, "root") as ch:
        resp = await pb_grpc.JobServiceStub(ch).SubmitJobs(pb.SubmitJobsRequest(items=items), timeout=60)
    codes = _codes(resp)
    assert codes[:5] == [OK, IA, OK, AE, RE]
    assert codes[5] == OK  # root may submit anywhere
    assert codes[6:] == [OK] * 22 + [RE] * 3
    first, invalid, dup, other, quota = resp.results[:5]
    assert invalid.message.startswith("spec.workers:") and quota.message.startswith("quota.nlp")
    assert not first.response.duplicate and dup.response.duplicate and dup.response.job_id == first.response.job_id
    assert all(r.message.startswith("budget.vision:") for r in resp.results[-3:])
    assert admission.servicer._holds == {}  # every hold handed to the view or released
    accepted = {r.response.job_id for r in resp.results if not r.code}
    assert accepted <= set(admission.view.jobs) and len(accepted) == 24  # first/dup one job, ads, 22 vision
    trace = {r.response.trace_id for r in resp.results if not r.code}
    assert len(trace) == 1 and len(trace.pop()) == 32

    async with channel(admission.port, "root") as ch:
        again = await pb_grpc.JobServiceStub(ch).SubmitJobs(pb.SubmitJobsRequest(items=items), timeout=60)
    for before, after in zip(resp.results, again.results):
        if not before.code:  # every accepted key answers with its job, marked duplicate
            assert after.code == 0 and after.response.duplicate and after.response.job_id == before.response.job_id
    events = await _events(bus)
    submitted = [e for e in events if e.type == EventType.JOB_SUBMITTED]
    assert len(submitted) == 24  # one event per job, none for the repeats
    rejected = [e for e in events if e.type == EventType.SUBMISSION_REJECTED]
    assert len(rejected) >= 5  # invalid, other spec, quota, 3 over budget (the first call)


async def test_a_batch_of_more_than_1000_items_is_refused_naming_items(admission):
    async with channel(admission.port, "root") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJobs(
                pb.SubmitJobsRequest(items=[pb.SubmitJobRequest(spec=_spec())] * 1001), timeout=30)
    assert e.value.code() == IA and e.value.details().startswith("items:")
    assert not admission.view.jobs


async def test_a_submitter_outside_its_rights_gets_a_per_item_denial(admission):
    async with channel(admission.port, "dave") as ch:
        resp = await pb_grpc.JobServiceStub(ch).SubmitJobs(pb.SubmitJobsRequest(items=[
            pb.SubmitJobRequest(spec=_spec()), pb.SubmitJobRequest(spec=_spec(project="serve"))]), timeout=30)
    assert _codes(resp) == [OK, PD]


async def test_submit_returns_its_trace_id_in_the_response_and_the_metadata_and_events_carry_it(admission, bus):
    async with channel(admission.port, "root") as ch:
        call = pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=_spec()), timeout=30)
        resp = await call
        metadata = dict(await call.trailing_metadata())  # sent with the response (no write of its own)
    assert len(resp.trace_id) == 32 and metadata["x-trace-id"] == resp.trace_id
    sub = await bus.js.pull_subscribe(bus.subjects.job("submitted", "search", "train"),
                                      stream=bus.stream_name("EVENTS"))
    msg = (await sub.fetch(1, timeout=5))[0]
    assert msg.headers["traceparent"].split("-")[1] == resp.trace_id


async def test_a_dry_run_without_a_scheduler_gives_the_verdict_and_no_what_if_and_changes_nothing(admission, bus):
    async with channel(admission.port, "root") as ch:
        stub = pb_grpc.JobServiceStub(ch)
        ok = await stub.SubmitJob(pb.SubmitJobRequest(spec=_vision(), dry_run=True), timeout=30)
        bad = await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(workers=0), dry_run=True), timeout=30)
        many = [await stub.SubmitJob(pb.SubmitJobRequest(spec=_vision(), dry_run=True), timeout=30)
                for _ in range(25)]  # 25 x 4.5 CNY: a dry run holds no budget, so all would be accepted
        t0 = time.monotonic()
        batch = await stub.SubmitJobs(pb.SubmitJobsRequest(items=[pb.SubmitJobRequest(spec=_vision(), dry_run=True)]
                                                           * 20), timeout=30)
        waited = time.monotonic() - t0
    assert [r.response.verdict for r in batch.results] == ["accepted"] * 20
    assert waited < 20 * 0.5  # only the first item waits for the scheduler that does not answer
    assert ok.verdict == "accepted" and not ok.job_id and not ok.HasField("what_if") and len(ok.trace_id) == 32
    assert bad.verdict.startswith("INVALID_ARGUMENT: spec.workers:")
    assert {r.verdict for r in many} == {"accepted"}
    assert not admission.view.jobs and admission.servicer._holds == {}
    assert await _events(bus) == []  # no job event, no rejection recorded


async def test_a_dry_run_with_a_scheduler_gets_its_what_if_and_the_scheduler_is_unchanged(admission, bus):
    await bus.publish(bus.subjects.inventory("cn-north-1", "cn-north-1-c1"),
                      make_event(EventType.INVENTORY_SNAPSHOT, InventorySnapshot(nodes=nodes("n", gpus=8)),
                                 producer="test", occurred_at=time.time(), region="cn-north-1", zone="cn-north-1a",
                                 cluster="cn-north-1-c1"))
    await bus.publish(bus.subjects.inventory("cn-east-1", "cn-east-1-c1"),
                      make_event(EventType.INVENTORY_SNAPSHOT, InventorySnapshot(nodes=nodes("e", gpus=16)),
                                 producer="test", occurred_at=time.time(), region="cn-east-1", zone="cn-east-1a",
                                 cluster="cn-east-1-c1"))
    scheduler = SchedulerService(bus, SystemClock(), build_policy(), load_price_catalog(), interval_s=0.01,
                                 stale_after_s=3600)
    task = asyncio.create_task(scheduler.run())
    try:
        assert await until(lambda: {"cn-north-1-c1", "cn-east-1-c1"} <= set(scheduler.clusters))
        assert await until(lambda: "cn-east-1-c1" in admission.clusters)
        before = (dict(scheduler.counts), len(scheduler.jobs), scheduler.applied_seq)
        async with channel(admission.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            fits = await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(gpus=2), dry_run=True), timeout=30)
            never = await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(gpus=16, workers=3), dry_run=True),
                                         timeout=30)  # admission knows no cluster could ever hold it
            waits = await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(max_price_per_gpu_hour=0.01), dry_run=True),
                                         timeout=30)  # its price ceiling is below every cluster's price
            batch = await stub.SubmitJobs(pb.SubmitJobsRequest(items=[
                pb.SubmitJobRequest(spec=_spec(), dry_run=True)]), timeout=30)
            abroad = await stub.SubmitJob(pb.SubmitJobRequest(spec=_spec(tenant="ads", gpus=16), dry_run=True),
                                          timeout=30)  # only cn-east-1 holds 16 cards; ads needs an approver there
        assert fits.verdict == "accepted" and fits.what_if.decisions[0].outcome == "placed"
        assert fits.what_if.decisions[0].cluster == "cn-north-1-c1"
        assert sorted(c.cluster for c in fits.what_if.decisions[0].clusters) == ["cn-east-1-c1", "cn-north-1-c1"]
        assert abroad.verdict == "awaiting_approval" and abroad.state == pb.JOB_STATE_AWAITING_APPROVAL
        assert abroad.what_if.decisions[0].cluster == "cn-east-1-c1"
        north = next(c for c in fits.what_if.decisions[0].clusters if c.cluster == "cn-north-1-c1")
        assert north.passed and north.HasField("total")
        assert never.verdict.startswith("FAILED_PRECONDITION:") and not never.HasField("what_if")
        assert waits.verdict == "accepted" and waits.what_if.decisions[0].outcome == "pending"
        assert all(not c.passed and c.reason for c in waits.what_if.decisions[0].clusters)
        assert batch.results[0].response.what_if.decisions[0].outcome == "placed"
        assert (dict(scheduler.counts), len(scheduler.jobs), scheduler.applied_seq) == before
        assert not admission.view.jobs
    finally:
        scheduler.stop()
        await task


async def test_a_refused_submit_has_its_trace_id_and_the_field_in_the_trailing_metadata(admission):
    async with channel(admission.port, "root") as ch:
        call = pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=_spec(project="nope")), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
    trailing = dict(e.value.trailing_metadata())
    assert e.value.code() == IA and trailing["fedsched-field"] == "spec.project"
    assert len(trailing["x-trace-id"]) == 32
