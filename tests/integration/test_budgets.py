"""Budgets on real NATS: month-to-date spend from billing's KV bucket (preferred) or from
``usage.recorded`` events (fallback); exhaustion and a job's worst case (retries included)
are RESOURCE_EXHAUSTED naming the budget."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import SystemClock
from fedsched.events import UsageRecorded, make_event
from fedsched.pricing import load_price_catalog
from services.admission.budgets import month_of
from services.admission.service import AdmissionService
from tests.builders import TENANTS, channel, policy_doc, store_policy, until

BUDGET_TENANTS = TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                                 "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                                 "budget: {monthly: \"1000\", currency: CNY}}")


@pytest.fixture
async def admission(bus):
    await store_policy(bus, policy_doc(tenants=BUDGET_TENANTS))
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0", spend_poll_s=0.05)
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    yield svc
    svc.stop()
    await task


def _job(**kw) -> pb.SubmitJobRequest:
    kw.setdefault("estimated_duration_seconds", 60)  # a budget needs an estimate to bound the cost
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant="vision", project="serve", gpus_per_worker=1, cpu_milli=1000,
                                               card_models=["T4"], **kw))


async def _submit(port, request) -> grpc.StatusCode:
    async with channel(port, "carol") as ch:
        try:
            await pb_grpc.JobServiceStub(ch).SubmitJob(request, timeout=10)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert e.details().startswith("budget.vision:")
                assert dict(e.trailing_metadata()).get("fedsched-limit") == "budget.vision"
            return e.code()


async def _usage(bus, cost: str, at: float) -> None:
    event = make_event("usage.recorded", UsageRecorded(gpu_seconds=3600.0, cost=cost), producer="billing",
                       occurred_at=at, tenant="vision", project="serve", job_id="j-x", actor="billing")
    await bus.publish(bus.subjects.usage("vision"), event)



async def test_spend_from_billing_kv_exhausts_the_budget(admission, bus):
    month = month_of(time.time())
    kv = await bus.key_value("spend")  # what billing creates and updates after each usage insert
    await kv.put(f"vision.{month}", b"999.50")
    assert await until(lambda: admission.spend.spend("vision", month) == 999.5)
    assert await _submit(admission.port, _job()) == grpc.StatusCode.OK
    await kv.put(f"vision.{month}", b"1000.000000")
    assert await until(lambda: admission.spend.spend("vision", month) == 1000)
    assert await _submit(admission.port, _job()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await _submit(admission.port, _job(retry_limit=0)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # other tenants are not affected
    async with channel(admission.port, "carol") as ch:
        await pb_grpc.JobServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(
            tenant="nlp", project="train", gpus_per_worker=1, cpu_milli=1000, card_models=["T4"])))


async def test_without_a_kv_figure_spend_is_summed_from_usage_events(admission, bus):
    now = time.time()
    last_month = datetime(2020, 1, 15, tzinfo=UTC).timestamp()
    await _usage(bus, "5000", last_month)  # another month: does not count
    await _usage(bus, "600.25", now)
    assert await until(lambda: admission.spend.from_events.get(("vision", month_of(now))) is not None)
    assert await _submit(admission.port, _job()) == grpc.StatusCode.OK
    await _usage(bus, "399.75", now)
    assert await until(lambda: admission.spend.spend("vision", month_of(now)) == 1000)
    assert admission.spend.source("vision", month_of(now)) == "events"
    assert await _submit(admission.port, _job()) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_kv_figure_takes_precedence_over_events(admission, bus):
    now = time.time()
    await _usage(bus, "5000", now)
    assert await until(lambda: admission.spend.spend("vision", month_of(now)) == 5000)
    kv = await bus.key_value("spend")
    await kv.put(f"vision.{month_of(now)}", b"12.5")
    assert await until(lambda: admission.spend.source("vision", month_of(now)) == "kv")
    assert await _submit(admission.port, _job()) == grpc.StatusCode.OK


async def test_a_jobs_retry_budget_counts_against_the_tenants_budget(admission):
    # 1 T4 x 100 h x (1 + 3 retries) at the highest T4 list price is far beyond 1000 CNY
    heavy = _job(estimated_duration_seconds=100 * 3600, retry_limit=3)
    async with channel(admission.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(heavy)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 attempt(s)" in e.value.details() and "retries included" in e.value.details()
    assert await _submit(admission.port, _job(estimated_duration_seconds=10 * 3600)) == grpc.StatusCode.OK


async def test_a_budget_needs_an_estimate_and_open_jobs_hold_their_worst_case(admission):
    """Without a runtime estimate the cost has no bound: refused, naming the field. Jobs queued
    or running are not billed yet, so their worst case is held against the budget."""
    async with channel(admission.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(_job(estimated_duration_seconds=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("spec.estimated_duration_seconds")
    price = max(load_price_catalog().gpu_hour(r, "nvidia-t4-16gb") for r in ("cn-north-1", "cn-east-1", "cn-south-1"))
    hours = 600 / float(price)  # each job's worst case: 600 of the 1000 CNY
    assert await _submit(admission.port, _job(estimated_duration_seconds=hours * 3600)) == grpc.StatusCode.OK
    async with channel(admission.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(_job(estimated_duration_seconds=hours * 3600))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "held by its open jobs" in e.value.details()
