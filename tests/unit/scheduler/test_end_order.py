"""Wait estimates read a cluster's running work in order of expected end from an order the
service keeps (:class:`services.scheduler.core.preempt.EndOrder`, issue 15 item 1): at 100,000
running jobs, sorting every cluster's work for each estimate was 55% of a cycle. The kept order
gives the ends a sort gives (equal ends in any order) and every estimate is what sorting gives;
the service keeps it equal to its running records while work starts and ends."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import RunningSet, RunningWork
from services.scheduler.core.fit import WorkingCluster
from services.scheduler.core.preempt import OVERDUE_FLOOR_S, EndOrder, estimated_start, expected_end
from tests.builders import ClusterSpec, SchedulerHarness, nodes
from tests.unit.scheduler.test_shape_sharing import NOW, T4, V100, federation

#: (started_at offset, est_end offset) from NOW: ahead, overdue by a little or a lot, started long ago
#: and overdue, never estimated; None started_at = placed, not started
VARIANTS = [(-600.0, 120.0), (-600.0, 900.0), (-60.0, -10.0), (-5000.0, -10.0), (-600.0, 0.0), (-900.0, math.inf),
            (None, 30.0), (None, 0.0), (None, math.inf), (-600.0, OVERDUE_FLOOR_S)]


def _running_set(works: list[RunningWork], variants: list[tuple]) -> RunningSet:
    """``works`` recast by ``variants`` (same order) as a running set with a kept end order."""
    started, pending = [], []
    for w, (start, end) in zip(works, variants):
        if start is None:  # a pending entry: the RunningWork fields with the work left instead of est_end
            pending.append((w.job_id, w.attempt, w.shard, w.tenant, w.priority, w.preemptible, w.checkpointable,
                            max(0.0, end), w.card_model, w.bindings))
        else:
            started.append(replace(w, started_at=NOW + start, est_end=NOW + end))
    return RunningSet(tuple(started), tuple(pending), NOW, ends=EndOrder(started))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(VARIANTS), st.integers(0, 3)), min_size=0, max_size=40))
def test_the_kept_order_gives_the_sorted_ends(drawn):
    works = [RunningWork(f"w{i}", 1, 0, "ads", 50, False, False, NOW, NOW, T4, ((k, (0,), 1000, 1000, 1024),))
             for i, (_, k) in enumerate(drawn)]
    rs = _running_set(works, [v for v, _ in drawn])
    got = list(rs.ends.expected_ends(NOW, rs.pending_records()))
    want = sorted(((expected_end(w, NOW), w) for w in rs), key=lambda x: x[0])
    assert [e for e, _ in got] == [e for e, _ in want]  # nondecreasing, the same ends
    assert sorted(w.job_id for _, w in got) == sorted(w.job_id for _, w in want)  # every work once


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=federation(), data=st.data(), within=st.sampled_from((None, 0.0, 120.0, 299.0, 300.0, 900.0, 1e9)))
def test_an_estimate_from_the_kept_order_is_the_estimate_from_sorting(case, data, within):
    view, queue = case
    for c in view.clusters:
        works = list(c.running)
        rs = _running_set(works, [data.draw(st.sampled_from(VARIANTS)) for _ in works])
        kept, plain = replace(c, running=rs), replace(c, running=tuple(rs))
        for j in queue[:5]:
            models = [m for m in (j.spec.card_models or (T4, V100)) if m in c.prices]
            a = estimated_start(j.spec, models, kept, WorkingCluster(kept), NOW, within=within)
            b = estimated_start(j.spec, models, plain, WorkingCluster(plain), NOW, within=within)
            assert a == b


def test_removing_work_the_order_does_not_hold_is_an_error():
    w = RunningWork("w", 1, 0, "ads", 50, False, False, NOW, NOW + 10, T4, ())
    order = EndOrder([w])
    order.remove(w)
    assert len(order) == 0
    try:
        order.remove(w)
    except ValueError:
        pass
    else:
        raise AssertionError("removed work it did not hold")


async def test_the_service_keeps_each_clusters_end_order_equal_to_its_running_records():
    A, B = "cn-north-1-c1", "cn-north-1-c2"
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=6)), ClusterSpec(B, node_list=nodes("b", count=6))),
                         reclaim_after_s=1e9)
    for i in range(60):
        h.submit(f"j{i}", estimated_duration_s=None if i % 9 == 0 else 60.0 + 7 * (i % 5))
    await h.cycle()
    for i in range(0, 60, 2):
        h.report(f"j{i}", "job.started")
    await h.cycle()
    h.advance(5.0)
    for i in range(1, 60, 2):
        h.report(f"j{i}", "job.started")
    for i in range(0, 60, 3):
        h.report(f"j{i}", "job.finished")
    await h.cycle()
    svc = h.svc
    svc.view()
    for name, works in svc._works.items():
        assert sorted(svc._ends[name], key=lambda w: w.job_id) == sorted(works.values(), key=lambda w: w.job_id)
    assert sum(len(w) for w in svc._works.values()) == 40  # 60 started, 20 finished
