"""What the region agent keeps cheaply (issue 15) says what the whole record says.

* A running attempt keeps its placement without the scheduler's explanations
  (:func:`~services.inventory.agent.kept_placement`), and everything it reports is what it
  would report from the whole placement.
"""

from __future__ import annotations

from fedsched.events import Envelope, JobPlaced, Subjects
from services.inventory.agent import ClusterAgent, kept_placement
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
EVALUATIONS = tuple({"cluster": c, "region": "cn-north-1", "passed": True, "reason": "", "detail": "",
                     "scores": {"home": 1.0, "price": 0.5}, "total": 1.5} for c in ("a", "b", "c"))


def _placed(job_id: str, bindings, *, gpus: int = 1, attempt: int = 1, at: float = 0.0) -> Envelope:
    env = placement(job_id, spec(gpus=gpus, cpu_milli=2000, memory_mib=4096), CLUSTER.name, CLUSTER.region,
                    bindings, attempt=attempt, at=at)
    p = env.payload_as(JobPlaced)
    rich = p.model_copy(update={"evaluations": EVALUATIONS, "explanation": "home region, cheapest",
                                "counterfactual": "a cheaper cluster was full"})
    return env.model_copy(update={"payload": rich.model_dump(mode="json")})


async def test_a_running_attempt_keeps_its_placement_without_the_explanations_and_reports_the_same():
    clock, publisher = FakeClock(), FakePublisher()
    backend = StaticBackend(nodes("n", 1, gpus=8), clock=clock, runtime_s=10.0)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    t0 = clock.time()
    env = _placed("a", [("n0", (2,))], at=t0)
    whole = env.payload_as(JobPlaced)
    assert whole.evaluations and whole.explanation and whole.counterfactual
    await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, clock.time())])
    kept = agent.running[("a", 1, 0)].placed
    assert kept == kept_placement(whole)
    assert (kept.evaluations, kept.explanation, kept.counterfactual) == ((), "", "")
    assert kept.model_copy(update={"evaluations": whole.evaluations, "explanation": whole.explanation,
                                   "counterfactual": whole.counterfactual}) == whole
    assert kept_placement(kept) is kept  # nothing to leave out: no copy
    clock.advance(10.0)
    await agent.finish_due()
    started, finished = (p.event for p in publisher.published)
    # what the whole placement would have reported
    assert started.payload == agent._status_item("job.started", agent_ref(started), whole, t0,
                                                 started_at=t0)[1].payload
    assert finished.payload == agent._status_item("job.finished", agent_ref(finished), whole, t0 + 10.0,
                                                  started_at=t0, exit_code=0)[1].payload


def agent_ref(event: Envelope):
    from services.inventory.agent import AttemptRef

    return AttemptRef.of(event)
