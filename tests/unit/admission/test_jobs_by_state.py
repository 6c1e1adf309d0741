"""Jobs by state, kept by admission's job view as events fold (the ``fedsched_admission_jobs``
gauge reads these counts; nothing walks the jobs at scrape time)."""

from __future__ import annotations

from collections import Counter

import pytest

from fedsched.events import JobPlaced, JobStatus, JobSubmitted, WorkerBinding, make_event
from fedsched.jobs import JobSpec, JobState
from fedsched.metrics import AdmissionMetrics
from services.admission.jobview import JobView

T0 = 1_700_000_000.0
SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)


def ev(type_, payload, job, at, **kw):
    return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train", job_id=job,
                      **kw)


def submitted(job, at=T0):
    return ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice"), job, at, actor="alice")


def placed(job, at, attempt=1):
    return ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),)), job, at,
              attempt=attempt, cluster="c1", region="cn-north-1")


def status(type_, job, at, attempt=1, reason=""):
    return ev(type_, JobStatus(reason=reason), job, at, attempt=attempt, cluster="c1", region="cn-north-1")


STEPS = [
    submitted("a"), submitted("b"), submitted("c"),
    placed("a", T0 + 1), status("job.started", "a", T0 + 2),
    placed("b", T0 + 1), status("job.started", "b", T0 + 2), status("job.failed", "b", T0 + 3, reason="exit 1"),
    status("job.finished", "a", T0 + 10),
    ev("job.cancelled", JobStatus(reason="cancelled"), "c", T0 + 11, actor="scheduler"),
]


@pytest.mark.parametrize("upto", range(len(STEPS) + 1))
def test_counts_equal_the_states_of_the_jobs_after_every_event(upto):
    view = JobView()
    for e in STEPS[:upto]:
        view.apply(e)
    expected = Counter(rec.state for rec in view.jobs.values())
    assert {s: n for s, n in view.by_state.items() if n} == dict(expected)
    assert set(view.by_state) == set(JobState)  # every state has a key (the scrape copies the dict)


def test_redelivered_events_do_not_count_twice():
    view = JobView()
    for e in STEPS + STEPS:
        view.apply(e)
    assert view.by_state[JobState.SUCCEEDED] == 1
    assert view.by_state[JobState.FAILED] == 1
    assert view.by_state[JobState.CANCELLED] == 1
    assert sum(view.by_state.values()) == 3


def test_the_gauge_reads_the_view():
    view, m = JobView(), AdmissionMetrics()
    m.watch_jobs(lambda: view.by_state)
    view.apply(submitted("a"))
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "queued"}) == 1
    view.apply(placed("a", T0 + 1))
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "queued"}) == 0
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "placed"}) == 1
