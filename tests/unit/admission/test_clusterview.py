"""Admission's capacity view as tables (no NATS): cards total / allocated / free per model (a
shared card counts as allocated), health from heartbeat age, maintenance and schedulable nodes,
running jobs from the newest message, older redeliveries ignored; queues from open jobs only."""

from __future__ import annotations

import pytest

from fedsched.events import Heartbeat, InventorySnapshot, NodeInventory, make_event
from fedsched.jobs import JobKind
from services.admission.clusterview import CardCount, ClusterView
from services.admission.jobview import JobView
from services.admission.ops_servicers import queue_rows
from tests.builders import EPOCH, T4, V100, delivery, spec, submitted

C = "cn-north-1-c1"


def snap(nodes, at, *, running=(), running_jobs=0, maintenance=False, seq=1):
    env = make_event("inventory.snapshot", InventorySnapshot(nodes=tuple(nodes), running=running,
                                                             running_jobs=running_jobs, maintenance=maintenance,
                                                             backend="trace"),
                     producer="agent", occurred_at=at, region="cn-north-1", zone="cn-north-1a", cluster=C)
    return delivery(env, f"t.inventory.cn-north-1.{C}", seq, at)


def beat(at, running, seq=2):
    env = make_event("inventory.heartbeat", Heartbeat(running_jobs=running), producer="agent", occurred_at=at,
                     region="cn-north-1", cluster=C)
    return delivery(env, f"t.heartbeat.cn-north-1.{C}", seq, at)


def node(name, model=T4, free=(1000, 1000), healthy=True, unschedulable=False):
    return NodeInventory(name=name, card_model=model, gpus=len(free), gpu_free_milli=free, healthy=healthy,
                         unschedulable=unschedulable)


CASES = [
    ("idle cards are free", [snap([node("a")], EPOCH)], EPOCH + 1,
     dict(cards=(CardCount(T4, 2, 0, 2),), healthy=True, nodes=1, nodes_schedulable=1)),
    ("a shared card counts as allocated", [snap([node("a", free=(500, 1000)), node("b", V100, (0,))], EPOCH)], EPOCH,
     dict(cards=(CardCount(T4, 2, 1, 1), CardCount(V100, 1, 1, 0)), nodes=2)),
    ("silent longer than the freshness limit: unhealthy", [snap([node("a")], EPOCH)], EPOCH + 11,
     dict(healthy=False, heartbeat_age_s=11.0)),
    ("a heartbeat keeps it fresh and says how many run", [snap([node("a")], EPOCH, running=("j/1/0",)),
                                                          beat(EPOCH + 9, 3)], EPOCH + 11,
     dict(healthy=True, running_jobs=3, heartbeat_age_s=2.0)),
    ("a snapshot says how many run", [snap([node("a")], EPOCH, running_jobs=4)], EPOCH + 1, dict(running_jobs=4)),
    ("an older agent's snapshot listed them", [snap([node("a")], EPOCH, running=("j/1/0", "k/1/0"))], EPOCH + 1,
     dict(running_jobs=2)),
    ("maintenance: unhealthy", [snap([node("a")], EPOCH, maintenance=True)], EPOCH, dict(healthy=False)),
    ("no schedulable node: unhealthy", [snap([node("a", unschedulable=True), node("b", healthy=False)], EPOCH)],
     EPOCH, dict(healthy=False, nodes=2, nodes_schedulable=0)),
    ("an older snapshot delivered late changes nothing", [snap([node("a", free=(0, 0))], EPOCH + 5, seq=3),
                                                          snap([node("a")], EPOCH, seq=1)], EPOCH + 5,
     dict(cards=(CardCount(T4, 2, 2, 0),))),
]


@pytest.mark.parametrize("deliveries, now, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cluster_rows(deliveries, now, expect):
    view = ClusterView(stale_after_s=10.0)
    for d in deliveries:
        view.apply(d, now)
    row, = view.rows(now)
    assert row.backend == "trace" and row.region == "cn-north-1"
    for key, value in expect.items():
        assert getattr(row, key) == value, key


def test_region_filter_and_never_heard():
    view = ClusterView()
    view.apply(snap([node("a")], EPOCH), EPOCH)
    assert view.rows(EPOCH, frozenset({"cn-east-1"})) == []
    assert view.last_seen("nowhere") == -1.0


def test_queues_count_waiting_open_jobs_per_home_region_and_kind():
    jobs = JobView()
    jobs.apply(submitted("j1", spec(kind=JobKind.TRAINING), EPOCH))
    jobs.apply(submitted("j2", spec(kind=JobKind.TRAINING), EPOCH + 10))
    jobs.apply(submitted("j3", spec(kind=JobKind.INFERENCE, home="cn-east-1", tenant="nlp"), EPOCH + 20))
    rows = [(q.region, q.kind, q.queued, q.oldest_wait_seconds) for q in queue_rows(jobs, EPOCH + 100)]
    assert rows == [("cn-east-1", "inference", 1, 80.0), ("cn-north-1", "training", 2, 100.0)]


# ---------------------------------------------------------------------------- decommissioned clusters

def _other(at, name="cn-north-1-c2", seq=5):
    env = make_event("inventory.heartbeat", Heartbeat(running_jobs=0), producer="agent", occurred_at=at,
                     region="cn-north-1", cluster=name)
    return delivery(env, f"t.heartbeat.cn-north-1.{name}", seq, at)


def test_a_cluster_silent_beyond_the_horizon_is_forgotten_and_comes_back_when_it_reports():
    """Review item 8: a decommissioned cluster (silent over ``gone_after_s``) is no longer listed;
    one merely stale still is (unhealthy); a message from it brings it back."""
    cv = ClusterView(stale_after_s=10.0, gone_after_s=3600.0)
    cv.apply(snap([node("a")], EPOCH), EPOCH)
    cv.apply(_other(EPOCH + 3000), EPOCH + 3000)
    rows = cv.rows(EPOCH + 3700)
    assert [r.cluster for r in rows] == ["cn-north-1-c2"] and not rows[0].healthy  # c2 stale, c1 gone
    assert C not in cv.clusters
    cv.apply(beat(EPOCH + 3800, 1, seq=9), EPOCH + 3800)
    assert {r.cluster for r in cv.rows(EPOCH + 3801)} == {C, "cn-north-1-c2"}


async def test_status_does_not_report_a_decommissioned_cluster_down():
    """GetStatus lists the agents of the clusters not gone: a cluster silent for 30 days is no
    agent/... entry (so `fedsched status` does not exit 1 for it); a stale one is down."""
    from types import SimpleNamespace

    from fedsched.api.v1 import jobs_pb2 as pb
    from services.admission.ops_servicers import SystemServicer
    from tests.builders import FakeClock

    class _NoBus:  # every bus question fails (this test is about the agents' entries only)
        prefix = "t"

        def stream_name(self, name):
            return f"t_{name}"

        def __getattr__(self, name):
            async def fail(*a, **kw):
                raise TimeoutError("no bus in this test")
            return SimpleNamespace(request=fail, stream_info=fail, consumer_info=fail)

    cv = ClusterView(stale_after_s=10.0, gone_after_s=3600.0)
    cv.apply(snap([node("a")], EPOCH - 30 * 86400), EPOCH - 30 * 86400)
    cv.apply(_other(EPOCH - 60), EPOCH - 60)
    wall = FakeClock(EPOCH)  # the wall clock of the call

    async def own():
        return "admission", 0

    svc = SystemServicer(_NoBus(), cv, wall, own, timeout_s=0.1)
    resp = await svc.GetStatus(pb.GetStatusRequest(), None)
    agents = {s.name: s.state for s in resp.services if s.name.startswith("agent/")}
    assert agents == {"agent/cn-north-1/cn-north-1-c2": "down"}
