"""Admission's read model of every job, folded from the event stream.

GetJob / ListJobs / WatchJob read this view; it is rebuilt from ``P_EVENTS`` on start and kept
current by following it, so admission is restartable with no database of its own. It also
indexes client request ids, so a retried SubmitJob returns the job it created the first time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fedsched.bus import Delivery
from fedsched.events import ApprovalDecided, ApprovalRequested, Envelope, JobPending, JobPlaced, JobStatus, JobSubmitted
from fedsched.jobs import TERMINAL_STATES, JobSpec, JobState


@dataclass
class AttemptRecord:
    """One placement attempt (times in business seconds since the Unix epoch)."""

    attempt: int
    region: str
    cluster: str
    card_model: str = ""
    placed_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    outcome: str = "placed"
    reason: str = ""
    cross_region: bool = False
    explanation: str = ""


@dataclass
class JobRecord:
    """Everything admission knows about one job."""

    job_id: str
    spec: JobSpec
    submitted_at: float
    submitted_by: str
    request_id: str
    state: JobState = JobState.QUEUED
    reason: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)
    policy_version: str = ""
    unplaceable: bool = False
    approval_id: str = ""  # the latest cross-region approval request
    version: int = 0  # increases with every change (for watchers)

    @property
    def current(self) -> AttemptRecord | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None


class JobView:
    """Jobs by id, folded from events; notifies watchers on change."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.by_request: dict[tuple[str, str], str] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self.applied_seq = 0

    def apply_delivery(self, d: Delivery) -> None:
        """Fold one delivered event (follower callback)."""
        self.applied_seq = max(self.applied_seq, d.stream_sequence)
        self.apply(d.envelope)

    def apply(self, env: Envelope) -> None:
        """Fold one event; idempotent (re-applying an event changes nothing)."""
        if env.type == "job.submitted":
            if env.job_id in self.jobs:
                return
            sub = env.payload_as(JobSubmitted)
            rec = JobRecord(env.job_id, sub.spec, env.occurred_at.timestamp(), sub.submitted_by, sub.request_id)
            self.jobs[env.job_id] = rec
            if sub.request_id:
                self.by_request[(sub.spec.tenant, sub.request_id)] = env.job_id
            self._notify(rec)
            return
        rec = self.jobs.get(env.job_id)
        if rec is None or rec.state in TERMINAL_STATES:
            return
        t = env.occurred_at.timestamp()
        if env.type == "job.placed":
            if rec.current and rec.current.attempt >= env.attempt:
                return
            p = env.payload_as(JobPlaced)
            rec.attempts.append(AttemptRecord(env.attempt, env.region, env.cluster, p.card_model, placed_at=t,
                                              cross_region=p.cross_region, explanation=p.explanation))
            rec.state, rec.reason, rec.unplaceable = JobState.PLACED, "", False  # also ends AWAITING_APPROVAL
            rec.policy_version = env.policy_version
        elif env.type == "job.pending":
            p = env.payload_as(JobPending)
            if rec.state == JobState.QUEUED:
                rec.reason, rec.unplaceable = p.reason, not p.fits_empty
                rec.policy_version = env.policy_version
        elif env.type == "approval.requested":
            if rec.state != JobState.QUEUED:
                return
            req = env.payload_as(ApprovalRequested)
            rec.state, rec.approval_id = JobState.AWAITING_APPROVAL, req.approval_id
            rec.reason = f"awaiting approval {req.approval_id} to run in {req.proposed_region}: {req.reason}"
            rec.policy_version = env.policy_version
        elif env.type in ("approval.approved", "approval.rejected", "approval.expired"):
            out = env.payload_as(ApprovalDecided)
            if rec.state != JobState.AWAITING_APPROVAL or rec.approval_id != out.approval_id:
                return
            rec.state = JobState.QUEUED
            rec.reason = {
                "approval.approved": f"cross-region run in {out.proposed_region} approved by {env.actor}",
                "approval.rejected": f"cross-region run rejected by {env.actor}; waits in its home region",
                "approval.expired": "approval timed out; back in its home region's queue",
            }[env.type]
        elif env.type == "job.cancel_requested":
            rec.reason = "cancel requested"
        elif env.type == "job.cancelled":
            rec.state, rec.reason, rec.ended_at = JobState.CANCELLED, "cancelled before placement", t
        elif env.type in ("job.started", "job.finished", "job.failed", "job.rejected", "job.stopped"):
            att = rec.current
            if att is None or att.attempt != env.attempt:
                return
            s = env.payload_as(JobStatus)
            if env.type == "job.started":
                att.started_at, att.outcome = t, "running"
                rec.state = JobState.RUNNING
                rec.started_at = rec.started_at or t
            elif env.type == "job.finished":
                att.ended_at, att.outcome = t, "succeeded"
                rec.state, rec.ended_at = JobState.SUCCEEDED, t
            elif env.type == "job.failed":
                att.ended_at, att.outcome, att.reason = t, "failed", s.reason
                retries_left = sum(a.outcome == "failed" for a in rec.attempts) <= rec.spec.retry_limit
                if retries_left:
                    rec.state, rec.reason = JobState.QUEUED, f"attempt {env.attempt} failed on {env.cluster}; retrying"
                else:
                    rec.state, rec.reason, rec.ended_at = JobState.FAILED, s.reason, t
            elif env.type == "job.rejected":
                att.ended_at, att.outcome, att.reason = t, "rejected", s.reason
                rec.state, rec.reason = JobState.QUEUED, f"{env.cluster} refused the placement: {s.reason}"
            else:  # stopped
                att.ended_at, att.outcome, att.reason = t, "stopped", s.reason
                if s.reason == "cancelled":
                    rec.state, rec.reason, rec.ended_at = JobState.CANCELLED, "cancelled", t
                else:
                    rec.state, rec.reason = JobState.QUEUED, f"{s.reason} on {env.cluster}; requeued"
        else:
            return
        self._notify(rec)

    def _notify(self, rec: JobRecord) -> None:
        rec.version += 1
        event = self._changed.pop(rec.job_id, None)
        if event is not None:
            event.set()

    def changed(self, job_id: str) -> asyncio.Event:
        """An event set at the next change of ``job_id`` (for WatchJob)."""
        event = self._changed.get(job_id)
        if event is None:
            event = self._changed[job_id] = asyncio.Event()
        return event

    def find_request(self, tenant: str, request_id: str) -> JobRecord | None:
        """The job a tenant's earlier request with ``request_id`` created, if any."""
        job_id = self.by_request.get((tenant, request_id))
        return self.jobs.get(job_id) if job_id else None
