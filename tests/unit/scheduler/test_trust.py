"""Issue 14 item 1 on the scheduler (fakes): a status is folded only when its envelope matches the
subject it came on and the scheduler's own placement of that attempt; anything else changes
nothing and goes out as a dead letter plus a ``security.rejected_message``."""

import pytest

from fedsched.events import Envelope, EventType, JobStatus, business_event_id, make_event
from fedsched.clock import to_datetime
from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, SchedulerHarness, nodes, status_event

A, B = "cn-north-1-c1", "cn-north-1-c2"
TWO = (ClusterSpec(A, node_list=nodes("a")), ClusterSpec(B, node_list=nodes("b")))


async def _running(h: SchedulerHarness, job: str = "j1") -> Envelope:
    h.submit(job, gpus=8)
    await h.cycle()
    h.report(job, "job.started")
    placed = h.placed[(job, 0)]
    assert h.svc.jobs[job].shards[0].state == ShardState.RUNNING
    return placed


def _forge(h: SchedulerHarness, placed: Envelope, *, region: str, cluster: str, job: str | None = None,
           attempt: int | None = None) -> Envelope:
    """A ``job.finished`` with the real end's id, claiming ``region``/``cluster``."""
    job = job or placed.job_id
    attempt = placed.attempt if attempt is None else attempt
    return make_event("job.finished", JobStatus(card_model="x", gpu_milli=64000, started_at=to_datetime(0.0)),
                      producer="agent/evil", occurred_at=h.clock.time(),
                      event_id=business_event_id(job, attempt, 0, "ended"), region=region, cluster=cluster,
                      tenant=placed.tenant, project=placed.project, job_id=job, attempt=attempt)


def _security(h: SchedulerHarness) -> list[Envelope]:
    return [p.event for p in h.publisher.published if p.event.type == EventType.SECURITY_REJECTED_MESSAGE]


@pytest.mark.parametrize("claim", ["own-cluster-in-envelope", "victim-cluster-in-envelope"])
async def test_another_clusters_job_reported_succeeded_stays_running_and_ends_once_for_real(claim):
    h = SchedulerHarness(TWO)
    placed = await _running(h)
    other = B if placed.cluster == A else A
    # the agent of `other` publishes on its own status subject (all NATS lets it do)
    envelope_cluster = other if claim == "own-cluster-in-envelope" else placed.cluster
    forged = _forge(h, placed, region="cn-north-1", cluster=envelope_cluster)
    h._event(forged, h.subjects.status("cn-north-1", other))
    await h.cycle()
    shard = h.svc.jobs["j1"].shards[0]
    assert shard.state == ShardState.RUNNING and shard.placed is not None
    (sec,) = _security(h)
    assert sec.payload["subject"] == h.subjects.status("cn-north-1", other)
    assert sec.payload["sender"] == f"agent/cn-north-1/{other}"
    assert sec.payload["claimed_cluster"] == envelope_cluster and sec.payload["job_id"] == "j1"
    dead = [p for p in h.publisher.published if p.event.type == EventType.BUS_DEAD_LETTER]
    assert [d.subject for d in dead] == ["t.deadletter.scheduler-events"]
    assert dead[0].event.payload["reason"].startswith("rejected: ")
    # the real end, from the cluster it runs on, still counts
    h.report("j1", "job.finished")
    assert shard.state == ShardState.DONE


async def test_a_status_for_an_invented_job_or_an_unplaced_attempt_is_refused():
    h = SchedulerHarness(TWO)
    placed = await _running(h)
    subject = h.subjects.status(placed.region, placed.cluster)
    h._event(_forge(h, placed, region=placed.region, cluster=placed.cluster, job="invented"), subject)
    h._event(_forge(h, placed, region=placed.region, cluster=placed.cluster, attempt=placed.attempt + 1), subject)
    await h.cycle()
    reasons = [s.payload["reason"] for s in _security(h)]
    assert reasons == ["job 'invented' does not exist",
                       f"attempt {placed.attempt + 1} of j1 was never placed (newest is {placed.attempt})"]
    assert h.svc.jobs["j1"].shards[0].state == ShardState.RUNNING


async def test_inventory_naming_another_cluster_is_refused_and_does_not_refresh_it():
    h = SchedulerHarness(TWO)
    before = h.svc.clusters[A].seen_at
    h.clock.now += 5
    from tests.builders import heartbeat
    h._inventory(heartbeat(A, "cn-north-1", h.clock.time()), h.subjects.heartbeat("cn-north-1", B))
    assert h.svc.clusters[A].seen_at == before
    await h.cycle()
    (sec,) = _security(h)
    assert "envelope claims cn-north-1/cn-north-1-c1" in sec.payload["reason"]


async def test_an_honest_late_status_of_an_earlier_attempt_is_not_a_security_event():
    h = SchedulerHarness(TWO, stale_after_s=1.0)
    placed = await _running(h)
    h.silence(placed.cluster)
    h.advance(1.6)
    await h.cycle()  # attempt 1 lost with its cluster; the job is placed again
    late = status_event("job.finished", placed, h.clock.time(), started_at=placed.occurred_at.timestamp())
    h._event(late, h.subjects.status(placed.region, placed.cluster))
    await h.cycle()
    assert _security(h) == []
