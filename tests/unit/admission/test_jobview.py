"""Admission's job read model: every terminal transition carries the ending event's time and
reason, and every attempt its true outcome (services/admission/jobview.py)."""

from __future__ import annotations

import pytest

from fedsched.events import JobCancelRequested, JobPending, JobPlaced, JobStatus, JobStop, JobSubmitted, WorkerBinding, make_event
from fedsched.jobs import JobSpec, JobState
from services.admission.jobview import JobView

T0 = 1_700_000_000.0  # submit time (business seconds)
JOB = "j-view-1"


def _spec(**kw) -> JobSpec:
    return JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1, retry_limit=kw.pop("retry_limit", 1), **kw)


class Events:
    """Builders for the events of one job, as admission reads them off the bus."""

    def __init__(self, spec: JobSpec | None = None) -> None:
        self.spec = spec or _spec()

    def _ev(self, type_, payload, at, **kw):
        return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train",
                          job_id=JOB, **kw)

    def submitted(self, at=T0):
        return self._ev("job.submitted", JobSubmitted(spec=self.spec, submitted_by="alice"), at, actor="alice")

    def cancel_requested(self, at, who="alice", reason=""):
        return self._ev("job.cancel_requested", JobCancelRequested(reason=reason), at, actor=who)

    def cancelled(self, at, attempt=0):
        return self._ev("job.cancelled", JobStatus(reason="cancelled"), at, attempt=attempt, actor="scheduler")

    def placed(self, at, attempt, cluster="c1", shard=0):
        return self._ev("job.placed", JobPlaced(spec=self.spec, bindings=(WorkerBinding(worker=0, node="n0"),),
                                                shard=shard), at, attempt=attempt, cluster=cluster, region="cn-north-1")

    def stop(self, at, attempt, reason, cluster="c1", **kw):
        return self._ev("job.stop", JobStop(reason=reason, **kw), at, attempt=attempt, cluster=cluster,
                        region="cn-north-1")

    def status(self, type_, at, attempt, cluster="c1", reason=""):
        return self._ev(type_, JobStatus(reason=reason), at, attempt=attempt, cluster=cluster, region="cn-north-1")


def _fold(*events) -> JobView:
    view = JobView()
    for e in events:
        view.apply(e)
    return view


def test_a_queued_job_cancelled_at_t_ended_at_t_with_who_and_why():
    ev = Events()
    t = T0 + 125.0
    rec = _fold(ev.submitted(), ev.cancel_requested(T0 + 120.0, reason="wrong dataset"), ev.cancelled(t)).jobs[JOB]
    assert rec.state == JobState.CANCELLED
    assert rec.ended_at == t != rec.submitted_at
    assert rec.reason == "cancelled by alice: wrong dataset"
    assert rec.attempts == []


def test_the_cancel_reason_replaces_the_pending_reason():
    ev = Events()
    view = _fold(ev.submitted())
    pending = make_event("job.pending", JobPending(reason="quota_exceeded"), producer="scheduler",
                         occurred_at=T0 + 1, tenant="search", project="train", job_id=JOB)
    view.apply(pending)
    assert view.jobs[JOB].reason == "quota_exceeded"
    view.apply(ev.cancel_requested(T0 + 2, who="root"))
    assert view.jobs[JOB].reason == "cancel requested" and view.jobs[JOB].ended_at is None
    view.apply(ev.cancelled(T0 + 3))
    assert (view.jobs[JOB].reason, view.jobs[JOB].ended_at) == ("cancelled by root", T0 + 3)


def test_a_reclaimed_attempt_ends_at_the_order_and_the_next_attempt_is_current():
    ev = Events()
    view = _fold(ev.submitted(), ev.placed(T0 + 1, 1, "c1"))
    view.apply(ev.stop(T0 + 31, 1, "reclaimed", detail="not started within 30 s"))
    rec = view.jobs[JOB]
    first = rec.attempts[0]
    assert (first.outcome, first.ended_at, first.reason) == ("reclaimed", T0 + 31, "not started within 30 s")
    assert rec.state == JobState.QUEUED and "reclaimed from c1" in rec.reason
    view.apply(ev.placed(T0 + 32, 2, "c2"))
    view.apply(ev.status("job.started", T0 + 33, 2, "c2"))
    view.apply(ev.status("job.finished", T0 + 93, 2, "c2"))
    first, second = rec.attempts
    assert rec.current is second and (second.outcome, second.cluster) == ("succeeded", "c2")
    assert first.outcome == "reclaimed" and first.started_at is None
    assert rec.state == JobState.SUCCEEDED and rec.ended_at == T0 + 93


def test_a_reclaimed_attempt_the_agent_started_late_keeps_its_outcome_and_the_new_attempt_its_state():
    ev = Events()
    view = _fold(ev.submitted(), ev.placed(T0 + 1, 1, "c1"), ev.stop(T0 + 31, 1, "reclaimed"),
                 ev.placed(T0 + 32, 2, "c2"),
                 ev.status("job.started", T0 + 32.5, 1, "c1"),  # c1 woke up and started it
                 ev.status("job.started", T0 + 33, 2, "c2"),
                 ev.status("job.stopped", T0 + 34, 1, "c1", reason="reclaimed"))
    rec = view.jobs[JOB]
    first, second = rec.attempts
    assert (first.outcome, first.started_at, first.ended_at) == ("reclaimed", T0 + 32.5, T0 + 34)
    assert second.outcome == "running" and rec.state == JobState.RUNNING and rec.current is second


def test_preemption_is_stopping_until_the_agent_stops_it_then_preempted():
    ev = Events()
    view = _fold(ev.submitted(), ev.placed(T0 + 1, 1), ev.status("job.started", T0 + 2, 1),
                 ev.stop(T0 + 100, 1, "preempted", for_job="j-high"))
    att = view.jobs[JOB].attempts[0]
    assert (att.outcome, att.ended_at, att.reason) == ("stopping", None, "preempted for j-high")
    assert view.jobs[JOB].state == JobState.RUNNING
    view.apply(ev.status("job.stopped", T0 + 101, 1, reason="preempted"))
    assert (att.outcome, att.ended_at, att.reason) == ("preempted", T0 + 101, "preempted for j-high")
    assert view.jobs[JOB].state == JobState.QUEUED and view.jobs[JOB].ended_at is None


@pytest.mark.parametrize("started", [True, False], ids=["running", "placed"])
def test_an_attempt_on_a_lost_cluster_is_lost_at_the_schedulers_word_and_the_job_requeued(started):
    """The scheduler declares a silent cluster's attempts lost: job.stop + job.stopped, both
    reason cluster_lost (services/scheduler/service.py ``_reclaim``)."""
    ev = Events()
    events = [ev.submitted(), ev.placed(T0 + 1, 1)] + ([ev.status("job.started", T0 + 2, 1)] if started else [])
    view = _fold(*events, ev.stop(T0 + 40, 1, "cluster_lost", detail="cluster c1 silent past 10 s"))
    att = view.jobs[JOB].attempts[0]
    assert (att.outcome, att.ended_at) == ("stopping", None)
    view.apply(ev.status("job.stopped", T0 + 40, 1, reason="cluster_lost"))
    rec = view.jobs[JOB]
    assert (att.outcome, att.ended_at, att.reason) == ("lost", T0 + 40, "cluster_lost (cluster c1 silent past 10 s)")
    assert rec.state == JobState.QUEUED and "cluster_lost on c1" in rec.reason and rec.ended_at is None


def test_a_running_job_cancelled_ends_when_its_agent_stopped_it():
    ev = Events()
    view = _fold(ev.submitted(), ev.placed(T0 + 1, 1), ev.status("job.started", T0 + 2, 1),
                 ev.cancel_requested(T0 + 50, who="bob", reason="no longer needed"),
                 ev.stop(T0 + 51, 1, "cancelled"), ev.status("job.stopped", T0 + 52, 1, reason="cancelled"),
                 ev.cancelled(T0 + 53, attempt=1))
    rec = view.jobs[JOB]
    att = rec.attempts[0]
    assert (att.outcome, att.ended_at, att.reason) == ("cancelled", T0 + 52, "cancelled by bob: no longer needed")
    assert rec.state == JobState.CANCELLED and rec.reason == "cancelled by bob: no longer needed"
    assert rec.ended_at == T0 + 52  # its last shard ended when the agent stopped it


@pytest.mark.parametrize("last,state,ended_at,reason", [
    ("job.finished", JobState.SUCCEEDED, T0 + 70, ""),
    ("job.failed", JobState.FAILED, T0 + 70, "exit 1"),
], ids=["succeeded", "failed-beyond-retries"])
def test_every_terminal_transition_takes_its_events_time(last, state, ended_at, reason):
    ev = Events(_spec(retry_limit=0))
    rec = _fold(ev.submitted(), ev.placed(T0 + 1, 1), ev.status("job.started", T0 + 2, 1),
                ev.status(last, T0 + 70, 1, reason=reason)).jobs[JOB]
    assert (rec.state, rec.ended_at, rec.reason) == (state, ended_at, reason)


def test_a_failed_attempt_within_the_retry_limit_requeues_and_the_job_has_no_end():
    ev = Events(_spec(retry_limit=1))
    rec = _fold(ev.submitted(), ev.placed(T0 + 1, 1), ev.status("job.started", T0 + 2, 1),
                ev.status("job.failed", T0 + 9, 1, reason="oom")).jobs[JOB]
    assert rec.state == JobState.QUEUED and rec.ended_at is None
    assert (rec.attempts[0].outcome, rec.attempts[0].ended_at) == ("failed", T0 + 9)


def test_refolding_the_same_events_changes_nothing():
    ev = Events()
    events = [ev.submitted(), ev.placed(T0 + 1, 1), ev.stop(T0 + 31, 1, "reclaimed"), ev.placed(T0 + 32, 2, "c2"),
              ev.status("job.started", T0 + 33, 2, "c2"), ev.cancel_requested(T0 + 40),
              ev.stop(T0 + 41, 2, "cancelled", cluster="c2"),
              ev.status("job.stopped", T0 + 42, 2, "c2", reason="cancelled"), ev.cancelled(T0 + 43, attempt=2)]
    once = _fold(*events).jobs[JOB]
    twice = _fold(*events, *events).jobs[JOB]
    assert [(a.outcome, a.ended_at, a.reason) for a in once.attempts] == \
           [(a.outcome, a.ended_at, a.reason) for a in twice.attempts]
    assert (once.state, once.ended_at, once.reason) == (twice.state, twice.ended_at, twice.reason)
    assert [a.outcome for a in once.attempts] == ["reclaimed", "cancelled"]


def _approval_requested(at, approval_id="ap-0123456789abcdef0123"):
    from fedsched.clock import to_datetime
    from fedsched.events import ApprovalRequested
    evaluations = ({"cluster": "east-c1", "region": "cn-east-1", "passed": True, "reason": "", "detail": "",
                    "scores": {"price": 0.9}, "total": 0.9},
                   {"cluster": "north-c1", "region": "cn-north-1", "passed": False,
                    "reason": "insufficient_free_resources", "detail": "0 of 1 GPU free", "scores": {}, "total": None})
    return make_event("approval.requested", ApprovalRequested(
        approval_id=approval_id, home_region="cn-north-1", proposed_region="cn-east-1", proposed_cluster="east-c1",
        reason="home region cn-north-1: full; east-c1 (cn-east-1) can run it now", expires_at=to_datetime(at + 3600),
        evaluations=evaluations, queue="training"),
        producer="scheduler", occurred_at=at, tenant="search", project="train", job_id=JOB, region="cn-east-1",
        cluster="east-c1", actor="scheduler", policy_version="v7")


def test_a_job_awaiting_approval_explains_the_proposal_and_its_verdicts():
    from fedsched.api.v1 import jobs_pb2 as pb
    from services.admission.service import explain_to_pb
    ev = Events()
    view = _fold(ev.submitted(), _approval_requested(T0 + 10))
    out = explain_to_pb(view.jobs[JOB])
    assert out.state == pb.JOB_STATE_AWAITING_APPROVAL
    (d,) = out.decisions
    assert (d.outcome, d.cluster, d.region, d.queue, d.policy_version) == (
        "awaiting_approval", "east-c1", "cn-east-1", "training", "v7")
    assert d.summary.startswith("home region cn-north-1: full") and d.approval_id == "ap-0123456789abcdef0123"
    assert d.approval_expires_at.seconds == int(T0 + 3610) and d.decided_at.seconds == int(T0 + 10)
    assert {c.cluster: (c.passed, c.reason) for c in d.clusters} == {
        "east-c1": (True, ""), "north-c1": (False, "insufficient_free_resources")}


def test_an_answered_proposal_is_no_longer_awaiting_approval():
    from fedsched.events import ApprovalDecided, approval_outcome_id
    from services.admission.service import explain_to_pb
    ev = Events()
    rejected = make_event("approval.rejected", ApprovalDecided(approval_id="ap-0123456789abcdef0123",
                                                               proposed_region="cn-east-1"),
                          producer="admission", occurred_at=T0 + 20, tenant="search", project="train", job_id=JOB,
                          event_id=approval_outcome_id("ap-0123456789abcdef0123"), actor="bob")
    view = _fold(ev.submitted(), _approval_requested(T0 + 10), rejected)
    (d,) = explain_to_pb(view.jobs[JOB]).decisions
    assert d.outcome == "approval_rejected" and d.summary.startswith("cross-region run rejected by bob")
    assert len(d.clusters) == 2
    cli, page = _rendered_explain(view)
    for text in (cli, page):  # the answered request, not a proposal still awaiting approval
        assert "awaiting approval" not in text.lower() and "decides by" not in text
    assert "proposal rejected: request ap-0123456789abcdef0123" in cli
    assert "Proposal rejected: request" in page and "<code>ap-0123456789abcdef0123</code>" in page
    cli, page = _rendered_explain(_fold(ev.submitted(), _approval_requested(T0 + 10)))  # still open
    assert "awaiting approval: needs a cross-region approval to run in cn-east-1 (east-c1): request " \
           "ap-0123456789abcdef0123, to be approved or rejected by" in " ".join(cli.split())
    assert "Awaiting approval (" in page and "it needs a cross-region approval to run in cn-east-1" in page


def _rendered_explain(view) -> tuple[str, str]:
    """The job's explanation as ``fedsched explain`` prints it and as the console's job page shows it."""
    import io
    from decimal import Decimal

    from fedapp.cli import jobs as cli_jobs
    from fedapp.cli.text import CliConsole
    from fedapp.web.app import _templates, approval_texts
    from fedsched.api.v1 import jobs_pb2 as pb
    from services.admission.service import explain_to_pb

    resp = explain_to_pb(view.jobs[JOB])
    out, saved = io.StringIO(), cli_jobs.console
    cli_jobs.console = CliConsole(file=out, width=200)
    try:
        cli_jobs._print_explain(resp)
    finally:
        cli_jobs.console = saved
    job = pb.Job(job_id=JOB, state=resp.state)
    page = _templates().get_template("job.html").render(
        csrf="", signed_in=True, path=f"/jobs/{JOB}", job=job, explain=resp, awaiting=approval_texts(job, resp),
        reads=False, events=[], event_total=0, cost=[], total_cost=Decimal(0), currency="", unreadable="")
    return out.getvalue(), page
