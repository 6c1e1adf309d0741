"""One oversized message never stops a batch (issue 14 item 6), on a real nats-server started
with a small ``max_payload`` (64 KiB, in its config file).

The issue's scenario: a job whose submission fits the bus but whose placement (the spec plus
bindings, verdicts and explanation) does not, queued with 20 ordinary jobs. Before, every
cycle's batch publish failed and the 20 waited; now the 20 are placed in the first cycles, the
big one's placement is dead-lettered on ``<prefix>.deadletter.scheduler`` with the reason and a
summary, and the job ends (``job.cancelled``, reason ``placement_too_large``) instead of being
decided again every cycle.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Bus, encoded_size
from fedsched.clock import SystemClock
from fedsched.errors import PayloadTooLargeError
from fedsched.events import (DeadLetter, Envelope, EventType, InventorySnapshot, JobSubmitted, NodeInventory,
                             business_event_id, make_event)
from fedsched.jobs import JobSpec
from fedsched.natsd import EmbeddedNats
from fedsched.ports import PublishResult
from fedsched.pricing import load_price_catalog
from services.admission.service import AdmissionService
from services.scheduler.core import build_policy
from services.scheduler.service import SchedulerService
from tests.builders import channel, policy_doc, store_policy, unique, until

MAX_PAYLOAD = 64 * 1024


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory):
    server = EmbeddedNats(tmp_path_factory.mktemp("nats-small"), max_payload=MAX_PAYLOAD)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def small_bus(small_nats):
    prefix = unique("t")
    b = await Bus.connect(small_nats.url, prefix, name="scheduler")
    await b.ensure_streams()
    yield b
    await b.close()


def _submitted(job_id: str, spec: JobSpec, at: float) -> Envelope:
    return make_event(EventType.JOB_SUBMITTED, JobSubmitted(spec=spec, submitted_by="alice"), producer="admission",
                      occurred_at=at, event_id=business_event_id(job_id, "submitted"), tenant=spec.tenant,
                      project=spec.project, job_id=job_id, actor="alice")


async def _read(bus: Bus, subject: str) -> list[Envelope]:
    stream = bus.stream_name("DLQ" if ".deadletter." in subject else "EVENTS")
    sub = await bus.js.pull_subscribe(subject, stream=stream)
    try:
        msgs = await sub.fetch(500, timeout=0.5)
    except Exception:  # noqa: BLE001 - nats TimeoutError: nothing there
        msgs = []
    finally:
        await sub.unsubscribe()
    return [Envelope.from_bytes(m.data) for m in msgs]


async def test_the_bus_reads_max_payload_from_the_server(small_bus):
    assert small_bus.max_payload == MAX_PAYLOAD


async def test_an_oversized_message_is_dead_lettered_and_the_rest_of_the_batch_goes(small_bus):
    bus = small_bus
    subject = bus.subjects.job("submitted", "search", "train")
    small = [_submitted(f"j-{i:020d}", JobSpec(tenant="search", project="train", home_region="cn-north-1"), 1.0)
             for i in range(5)]
    big = _submitted("j-" + "b" * 20, JobSpec(tenant="search", project="train", home_region="cn-north-1",
                                              annotations={f"k{i}": "v" * 1024 for i in range(64)}), 1.0)
    assert len(big.to_bytes()) > MAX_PAYLOAD
    # headers alone push this one over: nats.py checks the body only, and the server would close
    # the connection on it
    edge = _sized(MAX_PAYLOAD - 50)
    assert len(edge.to_bytes()) == MAX_PAYLOAD - 50
    items = [(subject, e, None) for e in small[:2]] + [(subject, big, None)] + [(subject, e, None) for e in small[2:]]
    items.append((subject, edge, {"x-pad": "p" * 200}))
    results = await bus.publish_many(items)
    assert results[:2] == [PublishResult.ACKED] * 2 and results[3:6] == [PublishResult.ACKED] * 3
    assert results[2] is PublishResult.REFUSED
    assert results[6] is PublishResult.REFUSED
    assert bus.nc.is_connected  # nothing oversized reached the server
    stored = {e.event_id for e in await _read(bus, subject)}
    assert stored == {e.event_id for e in small}
    dead = await _read(bus, bus.subjects.deadletter("scheduler"))
    letter = next(d for d in dead if d.payload_as(DeadLetter).data and
                  json.loads(d.payload_as(DeadLetter).data)["event_id"] == big.event_id)
    dl = letter.payload_as(DeadLetter)
    assert dl.consumer == "scheduler" and dl.subject == subject and f"max_payload of {MAX_PAYLOAD}" in dl.reason
    summary = json.loads(dl.data)
    assert summary["type"] == "job.submitted" and summary["body_bytes"] == len(big.to_bytes())
    assert len(letter.to_bytes()) < 4096  # a summary, not the body
    with pytest.raises(PayloadTooLargeError) as e:  # a single publish says so, typed, and sends nothing
        await bus.publish(subject, big)
    assert e.value.max_payload == MAX_PAYLOAD and e.value.size > MAX_PAYLOAD
    again = await bus.publish_many([(subject, big, None)])  # refusing it again stores no second letter
    assert again == [PublishResult.REFUSED]
    assert len([d for d in await _read(bus, bus.subjects.deadletter("scheduler"))
                if json.loads(d.payload_as(DeadLetter).data)["event_id"] == big.event_id]) == 1


async def test_one_message_that_fails_for_another_reason_fails_alone(small_bus):
    """A header the client refuses (not a valid header name) fails that message only; before,
    the exception ended the whole batch."""
    bus = small_bus
    subject = bus.subjects.job("submitted", "search", "train")
    events = [_submitted(f"j-{i:020d}", JobSpec(tenant="search", project="train", home_region="cn-north-1"), 1.0)
              for i in range(3)]
    results = await bus.publish_many([(subject, events[0], None), (subject, events[1], {"bad key": "v"}),
                                      (subject, events[2], None)])
    assert results == [PublishResult.ACKED, PublishResult.FAILED, PublishResult.ACKED]
    assert {e.event_id for e in await _read(bus, subject)} == {events[0].event_id, events[2].event_id}


def _sized(size: int) -> Envelope:
    """A ``job.submitted`` whose body is exactly ``size`` bytes (padding in annotations)."""
    def event(entries: int, pad: int) -> Envelope:
        annotations = {f"k{i:02d}": "v" * 1024 for i in range(entries)} | {"pad": "v" * pad}
        return _submitted("j-" + "e" * 20, JobSpec(tenant="search", project="train", home_region="cn-north-1",
                                                   annotations=annotations), 1.0)

    entries = 0
    while entries < 63 and len(event(entries + 1, 0).to_bytes()) <= size:
        entries += 1
    return event(entries, size - len(event(entries, 0).to_bytes()))


def test_encoded_size_counts_headers_as_nats_sends_them():
    assert encoded_size(None, b"abc") == 3
    assert encoded_size({"Nats-Msg-Id": "x1"}, b"abc") == len(b"NATS/1.0\r\nNats-Msg-Id: x1\r\n\r\n") + 3


def _big_spec(target: int) -> JobSpec:
    """A spec whose ``job.submitted`` is just under ``target`` bytes with its headers (so the
    placement, which adds bindings, verdicts and an explanation, is over)."""
    pad = 0
    while True:
        spec = JobSpec(tenant="search", project="train", card_models=("nvidia-t4-16gb",), home_region="cn-north-1",
                       estimated_duration_s=600, annotations={f"k{i}": "v" * 1000 for i in range(pad // 1000)}
                       | {"tail": "v" * (pad % 1000)})
        size = len(_submitted("j-" + "x" * 20, spec, 0.0).to_bytes()) + 400  # + headers (trace, msg id)
        if size >= target - 200:
            return spec
        pad += max(1, (target - 200 - size) // 2)


async def test_one_oversized_placement_does_not_hold_up_twenty_others(small_bus):
    bus = small_bus
    await store_policy(bus, policy_doc())
    snap = InventorySnapshot(nodes=tuple(NodeInventory(name=f"n{i}", card_model="nvidia-t4-16gb", gpus=4,
                                                       gpu_memory_gib=16) for i in range(8)))
    await bus.publish(bus.subjects.inventory("cn-north-1", "cn-north-1-c1"), make_event(
        "inventory.snapshot", snap, producer="agent", occurred_at=time.time(), region="cn-north-1",
        cluster="cn-north-1-c1"))
    now = time.time()
    big_id = "j-" + "b" * 20
    await bus.publish(bus.subjects.job("submitted", "search", "train"), _submitted(big_id, _big_spec(MAX_PAYLOAD), now))
    normal = [f"j-{i:020d}" for i in range(20)]
    for job_id in normal:
        spec = JobSpec(tenant="search", project="train", card_models=("nvidia-t4-16gb",), home_region="cn-north-1",
                       estimated_duration_s=600)
        await bus.publish(bus.subjects.job("submitted", "search", "train"), _submitted(job_id, spec, now))
    never = JobSpec(tenant="search", project="train", card_models=("nvidia-a100-80gb",), home_region="cn-north-1",
                    estimated_duration_s=600)  # stays queued (no A100 anywhere): cycles go on and are counted
    await bus.publish(bus.subjects.job("submitted", "search", "train"), _submitted("j-" + "n" * 20, never, now))
    svc = SchedulerService(bus, _Clock(), build_policy(), load_price_catalog())
    task = asyncio.create_task(svc.run())
    try:
        assert await until(lambda: all(j in svc.jobs and svc.jobs[j].shards[0].state == "placed" for j in normal),
                           timeout=30)
        assert svc.cycles <= 5, f"the 20 took {svc.cycles} cycles"
        assert await until(lambda: big_id in svc.jobs and svc.jobs[big_id].done, timeout=30)
        ended_at = svc.cycles
        assert await until(lambda: svc.cycles >= ended_at + 3)
        assert bus.refused == 1  # not decided (and refused) again in the cycles after it ended
    finally:
        svc.stop()
        await task
    decisions = await _read(bus, bus.subjects.decisions("search", "train"))
    ended, = [e for e in decisions if e.type == "job.cancelled" and e.job_id == big_id]
    assert ended.payload["reason"].startswith("placement_too_large: the placement of shard 0")
    placements = [e for e in await _read(bus, bus.subjects.placements("cn-north-1", "cn-north-1-c1"))
                  if e.type == "job.placed"]
    assert {e.job_id for e in placements} == set(normal)
    letter, = [d for d in await _read(bus, bus.subjects.deadletter("scheduler"))]
    dl = letter.payload_as(DeadLetter)
    assert json.loads(dl.data)["type"] == "job.placed" and json.loads(dl.data)["job_id"] == big_id
    assert "max_payload" in dl.reason


class _Clock:
    def time(self) -> float:
        return time.time()


async def test_a_submission_larger_than_the_bus_carries_is_invalid_argument_never_internal(small_bus):
    """Within the admission limits (128 KiB) but above this server's 64 KiB: the submission is
    refused naming ``spec``, with the sizes; one that fits is accepted."""
    bus = small_bus
    await store_policy(bus, policy_doc())
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(svc.ready.wait(), 20)
        async with channel(svc.port, "root") as ch:
            stub = pb_grpc.JobServiceStub(ch)
            for n, fits in ((40, True), (63, False)):
                spec = pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, card_models=["T4"],
                                  cpu_milli=1000, annotations={f"k{i}": "v" * 1024 for i in range(n)})
                if fits:
                    assert (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.SubmitJob(pb.SubmitJobRequest(spec=spec))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("spec: the job is too large for this federation's bus")
                assert f"at most {MAX_PAYLOAD}" in e.value.details()
    finally:
        svc.stop()
        await task
