"""A scheduling cycle's bookkeeping does not grow with the jobs that finished, nor walk the work
that keeps running: it visits what changed and what is queued (issue 15, item 1).

The scheduler service counts the shard records each cycle visits outside ``decide``
(``SchedulerService.last_cycle_visits``, per kind in ``last_cycle_visit_counts``): the queue,
the view records it rebuilds, reclamation candidates. Here a real service on the harness's fakes
holds a set of long-running jobs while 10,000 short jobs go through it in batches (submitted,
placed, started, finished); the visits per cycle must stay those of one batch.
"""

from __future__ import annotations

from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, SchedulerHarness, nodes

A, B = "cn-north-1-c1", "cn-north-1-c2"
LONG = 300  #: jobs that run through the whole test (1 GPU each)
BATCH = 50  #: short jobs per batch
BATCHES = 200  #: 10,000 short jobs in all


async def test_cycle_visits_stay_bounded_while_10000_jobs_finish():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=24)), ClusterSpec(B, node_list=nodes("b", count=24))),
                         reclaim_after_s=1e9)
    svc = h.svc
    for i in range(LONG):
        h.submit(f"long{i}")
    await h.cycle()
    for i in range(LONG):
        h.report(f"long{i}", "job.started")
    await h.cycle()
    assert svc.counts[ShardState.RUNNING] == LONG

    per_batch: list[int] = []  # the most visits of any cycle of each batch
    for b in range(BATCHES):
        ids = [f"b{b}-{k}" for k in range(BATCH)]
        visits = []
        for job in ids:
            h.submit(job)
        await h.cycle()  # places the batch
        visits.append(svc.last_cycle_visits)
        assert all(h.shard(job).state == ShardState.PLACED for job in ids)
        h.advance(1.0)
        for job in ids:
            h.report(job, "job.started")
        await h.cycle()
        visits.append(svc.last_cycle_visits)
        h.advance(1.0)
        for job in ids:
            h.report(job, "job.finished")
        await h.cycle()
        visits.append(svc.last_cycle_visits)
        per_batch.append(max(visits))

    done = sum(1 for j in svc.jobs.values() if j.done)
    assert done == BATCH * BATCHES
    assert svc.counts[ShardState.RUNNING] == LONG  # the long jobs ran throughout
    # a batch's cycles visit that batch (queued, placed, started records) -- a few per job, never
    # the long-running work nor the finished history
    # (the first batch's first view also builds the long jobs' records, once)
    assert per_batch[0] >= LONG
    assert max(per_batch[1:]) <= 4 * BATCH, per_batch[:5]
    assert max(per_batch[-20:]) <= max(per_batch[1:21])


async def test_a_cycle_with_nothing_new_visits_nothing_of_the_running_work():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=8)),), reclaim_after_s=1e9)
    for i in range(60):
        h.submit(f"j{i}")
    await h.cycle()
    for i in range(60):
        h.report(f"j{i}", "job.started")
    h.submit("waiting", gpus=8, workers=9)  # never fits: keeps the cycle running
    await h.cycle()
    first = h.svc.last_cycle_visits  # rebuilds the 60 started records once
    await h.cycle()
    assert first >= 60
    assert h.svc.last_cycle_visits <= 2, h.svc.last_cycle_visit_counts  # the one queued job (queue, expiry)
