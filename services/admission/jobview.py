"""Admission's read model of every job, folded from the event stream.

GetJob / ListJobs / WatchJob / ExplainJob read this view; it is rebuilt from ``P_EVENTS`` on
start and kept current by following it, so admission is restartable with no database of its
own. It also indexes client request ids, so a retried SubmitJob returns the job it created the
first time.

A job has one or more shards (split batch jobs have several; every other job has shard 0).
Each shard has its attempts; the job's state is derived from its shards: running if any runs,
placed if any is placed, queued if any waits, otherwise failed if any failed, cancelled if any
was cancelled, else succeeded.

A queued job can be held (``job.held``): its state is ``held`` and the scheduler does not
consider it until ``job.released``; only a job whose every open shard is queued can be held (not
one awaiting approval: an approver decides it first), and a placement that reached the stream
before the hold clears it (the scheduler ignored the hold too). ``job.priority_changed`` changes
the spec's priority class of a job still queued or held.

Every terminal transition records its time (the ending event's business time) and its reason:
a job's ``ended_at`` is when its last shard ended, never its submit time, and a cancelled job
says who cancelled it and why.

An attempt's ``outcome`` follows the events that concern it::

    placed -> running -> succeeded | failed | preempted | cancelled | stopped (other stop reasons)
    placed -> rejected                     (the agent refused the placement)
    placed | running -> reclaimed          (``job.stop`` reclaimed: ends at the order's time)
    running -> stopping -> preempted | cancelled   (``job.stop`` sent, the agent not yet done)
    placed | running | stopping -> cancelled       (``job.cancelled`` while it was open)
    placed | running -> lost               (its cluster went silent: ``job.stopped`` cluster_lost)

A reclaim ends the attempt when the scheduler orders it (the scheduler requeues the shard at
once and never counts the attempt again); a preemption or a cancellation ends it when the agent
reports ``job.stopped``. Status events of an attempt that is no longer the shard's latest (a
reclaimed placement the agent started late) update only that attempt's record.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedsched.bounded import RecentDict
from fedsched.bus import Delivery
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.events import (ApprovalDecided, ApprovalRequested, Envelope, EventType, JobCancelRequested, JobHeld,
                             JobPending, JobPriorityChanged, JobStatus, JobStop, JobSubmitted)
from fedsched.jobs import TERMINAL_STATES, AttemptState, JobSpec, JobState, StopReason
from fedsched.lease import Tenure, stale_order, unissued
from fedsched.trust import ATTEMPT_STATUSES, PlacedAttempt, Rejection, check_placement, check_subject

log = logging.getLogger(__name__)

class PlacedFields(BaseModel):
    """What the job view reads of a ``job.placed`` payload (:class:`~fedsched.events.JobPlaced`):
    these fields, validated as ``JobPlaced`` types them; the spec and the worker bindings (the
    bulk of the payload, and what an agent needs) must be present but are not decoded here --
    the view keeps the spec of the job's ``job.submitted``. Issue 15: the full ``JobPlaced``
    parse was the largest part of admission's cost per placement. Their shapes are still checked
    (cheaply, without copying): ``spec`` an object, ``bindings`` a non-empty list of objects --
    a payload every other reader refuses must not mark the job placed here (stop-12 review)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    spec: Any
    bindings: Any
    card_model: str = ""
    explanation: str = ""
    cross_region: bool = False
    shard: int = 0
    evaluations: tuple[Any, ...] = ()  #: each a dict (checked, not copied: see _dicts)
    queue: str = ""
    counterfactual: str = ""
    fencing_token: int = Field(default=0, ge=0)

    @field_validator("evaluations")
    @classmethod
    def _dicts(cls, v: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every evaluation is an object (as ``JobPlaced`` types them), checked without
        rebuilding each dict (one per cluster considered: the bulk of a placement's fields)."""
        if not all(isinstance(e, dict) for e in v):
            raise ValueError("every evaluation must be an object")
        return v

    @field_validator("spec")
    @classmethod
    def _spec_object(cls, v: Any) -> Any:
        """The spec is an object (``JobPlaced.spec`` is a ``JobSpec``); its fields are not read here."""
        if not isinstance(v, dict):
            raise ValueError("spec must be an object")
        return v

    @field_validator("bindings")
    @classmethod
    def _binding_objects(cls, v: Any) -> Any:
        """The worker bindings are a non-empty list of objects (one ``WorkerBinding`` per worker)."""
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(b, dict) for b in v):
            raise ValueError("bindings must be a non-empty list of objects")
        return v


#: The active scheduler's orders (fenced by its lease's token) and the payloads the view reads.
_ORDERS = {EventType.JOB_PLACED: PlacedFields, EventType.JOB_STOP: JobStop}


@dataclass
class AttemptRecord:
    """One placement attempt (times in business seconds since the Unix epoch).

    Attributes:
        outcome: an :class:`~fedsched.jobs.AttemptState`: ``placed``, ``running``, ``stopping``
            (a stop order is out, the agent has not confirmed), or how it ended: ``succeeded``,
            ``failed``, ``rejected``, ``reclaimed``, ``preempted``, ``cancelled``, ``lost``,
            ``stopped`` (module docstring).
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
    outcome: AttemptState = AttemptState.PLACED
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
    approval_id: str = ""  #: outcome "awaiting_approval": the request opened for the proposal
    approval_expires_at: float | None = None  #: its deadline (business s)


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


#: a one-shard job's state is its shard's when it is one of these, else succeeded (JobRecord.state)
_ONE_SHARD_STATES = frozenset({JobState.RUNNING, JobState.PLACED, JobState.AWAITING_APPROVAL, JobState.QUEUED,
                               JobState.FAILED, JobState.CANCELLED})


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
    held: bool = False  #: held (``job.held``) and not released or placed since
    hold_reason: str = ""  #: "held by <principal>[: <their reason>]"
    holds: int = 0  #: holds applied so far (the n-th hold and its release have their own event ids)
    priority_changes: int = 0  #: ``job.priority_changed`` applied so far (event ids)
    counted_state: JobState | None = field(default=None, repr=False, compare=False)  # in JobView.by_state
    listed: "ListingKey | None" = field(default=None, repr=False, compare=False)  # as JobView last logged it

    @property
    def state(self) -> JobState:
        """The job's state, derived from its shards (module docstring)."""
        if self.cancelled:
            return JobState.CANCELLED
        if len(self.shards) == 1:  # most jobs: the rules below for one shard, without building lists
            state = self.shards[0].state
            if state == JobState.QUEUED and self.held and not self.cancel_requested:
                return JobState.HELD
            return state if state in _ONE_SHARD_STATES else JobState.SUCCEEDED
        states = [s.state for s in self.shards]
        if self.held and not self.cancel_requested and all(s == JobState.QUEUED or s in TERMINAL_STATES
                                                           for s in states) and JobState.QUEUED in states:
            return JobState.HELD
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
        if state == JobState.HELD:
            return self.hold_reason
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
        if len(self.shards) == 1 and len(self.shards[0].attempts) <= 1:  # most jobs: nothing to sort
            return self.shards[0].current
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


class ListingKey(NamedTuple):
    """What of a job ListJobs' changeable filters look at: its state and where its latest
    attempt runs or ran (None: never placed). Tenant, project, kind, name and submit time are
    fixed at submit."""

    state: JobState
    region: str | None
    cluster: str | None


def listing_key(rec: "JobRecord") -> ListingKey:
    """``rec``'s :class:`ListingKey` now."""
    att = rec.current
    return ListingKey(rec.state, att.region if att else None, att.cluster if att else None)


@dataclass(frozen=True, slots=True)
class ListingChange:
    """One change of a job as ListJobs' filters see it (:attr:`JobView.listing_changes`).

    Attributes:
        seq: the view's listing sequence number of this change (1, 2, ...).
        before / after: the job's key before and after; ``before`` None = it entered the view
            (submitted), ``after`` None = it left (evicted).
    """

    seq: int
    job_id: str
    spec: JobSpec
    submitted_at: float
    before: ListingKey | None
    after: ListingKey | None


#: ``job.stopped`` reasons (the scheduler's stop order reasons) -> the attempt's outcome
STOP_OUTCOMES: dict[str, AttemptState] = {
    StopReason.PREEMPTED: AttemptState.PREEMPTED, StopReason.RECLAIMED: AttemptState.RECLAIMED,
    StopReason.CANCELLED: AttemptState.CANCELLED, StopReason.CLUSTER_LOST: AttemptState.LOST,
}


class JobView:
    """Jobs by id, folded from events; notifies watchers on change.

    Args:
        retain_ended: ended jobs kept in memory (the newest to end); older ones leave the view
            (:attr:`jobs`, the listing and request indexes) and are handed to ``archive``.
        archive: called with each record that leaves (the service writes it to the ended-jobs
            KV bucket, :mod:`services.admission.ended`, where GetJob / WatchJob find it).
        retain_tombstones: ids of jobs that left remembered with their newest attempt, so a
            late status of one is ignored rather than refused as a forgery; a redelivered
            submit does not bring one back.
        retain_listing_changes: the newest changes kept in :attr:`listing_changes` (ListJobs
            refreshes a later page's total from them; a page whose token is older than all
            of them counts its range again).

    Memory is bounded by the open jobs plus these retentions, not by the jobs ever seen
    (issue 15 item 2; ``tests/unit/admission/test_memory.py``).
    """

    def __init__(self, *, retain_ended: int = 10_000, archive: Callable[[JobRecord], None] | None = None,
                 retain_tombstones: int = 200_000, retain_listing_changes: int = 100_000) -> None:
        self.jobs: dict[str, JobRecord] = {}
        #: this view's identity: a page token's listing sequence means something only here (each
        #: admission replica folds the stream into its own view)
        self.view_id = uuid.uuid4().hex[:12]
        #: listing sequence: increases by one per change of a job's :class:`ListingKey`, entry
        #: into or exit from the view
        self.listing_seq = 0
        #: the newest :class:`ListingChange` s, oldest first
        self.listing_changes: deque[ListingChange] = deque(maxlen=max(1, retain_listing_changes))
        #: region / cluster -> jobs in the view whose latest attempt is there (kept as jobs
        #: change: ListJobs accepts these names as filters even when the cluster is gone)
        self.attempt_regions: Counter[str] = Counter()
        self.attempt_clusters: Counter[str] = Counter()
        self.retain_ended = max(1, retain_ended)
        self.archive = archive
        #: ended jobs still in :attr:`jobs`, oldest end first
        self.ended: OrderedDict[str, None] = OrderedDict()
        #: ended jobs that left memory: job id -> newest attempt over their shards
        self.tombstones: RecentDict[str, int] = RecentDict(max(1, retain_tombstones))
        #: (principal, tenant, project, request id) -> job id: the submitters' idempotency keys
        self.by_request: dict[tuple[str, str, str, str], str] = {}
        self.open_by_tenant: dict[str, set[str]] = {}  #: tenant -> ids of its jobs not yet ended
        #: every job as (submitted_at, job_id), kept sorted as jobs arrive (an insertion per
        #: submit), so ListJobs bisects to its cursor instead of sorting every job on each page
        self.by_submitted: list[tuple[float, str]] = []
        #: jobs per state, kept as jobs change (every state has a key: the metrics' scrape thread
        #: copies it while the loop updates values)
        self.by_state: dict[JobState, int] = dict.fromkeys(JobState, 0)
        #: called with the record after every change of a job (e.g. budget running totals)
        self.listeners: list[Callable[[JobRecord], None]] = []
        self._changed: dict[str, asyncio.Event] = {}
        self.applied_seq = 0
        self.skipped = SkippedTypes("admission-jobs")  #: events of unknown types (newer producers) skipped
        #: messages refused by the trust checks, for the service to dead-letter and record (drained by it)
        self.rejections: list[Rejection] = []
        #: scheduler-lease fencing (fedsched.lease): the highest token seen on placements and
        #: stop orders; an order with a lower one (a former active scheduler's) is not folded
        self.highest_token = 0
        self.stale_orders = 0
        #: the scheduler lease's current tenure, kept fresh by the service (None: not read); an
        #: order below it and stored after it began is not folded either (fedsched.lease.stale_order)
        self.tenure: Tenure | None = None
        #: tenant -> stream sequence of the newest ``job.submitted`` of that tenant folded here
        #: (the compare-and-set point of budgeted submissions across admission replicas)
        self.last_submitted: dict[str, int] = {}

    @staticmethod
    def order_token(env: Envelope) -> int | None:
        """The scheduler-lease fencing token of ``env`` when it is an order (placement or stop),
        else None."""
        kind = _ORDERS.get(env.known_type)
        return None if kind is None else env.payload_as(kind).fencing_token

    def apply_delivery(self, d: Delivery, *, subject_checked: bool = False) -> None:
        """Fold one delivered event (follower callback).

        A message whose envelope contradicts its subject or the job's placements
        (:mod:`fedsched.trust`) changes nothing and is added to :attr:`rejections`; an order
        with a stale fencing token (below the highest seen, or below :attr:`tenure` and stored
        after it began) changes nothing and is counted in :attr:`stale_orders`.
        ``subject_checked``: the caller already found that the envelope may arrive on its
        subject (:func:`~fedsched.trust.check_subject` gave None), so it is not checked twice.
        """
        self.applied_seq = max(self.applied_seq, d.stream_sequence)
        env = d.envelope
        reason = (check_subject(d.subject.split(".", 1)[0], d.subject, env) if d.subject and not subject_checked
                  else None)
        if reason is None and env.known_type in ATTEMPT_STATUSES - {EventType.AGENT_RECONCILED}:
            reason = self.check_status(env)
        if reason is not None:
            log.warning("admission-jobs: refused %s on %s: %s", env.type, d.subject, reason)
            self.rejections.append(Rejection("admission-jobs", d.subject, env, reason, d.stream_sequence,
                                             headers=tuple(sorted(d.headers.items()))))
            return
        if self.tenure is not None and env.known_type in _ORDERS:
            token = env.payload_as(_ORDERS[env.known_type]).fencing_token
            # a token above the lease's (read after the order arrived: the service re-reads it for
            # such a token) was issued by no tenure: refused, and never the highest seen (_fence)
            stale = unissued(token, self.tenure) or stale_order(token, d.published_at, 0, self.tenure)
            if stale is not None:
                self.stale_orders += 1
                log.warning("admission-jobs: not folding %s of %s: %s", env.type, env.job_id, stale)
                return
        self.apply(env)
        if env.type == EventType.JOB_SUBMITTED and env.tenant:
            self.note_submitted(env.tenant, d.stream_sequence)

    def check_status(self, env: Envelope) -> str | None:
        """Why the status ``env`` contradicts this view's placements (None: it agrees); see
        :func:`fedsched.trust.check_placement`."""
        rec = self.jobs.get(env.job_id)
        if rec is None:
            newest = self.tombstones.get(env.job_id)
            if newest is not None:  # ended and left memory: a late status, unless never placed
                return check_placement(env, True, None, newest) if env.attempt > newest else None
            return check_placement(env, False, None, 0)
        index = env.payload_as(JobStatus).shard
        shard = self._shard(rec, index)
        if shard is None:
            return f"job {env.job_id} has no shard {index}"
        att = shard.attempt(env.attempt)
        placed = PlacedAttempt(att.attempt, att.region, att.cluster) if att is not None else None
        return check_placement(env, True, placed, shard.current.attempt if shard.current else 0)

    def note_submitted(self, tenant: str, sequence: int) -> None:
        """A ``job.submitted`` of ``tenant`` stored at stream ``sequence`` is folded."""
        if sequence > self.last_submitted.get(tenant, 0):
            self.last_submitted[tenant] = sequence

    def apply(self, env: Envelope) -> None:
        """Fold one event; idempotent (re-applying an event changes nothing). Events of a type
        this build does not know are skipped and counted in :attr:`skipped`."""
        fold = JOB_VIEW_EVENTS.route(env.type, self.skipped)
        if fold is not None:
            fold(self, env)

    def apply_own_submission(self, env: Envelope, sub: JobSubmitted) -> None:
        """Fold this admission's own ``job.submitted`` ``env`` (just acknowledged by the
        stream), whose payload is ``sub``, the model it was built from: the same as
        :meth:`apply`, without parsing back the payload (the spec validated once, at submit).
        The follower's later copy of the event changes nothing (folds are idempotent).

        Raises:
            ValueError: ``env`` is not a ``job.submitted`` (a programming error).
        """
        if env.type != EventType.JOB_SUBMITTED:
            raise ValueError(f"not a job.submitted: {env.type}")
        self._on_submitted(env, sub)

    def _on_submitted(self, env: Envelope, sub: JobSubmitted | None = None) -> None:
        if env.job_id in self.jobs or env.job_id in self.tombstones:
            return
        if sub is None:
            sub = env.payload_as(JobSubmitted)
        rec = JobRecord(env.job_id, sub.spec, env.occurred_at.timestamp(), sub.submitted_by, sub.request_id,
                        shards=[ShardRecord(i) for i in range(sub.spec.shards)])
        self.jobs[env.job_id] = rec
        bisect.insort(self.by_submitted, (rec.submitted_at, rec.job_id))
        if sub.request_id:
            self.by_request[(sub.submitted_by, sub.spec.tenant, sub.spec.project, sub.request_id)] = env.job_id
        self._notify(rec)

    # The folds below take a job not yet ended (see _open_job) and return whether it changed.

    def _on_cancel_requested(self, rec: JobRecord, env: Envelope) -> bool:
        if rec.cancel_requested:
            return False
        why = env.payload_as(JobCancelRequested).reason
        rec.cancel_requested = True
        rec.cancel_reason = f"cancelled by {env.actor or 'unknown'}" + (f": {why}" if why else "")
        return True

    def _on_held(self, rec: JobRecord, env: Envelope) -> bool:
        if rec.held or rec.cancel_requested or rec.state != JobState.QUEUED:
            return False  # placed (or awaiting approval) before the hold reached the stream: no effect
        why = env.payload_as(JobHeld).reason
        rec.held, rec.holds = True, rec.holds + 1
        rec.hold_reason = f"held by {env.actor or 'unknown'}" + (f": {why}" if why else "")
        return True

    def _on_released(self, rec: JobRecord, env: Envelope) -> bool:
        if not rec.held:
            return False
        rec.held, rec.hold_reason = False, ""
        return True

    def _on_priority_changed(self, rec: JobRecord, env: Envelope) -> bool:
        change = env.payload_as(JobPriorityChanged)
        if rec.state not in (JobState.QUEUED, JobState.HELD) or rec.spec.priority == change.priority:
            return False
        rec.spec = rec.spec.model_copy(update={"priority": change.priority})
        rec.priority_changes += 1
        return True

    def _on_approval_requested(self, rec: JobRecord, env: Envelope) -> bool:
        req = env.payload_as(ApprovalRequested)
        waiting = [sh for sh in rec.shards if sh.state == JobState.QUEUED]
        if not waiting:
            return False
        rec.approval_id = req.approval_id
        for sh in waiting:
            sh.state = JobState.AWAITING_APPROVAL
            sh.reason = f"awaiting approval {req.approval_id} to run in {req.proposed_region}: {req.reason}"
            sh.decision = Decision("awaiting_approval", env.occurred_at.timestamp(), req.reason, req.evaluations,
                                   env.policy_version, cluster=req.proposed_cluster, region=req.proposed_region,
                                   queue=req.queue, approval_id=req.approval_id,
                                   approval_expires_at=req.expires_at.timestamp())
        rec.policy_version = env.policy_version
        return True

    def _on_approval_outcome(self, rec: JobRecord, env: Envelope) -> bool:
        out = env.payload_as(ApprovalDecided)
        held = [sh for sh in rec.shards if sh.state == JobState.AWAITING_APPROVAL]
        if not held or rec.approval_id != out.approval_id:
            return False
        for sh in held:
            sh.state = JobState.QUEUED
            sh.reason = {
                EventType.APPROVAL_APPROVED: f"cross-region run in {out.proposed_region} approved by {env.actor}",
                EventType.APPROVAL_REJECTED: f"cross-region run rejected by {env.actor}; waits in its home region",
                EventType.APPROVAL_EXPIRED: "approval timed out; back in its home region's queue",
            }[env.type]
            if sh.decision is not None and sh.decision.outcome == "awaiting_approval":  # the proposal, answered
                sh.decision = replace(sh.decision, outcome="approval_" + str(env.type).rsplit(".", 1)[-1],
                                      reason=f"{sh.reason} (proposed: {sh.decision.reason})")
        return True

    def _on_cancelled(self, rec: JobRecord, env: Envelope) -> bool:
        """The scheduler's ``job.cancelled``: the job ends now; its reason is the cancel's (who and
        why) or the scheduler's own (e.g. ``unschedulable_timeout: ...``)."""
        t = env.occurred_at.timestamp()
        own = env.payload_as(JobStatus).reason
        why = rec.cancel_reason or (own if own and own != "cancelled" else "cancelled")
        if not rec.cancel_reason and why != "cancelled":
            rec.cancel_reason = why
        rec.cancelled = True
        for sh in rec.shards:
            if sh.state in TERMINAL_STATES:
                continue
            att = sh.current
            if att is not None and att.ended_at is None:  # open when the job ended: ends with it
                att.ended_at, att.outcome, att.reason = t, AttemptState.CANCELLED, why
            sh.end(JobState.CANCELLED, t, why)
        return True

    def _on_placed(self, rec: JobRecord, env: Envelope) -> bool:
        t = env.occurred_at.timestamp()
        p = env.payload_as(PlacedFields)
        if not self._fence(p.fencing_token):
            return False
        shard = self._shard(rec, p.shard)
        if shard is None or (shard.current and shard.current.attempt >= env.attempt):
            return False
        shard.attempts.append(AttemptRecord(env.attempt, p.shard, env.region, env.cluster, p.card_model, placed_at=t,
                                            cross_region=p.cross_region, explanation=p.explanation))
        shard.state, shard.reason, shard.unplaceable = JobState.PLACED, "", False
        rec.held, rec.hold_reason = False, ""  # placed before a hold took effect
        shard.decision = Decision("placed", t, p.explanation, p.evaluations, env.policy_version, p.counterfactual,
                                  env.cluster, env.region, p.queue)
        rec.policy_version = env.policy_version
        return True

    def _on_pending(self, rec: JobRecord, env: Envelope) -> bool:
        t = env.occurred_at.timestamp()
        p = env.payload_as(JobPending)
        shard = self._shard(rec, p.shard)
        if shard is None or shard.state != JobState.QUEUED:
            return False
        shard.reason, shard.unplaceable = p.reason, not p.fits_empty
        shard.decision = Decision("pending", t, p.reason, p.evaluations, env.policy_version, p.counterfactual,
                                  queue=p.queue, fits_empty=p.fits_empty, reserved_cluster=p.reserved_cluster)
        rec.policy_version = env.policy_version
        return True

    def _fence(self, token: int) -> bool:
        """Scheduler-lease fencing in stream order: False for a token below the highest seen."""
        if token < self.highest_token:
            self.stale_orders += 1
            return False
        self.highest_token = token
        return True

    def _on_stop_order(self, rec: JobRecord, env: Envelope) -> bool:
        """A scheduler's ``job.stop``: a reclaim ends the attempt now; a preemption, a
        cancellation or a lost cluster marks it ``stopping`` until ``job.stopped`` arrives (the
        agent's, or for a lost cluster the scheduler's own)."""
        t = env.occurred_at.timestamp()
        stop = env.payload_as(JobStop)
        if not self._fence(stop.fencing_token):
            return False
        shard = self._shard(rec, stop.shard)
        att = shard.attempt(env.attempt) if shard else None
        if att is None or att.ended_at is not None or att.outcome == AttemptState.STOPPING:
            return False
        if stop.reason == StopReason.RECLAIMED:
            why = stop.detail or "not started in time"
            att.ended_at, att.outcome, att.reason = t, AttemptState.RECLAIMED, why
            if att is shard.current and shard.state in (JobState.PLACED, JobState.RUNNING):
                shard.state = JobState.QUEUED
                shard.reason = f"attempt {att.attempt} reclaimed from {att.cluster} ({why}); requeued"
            return True
        att.outcome = AttemptState.STOPPING
        if stop.reason == StopReason.PREEMPTED and stop.for_job:
            att.reason = f"preempted for {stop.for_job}"
        else:
            att.reason = stop.reason + (f" ({stop.detail})" if stop.detail else "")
        return True

    # Status folds: the status of one attempt (see _attempt_status), at business time t;
    # ``current`` says whether it is the shard's latest attempt (only that one moves the shard).

    @staticmethod
    def _on_started(rec: JobRecord, env: Envelope, s: JobStatus, shard: ShardRecord, att: AttemptRecord,
                    t: float, current: bool) -> bool:
        if att.started_at is not None:
            return False
        att.started_at = t
        if att.outcome == AttemptState.PLACED:
            att.outcome = AttemptState.RUNNING
        if current and shard.state == JobState.PLACED:
            shard.state = JobState.RUNNING
        return True

    @staticmethod
    def _on_finished(rec: JobRecord, env: Envelope, s: JobStatus, shard: ShardRecord, att: AttemptRecord,
                     t: float, current: bool) -> bool:
        att.ended_at, att.outcome = t, AttemptState.SUCCEEDED
        if current:
            shard.end(JobState.SUCCEEDED, t, "")
        return True

    @staticmethod
    def _on_failed(rec: JobRecord, env: Envelope, s: JobStatus, shard: ShardRecord, att: AttemptRecord,
                   t: float, current: bool) -> bool:
        att.ended_at, att.outcome, att.reason = t, AttemptState.FAILED, s.reason
        if current:
            shard.failures += 1
            if shard.failures <= rec.spec.retry_limit and not rec.cancel_requested:
                shard.state = JobState.QUEUED
                shard.reason = f"attempt {env.attempt} failed on {env.cluster}; retrying"
            else:
                shard.end(JobState.FAILED, t, s.reason)
        return True

    @staticmethod
    def _on_rejected(rec: JobRecord, env: Envelope, s: JobStatus, shard: ShardRecord, att: AttemptRecord,
                     t: float, current: bool) -> bool:
        att.ended_at, att.outcome, att.reason = t, AttemptState.REJECTED, s.reason
        if current:
            shard.state, shard.reason = JobState.QUEUED, f"{env.cluster} refused the placement: {s.reason}"
        return True

    @staticmethod
    def _on_stopped(rec: JobRecord, env: Envelope, s: JobStatus, shard: ShardRecord, att: AttemptRecord,
                    t: float, current: bool) -> bool:
        att.ended_at = t
        if s.reason == StopReason.CANCELLED or rec.cancel_requested:  # the scheduler ends the shard
            why = rec.cancel_reason or "cancelled"
            att.outcome, att.reason = AttemptState.CANCELLED, why
            if current:
                shard.end(JobState.CANCELLED, t, why)
            return True
        ordered = att.reason if att.outcome == AttemptState.STOPPING else ""  # e.g. "preempted for j-..."
        att.outcome = STOP_OUTCOMES.get(s.reason, AttemptState.STOPPED)
        att.reason = ordered or s.reason or "stopped"
        if current:
            resumed = f", resumes from {s.progress_s:.0f}s of work" if s.progress_s else ""
            shard.state, shard.reason = JobState.QUEUED, f"{s.reason} on {env.cluster}; requeued{resumed}"
        return True

    @staticmethod
    def _shard(rec: JobRecord, index: int) -> ShardRecord | None:
        return rec.shards[index] if 0 <= index < len(rec.shards) else None

    def adopt_listing(self, rec: JobRecord) -> None:
        """Count ``rec`` (restored from a checkpoint into :attr:`jobs`) in the attempt region and
        cluster counts, without logging a change (no page token of this view predates it)."""
        self._relist(rec, listing_key(rec), log_it=False)

    def _relist(self, rec: JobRecord, after: ListingKey | None, *, log_it: bool = True) -> None:
        """Log ``rec``'s listing change to ``after`` (None: it leaves) and move its counts."""
        before = rec.listed
        if before == after:
            return
        if log_it:
            self.listing_seq += 1
            self.listing_changes.append(ListingChange(self.listing_seq, rec.job_id, rec.spec, rec.submitted_at,
                                                      before, after))
        for key, step in ((before, -1), (after, 1)):
            if key is None:
                continue
            for counts, name in ((self.attempt_regions, key.region), (self.attempt_clusters, key.cluster)):
                if name is not None:
                    counts[name] += step
                    if counts[name] <= 0:
                        del counts[name]
        rec.listed = after

    def changes_since(self, seq: int) -> Iterator[ListingChange] | None:
        """The listing changes after sequence number ``seq``, oldest first, or None when the log
        no longer reaches back that far (or ``seq`` is not one of this view's). Costs the
        changes returned, not the log's length."""
        if seq > self.listing_seq or seq < 0:
            return None
        if seq == self.listing_seq:
            return iter(())
        log_ = self.listing_changes
        if not log_ or log_[0].seq > seq + 1:
            return None
        newer: list[ListingChange] = []
        for ch in reversed(log_):  # newest first: stops at the first change the caller has
            if ch.seq <= seq:
                break
            newer.append(ch)
        return reversed(newer)

    def _notify(self, rec: JobRecord) -> None:
        state = rec.state
        self._relist(rec, listing_key(rec))
        if rec.counted_state != state:  # jobs by state: move the job from the state it was counted in
            if rec.counted_state is not None:
                self.by_state[rec.counted_state] -= 1
            self.by_state[state] = self.by_state.get(state, 0) + 1
            rec.counted_state = state
        open_ids = self.open_by_tenant.setdefault(rec.spec.tenant, set())
        if state in TERMINAL_STATES:
            open_ids.discard(rec.job_id)
        else:
            open_ids.add(rec.job_id)
        rec.version += 1
        for listener in self.listeners:
            listener(rec)
        event = self._changed.pop(rec.job_id, None)
        if event is not None:
            event.set()
        if state in TERMINAL_STATES and rec.job_id not in self.ended:
            self.ended[rec.job_id] = None
            while len(self.ended) > self.retain_ended:
                self._evict(self.ended.popitem(last=False)[0])

    def _evict(self, job_id: str) -> None:
        """An ended job leaves memory: out of :attr:`jobs`, the submit-time and request indexes
        (O(log n) search plus one list deletion); handed to :attr:`archive`; a tombstone with its
        newest attempt stays. Its count in :attr:`by_state` stays (jobs ever seen per state)."""
        rec = self.jobs.pop(job_id, None)
        if rec is None:
            return
        waiting = self._changed.pop(job_id, None)  # a watcher gone (cancelled) before the job ended
        if waiting is not None:
            waiting.set()
        if self.archive is not None:
            self.archive(rec)
        self._relist(rec, None)
        key = (rec.submitted_at, rec.job_id)
        i = bisect.bisect_left(self.by_submitted, key)
        if i < len(self.by_submitted) and self.by_submitted[i] == key:
            del self.by_submitted[i]
        if rec.request_id:
            rkey = (rec.submitted_by, rec.spec.tenant, rec.spec.project, rec.request_id)
            if self.by_request.get(rkey) == job_id:
                del self.by_request[rkey]
        self.tombstones[job_id] = max((a.attempt for sh in rec.shards for a in sh.attempts), default=0)
        open_ids = self.open_by_tenant.get(rec.spec.tenant)
        if open_ids is not None and not open_ids:
            del self.open_by_tenant[rec.spec.tenant]

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


def _open_job(fold):
    """A job view handler for an event about a known job that has not ended:
    ``fold(view, rec, env) -> changed``; watchers are notified when it changed."""
    def handler(view: JobView, env: Envelope) -> None:
        rec = view.jobs.get(env.job_id)
        if rec is None or rec.state in TERMINAL_STATES:
            return
        if fold(view, rec, env):
            view._notify(rec)
    return handler


def _attempt_status(fold):
    """A fold (for :func:`_open_job`) of a status event of one attempt of a shard:
    ``fold(rec, env, status, shard, attempt, t, current) -> changed``. An attempt already ended
    changes only if it was reclaimed before the agent's word arrived (the agent may have run it
    for a while: its start and end are recorded); anything else about an ended attempt is a
    redelivery."""
    def changed(view: JobView, rec: JobRecord, env: Envelope) -> bool:
        s = env.payload_as(JobStatus)
        shard = view._shard(rec, s.shard)
        att = shard.attempt(env.attempt) if shard else None
        if att is None:
            return False
        t = env.occurred_at.timestamp()
        if att.ended_at is not None and att.outcome == AttemptState.RECLAIMED:
            if env.type == EventType.JOB_STARTED:
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
        return fold(rec, env, s, shard, att, t, att is shard.current)
    return changed


#: The job view's dispatch table (admission's ``admission-jobs`` follower; jobs, placements,
#: decisions, status, governance). Usage events go to the spend book, not here.
JOB_VIEW_EVENTS: EventTable = EventTable({
    EventType.JOB_SUBMITTED: JobView._on_submitted,
    EventType.JOB_CANCEL_REQUESTED: _open_job(JobView._on_cancel_requested),
    EventType.JOB_HELD: _open_job(JobView._on_held),
    EventType.JOB_RELEASED: _open_job(JobView._on_released),
    EventType.JOB_PRIORITY_CHANGED: _open_job(JobView._on_priority_changed),
    EventType.APPROVAL_REQUESTED: _open_job(JobView._on_approval_requested),
    EventType.APPROVAL_APPROVED: _open_job(JobView._on_approval_outcome),
    EventType.APPROVAL_REJECTED: _open_job(JobView._on_approval_outcome),
    EventType.APPROVAL_EXPIRED: _open_job(JobView._on_approval_outcome),
    EventType.JOB_CANCELLED: _open_job(JobView._on_cancelled),
    EventType.JOB_PLACED: _open_job(JobView._on_placed),
    EventType.JOB_PENDING: _open_job(JobView._on_pending),
    EventType.JOB_STOP: _open_job(JobView._on_stop_order),
    EventType.JOB_STARTED: _open_job(_attempt_status(JobView._on_started)),
    EventType.JOB_FINISHED: _open_job(_attempt_status(JobView._on_finished)),
    EventType.JOB_FAILED: _open_job(_attempt_status(JobView._on_failed)),
    EventType.JOB_REJECTED: _open_job(_attempt_status(JobView._on_rejected)),
    EventType.JOB_STOPPED: _open_job(_attempt_status(JobView._on_stopped)),
}, ignores=frozenset({
    EventType.SUBMISSION_REJECTED, EventType.POLICY_APPLIED, EventType.TENANT_UPDATED,
    EventType.QUOTA_UPDATED, EventType.PRINCIPAL_UPDATED, EventType.USAGE_RECORDED,
    EventType.AGENT_RECONCILED,  # audit and the report show it; its stops come as job.stopped
}))
