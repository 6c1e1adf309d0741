"""The region agent's rules as tables: placements and stop orders in, clock advances, status out.

A real :class:`~services.inventory.agent.ClusterAgent` on a fake publisher and a fake clock
(:mod:`tests.builders`), no NATS, no sleeps: each step hands it deliveries (as its durable
consumer would) or lets business time pass and ends what is due (as its ticker would); the
status events it publishes are compared as (type, job, attempt, reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fedsched.events import Subjects
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec, stop_order

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")


@dataclass
class AgentCase:
    id: str
    steps: list
    backend: dict = field(default_factory=dict)
    node_count: int = 1


@dataclass
class Place:
    job: str
    gpus: int
    bindings: list
    attempt: int = 1
    resume_from_s: float = 0.0
    kw: dict = field(default_factory=dict)


@dataclass
class Stop:
    job: str
    reason: str
    checkpoint_interval_s: float = 0.0
    attempt: int = 1


@dataclass
class Advance:
    seconds: float


@dataclass
class NodeDown:
    """The drill ``ClusterAgent.set_node_health(node, False)``, then a drain (as the ticker would)."""

    node: str


@dataclass
class Expect:
    """Exactly these status events since the previous Expect: (type, job, attempt, reason)."""

    events: list
    progress_s: float | None = None  # of the last one, when given


CASES = [
    AgentCase("a placement that fits starts and ends on time", [
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Expect([("job.started", "j1", 1, "")]),
        Advance(599), Expect([]),
        Advance(1), Expect([("job.finished", "j1", 1, "")]),
    ]),
    AgentCase("a redelivered placement is not started twice", [
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Expect([("job.started", "j1", 1, "")]),
    ]),
    AgentCase("a placement that would over-commit a GPU is rejected, never started", [
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Place("j2", 1, [("n0", (3,))]),
        Expect([("job.started", "j1", 1, ""), ("job.rejected", "j2", 1, "GPU 3 of n0 has 0m free, needs 1000m")]),
    ]),
    AgentCase("a placement on a node the cluster does not have is rejected", [
        Place("j1", 1, [("elsewhere", (0,))]),
        Expect([("job.rejected", "j1", 1, "node elsewhere is not in cluster cn-north-1-c1")]),
    ]),
    AgentCase("a stopped job frees its GPUs for the next placement", [
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Stop("j1", "preempted"),
        Place("j2", 8, [("n0", tuple(range(8)))]),
        Expect([("job.started", "j1", 1, ""), ("job.stopped", "j1", 1, "preempted"), ("job.started", "j2", 1, "")]),
    ]),
    AgentCase("a preempted checkpointable job reports its whole checkpoints as progress", [
        Place("j1", 8, [("n0", tuple(range(8)))], kw=dict(checkpointable=True, preemptible=True)),
        Advance(4200),
        Stop("j1", "preempted", checkpoint_interval_s=1800),
        Expect([("job.started", "j1", 1, ""), ("job.stopped", "j1", 1, "preempted")], progress_s=3600),
    ], dict(runtime_s=7200)),
    AgentCase("a resumed attempt runs only the rest", [
        Place("j1", 8, [("n0", tuple(range(8)))], attempt=2, resume_from_s=3600),
        Advance(3599), Expect([("job.started", "j1", 2, "")]),
        Advance(1), Expect([("job.finished", "j1", 2, "")]),
    ], dict(runtime_s=7200)),
    AgentCase("a stop before the placement arrives means it never starts", [
        Stop("j1", "reclaimed"),
        Place("j1", 8, [("n0", tuple(range(8)))]),
        Expect([]),
    ]),
    AgentCase("a failing attempt reports job.failed at its end", [
        Place("j1", 1, [("n0", (0,))]),
        Advance(600),
        Expect([("job.started", "j1", 1, ""), ("job.failed", "j1", 1, "exited with failure (trace outcome)")]),
    ], dict(outcome="failed")),
    # fencing by attempt
    AgentCase("a placement of an attempt older than one already seen is refused as superseded", [
        Place("j1", 1, [("n0", (0,))], attempt=2),
        Place("j1", 1, [("n0", (1,))], attempt=1),
        Expect([("job.started", "j1", 2, ""), ("job.rejected", "j1", 1, "superseded")]),
    ]),
    AgentCase("a newer attempt's placement stops the older attempt still running here", [
        Place("j1", 8, [("n0", tuple(range(8)))], attempt=1),
        Place("j1", 8, [("n0", tuple(range(8)))], attempt=2),
        Expect([("job.started", "j1", 1, ""), ("job.stopped", "j1", 1, "superseded"), ("job.started", "j1", 2, "")]),
        Advance(600), Expect([("job.finished", "j1", 2, "")]),
    ]),
    AgentCase("a stop order for attempt 2 stops attempt 1 and fences it", [
        Place("j1", 8, [("n0", tuple(range(8)))], attempt=1),
        Stop("j1", "cluster_lost", attempt=2),
        Place("j1", 8, [("n0", tuple(range(8)))], attempt=1),
        Advance(600),
        Expect([("job.started", "j1", 1, ""), ("job.stopped", "j1", 1, "superseded")]),
    ]),
    AgentCase("cluster_lost for the running attempt stops it; it never reports an end", [
        Place("j1", 1, [("n0", (0,))]),
        Stop("j1", "cluster_lost"),
        Advance(600),
        Expect([("job.started", "j1", 1, ""), ("job.stopped", "j1", 1, "cluster_lost")]),
    ]),
    # gangs on failing nodes
    AgentCase("a node failing under one worker fails the whole gang once, frees every worker's GPUs", [
        Place("g", 8, [("n0", tuple(range(8))), ("n1", tuple(range(8)))], kw=dict(workers=2)),
        NodeDown("n1"),
        Expect([("job.started", "g", 1, ""), ("job.failed", "g", 1, "node_failed")]),
        Place("j2", 8, [("n0", tuple(range(8)))]),
        Advance(600),
        Expect([("job.started", "j2", 1, ""), ("job.finished", "j2", 1, "")]),
    ], node_count=2),
    AgentCase("a node failing under no worker leaves the gang running", [
        Place("g", 8, [("n0", tuple(range(8))), ("n1", tuple(range(8)))], kw=dict(workers=2)),
        NodeDown("n2"),
        Advance(600),
        Expect([("job.started", "g", 1, ""), ("job.finished", "g", 1, "")]),
    ], node_count=3),
    AgentCase("a placement on a failed node is refused", [
        NodeDown("n0"),
        Place("j1", 1, [("n0", (0,))]),
        Expect([("job.rejected", "j1", 1, "node n0 is not healthy")]),
    ]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_agent_table(case: AgentCase) -> None:
    clock, publisher = FakeClock(), FakePublisher()
    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n", case.node_count), clock=clock, **case.backend), publisher=publisher,
                         subjects=SUBJECTS)
    placements: dict[tuple[str, int], object] = {}
    seen = seq = 0
    for step in case.steps:
        seq += 1
        if isinstance(step, Place):
            job = spec(gpus=step.gpus, **step.kw)
            env = placement(step.job, job, CLUSTER.name, CLUSTER.region, step.bindings, attempt=step.attempt,
                            at=clock.time(), resume_from_s=step.resume_from_s)
            placements[(step.job, step.attempt)] = env
            await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), seq, clock.time())])
        elif isinstance(step, Stop):
            placed = placements.get((step.job, step.attempt)) or placement(
                step.job, spec(), CLUSTER.name, CLUSTER.region, [("n0", (0,))], attempt=step.attempt)
            env = stop_order(placed, step.reason, clock.time(), checkpoint_interval_s=step.checkpoint_interval_s)
            await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), seq, clock.time())])
        elif isinstance(step, NodeDown):
            agent.set_node_health(step.node, False)
            await agent.finish_due()
        elif isinstance(step, Advance):
            clock.advance(step.seconds)
            await agent.finish_due()
        elif isinstance(step, Expect):
            new = publisher.published[seen:]
            seen = len(publisher.published)
            assert [(p.event.type, p.event.job_id, p.event.attempt, p.event.payload.get("reason", ""))
                    for p in new] == step.events
            assert all(p.subject == SUBJECTS.status(CLUSTER.region, CLUSTER.name) for p in new)
            if step.progress_s is not None:
                assert new[-1].event.payload["progress_s"] == step.progress_s
            for p in new:
                if p.event.payload.get("reason") == "node_failed":
                    assert p.event.payload["exit_code"] is None
    # whatever happened, the ledger is back to what still runs: nothing is allocated twice
    held = sum(1000 * len(b.gpu_indices) for j in agent.running.values() for b in j.placed.bindings)
    free = sum(sum(led.gpu_free) for led in agent.ledger.values())
    assert free + held == 1000 * 8 * case.node_count


async def test_an_agent_without_a_bus_needs_a_publisher() -> None:
    with pytest.raises(ValueError):
        ClusterAgent(None, FakeClock(), CLUSTER, StaticBackend(nodes("n"), clock=FakeClock()))


async def test_log_requests_answer_for_attempts_that_ran_here_only() -> None:
    from fedsched.logs import LogRequest

    clock, publisher = FakeClock(), FakePublisher()
    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n"), clock=clock), publisher=publisher,
                         subjects=SUBJECTS)
    env = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], at=clock.time())
    await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, clock.time())])

    async def ask(**kw):
        return [r async for r in agent.serve_logs(LogRequest(job_id="j1", attempt=1, **kw))]

    ran = await ask()
    assert [(r.code, r.eof) for r in ran] == [("no_logs", True)] and "trace backend keeps no logs" in ran[0].error
    assert [r.code for r in await ask(worker=1)] == ["not_found"]  # a 1-worker job
    assert [(r.code, r.eof) for r in [r async for r in agent.serve_logs(LogRequest(job_id="j1", attempt=2))]] == [
        ("not_found", True)]
    clock.advance(600)
    await agent.finish_due()  # ended: still answered
    assert [r.code for r in await ask()] == ["no_logs"]
    agent.backend._ended.clear()  # the backend forgot the ended attempt (it keeps 4096); the agent did not
    assert [r.code for r in await ask()] == ["no_logs"]


class FlakyBackend(StaticBackend):
    """Refuses the next launches with the given errors, then behaves; stops fail likewise."""

    def __init__(self, *a, launch_errors=(), stop_errors=(), **kw) -> None:
        super().__init__(*a, **kw)
        self.launch_errors = list(launch_errors)
        self.stop_errors = list(stop_errors)

    async def launch(self, attempt) -> None:
        if self.launch_errors:
            raise self.launch_errors.pop(0)
        await super().launch(attempt)

    async def stop(self, key, reason) -> None:
        if self.stop_errors:
            raise self.stop_errors.pop(0)
        await super().stop(key, reason)


async def test_backend_errors_retry_the_transient_and_report_the_permanent() -> None:
    from fedsched.errors import UnavailableError
    from services.inventory.backend import BackendError, BackendUnavailable

    clock, publisher = FakeClock(), FakePublisher()
    backend = FlakyBackend(nodes("n"), clock=clock, launch_errors=[BackendUnavailable("api down"),
                                                                     BackendError("bad image", retryable=False)],
                           stop_errors=[BackendUnavailable("api down")])
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    sub = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    j1 = placement("j1", spec(gpus=8), CLUSTER.name, CLUSTER.region, [("n0", tuple(range(8)))], at=clock.time())
    with pytest.raises(UnavailableError):  # transient: the consumer naks, the placement comes again
        await agent.handle([delivery(j1, sub, 1, clock.time())])
    assert not agent.running and sum(agent.ledger["n0"].gpu_free) == 8000
    j2 = placement("j2", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], at=clock.time())
    await agent.handle([delivery(j2, sub, 2, clock.time())])  # permanent: reported, resources back
    await agent.handle([delivery(j1, sub, 1, clock.time())])  # the redelivery starts it
    stop = stop_order(j1, "preempted", clock.time())
    await agent.handle([delivery(stop, sub, 3, clock.time())])  # the backend's stop fails once ...
    assert [o.key.job_id for o in await backend.list_attempts()] == ["j1"]
    await agent.finish_due()  # ... and is retried
    assert await backend.list_attempts() == []
    assert [(p.event.type, p.event.job_id, p.event.payload["reason"]) for p in publisher.published] == [
        ("job.failed", "j2", "launch failed: bad image"), ("job.started", "j1", ""), ("job.stopped", "j1", "preempted")]


class CountingPublisher(FakePublisher):
    """A fake publisher that counts its calls and, while ``down`` is true, acknowledges nothing."""

    def __init__(self) -> None:
        super().__init__(refuse=lambda subject, event: self.down)
        self.down = False
        self.single = 0
        self.batches: list[int] = []

    async def publish(self, subject, event, *, headers=None):
        self.single += 1
        return await super().publish(subject, event, headers=headers)

    async def publish_many(self, items):
        self.batches.append(len(items))
        return await super().publish_many(items)


async def test_a_batch_of_placements_is_reported_in_one_publish_and_an_unacknowledged_report_is_sent_again() -> None:
    """Issue 15: the statuses a drain finds go out in one ``publish_many`` (one flush, the acks
    awaited together), once per consumer batch -- not one publish round trip per placement --
    and one not acknowledged leaves the agent's state as it was and is reported at the next drain."""
    clock, publisher = FakeClock(), CountingPublisher()
    agent = ClusterAgent(None, clock, CLUSTER, StaticBackend(nodes("n", 2), clock=clock), publisher=publisher,
                         subjects=SUBJECTS)
    sub = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    batch = [delivery(placement(f"j{i}", spec(gpus=1), CLUSTER.name, CLUSTER.region, [(f"n{i % 2}", (i // 2,))],
                                at=clock.time()), sub, i + 1, clock.time()) for i in range(10)]
    await agent.handle(batch)
    assert publisher.single == 0 and publisher.batches == [10]
    assert [p.event.job_id for p in publisher.published] == [f"j{i}" for i in range(10)]
    assert all(p.event.type == "job.started" for p in publisher.published)

    publisher.down = True
    clock.advance(600)
    from fedsched.errors import UnavailableError
    with pytest.raises(UnavailableError):
        await agent.finish_due()
    assert len(agent.running) == 10  # nothing ended here before its report is on the bus
    assert sum(sum(n.gpu_free) for n in agent.ledger.values()) == 16000 - 10000
    publisher.down = False
    assert await agent.finish_due() == 10  # reported again (the backend hands each change over once)
    assert [p.event.type for p in publisher.published[10:]] == ["job.finished"] * 10
    assert not agent.running and sum(sum(n.gpu_free) for n in agent.ledger.values()) == 16000
