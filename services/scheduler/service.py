"""The scheduler service: keeps the global resource view and runs the pure core on it.

State is rebuilt from the bus on start (event sourcing): every event on ``P_EVENTS`` from the
first sequence (submissions, its own placements and stop orders, agents' status) and the newest
inventory of every cluster. Then it follows both streams and runs a cycle whenever something
changed (and at least once a second, for staleness, aging and reclamation):

1. judge every cluster's freshness (age of its newest heartbeat or inventory, from the time
   JetStream stored it -- so a restarted scheduler sees a silent cluster as silent), move every
   placement off a stale cluster (placed or running: ``job.stop`` with reason ``cluster_lost``,
   and for a started attempt a ``job.stopped`` on the cluster's behalf ending it at the time it
   was declared lost; retried elsewhere within the tenant's retry budget, a checkpointable job
   resuming from its last checkpoint: :meth:`SchedulerService._after_loss`), reclaim placements
   never started within ``reclaim_after_s``, and carry out
   cancellations, end jobs that have been unplaceable for ``unschedulable_timeout_s``
   (below) -- every cycle, whether or not anything is queued;
2. build the :class:`~services.scheduler.core.View` -- inventory capacity minus the allocations
   of placed and running work, that work with its estimated ends, heartbeat ages, tenant usage
   -- and the queue (one entry per waiting shard);
3. ``decide(view, queue, policy)`` -- pure;
4. publish, in one pipelined batch: stop orders for preemption victims, then placements (same
   subject per cluster, so an agent frees the victims before it admits the preemptor), then
   changed pending reasons with a counterfactual; message ids are (job, attempt, shard, step)
   so a retried publish is never a second placement;
5. update local state only for what JetStream acknowledged. One message never fails the
   batch (:meth:`fedsched.bus.Bus.publish_many`); a placement the bus refuses for good (larger
   than its ``max_payload``: dead-lettered by the bus) ends its job at once, ``job.cancelled``
   with reason ``placement_too_large: ...`` (:meth:`SchedulerService._placement_refused`), so it
   is not decided again every cycle; a refused pending reason is taken as given.

A job that can never run as asked on today's federation (the core's ``fits_empty`` is False for
every waiting shard: no cluster could hold it even empty) stays queued in case capacity joins,
but not forever: once every shard that has not ended has been unplaceable for
``unschedulable_timeout_s`` of business time (default 24 h), the job is ended like a
cancellation, ``job.cancelled`` whose reason starts with ``unschedulable_timeout``. A shard that
runs is never stopped for it (a split job ends when its running shards have). The timer is
kept in memory: after a restart it starts again.

Holds and priority: ``job.held`` takes a job whose every open shard is queued out of the queue
(its shards are ``held``: never decided, no pending reason, not counted as queued) until
``job.released`` puts them back with the job's original submit time (aging counts the time
held); a hold that arrives after a placement is ignored (admission's job view does the same in
stream order). ``job.priority_changed`` replaces the priority class of a job none of whose shards
is placed, running or stopping; the next cycle orders the queue by it. A held job can be cancelled.

Its own events come back through the follower; applying them again is a no-op (same attempt),
so the write-through state and the rebuilt state agree.

A status endpoint (core NATS request/reply on ``<p>.svc.scheduler.status``) reports the applied
stream sequence and queue sizes; the replay driver uses it to detect quiescence. A what-if
endpoint (``<p>.svc.scheduler.whatif``, :mod:`fedsched.whatif`) answers a dry-run submit: the
core's decision for one spec on the current view, committing nothing (:meth:`SchedulerService.what_if`).

Replicas (issue 14 item 9): several schedulers may run; with a :class:`~fedsched.lease.Lease`
only the replica holding it is *active* and runs cycles, the others are standbys that follow
the streams exactly as the active one does (so their state is current). A standby that
acquires the lease first reads the events stream up to its last sequence at that moment (what
the former holder published is then folded: nothing is placed twice), then stamps its orders
with the lease's fencing token (``JobPlaced.fencing_token``, ``JobStop.fencing_token``). A
replica that led and lost the lease only because a renewal came too late, and begins its next
tenure over its own unchanged record (:attr:`fedsched.lease.Lease.resumed`: nobody else wrote the
lease between), leads on at once with the new token -- no other holder gave orders. Every
publish goes through a fence that refuses it once the lease is no longer held (a renewal that
failed, a newer token seen on the bus), so a replica that lost its lease stops publishing
immediately. Read back from the stream, an order with a token lower than the highest seen is
ignored (a former holder's late order), and one with a higher token than ours means another
replica holds the lease: we step down. Only the active replica answers the status endpoint.

Seams: the rules take a :class:`~fedsched.ports.Publisher` (the bus live), a business
:class:`~fedsched.clock.Clock` (event times, ``view.now``) and a liveness clock (wall seconds:
heartbeat age, reclamation timers); the bus itself is only needed by :meth:`SchedulerService.run`
(followers, status endpoint). Tests feed deliveries to :meth:`SchedulerService.handle_event` /
:meth:`SchedulerService.handle_inventory` and call :meth:`SchedulerService.cycle` against fakes
(``tests/unit/scheduler/test_cycles.py``).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from collections.abc import Iterable
from typing import Awaitable, Callable

from sortedcontainers import SortedKeyList

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, StreamFollower
from fedsched.clock import Clock, SystemClock, to_datetime
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.errors import DecodeError, UnavailableError
from fedsched.events import (Envelope, EventType, Heartbeat, InventorySnapshot, JobPending, JobPlaced, JobPriorityChanged, JobStatus,
                             JobStop, JobSubmitted, Subjects, WorkerBinding, business_event_id, make_event)
from fedsched.gctune import tune_for_service
from fedsched.jobs import JobSpec
from fedsched.metrics import SchedulerMetrics, pending_reason_code
from fedsched.lease import Lease
from fedsched.policystore import PolicyFollower, PolicyHolder
from fedsched import snapshots
from fedsched.snapshots import SnapshotStore
from fedsched.version import package_version
from fedsched.ports import Publisher, PublishResult, retryable
from fedsched.pricing import PriceCatalog
from fedsched.tenancy import DEFAULT_RETRY_BUDGET, RetryBudgetDoc
from fedsched.whatif import WHAT_IF_JOB_ID, ShardWhatIf, WhatIfReply, WhatIfRequest
from fedsched.whatif import subject as what_if_subject
from fedsched.trust import PlacedAttempt, Rejection, check_placement, check_subject, dead_letter_room, rejection_events
from services.scheduler.approvals import TenancyGate, evaluation_record, placement_milli
from services.scheduler.core.collector import raise_gc_thresholds
from services.scheduler.core.preempt import EndOrder
from services.scheduler.checkpoint import STATE_VERSION, restore_scheduler, scheduler_state
from services.scheduler.queuebook import QueuedBook
from services.scheduler.states import ACTIVE, Outcome, ShardState, StopReason
from services.scheduler.core import (ClusterEvaluation, ClusterIndex, ClusterState, NodeState, Pending, Placement,
                                     Policy, QueuedJob, RunningSet, RunningWork, Usage, View,
                                     decide)
from services.scheduler.core.snapshot import MIN_LEFT_S, CapacityClasses, pending_end_key
from services.scheduler.core.explain import pending_counterfactual, placement_counterfactual
from services.scheduler.core.queues import effective_priority, queue_of

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.scheduler")


@dataclass
class ShardEntry:
    """One schedulable unit of a job (a whole job is shard 0 of 1).

    Attributes:
        state: see :class:`ShardState`.
        attempt: number of the latest placement (0 = never placed).
        failures: failed attempts so far (retry budget: ``spec.retry_limit``).
        losses: attempts lost with their cluster so far (infrastructure losses: the tenant's
            ``retries.max_infra_retries``, not ``spec.retry_limit``; see :meth:`SchedulerService._after_loss`).
        avoid: clusters where an attempt failed (failover prefers others).
        placed: the current placement (allocated while placed/running).
        attempt_placed: the placement of the latest attempt, kept after its resources are given
            up (what a ``job.stopped`` for it carries: card model, fabric).
        placed_wall: liveness-clock (wall) seconds when the placement was published (JetStream
            time when read back from the stream), for reclamation.
        started_at: business time the current attempt started.
        progress_s: checkpointed work from earlier attempts (s).
        pending_reason: the last published pending summary.
        unplaceable: the last decision found no cluster that could hold it even if empty.
        unplaceable_since: business time since when it has been unplaceable without a break
            (None = it is not).
        outcome: how a done shard ended: succeeded, failed, cancelled.
    """

    index: int
    state: ShardState = ShardState.QUEUED
    attempt: int = 0
    failures: int = 0
    losses: int = 0
    avoid: set[str] = field(default_factory=set)
    cluster: str = ""
    region: str = ""
    placed: JobPlaced | None = None
    attempt_placed: JobPlaced | None = None
    placed_wall: float = 0.0
    started_at: float | None = None
    progress_s: float = 0.0
    pending_reason: str = ""
    unplaceable: bool = False
    unplaceable_since: float | None = None
    stop_sent: bool = False
    outcome: Outcome = Outcome.NONE
    view_cache: tuple | None = field(default=None, repr=False, compare=False)
    #: (spec, submitted_at, attempt, progress_s, cross-region mode, len(avoid), QueuedJob): the
    #: queue's record of this shard, rebuilt only when one of those changed (SchedulerService.queue)
    queue_cache: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class JobEntry:
    """The scheduler's record of one job: identity, spec, trace context, its shards."""

    job_id: str
    tenant: str
    project: str
    spec: JobSpec
    submitted_at: float
    headers: dict[str, str] = field(default_factory=dict)
    cancel_requested: bool = False
    cancelled_sent: bool = False
    end_reason: str = ""  # why the scheduler itself ends it ("" = a cancellation someone asked for)
    shards: list[ShardEntry] = field(default_factory=list)
    mode_cache: tuple | None = field(default=None, repr=False, compare=False)  # (governance, cross-region mode)

    @property
    def done(self) -> bool:
        """Every shard is done."""
        return all(s.state == ShardState.DONE for s in self.shards)

    # -- the job as one attempt, for the governor (services/scheduler/approvals.py) --

    @property
    def state(self) -> ShardState:
        """``done`` when every shard is; else the most advanced shard state."""
        if self.done:
            return ShardState.DONE
        for state in (ShardState.RUNNING, ShardState.PLACED, ShardState.STOPPING, ShardState.QUEUED):
            if any(s.state == state for s in self.shards):
                return state
        return ShardState.QUEUED

    @property
    def attempt(self) -> int:
        """Latest attempt number over the shards."""
        return max((s.attempt for s in self.shards), default=0)

    @property
    def _lead(self) -> "ShardEntry | None":
        return next((s for s in self.shards if s.placed is not None), None)

    @property
    def placed(self) -> JobPlaced | None:
        """The first shard's current placement (None if no shard holds one)."""
        lead = self._lead
        return lead.placed if lead else None

    @property
    def region(self) -> str:
        """Region of :attr:`placed`."""
        lead = self._lead
        return lead.region if lead else ""


#: a placement whose agent is alive but behind on reading its orders waits at most this many
#: times ``reclaim_after_s`` before it is reclaimed anyway (an agent whose consumer is wedged
#: while it still heartbeats must not hold work forever)
RECLAIM_BACKLOG_LIMIT = 10

@dataclass
class ClusterInfo:
    """Latest inventory of one cluster and when it last produced a heartbeat or inventory
    (``seen_at``: liveness-clock seconds, the JetStream time of that message)."""

    name: str
    region: str
    zone: str
    snapshot: InventorySnapshot
    seen_at: float
    # node name -> [gpu milli per device], cpu milli, memory MiB allocated by placements
    alloc: dict[str, list] = field(default_factory=dict)
    cached: ClusterState | None = None
    # incremental view: the node states, their positions, the static index; dirty node names
    nodes: list[NodeState] = field(default_factory=list)
    position: dict[str, int] = field(default_factory=dict)
    index: ClusterIndex | None = None
    dirty_nodes: set[str] = field(default_factory=set)
    classes: CapacityClasses | None = None  # capacity classes of ``nodes``, updated from the dirty nodes
    orders_backlog: int = 0  # orders its agent had not read at its newest heartbeat (Heartbeat.orders_backlog)
    capacity_key: tuple | None = None  # _capacity_key(snapshot), kept (a new snapshot is compared with it)


class SchedulerService:
    """The scheduler.

    Args:
        bus: NATS connection; needed only by :meth:`run` (None for a service driven by hand
            through :meth:`handle_event` / :meth:`handle_inventory` / :meth:`cycle`).
        clock: business clock (event times, the view's ``now``).
        policy: the scheduling policy (see :func:`~services.scheduler.core.build_policy`).
        prices: price catalog (cluster prices in the view).
        publisher: where events go (default: ``bus``).
        subjects: subject names (default: ``bus.subjects``).
        liveness: wall clock for heartbeat ages and reclamation timers, comparable with the
            JetStream timestamps of the messages (default :class:`~fedsched.clock.SystemClock`).
        stale_after_s: wall seconds after which a silent cluster is excluded and its placements
            (placed or running) are moved.
        interval_s: minimum wall seconds between the starts of two cycles.
        coalesce_s: wall seconds a cycle waits after the change that woke it, for what arrives
            with it (:meth:`cycle_delay_s`); at most ``interval_s``.
        reclaim_after_s: wall seconds a placement may stay unstarted before it is reclaimed.
        cross_region_mode: tenant -> ``allowed`` / ``approval`` / ``forbidden`` (default allowed).
        unschedulable_timeout_s: business seconds a job may stay unplaceable (no cluster could
            hold it even empty) before it is ended with reason ``unschedulable_timeout``.
        metrics: where the cycle's metrics go (queues, cycle time, placements, pending reasons,
            heartbeat ages; default: a registry of its own, served by nobody).
        lease: the scheduler lease shared by the replicas (None = the only scheduler: always
            active, fencing token 0). With one, :meth:`run` steps it and cycles only while it
            is held; every publish is fenced by it.
        stream_end: ``async () -> int``, the events stream's last sequence now (what a new
            tenure must have folded before it decides; default: asked of ``bus``).
        retain_ended: ended jobs whose whole :class:`JobEntry` stays in memory (the newest ones,
            for inspection); older ended jobs leave it (:meth:`_retire`), keeping a tombstone.
        retain_tombstones: ended job ids remembered with their newest attempt (about 100 bytes
            each), so a late status of a job that left memory is ignored as late, not refused
            as a forgery, and a redelivered ``job.submitted`` does not revive it. Older ones are
            forgotten (a status of a job ended that long ago is refused as unknown).

        snapshot_every_s: write a restart checkpoint (:mod:`services.scheduler.checkpoint`, to the
            ``snapshot_scheduler`` object store) after a cycle when this many wall seconds passed
            since the last one, or ``snapshot_every_events`` stream events were folded since;
            and start from the newest checkpoint plus the stream after it. 0 = never (a start
            reads the whole stream).
        snapshot_every_events: see ``snapshot_every_s``.
        max_jobs_per_cycle: queued shards one cycle hands to ``decide`` at most (see
            :meth:`window`); the others wait for the next cycle (one ``interval_s`` later), so a
            burst of thousands of submissions is placed in a stream of short cycles, not one long
            one that publishes nothing until it ends. Default 500, as the setting
            :attr:`fedsched.settings.Settings.max_jobs_per_cycle` (``FEDSCHED_MAX_JOBS_PER_CYCLE``)
            that ``fedsched up`` passes in.

    Memory is bounded by the live jobs plus these two retentions, not by the jobs ever seen
    (issue 15 item 2; ``tests/unit/scheduler/test_memory.py``).

    Raises:
        ValueError: no bus and no publisher or subjects; ``max_jobs_per_cycle`` <= 0.
    """

    def __init__(self, bus: Bus | None, clock: Clock, policy: Policy, prices: PriceCatalog, *,
                 publisher: Publisher | None = None, subjects: Subjects | None = None, liveness: Clock | None = None,
                 stale_after_s: float = 10.0, interval_s: float = 0.02, coalesce_s: float = 0.003,
                 reclaim_after_s: float = 30.0,
                 cross_region_mode: dict[str, str] | None = None, unschedulable_timeout_s: float = 86400.0,
                 metrics: SchedulerMetrics | None = None, lease: Lease | None = None, stream_end=None,
                 retain_ended: int = 1000, retain_tombstones: int = 200_000, snapshot_every_s: float = 0.0,
                 snapshot_every_events: int = 100_000, max_jobs_per_cycle: int = 500) -> None:
        if bus is None and (publisher is None or subjects is None):
            raise ValueError("a scheduler without a bus needs a publisher and subjects")
        self.bus = bus
        if max_jobs_per_cycle <= 0:
            raise ValueError(f"max_jobs_per_cycle must be > 0 (got {max_jobs_per_cycle})")
        self.max_jobs_per_cycle = max_jobs_per_cycle
        self._window_blocked = False  # the last windowed cycle placed nothing: decide the whole queue next
        inner: Publisher = publisher if publisher is not None else bus
        self.lease = lease
        #: fencing token stamped on placements and stop orders (the lease's, once caught up)
        self.fencing_token = 0
        #: highest fencing token seen on placements and stop orders read from the stream
        self.highest_token = 0
        self.stale_orders = 0  # orders read back with a token below the highest seen (ignored)
        self.forged_orders = 0  # orders read back with a token no tenure of the lease issued (ignored)
        #: why this replica holds the lease but refuses to lead ("" = no problem): its token is
        #: not above the highest on the bus (a recreated leases bucket); shown by status()
        self.lease_problem = ""
        self._takeover = lease is not None  # a new tenure must read the stream to its end first
        self._led_until_loss = False  # the tenure just lost had caught up and led (see _on_lease_change)
        self._stream_end = stream_end if stream_end is not None else self._bus_stream_end
        self.publisher: Publisher = inner if lease is None else FencedPublisher(inner, self._may_publish)
        self.subjects: Subjects = subjects if subjects is not None else bus.subjects
        self.clock = clock
        self.liveness: Clock = liveness if liveness is not None else SystemClock()
        self.policy = policy
        self.prices = prices
        self.stale_after_s = stale_after_s
        self.interval_s = interval_s
        self.coalesce_s = max(0.0, min(coalesce_s, interval_s))
        self._cycle_started = -math.inf  # perf_counter when the last cycle of run() started
        self.reclaim_after_s = reclaim_after_s
        self._reclaim_recheck = 0.0  # liveness time before which due placements left waiting are not looked at again
        self.unschedulable_timeout_s = unschedulable_timeout_s
        self.cross_region_mode = cross_region_mode or {}
        # governance (quotas, cross-region modes, approvals): services/scheduler/approvals.py
        self.base_policy = policy
        self.policy_holder = PolicyHolder()
        self.governor = TenancyGate(self.policy_holder, self.subjects, prices)
        self.jobs: dict[str, JobEntry] = {}
        self.retain_ended = max(1, retain_ended)
        self.retain_tombstones = max(0, retain_tombstones)
        #: ended jobs still in :attr:`jobs`, oldest first (evicted past ``retain_ended``)
        self._ended: OrderedDict[str, None] = OrderedDict()
        #: ended jobs that left memory: job id -> newest attempt over its shards, oldest first
        self.tombstones: OrderedDict[str, int] = OrderedDict()
        self.clusters: dict[str, ClusterInfo] = {}
        self.counts = {state: 0 for state in ShardState}
        #: the queued shards, indexed in the window's order (services/scheduler/queuebook.py)
        self.queued: QueuedBook = QueuedBook(policy.fast_lane_s)
        #: queued shards found unplaceable by a decision (``unplaceable_since`` set): all that
        #: :meth:`_expire_unschedulable` looks at
        self._unplaceable: dict[tuple[str, int], tuple[JobEntry, ShardEntry]] = {}
        self.active: dict[tuple[str, int], tuple[JobEntry, ShardEntry]] = {}
        self.stopping: dict[tuple[str, int], tuple[JobEntry, ShardEntry]] = {}
        self.cancelling: dict[str, JobEntry] = {}
        self.applied_seq = 0
        self.cycles = 0
        self.last_cycle_ms = 0.0
        self.busy = False
        self._counterfactuals = 0
        self._placement_counterfactuals = 0
        self._evaluations: dict[int, tuple[ClusterEvaluation, dict]] = {}  # a cycle's records (_evaluation)
        self._home_starts: dict = {}
        self.on_cycle: list = []  # callables run after every cycle (e.g. a replay driver's wake-up)
        self._dirty = asyncio.Event()
        #: messages refused by the trust checks (fedsched.trust), published at the next cycle
        self.rejections: list[Rejection] = []
        self.rejected = 0  #: messages refused so far
        self._stop = asyncio.Event()
        self._status_sub = None
        self._what_if_sub = None
        self._stale: set[str] = set()
        #: liveness time of this tenure's start (:meth:`start_grace`): silence and unstarted
        #: placements are timed from no earlier than it (-inf until the rebuilt book is used)
        self._grace_from = -math.inf
        # events of types this build does not know (a newer producer), skipped per follower
        self.skipped = {name: SkippedTypes(name) for name in ("scheduler-events", "scheduler-inventory")}
        self._heard: dict[str, float] = {}  # cluster -> newest heartbeat time seen before its first inventory
        #: (tenant, ``YYYY-MM``) -> retried attempts (failures and losses) of that month (retry budget)
        self.retries_used: dict[tuple[str, str], int] = {}
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.metrics.watch_heartbeats(self.heartbeat_ages)
        # Incremental view (see _track): shards holding or giving up resources, per cluster; the
        # view's records of started work and the tenants' usage, kept from one cycle to the next.
        #: state (placed, running, stopping) -> cluster -> key -> (job, shard)
        self._on: dict[ShardState, dict[str, dict[tuple[str, int], tuple[JobEntry, ShardEntry]]]] = {
            ShardState.PLACED: {}, ShardState.RUNNING: {}, ShardState.STOPPING: {}}
        # quota usage of placed/running shards as running totals (kept by _track, read by the
        # quota book each cycle instead of walking self.active): key -> (tenant, model, region,
        # milli-GPUs, the JobPlaced counted), and (tenant, model, region) -> milli-GPUs
        self._quota_of: dict[tuple[str, int], tuple[str, str, str, int, JobPlaced]] = {}
        self._quota_use: dict[tuple[str, str, str], int] = {}
        self._tracked: dict[tuple[str, int], tuple[str, ShardState]] = {}  # key -> (cluster, state) indexed under
        self._works: dict[str, dict[tuple[str, int], RunningWork]] = {}  # cluster -> started shard -> record
        #: cluster -> the same records in order of estimated end (handed to the core with the view's
        #: running set: wait estimates read what frees up first without sorting all running work)
        self._ends: dict[str, EndOrder] = {}
        self._work_use: dict[tuple[str, int], tuple[str, int, int, int]] = {}  # its (tenant, GPU, CPU, MiB) held
        self._work_dirty: dict[str, set[tuple[str, int]]] = {}  # started shards whose record must be (re)built
        self._running_tuple: dict[str, tuple[tuple[RunningWork, ...], int | None]] = {}  # started records, lowest preemptible priority
        #: cluster -> priority -> how many of its started records are preemptible at that priority
        #: (kept with ``_works``: the lowest one without walking the records)
        self._preemptible_prios: dict[str, dict[int, int]] = {}
        self._positions: dict[str, dict] = {}  # cluster -> the node positions its records were built on
        self._held: dict[str, list[int]] = {}  # tenant -> [milli-GPU, milli-CPU, MiB] of started work
        #: the same for placed, not started work: cluster -> key -> (its RunningSet pending entry,
        #: tenant, (milli-GPU, milli-CPU, MiB)); shards whose entry must be (re)built; each
        #: cluster's entries in order of expected end (pending_end_key), handed to the core as
        #: they are; per cluster, priority -> preemptible entries; tenant -> its total
        self._unstarted: dict[str, dict[tuple[str, int], tuple[tuple, str, tuple[int, int, int]]]] = {}
        self._unstarted_dirty: dict[str, set[tuple[str, int]]] = {}
        self._unstarted_order: dict[str, SortedKeyList] = {}
        self._unstarted_prios: dict[str, dict[int, int]] = {}
        self._held_unstarted: dict[str, list[int]] = {}
        self._unstarted_due: list[tuple[float, int, tuple[str, int], int]] = []  # (placed_wall, seq, key, attempt)
        self._due_seq = 0
        #: shard records the last cycle visited outside decide() (queue, view records rebuilt,
        #: reclamation candidates, quota usage): per kind and in all (the scale tests' counter)
        #: followers' read horizon (see _live_now): stream -> newest production time read, and
        #: stream -> messages stored behind the last one read
        self._horizon: dict[str, float] = {}
        self._behind: dict[str, int] = {}
        self.last_cycle_visit_counts: dict[str, int] = {}
        self.last_cycle_visits = 0
        self.snapshot_every_s = snapshot_every_s
        self.snapshot_every_events = max(1, snapshot_every_events)
        self.snapshot_seq = 0  #: stream sequence of the last checkpoint written or loaded (0 = none)
        self._snapshot_wall = 0.0
        self._snapshot_retry_at = 0.0  # after a failed checkpoint: the next try not before this
        self._snapshots: SnapshotStore | None = None
        self._snapshot_task: asyncio.Task | None = None
        self._snapshot_lock = asyncio.Lock()

    # ------------------------------------------------------------------ inputs

    def lag_sources(self) -> list[tuple[str, Callable[[], Awaitable[int]]]]:
        """``(follower name, async lag())`` of the stream followers that feed this service (the
        ``consumer_lag_messages`` samples; none before they exist)."""
        followers = (getattr(self, "_events", None), getattr(self, "_inventory", None))
        return [(f.name, f.lag) for f in followers if f is not None]

    # ------------------------------------------------------------------ the lease

    @property
    def leading(self) -> bool:
        """Whether this replica may decide and publish: no lease (the only scheduler), or the
        lease is held and the new tenure has caught up with the stream."""
        if self.lease is None:
            return True
        return self.lease.is_active() and not self._takeover

    def _may_publish(self) -> bool:
        return self.lease is None or (self.lease.is_active() and self.fencing_token == self.lease.token)

    def _on_lease_change(self, held: bool) -> None:
        was_leading = self.fencing_token != 0 and not self._takeover
        self.fencing_token = 0
        self._dirty.set()
        if not held:
            self._led_until_loss = was_leading
            self._takeover = True  # the next gain must catch up (unless it resumes this tenure)
            return
        if self.lease is not None and self.lease.resumed and self._led_until_loss \
                and self.lease.token > self.highest_token:
            # our own tenure resumed (a renewal came too late; no other replica wrote the lease
            # since our last write): nobody else gave orders, and ours are in the book -- lead on
            # at once with the new token, no catch-up read and no start-up grace (a scheduler
            # busy at 100,000 jobs lost its lease every minute and stood still ~20 s each time
            # reading the stream to an end that kept moving)
            self.fencing_token = self.highest_token = self.lease.token
            self._takeover = False
            log.info("scheduler: lease resumed with fencing token %d", self.fencing_token)
            return
        self._takeover = True  # gained: catch up first

    async def _bus_stream_end(self) -> int:
        info = await self.bus.js.stream_info(self.bus.stream_name("EVENTS"))
        return int(info.state.last_seq)

    async def catch_up(self, timeout_s: float = 30.0) -> bool:
        """After acquiring the lease: fold the events stream up to its last sequence now (what
        a former holder published), then take the lease's token (:attr:`leading` from then on).
        False when the stream's end could not be read, it was not reached within
        ``timeout_s`` or the lease was lost meanwhile (:meth:`run` tries again)."""
        if self.lease is None or not self.lease.is_active():
            return False
        try:
            last = await self._stream_end()
        except Exception as e:  # noqa: BLE001 - NATS trouble: retried next loop
            log.warning("scheduler: cannot read the stream's end for the takeover: %r", e)
            return False
        deadline = time.monotonic() + timeout_s
        while self.applied_seq < last and time.monotonic() < deadline:
            if not self.lease.is_active():
                return False
            await asyncio.sleep(0.01)
        if self.applied_seq < last or not self.lease.is_active():
            return False
        if self.lease.token <= self.highest_token:  # the leases bucket was recreated: revisions restarted
            # leading would be useless and misleading: every order would be refused as stale
            problem = (f"lease token {self.lease.token} is not above the highest fencing token on the bus "
                       f"({self.highest_token}): the {self.bus.prefix if self.bus is not None else '<prefix>'}"
                       f"_leases bucket was deleted and recreated, so its revisions restarted; refusing to lead")
            if problem != self.lease_problem:
                log.error("scheduler: %s. To recover, write the lease key until its revision passes %d (each "
                          "write adds one) or restore the old bucket; never delete that bucket", problem,
                          self.highest_token)
            self.lease_problem = problem
            return False
        self.lease_problem = ""
        self.fencing_token = self.lease.token
        self.start_grace()  # a new tenure: clusters get stale_after_s from now to be heard by it
        # our tenure is the floor from now on: every order of an earlier one stored before it
        # began has just been folded; one read later was stored after it (fedsched.lease.stale_order)
        self.highest_token = max(self.highest_token, self.fencing_token)
        self._takeover = False
        log.info("scheduler: active with fencing token %d (stream read to %d)", self.fencing_token, last)
        return True

    def _fence(self, env: Envelope, token: int) -> bool:
        """Fold rule of an order read from the stream: False (ignore it) when its token is below
        the highest seen; a token above ours while we are active means another replica holds
        the lease: step down."""
        if token < self.highest_token:
            self.stale_orders += 1
            log.warning("scheduler: ignoring %s of %s with stale fencing token %d < %d", env.type, env.job_id,
                        token, self.highest_token)
            return False
        self.highest_token = token
        if self.lease is not None and self.fencing_token and token > self.fencing_token:
            self.lease.lose(f"fencing token {token} on the bus is newer than ours ({self.fencing_token})")
        return True

    # ------------------------------------------------------------------ inputs

    def handle_event(self, d: Delivery):
        """Fold one delivery of the events stream (what the follower calls, in stream order).

        An order (placement, stop) whose fencing token is above every token seen and our own is
        folded only after the lease is read (the awaitable returned; the follower awaits it
        before the next message): a token above the lease's current one was issued by no tenure
        (:func:`~fedsched.lease.unissued`: e.g. 2^62 published with the scheduler's credentials)
        and is neither folded nor taken as the highest token -- it would make this replica step
        down and every later takeover refuse to lead."""
        self._note_read("events", d)
        if self.lease is not None:
            token = _order_token(d.envelope)
            if token is not None and token > max(self.highest_token, self.fencing_token):
                return self._apply_after_lease_read(d, token)
        self._apply_event(d)
        return None

    async def _apply_after_lease_read(self, d: Delivery, token: int) -> None:
        try:
            record = await self.lease.store.get(self.lease.key)
        except UnavailableError as e:  # cannot judge: fold as before (the token rules of _fence)
            log.info("scheduler: lease not read for %s of %s (%s)", d.envelope.type, d.envelope.job_id, e)
            record = None
        if record is not None:
            issued = record.token or record.revision
            if token > issued:
                self.forged_orders += 1
                log.warning("scheduler: ignoring %s of %s: fencing token %d was issued by no tenure (the lease's "
                            "current token is %d)", d.envelope.type, d.envelope.job_id, token, issued)
                return
        self._apply_event(d)

    def handle_inventory(self, d: Delivery) -> None:
        """Fold one delivery of the inventory stream (snapshots, heartbeats)."""
        self._note_read("inventory", d)
        self._apply_inventory(d)

    def _note_read(self, stream: str, d: Delivery) -> None:
        """Remember how far a follower has read: the newest production time it has seen and the
        messages still waiting behind this one (JetStream's ``num_pending``; 0 when unknown)."""
        if d.published_at is not None:
            self._horizon[stream] = max(self._horizon.get(stream, 0.0), d.published_at)
        self._behind[stream] = d.pending

    def _live_now(self, now_live: float) -> float:
        """The liveness time silence is judged at: ``now_live`` when both followers have read
        everything stored, else the newest production time they have read. A scheduler whose
        followers lag (a long cycle, a burst of submissions) must not take its own backlog for
        the clusters' silence: it would declare healthy clusters lost and reclaim placements
        whose start it simply has not read yet (found by bench/e2e_throughput.py: tens of
        thousands of attempts lost at 20,000 jobs). Silence is then judged against what was
        read: a cluster is stale only if others spoke for ``stale_after_s`` after it last did."""
        if not any(self._behind.values()):
            return now_live
        horizons = [t for t in self._horizon.values() if t > 0]
        return min(now_live, min(horizons)) if horizons else now_live

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Rebuild from the bus, then schedule until :meth:`stop`."""
        bus = self.bus
        if bus is None:
            raise ValueError("run() needs a bus")
        raise_gc_thresholds()  # cycles allocate many objects: collect less often (core/collector.py)
        start = 1
        if self.snapshot_every_s > 0:  # a checkpoint and the stream after it (fedsched.snapshots)
            self._snapshots = SnapshotStore(bus, "scheduler")
            start = await self.load_snapshot()
            self._snapshot_wall = self.liveness.time()  # the first one a period after the start
        # The whole stream (not just jobs/status/placements): applied_seq then tells anyone
        # comparing it with the stream's last sequence whether the scheduler has seen everything.
        self._events = StreamFollower(bus, "EVENTS", self.handle_event, name="scheduler-events",
                                      start_sequence=start)
        self._inventory = StreamFollower(bus, "INVENTORY", self.handle_inventory, name="scheduler-inventory",
                                         last_per_subject=True)
        self._policy_follower = PolicyFollower(bus, self.policy_holder, name="scheduler-policy")
        tasks = [asyncio.create_task(self._events.run(), name="scheduler-events"),
                 asyncio.create_task(self._inventory.run(), name="scheduler-inventory"),
                 asyncio.create_task(self._policy_follower.run(), name="scheduler-policy")]
        lease_stop = asyncio.Event()
        if self.lease is not None:
            self.lease.on_change.append(self._on_lease_change)
            tasks.append(asyncio.create_task(self.lease.run(lease_stop), name="scheduler-lease"))
        self._status_sub = await self.bus.nc.subscribe(f"{self.bus.prefix}.svc.scheduler.status",
                                                       cb=self._on_status_request)
        self._what_if_sub = await self.bus.nc.subscribe(what_if_subject(self.bus.prefix), cb=self._on_what_if_request)
        try:
            await self._events.caught_up.wait()
            await self._inventory.caught_up.wait()
            await self._policy_follower.initial.wait()
            log.info("scheduler: rebuilt %d jobs, %d clusters", len(self.jobs), len(self.clusters))
            self.start_grace()
            # the rebuilt book leaves the collector's walks (a 5,000-job bench: the collector took ~27%
            # of the scheduler's CPU, 6 full collections over the start-up heap; issue 15)
            tune_for_service(0)
            self._dirty.set()
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._dirty.wait(), timeout=self.next_wake_s())
                except asyncio.TimeoutError:
                    pass  # periodic cycle: staleness, aging, reclamation
                if self._stop.is_set():
                    break
                if self.lease is not None and not self.leading:
                    if not self.lease.is_active():  # standby: follow only; wake to check the lease
                        await asyncio.sleep(min(0.1, self.lease.renew_every_s / 2))
                        continue
                    if not await self.catch_up():
                        await asyncio.sleep(0.1)
                        continue
                delay = self.cycle_delay_s(time.perf_counter())
                if delay > 0:  # gather what else is arriving (the follower's next fetch) into this cycle
                    await asyncio.sleep(delay)
                    if self._stop.is_set():
                        break
                self._dirty.clear()
                self.busy = True
                self._cycle_started = time.perf_counter()
                try:
                    await self.cycle()
                except Exception:  # noqa: BLE001 - a cycle must never kill the scheduler
                    log.exception("scheduler cycle failed")
                finally:
                    self.busy = False
                    for hook in self.on_cycle:
                        hook()
                self._snapshot_in_background()
        finally:
            lease_stop.set()  # the lease task releases the lease (a standby takes over at once)
            self._events.stop()
            self._inventory.stop()
            self._policy_follower.stop()
            for sub in (self._status_sub, self._what_if_sub):
                if sub is None:
                    continue
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - connection may be closing
                    pass
            if self._snapshot_task is not None:  # a checkpoint being written is finished, not torn
                await asyncio.gather(self._snapshot_task, return_exceptions=True)
            lease_task = [t for t in tasks if t.get_name() == "scheduler-lease"]
            if lease_task:
                await asyncio.wait(lease_task, timeout=2.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ checkpoints

    def snapshot_bytes(self) -> bytes:
        """The current book as a checkpoint (:mod:`services.scheduler.checkpoint`), reflecting the
        stream up to :attr:`applied_seq`."""
        return snapshots.encode("scheduler", STATE_VERSION, self.applied_seq, scheduler_state(self))

    def restore(self, data: bytes) -> int:
        """Load a checkpoint into this new service; returns the stream sequence to read from.

        Raises:
            fedsched.snapshots.SnapshotError: corrupt, incompatible or malformed (nothing loaded).
        """
        snap = snapshots.decode(data, "scheduler", STATE_VERSION)
        try:
            restore_scheduler(self, snap.state, snap.applied_seq, JobEntry, ShardEntry)
        except (KeyError, TypeError, ValueError) as e:
            raise snapshots.SnapshotError(f"malformed scheduler snapshot: {e!r}") from e
        self.snapshot_seq = snap.applied_seq
        return snap.applied_seq + 1

    def _forget_book(self) -> None:
        """Empty the job book and its indexes (after a checkpoint failed halfway through loading)."""
        for book in (self.jobs, self.queued, self._unplaceable, self.active, self.stopping, self.cancelling, self._ended, self.tombstones,
                     self.retries_used, self.governor.state, self.governor.started, self._tracked, self._works, self._ends,
                     self._quota_of, self._quota_use,
                     self._work_use, self._work_dirty, self._running_tuple, self._preemptible_prios, self._held,
                     self._unstarted, self._unstarted_dirty, self._unstarted_order, self._unstarted_prios,
                     self._held_unstarted,
                     *self._on.values()):
            book.clear()
        self._unstarted_due.clear()
        self.counts = {state: 0 for state in ShardState}
        self.applied_seq = self.snapshot_seq = 0

    async def load_snapshot(self) -> int:
        """Restore the newest usable checkpoint; the first stream sequence to read (1 = none:
        a corrupt or incompatible one is warned about and the whole stream is read)."""
        data = await self._snapshots.read() if self._snapshots is not None else None
        if data is None:
            return 1
        t0 = time.perf_counter()  # a log figure, not a rule
        try:
            start = self.restore(data)
        except snapshots.SnapshotError as e:
            log.warning("scheduler: snapshot not used (%s); reading the whole stream", e)
            self._forget_book()  # nothing half-loaded
            return 1
        log.info("scheduler: restored %d jobs at sequence %d from a snapshot (%d bytes) in %.2f s", len(self.jobs),
                 start - 1, len(data), time.perf_counter() - t0)
        return start

    async def maybe_snapshot(self, *, force: bool = False) -> bool:
        """Write a checkpoint when one is due (``snapshot_every_s`` / ``snapshot_every_events``);
        True when written. A failure is logged and retried a period later
        (:func:`fedsched.snapshots.checkpoint_due`).

        The book is captured by a ``fork`` (:class:`fedsched.snapshots.ForkedCapture`): the
        child walks and encodes it, so the loop's own work does not grow with the jobs held;
        awaiting this only waits for the child and the upload (the run loop does that in a
        background task, :meth:`_snapshot_in_background`)."""
        if self._snapshots is None or self.rejections:
            return False
        now = self.liveness.time()
        if not snapshots.checkpoint_due(applied_seq=self.applied_seq, written_seq=self.snapshot_seq, now=now,
                                        written_at=self._snapshot_wall, every_s=self.snapshot_every_s,
                                        every_events=self.snapshot_every_events, retry_at=self._snapshot_retry_at,
                                        force=force):
            return False
        async with self._snapshot_lock:  # one write at a time: an older one never lands last
            return await self._write_snapshot(now)

    async def _write_snapshot(self, now: float) -> bool:
        seq = self.applied_seq
        if seq <= self.snapshot_seq:
            return False
        capture = snapshots.ForkedCapture(self.snapshot_bytes)
        try:
            data = await capture.result()
            await self._snapshots.write(data)
        except Exception as e:  # noqa: BLE001 - a checkpoint is an optimisation; the stream is the truth
            self._snapshot_retry_at = now + self.snapshot_every_s
            log.warning("scheduler: snapshot at sequence %d not written: %s; next try in %g s", seq, e,
                        self.snapshot_every_s)
            return False
        finally:
            await capture.discard()
        self.snapshot_seq, self._snapshot_wall = max(self.snapshot_seq, seq), now
        log.info("scheduler: snapshot at sequence %d (%d jobs, %d bytes)", seq, len(self.jobs), len(data))
        return True

    def _snapshot_in_background(self) -> None:
        """Start :meth:`maybe_snapshot` as a task unless one is still writing (the cycle loop
        never waits for a checkpoint)."""
        if self._snapshot_task is None or self._snapshot_task.done():
            self._snapshot_task = asyncio.create_task(self.maybe_snapshot(), name="scheduler-snapshot")

    def cycle_delay_s(self, now: float) -> float:
        """Wall seconds to wait before a cycle woken at ``now`` (``time.perf_counter`` seconds)
        starts: the coalescing delay ``coalesce_s`` (the submissions arriving together -- one
        fetch of the follower after another -- are decided in one cycle, not one cycle each),
        and at least what is left of ``interval_s`` since the previous cycle started (the most
        cycles per second). A cycle starts when something changed, not on a timer: a
        submission reaching an idle scheduler waits ``coalesce_s``, not a period."""
        return max(self.coalesce_s, self._cycle_started + self.interval_s - now)

    def next_wake_s(self) -> float:
        """Wall seconds until the next cycle is due without any new event: when the freshest
        silent cluster turns stale or the oldest unstarted placement is due for reclamation,
        at most 1 s (aging, approval expiry), at least ``interval_s``."""
        now = self.liveness.time()
        due = 1.0
        for info in self.clusters.values():
            if info.name not in self._stale:
                due = min(due, self._silent_since(info) + self.stale_after_s - now)
        first = self._first_unstarted()
        if first is not None:
            due = min(due, max(max(first[0], self._grace_from) + self.reclaim_after_s, self._reclaim_recheck) - now)
        return max(self.interval_s, due + 0.001)

    def _unstarted_entry(self, entry: tuple) -> tuple[JobEntry, ShardEntry] | None:
        """The shard of a reclamation-heap entry if the entry is still its current placement
        (placed, not started, same attempt and placement time), else None."""
        wall, _, (job_id, index), attempt = entry
        job = self.jobs.get(job_id)
        if job is None:
            return None
        shard = job.shards[index]
        if shard.state != ShardState.PLACED or shard.attempt != attempt or shard.placed_wall != wall:
            return None
        return job, shard

    def _first_unstarted(self) -> tuple | None:
        """The reclamation heap's earliest live entry (dropping dead ones on the way), or None.
        Amortised O(log n) per placement: each entry is pushed once and popped once."""
        heap = self._unstarted_due
        while heap and self._unstarted_entry(heap[0]) is None:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()
        self._dirty.set()

    def status(self) -> dict:
        """Counts (of shards) for dashboards and the replay driver's quiescence check."""
        unplaceable = sum(1 for _, s in self._unplaceable.values() if s.unplaceable)
        timers = [st.pending.expires_at for st in self.governor.state.values() if st.pending is not None]
        return {"next_due": min(timers) if timers else None,  # business time of the next timer (approval expiry)
                "applied_seq": self.applied_seq, "dirty": self._dirty.is_set(), "busy": self.busy, "cycles": self.cycles,
                "last_cycle_ms": round(self.last_cycle_ms, 2), "unplaceable": unplaceable, "jobs": len(self.jobs),
                "clusters": len(self.clusters), "stale": sorted(self._stale), "policy": self.policy.version,
                "skipped_types": {name: c.as_dict() for name, c in self.skipped.items() if c.counts},
                "role": "active" if self.leading else "refusing" if self.lease_problem else "standby",
                "fencing_token": self.fencing_token,
                "holder": self.lease.holder if self.lease is not None else "",
                "stale_orders": self.stale_orders, "lease_problem": self.lease_problem,
                "version": package_version(),
                **{state.value: n for state, n in self.counts.items()}}

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        """``(region, cluster, wall seconds since its newest heartbeat or inventory)`` of every
        known cluster (the metrics' scrape thread calls it: one C-level copy of the clusters)."""
        now = self.liveness.time()
        return [(info.region, info.name, now - info.seen_at) for info in tuple(self.clusters.values())]

    async def _on_status_request(self, msg) -> None:
        if not self.leading and not self.lease_problem:
            return  # only the active replica answers (a standby's counts would mislead)
        await msg.respond(json.dumps(self.status()).encode())  # or the lease holder refusing to lead: why

    async def _on_what_if_request(self, msg) -> None:
        """Answer a dry run's what-if (:meth:`what_if`) -- only while leading: a standby's view
        may lag and every replica running the decision would multiply the work (the requester
        takes the leader's answer; with no leader it times out and the dry run has no what-if)."""
        if not self.leading:
            return
        try:
            request = WhatIfRequest.model_validate_json(msg.data)
        except ValueError as e:
            await msg.respond(WhatIfReply(error=f"not a what-if request: {e}"[:2000]).model_dump_json().encode())
            return
        try:
            reply = self.what_if(request)
        except Exception as e:  # noqa: BLE001 - a what-if must never hurt the scheduler
            log.exception("scheduler: what-if failed")
            reply = WhatIfReply(error=f"what-if failed: {type(e).__name__}")
        await msg.respond(reply.model_dump_json().encode())

    def what_if(self, request: WhatIfRequest) -> WhatIfReply:
        """The core's decision for ``request.spec`` (one queue entry per shard, attempt 1) on the
        current view, with the governance policy's weights, quota usage and cross-region mode, as
        a cycle would make it for that job alone -- committing nothing: no event is published,
        no shard, queue, cluster allocation, pending reason or approval changes (the view's
        caches are derived data and stay valid). Placements that would need an approval are
        reported as placed, marked ``needs_approval`` and noted in the summary.

        Returns:
            :class:`~fedsched.whatif.WhatIfReply`, one decision per shard in shard order.
        """
        spec = request.spec
        if not self.clusters:
            return WhatIfReply(decisions=tuple(ShardWhatIf(shard=i, outcome="pending", summary="no cluster reported yet",
                                                            decided_at=self.clock.time())
                                               for i in range(spec.shards)))
        policy = self.governor.effective_policy(self.base_policy)  # not self.policy: nothing is committed
        gov = self.policy_holder.current
        mode = gov.mode_for(spec)[0] if gov is not None else self.cross_region_mode.get(spec.tenant, "allowed")
        queue = [QueuedJob(WHAT_IF_JOB_ID, 1, spec, request.submitted_at, frozenset(), i, mode, 0.0)
                 for i in range(spec.shards)]
        view = self.view()
        view = replace(view, quota=self.governor.quota_book_of_totals(self._quota_use))
        narrowed = self.governor.narrow(queue, view)
        decisions = decide(view, narrowed, policy)
        now = self.clock.time()
        out: list[ShardWhatIf] = []
        for p in decisions.placements:
            summary = p.explanation
            approval = p.cross_region and mode == "approval"
            if approval:
                summary += f" (a run in {p.region} needs an approver's approval first)"
            out.append(ShardWhatIf(
                shard=p.job.shard, outcome="placed", summary=summary, cluster=p.cluster, region=p.region,
                needs_approval=approval,
                queue=p.queue, policy_version=decisions.policy_version, decided_at=now,
                counterfactual=placement_counterfactual(view, p, policy) if p.cross_region else "",
                evaluations=tuple(_evaluation(e) for e in p.evaluations)))
        for pend in decisions.pending:
            res = pend.reservation
            out.append(ShardWhatIf(
                shard=pend.job.shard, outcome="pending", summary=pend.reason, queue=pend.queue,
                policy_version=decisions.policy_version, decided_at=now, fits_empty=pend.fits_empty,
                reserved_cluster=res.cluster if res else "",
                counterfactual=pending_counterfactual(view, pend.job, policy),
                evaluations=tuple(_evaluation(e) for e in pend.evaluations)))
        return WhatIfReply(decisions=tuple(sorted(out, key=lambda d: d.shard)))

    # ------------------------------------------------------------------ shard state

    def _set(self, job: JobEntry, shard: ShardEntry, state: ShardState) -> None:
        """Move a shard to ``state``, keeping counts and indexes current."""
        key = (job.job_id, shard.index)
        self.counts[shard.state] -= 1
        self.counts[state] += 1
        shard.state = state
        if state == ShardState.QUEUED:
            self.queued[key] = (job, shard)
        else:
            self.queued.pop(key, None)
        if state in ACTIVE:
            self.active[key] = (job, shard)
        else:
            self.active.pop(key, None)
        if state == ShardState.STOPPING:
            self.stopping[key] = (job, shard)
        else:
            self.stopping.pop(key, None)
        if state != ShardState.QUEUED:
            shard.unplaceable, shard.unplaceable_since = False, None
            self._unplaceable.pop(key, None)
        self._track(job, shard)
        if state not in (ShardState.PLACED, ShardState.RUNNING):
            # a shard queued, held, stopping or done can change what a cycle decides; one placed
            # or started only takes room (the cycle that placed it asks for the next one itself
            # when its window left shards waiting): no cycle per job.placed read back or job.started
            self._dirty.set()
        if state == ShardState.DONE and job.job_id not in self.cancelling and job.done:
            self._retire(job)

    def _retire(self, job: JobEntry) -> None:
        """A job has ended (every shard done, its ``job.cancelled`` out if it needs one): it joins
        the retained ended jobs; the oldest beyond ``retain_ended`` leaves :attr:`jobs` for a
        tombstone (job id -> newest attempt), the oldest tombstones beyond ``retain_tombstones``
        are forgotten. O(1) amortised per ended job. What a later event needs of it: a status of
        an attempt up to the newest is late (ignored), a redelivered submit is a duplicate."""
        if job.job_id in self._ended or self.jobs.get(job.job_id) is not job:
            return
        self._ended[job.job_id] = None
        while len(self._ended) > self.retain_ended:
            old_id, _ = self._ended.popitem(last=False)
            old = self.jobs.pop(old_id, None)
            self.governor.forget(old_id)
            if old is None or not self.retain_tombstones:
                continue
            self.tombstones[old_id] = old.attempt
            self.tombstones.move_to_end(old_id)
            while len(self.tombstones) > self.retain_tombstones:
                self.tombstones.popitem(last=False)

    def _track(self, job: JobEntry, shard: ShardEntry) -> None:
        """Keep the per-cluster indexes current for one shard (after any change of its state or
        placement): placed, running (with a placement) and stopping shards under ``_on[state]
        [cluster]``; a running one also gets a view record, built at the next :meth:`view`.
        O(1); what the cycle reads instead of walking every job. Also keeps the quota usage
        totals (:meth:`_count_quota`)."""
        key = (job.job_id, shard.index)
        state = shard.state
        self._count_quota(job, shard, key)
        if state in self._on and shard.cluster and (state == ShardState.STOPPING or shard.placed is not None):
            where = (shard.cluster, state)
        else:
            where = None
        old = self._tracked.get(key)
        if where is not None and state == ShardState.PLACED:  # (its placement may have changed in place)
            self._unstarted_dirty.setdefault(shard.cluster, set()).add(key)
        if old == where:
            return
        if old is not None:
            cluster, was = old
            self._on[was].get(cluster, {}).pop(key, None)
            if was == ShardState.RUNNING:
                self._drop_work(cluster, key)
            elif was == ShardState.PLACED:
                self._unstarted_dirty.setdefault(cluster, set()).add(key)
            self._tracked.pop(key)
        if where is None:
            return
        cluster, now = where
        self._on[now].setdefault(cluster, {})[key] = (job, shard)
        if now == ShardState.RUNNING:
            self._work_dirty.setdefault(cluster, set()).add(key)
        self._tracked[key] = where

    def _count_quota(self, job: JobEntry, shard: ShardEntry, key: tuple[str, int]) -> None:
        """Keep :attr:`_quota_use` = the milli-GPUs (:func:`placement_milli`) of every placed or
        running shard with a placement, per (tenant, card model, region): what
        :meth:`TenancyGate.quota_book_of_totals` builds the cycle's quota book from. O(1)."""
        placed = shard.placed if shard.state in ACTIVE else None
        old = self._quota_of.get(key)
        if old is not None and old[4] is placed and old[2] == shard.region:
            return
        use = self._quota_use
        if old is not None:
            k = old[:3]
            left = use.get(k, 0) - old[3]
            if left:
                use[k] = left
            else:
                use.pop(k, None)
            del self._quota_of[key]
        if placed is not None and placed.card_model:  # CPU-only work holds no GPU quota
            milli = placement_milli(placed.bindings)
            if milli:
                new = (job.tenant, placed.card_model, shard.region, milli, placed)
                self._quota_of[key] = new
                use[new[:3]] = use.get(new[:3], 0) + milli

    def _drop_work(self, cluster: str, key: tuple[str, int]) -> None:
        """Forget a shard's view record on ``cluster`` (and its usage)."""
        self._work_dirty.get(cluster, set()).discard(key)
        w = self._works.get(cluster, {}).pop(key, None)
        if w is not None:
            self._ends[cluster].remove(w)
            self._count_preemptible(cluster, w, -1)
            self._running_tuple.pop(cluster, None)
        self._unhold(key)

    def _count_preemptible(self, cluster: str, w: RunningWork, n: int) -> None:
        """Add ``n`` (+1 / -1) records of ``w``'s priority to :attr:`_preemptible_prios` if it is
        preemptible. O(1)."""
        if not w.preemptible:
            return
        prios = self._preemptible_prios.setdefault(cluster, {})
        left = prios.get(w.priority, 0) + n
        if left:
            prios[w.priority] = left
        else:
            del prios[w.priority]

    def _unhold(self, key: tuple[str, int]) -> None:
        """Take a dropped view record's resources off its tenant's usage."""
        use = self._work_use.pop(key, None)
        if use is not None:
            h = self._held[use[0]]
            h[0], h[1], h[2] = h[0] - use[1], h[1] - use[2], h[2] - use[3]

    def _requeue(self, job: JobEntry, shard: ShardEntry, *, avoid: str = "") -> None:
        if avoid:
            shard.avoid.add(avoid)
        shard.pending_reason = ""
        self._set(job, shard, ShardState.DONE if job.cancel_requested else ShardState.QUEUED)
        if job.cancel_requested:
            shard.outcome = Outcome.CANCELLED

    # ------------------------------------------------------------------ state from events

    def _reject(self, consumer: str, d: Delivery, reason: str) -> None:
        """Refuse a message (it changes nothing); its dead letter and security record go out at
        the next cycle (:meth:`_publish_rejections`)."""
        log.warning("%s: refused %s on %s: %s", consumer, d.envelope.type, d.subject, reason)
        self.rejections.append(Rejection(consumer, d.subject, d.envelope, reason, d.stream_sequence,
                                         headers=tuple(sorted(d.headers.items()))))
        self.rejected += 1
        self._dirty.set()

    async def _publish_rejections(self) -> None:
        """Publish the dead letters and security records of refused messages (the message
        embedded up to :func:`~fedsched.trust.dead_letter_room` of the bus's ``max_payload``);
        kept when not acknowledged for now, dropped when the bus refuses one for good
        (``PublishResult.REFUSED``: it dead-letters that itself; retrying would fail forever and
        block checkpoints)."""
        pending, self.rejections = self.rejections, []
        room = dead_letter_room(getattr(self.publisher, "max_payload", None))
        items = [(subject, event, None) for r in pending
                 for subject, event in rejection_events(self.subjects, r, self.clock.time(), max_data=room)]
        if not items:
            return
        ok = await self.publisher.publish_many(items)
        self.rejections = [r for i, r in enumerate(pending) if any(map(retryable, ok[2 * i:2 * i + 2]))] + \
            self.rejections

    def _apply_event(self, d: Delivery) -> None:
        self.applied_seq = d.stream_sequence
        env = d.envelope
        if d.subject and (reason := check_subject(self.subjects.prefix, d.subject, env)) is not None:
            self._reject("scheduler-events", d, reason)
            return
        handler = EVENTS.route(env.type, self.skipped["scheduler-events"])
        if handler is not None:
            handler(self, env, d)
        if self.governor.apply(env):  # governance: approval requests and outcomes
            self._dirty.set()

    def _shard(self, env: Envelope, index: int) -> tuple[JobEntry, ShardEntry] | None:
        job = self.jobs.get(env.job_id)
        if job is None or not 0 <= index < len(job.shards):
            return None
        return job, job.shards[index]

    def _on_submitted(self, env: Envelope, d: Delivery) -> None:
        if env.job_id in self.jobs or env.job_id in self.tombstones:
            return
        sub = env.payload_as(JobSubmitted)
        job = JobEntry(env.job_id, env.tenant, env.project, sub.spec, env.occurred_at.timestamp(),
                       headers={k: v for k, v in d.headers.items() if k in ("traceparent", "tracestate")})
        job.shards = [ShardEntry(i) for i in range(sub.spec.shards)]
        self.jobs[env.job_id] = job
        for shard in job.shards:
            self.counts[ShardState.QUEUED] += 1
            self.queued[(job.job_id, shard.index)] = (job, shard)
        self._dirty.set()

    def _on_cancel(self, env: Envelope, d: Delivery) -> None:
        job = self.jobs.get(env.job_id)
        if job is None or job.done:
            return
        job.cancel_requested = True
        self.cancelling[job.job_id] = job
        self._dirty.set()

    def _on_held(self, env: Envelope, d: Delivery) -> None:
        """``job.held``: every queued shard leaves the queue, if no shard is placed, running or
        stopping and the job is not awaiting approval (else the hold came too late and has no
        effect)."""
        job = self.jobs.get(env.job_id)
        if job is None or job.done or job.cancel_requested:
            return
        if any(s.state not in (ShardState.QUEUED, ShardState.DONE) for s in job.shards):
            return
        approvals = self.governor.state.get(job.job_id)
        if approvals is not None and approvals.pending is not None:
            return  # awaiting approval (admission's view refuses to hold it too)
        for shard in job.shards:
            if shard.state == ShardState.QUEUED:
                shard.pending_reason = ""
                self._set(job, shard, ShardState.HELD)

    def _on_released(self, env: Envelope, d: Delivery) -> None:
        """``job.released``: held shards wait again (the job keeps its submit time)."""
        job = self.jobs.get(env.job_id)
        if job is None:
            return
        for shard in job.shards:
            if shard.state == ShardState.HELD:
                self._set(job, shard, ShardState.QUEUED)

    def _on_priority_changed(self, env: Envelope, d: Delivery) -> None:
        """``job.priority_changed``: a job not placed anywhere takes the new class (next cycle)."""
        job = self.jobs.get(env.job_id)
        if job is None or job.done or any(s.state in (*ACTIVE, ShardState.STOPPING) for s in job.shards):
            return
        change = env.payload_as(JobPriorityChanged)
        if job.spec.priority != change.priority:
            job.spec = job.spec.model_copy(update={"priority": change.priority})
            job.mode_cache = None  # a job class may match on it
            for shard in job.shards:  # its place in the queue's order index moves with its class
                if (job.job_id, shard.index) in self.queued:
                    self.queued[(job.job_id, shard.index)] = (job, shard)
            self._dirty.set()

    def _on_cancelled(self, env: Envelope, d: Delivery) -> None:
        """Our own ``job.cancelled``, read back after a restart: the job has ended (asked for, or
        :meth:`_expire_unschedulable`); its waiting shards must not be placed again."""
        job = self.jobs.get(env.job_id)
        if job is None or job.done:
            return
        job.cancel_requested = job.cancelled_sent = True
        self.cancelling[job.job_id] = job
        self._dirty.set()

    def _on_placed(self, env: Envelope, d: Delivery) -> None:
        raw = env.payload
        index, token = raw.get("shard", 0), raw.get("fencing_token", 0)
        if type(index) is int and type(token) is int and token == self.highest_token:
            # our own write-through read back (the common case, one per placement): the shard
            # already holds this attempt, so the payload (spec, bindings, evaluations) is not
            # parsed again -- the rule is the one below, decided on the two fields it reads
            found = self._shard(env, index)
            if found is not None and env.attempt == found[1].attempt and found[1].attempt_placed is not None:
                self._fence(env, token)
                return
        placed = env.payload_as(JobPlaced)
        found = self._shard(env, placed.shard)
        if found is None:
            return
        job, shard = found
        if not self._fence(env, placed.fencing_token):
            return  # a former lease holder's late placement
        if env.attempt <= shard.attempt:
            return  # our own write-through, or a stale duplicate
        self._bind(job, shard, env.attempt, env.cluster, env.region, placed, self._produced_at(d))

    def _on_stop_order(self, env: Envelope, d: Delivery) -> None:
        """Our own stop order, read back after a restart: the shard gave up its resources.

        A preempted attempt waits for its agent's ``job.stopped`` (stopping); a reclaimed one or
        one on a lost cluster was requeued when the order was published, so it is requeued here
        too (a reclaimed one avoiding the cluster that never started it).
        """
        stop = env.payload_as(JobStop)
        found = self._shard(env, stop.shard)
        if found is None:
            return
        job, shard = found
        if not self._fence(env, stop.fencing_token):
            return  # a former lease holder's late stop order
        if env.attempt != shard.attempt or shard.state not in ACTIVE:
            return
        if stop.reason == StopReason.PREEMPTED:
            self._unbind(shard)
            self._set(job, shard, ShardState.STOPPING)
        elif stop.reason == StopReason.RECLAIMED:
            self._unbind(shard)
            self._requeue(job, shard, avoid=env.cluster)
        elif stop.reason == StopReason.CLUSTER_LOST:
            self._unbind(shard)
            at = env.occurred_at.timestamp()
            self._after_loss(job, shard, at, _resume_point(shard, at, stop.checkpoint_interval_s))

    # Status folds: a status of the shard's current attempt (see _attempt_status); the ending
    # ones run after the attempt's resources were given back (_unbind).

    def _on_started(self, job: JobEntry, shard: ShardEntry, env: Envelope, status: JobStatus) -> None:
        if shard.state == ShardState.PLACED:
            shard.started_at = env.occurred_at.timestamp()
            self._set(job, shard, ShardState.RUNNING)

    def _on_finished(self, job: JobEntry, shard: ShardEntry, env: Envelope, status: JobStatus) -> None:
        shard.outcome = Outcome.SUCCEEDED
        self._set(job, shard, ShardState.DONE)

    def _on_failed(self, job: JobEntry, shard: ShardEntry, env: Envelope, status: JobStatus) -> None:
        """Retried elsewhere (avoiding this cluster) while the job has retries left and is not
        being cancelled; else the shard ends failed."""
        shard.failures += 1
        if shard.failures <= job.spec.retry_limit and not job.cancel_requested:
            at = env.occurred_at.timestamp()
            if self._take_retry(job.tenant, at):
                self._requeue(job, shard, avoid=env.cluster)
            else:
                self._end_for_retries(job, shard, self._month_cap_reason(job.tenant, at, env.attempt, "failed"))
        else:
            shard.outcome = Outcome.FAILED
            self._set(job, shard, ShardState.DONE)

    # -- retry accounting (the tenant's retry budget: fedsched.tenancy.RetryBudgetDoc)

    def _retry_budget(self, tenant: str) -> RetryBudgetDoc:
        gov = self.policy_holder.current
        return gov.retry_budget(tenant) if gov is not None else DEFAULT_RETRY_BUDGET

    def _take_retry(self, tenant: str, at: float) -> bool:
        """Count one retry of ``tenant``'s work against its month (UTC month of business time
        ``at``); False (and nothing counted) when ``retries.per_month`` is used up."""
        key = (tenant, to_datetime(at).strftime("%Y-%m"))
        cap = self._retry_budget(tenant).per_month
        used = self.retries_used.get(key, 0)
        if cap is not None and used >= cap:
            return False
        self.retries_used[key] = used + 1
        return True

    def _month_cap_reason(self, tenant: str, at: float, attempt: int, how: str) -> str:
        month = to_datetime(at).strftime("%Y-%m")
        return (f"retries_exhausted: attempt {attempt} {how}; tenant {tenant} has used its "
                f"{self._retry_budget(tenant).per_month} retries for {month}")

    def _end_for_retries(self, job: JobEntry, shard: ShardEntry, reason: str) -> None:
        """End the job because its retry budget is spent: like a cancellation the scheduler makes
        (``job.cancelled`` with ``reason``; other shards still running are stopped)."""
        if not job.cancel_requested:
            job.cancel_requested = True
            job.end_reason = reason
            self.cancelling[job.job_id] = job
            log.warning("scheduler: ending %s: %s", job.job_id, reason)
        self._requeue(job, shard)  # done (cancelled) since the job is being ended

    def _after_loss(self, job: JobEntry, shard: ShardEntry, at: float, progress_s: float) -> None:
        """A shard's attempt was lost with its cluster at business time ``at`` (its resources
        already given back): retry it elsewhere, resuming from ``progress_s`` (its last
        checkpoint; 0 for a job that is not checkpointable), unless the job is being cancelled
        or the tenant's retry budget is spent -- more than ``retries.max_infra_retries`` losses
        of this shard, or ``retries.per_month`` used up -- in which case the job ends
        (``retries_exhausted``). A loss does not count against ``spec.retry_limit`` (the job
        did not fail; :class:`~fedsched.tenancy.RetryBudgetDoc`). The same on the live path
        (:meth:`_reclaim`) and on a rebuild (:meth:`_on_stop_order`)."""
        shard.progress_s = max(shard.progress_s, progress_s)
        shard.losses += 1
        limit = self._retry_budget(job.tenant).max_infra_retries
        if job.cancel_requested:
            self._requeue(job, shard)
        elif shard.losses > limit:
            self._end_for_retries(job, shard, f"retries_exhausted: attempt {shard.attempt} lost with cluster "
                                              f"{shard.cluster}; {shard.losses} infrastructure losses, tenant "
                                              f"{job.tenant} allows {limit} per shard")
        elif not self._take_retry(job.tenant, at):
            self._end_for_retries(job, shard, self._month_cap_reason(job.tenant, at, shard.attempt,
                                                                     f"lost with cluster {shard.cluster}"))
        else:
            self._requeue(job, shard)

    def _on_rejected(self, job: JobEntry, shard: ShardEntry, env: Envelope, status: JobStatus) -> None:
        self._requeue(job, shard)

    def _on_stopped(self, job: JobEntry, shard: ShardEntry, env: Envelope, status: JobStatus) -> None:
        """Cancelled: the shard ends. Otherwise (preempted, reclaimed, cluster lost) it is
        requeued, resuming from the progress the agent reported."""
        if status.reason == StopReason.CANCELLED or job.cancel_requested:
            shard.outcome = Outcome.CANCELLED
            self._set(job, shard, ShardState.DONE)
        else:
            shard.progress_s = max(shard.progress_s, status.progress_s)
            self._requeue(job, shard)

    def _bind(self, job: JobEntry, shard: ShardEntry, attempt: int, cluster: str, region: str,
              placed: JobPlaced, placed_wall: float) -> None:
        self._unbind(shard)
        shard.attempt = attempt
        shard.cluster, shard.region = cluster, region
        shard.placed = shard.attempt_placed = placed
        shard.placed_wall = placed_wall
        shard.started_at = None
        shard.stop_sent = False
        info = self.clusters.get(cluster)
        if info is not None:
            _allocate(info, placed, +1)
        self._due_seq += 1
        heapq.heappush(self._unstarted_due, (placed_wall, self._due_seq, (job.job_id, shard.index), attempt))
        self._set(job, shard, ShardState.PLACED)

    def _unbind(self, shard: ShardEntry) -> None:
        if shard.placed is None:
            return
        info = self.clusters.get(shard.cluster)
        if info is not None:
            _allocate(info, shard.placed, -1)
        shard.placed = None  # (every caller then moves the shard with _set, which re-indexes it)

    def _produced_at(self, d: Delivery) -> float:
        """Liveness-clock seconds at which a delivery was produced: its JetStream time, else now
        (a delivery without metadata has just been produced)."""
        return d.published_at if d.published_at is not None else self.liveness.time()

    def _apply_inventory(self, d: Delivery) -> None:
        """Fold a heartbeat or snapshot; a cluster is as fresh as its newest message's
        production time (so reading an old heartbeat after a restart does not revive it)."""
        env = d.envelope
        if d.subject and (reason := check_subject(self.subjects.prefix, d.subject, env)) is not None:
            self._reject("scheduler-inventory", d, reason)
            return
        info = self.clusters.get(env.cluster)
        at = self._produced_at(d)
        handler = INVENTORY.route(env.type, self.skipped["scheduler-inventory"])
        if handler is None:
            return
        if handler == "heartbeat":
            if info is None:  # heard before its first inventory (stream order of two subjects)
                self._heard[env.cluster] = max(at, self._heard.get(env.cluster, at))
            else:
                if at >= info.seen_at:  # the newest heartbeat says how far the agent has read
                    info.orders_backlog = env.payload_as(Heartbeat).orders_backlog
                info.seen_at = max(info.seen_at, at)
                self._revive(info)
            return
        snap = env.payload_as(InventorySnapshot)
        if info is None:
            info = self.clusters[env.cluster] = ClusterInfo(env.cluster, env.region, env.zone, snap,
                                                            max(at, self._heard.pop(env.cluster, at)))
            for _, shard in self.active.values():  # placements made before this inventory arrived
                if shard.placed is not None and shard.cluster == env.cluster:
                    _allocate(info, shard.placed, +1)
            self._dirty.set()
        else:
            key = _capacity_key(snap)
            if info.capacity_key is None:
                info.capacity_key = _capacity_key(info.snapshot)
            changed = info.capacity_key != key
            info.snapshot, info.seen_at, info.capacity_key = snap, max(info.seen_at, at), key
            if changed:
                info.cached = None
                info.index = None  # nodes or health changed: rebuild everything
                self._dirty.set()
        self._revive(info)

    def _revive(self, info: ClusterInfo) -> None:
        """A stale cluster heard from again within the limit is schedulable again."""
        if info.name in self._stale and self.liveness.time() - info.seen_at <= self.stale_after_s:
            self._stale.discard(info.name)
            info.cached = None
            self._dirty.set()

    def start_grace(self) -> None:
        """Begin this tenure's start-up grace at liveness time now: a cluster is judged stale
        only once silent for ``stale_after_s`` after both its newest heartbeat (or inventory) and
        this moment, and an unstarted placement is reclaimed only ``reclaim_after_s`` after both
        its placement and this moment. :meth:`run` calls it once the book is rebuilt and
        :meth:`catch_up` when a replica takes the lease.

        Why: a scheduler down longer than ``stale_after_s`` (a restart of the whole system, a
        kill -9 and start 6.6 s later) found every cluster's newest heartbeat too old before any
        agent could speak to it and stopped all running attempts as ``cluster_lost`` (652 in a
        tryout, 13.37 CNY of lost work billed). Silence it has not had the chance to hear is
        not evidence; the rule is Kubernetes' node lifecycle controller's, which gives every node
        a grace period after the controller starts before marking it not ready."""
        self._grace_from = self.liveness.time()

    def _silent_since(self, info: ClusterInfo) -> float:
        """Liveness time a cluster's silence is counted from: its newest heartbeat or
        inventory, or this tenure's start (:meth:`start_grace`) when that is later."""
        return max(info.seen_at, self._grace_from)

    def _judge_staleness(self, now: float) -> None:
        """Mark clusters silent for more than ``stale_after_s`` at liveness time ``now`` stale
        (and fresh ones not); run at the start of every cycle. Silence counts from
        :meth:`_silent_since` (the start-up grace), so a restart does not lose running work."""
        for info in self.clusters.values():
            age = now - self._silent_since(info)
            if age > self.stale_after_s:
                if info.name not in self._stale:
                    self._stale.add(info.name)
                    log.warning("scheduler: cluster %s is stale (%.1fs since its last heartbeat)", info.name,
                                now - info.seen_at)
            elif info.name in self._stale:
                self._stale.discard(info.name)
                info.cached = None

    # ------------------------------------------------------------------ the cycle

    def view(self, live_now: float | None = None) -> View:
        """The current resource view (immutable); heartbeat ages on the liveness clock, at
        ``live_now`` when given (a cycle passes the time it judges silence at,
        :meth:`_live_now`: a scheduler whose followers lag must not find every cluster's
        newest heartbeat read "too old" and leave the queue pending as ``inventory_stale``;
        found by bench/e2e_throughput.py under CPU contention), else now.

        Incremental: a cluster's node states and capacity classes are rebuilt only for nodes
        whose allocation changed, the records of started work only for shards that started,
        moved or ended since the last view (all of a cluster's when its nodes changed), the
        entries of placed, not started shards likewise (each is expected to start at the view's
        ``now``, which :class:`RunningSet` adds when read, so an entry does not age), and the
        tenants' usage of both is kept as it changes. Cost: O(clusters + changes), not O(jobs)
        nor O(placed-not-started), plus a copy of each changed cluster's records into the tuples
        handed over; shards visited are counted in ``last_cycle_visit_counts["view"]``.
        """
        now_live = self.liveness.time() if live_now is None else live_now
        now = self.clock.time()
        visits = 0
        for info in self.clusters.values():  # node positions must be current before bindings map to them
            if info.cached is None:
                info.cached = _cluster_state(info, self.prices)
            if self._positions.get(info.name) is not info.position:  # nodes changed: every record of it
                self._positions[info.name] = info.position
                self._work_dirty.setdefault(info.name, set()).update(self._on[ShardState.RUNNING].get(info.name, ()))
                # (an entry of a shard that left PLACED is dirty already: _track marked it)
                self._unstarted_dirty.setdefault(info.name, set()).update(self._on[ShardState.PLACED].get(info.name, ()))
        for name, keys in self._work_dirty.items():
            info = self.clusters.get(name)
            if info is None or not keys:
                continue  # rebuilt once its inventory arrives
            works = self._works.setdefault(name, {})
            ends = self._ends.setdefault(name, EndOrder())
            active = self._on[ShardState.RUNNING].get(name, {})
            for key in keys:
                visits += 1
                old = works.pop(key, None)
                if old is not None:
                    ends.remove(old)
                    self._count_preemptible(name, old, -1)
                self._unhold(key)
                entry = active.get(key)
                if entry is None:
                    continue
                job, shard = entry
                work = self._running_work(job, shard, shard.placed, info, now)
                if work is None:
                    continue  # bound to a node the inventory no longer has: neither held nor shown
                spec = job.spec
                use = (job.tenant, spec.total_gpu_milli, spec.cpu_milli * spec.workers, spec.memory_mib * spec.workers)
                works[key] = work
                ends.add(work)
                self._count_preemptible(name, work, 1)
                self._work_use[key] = use
                h = self._held.setdefault(job.tenant, [0, 0, 0])
                h[0], h[1], h[2] = h[0] + use[1], h[1] + use[2], h[2] + use[3]
            keys.clear()
            self._running_tuple.pop(name, None)
        for name, keys in self._unstarted_dirty.items():
            info = self.clusters.get(name)
            if info is None or not keys:
                continue  # built once its inventory arrives
            visits += self._rebuild_unstarted(info, keys)
            keys.clear()
        held = {tenant: list(h) for tenant, h in self._held.items() if any(h)}
        for tenant, h in self._held_unstarted.items():
            if any(h):
                t = held.get(tenant)
                if t is None:
                    held[tenant] = list(h)
                else:
                    t[0], t[1], t[2] = t[0] + h[0], t[1] + h[1], t[2] + h[2]
        clusters = []
        for info in sorted(self.clusters.values(), key=lambda c: c.name):
            age = max(0.0, now_live - info.seen_at)
            if info.cached is None:
                info.cached = _cluster_state(info, self.prices)
            kept = self._running_tuple.get(info.name)
            if kept is None:
                started = tuple(self._works.get(info.name, {}).values())
                low = min(self._preemptible_prios.get(info.name) or (None,))  # a few priorities, not the records
                kept = self._running_tuple[info.name] = (started, low)
            unstarted = self._unstarted_order.get(info.name, ())
            # (the kept orders are read by the core during this cycle, before anything awaits)
            running = RunningSet(kept[0], unstarted, now, kept[1], ends=self._ends.setdefault(info.name, EndOrder()),
                                 pending_sorted=True,
                                 pending_lowest=min(self._unstarted_prios.get(info.name) or (None,)))
            clusters.append(replace(info.cached, heartbeat_age_s=age, running=running))
        self._visit("view", visits)
        usage = {tenant: Usage(*h) for tenant, h in held.items()}
        return View(tuple(clusters), now, self.stale_after_s, usage)

    def _rebuild_unstarted(self, info: ClusterInfo, keys: Iterable[tuple[str, int]]) -> int:
        """(Re)build the pending entries of the placed, not started shards ``keys`` of the
        cluster ``info`` (dropping those no longer placed there) and the tenants' usage they hold.
        O(len(keys)); returns how many were visited."""
        name = info.name
        entries = self._unstarted.setdefault(name, {})
        order = self._unstarted_order.get(name)
        if order is None:
            order = self._unstarted_order[name] = SortedKeyList(key=pending_end_key)
        prios = self._unstarted_prios.setdefault(name, {})
        placed = self._on[ShardState.PLACED].get(name, {})
        held = self._held_unstarted
        n = 0
        for key in keys:
            n += 1
            old = entries.pop(key, None)
            if old is not None:
                entry, use = old[0], old[2]
                order.remove(entry)
                if entry[5]:
                    left = prios[entry[4]] - 1
                    if left:
                        prios[entry[4]] = left
                    else:
                        del prios[entry[4]]
                h = held[old[1]]
                h[0], h[1], h[2] = h[0] - use[0], h[1] - use[1], h[2] - use[2]
            got = placed.get(key)
            pending = None if got is None else self._pending_entry(got[0], got[1], got[1].placed, info)
            if pending is None:
                continue  # not placed here any more, or bound to a node the inventory no longer has
            entry, use = pending
            tenant = got[0].tenant
            entries[key] = (entry, tenant, use)
            order.add(entry)
            if entry[5]:
                prios[entry[4]] = prios.get(entry[4], 0) + 1
            h = held.setdefault(tenant, [0, 0, 0])
            h[0], h[1], h[2] = h[0] + use[0], h[1] + use[1], h[2] + use[2]
        return n

    def _visit(self, kind: str, n: int) -> None:
        """Count ``n`` shard records visited by the running cycle under ``kind``."""
        self.last_cycle_visit_counts[kind] = self.last_cycle_visit_counts.get(kind, 0) + n
        self.last_cycle_visits += n

    @staticmethod
    def _running_work(job: "JobEntry", shard: ShardEntry, p: JobPlaced, info: ClusterInfo,
                      now: float) -> RunningWork | None:
        """The view's record of a placed/running shard (None if a node it is bound to is gone).

        Kept on the shard while nothing it depends on changes (attempt, start, placement,
        progress, the cluster's node positions), so a cycle does not rebuild every running job;
        a shard not started yet is expected to start ``now``, so its record is rebuilt each time
        (from its bindings and whether their nodes exist, both kept: O(1) per unstarted shard).
        """
        key = (shard.attempt, shard.started_at, shard.progress_s)
        # (key, placement, positions, work or the bindings of an unstarted one): the objects
        # themselves, compared by identity
        cached = shard.view_cache
        hit = (cached is not None and len(cached) == 4 and cached[0] == key and cached[1] is p
               and cached[2] is info.position)  # (5 long: a pending entry of _pending_entry)
        if hit and shard.started_at is not None:
            return cached[3]
        spec = job.spec
        est = spec.estimated_duration_s
        left = max(0.0, est - shard.progress_s) if est is not None else math.inf
        start = shard.started_at if shard.started_at is not None else now
        if hit:  # not started: only its expected end moves with ``now``; the bindings are kept
            bindings, bound = cached[3]
        else:
            bindings = tuple((info.position.get(b.node, -1), tuple(b.gpu_indices), b.gpu_milli, b.cpu_milli,
                              b.memory_mib) for b in p.bindings)
            bound = all(b[0] >= 0 for b in bindings)  # every node it is bound to still exists
        work = None if not bound else RunningWork(
            job.job_id, shard.attempt, shard.index, job.tenant, spec.priority_value, spec.preemptible,
            spec.checkpointable, shard.started_at, start + left, p.card_model, bindings)
        if shard.started_at is not None:
            shard.view_cache = (key, p, info.position, work)
        elif not hit:
            shard.view_cache = (key, p, info.position, (bindings, bound))
        return work

    @staticmethod
    def _pending_entry(job: "JobEntry", shard: ShardEntry, p: JobPlaced,
                       info: ClusterInfo) -> tuple[tuple, tuple[int, int, int]] | None:
        """A placed, not started shard as a :class:`RunningSet` pending entry, with the
        (milli-GPU, milli-CPU, MiB) it holds; None if a node it is bound to is gone.

        The entry does not depend on ``now`` (the :class:`RunningSet` adds the view's ``now`` to
        its work left when the core reads it), so it is kept on the shard while its attempt,
        progress, placement and the cluster's node positions are unchanged: O(1) per cycle.
        """
        key = (shard.attempt, shard.started_at, shard.progress_s)
        cached = shard.view_cache
        if cached is not None and cached[0] == key and cached[1] is p and cached[2] is info.position \
                and len(cached) == 5:
            return cached[4]
        spec = job.spec
        est = spec.estimated_duration_s
        left = max(0.0, est - shard.progress_s) if est is not None else math.inf
        if left < MIN_LEFT_S:
            left = 0.0  # (so the kept end order is exact: pending_end_key)
        bindings = tuple((info.position.get(b.node, -1), tuple(b.gpu_indices), b.gpu_milli, b.cpu_milli,
                          b.memory_mib) for b in p.bindings)
        out = None
        if all(b[0] >= 0 for b in bindings):  # every node it is bound to still exists
            out = ((job.job_id, shard.attempt, shard.index, job.tenant, spec.priority_value, spec.preemptible,
                    spec.checkpointable, left, p.card_model, bindings),
                   (spec.total_gpu_milli, spec.cpu_milli * spec.workers, spec.memory_mib * spec.workers))
        shard.view_cache = (key, p, info.position, None, out)
        return out

    def queue(self) -> list[QueuedJob]:
        """Shards waiting for a placement (cross-region mode from the governance policy in force,
        else the ``cross_region_mode`` given at construction). O(queued shards)."""
        gov = self.policy_holder.current
        return [self._queued_job(job, shard, gov) for job, shard in self.queued.values() if not job.cancel_requested]

    def queue_window(self, now: float) -> list[QueuedJob]:
        """What one cycle decides: :meth:`window` of :meth:`queue` at business time ``now``, cut
        from the queue's order index (:meth:`QueuedBook.window`) in O(groups x aging steps x
        log n + window) instead of O(queue) -- the same shards (``tests/unit/scheduler/
        test_cycle_window.py`` compares the two); only the window's records are built."""
        gov = self.policy_holder.current
        return [self._queued_job(job, shard, gov) for job, shard in
                self.queued.window(self.max_jobs_per_cycle, now, self.policy, skip=_cancel_requested)]

    def _queued_job(self, job: JobEntry, shard: ShardEntry, gov) -> QueuedJob:
        """The queue's record of one shard, kept on the shard while it is unchanged; the job's
        cross-region mode kept on the job per governance policy in force ``gov``."""
        cached = job.mode_cache
        if cached is not None and cached[0] is gov:
            m = cached[1]
        else:
            m = gov.mode_for(job.spec)[0] if gov is not None else self.cross_region_mode.get(job.tenant, "allowed")
            job.mode_cache = (gov, m)
        c = shard.queue_cache
        if (c is not None and c[0] is job.spec and c[1] == job.submitted_at and c[2] == shard.attempt
                and c[3] == shard.progress_s and c[4] == m and c[5] == len(shard.avoid)):  # avoid only grows
            return c[6]
        qj = QueuedJob(job.job_id, shard.attempt + 1, job.spec, job.submitted_at, frozenset(shard.avoid),
                       shard.index, m, shard.progress_s)
        shard.queue_cache = (job.spec, job.submitted_at, shard.attempt, shard.progress_s, m, len(shard.avoid), qj)
        return qj

    def window(self, queue: list[QueuedJob], now: float) -> list[QueuedJob]:
        """The part of ``queue`` one cycle decides: all of it up to :attr:`max_jobs_per_cycle`
        shards, else the head of the order ``decide`` considers jobs in
        (:class:`~services.scheduler.core.queues.FairOrder`: effective priority, then DRF among
        tenants, each tenant's jobs oldest first): whole priority levels from the highest, each
        tenant of a level given an equal part of the room left (its oldest shards, at least one).
        The jobs the cycle does consider are then ordered exactly as in the full queue; the
        others are decided in the next cycles. After a windowed cycle that placed nothing the
        next cycle decides the whole queue (a blocked head must not keep the jobs behind it from
        being placed or backfilled). Cost O(queue) (plus sorting each tenant's part): the rule's
        reference; a cycle cuts the same window from the order index (:meth:`queue_window`).
        """
        cap = self.max_jobs_per_cycle
        if len(queue) <= cap:
            return queue
        levels: dict[int, dict[str, list[QueuedJob]]] = {}
        for qj in queue:
            levels.setdefault(effective_priority(qj, now, self.policy), {}).setdefault(qj.spec.tenant, []).append(qj)
        out: list[QueuedJob] = []
        for level in sorted(levels, reverse=True):
            room = cap - len(out)
            if room <= 0:
                break
            tenants = levels[level]
            part = max(1, room // len(tenants))
            for jobs in tenants.values():
                out.extend(jobs if len(jobs) <= part else
                           heapq.nsmallest(part, jobs, key=lambda j: (j.submitted_at, j.key)))
        return out

    async def cycle(self) -> None:
        """One scheduling cycle (see the module docstring); nothing while not :attr:`leading`."""
        if not self.leading:
            return
        t0 = time.perf_counter()  # cycle duration (a metric, not a rule)
        self.last_cycle_visit_counts, self.last_cycle_visits = {}, 0
        self.policy = self.governor.effective_policy(self.base_policy)  # governance: weights, quota filter
        now_live = self.liveness.time()
        if self.rejections:  # refused messages: dead letters and security records
            await self._publish_rejections()
        judged_at = self._live_now(now_live)  # what the followers have read, not the wall, when they lag
        self._judge_staleness(judged_at)                                             # 1
        await self._reclaim(judged_at)
        self._expire_unschedulable(self.clock.time())
        await self._cancellations()
        expired = self.governor.expiries(self.jobs, self.clock.time())  # governance: approval timeouts
        self._visit("approvals", self.governor.last_expiry_visits)
        if expired:
            await self.publisher.publish_many(expired)
        # the queue: the window (cut from the order index), or the whole of it after a window
        # that placed nothing; the gauges from the index's groups (O(groups))
        full = len(self.queued)
        queue = self.queue() if self._window_blocked else self.queue_window(self.clock.time())
        self.metrics.observe_queues(self.queued.stats(self.clock.time(), self.policy.fast_lane_s))
        self._visit("queue", len(queue))
        if not queue or not self.clusters:
            return
        windowed = len(queue) < full
        view = self.view(judged_at)                                                  # 2
        if self.policy_holder.current is not None and self.policy_holder.current.quota_rules:
            self._visit("quota", len(self._quota_use))  # running totals: one per (tenant, model, region)
        view = replace(view, quota=self.governor.quota_book_of_totals(self._quota_use))  # governance: quota usage
        queue = self.governor.narrow(queue, view)  # governance: awaiting approval, home-only, quota room
        with tracer.start_as_current_span("scheduler.cycle", attributes={"queue": len(queue)}):
            decisions = decide(view, queue, self.policy)                             # 3
        decisions, requests = self.governor.gate(decisions, self.jobs, view, self.clock.time())  # governance
        # a window that placed nothing (its head is blocked): the next cycle decides the whole
        # queue, so jobs behind the window can still be placed or backfilled
        self._window_blocked = windowed and not decisions.placements
        if windowed:  # shards were left waiting: decide them in the next cycle
            self._dirty.set()
        stops, places, pendings, pending_codes = [], [], [], []
        self._counterfactuals = self._placement_counterfactuals = 0
        self._evaluations = {}  # this cycle's evaluation records (see _evaluation)
        self._home_starts: dict = {}  # home start estimates on this cycle's view (placement counterfactuals)
        for p in decisions.placements:                                               # 4
            for victim in p.victims:
                stops.append((victim, p))
            places.append(self._placement_event(view, p, decisions.policy_version))
        now = self.clock.time()
        for pend in decisions.pending:
            job, shard = self.jobs[pend.job.job_id], self.jobs[pend.job.job_id].shards[pend.job.shard]
            shard.unplaceable = not pend.fits_empty
            if not shard.unplaceable:
                shard.unplaceable_since = None
                self._unplaceable.pop((job.job_id, shard.index), None)
            elif shard.unplaceable_since is None:
                shard.unplaceable_since = now
                self._unplaceable[(job.job_id, shard.index)] = (job, shard)
            if pend.reason != shard.pending_reason:
                pendings.append((shard, pend.reason, self._pending_event(view, pend, decisions.policy_version)))
                pending_codes.append(pending_reason_code(e.verdict for e in pend.evaluations))
        self._evaluations.clear()  # (the records are in the events: nothing of this cycle kept alive)
        stop_items = [(v, item) for v, p in stops
                      if (item := self._stop_event(self.jobs[v.job_id], self.jobs[v.job_id].shards[v.shard],
                                                   StopReason.PREEMPTED, for_job=p.job.job_id)) is not None]
        results = await self.publisher.publish_many([item for _, item in stop_items] +
                                              [(s, e, h) for _, s, e, h, _ in places] +
                                              [(s, e, h) for _, _, (s, e, h) in pendings] + requests)
        if requests:  # governance: the jobs whose approval request was acknowledged now wait
            self.governor.confirm(requests, results[len(results) - len(requests):])
        rest = results[len(stop_items):]                                             # 5
        for (victim, _), ok in zip(stop_items, results):
            job = self.jobs.get(victim.job_id)  # (it may have ended, and left, during the publish)
            if job is None:
                continue
            shard = job.shards[victim.shard]
            if ok and shard.attempt == victim.attempt and shard.state in ACTIVE:
                shard.stop_sent = True
                self._unbind(shard)
                self._set(job, shard, ShardState.STOPPING)
        for (p, subject, env, _, payload), ok in zip(places, rest[:len(places)]):
            job = self.jobs.get(p.job.job_id)
            if ok and job is not None:
                self._bind(job, job.shards[p.job.shard], p.job.attempt, p.cluster, p.region, payload, now_live)
                self.metrics.placed(p.region, p.cluster)
            elif ok is PublishResult.REFUSED:
                self._placement_refused(self.jobs[p.job.job_id], p.job.shard, subject, env)
        for (shard, reason, _), code, ok in zip(pendings, pending_codes, rest[len(places):]):
            if ok or ok is PublishResult.REFUSED:  # refused: dead-lettered by the bus, never sendable
                shard.pending_reason = reason
                self.metrics.pending(code)
        self.cycles += 1
        self.last_cycle_ms = (time.perf_counter() - t0) * 1000
        self.metrics.observe_cycle(self.last_cycle_ms / 1000, placed=len(decisions.placements),
                                   pending=len(decisions.pending))

    # ------------------------------------------------------------------ reclamation, cancellation

    async def _reclaim(self, now_live: float) -> None:
        """Move placements off stale clusters and take back placements never started in time.

        * On a stale cluster (see :meth:`_judge_staleness`) every attempt -- placed, running, or
          stopping after a preemption -- is declared lost: a ``job.stop`` (reason
          ``cluster_lost``) fences it on the agent should the cluster come back, and a
          ``job.stopped`` on the cluster's status subject ends the attempt at the business time
          it was declared lost (billing bills a started attempt up to then). Its event id is the
          one the agent would give its own end of that attempt, so whichever is stored first is
          the only one. The shard is retried elsewhere (:meth:`_after_loss`: within the
          tenant's retry budget; the stale cluster is excluded by the filters until it is heard
          from again): a checkpointable job resumes from its last checkpoint (the next
          placement's ``resume_from_s``; the checkpoint location travels in the job's spec),
          others restart from the work they had when the lost attempt began.
        * A placement not started within ``reclaim_after_s`` of ``placed_wall`` is reclaimed
          (``job.stop``, reason ``reclaimed``) and requeued avoiding that cluster -- unless the
          cluster's agent, alive, said at its newest heartbeat that it has orders still to read
          (``orders_backlog`` > 0): it is behind, not refusing, and taking its placements back
          would only place the work twice (an overloaded embedded system did: 40,648 placements
          for 20,000 jobs). Such a placement waits for the agent up to
          :data:`RECLAIM_BACKLOG_LIMIT` times ``reclaim_after_s``, then is reclaimed anyway.

        Local state changes only for what was acknowledged.
        """
        lost: list[tuple[JobEntry, ShardEntry, list, float]] = []
        reclaimed: list[tuple[JobEntry, ShardEntry, tuple]] = []
        at = self.clock.time()
        visits = 0
        # Only what can be due is looked at: the shards on stale clusters (per-cluster indexes)
        # and the placements whose reclamation time has come (a heap by placement time).
        for name in sorted(self._stale):
            on_cluster = [e for state in (ShardState.PLACED, ShardState.RUNNING, ShardState.STOPPING)
                          for e in self._on[state].get(name, {}).values()]
            for job, shard in on_cluster:
                visits += 1
                items = []
                progress = shard.progress_s
                if shard.state != ShardState.STOPPING:
                    stop = self._stop_event(job, shard, StopReason.CLUSTER_LOST, at=at,
                                            detail=f"cluster {shard.cluster} silent past {self.stale_after_s:g} s")
                    if stop is None:
                        continue
                    items.append(stop)
                    progress = _resume_point(shard, at, stop[1].payload_as(JobStop).checkpoint_interval_s)
                items.append(self._lost_event(job, shard, at, progress))
                lost.append((job, shard, items, progress))
        keep: list[tuple] = []  # due entries not reclaimed now (on a stale cluster, or the publish failed)
        waiting = 0  # of which left for their cluster (stale, or its agent still reading its orders)
        while (now_live >= self._reclaim_recheck and (first := self._first_unstarted()) is not None
               and now_live - max(first[0], self._grace_from) > self.reclaim_after_s):
            entry = heapq.heappop(self._unstarted_due)
            visits += 1
            job, shard = self._unstarted_entry(entry)
            if shard.cluster in self._stale:
                keep.append(entry)
                waiting += 1
                continue
            info = self.clusters.get(shard.cluster)
            if (info is not None and info.orders_backlog > 0
                    and now_live - entry[0] <= self.reclaim_after_s * RECLAIM_BACKLOG_LIMIT):
                keep.append(entry)  # its agent has orders still to read: behind, not refusing
                waiting += 1
                continue
            item = self._stop_event(job, shard, StopReason.RECLAIMED,
                                    detail=f"not started within {self.reclaim_after_s:g} s")
            if item is not None:
                reclaimed.append((job, shard, item))
            keep.append(entry)  # dead once the shard is requeued; live again if the publish failed
        for entry in keep:
            heapq.heappush(self._unstarted_due, entry)
        if waiting:  # look at the waiting ones again in a while, not at every cycle
            self._reclaim_recheck = now_live + min(1.0, self.reclaim_after_s / 4)
        self._visit("reclaim", visits)
        if not lost and not reclaimed:
            return
        results = await self.publisher.publish_many([i for _, _, items, _ in lost for i in items] +
                                                    [item for _, _, item in reclaimed])
        pos = 0
        for job, shard, items, progress in lost:
            ok = all(results[pos:pos + len(items)])
            pos += len(items)
            if ok:
                log.warning("scheduler: %s/%d attempt %d lost with cluster %s (resumes from %.0f s)", job.job_id,
                            shard.index, shard.attempt, shard.cluster, progress)
                self._unbind(shard)
                self._after_loss(job, shard, at, progress)
        for (job, shard, _), ok in zip(reclaimed, results[pos:]):
            if ok:
                log.warning("scheduler: reclaiming %s/%d from %s (never started)", job.job_id, shard.index,
                            shard.cluster)
                cluster = shard.cluster
                self._unbind(shard)
                self._requeue(job, shard, avoid=cluster)

    def _lost_event(self, job: JobEntry, shard: ShardEntry, at: float, progress_s: float):
        """``job.stopped`` (reason ``cluster_lost``) for an attempt on a lost cluster at business
        time ``at``, published on that cluster's status subject with the id its agent would give
        the attempt's end; ``progress_s`` is the work the next attempt resumes from."""
        placed = shard.attempt_placed
        spec = job.spec
        info = self.clusters.get(shard.cluster)
        payload = JobStatus(
            card_model=placed.card_model if placed else "", gpu_milli=spec.total_gpu_milli,
            cpu_milli=spec.cpu_milli * spec.workers, memory_mib=spec.memory_mib * spec.workers,
            started_at=to_datetime(shard.started_at) if shard.started_at is not None else None,
            reason=StopReason.CLUSTER_LOST.value, shard=shard.index,
            data_version=spec.annotations.get("data.version", ""), kind=spec.kind.value,
            cross_region=placed.cross_region if placed else False, progress_s=progress_s)
        event = make_event(EventType.JOB_STOPPED, payload, producer="scheduler", occurred_at=at,
                           event_id=business_event_id(job.job_id, shard.attempt, shard.index, "ended"),
                           region=shard.region, zone=info.zone if info else "", cluster=shard.cluster,
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=shard.attempt,
                           actor="scheduler", policy_version=self.policy.version)
        return self.subjects.status(shard.region, shard.cluster), event, job.headers

    def _expire_unschedulable(self, now: float) -> None:
        """End the jobs whose every shard not yet ended has been unplaceable for at least
        ``unschedulable_timeout_s`` (business seconds, ``now`` included): they are cancelled by
        :meth:`_cancellations` with reason ``unschedulable_timeout``. Walks only the queued shards
        a decision found unplaceable (:attr:`_unplaceable`), not the whole queue."""
        limit = self.unschedulable_timeout_s

        def expired(s: ShardEntry) -> bool:
            return s.state == ShardState.QUEUED and s.unplaceable_since is not None and now - s.unplaceable_since >= limit

        self._visit("expire", len(self._unplaceable))
        for job, shard in list(self._unplaceable.values()):
            if job.cancel_requested or not expired(shard):
                continue
            if all(s.state == ShardState.DONE or expired(s) for s in job.shards):
                waited = now - min(s.unplaceable_since for s in job.shards if expired(s))
                job.cancel_requested = True
                job.end_reason = (f"unschedulable_timeout: no cluster could hold it as asked for {waited:.0f} s "
                                  f"(limit {limit:.0f} s); last reason: {shard.pending_reason or 'unplaceable'}")
                self.cancelling[job.job_id] = job
                log.warning("scheduler: ending %s: %s", job.job_id, job.end_reason)

    def _placement_refused(self, job: "JobEntry", shard: int, subject: str, event: Envelope) -> None:
        """End ``job`` whose placement the bus refused for good (larger than its server carries;
        the bus dead-lettered it with the reason): deciding it again each cycle would only be
        refused again. It ends like a cancellation (:meth:`_cancellations`, next cycle), with
        ``job.cancelled`` whose reason starts with ``placement_too_large`` -- audited, and the
        job's state in admission. Its other shards, if running, are stopped."""
        if job.cancel_requested:
            return
        job.cancel_requested = True
        job.end_reason = (f"placement_too_large: the placement of shard {shard} ({len(event.to_bytes())} bytes) is "
                          f"larger than the bus carries; it was dead-lettered "
                          f"on {self.subjects.deadletter(getattr(self.publisher, 'name', 'scheduler'))}); submit a "
                          f"smaller spec")
        self.cancelling[job.job_id] = job
        log.warning("scheduler: ending %s: placement to %s refused by the bus", job.job_id, subject)

    async def _cancellations(self) -> None:
        for job in list(self.cancelling.values()):
            items = []
            for shard in job.shards:
                if shard.state in (ShardState.QUEUED, ShardState.HELD):
                    shard.outcome = Outcome.CANCELLED
                    self._set(job, shard, ShardState.DONE)
                elif shard.state in ACTIVE and not shard.stop_sent:
                    item = self._stop_event(job, shard, StopReason.CANCELLED)
                    if item is not None:
                        items.append((shard, item))
            if items:
                for (shard, _), ok in zip(items, await self.publisher.publish_many([i for _, i in items])):
                    shard.stop_sent = shard.stop_sent or bool(ok)
            if job.done and not job.cancelled_sent:
                event = make_event(EventType.JOB_CANCELLED, JobStatus(reason=job.end_reason or "cancelled"), producer="scheduler",
                                   occurred_at=self.clock.time(), event_id=business_event_id(job.job_id, "cancelled"),
                                   tenant=job.tenant, project=job.project, job_id=job.job_id,
                                   attempt=max(s.attempt for s in job.shards), actor="scheduler",
                                   policy_version=self.policy.version)
                await self.publisher.publish(self.subjects.decisions(job.tenant, job.project), event, headers=job.headers)
                job.cancelled_sent = True
                self.cancelling.pop(job.job_id, None)
                self._retire(job)
            elif job.done:
                self.cancelling.pop(job.job_id, None)
                self._retire(job)

    def _stop_event(self, job: JobEntry, shard: ShardEntry, reason: StopReason, *, for_job: str = "", detail: str = "",
                    at: float | None = None):
        info = self.clusters.get(shard.cluster)
        if not shard.cluster or not shard.region:
            return None
        payload = JobStop(reason=reason.value, shard=shard.index, for_job=for_job, detail=detail,
                          checkpoint_interval_s=self.policy.checkpoint_interval_s if job.spec.checkpointable else 0.0,
                          fencing_token=self.fencing_token)
        event = make_event(EventType.JOB_STOP, payload, producer="scheduler",
                           occurred_at=self.clock.time() if at is None else at,
                           event_id=order_event_id(job.job_id, shard.attempt, shard.index, "stop", self.fencing_token),
                           region=shard.region, zone=info.zone if info else "", cluster=shard.cluster,
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=shard.attempt,
                           actor="scheduler", policy_version=self.policy.version)
        return self.subjects.placements(shard.region, shard.cluster), event, job.headers

    # ------------------------------------------------------------------ events out

    def _placement_event(self, view: View, p: Placement, policy_version: str):
        job = self.jobs[p.job.job_id]
        payload = JobPlaced(
            spec=job.spec, card_model=p.card_model,
            bindings=tuple(WorkerBinding(worker=b.worker, node=b.node, gpu_indices=b.devices, gpu_milli=b.gpu_milli,
                                         cpu_milli=b.cpu_milli, memory_mib=b.memory_mib) for b in p.bindings),
            score=p.score, explanation=p.explanation, cross_region=p.cross_region, transfer_s=p.transfer_s,
            transfer_bytes=p.transfer_bytes, price_per_gpu_hour=p.price_per_gpu_hour, shard=p.job.shard,
            evaluations=tuple(self._evaluation(e) for e in p.evaluations), resume_from_s=p.job.progress_s,
            queue=p.queue, est_cost=p.est_cost, fencing_token=self.fencing_token,
            counterfactual=self._placement_counterfactual(view, p))
        event = make_event(EventType.JOB_PLACED, payload, producer="scheduler", occurred_at=self.clock.time(),
                           event_id=order_event_id(job.job_id, p.job.attempt, p.job.shard, "placed", self.fencing_token),
                           region=p.region, zone=p.zone, cluster=p.cluster, tenant=job.tenant, project=job.project,
                           job_id=job.job_id, attempt=p.job.attempt, actor="scheduler", policy_version=policy_version)
        headers = telemetry.child_headers(job.headers, "scheduler.place", job_id=job.job_id, cluster=p.cluster)
        return p, self.subjects.placements(p.region, p.cluster), event, headers, payload

    #: counterfactuals cost a decide() per relaxation: only for jobs that waited this long (or can
    #: never run as asked), and at most this many per cycle
    COUNTERFACTUAL_AFTER_S = 60.0
    COUNTERFACTUALS_PER_CYCLE = 32

    #: cross-region placements explained with a counterfactual (the home start estimate walks
    #: the home clusters' work) per cycle; beyond it (a burst placing thousands abroad at once)
    #: the placement carries none
    PLACEMENT_COUNTERFACTUALS_PER_CYCLE = 64

    def _evaluation(self, e: ClusterEvaluation) -> dict:
        """The bus record of one cluster evaluation, built once per evaluation object in a cycle:
        ``decide`` shares the verdicts of clusters that cannot fit a job among the jobs of one
        shape (500 placements carried 3,000 evaluations of ~700 objects, issue 15). The payload
        copies the record when it validates, so sharing it is safe."""
        hit = self._evaluations.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        record = evaluation_record(e)
        self._evaluations[id(e)] = (e, record)  # (e kept alive: its id is not reused this cycle)
        return record

    def _placement_counterfactual(self, view: View, p: Placement) -> str:
        if not p.cross_region or self._placement_counterfactuals >= self.PLACEMENT_COUNTERFACTUALS_PER_CYCLE:
            return ""
        self._placement_counterfactuals += 1
        return placement_counterfactual(view, p, self.policy, self._home_starts)

    def _counterfactual(self, view: View, pend: Pending) -> str:
        if pend.fits_empty and view.now - pend.job.submitted_at < self.COUNTERFACTUAL_AFTER_S:
            return ""
        if self._counterfactuals >= self.COUNTERFACTUALS_PER_CYCLE:
            return ""
        self._counterfactuals += 1
        return pending_counterfactual(view, pend.job, self.policy)

    def _pending_event(self, view: View, pend: Pending, policy_version: str):
        job = self.jobs[pend.job.job_id]
        res = pend.reservation
        payload = JobPending(reason=pend.reason, reasons={e.cluster: str(e.verdict) for e in pend.evaluations},
                             fits_empty=pend.fits_empty, evaluations=tuple(self._evaluation(e) for e in pend.evaluations),
                             shard=pend.job.shard, queue=pend.queue, reserved_cluster=res.cluster if res else "",
                             reserved_from=to_datetime(res.start_at) if res else None,
                             counterfactual=self._counterfactual(view, pend))
        event = make_event(EventType.JOB_PENDING, payload, producer="scheduler", occurred_at=self.clock.time(),
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=pend.job.attempt - 1,
                           actor="scheduler", policy_version=policy_version)
        return self.subjects.decisions(job.tenant, job.project), event, job.headers


def order_event_id(job_id: str, attempt: int, shard: int, kind: str, fencing_token: int) -> str:
    """The event id of an order to an agent (``kind`` "placed" or "stop") for one shard's attempt:
    :func:`~fedsched.events.business_event_id` of the shard's key and, under a lease (token > 0),
    the issuing tenure's fencing token. The same holder re-publishing an order (a retry, a restart
    with its token) gets the same id, so JetStream drops the repeat; two holders' orders for one
    attempt get two ids. Without the token a deposed holder's late order, stored first, made the
    new holder's order a *duplicate* that was never stored: the agent refused the stale one and the
    job sat until it was reclaimed as never started, avoiding a cluster that was not at fault
    (review of issue 15's change)."""
    if fencing_token > 0:
        return business_event_id(job_id, attempt, shard, kind, fencing_token)
    return business_event_id(job_id, attempt, shard, kind)


def _order_token(env: Envelope) -> int | None:
    """The fencing token of ``env`` when it is an order to an agent (placement, stop), else None
    (also for a payload that does not parse: the fold refuses it)."""
    kind = {EventType.JOB_PLACED: JobPlaced, EventType.JOB_STOP: JobStop}.get(env.known_type)
    if kind is None:
        return None
    try:
        return env.payload_as(kind).fencing_token
    except DecodeError:
        return None


def _cancel_requested(job: JobEntry) -> bool:
    return job.cancel_requested


def queue_stats(queue: list[QueuedJob], now: float, fast_lane_s: float) -> dict[str, tuple[int, float]]:
    """Queue name (:func:`~services.scheduler.core.queues.queue_of`) -> (waiting shards, business
    seconds the oldest has waited since submission at business time ``now``). One pass over
    the queue the cycle has built anyway."""
    stats: dict[str, tuple[int, float]] = {}
    for job in queue:
        name = queue_of(job, fast_lane_s)
        n, age = stats.get(name, (0, 0.0))
        stats[name] = (n + 1, max(age, now - job.submitted_at))
    return stats


class FencedPublisher:
    """A :class:`~fedsched.ports.Publisher` that publishes only while ``allowed()`` is true
    (the scheduler's lease is held): otherwise :meth:`publish` raises
    :class:`~fedsched.errors.UnavailableError` and :meth:`publish_many` acknowledges nothing,
    so the caller keeps its state as if the bus were down."""

    def __init__(self, inner: Publisher, allowed) -> None:
        self.inner = inner
        self.allowed = allowed
        self.refused = 0

    async def publish(self, subject: str, event: Envelope, *, headers: dict[str, str] | None = None):
        if not self.allowed():
            self.refused += 1
            raise UnavailableError(f"not published to {subject}: this scheduler does not hold the lease")
        return await self.inner.publish(subject, event, headers=headers)

    async def publish_many(self, items) -> list[bool]:
        if not self.allowed():
            self.refused += len(items)
            return [False] * len(items)
        return await self.inner.publish_many(items)


def _attempt_status(fold, *, ends: bool):
    """A ``scheduler-events`` handler of a status event (``job.started`` or a terminal status)
    of one attempt: ``fold(svc, job, shard, env, status)`` runs only when the event is about the
    shard's current attempt and the shard still has it (not done, not requeued: an attempt we
    already gave up on is ignored). With ``ends`` the attempt's resources are released first.

    A status that contradicts the scheduler's placements (:func:`fedsched.trust.check_placement`:
    unknown job or shard, an attempt never placed, or the current attempt reported from another
    cluster) is refused and changes nothing. An earlier attempt's status is a late event (its
    cluster is no longer kept): ignored as before."""
    def handler(svc: SchedulerService, env: Envelope, d: Delivery) -> None:
        status = env.payload_as(JobStatus)
        found = svc._shard(env, status.shard)
        if found is None and env.job_id in svc.tombstones:
            newest = svc.tombstones[env.job_id]
            if env.attempt <= newest:
                return  # a late status of a job that ended and left memory
            svc._reject("scheduler-events", d, check_placement(env, True, None, newest))
            return
        shard = found[1] if found is not None else None
        placed = (PlacedAttempt(shard.attempt, shard.region, shard.cluster)
                  if shard is not None and env.attempt == shard.attempt > 0 and shard.cluster else None)
        if env.job_id in svc.jobs and found is None:
            reason = f"job {env.job_id} has no shard {status.shard}"
        else:
            reason = check_placement(env, found is not None, placed, shard.attempt if shard is not None else 0)
        if reason is not None:
            svc._reject("scheduler-events", d, reason)
            return
        job, shard = found
        if env.attempt != shard.attempt or shard.state in (ShardState.DONE, ShardState.QUEUED, ShardState.HELD):
            return  # an attempt we already gave up on
        if ends:
            svc._unbind(shard)
        fold(svc, job, shard, env, status)
    return handler


#: ``scheduler-events`` (the whole EVENTS stream): the job lifecycle. Approval requests and
#: outcomes, ``job.started`` and the terminal statuses are folded by the TenancyGate as well
#: (``services/scheduler/approvals.py``); policy versions are read by the PolicyFollower.
EVENTS: EventTable = EventTable({
    EventType.JOB_SUBMITTED: SchedulerService._on_submitted,
    EventType.JOB_CANCEL_REQUESTED: SchedulerService._on_cancel,
    EventType.JOB_HELD: SchedulerService._on_held,
    EventType.JOB_RELEASED: SchedulerService._on_released,
    EventType.JOB_PRIORITY_CHANGED: SchedulerService._on_priority_changed,
    EventType.JOB_CANCELLED: SchedulerService._on_cancelled,
    EventType.JOB_PLACED: SchedulerService._on_placed,
    EventType.JOB_STOP: SchedulerService._on_stop_order,
    EventType.JOB_STARTED: _attempt_status(SchedulerService._on_started, ends=False),
    EventType.JOB_FINISHED: _attempt_status(SchedulerService._on_finished, ends=True),
    EventType.JOB_FAILED: _attempt_status(SchedulerService._on_failed, ends=True),
    EventType.JOB_REJECTED: _attempt_status(SchedulerService._on_rejected, ends=True),
    EventType.JOB_STOPPED: _attempt_status(SchedulerService._on_stopped, ends=True),
}, ignores=frozenset({
    EventType.JOB_PENDING, EventType.SUBMISSION_REJECTED, EventType.USAGE_RECORDED, EventType.BUS_DEAD_LETTER,
    EventType.POLICY_APPLIED, EventType.TENANT_UPDATED, EventType.QUOTA_UPDATED, EventType.PRINCIPAL_UPDATED,
    EventType.APPROVAL_REQUESTED, EventType.APPROVAL_APPROVED, EventType.APPROVAL_REJECTED,
    EventType.APPROVAL_EXPIRED,
    EventType.AGENT_RECONCILED,  # an agent's own audit record; its stops come as job.stopped
    EventType.SECURITY_REJECTED_MESSAGE,  # on the dead-letter stream; listed for completeness
}))

#: ``scheduler-inventory``: which branch of ``_apply_inventory`` an inventory event takes.
INVENTORY: EventTable = EventTable({EventType.INVENTORY_HEARTBEAT: "heartbeat",
                                    EventType.INVENTORY_SNAPSHOT: "snapshot"})


def _resume_point(shard: ShardEntry, at: float, checkpoint_interval_s: float) -> float:
    """Work (s) a shard's next attempt resumes from when its current attempt is lost at
    business time ``at``: the progress it started from plus the whole checkpoint intervals
    it ran (the agent's rule for a stopped checkpointable attempt; ``checkpoint_interval_s``
    is 0 for a job that is not checkpointable, which restarts from what it had)."""
    if checkpoint_interval_s <= 0 or shard.started_at is None:
        return shard.progress_s
    ran = max(0.0, at - shard.started_at)
    return shard.progress_s + ran // checkpoint_interval_s * checkpoint_interval_s


def _evaluation(e: ClusterEvaluation) -> dict:
    return evaluation_record(e)


def _capacity_key(snap: InventorySnapshot) -> tuple:
    return (snap.maintenance, snap.interconnect, snap.residency_tags,
            tuple((n.name, n.gpus, n.cpu_milli, n.memory_mib, n.healthy, n.card_model) for n in snap.nodes))


def _allocate(info: ClusterInfo, placed: JobPlaced, sign: int) -> None:
    for b in placed.bindings:
        slot = info.alloc.get(b.node)
        if slot is None:
            slot = info.alloc[b.node] = [{}, 0, 0]
        for i in b.gpu_indices:
            slot[0][i] = slot[0].get(i, 0) + sign * b.gpu_milli
        slot[1] += sign * b.cpu_milli
        slot[2] += sign * b.memory_mib
        info.dirty_nodes.add(b.node)
    info.cached = None


def _node_state(n, alloc: dict[str, list]) -> NodeState:
    gpu_alloc, cpu_alloc, mem_alloc = alloc.get(n.name, ({}, 0, 0))
    free = tuple(1000 - gpu_alloc.get(i, 0) for i in range(n.gpus))
    return NodeState(n.name, n.card_model, n.gpu_memory_gib, free, n.cpu_milli - cpu_alloc, n.memory_mib - mem_alloc,
                     n.cpu_milli, n.memory_mib, n.healthy, n.rdma)


def _cluster_state(info: ClusterInfo, prices: PriceCatalog) -> ClusterState:
    """The cluster's immutable state; only nodes whose allocation changed are rebuilt (and their
    capacity classes updated)."""
    snap = info.snapshot
    if info.index is None or len(info.nodes) != len(snap.nodes) or info.classes is None:
        info.nodes = [_node_state(n, info.alloc) for n in snap.nodes]
        info.position = {n.name: i for i, n in enumerate(snap.nodes)}
        info.index = ClusterIndex.build(tuple(info.nodes))
        info.classes = CapacityClasses.build(tuple(info.nodes), info.index.pool)
    else:
        changed = []
        for name in info.dirty_nodes:
            i = info.position.get(name)
            if i is not None:
                info.nodes[i] = _node_state(snap.nodes[i], info.alloc)
                changed.append(i)
        if changed:
            info.classes = info.classes.updated(tuple(info.nodes), changed, info.index.pool)
    info.dirty_nodes.clear()
    models = info.index.memory
    return ClusterState(
        name=info.name, region=info.region, zone=info.zone, nodes=tuple(info.nodes), maintenance=snap.maintenance,
        residency_tags=frozenset(snap.residency_tags), interconnect=snap.interconnect,
        prices={m: float(prices.gpu_hour(info.region, m)) for m in models},
        cpu_price_per_core_hour=float(prices.cpu_core_hour_in(info.region)), index=info.index, classes=info.classes)
