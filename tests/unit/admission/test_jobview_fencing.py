"""Admission's job view skips a former active scheduler's late orders (scheduler-lease fencing).

Rule (``services/admission/jobview.py``, issue 14 item 9): in stream order, a ``job.placed`` or
``job.stop`` whose ``fencing_token`` is below the highest seen is not folded; the same rule the
agents, the scheduler and billing apply, so every reader agrees on what happened.
"""

from __future__ import annotations

from fedsched.events import JobPlaced, JobStop, JobSubmitted, WorkerBinding, make_event
from fedsched.jobs import JobSpec, JobState
from services.admission.jobview import JobView

T0 = 1_700_000_000.0
SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)


def _ev(type_, payload, job_id, at, **kw):
    return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train",
                      job_id=job_id, **kw)


def _placed(job_id, token, at):
    return _ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),), fencing_token=token),
               job_id, at, attempt=1, region="cn-north-1", cluster="c1", actor="scheduler")


def test_a_placement_with_a_stale_token_leaves_the_job_queued() -> None:
    view = JobView()
    for job in ("j1", "j2"):
        view.apply(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice"), job, T0, actor="alice"))
    view.apply(_placed("j1", 9, T0 + 1))
    view.apply(_placed("j2", 4, T0 + 2))  # the former holder's, arriving late
    assert view.jobs["j1"].state == JobState.PLACED
    assert view.jobs["j2"].state == JobState.QUEUED
    assert (view.highest_token, view.stale_orders) == (9, 1)


def test_a_stop_order_with_a_stale_token_is_not_folded() -> None:
    view = JobView()
    view.apply(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice"), "j1", T0, actor="alice"))
    view.apply(_placed("j1", 9, T0 + 1))
    view.apply(_ev("job.stop", JobStop(reason="reclaimed", fencing_token=8), "j1", T0 + 2, attempt=1,
                   region="cn-north-1", cluster="c1", actor="scheduler"))
    assert view.jobs["j1"].state == JobState.PLACED
    view.apply(_ev("job.stop", JobStop(reason="reclaimed", fencing_token=9), "j1", T0 + 3, attempt=1,
                   region="cn-north-1", cluster="c1", actor="scheduler"))
    assert view.jobs["j1"].state != JobState.PLACED


def test_a_forged_token_above_the_lease_is_not_folded_nor_the_highest_seen() -> None:
    """The tryout: one ``job.placed`` with token 2^62 (issued by no tenure: the lease's current
    token is 41) must not make the real holder's later placements stale."""
    from fedsched.bus import Delivery
    from fedsched.lease import Tenure
    view = JobView()
    view.tenure = Tenure(41, T0 - 10, "sched-a")
    for job in ("j1", "j2", "j3"):
        view.apply(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice"), job, T0, actor="alice"))
    subject = "fed.placements.cn-north-1.c1"
    view.apply_delivery(Delivery(_placed("j1", 2 ** 62, T0 + 1), subject, {}, 10, 1, published_at=T0 + 1),
                        subject_checked=True)
    assert view.jobs["j1"].state == JobState.QUEUED
    assert (view.highest_token, view.stale_orders) == (0, 1)
    assert JobView.order_token(_placed("j2", 41, T0 + 2)) == 41
    for seq, job in ((11, "j2"), (12, "j3")):
        view.apply_delivery(Delivery(_placed(job, 41, T0 + 2), subject, {}, seq, 1, published_at=T0 + 2),
                            subject_checked=True)
        assert view.jobs[job].state == JobState.PLACED
    assert (view.highest_token, view.stale_orders) == (41, 1)
