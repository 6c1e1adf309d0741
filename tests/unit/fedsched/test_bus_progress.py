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
    loop = asyncio.get_running_loop()
    before = loop.time()
    progress = _Progress(consumer, [slow])
    after = loop.time()
    # the reporting task is due a quarter of the ack wait after the fetch (the timer's own
    # deadline: no wall-clock bound on a loaded machine)
    assert progress._timer.when() - before >= 0.1 and progress._timer.when() - after <= 0.1
    assert await until(lambda: slow.reports >= 1, timeout=5, interval=0.005)
    assert loop.time() - before >= 0.1 - 1e-3  # not before the timer
    assert await until(lambda: slow.reports >= 2, timeout=5, interval=0.005)
    task = progress.cancel()
    assert task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert quick.reports == 0 and consumer.progress_reports == slow.reports


async def test_the_reporting_task_reports_at_once_not_after_another_quarter() -> None:
    """The timer already waited a quarter of the ack wait: the task it starts reports in its
    first step (counted after a few loop turns; the next report is 10 s away)."""
    from fedsched.bus import _Progress

    consumer = DurableConsumer(_Bus(), "EVENTS", "d", ["t.>"], _noop, ack_wait_s=40.0)
    msg = _Msg(acked=False)
    progress = _Progress(consumer, [msg])
    progress._timer.cancel()
    progress._start()  # what the timer does when it fires
    for _ in range(5):
        await asyncio.sleep(0)
    assert msg.reports == 1
    task = progress.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert msg.reports == 1 and consumer.progress_reports == 1
