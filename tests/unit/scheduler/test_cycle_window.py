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
from services.scheduler.service import SchedulerService
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
