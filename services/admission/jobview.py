"""Admission's read model of every job, folded from the event stream.

GetJob / ListJobs / WatchJob / ExplainJob read this view; it is rebuilt from ``P_EVENTS`` on
start and kept current by following it, so admission is restartable with no database of its
own. It also indexes client request ids, so a retried SubmitJob returns the job it created the
first time.

A job has one or more shards (split batch jobs have several; every other job has shard 0).
Each shard has its attempts; the job's state is derived from its shards: running if any runs,
placed if any is placed, queued if any waits, otherwise failed if any failed, cancelled if any
was cancelled, else succeeded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fedsched.bus import Delivery
from fedsched.events import ApprovalDecided, ApprovalRequested, Envelope, JobPending, JobPlaced, JobStatus, JobSubmitted
from fedsched.jobs import TERMINAL_STATES, JobSpec, JobState


@dataclass
class AttemptRecord:
    """One placement attempt (times in business seconds since the Unix epoch)."""

    attempt: int
    shard: int
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
class Decision:
    """The scheduler's latest word on a shard: placed or pending, with every cluster's verdict."""

    outcome: str
    at: float
    reason: str
    evaluations: tuple[dict[str, Any], ...]
    policy_version: str
    counterfactual: str = ""
    cluster: str = ""
    region: str = ""
    queue: str = ""
    fits_empty: bool = True
    reserved_cluster: str = ""


@dataclass
class ShardRecord:
    """One shard's state, attempts and latest decision."""

    index: int
    state: JobState = JobState.QUEUED
    reason: str = ""
    attempts: list[AttemptRecord] = field(default_factory=list)
    decision: Decision | None = None
    failures: int = 0
    unplaceable: bool = False

    @property
    def current(self) -> AttemptRecord | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None


@dataclass
class JobRecord:
    """Everything admission knows about one job."""

    job_id: str
    spec: JobSpec
    submitted_at: float
    submitted_by: str
    request_id: str
    shards: list[ShardRecord] = field(default_factory=list)
    cancelled: bool = False
    cancel_requested: bool = False
    policy_version: str = ""
    approval_id: str = ""  # the latest cross-region approval request
    version: int = 0  # increases with every change (for watchers)

    @property
    def state(self) -> JobState:
        """The job's state, derived from its shards (module docstring)."""
        if self.cancelled:
            return JobState.CANCELLED
        states = [s.state for s in self.shards]
        for s in (JobState.RUNNING, JobState.PLACED, JobState.AWAITING_APPROVAL, JobState.QUEUED):
            if s in states:
                return s
        if JobState.FAILED in states:
            return JobState.FAILED
        if JobState.CANCELLED in states:
            return JobState.CANCELLED
        return JobState.SUCCEEDED

    @property
    def reason(self) -> str:
        """Why it waits / how it ended (the first shard that has something to say)."""
        if self.cancel_requested and self.state not in TERMINAL_STATES:
            return "cancel requested"
        for s in self.shards:
            if s.reason:
                return s.reason if len(self.shards) == 1 else f"shard {s.index}: {s.reason}"
        return ""

    @property
    def attempts(self) -> list[AttemptRecord]:
        """All attempts of all shards, in placement order."""
        return sorted((a for s in self.shards for a in s.attempts), key=lambda a: (a.placed_at or 0, a.shard))

    @property
    def current(self) -> AttemptRecord | None:
        """The latest attempt of any shard."""
        attempts = self.attempts
        return attempts[-1] if attempts else None

    @property
    def started_at(self) -> float | None:
        """First start of any shard."""
        starts = [a.started_at for a in self.attempts if a.started_at is not None]
        return min(starts) if starts else None

    @property
    def ended_at(self) -> float | None:
        """When the last shard ended (terminal jobs only)."""
        if self.state not in TERMINAL_STATES:
            return None
        ends = [a.ended_at for a in self.attempts if a.ended_at is not None]
        return max(ends) if ends else self.submitted_at

    @property
    def unplaceable(self) -> bool:
        """Some waiting shard fits no cluster even if empty."""
        return any(s.unplaceable and s.state == JobState.QUEUED for s in self.shards)


class JobView:
    """Jobs by id, folded from events; notifies watchers on change."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        #: (principal, tenant, project, request id) -> job id: the submitters' idempotency keys
        self.by_request: dict[tuple[str, str, str, str], str] = {}
        self.open_by_tenant: dict[str, set[str]] = {}  #: tenant -> ids of its jobs not yet ended
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
            rec = JobRecord(env.job_id, sub.spec, env.occurred_at.timestamp(), sub.submitted_by, sub.request_id,
                            shards=[ShardRecord(i) for i in range(sub.spec.shards)])
            self.jobs[env.job_id] = rec
            if sub.request_id:
                self.by_request[(sub.submitted_by, sub.spec.tenant, sub.spec.project, sub.request_id)] = env.job_id
            self._notify(rec)
            return
        rec = self.jobs.get(env.job_id)
        if rec is None or rec.state in TERMINAL_STATES:
            return
        if env.type == "job.cancel_requested":
            rec.cancel_requested = True
        elif env.type == "approval.requested":
            req = env.payload_as(ApprovalRequested)
            waiting = [sh for sh in rec.shards if sh.state == JobState.QUEUED]
            if not waiting:
                return
            rec.approval_id = req.approval_id
            for sh in waiting:
                sh.state = JobState.AWAITING_APPROVAL
                sh.reason = f"awaiting approval {req.approval_id} to run in {req.proposed_region}: {req.reason}"
            rec.policy_version = env.policy_version
        elif env.type in ("approval.approved", "approval.rejected", "approval.expired"):
            out = env.payload_as(ApprovalDecided)
            held = [sh for sh in rec.shards if sh.state == JobState.AWAITING_APPROVAL]
            if not held or rec.approval_id != out.approval_id:
                return
            for sh in held:
                sh.state = JobState.QUEUED
                sh.reason = {
                    "approval.approved": f"cross-region run in {out.proposed_region} approved by {env.actor}",
                    "approval.rejected": f"cross-region run rejected by {env.actor}; waits in its home region",
                    "approval.expired": "approval timed out; back in its home region's queue",
                }[env.type]
        elif env.type == "job.cancelled":
            rec.cancelled = True
            for s in rec.shards:
                if s.state not in TERMINAL_STATES:
                    s.state = JobState.CANCELLED
        elif not self._apply_shard(rec, env):
            return
        self._notify(rec)

    def _apply_shard(self, rec: JobRecord, env: Envelope) -> bool:
        t = env.occurred_at.timestamp()
        if env.type == "job.placed":
            p = env.payload_as(JobPlaced)
            shard = self._shard(rec, p.shard)
            if shard is None or (shard.current and shard.current.attempt >= env.attempt):
                return False
            shard.attempts.append(AttemptRecord(env.attempt, p.shard, env.region, env.cluster, p.card_model, placed_at=t,
                                                cross_region=p.cross_region, explanation=p.explanation))
            shard.state, shard.reason, shard.unplaceable = JobState.PLACED, "", False
            shard.decision = Decision("placed", t, p.explanation, p.evaluations, env.policy_version, p.counterfactual,
                                      env.cluster, env.region, p.queue)
            rec.policy_version = env.policy_version
            return True
        if env.type == "job.pending":
            p = env.payload_as(JobPending)
            shard = self._shard(rec, p.shard)
            if shard is None or shard.state != JobState.QUEUED:
                return False
            shard.reason, shard.unplaceable = p.reason, not p.fits_empty
            shard.decision = Decision("pending", t, p.reason, p.evaluations, env.policy_version, p.counterfactual,
                                      queue=p.queue, fits_empty=p.fits_empty, reserved_cluster=p.reserved_cluster)
            rec.policy_version = env.policy_version
            return True
        if env.type not in ("job.started", "job.finished", "job.failed", "job.rejected", "job.stopped"):
            return False
        s = env.payload_as(JobStatus)
        shard = self._shard(rec, s.shard)
        att = shard.current if shard else None
        if att is None or att.attempt != env.attempt:
            return False
        if env.type == "job.started":
            att.started_at, att.outcome = t, "running"
            shard.state = JobState.RUNNING
        elif env.type == "job.finished":
            att.ended_at, att.outcome = t, "succeeded"
            shard.state, shard.reason = JobState.SUCCEEDED, ""
        elif env.type == "job.failed":
            att.ended_at, att.outcome, att.reason = t, "failed", s.reason
            shard.failures += 1
            if shard.failures <= rec.spec.retry_limit and not rec.cancel_requested:
                shard.state, shard.reason = JobState.QUEUED, f"attempt {env.attempt} failed on {env.cluster}; retrying"
            else:
                shard.state, shard.reason = JobState.FAILED, s.reason
        elif env.type == "job.rejected":
            att.ended_at, att.outcome, att.reason = t, "rejected", s.reason
            shard.state, shard.reason = JobState.QUEUED, f"{env.cluster} refused the placement: {s.reason}"
        else:  # stopped
            att.ended_at, att.outcome, att.reason = t, "stopped", s.reason
            if s.reason == "cancelled":
                shard.state, shard.reason = JobState.CANCELLED, "cancelled"
            else:
                resumed = f", resumes from {s.progress_s:.0f}s of work" if s.progress_s else ""
                shard.state, shard.reason = JobState.QUEUED, f"{s.reason} on {env.cluster}; requeued{resumed}"
        return True

    @staticmethod
    def _shard(rec: JobRecord, index: int) -> ShardRecord | None:
        return rec.shards[index] if 0 <= index < len(rec.shards) else None

    def _notify(self, rec: JobRecord) -> None:
        open_ids = self.open_by_tenant.setdefault(rec.spec.tenant, set())
        if rec.state in TERMINAL_STATES:
            open_ids.discard(rec.job_id)
        else:
            open_ids.add(rec.job_id)
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

    def find_request(self, principal: str, tenant: str, project: str, request_id: str) -> JobRecord | None:
        """The job ``principal``'s earlier request with ``request_id`` for ``tenant``/``project``
        created, if any (the idempotency key is all four)."""
        job_id = self.by_request.get((principal, tenant, project, request_id))
        return self.jobs.get(job_id) if job_id else None
