"""The bus's per-message costs under load (fedsched/bus.py):

* ``Bus.publish_many`` waits for a batch's pipelined acks with a deadline (``_acks``): an ack
  that never comes is a timeout for that message alone (it is then sent again one by one),
  never a publisher held for good;
* the readers of one process share a decoded stream message (``_decode``), never one with
  other bytes."""

from __future__ import annotations

import asyncio

import pytest

from fedsched.bus import _acks, _failed


async def test_acks_give_results_errors_and_timeouts_per_message():
    loop = asyncio.get_running_loop()
    acked, never, late = loop.create_future(), loop.create_future(), loop.create_future()
    acked.set_result("ack-1")
    loop.call_later(0.01, late.set_result, "ack-3")
    t0 = loop.time()
    out = await _acks([acked, never, late, _failed(ValueError("not sent"))], timeout_s=0.3)
    assert loop.time() - t0 < 5
    assert out[0] == "ack-1" and out[2] == "ack-3"
    assert isinstance(out[1], asyncio.TimeoutError) and never.cancelled()
    assert isinstance(out[3], ValueError)


async def test_no_futures_no_wait():
    assert await _acks([], timeout_s=0.0) == []


class _Md:
    def __init__(self, stream: str, seq: int) -> None:
        self.stream = stream
        self.sequence = type("S", (), {"stream": seq})()


class _Msg:
    def __init__(self, data: bytes, stream: str = "EV", seq: int = 1, subject: str = "x.jobs.cancel") -> None:
        self.data, self.metadata, self.subject = data, _Md(stream, seq), subject


def test_readers_of_one_process_share_a_decoded_message_and_never_a_different_one():
    from fedsched.bus import READERS, _DECODED, _decode
    from fedsched.events import JobCancelRequested, make_event

    one = make_event("job.cancel_requested", JobCancelRequested(), producer="admission", occurred_at=1.7e9, job_id="j1").to_bytes()
    two = make_event("job.cancel_requested", JobCancelRequested(), producer="admission", occurred_at=1.7e9, job_id="j2").to_bytes()
    readers = [READERS.add("EV", ["x.>"]) for _ in range(3)]
    try:
        first = _decode(_Msg(one, seq=424242))
        assert _decode(_Msg(one, seq=424242)) is first  # the second reader gets the same (immutable) envelope
        other = _decode(_Msg(two, seq=424242))  # same place, other bytes (a recreated stream): decoded anew
        assert other.job_id == "j2" and first.job_id == "j1"
        assert _decode(_Msg(one, seq=424243)) is first  # the third
        assert one not in _DECODED  # all three readers took it
        assert _decode(_Msg(one, stream="OTHER", seq=424242)) is not first  # (no reader of OTHER: nothing kept)
        assert one not in _DECODED
        assert _decode(_Msg(two, seq=424242)) is other and _decode(_Msg(two, seq=424242)) is other
        assert two not in _DECODED  # all three readers took it
    finally:
        for r in readers:
            READERS.remove(r)


async def _swallowing(bus, limit: int) -> tuple[str, list]:
    """``bus`` with a client pending-ack limit of ``limit`` and a subject whose messages a plain
    subscriber takes without ever acknowledging (a JetStream that does not answer): past
    ``limit`` messages, ``publish_async`` waits for a slot. Returns the subject's base and the
    messages received."""
    bus.js = bus.nc.jetstream(timeout=10, publish_async_max_pending=limit)
    base = f"nostream.{bus.prefix}"
    seen: list = []

    async def take(msg) -> None:
        seen.append(msg.subject)

    await bus.nc.subscribe(f"{base}.>", cb=take)
    await bus.nc.flush()
    return base, seen


def _items(base: str, n: int):
    from fedsched.events import JobCancelRequested, make_event

    return [(f"{base}.{i}", make_event("job.cancel_requested", JobCancelRequested(), producer="admission",
                                       occurred_at=1.7e9, job_id=f"j{i}"), None) for i in range(n)]


async def _end(task: asyncio.Task) -> None:
    """Make a publisher that swallows cancellations end (one cancel per message it holds), so a
    failing test does not leave it running on the session's loop."""
    for _ in range(20):
        if task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)


async def _cancel_while_stalled(bus, seen: list, call) -> None:
    from tests.builders import until

    task = asyncio.create_task(call)
    assert await until(lambda: len(seen) == 2, timeout=5)  # two sent; the third waits for a slot
    assert not task.done()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    try:
        assert task.done(), "the cancel became one item's failure and it went on publishing"
    finally:
        await _end(task)
    with pytest.raises(asyncio.CancelledError):
        await task
    await bus.nc.flush()
    assert len(seen) == 2  # nothing more was published
    assert bus.js.publish_async_pending() == 0  # the acks given up free their slots


async def test_a_publish_acks_cancelled_while_stalled_raises_cancelled_and_publishes_nothing_more(bus):
    base, seen = await _swallowing(bus, limit=2)
    await _cancel_while_stalled(bus, seen, bus.publish_acks(_items(base, 6)))


async def test_a_publish_many_cancelled_while_stalled_raises_cancelled_and_publishes_nothing_more(bus):
    base, seen = await _swallowing(bus, limit=2)
    await _cancel_while_stalled(bus, seen, bus.publish_many(_items(base, 6)))


async def test_a_stall_past_the_ack_timeout_sends_the_rest_alone_without_waiting_again(bus):
    """The pending-ack limit holds the third message back past ``ack_timeout_s``: it and the
    rest are not pipelined (each would wait ``ack_timeout_s`` again) but sent alone."""
    base, seen = await _swallowing(bus, limit=2)
    bus.ack_timeout_s = 0.2
    sent_alone: list[str] = []

    async def publish(subject, event, headers=None):
        sent_alone.append(subject)
        return "acked alone"

    bus.publish = publish  # the one-by-one path is not under test here
    t0 = asyncio.get_running_loop().time()
    task = asyncio.create_task(bus.publish_acks(_items(base, 6)))
    await asyncio.wait({task}, timeout=5)
    try:
        assert task.done(), "a stalled publish waited for a slot without a deadline"
    finally:
        await _end(task)
    out = task.result()
    assert asyncio.get_running_loop().time() - t0 < 2.0  # two waits of 0.2 s, not one per message
    assert out == ["acked alone"] * 6 and len(seen) == 2
    assert sent_alone == [f"{base}.{i}" for i in range(6)]
