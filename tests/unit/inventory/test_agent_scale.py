"""The region agent's due tracking does not walk its running set (issue 15, item 1).

A real :class:`~services.inventory.agent.ClusterAgent` on the trace backend's machinery (fakes:
clock, publisher) runs 300 attempts that never end while 10,000 short attempts are placed, run
and end in batches. Each drain (:meth:`ClusterAgent.finish_due`, what the ticker calls every
few ms) must visit only what ended: ``agent.last_drain_visits`` (statuses reported, stops
retried, gangs on failed nodes) and the backend's ``last_ready_visits`` (heap entries popped)
stay those of one batch, and an idle tick visits nothing.
"""

from __future__ import annotations

from fedsched.events import Subjects
from fedsched.jobs import AttemptState
from services.inventory.agent import ClusterAgent
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
LONG = 300
BATCH = 50
BATCHES = 200


class ForeverOrShort(StaticBackend):
    """Attempts annotated ``test.forever`` run until stopped; the others ``runtime_s``."""

    def plan(self, spec, started_at, *, attempt=1, resume_from_s=0.0):
        if spec.annotations.get("test.forever"):
            return None, AttemptState.SUCCEEDED
        return super().plan(spec, started_at, attempt=attempt, resume_from_s=resume_from_s)


async def test_drains_visit_what_ended_not_the_running_set_while_10000_attempts_end():
    clock, publisher = FakeClock(), FakePublisher()
    backend = ForeverOrShort(nodes("n", 48), clock=clock, runtime_s=600.0)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    subject = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    seq = 0

    async def place(job_id: str, node: str, device: int, **kw) -> None:
        nonlocal seq
        seq += 1
        env = placement(job_id, spec(**kw), CLUSTER.name, CLUSTER.region, [(node, (device,))], at=clock.time())
        await agent.handle([delivery(env, subject, seq, clock.time())])

    for i in range(LONG):
        await place(f"long{i}", f"n{i // 8}", i % 8, annotations={"test.forever": "1"})
    assert len(agent.running) == LONG

    drains, pops = [], []
    for b in range(BATCHES):
        for k in range(BATCH):
            await place(f"b{b}-{k}", f"n{40 + k // 8}", k % 8)
        assert len(agent.running) == LONG + BATCH
        clock.advance(600.0)
        ended = await agent.finish_due()
        assert ended == BATCH
        drains.append(agent.last_drain_visits)
        pops.append(backend.last_ready_visits)
        clock.advance(0.01)
        assert await agent.finish_due() == 0
        assert agent.last_drain_visits == 0 and backend.last_ready_visits == 0  # an idle tick: nothing
    assert len(agent.running) == LONG
    finished = sum(1 for p in publisher.published if p.event.type == "job.finished")
    assert finished == BATCH * BATCHES
    assert max(drains) == BATCH and max(pops) == BATCH  # exactly the attempts that ended
