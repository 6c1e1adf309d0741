"""Admission restarted from a checkpoint plus the stream after it holds the read models a full
read gives (issue 15 item 3): jobs (states, attempts, decisions, reasons, holds, priorities),
the listing and request indexes, open jobs per tenant, jobs per state, tombstones, approvals and
the spend summed from usage events; for a stream with submits, placements, pending decisions,
starts, finishes, failures with retries, cancellations, holds, releases, priority changes,
approval requests and decisions and usage, cut at several points."""

from __future__ import annotations

import pytest

from fedsched import snapshots
from fedsched.clock import to_datetime
from fedsched.events import (ApprovalDecided, ApprovalRequested, JobCancelRequested, JobHeld, JobPending, JobPlaced,
                             JobPriorityChanged, JobStatus, JobSubmitted, UsageRecorded, WorkerBinding, make_event)
from fedsched.jobs import JobSpec, PriorityClass
from services.admission.approvalview import ApprovalView
from services.admission.budgets import SpendBook
from services.admission.ended import EndedJobs, record_doc
from services.admission.jobview import JobView
from services.admission.snapshot import STATE_VERSION, admission_state, restore_admission

T0 = 1_700_000_000.0
SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1, retry_limit=1)


def _ev(type_, payload, job_id, at, **kw):
    kw.setdefault("region", "cn-north-1")
    return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train",
                      job_id=job_id, **kw)


def _stream() -> list:
    out = []
    t = T0
    for i in range(30):
        j = f"j{i}"
        out.append(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice", request_id=f"r{i}"), j, t,
                       actor="alice"))
        t += 1
    for i in range(0, 20):
        j = f"j{i}"
        out.append(_ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),),
                                               explanation=f"best of 2 for {j}"), j, t, attempt=1, cluster="c1"))
        out.append(_ev("job.started", JobStatus(), j, t + 1, attempt=1, cluster="c1"))
    for i in range(20, 30):
        out.append(_ev("job.pending", JobPending(reason="insufficient_free_resources"), f"j{i}", t))
    t += 10
    for i in range(0, 8):
        out.append(_ev("job.finished", JobStatus(), f"j{i}", t + i, attempt=1, cluster="c1"))
        out.append(_ev("usage.recorded", UsageRecorded(gpu_seconds=60, cost="1.25"), f"j{i}", t + i))
    out.append(_ev("job.failed", JobStatus(reason="oom"), "j8", t, attempt=1, cluster="c1"))  # retried
    out.append(_ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n1"),)), "j8", t + 1,
                   attempt=2, cluster="c2"))
    out.append(_ev("job.cancel_requested", JobCancelRequested(reason="not needed"), "j9", t, actor="bob"))
    out.append(_ev("job.stopped", JobStatus(reason="cancelled"), "j9", t + 2, attempt=1, cluster="c1"))
    out.append(_ev("job.cancelled", JobStatus(reason="cancelled"), "j9", t + 3, attempt=1, actor="scheduler"))
    out.append(_ev("job.held", JobHeld(reason="wait"), "j25", t, actor="bob"))
    out.append(_ev("job.held", JobHeld(reason="wait"), "j26", t, actor="bob"))
    out.append(_ev("job.released", JobHeld(reason="go"), "j26", t + 5, actor="bob"))
    out.append(_ev("job.priority_changed", JobPriorityChanged(previous=PriorityClass.NORMAL,
                                                              priority=PriorityClass.HIGH), "j27", t, actor="bob"))
    for n, (j, outcome) in enumerate((("j28", "approval.approved"), ("j29", "approval.rejected"))):
        aid = f"ap-{n:020x}"
        out.append(_ev("approval.requested", ApprovalRequested(
            approval_id=aid, home_region="cn-north-1", proposed_region="cn-east-1", proposed_cluster="e1",
            expires_at=to_datetime(t + 3600)), j, t, actor="scheduler"))
        out.append(_ev(outcome, ApprovalDecided(approval_id=aid, proposed_region="cn-east-1"), j, t + 5, actor="carol"))
    out.append(_ev("job.cancel_requested", JobCancelRequested(), "j24", t + 20, actor="alice"))
    out.append(_ev("job.cancelled", JobStatus(reason="cancelled"), "j24", t + 21, actor="scheduler"))
    for i in range(10, 14):
        out.append(_ev("job.finished", JobStatus(), f"j{i}", t + 30, attempt=1, cluster="c1"))
    return out


class Admission:
    """Admission's three read models fed as its follower feeds them (approvals to both views,
    usage to the spend book, everything else to the job view)."""

    def __init__(self) -> None:
        self.ended = EndedJobs(None)
        self.view = JobView(retain_ended=4, archive=self.ended.put, retain_tombstones=1000)
        self.approvals = ApprovalView()
        self.spend = SpendBook()

    def feed(self, env, seq: int) -> None:
        if env.type == "usage.recorded":
            self.spend.apply_event(env)
        else:
            if env.type.startswith("approval."):
                self.approvals.apply(env)
            self.view.apply(env)
        self.view.applied_seq = seq

    def book(self) -> dict:
        v = self.view
        return {"jobs": {k: record_doc(r) for k, r in v.jobs.items()}, "ended": list(v.ended),
                "tombstones": dict(v.tombstones), "by_state": dict(v.by_state), "by_submitted": list(v.by_submitted),
                "by_request": dict(v.by_request), "open": {t: ids for t, ids in v.open_by_tenant.items() if ids},
                "states": {k: r.state for k, r in v.jobs.items()},
                "approvals": dict(self.approvals.by_id), "spend": dict(self.spend.from_events),
                "applied_seq": v.applied_seq}


@pytest.mark.parametrize("cut", [5, 40, 70, 95, 110])
def test_checkpoint_plus_tail_equals_a_full_read(cut):
    events = _stream()
    assert cut < len(events)
    live = Admission()
    for seq, env in enumerate(events[:cut], 1):
        live.feed(env, seq)
    data = snapshots.encode("admission", STATE_VERSION, live.view.applied_seq,
                            admission_state(live.view, live.approvals, live.spend))
    snap = snapshots.decode(data, "admission", STATE_VERSION)
    restored = Admission()
    restore_admission(restored.view, restored.approvals, restored.spend, snap.state, snap.applied_seq)
    for seq, env in enumerate(events, 1):
        if seq > snap.applied_seq:
            restored.feed(env, seq)
    full = Admission()
    for seq, env in enumerate(events, 1):
        full.feed(env, seq)
    assert full.view.tombstones and full.approvals.by_id and full.spend.from_events  # the history is varied
    assert restored.book() == full.book()
    # what left memory after the cut went to the archive in both
    assert set(full.ended.pending) >= set(restored.ended.pending)


def test_a_restart_from_a_checkpoint_still_refuses_an_order_below_the_highest_token_seen() -> None:
    """Issue 14: the highest scheduler-lease fencing token seen is part of the checkpoint, so the
    restarted view does not fold a former active scheduler's order that arrives after it."""
    view = JobView()
    for j in ("j1", "j2"):
        view.apply(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice"), j, T0, actor="alice"))
    view.apply(_ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),), fencing_token=9),
                   "j1", T0 + 1, attempt=1, cluster="c1"))
    state = admission_state(view, ApprovalView(), SpendBook())
    restored = JobView()
    restore_admission(restored, ApprovalView(), SpendBook(), state, applied_seq=3)
    assert restored.highest_token == 9
    restored.apply(_ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),),
                                               fencing_token=4), "j2", T0 + 2, attempt=1, cluster="c1"))
    assert restored.jobs["j2"].current is None and restored.stale_orders == 1


async def test_a_forked_capture_walks_no_job_record_in_the_service_process(monkeypatch):
    """Issue 15 item 3: admission's checkpoint (``AdmissionService.maybe_snapshot`` captures with
    :class:`fedsched.snapshots.ForkedCapture`) walks the job records in the child only."""
    from services.admission import snapshot as module

    live = Admission()
    for seq, env in enumerate(_stream(), 1):
        live.feed(env, seq)
    walked: list[str] = []
    original = module.record_doc

    def counted(rec, specs=None):
        walked.append(rec.job_id)
        return original(rec, specs)

    monkeypatch.setattr(module, "record_doc", counted)

    def build() -> bytes:
        return snapshots.encode("admission", STATE_VERSION, live.view.applied_seq,
                                admission_state(live.view, live.approvals, live.spend))

    data = await snapshots.ForkedCapture(build).result()
    assert walked == []
    assert snapshots.decode(data, "admission", STATE_VERSION).state == snapshots.decode(build(), "admission",
                                                                                          STATE_VERSION).state
    assert len(walked) == len(live.view.jobs) > 0  # (built here: one visit per job)
