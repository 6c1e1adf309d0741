"""The execution backend contract (services/inventory/backend.py), run on every backend.

``backend_under_test`` (tests/contract/conftest.py) is parametrised over the backends; each
case drives the backend only through the :class:`~services.inventory.backend.Backend` protocol
and the harness (time passing, a node failing). Here it runs on ``trace``; the Slurm and
Kubernetes issues add theirs to the same fixture.
"""

from __future__ import annotations

import pytest

from fedsched.events import JobPlaced, JobStatus, Subjects, WorkerBinding
from services.inventory.agent import ClusterAgent
from services.inventory.backend import (NODE_FAILED, TERMINAL_PHASES, AttemptKey, AttemptNotFound, AttemptSpec, Backend,
                                        BackendError, NoLogsKept, Phase)
from services.inventory.trace import ClusterDef
from tests.builders import FakePublisher, delivery, placement

CLUSTER = ClusterDef("cn-north-1-c1", "cn-north-1", "cn-north-1a", "ethernet", "standard", ("cn",))
SUBJECTS = Subjects("t")


def attempt_of(h, job_id: str, job, *, attempt: int = 1, nodes: tuple[str, ...] | None = None) -> AttemptSpec:
    """An AttemptSpec binding worker i of ``job`` to ``nodes[i]`` (default: the harness's), GPU i."""
    nodes = nodes or h.nodes[:job.workers]
    bindings = tuple(WorkerBinding(worker=i, node=n, gpu_indices=tuple(range(job.gpus_per_worker)),
                                   gpu_milli=job.gpu_milli, cpu_milli=job.cpu_milli, memory_mib=job.memory_mib)
                     for i, n in enumerate(nodes))
    return AttemptSpec(AttemptKey(job_id, attempt, 0), job.tenant, job.project, job, h.card_model, bindings)


def phases(statuses, key: AttemptKey) -> list[Phase]:
    return [s.phase for s in statuses if s.key == key]


async def until_lines(h, key, timeout_s: float = 10.0) -> list[str]:
    """The attempt's output of worker 0 once it has any (a real workload writes it after it starts)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line async for line in h.backend.logs(key, 0)]
        if lines or time.monotonic() > deadline:
            return lines
        await asyncio.sleep(0.05)


async def drain_until(agent, publisher, count: int, timeout_s: float = 10.0) -> None:
    """Let the agent report what its backend observed until ``count`` events are published."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while len(publisher.published) < count and time.monotonic() < deadline:
        await agent.finish_due()
        await asyncio.sleep(0.05)


async def running_keys(h) -> set[AttemptKey]:
    return {o.key for o in await h.backend.list_attempts() if o.phase not in TERMINAL_PHASES}


def test_implements_the_protocol(backend_under_test):
    assert isinstance(backend_under_test.backend, Backend)
    assert backend_under_test.backend.kind
    assert isinstance(backend_under_test.backend.durable, bool)


async def test_inventory_lists_healthy_nodes_with_capacity(backend_under_test):
    h = backend_under_test
    inv = {n.name: n for n in await h.backend.inventory()}
    for name in h.nodes:
        assert inv[name].healthy and not inv[name].unschedulable
        assert inv[name].gpus == h.gpus_per_node and inv[name].card_model == h.card_model


async def test_launch_reports_pending_then_running_and_lists_it_under_its_labels(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "launch", h.job(runtime_s=600))
    await h.backend.launch(a)
    got = await h.statuses(lambda s: Phase.RUNNING in phases(s, a.key))
    assert phases(got, a.key) == [Phase.PENDING, Phase.RUNNING]
    observed = {o.key: o for o in await h.backend.list_attempts()}
    assert observed[a.key].phase == Phase.RUNNING
    assert observed[a.key].nodes == tuple(b.node for b in a.bindings)
    assert AttemptKey.from_labels(observed[a.key].labels) == a.key
    assert observed[a.key].labels["fedsched.io/tenant"] == a.tenant


async def test_relaunch_adopts_and_never_makes_a_second_copy(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "twice", h.job(runtime_s=600))
    await h.backend.launch(a)
    await h.backend.launch(a)
    got = await h.statuses(lambda s: Phase.RUNNING in phases(s, a.key))
    await h.advance(1)
    got += await h.statuses(lambda s: False, timeout_s=0.2)
    assert phases(got, a.key) == [Phase.PENDING, Phase.RUNNING]
    assert [o.key for o in await h.backend.list_attempts()].count(a.key) == 1


async def test_an_attempt_succeeds_after_its_runtime_with_exit_code_0(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "ok", h.job(runtime_s=60))
    await h.backend.launch(a)
    got = await h.statuses(lambda s: Phase.RUNNING in phases(s, a.key))
    started = next(s.at for s in got if s.key == a.key and s.phase == Phase.RUNNING)
    await h.advance(50)
    assert Phase.SUCCEEDED not in phases(await h.statuses(lambda s: False, timeout_s=0.2), a.key)
    await h.advance(10)
    end = [s for s in await h.statuses(lambda s: Phase.SUCCEEDED in phases(s, a.key)) if s.key == a.key]
    assert [(s.phase, s.exit_code) for s in end] == [(Phase.SUCCEEDED, 0)]
    assert 60 * h.time_scale - 1 <= end[0].at - started <= 60 * h.time_scale + h.start_overhead_s + 1
    assert a.key not in await running_keys(h)


async def test_a_failing_attempt_reports_its_exit_code_and_a_reason(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "bad", h.job(runtime_s=30, exit_code=3))
    await h.backend.launch(a)
    await h.advance(30)
    got = [s for s in await h.statuses(lambda s: Phase.FAILED in phases(s, a.key)) if s.key == a.key]
    failed = got[-1]
    assert failed.phase == Phase.FAILED
    assert failed.exit_code not in (None, 0)
    assert failed.reason or failed.message
    assert a.key not in await running_keys(h)


async def test_stop_ends_every_worker_and_is_idempotent(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "stopme", h.job(runtime_s=60, workers=2))
    await h.backend.launch(a)
    await h.statuses(lambda s: Phase.RUNNING in phases(s, a.key))
    await h.backend.stop(a.key, "preempted")
    await h.backend.stop(a.key, "preempted")
    await h.backend.stop(AttemptKey("never-launched", 1, 0), "cancelled")
    assert a.key not in await running_keys(h)
    await h.advance(120)
    assert not [p for p in phases(await h.statuses(lambda s: False, timeout_s=0.2), a.key) if p in TERMINAL_PHASES]


async def test_events_iterates_the_same_stream(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "stream", h.job(runtime_s=5))
    await h.backend.launch(a)
    stream = h.backend.events()
    first = await stream.__anext__()
    assert (first.key, first.phase) == (a.key, Phase.PENDING)
    assert (await stream.__anext__()).phase == Phase.RUNNING
    await h.advance(5)
    assert (await stream.__anext__()).phase == Phase.SUCCEEDED
    await stream.aclose()


async def test_a_failed_node_fails_the_whole_gang_and_shows_in_the_inventory(backend_under_test):
    h = backend_under_test
    h.require("node_failure")
    gang = attempt_of(h, "gang", h.job(runtime_s=600, workers=2), nodes=h.nodes[:2])
    other = attempt_of(h, "other", h.job(runtime_s=600), nodes=(h.nodes[2],))
    await h.backend.launch(gang)
    await h.backend.launch(other)
    await h.statuses(lambda s: Phase.RUNNING in phases(s, gang.key) and Phase.RUNNING in phases(s, other.key))
    h.fail_node(h.nodes[1])
    got = [s for s in await h.statuses(lambda s: Phase.FAILED in phases(s, gang.key)) if s.key == gang.key]
    assert (got[-1].phase, got[-1].reason, got[-1].exit_code) == (Phase.FAILED, NODE_FAILED, None)
    assert got[-1].node == h.nodes[1]
    inv = {n.name: n for n in await h.backend.inventory()}
    assert not inv[h.nodes[1]].healthy and inv[h.nodes[0]].healthy
    assert await running_keys(h) == {other.key}  # no worker of the gang runs on the healthy node


async def test_launch_on_a_node_the_cluster_does_not_have_is_refused_not_retryable(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "nowhere", h.job(runtime_s=5), nodes=("no-such-node",))
    with pytest.raises(BackendError) as e:
        await h.backend.launch(a)
    assert e.value.retryable is False
    assert a.key not in await running_keys(h)


async def test_logs_of_an_attempt_and_not_found_errors(backend_under_test):
    h = backend_under_test
    a = attempt_of(h, "logged", h.job(runtime_s=5))
    await h.backend.launch(a)
    await h.statuses(lambda s: Phase.RUNNING in phases(s, a.key))
    with pytest.raises(AttemptNotFound):
        [line async for line in h.backend.logs(a.key, 7)]
    if not h.keeps_logs:  # says so for its attempts, never an empty output or "not found"
        with pytest.raises(NoLogsKept):
            [line async for line in h.backend.logs(a.key, 0)]
        return
    lines = await until_lines(h, a.key)
    assert lines and all(isinstance(line, str) and "\n" not in line for line in lines)
    with pytest.raises(AttemptNotFound):
        [line async for line in h.backend.logs(AttemptKey("unknown", 1, 0))]


async def test_reconcile_adopts_the_live_attempt_and_stops_the_orphan(backend_under_test):
    """An agent restarting on a cluster that runs two fedsched attempts: its ledger has one (live,
    started), the other is unknown to it and an older attempt of the live job is also there."""
    h = backend_under_test
    # 300 s: long enough to outlive the launches and the reconcile (~4 s of wall time on Slurm at
    # its 0.05 time scale, so 15 s there), short enough that waiting for its end costs little
    job = h.job(runtime_s=300)
    live = attempt_of(h, "live", job, attempt=2, nodes=(h.nodes[0],))
    stale = attempt_of(h, "live", job, attempt=1, nodes=(h.nodes[1],))
    orphan = attempt_of(h, "orphan", job, nodes=(h.nodes[2],))
    for a in (live, stale, orphan):
        await h.backend.launch(a)
    await h.statuses(lambda s: all(Phase.RUNNING in phases(s, a.key) for a in (live, stale, orphan)))
    publisher = FakePublisher()
    agent = ClusterAgent(None, h.clock, CLUSTER, h.backend, publisher=publisher, subjects=SUBJECTS)
    await agent.refresh_inventory()
    env = placement("live", job, CLUSTER.name, CLUSTER.region, [(h.nodes[0], (0,))], attempt=2,
                    card_model=h.card_model)
    agent._see_attempt("live", 0, 2)  # as rebuild() does for every placement it folds
    ledger = {("live", 2, 0): (delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, 0.0),
                               env.payload_as(JobPlaced), agent.clock.time())}
    await agent.reconcile(ledger)
    assert sorted(agent.reconciled) == sorted([("adopted", str(live.key)), ("superseded", str(stale.key)),
                                               ("orphaned", str(orphan.key))])
    assert await running_keys(h) == {live.key}
    stops = [p.event for p in publisher.published if p.event.type == "job.stopped"]
    assert sorted((e.job_id, e.attempt, e.payload["reason"]) for e in stops) == [("live", 1, "superseded"),
                                                                                 ("orphan", 1, "orphaned")]
    assert all(e.payload["started_at"] is None for e in stops)
    # every action is also an audited agent.reconciled record, with the attempt's routing names
    records = [p.event for p in publisher.published if p.event.type == "agent.reconciled"]
    assert sorted((e.job_id, e.attempt, e.payload["reason"]) for e in records) == [
        ("live", 1, "superseded"), ("live", 2, "adopted"), ("orphan", 1, "orphaned")]
    assert all(e.cluster == CLUSTER.name and e.tenant == job.tenant for e in records)
    assert len(publisher.published) == len(stops) + len(records)
    # the adopted attempt is reported when it ends, once
    await h.advance(300)
    await drain_until(agent, publisher, 6)
    assert [(p.event.type, p.event.job_id, p.event.attempt) for p in publisher.published[5:]] == [
        ("job.finished", "live", 2)]


async def test_reconcile_adopts_a_placed_attempt_the_bus_never_saw_start(backend_under_test):
    """The agent launched an attempt and went down before publishing ``job.started``: after the
    restart the cluster still runs it, so it is adopted and its start reported (once); a placed
    attempt the cluster does not have is left to redelivery (nothing launched, nothing published)."""
    h = backend_under_test
    job = h.job(runtime_s=600)
    ran = attempt_of(h, "ran", job, nodes=(h.nodes[0],))
    await h.backend.launch(ran)
    await h.statuses(lambda s: Phase.RUNNING in phases(s, ran.key))
    publisher = FakePublisher()
    agent = ClusterAgent(None, h.clock, CLUSTER, h.backend, publisher=publisher, subjects=SUBJECTS)
    await agent.refresh_inventory()
    ledger = {}
    for job_id, node in (("ran", h.nodes[0]), ("never", h.nodes[1])):
        env = placement(job_id, job, CLUSTER.name, CLUSTER.region, [(node, (0,))], card_model=h.card_model)
        ledger[(job_id, 1, 0)] = (delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, 0.0),
                                  env.payload_as(JobPlaced), None)
    await agent.reconcile(ledger)
    assert agent.reconciled == [("adopted", str(ran.key))]
    assert [(p.event.type, p.event.job_id) for p in publisher.published] == [("job.started", "ran"),
                                                                               ("agent.reconciled", "ran")]
    assert publisher.published[1].event.payload["reason"] == "adopted"
    assert await running_keys(h) == {ran.key}
    await agent.finish_due()
    assert len(publisher.published) == 2  # not started twice


async def test_reconcile_reports_the_start_of_an_attempt_that_ran_and_ended_while_no_agent_watched(backend_under_test):
    """The agent launched an attempt and went down before publishing ``job.started``; the attempt
    ran and ended before the next agent started. Adopted, its start is reported at the cluster's
    start time and its end carries that start -- billing prices an end only from a start (the
    Slurm e2e lost two compute lines this way under load)."""
    h = backend_under_test
    if not h.backend.durable:
        pytest.skip("the trace cluster ends with its agent: nothing outlives it to adopt")
    job = h.job(runtime_s=1)
    # a job id no other case launches: the session's Slurm still holds earlier cases' jobs, and the
    # previous case's attempt of the same id (cancelled at its end) would be adopted instead
    ran = attempt_of(h, "ran-and-ended", job, nodes=(h.nodes[0],))
    await h.backend.launch(ran)
    await h.advance(2)
    seen = await h.statuses(lambda s: Phase.SUCCEEDED in phases(s, ran.key), timeout_s=60)
    assert Phase.SUCCEEDED in phases(seen, ran.key), seen
    started = next(s.at for s in seen if s.key == ran.key and s.phase == Phase.RUNNING)
    publisher = FakePublisher()
    agent = ClusterAgent(None, h.clock, CLUSTER, h.backend, publisher=publisher, subjects=SUBJECTS)
    await agent.refresh_inventory()
    env = placement("ran-and-ended", job, CLUSTER.name, CLUSTER.region, [(h.nodes[0], (0,))], card_model=h.card_model)
    ledger = {("ran-and-ended", 1, 0): (delivery(env, SUBJECTS.placements(CLUSTER.region, CLUSTER.name), 1, 0.0),
                              env.payload_as(JobPlaced), None)}
    await agent.reconcile(ledger)
    assert agent.reconciled == [("adopted", str(ran.key))]
    first = publisher.published[0].event
    assert first.type == "job.started" and abs(first.payload_as(JobStatus).started_at.timestamp() - started) < 1.5
    # its end (reported by on_status as the cluster's poll sees it) carries that start
    assert agent.running[("ran-and-ended", 1, 0)].started_at == first.payload_as(JobStatus).started_at.timestamp()
