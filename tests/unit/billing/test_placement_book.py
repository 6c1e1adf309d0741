"""Billing books a batch's placements with pipelined puts (issue 15): every put of the batch
is in flight before any answer is awaited, the batch returns only once every put is confirmed,
and a failed put hands the batch back (UnavailableError). The book is a hand-written fake of
the KV bucket's ``put``; the bus is a stand-in (only names are read)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import nats.errors
import pytest

from fedsched.errors import UnavailableError
from fedsched.events import JobPlaced, Subjects, WorkerBinding, make_event
from fedsched.jobs import JobSpec
from fedsched.pricing import load_price_catalog
from services.billing.service import BillingService
from tests.builders import delivery

SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)
SUBJECTS = Subjects("t")


class FakeBook:
    """A KV bucket whose puts are answered only when the test says so."""

    def __init__(self, fail: str = "") -> None:
        self.in_flight = 0
        self.most_in_flight = 0
        self.stored: dict[str, bytes] = {}
        self.release = asyncio.Event()
        self.fail = fail

    async def put(self, key: str, value: bytes) -> int:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
            if key.startswith(self.fail or "\0"):
                raise nats.errors.TimeoutError
            self.stored[key] = value
            return len(self.stored)
        finally:
            self.in_flight -= 1


def _billing(book: FakeBook) -> BillingService:
    bus = SimpleNamespace(stream_name=lambda suffix: f"T_{suffix}", subjects=SUBJECTS)
    billing = BillingService(bus, store=None, prices=load_price_catalog())

    async def placement_book():
        return book

    billing._placement_book = placement_book
    return billing


def _placements(n: int):
    sub = SUBJECTS.placements("cn-north-1", "c1")
    return [delivery(make_event("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),)),
                                producer="scheduler", occurred_at=1.7e9, tenant="search", project="train",
                                job_id=f"j{i}", attempt=1, region="cn-north-1", cluster="c1"), sub, i + 1, 1.7e9)
            for i in range(n)]


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def test_every_put_of_a_batch_is_in_flight_before_any_is_answered() -> None:
    book = FakeBook()
    billing = _billing(book)
    task = asyncio.create_task(billing.record_placements(_placements(50)))
    await _until(lambda: book.in_flight == 50)
    assert not task.done()  # not returned before the puts are confirmed
    book.release.set()
    await task
    assert book.most_in_flight == 50 and sorted(book.stored) == sorted(f"j{i}.1.0" for i in range(50))


async def test_a_failed_put_hands_the_batch_back() -> None:
    book = FakeBook(fail="j3.")
    book.release.set()
    billing = _billing(book)
    with pytest.raises(UnavailableError, match="cannot record placements"):
        await billing.record_placements(_placements(5))
    assert len(book.stored) == 4  # the others were put (idempotent: the retried batch puts them again)
