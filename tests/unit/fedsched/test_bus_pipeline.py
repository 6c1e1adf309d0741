"""The bus's per-message costs under load (fedsched/bus.py):

* ``Bus.publish_many`` waits for a batch's pipelined acks with a deadline (``_acks``): an ack
  that never comes is a timeout for that message alone (it is then sent again one by one),
  never a publisher held for good;
* the readers of one process share a decoded stream message (``_decode``), never one with
  other bytes."""

from __future__ import annotations

import asyncio

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
    def __init__(self, data: bytes, stream: str = "EV", seq: int = 1) -> None:
        self.data, self.metadata = data, _Md(stream, seq)


def test_readers_of_one_process_share_a_decoded_message_and_never_a_different_one():
    from fedsched.bus import _decode
    from fedsched.events import JobCancelRequested, make_event

    one = make_event("job.cancel_requested", JobCancelRequested(), producer="admission", occurred_at=1.7e9, job_id="j1").to_bytes()
    two = make_event("job.cancel_requested", JobCancelRequested(), producer="admission", occurred_at=1.7e9, job_id="j2").to_bytes()
    first = _decode(_Msg(one, seq=424242))
    assert _decode(_Msg(one, seq=424242)) is first  # the second reader gets the same (immutable) envelope
    other = _decode(_Msg(two, seq=424242))  # same place, other bytes (a recreated stream): decoded anew
    assert other.job_id == "j2" and first.job_id == "j1"
    assert _decode(_Msg(one, stream="OTHER", seq=424242)) is not first
