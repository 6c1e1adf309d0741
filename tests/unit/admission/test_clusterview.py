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


def snap(nodes, at, *, running=(), maintenance=False, seq=1):
    env = make_event("inventory.snapshot", InventorySnapshot(nodes=tuple(nodes), running=running,
                                                             maintenance=maintenance, backend="trace"),
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
