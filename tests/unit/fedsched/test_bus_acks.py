"""``Bus.publish_many`` waits for a batch's pipelined acks with a deadline (fedsched/bus.py
``_acks``): an ack that never comes is a timeout for that message alone (it is then sent again
one by one), never a publisher held for good."""

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
