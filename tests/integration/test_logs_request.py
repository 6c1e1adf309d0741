"""fedsched.logs.request_logs over a real nats-server: replies in order up to eof, a silent
listener or none at all is UnavailableError after the timeout (never a hang)."""

from __future__ import annotations

import time

import pytest

from fedsched.errors import UnavailableError
from fedsched.logs import LogReply, LogRequest, request_logs


async def test_replies_arrive_in_order_until_eof(bus) -> None:
    subject = bus.subjects.logs("cn-north-1", "cn-north-1-c1")

    async def agent(msg) -> None:
        for reply in (LogReply(data="a\n"), LogReply(data="b\n"), LogReply(eof=True)):
            await bus.nc.publish(msg.reply, reply.model_dump_json().encode())

    sub = await bus.nc.subscribe(subject, cb=agent)
    try:
        got = [r async for r in request_logs(bus.nc, subject, LogRequest(job_id="j1", attempt=1), timeout_s=2)]
    finally:
        await sub.unsubscribe()
    assert [(r.data, r.eof) for r in got] == [("a\n", False), ("b\n", False), ("", True)]


@pytest.mark.parametrize("listening", [True, False], ids=["silent-agent", "no-agent"])
async def test_an_agent_that_does_not_answer_is_unavailable_within_the_timeout(bus, listening) -> None:
    subject = bus.subjects.logs("cn-north-1", "cn-north-1-c2")

    async def silent(msg) -> None:
        return None

    sub = await bus.nc.subscribe(subject, cb=silent) if listening else None
    started = time.monotonic()
    try:
        with pytest.raises(UnavailableError):
            [r async for r in request_logs(bus.nc, subject, LogRequest(job_id="j1", attempt=1), timeout_s=0.3)]
    finally:
        if sub is not None:
            await sub.unsubscribe()
    assert time.monotonic() - started < 3
