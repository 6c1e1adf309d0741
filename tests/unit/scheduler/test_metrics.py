"""The scheduler's metrics from whole cycles on fakes (SchedulerHarness: fake publisher, fake
clock, no NATS, no sleeps): placements per cluster, pending reasons, queues, cycles, heartbeat age."""

from __future__ import annotations

from fedsched.metrics import SchedulerMetrics
from tests.builders import V100, ClusterSpec, SchedulerHarness, nodes

A, B = "cn-north-1-c1", "cn-north-1-c2"


def harness() -> tuple[SchedulerHarness, SchedulerMetrics]:
    m = SchedulerMetrics()
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a")), ClusterSpec(B, node_list=nodes("b"))), metrics=m)
    return h, m


async def test_placements_are_counted_per_cluster_once_acknowledged():
    h, m = harness()
    for i in range(3):
        h.submit(f"j{i}", gpus=8)
    decisions = await h.cycle()
    by_cluster = {c: sum(1 for d in decisions if d.type == "job.placed" and d.cluster == c) for c in (A, B)}
    get = m.registry.get_sample_value
    for c, n in by_cluster.items():
        assert get("fedsched_scheduler_placements_total", {"region": "cn-north-1", "cluster": c}) == (n or None)
    assert sum(by_cluster.values()) == 2  # two 8-GPU nodes
    assert get("fedsched_scheduler_cycle_duration_seconds_count") == 1
    assert get("fedsched_scheduler_decisions_per_cycle_sum", {"outcome": "placed"}) == 2
    assert get("fedsched_scheduler_decisions_per_cycle_sum", {"outcome": "pending"}) == 1
    assert get("fedsched_scheduler_pending_reasons_total", {"reason": "insufficient_free_resources"}) == 1


async def test_a_refused_placement_is_not_counted():
    h, m = harness()
    h.publisher.refuse = lambda subject, event: event.type == "job.placed"
    h.submit("j1", gpus=1)
    await h.cycle()
    assert m.registry.get_sample_value("fedsched_scheduler_placements_total", {"region": "cn-north-1", "cluster": A}) is None
    assert m.registry.get_sample_value("fedsched_scheduler_placements_total", {"region": "cn-north-1", "cluster": B}) is None


async def test_pending_reason_is_counted_when_it_changes_only():
    h, m = harness()
    h.submit("j1", gpus=1, card_models=(V100,))  # no cluster has V100s
    await h.cycle()
    await h.cycle()
    assert m.registry.get_sample_value("fedsched_scheduler_pending_reasons_total",
                                       {"reason": "card_model_not_offered"}) == 1


async def test_queue_length_and_oldest_age_per_queue():
    h, m = harness()
    h.submit("t1", gpus=1, card_models=(V100,), kind="training")
    h.advance(30)
    h.submit("t2", gpus=1, card_models=(V100,), kind="training")
    h.submit("f1", gpus=1, card_models=(V100,), estimated_duration_s=60)
    h.advance(10)
    await h.cycle()
    get = m.registry.get_sample_value
    assert get("fedsched_scheduler_queue_length", {"queue": "training"}) == 2
    assert get("fedsched_scheduler_queue_oldest_age_seconds", {"queue": "training"}) == 40
    assert get("fedsched_scheduler_queue_length", {"queue": "fast"}) == 1
    assert get("fedsched_scheduler_queue_oldest_age_seconds", {"queue": "fast"}) == 10
    h.cancel("t1")
    h.cancel("t2")
    h.cancel("f1")
    await h.cycle()
    assert get("fedsched_scheduler_queue_length", {"queue": "training"}) == 0
    assert get("fedsched_scheduler_queue_length", {"queue": "fast"}) == 0


async def test_heartbeat_age_per_cluster_grows_while_silent():
    h, m = harness()
    get = m.registry.get_sample_value
    assert get("fedsched_scheduler_heartbeat_age_seconds", {"region": "cn-north-1", "cluster": A}) == 0
    h.silence(B)
    h.advance(5)
    assert get("fedsched_scheduler_heartbeat_age_seconds", {"region": "cn-north-1", "cluster": B}) == 5
    assert get("fedsched_scheduler_heartbeat_age_seconds", {"region": "cn-north-1", "cluster": A}) < 0.5
