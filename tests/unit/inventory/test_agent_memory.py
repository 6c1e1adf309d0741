"""The region agent's records of ended attempts are bounded (issue 15 item 2): ``done`` and the
fencing records keep the newest ``retain_done`` only, while a redelivered placement of a recently
ended attempt is still recognised and not run again."""

from __future__ import annotations

from fedsched.events import Subjects
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
RETAIN = 500
JOBS = 3000


async def test_done_and_fencing_records_stay_bounded_while_3000_attempts_end():
    clock, publisher = FakeClock(), FakePublisher()
    backend = StaticBackend(nodes("n", 8), clock=clock, runtime_s=10.0)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS, retain_done=RETAIN)
    subject = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    seq = 0
    last = None
    for i in range(JOBS):
        seq += 1
        env = placement(f"j{i}", spec(), CLUSTER.name, CLUSTER.region, [(f"n{(i // 8) % 8}", (i % 8,))], at=clock.time())
        last = delivery(env, subject, seq, clock.time())
        await agent.handle([last])
        if i % 50 == 49:
            clock.advance(10.0)
            await agent.finish_due()
    clock.advance(10.0)
    await agent.finish_due()
    assert not agent.running
    finished = sum(1 for p in publisher.published if p.event.type == "job.finished")
    assert finished == JOBS
    assert len(agent.done) == RETAIN and len(agent.highest) == RETAIN
    await agent.handle([last])  # a redelivery of the newest placement: ended here, not run again
    assert not agent.running
