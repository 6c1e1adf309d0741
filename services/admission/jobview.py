"""Admission's read model of every job, folded from the event stream.

GetJob / ListJobs / WatchJob / ExplainJob read this view; it is rebuilt from ``P_EVENTS`` on
start and kept current by following it, so admission is restartable with no database of its
own. It also indexes client request ids, so a retried SubmitJob returns the job it created the
first time.

A job has one or more shards (split batch jobs have several; every other job has shard 0).
Each shard has its attempts; the job's state is derived from its shards: running if any runs,
placed if any is placed, queued if any waits, otherwise failed if any failed, cancelled if any
was cancelled, else succeeded.

Every terminal transition records its time (the ending event's business time) and its reason:
a job's ``ended_at`` is when its last shard ended, never its submit time, and a cancelled job
says who cancelled it and why.

An attempt's ``outcome`` follows the events that concern it::

    placed -> running -> succeeded | failed | preempted | cancelled | stopped (other stop reasons)
    placed -> rejected                     (the agent refused the placement)
    placed | running -> reclaimed          (``job.stop`` reclaimed: ends at the order's time)
    running -> stopping -> preempted | cancelled   (``job.stop`` sent, the agent not yet done)
    placed | running | stopping -> cancelled       (``job.cancelled`` while it was open)

A reclaim ends the attempt when the scheduler orders it (the scheduler requeues the shard at
once and never counts the attempt again); a preemption or a cancellation ends it when the agent
reports ``job.stopped``. Status events of an attempt that is no longer the shard's latest (a
reclaimed placement the agent started late) update only that attempt's record.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fedsched.bus import Delivery
from fedsched.events import (ApprovalDecided, ApprovalRequested, Envelope, JobCancelRequested, JobPending, JobPlaced,
                             JobStatus, JobStop, JobSubmitted)
from fedsched.jobs import TERMINAL_STATES, JobSpec, JobState


@dataclass
class AttemptRecord:
    """One placement attempt (times in business seconds since the Unix epoch).

    Attributes:
        outcome: ``placed``, ``running``, ``stopping`` (a stop order is out, the agent has not
            confirmed), or how it ended: ``succeeded``, ``failed``, ``rejected``, ``reclaimed``,
            ``preempted``, ``cancelled``, ``stopped`` (module docstring).
        ended_at: when it ended (None while open).
        reason: why it ended, or why it is being stopped.
    """

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
    ended_at: float | None = None  #: business time of its terminal transition (None while open)

    @property
    def current(self) -> AttemptRecord | None:
        """The latest attempt."""
        return self.attempts[-1] if self.attempts else None

    def attempt(self, number: int) -> AttemptRecord | None:
        """The attempt numbered ``number`` (None if never placed); attempts are few per shard."""
        for a in reversed(self.attempts):
            if a.attempt == number:
                return a
        return None

    def end(self, state: JobState, at: float, reason: str) -> None:
        """Terminal transition: ``state`` at business time ``at`` because of ``reason``."""
        self.state, self.ended_at, self.reason = state, at, reason


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
    cancel_reason: str = ""  #: "cancelled by <principal>[: <their reason>]"
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
        state = self.state
        if self.cancel_requested and state not in TERMINAL_STATES:
            return "cancel requested"
        if state == JobState.CANCELLED and self.cancel_reason:
            return self.cancel_reason
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
        """When the last shard ended: the time of the event that ended it (terminal jobs only)."""
        if self.state not in TERMINAL_STATES:
            return None
        ends = [s.ended_at for s in self.shards if s.ended_at is not None]
        return max(ends) if ends else None

    @property
    def unplaceable(self) -> bool:
        """Some waiting shard fits no cluster even if empty."""
        return any(s.unplaceable and s.state == JobState.QUEUED for s in self.shards)


#: ``job.stopped`` reasons that name the attempt's outcome (the scheduler's stop order reasons)
STOP_OUTCOMES = frozenset({"preempted", "reclaimed", "cancelled"})


class JobView:
    """Jobs by id, folded from events; notifies watchers on change."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.by_request: dict[tuple[str, str], str] = {}
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
                self.by_request[(sub.spec.tenant, sub.request_id)] = env.job_id
            self._notify(rec)
            return
        rec = self.jobs.get(env.job_id)
        if rec is None or rec.state in TERMINAL_STATES:
            return
        if env.type == "job.cancel_requested":
            if rec.cancel_requested:
                return
            why = env.payload_as(JobCancelRequested).reason
            rec.cancel_requested = True
            rec.cancel_reason = f"cancelled by {env.actor or 'unknown'}" + (f": {why}" if why else "")
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
            t = env.occurred_at.timestamp()
            why = rec.cancel_reason or "cancelled"
            rec.cancelled = True
            for sh in rec.shards:
                if sh.state in TERMINAL_STATES:
                    continue
                att = sh.current
                if att is not None and att.ended_at is None:  # open when the job ended: ends with it
                    att.ended_at, att.outcome, att.reason = t, "cancelled", why
                sh.end(JobState.CANCELLED, t, why)
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
        if env.type == "job.stop":
            return self._apply_stop_order(rec, env, t)
        if env.type not in ("job.started", "job.finished", "job.failed", "job.rejected", "job.stopped"):
            return False
        s = env.payload_as(JobStatus)
        shard = self._shard(rec, s.shard)
        att = shard.attempt(env.attempt) if shard else None
        if att is None:
            return False
        if att.ended_at is not None and att.outcome == "reclaimed":
            # taken back before the agent's word arrived: the agent may have run it for a while
            if env.type == "job.started":
                if att.started_at is not None:
                    return False
                att.started_at = t
                return True
            if att.started_at is None or att.ended_at == t:
                return False
            att.ended_at = t  # it ran until the agent stopped it
            return True
        if att.ended_at is not None:
            return False  # redelivery
        current = att is shard.current
        if env.type == "job.started":
            if att.started_at is not None:
                return False
            att.started_at = t
            if att.outcome == "placed":
                att.outcome = "running"
            if current and shard.state == JobState.PLACED:
                shard.state = JobState.RUNNING
            return True
        att.ended_at = t
        if env.type == "job.finished":
            att.outcome = "succeeded"
            if current:
                shard.end(JobState.SUCCEEDED, t, "")
        elif env.type == "job.failed":
            att.outcome, att.reason = "failed", s.reason
            if current:
                shard.failures += 1
                if shard.failures <= rec.spec.retry_limit and not rec.cancel_requested:
                    shard.state = JobState.QUEUED
                    shard.reason = f"attempt {env.attempt} failed on {env.cluster}; retrying"
                else:
                    shard.end(JobState.FAILED, t, s.reason)
        elif env.type == "job.rejected":
            att.outcome, att.reason = "rejected", s.reason
            if current:
                shard.state, shard.reason = JobState.QUEUED, f"{env.cluster} refused the placement: {s.reason}"
        else:  # stopped
            if s.reason == "cancelled" or rec.cancel_requested:  # the scheduler ends the shard
                why = rec.cancel_reason or "cancelled"
                att.outcome, att.reason = "cancelled", why
                if current:
                    shard.end(JobState.CANCELLED, t, why)
            else:
                ordered = att.reason if att.outcome == "stopping" else ""  # e.g. "preempted for j-..."
                att.outcome = s.reason if s.reason in STOP_OUTCOMES else "stopped"
                att.reason = ordered or s.reason or "stopped"
                if current:
                    resumed = f", resumes from {s.progress_s:.0f}s of work" if s.progress_s else ""
                    shard.state, shard.reason = JobState.QUEUED, f"{s.reason} on {env.cluster}; requeued{resumed}"
        return True

    def _apply_stop_order(self, rec: JobRecord, env: Envelope, t: float) -> bool:
        """A scheduler's ``job.stop``: a reclaim ends the attempt now; a preemption or a
        cancellation marks it ``stopping`` until the agent reports ``job.stopped``."""
        stop = env.payload_as(JobStop)
        shard = self._shard(rec, stop.shard)
        att = shard.attempt(env.attempt) if shard else None
        if att is None or att.ended_at is not None or att.outcome == "stopping":
            return False
        if stop.reason == "reclaimed":
            why = stop.detail or "not started in time"
            att.ended_at, att.outcome, att.reason = t, "reclaimed", why
            if att is shard.current and shard.state in (JobState.PLACED, JobState.RUNNING):
                shard.state = JobState.QUEUED
                shard.reason = f"attempt {att.attempt} reclaimed from {att.cluster} ({why}); requeued"
            return True
        att.outcome = "stopping"
        att.reason = f"preempted for {stop.for_job}" if stop.reason == "preempted" and stop.for_job else stop.reason
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

    def find_request(self, tenant: str, request_id: str) -> JobRecord | None:
        """The job a tenant's earlier request with ``request_id`` created, if any."""
        job_id = self.by_request.get((tenant, request_id))
        return self.jobs.get(job_id) if job_id else None
