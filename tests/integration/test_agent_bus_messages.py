"""How many NATS messages a region agent exchanges per placement it takes (issue 15): the
agent's connection's own counters (``nc.stats``: protocol messages sent and received, acks,
pull requests and their status replies, KV reads and publish acks included) on a real
nats-server, for placements published as a scheduler cycle does (a burst) and one at a time;
and how many socket writes carry what it sends (each one a system call and a wake-up of the
server: a third of the agents process's samples in a profile)."""

import asyncio
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


async def _run(bus, *, jobs: int, burst: int) -> tuple[float, float, float]:
    """Publish ``jobs`` placements for one agent in bursts of ``burst`` (each burst after the
    previous one started); returns (messages the agent sent, received, socket writes it made)
    per placement."""
    clock = SystemClock()
    own = await Bus.connect(bus.nc.connected_url.geturl(), bus.prefix, name="agent-under-test")
    agent = ClusterAgent(own, clock, NORTH, StaticBackend(nodes("n", jobs // 8 + 1, gpus=8), clock=clock,
                                                          runtime_s=None),
                         heartbeat_interval_s=3600, tick_s=0.01)
    task = asyncio.create_task(agent.run())
    try:
        assert await until(lambda: agent._consumer is not None and agent.sequence >= 2, timeout=10)
        await asyncio.sleep(0)  # (the first heartbeat and snapshot are out: counted from here)
        stats0 = dict(own.nc.stats)
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
        out = own.nc.stats["out_msgs"] - stats0["out_msgs"]
        got = own.nc.stats["in_msgs"] - stats0["in_msgs"]
        return out / jobs, got / jobs, counting.writes / jobs
    finally:
        agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await own.close()


@pytest.mark.parametrize("burst,most,writes", [(50, 4.5, 0.2), (1, 7.5, 3.2)], ids=["cycle-bursts", "one-at-a-time"])
async def test_messages_per_placement_stay_bounded(bus, burst, most, writes):
    """Per placement at least: its delivery, its ack, its ``job.started`` and that publish's ack
    (4). Per batch: the pull requests (a lingering one for the first message, a no-wait one for
    the rest, with its "no messages" status) and the lease read (request and reply); and while
    idle a lingering pull request every ``max_wait_s`` (with its timeout status). Measured
    (2026-12-01): 2.1 + 2.1 per placement in bursts of 50, 4 + 3 one at a time. Socket writes
    per batch: the pull requests, the lease read, the status publishes, the acks -- the acks
    leave with the next pull request (:func:`fedsched.bus.fetch_fast`)."""
    sent, received, wrote = await _run(bus, jobs=200, burst=burst)
    print(f"burst {burst}: agent sent {sent:.2f}, received {received:.2f} messages, made {wrote:.2f} socket writes "
          f"per placement")
    assert 4 <= sent + received <= most
    assert wrote <= writes
