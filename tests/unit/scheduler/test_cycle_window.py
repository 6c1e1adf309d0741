"""A cycle decides at most ``max_jobs_per_cycle`` queued shards (issue 15: a burst is placed in
a stream of short cycles, not one long cycle that publishes nothing until it ends).

Rules (``SchedulerService.window``): the window is the head of the order ``decide`` uses --
higher effective priority first, each tenant of a level an equal part, oldest first; a
windowed cycle that placed nothing is followed by one over the whole queue.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fedapp.runtime import scheduler_settings
from fedsched.settings import Settings
from services.scheduler.service import SchedulerService, queue_stats
from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, SchedulerHarness, nodes

A = "cn-north-1-c1"


def _placed(h: SchedulerHarness, ids) -> set[str]:
    return {j for j in ids if h.shard(j).state == ShardState.PLACED}


async def test_a_burst_is_placed_over_several_short_cycles_oldest_first_per_tenant():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=8)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=10)
    ids = []
    for i in range(30):  # 15 each for two tenants, submitted one after another
        job = f"j{i:02d}"
        h.submit(job, tenant=("search", "ads")[i % 2])
        ids.append(job)
        h.advance(0.01)
    h.submit("urgent", tenant="ads", priority="critical")  # last in, highest priority
    await h.cycle()
    first = _placed(h, ids + ["urgent"])
    # the critical job (its level first), then the room left (9) split evenly: each tenant's 4 oldest
    assert first == {"urgent", "j00", "j02", "j04", "j06", "j01", "j03", "j05", "j07"}
    cycles = 1
    while len(_placed(h, ids)) < 30:
        await h.cycle()
        cycles += 1
        assert cycles < 10
    assert cycles >= 3  # 31 jobs, at most 10 per cycle


async def test_a_blocked_window_lets_the_next_cycle_see_the_whole_queue():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=1)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=3)
    for i in range(5):
        h.submit(f"big{i}", gpus=8, workers=2)  # can never fit one 8-GPU node: the head is blocked
        h.advance(0.01)
    h.submit("small", gpus=1)  # behind the window
    await h.cycle()
    assert h.shard("small").state == ShardState.QUEUED  # not in the window, nothing placed
    await h.cycle()
    assert h.shard("small").state == ShardState.PLACED  # the whole queue was decided


def test_max_jobs_per_cycle_is_a_setting_validated_above_zero_and_passed_to_the_scheduler(monkeypatch):
    """Issue 15: ``FEDSCHED_MAX_JOBS_PER_CYCLE`` sets the window (default 500); 0, negatives and
    non-numbers are refused by the settings and by the scheduler itself."""
    monkeypatch.delenv("FEDSCHED_MAX_JOBS_PER_CYCLE", raising=False)
    assert Settings().max_jobs_per_cycle == 500
    monkeypatch.setenv("FEDSCHED_MAX_JOBS_PER_CYCLE", "3")
    assert scheduler_settings(Settings())["max_jobs_per_cycle"] == 3
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("FEDSCHED_MAX_JOBS_PER_CYCLE", bad)
        with pytest.raises(ValidationError, match="max_jobs_per_cycle"):
            Settings()
    with pytest.raises(ValueError, match="max_jobs_per_cycle must be > 0"):
        SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=1)),), max_jobs_per_cycle=0)
    assert SchedulerService.__init__.__kwdefaults__["max_jobs_per_cycle"] == Settings.model_fields[
        "max_jobs_per_cycle"].default  # one documented default


async def test_the_settings_window_is_what_a_cycle_decides(monkeypatch):

    monkeypatch.setenv("FEDSCHED_MAX_JOBS_PER_CYCLE", "4")
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=8)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=scheduler_settings(Settings())["max_jobs_per_cycle"])
    ids = [f"j{i}" for i in range(10)]
    for job in ids:
        h.submit(job)
        h.advance(0.01)
    await h.cycle()
    assert _placed(h, ids) == set(ids[:4])  # the four oldest


@pytest.mark.parametrize("seed", range(4))
async def test_the_window_cut_from_the_order_index_is_the_window_of_the_whole_queue(seed):
    """Issue 15: a cycle cuts its window from the queue's order index (``QueuedBook.window``:
    groups of tenant x class x queue, runs per aging step) instead of grouping the whole queue;
    it must be the same shards as the rule over the whole queue (``SchedulerService.window``)
    through aging, the fast lane, split jobs, priority changes, holds and placements."""
    import random

    from fedsched.jobs import PriorityClass

    rng = random.Random(seed)
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=rng.choice((7, 20, 45)))
    svc = h.svc
    period = svc.policy.aging_period_s
    classes = ["low", "normal", "high", "critical", "best_effort"]
    ids = []
    for i in range(260):
        job = f"j{i:03d}"
        h.submit(job, tenant=rng.choice(("search", "ads", "maps")), priority=rng.choice(classes),
                 estimated_duration_s=rng.choice((None, 60.0, 3600.0)), gpus=rng.choice((1, 2, 8)),
                 workers=rng.choice((1, 1, 2)), **({"kind": "batch", "shards": 3} if i % 17 == 0 else {}))
        ids.append(job)
        h.advance(rng.choice((0.0, 1.0, period / 7, period / 2)))  # some share a submit time
    for job in rng.sample(ids, 20):
        h.set_priority(job, rng.choice(list(PriorityClass)))
    for job in rng.sample(ids, 10):
        h.hold(job)

    def same_window(now: float) -> None:
        expected = sorted(q.key for q in svc.window(svc.queue(), now))
        got = sorted(q.key for q in svc.queue_window(now))
        assert got == expected

    for _ in range(6):
        now = h.clock.time()
        for later in (0.0, period / 3, period, 2.5 * period, 10 * period):  # aging moves jobs up a level
            same_window(now + later)
        await h.cycle()  # places some: they leave the index
        h.advance(period / 4)
    assert len(svc.queued) > svc.max_jobs_per_cycle  # still a backlog: the windows were cut
    # the queue gauges from the index's groups are those of a pass over the whole queue
    now = h.clock.time()
    assert svc.queued.stats(now, svc.policy.fast_lane_s) == queue_stats(svc.queue(), now, svc.policy.fast_lane_s)
