"""Progress reports of a durable consumer's batch (:meth:`fedsched.bus.DurableConsumer._heartbeat`).

A progress report (``+WPI``) after a nak restarts the server's full ack wait for that message, so
a message handed back with a short delay while the rest of its batch is still handled would wait
``ack_wait_s`` instead of the delay (review of the stop-11 change). The fakes below stand for
nats.py's ``Msg`` only in what the heartbeat reads: ``is_acked`` and ``in_progress()``.
"""

from __future__ import annotations

import asyncio
import contextlib

from fedsched.bus import DurableConsumer
from tests.builders import until


class _Bus:
    def stream_name(self, suffix: str) -> str:
        return f"T_{suffix}"


class _Msg:
    def __init__(self, acked: bool) -> None:
        self.is_acked = acked
        self.reports = 0

    async def in_progress(self) -> None:
        self.reports += 1


async def _noop(deliveries) -> None:
    return None


async def test_messages_already_acked_or_handed_back_get_no_progress_reports() -> None:
    consumer = DurableConsumer(_Bus(), "EVENTS", "d", ["t.>"], _noop, ack_wait_s=0.04)
    live, handed_back = _Msg(acked=False), _Msg(acked=True)
    beat = asyncio.create_task(consumer._heartbeat([live, handed_back]))
    try:
        assert await until(lambda: live.reports >= 3, timeout=5)
        live.is_acked = True  # acknowledged meanwhile: reports stop for it too
        seen = live.reports
        handed_back_after = handed_back.reports
        fresh = _Msg(acked=False)
        beat2 = asyncio.create_task(consumer._heartbeat([live, fresh]))
        assert await until(lambda: fresh.reports >= 2, timeout=5)
        beat2.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat2
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
    assert handed_back.reports == handed_back_after == 0
    assert live.reports <= seen + 1  # at most a report already under way when it was acked
    assert consumer.progress_reports == live.reports + fresh.reports


async def test_a_batch_handled_within_a_quarter_of_the_ack_wait_starts_no_reporting_task() -> None:
    from fedsched.bus import _Progress

    consumer = DurableConsumer(_Bus(), "EVENTS", "d", ["t.>"], _noop, ack_wait_s=0.4)
    quick = _Msg(acked=False)
    progress = _Progress(consumer, [quick])
    assert progress.cancel() is None  # handled at once: a timer cancelled, nothing to await
    slow = _Msg(acked=False)
    progress = _Progress(consumer, [slow])
    loop = asyncio.get_running_loop()
    held_from = loop.time()
    assert await until(lambda: slow.reports >= 1, timeout=5, interval=0.005)
    first_after = loop.time() - held_from
    assert await until(lambda: slow.reports >= 2, timeout=5, interval=0.005)
    task = progress.cancel()
    assert task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert 0.1 <= first_after < 0.2  # a quarter of the ack wait after the fetch, not two
    assert quick.reports == 0 and consumer.progress_reports == slow.reports
