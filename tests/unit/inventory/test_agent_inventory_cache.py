"""What the region agent keeps to report its inventory cheaply (issue 15) says what a fresh
look at its ledger says.

* The snapshot payload is made from the entries of the previous snapshot, redoing only the
  nodes that changed (:meth:`ClusterAgent.snapshot_payload`): after placements, ends, stops, a
  node failure, a drain or taint seen in the backend's inventory and a node added, it equals
  ``snapshot().model_dump(mode="json")`` (every node dumped afresh), and a payload already
  published is never changed by what happens after.
* The heartbeat's totals (GPUs, milli-GPUs free) are kept as allocations change: they equal the
  sums over the ledger.
* A running attempt keeps its placement without the scheduler's explanations
  (:func:`~services.inventory.agent.kept_placement`), and everything it reports is what it
  would report from the whole placement.
"""

from __future__ import annotations

import copy

from fedsched.events import Envelope, InventorySnapshot, JobPlaced, Subjects
from services.inventory.agent import ClusterAgent, kept_placement
from services.inventory.trace import ClusterDef
from tests.builders import (FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec, stop_order)

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
EVALUATIONS = tuple({"cluster": c, "region": "cn-north-1", "passed": True, "reason": "", "detail": "",
                     "scores": {"home": 1.0, "price": 0.5}, "total": 1.5} for c in ("a", "b", "c"))


def _fresh(agent: ClusterAgent) -> dict:
    return agent.snapshot().model_dump(mode="json")


def _totals(agent: ClusterAgent) -> tuple[int, int]:
    return (sum(len(led.gpu_free) for led in agent.ledger.values()),
            sum(sum(led.gpu_free) for led in agent.ledger.values()))


def _placed(job_id: str, bindings, *, gpus: int = 1, attempt: int = 1, at: float = 0.0) -> Envelope:
    env = placement(job_id, spec(gpus=gpus, cpu_milli=2000, memory_mib=4096), CLUSTER.name, CLUSTER.region,
                    bindings, attempt=attempt, at=at)
    p = env.payload_as(JobPlaced)
    rich = p.model_copy(update={"evaluations": EVALUATIONS, "explanation": "home region, cheapest",
                                "counterfactual": "a cheaper cluster was full"})
    return env.model_copy(update={"payload": rich.model_dump(mode="json")})


async def test_the_cached_snapshot_payload_equals_a_fresh_one_as_the_ledger_changes():
    clock, publisher = FakeClock(), FakePublisher()
    backend = StaticBackend(nodes("n", 4, gpus=8), clock=clock, runtime_s=30.0)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    subject = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    seq = 0

    async def place(job_id, bindings, **kw):
        nonlocal seq
        seq += 1
        env = _placed(job_id, bindings, at=clock.time(), **kw)
        await agent.handle([delivery(env, subject, seq, clock.time())])
        return env

    assert agent.snapshot_payload() == _fresh(agent)  # every node dumped for the first time
    first = agent.snapshot_payload()
    published = copy.deepcopy(first)
    await place("a", [("n0", (0, 1))], gpus=2)
    await place("b", [("n1", (3,))])
    now = agent.snapshot_payload()
    assert now == _fresh(agent) and now != first
    assert first == published  # what an earlier snapshot published is never changed afterwards
    assert now["nodes"][2] is first["nodes"][2]  # an untouched node's entry is reused, not dumped again
    assert now["nodes"][0]["gpu_free_milli"] == [0, 0, 1000, 1000, 1000, 1000, 1000, 1000]
    assert now["running_jobs"] == 2 and now["running"] == []  # a count, not every attempt's id (issue 15)

    clock.advance(30.0)  # both end: resources back
    await agent.finish_due()
    assert agent.snapshot_payload() == _fresh(agent)
    a = await place("c", [("n2", (0,))])
    await agent.handle([delivery(stop_order(a, "preempted", clock.time()), subject, seq + 1, clock.time())])
    assert agent.snapshot_payload() == _fresh(agent)

    agent.set_node_health("n3", False)  # the drill: health on the ledger and the backend
    assert agent.snapshot_payload() == _fresh(agent)
    seen = backend._nodes["n1"].model_copy(update={"unschedulable": True, "taints": ("gpu=broken",)})
    extra = nodes("m", 1, gpus=4)[0]
    agent._merge_inventory([seen, extra])  # a refresh showing a drain and taint, and a new node
    payload = agent.snapshot_payload()
    assert payload == _fresh(agent) and len(payload["nodes"]) == 5
    assert payload["nodes"][1]["unschedulable"] is True and payload["nodes"][4]["name"] == extra.name
    assert InventorySnapshot.model_validate(payload) == agent.snapshot()


async def test_a_published_snapshot_carries_the_cached_payload_and_the_envelope_make_event_makes():
    clock, publisher = FakeClock(), FakePublisher()
    backend = StaticBackend(nodes("n", 2, gpus=8), clock=clock, runtime_s=None)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    await agent.handle([delivery(_placed("a", [("n1", (5,))], at=clock.time()),
                                 SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, clock.time())])
    await agent.publish_snapshot()
    event = publisher.published[-1].event
    assert publisher.published[-1].subject == SUBJECTS.inventory(CLUSTER.region, CLUSTER.name)
    assert event.type == "inventory.snapshot" and event.producer == event.actor == "agent/cn-north-1-c1"
    assert (event.region, event.zone, event.cluster) == (CLUSTER.region, CLUSTER.zone, CLUSTER.name)
    assert event.occurred_at.timestamp() == clock.time()
    assert event.payload == _fresh(agent) and event.payload_as(InventorySnapshot) == agent.snapshot()
    assert Envelope.from_bytes(event.to_bytes()) == event


async def test_heartbeat_totals_are_the_ledger_sums_as_allocations_change():
    clock, publisher = FakeClock(), FakePublisher()
    backend = StaticBackend(nodes("n", 3, gpus=8), clock=clock, runtime_s=20.0)
    agent = ClusterAgent(None, clock, CLUSTER, backend, publisher=publisher, subjects=SUBJECTS)
    subject = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    assert (agent._gpus_total, agent._gpu_milli_free) == _totals(agent) == (24, 24000)
    for i in range(10):
        env = _placed(f"j{i}", [(f"n{i % 3}", (i // 3, i // 3 + 4))], gpus=2, at=clock.time())
        await agent.handle([delivery(env, subject, i + 1, clock.time())])
        clock.advance(3.0)
        await agent.finish_due()
        assert (agent._gpus_total, agent._gpu_milli_free) == _totals(agent)
    agent._merge_inventory(nodes("m", 2, gpus=4))
    clock.advance(60.0)
    await agent.finish_due()
    assert not agent.running and (agent._gpus_total, agent._gpu_milli_free) == _totals(agent) == (32, 32000)
    await agent.publish_heartbeat()
    beat = publisher.published[-1].event.payload
    assert (beat["gpus_total"], beat["gpu_milli_free"], beat["running_jobs"]) == (32, 32000, 0)


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
