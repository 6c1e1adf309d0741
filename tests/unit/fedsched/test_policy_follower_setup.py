"""The policy follower does not wait a whole JetStream request timeout on a watch set-up left
unanswered (issue 15: the scheduler waits for the policy before its first cycle, and a 500-job
bench placed nothing for ~9.5 s when the first watch request of a fresh system went unanswered)."""

from __future__ import annotations

import asyncio
import time

from fedsched.policystore import PolicyFollower, PolicyHolder


class _Watcher:
    def __init__(self, kv: "_KV") -> None:
        self.kv = kv
        self.sent_initial = False

    async def updates(self, timeout: float):
        if not self.sent_initial:
            self.sent_initial = True
            return None  # the end-of-initial-state marker: no policy stored
        await asyncio.wait_for(asyncio.Event().wait(), timeout)  # nothing new: times out

    async def stop(self) -> None:
        self.kv.stopped.append(self)


class _KV:
    """The bus's policy bucket: its first watch set-up hangs until released (a lost request)."""

    def __init__(self) -> None:
        self.watches = 0
        self.release = asyncio.Event()
        self.stopped: list[_Watcher] = []

    async def watch(self, key: str) -> _Watcher:
        self.watches += 1
        if self.watches == 1:
            await self.release.wait()
        return _Watcher(self)


class _Bus:
    def __init__(self) -> None:
        self.kv = _KV()

    async def key_value(self, bucket: str, **kw) -> _KV:
        return self.kv


async def _until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_a_hung_watch_set_up_is_abandoned_after_the_set_up_timeout_and_tried_again():
    bus = _Bus()
    follower = PolicyFollower(bus, PolicyHolder(), name="t", setup_timeout_s=0.05)
    task = asyncio.create_task(follower.run())
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(follower.initial.wait(), 5.0)
        assert time.monotonic() - t0 < 2.0  # not the 10 s of a JetStream request timeout
        assert bus.kv.watches == 2  # the second set-up answered
        assert bus.kv.stopped == []
        bus.kv.release.set()  # the first set-up completes late: its watch is stopped, not leaked
        await _until(lambda: len(bus.kv.stopped) == 1, 2.0, "the late watch stopped")
    finally:
        follower.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_follower_cancelled_during_a_hung_set_up_stops_the_watch_it_makes_late():
    bus = _Bus()
    follower = PolicyFollower(bus, PolicyHolder(), name="t", setup_timeout_s=30.0)
    task = asyncio.create_task(follower.run())
    await _until(lambda: bus.kv.watches == 1, 2.0, "the set-up under way")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and bus.kv.stopped == []
    bus.kv.release.set()  # the shielded set-up finishes after its follower is gone
    await _until(lambda: len(bus.kv.stopped) == 1, 2.0, "the late watch stopped")
