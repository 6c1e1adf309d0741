"""The region agent refuses orders of a former active scheduler (fencing by scheduler lease).

A real :class:`~services.inventory.agent.ClusterAgent` on a fake publisher and clock. Rule
(``services/inventory/agent.py`` module docstring, issue 14 item 9): the agent keeps the highest
``fencing_token`` seen on its placements and stop orders; one with a lower token raises
:class:`~fedsched.errors.DecodeError` naming both tokens -- the durable consumer dead-letters it
with that reason -- and changes nothing.
"""

from __future__ import annotations

import pytest

from fedsched.errors import DecodeError
from fedsched.events import Subjects
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec, stop_order

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
SUB = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)


def _agent():
    clock, publisher = FakeClock(), FakePublisher()
    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n"), clock=clock, runtime_s=None),
                         publisher=publisher, subjects=SUBJECTS)
    return clock, publisher, agent


def _types(publisher: FakePublisher) -> list[tuple[str, str]]:
    return [(p.event.type, p.event.job_id) for p in publisher.published if p.event.type.startswith("job.")]


async def test_a_placement_with_a_stale_token_is_refused_and_not_started() -> None:
    clock, publisher, agent = _agent()
    new = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], fencing_token=7)
    await agent.handle([delivery(new, SUB, 1, clock.time())])
    late = placement("j2", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (1,))], fencing_token=5)
    with pytest.raises(DecodeError, match="stale fencing token.*token 5.*seen 7"):
        await agent.handle([delivery(late, SUB, 2, clock.time())])
    assert _types(publisher) == [("job.started", "j1")]
    assert set(agent.running) == {("j1", 1, 0)} and agent.stale_refused == 1
    assert sum(agent.ledger["n0"].gpu_free) == 7000


async def test_a_stop_order_with_a_stale_token_leaves_the_attempt_running() -> None:
    clock, publisher, agent = _agent()
    placed = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], fencing_token=9)
    await agent.handle([delivery(placed, SUB, 1, clock.time())])
    with pytest.raises(DecodeError, match="stale fencing token"):
        await agent.handle([delivery(stop_order(placed, "preempted", clock.time(), fencing_token=8), SUB, 2,
                                     clock.time())])
    assert ("j1", 1, 0) in agent.running
    await agent.handle([delivery(stop_order(placed, "preempted", clock.time(), fencing_token=9), SUB, 3,
                                 clock.time())])
    assert _types(publisher) == [("job.started", "j1"), ("job.stopped", "j1")]


async def test_a_newer_token_is_accepted_and_raises_the_bar() -> None:
    clock, publisher, agent = _agent()
    for seq, (job, token) in enumerate([("j1", 3), ("j2", 3), ("j3", 11)], start=1):
        env = placement(job, spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (seq,))], fencing_token=token)
        await agent.handle([delivery(env, SUB, seq, clock.time())])
    assert agent.highest_token == 11 and len(agent.running) == 3
    with pytest.raises(DecodeError):
        await agent.handle([delivery(placement("j4", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (5,))],
                                               fencing_token=3), SUB, 4, clock.time())])


async def test_a_redelivered_placement_that_was_accepted_is_not_dead_lettered_later() -> None:
    clock, publisher, agent = _agent()
    old = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], fencing_token=3)
    await agent.handle([delivery(old, SUB, 1, clock.time())])
    await agent.handle([delivery(placement("j2", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (1,))],
                                           fencing_token=4), SUB, 2, clock.time())])
    await agent.handle([delivery(old, SUB, 1, clock.time())])  # JetStream redelivers j1's placement
    assert agent.stale_refused == 0


async def test_an_end_not_published_while_the_bus_is_away_is_reported_by_the_next_drain() -> None:
    """Found by the three-node cluster drill: the end of an attempt was taken from the backend,
    the resources released, and the publish failed during a stream leader election -- the
    job stayed RUNNING forever. Now the status is kept and reported again."""
    from fedsched.errors import UnavailableError

    clock = FakeClock()
    away = {"on": False}
    publisher = FakePublisher(refuse=lambda subject, event: away["on"])
    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n"), clock=clock, runtime_s=600),
                         publisher=publisher, subjects=SUBJECTS)
    await agent.handle([delivery(placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))]), SUB, 1,
                                 clock.time())])
    await agent.finish_due()
    clock.advance(600)
    away["on"] = True
    with pytest.raises(UnavailableError):
        await agent.finish_due()
    assert ("j1", 1, 0) in agent.running  # not released: the end is not on the bus yet
    away["on"] = False
    assert await agent.finish_due() == 1
    assert _types(publisher) == [("job.started", "j1"), ("job.finished", "j1")]
    assert agent.running == {} and sum(agent.ledger["n0"].gpu_free) == 8000


async def test_an_order_below_the_leases_current_tenure_is_refused_before_any_order_of_the_new_holder() -> None:
    """The agent has seen no order at all; the lease KV says tenure 9 began at t=100. The former
    holder's order (token 5) stored at t=150 is refused; its order stored at t=50, while it held
    the lease, and read only now, is carried out; the new holder's order is carried out."""
    from fedsched.lease import Tenure

    clock, publisher = FakeClock(), FakePublisher()

    async def tenure():
        return Tenure(9, 100.0, "sched-b")

    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n"), clock=clock, runtime_s=None),
                         publisher=publisher, subjects=SUBJECTS, tenure=tenure)
    late = placement("late", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], fencing_token=5)
    with pytest.raises(DecodeError, match="stale fencing token: 5 is below 9.*held by sched-b"):
        await agent.handle([delivery(late, SUB, 2, 150.0)])
    early = placement("early", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (1,))], fencing_token=5)
    await agent.handle([delivery(early, SUB, 1, 50.0)])
    new = placement("new", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (2,))], fencing_token=9)
    await agent.handle([delivery(new, SUB, 3, 160.0)])
    assert _types(publisher) == [("job.started", "early"), ("job.started", "new")]
    assert agent.stale_refused == 1 and agent.highest_token == 9
