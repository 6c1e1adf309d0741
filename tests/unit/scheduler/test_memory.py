"""Finished jobs leave the scheduler's memory (issue 15 item 2, issue 14 item 8).

A real service on the harness's fakes: 10,000 short jobs go through it (submitted, placed,
started, finished) while a few long ones keep running; the :class:`JobEntry` objects alive
(counted with ``gc``) stay bounded by the live jobs plus ``retain_ended``, and the tombstones by
``retain_tombstones``. A late status of a job that left memory is ignored (not refused as a
forgery); a status of an attempt it never had is refused; a redelivered submit does not revive it.
"""

from __future__ import annotations

import gc

from services.scheduler.service import JobEntry, ShardEntry
from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, SchedulerHarness, delivery, nodes, status_event, submitted

A = "cn-north-1-c1"
LONG = 20
BATCH = 100
BATCHES = 100  #: 10,000 short jobs
RETAIN = 50
TOMBSTONES = 3000


def _alive(cls) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)


async def test_job_entries_stay_bounded_while_10000_jobs_finish():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=40)),), reclaim_after_s=1e9,
                         retain_ended=RETAIN, retain_tombstones=TOMBSTONES)
    svc = h.svc
    for i in range(LONG):
        h.submit(f"long{i}")
    await h.cycle()
    for i in range(LONG):
        h.report(f"long{i}", "job.started")
    base_entries = _alive(JobEntry)
    peak_jobs = peak_entries = 0
    for b in range(BATCHES):
        ids = [f"b{b}-{k}" for k in range(BATCH)]
        for job in ids:
            h.submit(job)
        await h.cycle()
        for job in ids:
            h.report(job, "job.started")
        await h.cycle()
        for job in ids:
            h.report(job, "job.finished")
        await h.cycle()
        peak_jobs = max(peak_jobs, len(svc.jobs))
        if b % 25 == 24:
            peak_entries = max(peak_entries, _alive(JobEntry))
    assert svc.counts[ShardState.RUNNING] == LONG
    assert svc.counts[ShardState.DONE] == BATCH * BATCHES
    # live (the long jobs) + one batch in flight + the retained ended ones, never the 10,000
    assert peak_jobs <= LONG + BATCH + RETAIN
    assert len(svc.jobs) == LONG + RETAIN
    assert peak_entries <= base_entries + BATCH + RETAIN
    assert _alive(ShardEntry) <= LONG + BATCH + RETAIN
    assert len(svc.tombstones) == TOMBSTONES  # the newest ended ids, bounded
    assert len(svc.governor.started) <= LONG + RETAIN


async def test_late_status_of_a_job_that_left_memory_is_ignored_and_a_forged_one_refused():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=4)),), reclaim_after_s=1e9, retain_ended=1)
    svc = h.svc
    for job in ("old", "newer"):
        h.submit(job)
        await h.cycle()
        h.report(job, "job.started")
        h.report(job, "job.finished")
    assert "old" not in svc.jobs and svc.tombstones["old"] == 1
    assert "newer" in svc.jobs  # retained (retain_ended=1)
    placed = h.placed[("old", 0)]
    before = svc.rejected
    late = status_event("job.finished", placed, h.clock.time(), started_at=h.clock.time())
    subject = h.subjects.status(placed.region, placed.cluster)
    svc.handle_event(delivery(late, subject, 9_000, h.clock.time()))  # a redelivery of the end
    assert svc.rejected == before  # known, ended: ignored
    forged = status_event("job.started", placed.model_copy(update={"attempt": 7}), h.clock.time())
    svc.handle_event(delivery(forged, subject, 9_001, h.clock.time()))
    assert svc.rejected == before + 1 and "never placed" in svc.rejections[-1].reason
    # a redelivered submit does not bring the job back into the queue
    spec = h.specs["old"]
    svc.handle_event(delivery(submitted("old", spec, h.clock.time()),
                              h.subjects.job("submitted", spec.tenant, spec.project), 10_000, h.clock.time()))
    assert "old" not in svc.jobs and not svc.queued
