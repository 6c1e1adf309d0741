"""A cycle decides at most ``max_jobs_per_cycle`` queued shards (issue 15: a burst is placed in
a stream of short cycles, not one long cycle that publishes nothing until it ends).

Rules (``SchedulerService.window``): the window is the head of the order ``decide`` uses --
higher effective priority first, each tenant of a level an equal part, oldest first; a
windowed cycle that placed nothing is followed by one over the whole queue.
"""

from __future__ import annotations

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
