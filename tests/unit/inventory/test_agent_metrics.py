"""The region agent's metrics on fakes (no NATS, no sleeps): placements received (redeliveries
not counted), running jobs, backend errors by operation."""

from __future__ import annotations

from fedsched.events import Subjects
from fedsched.metrics import AgentMetrics
from services.inventory.agent import ClusterAgent
from services.inventory.backend import BackendError
from services.inventory.trace import ClusterDef
from tests.builders import FakeClock, FakePublisher, StaticBackend, delivery, nodes, placement, spec, stop_order

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")
LABELS = {"region": "cn-north-1", "cluster": "cn-north-1-c1"}


class FailingLaunch(StaticBackend):
    """Refuses every launch (not retryable)."""

    async def launch(self, attempt) -> None:
        raise BackendError("quota exceeded on the cluster", retryable=False)


def agent_on(backend_cls=StaticBackend):
    clock, m = FakeClock(), AgentMetrics()
    agent = ClusterAgent(None, clock, CLUSTER, backend_cls(nodes("n"), clock=clock), publisher=FakePublisher(),
                         subjects=SUBJECTS, metrics=m)
    return agent, clock, m


async def test_placements_received_and_running_jobs():
    agent, clock, m = agent_on()
    get = m.registry.get_sample_value
    assert get("fedsched_agent_running_jobs", LABELS) == 0
    subject = SUBJECTS.placements(CLUSTER.region, CLUSTER.name)
    envs = [placement(f"j{i}", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (i,))], at=clock.time())
            for i in range(3)]
    for seq, env in enumerate(envs, 1):
        await agent.handle([delivery(env, subject, seq, clock.time())])
    await agent.handle([delivery(envs[0], subject, 1, clock.time())])  # redelivered
    assert get("fedsched_agent_placements_received_total", LABELS) == 3
    assert get("fedsched_agent_running_jobs", LABELS) == 3
    await agent.handle([delivery(stop_order(envs[1], "preempted", clock.time()), subject, 4, clock.time())])
    assert get("fedsched_agent_running_jobs", LABELS) == 2
    clock.advance(600)
    await agent.finish_due()
    assert get("fedsched_agent_running_jobs", LABELS) == 0


async def test_backend_errors_are_counted_by_operation():
    agent, clock, m = agent_on(FailingLaunch)
    env = placement("j1", spec(gpus=1), CLUSTER.name, CLUSTER.region, [("n0", (0,))], at=clock.time())
    await agent.handle([delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, clock.time())])
    get = m.registry.get_sample_value
    assert get("fedsched_agent_backend_errors_total", {**LABELS, "operation": "launch"}) == 1
    assert get("fedsched_agent_backend_errors_total", {**LABELS, "operation": "stop"}) == 0
    assert get("fedsched_agent_running_jobs", LABELS) == 0
