"""The view hands the core each cluster's running work as a :class:`RunningSet` (issue 15,
item 1): started records kept from cycle to cycle, and placed-not-started shards as entries
whose records (expected to start at the view's ``now``) are built only when the core reads them.
It must read as the tuple of records built the old way, and decide the same."""

from __future__ import annotations

import math
from dataclasses import replace

from fedsched.jobs import PriorityClass
from services.scheduler.core import RunningSet, RunningWork, decide
from services.scheduler.core.snapshot import lowest_preemptible
from tests.builders import ClusterSpec, SchedulerHarness, nodes

A, B = "cn-north-1-c1", "cn-north-1-c2"


async def _harness_with_started_and_unstarted() -> SchedulerHarness:
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=4)), ClusterSpec(B, node_list=nodes("b", count=4))),
                         reclaim_after_s=1e9)
    for i in range(40):
        h.submit(f"j{i}", estimated_duration_s=None if i % 7 == 0 else 100.0 + i, preemptible=i % 3 != 0)
    await h.cycle()
    h.advance(3.0)
    for i in range(0, 40, 2):  # half start, half stay placed
        h.report(f"j{i}", "job.started")
    await h.cycle()
    h.advance(4.0)
    return h


async def test_a_running_set_reads_as_the_records_built_at_the_views_now():
    h = await _harness_with_started_and_unstarted()
    svc = h.svc
    view = svc.view()
    pending_seen = 0
    for c in view.clusters:
        assert isinstance(c.running, RunningSet)
        pending_seen += len(c.running.pending)
        expected = []
        for job, shard in list(svc.active.values()):
            if shard.cluster != c.name or shard.placed is None:
                continue
            w = svc._running_work(job, shard, shard.placed, svc.clusters[c.name], view.now)
            if w is not None:
                expected.append(w)
        got = list(c.running)
        assert len(got) == len(c.running) and set(got) == set(expected)
        assert c.running == tuple(got) and list(c.running[i] for i in range(len(got))) == got
        for w in got:
            if w.started_at is None:  # expected to start now
                spec = h.specs[w.job_id]
                est = spec.estimated_duration_s
                assert w.est_end == (view.now + est if est is not None else math.inf)
        assert lowest_preemptible(c.running) == min((w.priority for w in got if w.preemptible), default=None)
        assert lowest_preemptible(tuple(got)) == lowest_preemptible(c.running)
    assert pending_seen == 20


async def test_decide_is_the_same_with_a_running_set_or_the_tuple_of_its_records():
    h = await _harness_with_started_and_unstarted()
    svc = h.svc
    for i in range(30):  # more than fits: placements, preemptions and reservations against the running work
        h.submit(f"hi{i}", gpus=2 + i % 3, priority=PriorityClass.HIGH)
    await h.cycle()
    view = svc.view()
    queue = svc.queue()
    assert queue
    as_tuples = replace(view, clusters=tuple(replace(c, running=tuple(c.running)) for c in view.clusters))
    a = decide(view, queue, svc.policy)
    b = decide(as_tuples, queue, svc.policy)
    assert a.pending and a == b  # waiting against the running work (wait estimates read every timeline)


def test_pending_records_are_built_once_and_only_when_read():
    started = (RunningWork("s", 1, 0, "t", 5, True, False, 10.0, 50.0, "A100", ((0, (0,), 1000, 0, 0),)),)
    pending = (("p", 1, 0, "t", 3, True, True, 20.0, "A100", ((0, (1,), 1000, 0, 0),)),
               ("q", 1, 0, "u", 1, False, True, math.inf, "A100", ((0, (2,), 1000, 0, 0),)))
    rs = RunningSet(started, pending, 100.0)
    assert rs.lowest_preemptible() == 3 and rs._all is None  # answered without building records
    recs = list(rs)
    assert recs[0] is started[0]
    assert recs[1] == RunningWork("p", 1, 0, "t", 3, True, True, None, 120.0, "A100", ((0, (1,), 1000, 0, 0),))
    assert recs[2].est_end == math.inf and recs[2].started_at is None
    assert list(rs)[1] is recs[1]  # kept


def test_the_pending_work_in_end_order_is_sorted_once_per_now():
    """A cycle's wait estimates read a cluster's unstarted work in expected-end order: sorted
    once for the view's ``now`` (and again only for another ``now``), the order sorting gives."""
    from services.scheduler.core.preempt import expected_end

    pending = tuple((f"p{i}", 1, 0, "t", 3, True, True, float((i * 37) % 11) if i % 5 else math.inf, "A100",
                     ((0, (i % 8,), 1000, 0, 0),)) for i in range(30))
    rs = RunningSet((), pending, 100.0)
    first = rs.pending_in_end_order(100.0)
    assert [e for e, _ in first] == sorted(expected_end(w, 100.0) for w in rs.pending_records())
    assert {w.job_id for _, w in first} == {p[0] for p in pending}
    assert rs.pending_in_end_order(100.0) is first  # kept
    later = rs.pending_in_end_order(150.0)
    assert later is not first and [e for e, _ in later] == sorted(expected_end(w, 150.0) for w in rs.pending_records())
    assert all(w is r for (_, w), r in zip(sorted(first, key=lambda x: x[1].job_id),
                                            sorted(rs.pending_records(), key=lambda w: w.job_id)))


async def test_the_views_kept_order_of_unstarted_work_reads_as_sorting_it():
    """The service keeps each cluster's unstarted entries in expected-end order (work left,
    none left counting as overdue) and their lowest preemptible priority, from view to view:
    read lazily, they are what sorting the records by expected end gives, through more
    placements, starts, an entry with no estimate and one with no work left."""
    from services.scheduler.core.preempt import expected_end

    h = await _harness_with_started_and_unstarted()
    shard = h.shard("j1")
    shard.progress_s = 200.0  # more than its estimate: no work left (made again when re-indexed)
    h.svc._track(h.svc.jobs["j1"], shard)
    for _ in range(3):
        view = h.svc.view()
        seen = 0
        for c in view.clusters:
            rs = c.running
            assert rs.pending_sorted
            lazy = list(rs.pending_in_end_order(view.now))
            assert [e for e, _ in lazy] == sorted(expected_end(w, view.now) for w in rs.pending_records())
            assert sorted(w.job_id for _, w in lazy) == sorted(w.job_id for w in rs.pending_records())
            assert rs.lowest_preemptible() == lowest_preemptible(tuple(rs))
            seen += len(lazy)
        assert seen == sum(1 for j in h.svc.jobs.values() for s in j.shards if s.state.value == "placed")
        h.submit(f"more{h.clock.time()}", estimated_duration_s=7.0, preemptible=True)
        await h.cycle()
        h.advance(2.0)
    assert any(e[7] == 0.0 for c in view.clusters for e in c.running.pending)  # the no-work-left case ran


async def test_the_views_pending_entries_and_started_records_are_kept_from_view_to_view():
    h = await _harness_with_started_and_unstarted()
    first = h.svc.view()
    h.advance(2.0)
    again = h.svc.view()
    for c1, c2 in zip(first.clusters, again.clusters):
        assert c2.running.started is c1.running.started  # nothing started or ended: the same tuple
        assert c1.running.pending and all(a is b for a, b in zip(c1.running.pending, c2.running.pending))
        assert c2.running._all is None  # no record built until the core reads them
        assert [w.est_end for w in c2.running if w.started_at is None] == \
            [w.est_end + 2.0 for w in c1.running if w.started_at is None]
