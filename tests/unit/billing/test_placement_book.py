"""Billing books a batch's placements with pipelined puts (issue 15): every put of the batch
is published before any acknowledgement is awaited, the batch returns only once every put is
acknowledged, and a failed or unacknowledged put hands the batch back (UnavailableError).

The bus is a stand-in whose ``js.publish_async`` is a hand-written fake of JetStream's
(futures the test resolves); :meth:`BillingService._placement_book` is stubbed (the bucket exists)."""

from __future__ import annotations

import asyncio
import json
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


class FakeJetStream:
    """``publish_async``: records the publish, returns a future the test resolves."""

    def __init__(self) -> None:
        self.published: dict[str, bytes] = {}
        self.futures: dict[str, asyncio.Future] = {}

    async def publish_async(self, subject: str, payload: bytes = b"", wait_stall=None, **_):
        self.published[subject] = payload
        self.futures[subject] = asyncio.get_running_loop().create_future()
        return self.futures[subject]

    def answer(self, fail: str = "") -> None:
        for subject, f in self.futures.items():
            if not f.done():
                if fail and fail in subject:
                    f.set_exception(nats.errors.NoRespondersError())
                else:
                    f.set_result(SimpleNamespace(seq=1))


def _billing(js: FakeJetStream) -> BillingService:
    bus = SimpleNamespace(stream_name=lambda suffix: f"T_{suffix}", subjects=SUBJECTS, prefix="t", js=js)
    billing = BillingService(bus, store=None, prices=load_price_catalog())

    async def placement_book():
        return object()

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


async def test_every_put_of_a_batch_is_published_before_any_is_acknowledged() -> None:
    js = FakeJetStream()
    task = asyncio.create_task(_billing(js).record_placements(_placements(50)))
    await _until(lambda: len(js.published) == 50)
    assert not task.done()  # returns only once every put is acknowledged
    js.answer()
    await task
    assert sorted(js.published) == sorted(f"$KV.t_placements.j{i}.1.0" for i in range(50))
    record = json.loads(js.published["$KV.t_placements.j7.1.0"])
    assert (record["region"], record["cluster"], record["attempt"]) == ("cn-north-1", "c1", 1)


async def test_a_failed_put_hands_the_batch_back() -> None:
    js = FakeJetStream()
    task = asyncio.create_task(_billing(js).record_placements(_placements(5)))
    await _until(lambda: len(js.published) == 5)
    js.answer(fail=".j3.")
    with pytest.raises(UnavailableError, match="cannot record placements"):
        await task


async def test_an_unacknowledged_put_hands_the_batch_back() -> None:
    js = FakeJetStream()
    billing = _billing(js)
    with pytest.raises(asyncio.TimeoutError, match="1 of 1 placement puts"):
        await billing._put_all([("j1.1.0", b"{}")], timeout_s=0.05)
    assert js.futures["$KV.t_placements.j1.1.0"].cancelled()


async def test_a_put_all_cancelled_while_the_pending_ack_limit_holds_it_back_is_cancelled(nats_server) -> None:
    """A real client with a pending-ack limit of 2 and a bucket subject no JetStream answers
    (a plain subscriber takes the puts): cancelled while the third put waits for a slot, the
    batch raises CancelledError (nats.py would make it TooManyStalledMsgsError: a nak, and a
    cancelled consumer kept running) and puts nothing more."""
    import nats as nats_client

    from tests.builders import until

    nc = await nats_client.connect(nats_server.url)
    try:
        seen: list[str] = []

        async def take(msg) -> None:
            seen.append(msg.subject)

        await nc.subscribe("$KV.t_placements.>", cb=take)
        await nc.flush()
        billing = _billing(FakeJetStream())
        billing.bus.js = nc.jetstream(publish_async_max_pending=2)
        task = asyncio.create_task(billing._put_all([(f"j{i}.1.0", b"{}") for i in range(6)], timeout_s=30))
        assert await until(lambda: len(seen) == 2, timeout=5)
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        assert task.done()
        with pytest.raises(asyncio.CancelledError):
            await task
        await nc.flush()
        assert len(seen) == 2 and billing.bus.js.publish_async_pending() == 0
    finally:
        await nc.close()
