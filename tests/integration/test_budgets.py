"""Budgets on real NATS: month-to-date spend from billing's KV bucket (preferred) or from
``usage.recorded`` events (fallback); exhaustion and a job's worst case (retries included)
are RESOURCE_EXHAUSTED naming the budget."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.events import UsageRecorded, make_event
from fedsched.pricing import load_price_catalog
from services.admission.budgets import month_of
from tests.builders import TENANTS, channel, policy_doc, running_admission, submit_at_once, until

BUDGET_TENANTS = TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                                 "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                                 "budget: {monthly: \"1000\", currency: CNY}}")


@pytest.fixture
async def admission(bus):
    async with running_admission(bus, policy_doc(tenants=BUDGET_TENANTS), spend_poll_s=0.05) as svc:
        yield svc


def _job(**kw) -> pb.SubmitJobRequest:
    kw.setdefault("estimated_duration_seconds", 60)  # a budget needs an estimate to bound the cost
    kw.setdefault("card_models", ["T4"])
    kw.setdefault("gpus_per_worker", 1)
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant="vision", project="serve", cpu_milli=1000, **kw))


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


async def test_a_split_jobs_worst_case_counts_every_shard(admission):
    """One shard's worst case is 300 of the 1000 CNY: 3 shards (900) fit, 4 shards (1200) do not."""
    price = max(load_price_catalog().gpu_hour(r, "nvidia-t4-16gb") for r in ("cn-north-1", "cn-east-1", "cn-south-1"))
    seconds = 300 / float(price) * 3600
    async with channel(admission.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(_job(estimated_duration_seconds=seconds, shards=4))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 shards x 1 GPU" in e.value.details()
    assert await _submit(admission.port, _job(estimated_duration_seconds=seconds, shards=3)) == grpc.StatusCode.OK


async def _inventory(bus, region: str, cluster: str, card: str, gpus: int) -> None:
    """One agent's inventory snapshot: two nodes of ``gpus`` x ``card``."""
    from fedsched.events import InventorySnapshot, NodeInventory

    snap = InventorySnapshot(nodes=tuple(NodeInventory(name=f"{cluster}-n{i}", card_model=card, gpus=gpus,
                                                       gpu_memory_gib=16) for i in range(2)))
    await bus.publish(bus.subjects.inventory(region, cluster), make_event(
        "inventory.snapshot", snap, producer="agent", occurred_at=time.time(), region=region, cluster=cluster))


async def test_a_job_no_cluster_could_ever_hold_is_refused_and_holds_no_budget(admission, bus):
    """The issue's example: tenant vision (budget 1000 CNY) asks for a card model no cluster has.
    Refused at submit with FAILED_PRECONDITION and the reason, so it holds nothing; later T4 jobs
    are accepted."""
    await _inventory(bus, "cn-south-1", "cn-south-1-c1", "nvidia-t4-16gb", 4)
    assert await until(lambda: "cn-south-1-c1" in admission.clusters)
    price = max(load_price_catalog().gpu_hour(r, "nvidia-t4-16gb") for r in ("cn-north-1", "cn-east-1", "cn-south-1"))
    seconds = 600 / float(price) * 3600  # a T4 job's worst case: 600 of the 1000 CNY
    async with channel(admission.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.JobServiceStub(ch).SubmitJob(_job(card_models=["A100"], estimated_duration_seconds=60))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has nvidia-a100" in e.value.details() and "could never run as asked" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a gang larger than the cluster (2 nodes x 4 T4)
            await pb_grpc.JobServiceStub(ch).SubmitJob(_job(workers=3, gpus_per_worker=4))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "larger than any cluster" in e.value.details()
    assert not admission.view.jobs
    assert await _submit(admission.port, _job(estimated_duration_seconds=seconds)) == grpc.StatusCode.OK


async def test_a_job_that_cannot_run_now_holds_no_budget_until_it_can(admission, bus):
    """Accepted (no inventory yet), then found unplaceable by the scheduler: its 600 CNY worst
    case is released while it cannot run, and held again once it can."""
    from fedsched.events import JobPending

    price = max(load_price_catalog().gpu_hour(r, "nvidia-t4-16gb") for r in ("cn-north-1", "cn-east-1", "cn-south-1"))
    seconds = 600 / float(price) * 3600
    async with channel(admission.port, "carol") as ch:
        first = await pb_grpc.JobServiceStub(ch).SubmitJob(_job(estimated_duration_seconds=seconds))
    assert await _submit(admission.port, _job(estimated_duration_seconds=seconds)) == grpc.StatusCode.RESOURCE_EXHAUSTED

    async def pending(fits_empty: bool) -> None:
        await bus.publish(bus.subjects.decisions("vision", "serve"), make_event(
            "job.pending", JobPending(reason="card_model", fits_empty=fits_empty), producer="scheduler",
            occurred_at=time.time(), tenant="vision", project="serve", job_id=first.job_id, actor="scheduler"))

    await pending(False)  # no cluster could hold it even empty
    assert await until(lambda: admission.view.jobs[first.job_id].unplaceable)
    assert await _submit(admission.port, _job(estimated_duration_seconds=seconds)) == grpc.StatusCode.OK
    await pending(True)  # capacity joined: it can run some day, and holds its worst case again
    assert await until(lambda: not admission.view.jobs[first.job_id].unplaceable)
    assert await _submit(admission.port, _job(estimated_duration_seconds=seconds)) == grpc.StatusCode.RESOURCE_EXHAUSTED


SMALL_BUDGET_TENANTS = TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                                       "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                                       "budget: {monthly: \"100\", currency: CNY}}")


async def test_concurrent_submits_never_hold_more_than_the_budget(bus):
    """200 submits at once, each with a worst case of 4.5 CNY, against 100 CNY: the check and the
    hold are one step, so exactly floor(100 / 4.5) = 22 are accepted (as one at a time), and
    every refusal says how much is held."""
    async with running_admission(bus, policy_doc(tenants=SMALL_BUDGET_TENANTS), spend_poll_s=0.05) as svc:
        # 1 attempt x 1 GPU x 1 h x 4.5 CNY/GPU-h (the job's price cap bounds its worst case)
        job = _job(estimated_duration_seconds=3600, max_price_per_gpu_hour=4.5, retry_limit=0)
        accepted, refused = await submit_at_once([svc.port] * 4, "carol", job, 200)
        assert len(accepted) == 22 and len({r.job_id for r in accepted}) == 22
        assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all(r.details().startswith("budget.vision:") and "may cost up to 4.500000 CNY" in r.details()
                   and "99.000000 CNY held by its open jobs" in r.details() for r in refused), refused[0].details()
        assert len(svc.view.open_by_tenant["vision"]) == 22
        assert svc.servicer._holds == {}  # every hold was handed to the view or released


async def test_a_restart_from_a_checkpoint_keeps_budget_holds_and_submits_at_once(bus):
    """Review items 1 and 2 on real NATS: 10 queued jobs of 4.5 CNY against 100 CNY, a checkpoint,
    a restart from it. The restored jobs hold their worst case again (exactly 12 more pass, as
    before the restart), and the first budgeted submit after the restart -- whose compare-and-set
    point (the tenant's last submission) the checkpoint does not keep -- reads the real one from
    JetStream and is accepted at once instead of after ~100 s of conflicts."""
    job = _job(estimated_duration_seconds=3600, max_price_per_gpu_hour=4.5, retry_limit=0)
    opts = dict(spend_poll_s=0.05, snapshot_every_s=3600)
    async with running_admission(bus, policy_doc(tenants=SMALL_BUDGET_TENANTS), **opts) as svc:
        for _ in range(10):
            assert await _submit(svc.port, job) == grpc.StatusCode.OK
        assert await until(lambda: svc.view.applied_seq >= svc.view.last_submitted.get("vision", 0) > 0)
        assert await svc.maybe_snapshot(force=True)
    async with running_admission(bus, policy_doc(tenants=SMALL_BUDGET_TENANTS), **opts) as again:
        assert len(again.view.open_by_tenant["vision"]) == 10
        assert "vision" not in again.view.last_submitted  # not in the checkpoint
        t0 = time.monotonic()
        codes = [await _submit(again.port, job) for _ in range(13)]
        assert codes == [grpc.StatusCode.OK] * 12 + [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert time.monotonic() - t0 < 20  # the old path: 2 s per lost round
        assert again.servicer.budget_conflicts == 0  # the point was read before the first round
