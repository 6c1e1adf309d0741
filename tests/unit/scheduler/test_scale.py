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



async def _batch_lifetime(h, ids, *, placed_at_once: bool = False) -> int:
    """Submit ``ids``, then report them started and finished, a cycle after each step (1 s apart);
    the most shard records a cycle visited (``placed_at_once``: the first cycle placed them all)."""
    visits = []
    for job in ids:
        h.submit(job)
    await h.cycle()
    visits.append(h.svc.last_cycle_visits)
    if placed_at_once:
        assert all(h.shard(job).state == ShardState.PLACED for job in ids)
    for status in ("job.started", "job.finished"):
        h.advance(1.0)
        for job in ids:
            h.report(job, status)
        await h.cycle()
        visits.append(h.svc.last_cycle_visits)
    return max(visits)

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
        per_batch.append(await _batch_lifetime(h, ids, placed_at_once=True))

    done = sum(1 for j in svc.jobs.values() if j.done)
    assert done + len(svc.tombstones) == BATCH * BATCHES  # every short job ended (most left memory)
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


def _recount(svc) -> tuple[dict, dict]:
    """What the view's running sets and tenant usage were when rebuilt by walking every placed or
    running shard (the rule the incremental upkeep must keep)."""
    running: dict[str, set] = {}
    usage: dict[str, tuple[int, int, int]] = {}
    now = svc.clock.time()
    for job, shard in svc.active.values():
        info = svc.clusters.get(shard.cluster)
        if shard.placed is None or info is None:
            continue
        work = svc._running_work(job, shard, shard.placed, info, now)
        if work is None:
            continue
        running.setdefault(shard.cluster, set()).add(work)
        g, c, m = usage.get(job.tenant, (0, 0, 0))
        s = job.spec
        usage[job.tenant] = (g + s.total_gpu_milli, c + s.cpu_milli * s.workers, m + s.memory_mib * s.workers)
    return running, usage


async def test_the_incremental_view_equals_a_recount_through_starts_failures_reclaims_and_a_lost_cluster():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)), ClusterSpec(B, node_list=nodes("b", count=2))),
                         reclaim_after_s=20.0, stale_after_s=3.0)
    svc = h.svc

    async def check() -> None:
        view = svc.view()
        running, usage = _recount(svc)
        assert {c.name: set(c.running) for c in view.clusters if c.running} == running
        assert {t: (u.gpu_milli, u.cpu_milli, u.memory_mib) for t, u in view.tenant_usage.items()} == usage

    for i in range(24):
        h.submit(f"j{i}", tenant=("search", "ads")[i % 2], gpus=1 + i % 3, retry_limit=3)
    await h.cycle()
    await check()
    for i in range(0, 24, 2):
        if h.shard(f"j{i}").state == ShardState.PLACED:
            h.report(f"j{i}", "job.started")
    await h.cycle()
    await check()
    for i in range(0, 12, 4):
        if h.shard(f"j{i}").state == ShardState.RUNNING:
            h.report(f"j{i}", "job.failed", reason="exit 1")  # requeued, placed again
    for i in range(2, 12, 4):
        if h.shard(f"j{i}").state == ShardState.RUNNING:
            h.report(f"j{i}", "job.finished")
    await h.cycle()
    await check()
    h.advance(25.0)  # unstarted placements are reclaimed and placed again
    await h.cycle()
    await check()
    h.silence(B)
    h.advance(5.0)  # B is lost: its work moves to A (or waits)
    await h.cycle()
    await check()
    for job_id in list(svc.jobs):
        if h.shard(job_id).state == ShardState.PLACED:
            h.report(job_id, "job.started")
    await h.cycle()
    await check()
    assert any(sh.losses for j in svc.jobs.values() for sh in j.shards)  # the lost-cluster path ran
    assert any(sh.failures for j in svc.jobs.values() for sh in j.shards)


async def test_the_queue_records_of_unchanged_shards_are_kept_from_cycle_to_cycle():
    """Issue 15: a backlog of queued shards is not rebuilt record by record every cycle (a 50,000
    job burst made the scheduler's CPU per job grow with the backlog); a shard whose job changed
    (a new priority class replaces its spec) gets a new record with the change."""
    from fedsched.jobs import PriorityClass

    h = SchedulerHarness([ClusterSpec("c1", node_list=nodes("n", 1))])
    for i in range(3):
        h.submit(f"j{i}", gpus=1)
    first = {q.job_id: q for q in h.svc.queue()}
    again = {q.job_id: q for q in h.svc.queue()}
    assert set(first) == {"j0", "j1", "j2"} and all(again[j] is first[j] for j in first)
    h.set_priority("j1", PriorityClass.CRITICAL)
    after = {q.job_id: q for q in h.svc.queue()}
    assert after["j0"] is first["j0"] and after["j2"] is first["j2"]
    assert after["j1"] is not first["j1"] and after["j1"].spec.priority == PriorityClass.CRITICAL


async def test_a_cycle_visits_its_window_not_the_backlog_of_queued_jobs():
    """Issue 15: with thousands of shards queued, a cycle's bookkeeping visits its window (cut
    from the queue's order index), the placements it made and the unplaceable shards -- not every
    queued shard (a walk of the whole queue cost ~60 ms per cycle at 30,000 queued)."""
    cap, backlog = 40, 4000
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=600)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=cap)
    svc = h.svc
    h.submit("never", gpus=8, workers=700)  # no cluster could hold it: unplaceable throughout
    for i in range(backlog):
        h.submit(f"q{i}")
        if i % 500 == 0:
            h.advance(1.0)
    seen = []
    while len(svc.queued) > backlog - 10 * cap:
        placed_before = svc.counts[ShardState.PLACED]
        await h.cycle()
        assert svc.counts[ShardState.PLACED] > placed_before  # each window places (nothing blocked)
        counts = dict(svc.last_cycle_visit_counts)
        seen.append(counts)
        for job_id, _ in [k for k, (_, s) in svc.active.items() if s.state == ShardState.PLACED]:
            h.report(job_id, "job.started")
    assert len(seen) >= 8
    for counts in seen:
        assert counts.get("queue", 0) <= cap + 1, counts  # the window, not the backlog of ~4000
        assert counts.get("expire", 0) <= 1, counts  # only the unplaceable shard
        assert sum(counts.values()) <= 4 * cap, counts
    assert h.shard("never").unplaceable and h.shard("never").state == ShardState.QUEUED


async def test_a_cycle_builds_each_shared_cluster_evaluation_record_once(monkeypatch):
    """Issue 15: ``decide`` shares the evaluations of clusters a shape cannot fit among the jobs
    of that shape; the cycle builds the bus record of each evaluation object once (500
    placements carried 3,000 evaluations of ~700 objects), and every placement still carries
    one record per cluster, equal to the record of its own evaluation."""
    import services.scheduler.service as service_mod
    from services.scheduler.approvals import evaluation_record

    built: list = []

    def counting(e):
        built.append(e)
        return evaluation_record(e)

    monkeypatch.setattr(service_mod, "evaluation_record", counting)
    clusters = [ClusterSpec(f"{r}-c{i}", node_list=nodes(f"{r[3:]}{i}", count=40))
                for r in ("cn-north-1", "cn-east-1", "cn-south-1") for i in (1, 2)]
    h = SchedulerHarness(clusters, reclaim_after_s=1e9)
    for i in range(120):
        h.submit(f"j{i}", home=("cn-north-1", "cn-east-1", "cn-south-1")[i % 3], gpus=1 + i % 2,
                 estimated_duration_s=600.0)
    await h.cycle()
    placed = [p.event for p in h.publisher.published if p.event.type == "job.placed"]
    assert len(placed) == 120
    carried = sum(len(e.payload["evaluations"]) for e in placed)
    assert carried == 120 * len(clusters)  # one record per cluster in every placement
    assert len({id(e) for e in built}) == len(built) < carried  # each evaluation object once, shared
    records = {(r["cluster"], r["reason"], r["total"], tuple(sorted(r["scores"].items()))) for r in
               map(evaluation_record, built)}
    assert all((r["cluster"], r["reason"], r["total"], tuple(sorted(r["scores"].items()))) in records
               for e in placed for r in e.payload["evaluations"])


async def test_an_unstarted_placement_keeps_its_bindings_and_only_its_expected_end_moves():
    """Issue 15: a placed, not yet started shard is expected to start ``now``, so its view record
    is made again each view -- from the bindings (node positions) and their check kept from the
    first one, not rebuilt from the placement."""
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)),), reclaim_after_s=1e9)
    h.submit("j", estimated_duration_s=100.0)
    await h.cycle()
    first = next(w for c in h.svc.view().clusters for w in c.running)
    h.advance(5.0)
    again = next(w for c in h.svc.view().clusters for w in c.running)
    assert first.started_at is None and again.bindings is first.bindings  # kept, not rebuilt
    assert again.est_end == first.est_end + 5.0  # expected to start now: its end moves with now


async def test_an_inventory_snapshot_computes_its_capacity_key_once(monkeypatch):
    """Issue 15: each inventory snapshot is compared with the kept capacity key of the one before
    (not the previous snapshot's key computed again); a change of capacity is still seen."""
    import services.scheduler.service as service_mod
    from tests.builders import snapshot

    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)),), reclaim_after_s=1e9)
    real = service_mod._capacity_key
    calls = []
    monkeypatch.setattr(service_mod, "_capacity_key", lambda snap: calls.append(snap) or real(snap))
    for _ in range(5):
        h._inventory(snapshot(A, "cn-north-1", nodes("a", count=2), h.clock.time()), h.subjects.inventory("cn-north-1", A))
    assert len(calls) <= 6  # one per snapshot (plus the kept key of the first, once)
    info = h.svc.clusters[A]
    h.svc.view()
    cached = info.cached
    h._inventory(snapshot(A, "cn-north-1", nodes("a", count=3), h.clock.time()), h.subjects.inventory("cn-north-1", A))
    assert info.cached is None and cached is not None  # a new node: the cluster's state is rebuilt


async def test_cycle_visits_stay_bounded_while_10000_jobs_run_and_some_wait_to_start():
    """Issue 15: 10,000 started jobs and a set of placed-not-started ones stay on the clusters
    while batches go through; a cycle visits its batch, never the started work nor the
    not-started shards it did not change (their entries are kept, expected to start at the
    view's ``now``)."""
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=700)), ClusterSpec(B, node_list=nodes("b", count=700))),
                         reclaim_after_s=1e9, max_jobs_per_cycle=1000)
    svc = h.svc
    running, unstarted = 10_000, 200
    for start in range(0, running + unstarted, 1000):
        for i in range(start, min(start + 1000, running + unstarted)):
            h.submit(f"long{i}", estimated_duration_s=3600.0, preemptible=i % 2 == 0)
        await h.cycle()
    for i in range(running):
        h.report(f"long{i}", "job.started")
    await h.cycle()
    assert svc.counts[ShardState.RUNNING] == running and svc.counts[ShardState.PLACED] == unstarted

    per_batch: list[int] = []
    for b in range(40):
        ids = [f"b{b}-{k}" for k in range(BATCH)]
        per_batch.append(await _batch_lifetime(h, ids))
        assert svc.last_cycle_visit_counts.get("view", 0) <= 2 * BATCH  # (was: every unstarted one each cycle)
    assert svc.counts[ShardState.RUNNING] == running
    assert per_batch[0] >= running  # the first view builds the started records, once
    assert max(per_batch[1:]) <= 4 * BATCH, per_batch[:5]  # never again the 10,000 running nor the 200
