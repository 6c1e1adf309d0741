"""Billing's pure core: which line an event makes and what it costs (Decimal, never float)."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from fedsched.events import JobPlaced, JobStatus, WorkerBinding, make_event
from fedsched.jobs import Dataset, JobSpec
from fedsched.pricing import PriceCatalog, load_price_catalog
from services.billing.usage import compute_line, price_segments, spend_key, to_ms, transfer_line

T0 = datetime(2023, 3, 1, 12, 0, tzinfo=UTC)
CATALOG = load_price_catalog()


def _status(type_, *, seconds=3600.0, gpu_milli=2000, cpu_milli=8000, reason="", started=True, start=T0,
            region="cn-east-1"):
    payload = JobStatus(card_model="nvidia-t4-16gb", gpu_milli=gpu_milli, cpu_milli=cpu_milli, reason=reason,
                        started_at=start if started else None, kind="training")
    return make_event(type_, payload, producer="agent/x", occurred_at=(start + timedelta(seconds=seconds)).timestamp(),
                      region=region, cluster=f"{region}-c1", tenant="nlp", project="train", job_id="j-1", attempt=1)


# 2 GPUs of T4 in cn-east-1: 6.0 x 0.9 = 5.4 per GPU-hour
CASES = [
    ("finished", "job.finished", {}, ("finished", "", Decimal("5.400000"), Decimal("10.800000"), 7200.0)),
    ("failed-is-billed-and-flagged", "job.failed", {}, ("failed", "failed", Decimal("5.400000"),
                                                         Decimal("10.800000"), 7200.0)),
    ("preempted", "job.stopped", {"reason": "preempted", "seconds": 1800},
     ("stopped:preempted", "preempted", Decimal("5.400000"), Decimal("5.400000"), 3600.0)),
    ("half-gpu-90s", "job.finished", {"gpu_milli": 500, "seconds": 90},
     ("finished", "", Decimal("5.400000"), Decimal("0.067500"), 45.0)),
    # CPU-only: 8 cores x 1 h x 0.25 x 0.9
    ("cpu-only", "job.finished", {"gpu_milli": 0}, ("finished", "", Decimal("0.225000"), Decimal("1.800000"), 0.0)),
    ("zero-length", "job.finished", {"seconds": 0}, ("finished", "", Decimal("5.400000"), Decimal("0.000000"), 0.0)),
]


@pytest.mark.parametrize("type_,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compute_line_prices_every_ended_attempt(type_, kwargs, expected):
    line = compute_line(_status(type_, **kwargs), CATALOG)
    outcome, flag, unit, cost, gpu_seconds = expected
    assert (line.outcome, line.flag, line.unit_price, line.cost, line.gpu_seconds) == (outcome, flag, unit, cost,
                                                                                      gpu_seconds)
    assert isinstance(line.cost, Decimal) and line.line == "compute" and line.price_version == CATALOG.version


@pytest.mark.parametrize("type_,started", [("job.started", True), ("job.rejected", True), ("job.finished", False),
                                           ("job.cancelled", False)], ids=["start", "rejected", "never-started",
                                                                            "cancelled"])
def test_events_without_an_interval_make_no_compute_line(type_, started):
    assert compute_line(_status(type_, started=started), CATALOG) is None


def test_interval_is_taken_at_millisecond_precision_like_the_store():
    start = T0 + timedelta(microseconds=123_999)
    line = compute_line(_status("job.finished", seconds=1.0, start=start), CATALOG)
    assert line.started_at == datetime(2023, 3, 1, 12, 0, 0, 123_000, tzinfo=UTC)
    assert line.ended_at == datetime(2023, 3, 1, 12, 0, 1, 123_000, tzinfo=UTC)  # 1.123999 s -> truncated
    assert to_ms(start) == line.started_at


def test_time_of_day_prices_each_stretch_of_the_interval():
    catalog = PriceCatalog.from_yaml("base: {T4: 10.0}\ntime_of_day: [{start_hour: 0, end_hour: 6, factor: 0.5}]\n")
    start = datetime(2023, 3, 1, 5, 30, tzinfo=UTC)  # 30 min at 5.0, then 60 min at 10.0 (1 GPU)
    line = compute_line(_status("job.finished", seconds=5400, gpu_milli=1000, start=start, region="cn-north-1"),
                        catalog)
    assert line.cost == Decimal("12.500000")
    assert line.unit_price == Decimal("8.333333")  # effective average: 12.5 / 1.5 h
    segs = price_segments(line.started_at, line.ended_at, catalog)
    assert [ms for _, ms in segs] == [1_800_000, 3_600_000]


def _placed(transfer_bytes: int, cross_region: bool = True):
    spec = JobSpec(tenant="nlp", project="train", home_region="cn-north-1", kind="training",
                   datasets=(Dataset(name="nlp/corpus", home_region="cn-north-1", size_bytes=transfer_bytes),))
    payload = JobPlaced(spec=spec, card_model="nvidia-t4-16gb", bindings=(WorkerBinding(worker=0, node="n1"),),
                        cross_region=cross_region, transfer_bytes=transfer_bytes, transfer_s=transfer_bytes / 1.25e9)
    return make_event("job.placed", payload, producer="scheduler", occurred_at=T0.timestamp(), region="cn-east-1",
                      cluster="cn-east-1-c1", tenant="nlp", project="train", job_id="j-1", attempt=2)


def test_a_placement_that_moves_data_is_one_transfer_line():
    e = _placed(16_093_383_920)
    line = transfer_line(e, CATALOG)
    # 16.09338392 GB x 0.5 per GB
    assert (line.line, line.usage_id, line.transfer_bytes, line.cost) == ("transfer", e.event_id, 16_093_383_920,
                                                                          Decimal("8.046692"))
    assert line.gpu_seconds == 0.0 and line.started_at == line.ended_at and line.kind == "training"
    assert compute_line(e, CATALOG) is None


def test_placements_without_data_to_move_cost_nothing_extra():
    assert transfer_line(_placed(0, cross_region=True), CATALOG) is None
    assert transfer_line(_status("job.finished"), CATALOG) is None


def test_spend_key_is_tenant_dot_month_of_the_interval_end():
    line = compute_line(_status("job.finished", start=datetime(2023, 1, 31, 23, 30, tzinfo=UTC)), CATALOG)
    assert spend_key(line.tenant, line.month) == "nlp.2023-02"
