"""The bus against a real nats-server: dedup by message id, ack-after-commit, dead letters."""

import asyncio
import time

import pytest

from fedsched.bus import DurableConsumer, StreamFollower
from fedsched.events import Heartbeat, JobStatus, business_event_id, make_event


def _event(i: int = 0, event_id: str | None = None):
    return make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000), producer="test",
                      occurred_at=time.time(), event_id=event_id or business_event_id("job", i, "started"),
                      region="cn-north-1", cluster="cn-north-1-c1", tenant="search", project="train", job_id=f"j-{i}",
                      attempt=1)


async def _collect(bus, subjects, durable, n, timeout=10.0, handler=None):
    got = []

    async def h(ds):
        if handler:
            await handler(ds)
        got.extend(ds)

    c = DurableConsumer(bus, "EVENTS", durable, subjects, h, batch=50, max_wait_s=0.1)
    task = asyncio.create_task(c.run())
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    c.stop()
    await task
    return got, c


async def test_streams_are_created_idempotently(bus):
    await bus.ensure_streams()
    await bus.ensure_streams()
    info = await bus.js.stream_info(bus.stream_name("EVENTS"))
    assert f"{bus.prefix}.status.>" in info.config.subjects


async def test_a_republished_event_is_stored_once(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    e = _event(1)
    first = await bus.publish(subject, e)
    second = await bus.publish(subject, e)
    assert not first.duplicate and second.duplicate
    info = await bus.js.stream_info(bus.stream_name("EVENTS"))
    assert info.state.messages == 1


async def test_handler_failure_means_redelivery_not_loss(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    await bus.publish(subject, _event(2))
    calls = []

    async def flaky(ds):
        calls.append(len(ds))
        if len(calls) <= 2:  # the in-place retry fails too: the message must come back
            raise RuntimeError("disk full")

    got, c = await _collect(bus, [subject], "flaky", 1, handler=flaky)
    assert len(got) == 1 and len(calls) == 3
    assert got[0].deliveries == 2
    assert await c.lag() == 0


async def test_undecodable_message_goes_to_dead_letter_and_consumer_continues(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    await bus.js.publish(subject, b"{not json")
    await bus.js.publish(subject, b'{"event_id": "x"}')
    await bus.publish(subject, _event(3))
    got, c = await _collect(bus, [subject], "dlq-test", 1)
    assert [d.envelope.job_id for d in got] == ["j-3"]
    assert c.dead_lettered == 2
    dead = []
    f = StreamFollower(bus, "DLQ", dead.append, name="check")
    task = asyncio.create_task(f.run())
    await f.caught_up.wait()
    f.stop()
    await task
    reasons = [d.envelope.payload["reason"] for d in dead]
    assert len(reasons) == 2 and all("not a valid envelope" in r for r in reasons)
    assert dead[0].envelope.payload["data"] == "{not json"
    assert dead[0].envelope.type == "bus.dead_letter"


async def test_an_unknown_event_type_reaches_the_handler_and_a_malformed_type_is_dead_lettered(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    newer = _event(5).model_copy(update={"type": "job.future_thing", "event_id": business_event_id("future")})
    await bus.publish(subject, newer)
    await bus.js.publish(subject, newer.to_bytes().replace(b"job.future_thing", b"Job Future!"))
    await bus.publish(subject, _event(6))
    got, c = await _collect(bus, [subject], "unknown-type-test", 2)
    assert [(d.envelope.type, d.envelope.known_type) for d in got] == [("job.future_thing", None),
                                                                      ("job.started", "job.started")]
    assert c.dead_lettered == 1


async def test_poison_payload_is_dead_lettered_after_retries(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    await bus.publish(subject, _event(4))

    async def always_fails(ds):
        raise ValueError("bug in handler")

    c = DurableConsumer(bus, "EVENTS", "poison", [subject], always_fails, batch=10, max_wait_s=0.1, max_failures=3)
    task = asyncio.create_task(c.run())
    deadline = time.monotonic() + 15
    while c.dead_lettered == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    c.stop()
    await task
    assert c.dead_lettered == 1
    assert await c.lag() == 0


async def test_durable_consumer_resumes_after_restart_without_repeats(bus):
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    for i in range(10, 15):
        await bus.publish(subject, _event(i))
    first, _ = await _collect(bus, [subject], "resume", 5)
    for i in range(15, 18):
        await bus.publish(subject, _event(i))
    second, _ = await _collect(bus, [subject], "resume", 3)
    assert [d.envelope.job_id for d in first] == [f"j-{i}" for i in range(10, 15)]
    assert [d.envelope.job_id for d in second] == [f"j-{i}" for i in range(15, 18)]


async def test_follower_reads_history_then_follows(bus):
    subject = bus.subjects.heartbeat("cn-north-1", "cn-north-1-c1")
    for i in range(3):
        await bus.publish(subject, make_event("inventory.heartbeat", Heartbeat(sequence=i), producer="t",
                                              occurred_at=time.time(), region="cn-north-1", cluster="cn-north-1-c1"))
    seen = []
    f = StreamFollower(bus, "INVENTORY", lambda d: seen.append(d.envelope.payload["sequence"]), name="f")
    task = asyncio.create_task(f.run())
    await f.caught_up.wait()
    await bus.publish(subject, make_event("inventory.heartbeat", Heartbeat(sequence=3), producer="t",
                                          occurred_at=time.time(), region="cn-north-1", cluster="cn-north-1-c1"))
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    f.stop()
    await task
    assert seen == [0, 1, 2, 3]


async def test_the_scheduler_skips_an_unknown_event_type_and_reports_it_on_its_status(bus):
    from fedsched.clock import SystemClock
    from fedsched.pricing import load_price_catalog
    from services.scheduler.core import build_policy
    from services.scheduler.service import SchedulerService

    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    newer = _event(7).model_copy(update={"type": "job.future_thing", "event_id": business_event_id("future", 7)})
    await bus.publish(subject, newer)
    last = (await bus.publish(subject, _event(8))).seq
    svc = SchedulerService(bus, SystemClock(), build_policy(), load_price_catalog())
    task = asyncio.create_task(svc.run())
    try:
        deadline = time.monotonic() + 10
        while svc.applied_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert svc.applied_seq == last  # it went past the unknown event, and on to the next one
        assert svc.status()["skipped_types"] == {"scheduler-events": {"job.future_thing": 1}}
    finally:
        svc.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    dlq = (await bus.js.stream_info(bus.stream_name("DLQ"))).state.messages
    assert dlq == 0


async def test_admission_skips_an_unknown_event_type_and_reports_it(bus):
    from fedsched.clock import SystemClock
    from services.admission.service import AdmissionService
    from tests.builders import policy_doc, store_policy

    await store_policy(bus, policy_doc())
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    newer = _event(9).model_copy(update={"type": "job.future_thing", "event_id": business_event_id("future", 9)})
    last = (await bus.publish(subject, newer)).seq
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    task = asyncio.create_task(svc.run())
    try:
        await asyncio.wait_for(svc.ready.wait(), 20)  # ready = the read models caught up with the stream
        assert svc.view.applied_seq == last
        assert svc.skipped_types() == {"admission-jobs": {"job.future_thing": 1}}
    finally:
        svc.stop()
        await task
    assert (await bus.js.stream_info(bus.stream_name("DLQ"))).state.messages == 0


async def test_a_bad_message_read_again_after_a_restart_is_dead_lettered_once(bus):
    """A follower rebuilding from the stream's start (every service after a restart) meets the
    same undecodable message again: its dead letter has the same id, so the DLQ (and audit,
    which stores by event id) hold it once."""
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    await bus.js.publish(subject, b"{not json")
    await bus.publish(subject, _event(4))
    for _ in range(2):  # the same follower name, as a restarted service has
        seen = []
        f = StreamFollower(bus, "EVENTS", seen.append, name="restarting", filter_subjects=[subject])
        task = asyncio.create_task(f.run())
        await f.caught_up.wait()
        f.stop()
        await task
        assert [d.envelope.job_id for d in seen] == ["j-4"]
    dead = []
    f = StreamFollower(bus, "DLQ", dead.append, name="check-once")
    task = asyncio.create_task(f.run())
    await f.caught_up.wait()
    f.stop()
    await task
    assert len(dead) == 1 and dead[0].envelope.payload["data"] == "{not json"


async def test_a_follower_re_reads_a_delivery_the_client_lost(bus, monkeypatch):
    """Without acks, a message taken off the subscription and then dropped (a fetch cancelled by
    its timeout while a long cycle held the loop) is gone for the server; the follower sees the
    gap in the consumer's delivery sequence and re-reads from the stream: every message once, in
    order. (A filtered follower: stream sequences of its messages have gaps of their own.)"""
    import fedsched.bus as busmod

    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    other = bus.subjects.status("cn-north-1", "cn-north-1-c2")
    for i in range(30):
        await bus.publish(subject, _event(100 + i))
        await bus.publish(other, _event(200 + i))
    real = busmod.PullFeed.take
    dropped = []

    async def lossy(feed, wait_s):
        msgs = await real(feed, wait_s)
        if not dropped and len(msgs) > 3:
            dropped.append(msgs.pop(2).metadata.sequence.stream)  # taken off the buffer, never handed over
        return msgs

    monkeypatch.setattr(busmod.PullFeed, "take", lossy)
    seen = []
    f = StreamFollower(bus, "EVENTS", lambda d: seen.append(d.envelope.job_id), name="lossy", filter_subjects=[subject],
                       batch=10)
    task = asyncio.create_task(f.run())
    deadline = time.monotonic() + 10
    while len(seen) < 30 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    f.stop()
    await task
    assert dropped and f.gaps == 1
    assert seen == [f"j-{100 + i}" for i in range(30)]


async def test_a_follower_is_caught_up_once_its_backlog_is_read_even_while_messages_keep_arriving(bus):
    """``caught_up`` means "the backlog stored when the follower started is read": a scheduler
    started during a burst of submissions must not wait for the burst to end before its first
    cycle (num_pending never reaches 0 while a publisher keeps ahead of the reader)."""
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    for i in range(200):
        await bus.publish(subject, _event(i))
    stop = asyncio.Event()

    async def keep_publishing() -> None:
        i = 1000
        while not stop.is_set():
            await bus.publish_many([(subject, _event(i + k), None) for k in range(20)])
            i += 20

    publisher = asyncio.create_task(keep_publishing())
    seen: list[str] = []

    async def slow(d) -> None:  # a reader slower than the publisher: it never sees num_pending == 0
        seen.append(d.envelope.job_id)
        await asyncio.sleep(0.001)

    f = StreamFollower(bus, "EVENTS", slow, name="busy", filter_subjects=[subject], batch=50)
    task = asyncio.create_task(f.run())
    try:
        await asyncio.wait_for(f.caught_up.wait(), timeout=10)
        assert not publisher.done()  # caught up while the flow goes on
        assert seen[:200] == [f"j-{i}" for i in range(200)]
    finally:
        stop.set()
        await publisher
        f.stop()
        await task


async def test_a_reader_in_the_publishing_process_gets_the_published_envelope_without_decoding_it(bus, monkeypatch):
    """Issue 15: what a process published (acknowledged with its stream sequence) is handed to
    its own readers as the same envelope object (the scheduler reading its placements back,
    admission its submissions, all services when embedded); bytes stored by another publisher
    are decoded as before."""
    from fedsched.events import Envelope

    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    decoded = []
    real = Envelope.from_bytes.__func__

    def counting(cls, data):
        decoded.append(data)
        return real(cls, data)

    monkeypatch.setattr(Envelope, "from_bytes", classmethod(counting))
    seen = []
    f = StreamFollower(bus, "EVENTS", seen.append, name="own", filter_subjects=[subject])
    task = asyncio.create_task(f.run())  # a reader of this process first (a service follows, then publishes)
    await asyncio.sleep(0.1)
    mine = [_event(300 + i) for i in range(5)]
    assert all(await bus.publish_many([(subject, e, None) for e in mine[:4]]))
    await bus.publish(subject, mine[4])
    foreign = _event(400)
    await bus.nc.publish(subject, foreign.to_bytes())  # (a plain publish: no ack, nothing remembered)
    await bus.nc.flush()
    deadline = time.monotonic() + 10
    while len(seen) < 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    f.stop()
    await task
    assert [d.envelope.job_id for d in seen] == [f"j-{300 + i}" for i in range(5)] + ["j-400"]
    assert all(d.envelope is e for d, e in zip(seen, mine))
    assert len(decoded) == 1 and seen[5].envelope == foreign


async def test_a_durable_consumer_knows_how_many_messages_it_has_yet_to_handle(bus):
    """What an agent reports as ``orders_backlog`` in its heartbeats (the scheduler does not
    reclaim placements an agent has yet to read): while a batch is handled, that batch plus
    what the server still holds for the consumer; 0 once a fetch finds nothing."""
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    for i in range(40, 50):
        await bus.publish(subject, _event(i))
    seen: list[int] = []
    consumer: list[DurableConsumer] = []

    async def record(ds):
        seen.append(consumer[0].backlog)

    c = DurableConsumer(bus, "EVENTS", "backlog", [subject], record, batch=2, max_wait_s=0.1)
    consumer.append(c)
    task = asyncio.create_task(c.run())
    try:
        deadline = time.monotonic() + 10
        while (len(seen) < 5 or c.backlog) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        c.stop()
        await task
    assert seen == [10, 8, 6, 4, 2]  # two in hand plus the rest the server holds
    assert c.backlog == 0


async def test_publish_acks_gives_each_event_its_ack_a_repeat_is_a_duplicate_and_an_oversized_one_its_error(bus):
    """``Bus.publish_acks`` (admission's pipelined batch submit): every item gets its own
    JetStream ack -- sequences in order, a repeated event id acknowledged as a duplicate of the
    first copy and stored once -- and an item larger than the server carries gets the
    ``PayloadTooLargeError`` a single publish raises, without failing the others."""
    from fedsched.errors import PayloadTooLargeError
    from fedsched.events import JobStatus

    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    big = make_event("job.failed", JobStatus(reason="x" * (bus.max_payload + 1)), producer="test",
                     occurred_at=time.time(), region="cn-north-1", cluster="cn-north-1-c1", tenant="search",
                     project="train", job_id="j-big", attempt=1)
    items = [(subject, _event(1), None), (subject, _event(2), None), (subject, big, None), (subject, _event(1), None)]
    acks = await bus.publish_acks(items)
    assert [a.seq for a in (acks[0], acks[1])] == [1, 2] and not acks[0].duplicate and not acks[1].duplicate
    assert isinstance(acks[2], PayloadTooLargeError)
    assert acks[3].duplicate and acks[3].seq == 1
    info = await bus.js.stream_info(bus.stream_name("EVENTS"))
    assert info.state.messages == 2


async def test_a_follower_folding_a_long_batch_hands_the_loop_back_between_messages(bus):
    """A fetched batch is folded in turns (fedsched.bus.Turns): with a handler that takes 1 ms
    per message, another task on the loop -- a lease renewal, a cycle -- waits a few ms, not the
    whole batch (before: 400 messages held the loop ~0.4 s)."""
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    n = 400
    await bus.publish_many([(subject, _event(i), None) for i in range(n)])
    seen = []

    def slow(d):
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
        seen.append(d)

    f = StreamFollower(bus, "EVENTS", slow, name="slow", filter_subjects=[subject], batch=n)
    gaps, last = [], [time.perf_counter()]

    async def ticker():
        while len(seen) < n:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last[0])
            last[0] = now

    task = asyncio.create_task(f.run())
    await asyncio.wait_for(ticker(), 20)
    f.stop()
    await task
    assert len(seen) == n
    assert max(gaps) < 0.1, f"the loop was held {max(gaps) * 1000:.0f} ms"


async def test_turns_yield_only_once_their_time_is_up(monkeypatch):
    from fedsched import bus as busmod

    now = [100.0]
    monkeypatch.setattr(busmod.time, "perf_counter", lambda: now[0])
    yields = []
    real_sleep = asyncio.sleep

    async def sleep(s):
        yields.append(s)
        await real_sleep(s)

    monkeypatch.setattr(busmod.asyncio, "sleep", sleep)
    turns = busmod.Turns()
    await turns.take()
    assert yields == []
    now[0] += busmod.TURN_S
    await turns.take()
    assert yields == [0]
    await turns.take()
    assert yields == [0]  # a new turn began


def test_subject_filters_match_as_nats_does():
    from fedsched.bus import subject_matches

    for pattern, subject, ok in [("a.b.c", "a.b.c", True), ("a.*.c", "a.x.c", True), ("a.*", "a.x.c", False),
                                 ("a.>", "a.x.c", True), ("a.>", "a", False), ("a.b", "a.b.c", False),
                                 ("a.b.c", "a.b", False), (">", "a", True), ("*.b.>", "x.b.c.d", True)]:
        assert subject_matches(pattern, subject) is ok, (pattern, subject)


async def test_a_decoded_message_is_kept_for_exactly_the_other_local_readers_of_its_subject(bus):
    """The shared decode (fedsched.bus._DECODED) keeps an envelope until the last reader of this
    process whose filter takes it has read it, and keeps none nobody else will read (issue 15:
    the agents' process held ~8,000 envelopes for readers that never came)."""
    from fedsched import bus as busmod

    status = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    placements = bus.subjects.placements("cn-north-1", "cn-north-1-c1")
    got: dict[str, list] = {"all": [], "status": [], "placements": []}
    readers = [StreamFollower(bus, "EVENTS", got["all"].append, name="all", filter_subjects=[f"{bus.prefix}.>"]),
               StreamFollower(bus, "EVENTS", got["status"].append, name="status", filter_subjects=[status]),
               StreamFollower(bus, "EVENTS", got["placements"].append, name="placements",
                              filter_subjects=[f"{bus.prefix}.placements.>"])]
    tasks = [asyncio.create_task(r.run()) for r in readers]
    try:
        await asyncio.sleep(0.3)  # all three registered and subscribed
        stream = bus.stream_name("EVENTS")
        assert busmod.READERS.of(stream, status) == 2 and busmod.READERS.of(stream, placements) == 2
        assert busmod.READERS.of(stream, bus.subjects.heartbeat("cn-north-1", "cn-north-1-c1")) == 1
        event = _event(1, "a" * 32)
        key = event.to_bytes()
        publishing = asyncio.create_task(bus.publish(status, event))
        await asyncio.sleep(0)  # shared as it is sent, before its ack (a waiting reader may get it first)
        assert busmod._DECODED[key][1] == 2  # published here: kept for both local readers of the subject
        await publishing
        deadline = time.monotonic() + 5
        while (not got["all"] or not got["status"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert got["all"][0].envelope is got["status"][0].envelope  # decoded once (here: not at all)
        assert key not in busmod._DECODED  # both read it: let go
    finally:
        for r in readers:
            r.stop()
        await asyncio.gather(*tasks)
    assert busmod.READERS.of(bus.stream_name("EVENTS"), status) == 0  # stopped readers leave the count


async def test_a_follower_asks_for_messages_once_per_half_batch_and_survives_its_consumer_being_deleted(bus):
    """The continuous pull (:class:`fedsched.bus.PullFeed`): 600 messages in bursts of 20 cost
    at most one pull request per half batch (50) plus the first, not one or two per burst; when
    the follower's consumer is deleted under it (the server answers its waiting request 409),
    it makes a new one from the next sequence: every message once, in order."""
    subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
    seen: list[str] = []
    f = StreamFollower(bus, "EVENTS", lambda d: seen.append(d.envelope.job_id), name="pull", filter_subjects=[subject],
                       batch=100, max_wait_s=0.05)
    task = asyncio.create_task(f.run())
    try:
        await asyncio.wait_for(f.caught_up.wait(), 10)
        for first in range(0, 600, 20):
            assert all(await bus.publish_many([(subject, _event(first + k), None) for k in range(20)]))
            await asyncio.sleep(0.005)
        deadline = time.monotonic() + 10
        while len(seen) < 600 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert seen == [f"j-{i}" for i in range(600)]
        assert f.pull_requests <= 1 + 600 // 50, f.pull_requests
        await bus.js.delete_consumer(bus.stream_name("EVENTS"), f._consumer)
        for i in range(600, 610):
            await bus.publish(subject, _event(i))
        deadline = time.monotonic() + 15
        while len(seen) < 610 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert seen == [f"j-{i}" for i in range(610)]
    finally:
        f.stop()
        await task


async def test_a_follower_resumes_within_seconds_after_the_server_restarts(tmp_path):
    """A nats-server killed (-9) and restarted keeps no in-memory consumer and no waiting pull
    request: the follower's feed notices the reconnect (not three missed heartbeats later, 15 s) and makes a
    new consumer from the next sequence; what was published before and after is read once, in
    order."""
    from fedsched.bus import Bus
    from fedsched.natsd import EmbeddedNats

    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    bus = await Bus.connect(server.client_url, "fedr")
    try:
        await bus.ensure_streams()
        subject = bus.subjects.status("cn-north-1", "cn-north-1-c1")
        seen: list[str] = []
        f = StreamFollower(bus, "EVENTS", lambda d: seen.append(d.envelope.job_id), name="restarts",
                           filter_subjects=[subject])
        task = asyncio.create_task(f.run())
        for i in range(5):
            await bus.publish(subject, _event(i))
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert seen == [f"j-{i}" for i in range(5)]
        server.kill()  # (kill -9: no "409 Server Shutdown" to the waiting request)
        server.start()
        for i in range(5, 10):
            await bus.publish(subject, _event(i))  # (retried until the connection is back)
        restarted = time.monotonic()
        while len(seen) < 10 and time.monotonic() < restarted + 20:
            await asyncio.sleep(0.02)
        assert seen == [f"j-{i}" for i in range(10)]
        assert time.monotonic() - restarted < 5.0
        f.stop()
        await task
    finally:
        await bus.close()
        server.stop()


async def test_a_silent_feed_asks_again_before_giving_up_and_a_consumer_without_responders_is_lost(bus):
    """:class:`fedsched.bus.PullFeed` after two heartbeats of silence sends a fresh pull request
    instead of giving up: a loop that was held (here: the last word from the server pushed 10 s
    back) carries on with the same consumer. A request nobody serves -- the consumer's node died
    with it, here a consumer that does not exist -- is answered 503 (no responders): lost at
    once, not three heartbeats later."""
    from nats.js import api

    from fedsched.bus import FeedLost, PullFeed

    stream = bus.stream_name("EVENTS")
    await bus.js.add_consumer(stream, api.ConsumerConfig(name="silent", ack_policy=api.AckPolicy.NONE,
                                                         inactive_threshold=30.0, mem_storage=True))
    feed = PullFeed(bus.nc, "$JS.API", stream, "silent", batch=10, heartbeat_s=0.2)
    await feed.start()
    try:
        assert await feed.take(0.05) == [] and feed.requests == 1
        feed._heard -= 10.0  # as a take() after a 10 s stall of the loop sees it
        assert await feed.take(0.05) == []
        assert feed.requests == 2  # asked again, did not give up
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the consumer's heartbeats answer: never lost
            assert await feed.take(0.05) == []
    finally:
        await feed.close()
    nobody = PullFeed(bus.nc, "$JS.API", stream, "no-such-consumer", batch=10, heartbeat_s=5.0)
    await nobody.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(FeedLost, match="503"):
            await nobody.take(2.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        await nobody.close()


async def test_consumer_requests_whose_answers_are_lost_are_asked_again(nats_server, monkeypatch):
    """:func:`fedsched.bus.asked_again`: on a JetStream cluster an API request sent while the meta
    leader is being elected goes unanswered, and each of a reader's calls to make its consumer
    again waited the whole API timeout (10 s; readers resumed 10-22 s after a node's kill). Here
    the JetStream API is reached through a domain whose requests a relay passes to the real
    server, dropping the server's answer to the first request of each kind it is told to (the
    server did act on it). After :data:`~fedsched.bus.CREATE_ATTEMPT_S` the reader asks again:
    a random-name follower creates under a fresh name (the first consumer is left to expire),
    a fixed-name follower deletes its leftover and creates under its own name, a durable
    consumer asks for its info and creates under its name -- the server answers with what it
    did, and no consumer is made twice."""
    import nats

    import fedsched.bus as busmod
    from fedsched.bus import Bus
    from tests.builders import unique

    monkeypatch.setattr(busmod, "CREATE_ATTEMPT_S", 0.3)
    relay = await nats.connect(nats_server.url)
    asked: dict[str, list[str]] = {"CREATE": [], "DELETE": [], "INFO": []}
    drop: set[str] = set()  # the kinds whose next answer goes nowhere

    async def forward(msg):
        api_subject = "$JS.API." + msg.subject.removeprefix("$JS.lossy.API.")
        kind = next((k for k in asked if api_subject.startswith((f"$JS.API.CONSUMER.{k}.",
                                                                  f"$JS.API.CONSUMER.DURABLE.{k}."))), None)
        reply = msg.reply
        if kind is not None:
            asked[kind].append(api_subject)
            if kind in drop:  # the server acts on it; its answer goes nowhere
                drop.discard(kind)
                reply = relay.new_inbox()
        await relay.publish(api_subject, msg.data, reply=reply, headers=msg.headers)

    async def consumers() -> set[str]:
        return {c.name for c in await bus.js.consumers_info(stream)}

    async def follow(**kwargs) -> list[str]:
        seen: list[str] = []
        f = StreamFollower(bus, "EVENTS", lambda d: seen.append(d.envelope.job_id), **kwargs)
        task = asyncio.create_task(f.run())
        try:
            await asyncio.wait_for(f.caught_up.wait(), 5.0)
        finally:
            f.stop()
            await task
        return seen

    def clear() -> None:
        for v in asked.values():
            v.clear()

    await relay.subscribe("$JS.lossy.API.>", cb=forward)
    await relay.flush()
    bus = await Bus.connect(nats_server.url, unique("t"), name="test", js_domain="lossy")
    try:
        await bus.ensure_streams()
        stream = bus.stream_name("EVENTS")
        subject = bus.subjects.status("cn-north-1", "c1")
        await bus.publish(subject, _event(7))

        before, _ = await consumers(), clear()
        drop.add("CREATE")
        assert await follow(name="lossy") == ["j-7"]
        creates = asked["CREATE"]
        assert len(creates) == 2 and creates[0] != creates[1]  # asked again under a new name
        made = await consumers() - before
        assert len(made) == 2  # the one whose answer was lost, left to expire, and the one read
        assert {n for n in made if n in creates[1]} and {n for n in made if n in creates[0]}

        before, _ = await consumers(), clear()
        drop.update(("DELETE", "CREATE"))
        assert await follow(name="lossy-fixed", filter_subjects=[subject], fixed_name=True) == ["j-7"]
        assert len(asked["DELETE"]) == 2 and len(set(asked["DELETE"])) == 1  # asked again, same name
        assert len(asked["CREATE"]) == 2 and len(set(asked["CREATE"])) == 1
        assert await consumers() - before == {"lossy-fixed"}

        before, _ = await consumers(), clear()
        drop.update(("INFO", "CREATE"))
        got, _ = await _collect(bus, [subject], "lossy-durable", 1, timeout=5.0)  # (the writers', the agents')
        assert [d.envelope.job_id for d in got] == ["j-7"]
        assert len(asked["INFO"]) >= 2 and len(set(asked["INFO"])) == 1
        assert len(asked["CREATE"]) == 2 and len(set(asked["CREATE"])) == 1
        assert await consumers() - before == {"lossy-durable"}
    finally:
        await bus.close()
        await relay.close()


async def test_a_feed_whose_fresh_request_goes_unanswered_is_lost_only_after_lost_after_s(nats_server):
    """:class:`fedsched.bus.PullFeed`: silent for two heartbeats, the feed asks again; a request
    nothing answers at all (no 503: here a relay takes pull requests and drops them) makes it
    lost only ``lost_after_s`` after that fresh request -- not two heartbeats later, which gave
    up on healthy consumers whose heartbeats were late under load (200 followers made at once
    on a 3-node cluster made ~160-240 consumers again)."""
    import nats

    from fedsched.bus import FeedLost, PullFeed

    relay = await nats.connect(nats_server.url)
    pulls = []

    async def swallow(msg):
        pulls.append(msg.subject)

    await relay.subscribe("$JS.deaf.API.CONSUMER.MSG.NEXT.>", cb=swallow)
    await relay.flush()
    feed = PullFeed(relay, "$JS.deaf.API", "S", "c", batch=10, heartbeat_s=0.1, lost_after_s=1.0)
    await feed.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(FeedLost, match="after a fresh pull request"):
            while time.monotonic() - t0 < 5.0:
                await feed.take(0.05)
        assert time.monotonic() - t0 >= 1.0 + 2 * feed.heartbeat_s - 0.05  # not two heartbeats after the probe
        assert feed.requests == 2 and len(pulls) == 2  # the first request and one fresh one
    finally:
        await feed.close()
        await relay.close()
