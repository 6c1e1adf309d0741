"""Billing's pure core: which line an event makes and what it costs (Decimal, never float)."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from fedsched.events import JobPlaced, JobStatus, WorkerBinding, make_event
from fedsched.jobs import Dataset, JobSpec
from fedsched.pricing import PriceCatalog, load_price_catalog
from services.billing.usage import (PlacementRecord, compute_line, placement_record, price_segments, spend_key,
                                    to_ms, transfer_line)

T0 = datetime(2023, 3, 1, 12, 0, tzinfo=UTC)
CATALOG = load_price_catalog()


def _status(type_, *, seconds=3600.0, gpu_milli=2000, cpu_milli=8000, reason="", started=True, start=T0,
            region="cn-east-1"):
    payload = JobStatus(card_model="nvidia-t4-16gb", gpu_milli=gpu_milli, cpu_milli=cpu_milli, reason=reason,
                        started_at=start if started else None, kind="training")
    return make_event(type_, payload, producer="agent/x", occurred_at=(start + timedelta(seconds=seconds)).timestamp(),
                      region=region, cluster=f"{region}-c1", tenant="nlp", project="train", job_id="j-1", attempt=1)


def _record(*, gpu_milli=2000, cpu_milli=8000, region="cn-east-1", placed_at=T0 - timedelta(hours=1)):
    """The federation's placement of the attempt ``_status`` reports about (billing's source)."""
    return PlacementRecord(event_id="p" * 32, job_id="j-1", attempt=1, shard=0, tenant="nlp", project="train",
                           region=region, zone="", cluster=f"{region}-c1", card_model="nvidia-t4-16gb", kind="training",
                           gpu_milli=gpu_milli, cpu_milli=cpu_milli, cross_region=False, placed_at=placed_at)


def _line(type_, **kwargs):
    """compute_line of a status whose placement holds the same demand (the honest agent's case)."""
    rec = {k: kwargs[k] for k in ("gpu_milli", "cpu_milli", "region") if k in kwargs}
    rec["placed_at"] = kwargs.get("start", T0) - timedelta(hours=1)
    return compute_line(_status(type_, **kwargs), _record(**rec), kwargs.pop("catalog", CATALOG))


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
    line = _line(type_, **kwargs)
    outcome, flag, unit, cost, gpu_seconds = expected
    assert (line.outcome, line.flag, line.unit_price, line.cost, line.gpu_seconds) == (outcome, flag, unit, cost,
                                                                                      gpu_seconds)
    assert isinstance(line.cost, Decimal) and line.line == "compute" and line.price_version == CATALOG.version


@pytest.mark.parametrize("type_,started", [("job.started", True), ("job.rejected", True), ("job.finished", False),
                                           ("job.cancelled", False)], ids=["start", "rejected", "never-started",
                                                                            "cancelled"])
def test_events_without_an_interval_make_no_compute_line(type_, started):
    assert _line(type_, started=started) is None


def test_interval_is_taken_at_millisecond_precision_like_the_store():
    start = T0 + timedelta(microseconds=123_999)
    line = _line("job.finished", seconds=1.0, start=start)
    assert line.started_at == datetime(2023, 3, 1, 12, 0, 0, 123_000, tzinfo=UTC)
    assert line.ended_at == datetime(2023, 3, 1, 12, 0, 1, 123_000, tzinfo=UTC)  # 1.123999 s -> truncated
    assert to_ms(start) == line.started_at


def test_time_of_day_prices_each_stretch_of_the_interval():
    catalog = PriceCatalog.from_yaml("base: {T4: 10.0}\ntime_of_day: [{start_hour: 0, end_hour: 6, factor: 0.5}]\n")
    start = datetime(2023, 3, 1, 5, 30, tzinfo=UTC)  # 30 min at 5.0, then 60 min at 10.0 (1 GPU)
    line = compute_line(_status("job.finished", seconds=5400, gpu_milli=1000, start=start, region="cn-north-1"),
                        _record(gpu_milli=1000, region="cn-north-1", placed_at=start), catalog)
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
    assert compute_line(e, placement_record(e), CATALOG) is None


def test_placements_without_data_to_move_cost_nothing_extra():
    assert transfer_line(_placed(0, cross_region=True), CATALOG) is None
    assert transfer_line(_status("job.finished"), CATALOG) is None


def test_spend_key_is_tenant_dot_month_of_the_interval_end():
    line = _line("job.finished", start=datetime(2023, 1, 31, 23, 30, tzinfo=UTC))
    assert spend_key(line.tenant, line.month) == "nlp.2023-02"


def test_only_the_times_come_from_the_status_everything_else_from_the_placement():
    """An agent claiming 64 GPUs of another card for another tenant is billed what was placed."""
    payload = JobStatus(card_model="nvidia-h100-80gb", gpu_milli=64000, cpu_milli=1, started_at=T0, kind="inference")
    forged = make_event("job.finished", payload, producer="agent/x", occurred_at=(T0 + timedelta(hours=1)).timestamp(),
                        region="cn-east-1", cluster="cn-east-1-c1", tenant="other", project="p", job_id="j-1",
                        attempt=1)
    line = compute_line(forged, _record(), CATALOG)
    assert (line.tenant, line.project, line.card_model, line.gpu_milli, line.kind) == (
        "nlp", "train", "nvidia-t4-16gb", 2000, "training")
    assert line.cost == Decimal("10.800000")  # 2 T4 x 1 h x 5.4


def test_an_interval_never_starts_before_its_placement():
    line = compute_line(_status("job.finished", seconds=3600, start=T0), _record(placed_at=T0 + timedelta(minutes=30)),
                        CATALOG)
    assert line.started_at == T0 + timedelta(minutes=30) and line.cost == Decimal("5.400000")


def test_placement_record_round_trips_through_the_book():
    e = _placed(0)
    rec = placement_record(e)
    assert PlacementRecord.from_json(rec.to_json()) == rec
    assert (rec.key, rec.gpu_milli, rec.cluster) == ("j-1.2.0", 1000, "cn-east-1-c1")
