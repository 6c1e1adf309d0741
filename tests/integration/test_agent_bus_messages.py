"""How many NATS messages a region agent exchanges per placement it takes (issue 15): the
agent's connection's own counters (``nc.stats``: protocol messages sent and received, acks,
pull requests and their status replies, KV reads and publish acks included) on a real
nats-server, for placements published as a scheduler cycle does (a burst) and one at a time;
and how many socket writes carry what it sends (each one a system call and a wake-up of the
server: a third of the agents process's samples in a profile)."""

import asyncio
import math
import time

import pytest

from fedsched.bus import Bus
from fedsched.clock import SystemClock
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import StaticBackend, nodes, placement, spec, until

NORTH = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))


class _CountingWrites:
    """Counts the writes of a connection's transport (wrapping it: every write still goes out)."""

    def __init__(self, transport) -> None:
        self.inner = transport
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1
        self.inner.write(data)

    def writelines(self, lines) -> None:
        self.writes += 1
        self.inner.writelines(lines)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _run(bus, *, jobs: int, burst: int) -> dict:
    """Publish ``jobs`` placements for one agent in bursts of ``burst`` (each burst after the
    previous one started); returns the messages the agent sent and received and the socket
    writes it made (counts), the batches its consumer handled and the seconds it took."""
    clock = SystemClock()
    own = await Bus.connect(bus.nc.connected_url.geturl(), bus.prefix, name="agent-under-test")
    agent = ClusterAgent(own, clock, NORTH, StaticBackend(nodes("n", jobs // 8 + 1, gpus=8), clock=clock,
                                                          runtime_s=None),
                         heartbeat_interval_s=3600, tick_s=0.01)
    task = asyncio.create_task(agent.run())
    try:
        # counted once the consumer has made its durable (its info and create requests are start-up
        # work: with the create asked again while unanswered they may land after the first snapshot)
        assert await until(lambda: agent._consumer is not None and agent._consumer._sub is not None
                           and agent.sequence >= 2, timeout=10)
        await asyncio.sleep(0)  # (the first heartbeat and snapshot are out: counted from here)
        stats0, batches0, t0 = dict(own.nc.stats), agent._consumer.batches, time.monotonic()
        own.nc._transport = counting = _CountingWrites(own.nc._transport)
        job = spec()
        subject = bus.subjects.placements(NORTH.region, NORTH.name)
        for first in range(0, jobs, burst):
            items = [(subject, placement(f"j{i}", job, NORTH.name, NORTH.region, [(f"n{i // 8}", (i % 8,))],
                                         at=time.time()), None) for i in range(first, min(jobs, first + burst))]
            assert all(await bus.publish_many(items))
            last = agent.running.get((items[-1][1].job_id, 1, 0))
            assert await until(lambda: (last := agent.running.get((items[-1][1].job_id, 1, 0))) is not None
                               and last.started_at is not None, timeout=20, interval=0.005)
        assert await until(lambda: agent._consumer.processed >= jobs, timeout=10, interval=0.005)
        return {"sent": own.nc.stats["out_msgs"] - stats0["out_msgs"],
                "received": own.nc.stats["in_msgs"] - stats0["in_msgs"], "writes": counting.writes,
                "batches": agent._consumer.batches - batches0, "seconds": time.monotonic() - t0,
                "max_wait_s": agent._consumer.max_wait_s}
    finally:
        agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await own.close()


@pytest.mark.parametrize("burst", [50, 5, 1], ids=["cycle-bursts", "bursts-of-5", "one-at-a-time"])
async def test_messages_per_placement_stay_bounded(bus, burst):
    """Per placement: its delivery, its ack, its ``job.started`` and that publish's ack (4
    messages). Per batch the consumer handles: the pull requests (a lingering one for the first
    message, a no-wait one for the rest, with its "no messages" status) and the lease read
    (request and reply), at most 6; and while idle a lingering pull request every
    ``max_wait_s`` with its timeout status (2). Socket writes: per batch the pull requests, the
    lease read, the status publishes and the acks -- the acks leave with the next pull request
    (:meth:`fedsched.bus.PullFetcher.fetch_fast`) -- at most 4, and one per idle pull. Measured (2026-12-02):
    in bursts of 50, 8 batches for 200 placements, 2.10 + 2.08 messages and 0.14 writes per
    placement; in bursts of 5, 42 batches, 2.62 + 2.42 and 0.83; one at a time, 4 + 3 and 3.
    How a burst splits into batches depends on timing (a loaded machine takes a burst in more,
    smaller batches: CI once saw 2.33 + 2.32 and 0.84), so the bounds are per placement plus
    per batch, and a burst must still arrive in batches."""
    jobs = 200
    got = await _run(bus, jobs=jobs, burst=burst)
    # lingering pulls that expired: a whole number, each window of max_wait_s begun one more
    batches, idle = got["batches"], math.ceil(got["seconds"] / got["max_wait_s"]) + 1
    print(f"burst {burst}: agent sent {got['sent'] / jobs:.2f}, received {got['received'] / jobs:.2f} messages, "
          f"made {got['writes'] / jobs:.2f} socket writes per placement, in {batches} batches, {got['seconds']:.2f} s")
    assert 4 * jobs <= got["sent"] + got["received"] <= 4 * jobs + 6 * batches + 2 * idle
    assert got["writes"] <= 4 * batches + idle
    if burst == 1:
        assert batches == jobs
    elif burst >= 50:  # the point of bursts: far fewer batches than placements
        assert batches <= jobs // 4
