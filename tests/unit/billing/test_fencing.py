"""Billing does not bill a former active scheduler's late placement (scheduler-lease fencing).

Rule (``services/billing/service.py`` module docstring): a ``job.placed`` whose ``fencing_token``
is below the highest seen gives no ``transfer`` line. :meth:`BillingService.lines` is the pure
step; the service is built on a stand-in for the bus (only names are read at construction).
"""

from __future__ import annotations

from types import SimpleNamespace

from fedsched.events import JobPlaced, Subjects, WorkerBinding, make_event
from fedsched.jobs import Dataset, JobSpec
from fedsched.pricing import load_price_catalog
from services.billing.service import BillingService
from tests.builders import delivery

SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1,
               datasets=(Dataset(name="d", home_region="cn-east-1", size_bytes=10**10),))


def _placed(job_id: str, token: int):
    payload = JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),), cross_region=True,
                        transfer_bytes=10**10, fencing_token=token)
    return make_event("job.placed", payload, producer="scheduler", occurred_at=1.7e9, tenant="search",
                      project="train", job_id=job_id, attempt=1, region="cn-north-1", cluster="c1")


def test_a_stale_token_placement_is_not_billed() -> None:
    subjects = Subjects("t")
    bus = SimpleNamespace(stream_name=lambda suffix: f"T_{suffix}", subjects=subjects)
    billing = BillingService(bus, store=None, prices=load_price_catalog())
    sub = subjects.placements("cn-north-1", "c1")
    lines = billing.lines([delivery(_placed("j1", 7), sub, 1, 1.7e9), delivery(_placed("j2", 3), sub, 2, 1.7e9),
                           delivery(_placed("j3", 7), sub, 3, 1.7e9)], placements={})
    assert [ln.job_id for ln in lines] == ["j1", "j3"]
    assert billing.stale_orders == 1


def test_fencing_is_judged_in_stream_order_not_handling_order() -> None:
    """The CI fault (issue 14): a batch of token-1 placements is handed back during a NATS
    election, a placement of the next holder (token 6, later in the stream) is handled first;
    the token-1 placements, valid when published, are still booked and billed when redelivered.
    A token-1 order published *after* token 6 appeared in the stream stays stale."""
    subjects = Subjects("t")
    bus = SimpleNamespace(stream_name=lambda suffix: f"T_{suffix}", subjects=subjects)
    billing = BillingService(bus, store=None, prices=load_price_catalog())
    sub = subjects.placements("cn-north-1", "c1")
    handled = [delivery(_placed("new", 6), sub, 40, 1.7e9),       # handled first, later in the stream
               delivery(_placed("valid", 1), sub, 30, 1.7e9),     # redelivered: published before token 6
               delivery(_placed("late", 1), sub, 41, 1.7e9)]      # the former holder's late order
    assert [ln.job_id for ln in billing.lines(handled, placements={})] == ["new", "valid"]
    assert billing.stale_orders == 1 and billing.highest_token == 6


def test_a_line_the_store_cannot_hold_is_refused_with_a_typed_reason_not_a_raw_exception() -> None:
    """Times and amounts are bounded at decode (tryout: a ``job.finished`` at 9999-12-31 made
    billing fail with ``year 10000 is out of range``, dead-lettered as the raw exception); what
    stays in bounds but prices beyond usage.cost's Decimal(18, 6) -- the largest gang over two
    centuries -- is refused by name, the rest of the batch billed by the consumer."""
    from datetime import UTC, datetime

    import pytest

    from fedsched.errors import DecodeError
    from fedsched.events import JobStatus
    from services.billing.usage import PlacementRecord, placement_key

    subjects = Subjects("t")
    bus = SimpleNamespace(stream_name=lambda suffix: f"T_{suffix}", subjects=subjects)
    billing = BillingService(bus, store=None, prices=load_price_catalog())
    start = datetime(1971, 1, 1, tzinfo=UTC)

    def ended(at: datetime, gpu_milli: int):
        status = make_event("job.finished", JobStatus(card_model="nvidia-t4-16gb", started_at=start, kind="training"),
                            producer="agent/x", occurred_at=at.timestamp(), tenant="search", project="train",
                            job_id="j1", attempt=1, region="cn-north-1", cluster="c1")
        record = PlacementRecord(event_id="p" * 32, job_id="j1", attempt=1, shard=0, tenant="search", project="train",
                                 region="cn-north-1", zone="", cluster="c1", card_model="nvidia-t4-16gb",
                                 kind="training", gpu_milli=gpu_milli, cpu_milli=0, cross_region=False,
                                 placed_at=start)
        return ([delivery(status, subjects.status("cn-north-1", "c1"), 1, at.timestamp())],
                {placement_key("j1", 1, 0): record})

    # one GPU for two centuries is billable; the largest gang (4096 x 64 GPUs) for as long is not
    (line,) = billing.lines(*ended(datetime(2199, 12, 31, tzinfo=UTC), 1000))
    assert line.cost > 0
    with pytest.raises(DecodeError, match=r"job.finished [0-9a-f]{32} cannot be billed: its cost .* is outside "
                                          r"\[0, 10\^12\)"):
        billing.lines(*ended(datetime(2199, 12, 31, tzinfo=UTC), 4096 * 64 * 1000))
