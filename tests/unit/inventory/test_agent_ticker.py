"""The agent's drain loop sleeps until the backend's next status is due, not a fixed 10 ms poll
(issue 15: six idle agents polling took ~2% of a core), and still reports ends and node failures
on time: a launch or a failure ends its sleep."""

from __future__ import annotations

import asyncio

import pytest

from fedsched.clock import SystemClock
from fedsched.events import Subjects
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec, until

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
PLACEMENTS = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)


def _agent(clock, runtime_s, *, idle_tick_s: float = 5.0, publisher=None) -> ClusterAgent:
    return ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n", 2), clock=clock, runtime_s=runtime_s),
                        publisher=publisher or FakePublisher(), subjects=SUBJECTS, tick_s=0.01, idle_tick_s=idle_tick_s)


async def _place(agent: ClusterAgent, job_id: str, node: str = "n0", seq: int = 1) -> None:
    env = placement(job_id, spec(), CLUSTER.name, CLUSTER.region, [(node, (0,))], at=agent.clock.time())
    await agent.handle([delivery(env, PLACEMENTS, seq, agent.clock.time())])


async def test_the_sleep_is_the_time_to_the_next_end_between_tick_and_idle_tick():
    agent = _agent(SystemClock(), runtime_s=2.0)
    assert agent.next_tick_s() == 5.0  # nothing runs: only a launch or a failure can change that
    await _place(agent, "j1")
    assert 1.5 < agent.next_tick_s() <= 2.0  # its end
    agent._stop_retry[next(iter(agent.backend._live))] = "preempted"  # a stop to retry: polling again
    assert agent.next_tick_s() == 0.01


@pytest.mark.parametrize("clock", [FakeClock(), None], ids=["replay-like-clock", "backend-without-next-due"])
async def test_it_polls_every_tick_when_business_time_is_not_wall_time_or_the_backend_cannot_say(clock):
    agent = _agent(clock or SystemClock(), runtime_s=2.0)
    if clock is None:
        agent.backend.next_due = None  # (a backend without the method: kubernetes, slurm)
    assert agent.next_tick_s() == 0.01


async def test_an_end_and_a_node_failure_are_reported_on_time_while_idle_sleeps_are_long():
    publisher = FakePublisher()
    agent = _agent(SystemClock(), runtime_s=None, publisher=publisher)
    agent._poked.set()
    ticker = asyncio.create_task(agent._ticker())
    asleep = lambda: not agent._poked.is_set()  # noqa: E731 - the loop clears it right before its sleep
    try:
        assert await until(asleep, timeout=2) and agent.next_tick_s() == 5.0
        agent.backend.runtime_s = 0.3
        await _place(agent, "short", "n0", 1)  # placed while the loop sleeps its 5 s: the launch wakes it
        assert await until(lambda: any(p.event.type == "job.finished" for p in publisher.published), timeout=2)
        agent.backend.runtime_s = None
        await _place(agent, "long", "n1", 2)
        assert await until(asleep, timeout=2) and agent.next_tick_s() == 5.0
        agent.set_node_health("n1", False)  # the failure wakes it (and a snapshot follows at once)
        assert await until(lambda: any(p.event.type == "job.failed" for p in publisher.published), timeout=2)
    finally:
        agent.stop()
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    assert [(p.event.type, p.event.job_id) for p in publisher.published if p.event.type.startswith("job.")] == [
        ("job.started", "short"), ("job.finished", "short"), ("job.started", "long"), ("job.failed", "long")]
