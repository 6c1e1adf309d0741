"""The scheduler service: keeps the global resource view and runs the pure core on it.

State is rebuilt from the bus on start (event sourcing): every event on ``P_EVENTS`` from the
first sequence (submissions, its own placements and stop orders, agents' status) and the newest
inventory of every cluster. Then it follows both streams and runs a cycle whenever something
changed (and at least once a second, for staleness, aging and reclamation):

1. reclaim placements that never started (timeout) or sit on a stale cluster, and carry out
   cancellations;
2. build the :class:`~services.scheduler.core.View` -- inventory capacity minus the allocations
   of placed and running work, that work with its estimated ends, heartbeat ages, tenant usage
   -- and the queue (one entry per waiting shard);
3. ``decide(view, queue, policy)`` -- pure;
4. publish, in one pipelined batch: stop orders for preemption victims, then placements (same
   subject per cluster, so an agent frees the victims before it admits the preemptor), then
   changed pending reasons with a counterfactual; message ids are (job, attempt, shard, step)
   so a retried publish is never a second placement;
5. update local state only for what JetStream acknowledged.

Its own events come back through the follower; applying them again is a no-op (same attempt),
so the write-through state and the rebuilt state agree.

A status endpoint (core NATS request/reply on ``<p>.svc.scheduler.status``) reports the applied
stream sequence and queue sizes; the replay driver uses it to detect quiescence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, StreamFollower
from fedsched.clock import Clock, to_datetime
from fedsched.events import (Envelope, InventorySnapshot, JobPending, JobPlaced, JobStatus, JobStop, JobSubmitted,
                             WorkerBinding, business_event_id, make_event)
from fedsched.jobs import JobSpec
from fedsched.policystore import PolicyFollower, PolicyHolder
from fedsched.pricing import PriceCatalog
from services.scheduler.approvals import TenancyGate
from services.scheduler.core import (ClusterEvaluation, ClusterIndex, ClusterState, NodeState, Pending, Placement,
                                     Policy, QueuedJob, RunningWork, Usage, View, decide)
from services.scheduler.core.explain import pending_counterfactual, placement_counterfactual

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.scheduler")

ACTIVE = ("placed", "running")


@dataclass
class ShardEntry:
    """One schedulable unit of a job (a whole job is shard 0 of 1).

    Attributes:
        state: ``queued``, ``placed``, ``running``, ``stopping`` (evicted or reclaimed, stop
            order sent, resources already given up) or ``done``.
        attempt: number of the latest placement (0 = never placed).
        failures: failed attempts so far (retry budget: ``spec.retry_limit``).
        avoid: clusters where an attempt failed (failover prefers others).
        placed: the current placement (allocated while placed/running).
        placed_mono: wall-clock (monotonic) time of the placement, for reclamation.
        started_at: business time the current attempt started.
        progress_s: checkpointed work from earlier attempts (s).
        pending_reason: the last published pending summary.
        unplaceable: the last decision found no cluster that could hold it even if empty.
        outcome: how a done shard ended: succeeded, failed, cancelled.
    """

    index: int
    state: str = "queued"
    attempt: int = 0
    failures: int = 0
    avoid: set[str] = field(default_factory=set)
    cluster: str = ""
    region: str = ""
    placed: JobPlaced | None = None
    placed_mono: float = 0.0
    started_at: float | None = None
    progress_s: float = 0.0
    pending_reason: str = ""
    unplaceable: bool = False
    stop_sent: bool = False
    outcome: str = ""
    view_cache: tuple | None = field(default=None, repr=False, compare=False)


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
    shards: list[ShardEntry] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Every shard is done."""
        return all(s.state == "done" for s in self.shards)

    # -- the job as one attempt, for the governor (services/scheduler/approvals.py) --

    @property
    def state(self) -> str:
        """``done`` when every shard is; else the most advanced shard state."""
        if self.done:
            return "done"
        for state in ("running", "placed", "stopping", "queued"):
            if any(s.state == state for s in self.shards):
                return state
        return "queued"

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


@dataclass(frozen=True)
class ActiveShard:
    """A placed or running shard as the governor's quota book counts it."""

    tenant: str
    region: str
    placed: JobPlaced


@dataclass
class ClusterInfo:
    """Latest inventory of one cluster and when we last heard from it (monotonic seconds)."""

    name: str
    region: str
    zone: str
    snapshot: InventorySnapshot
    seen_mono: float
    # node name -> [gpu milli per device], cpu milli, memory MiB allocated by placements
    alloc: dict[str, list] = field(default_factory=dict)
    cached: ClusterState | None = None
    # incremental view: the node states, their positions, the static index; dirty node names
    nodes: list[NodeState] = field(default_factory=list)
    position: dict[str, int] = field(default_factory=dict)
    index: ClusterIndex | None = None
    dirty_nodes: set[str] = field(default_factory=set)


class SchedulerService:
    """The scheduler.

    Args:
        bus: NATS connection.
        clock: business clock.
        policy: the scheduling policy (see :func:`~services.scheduler.core.build_policy`).
        prices: price catalog (cluster prices in the view).
        stale_after_s: wall seconds after which a silent cluster is excluded and its unstarted
            placements are reclaimed.
        interval_s: minimum wall seconds between cycles.
        reclaim_after_s: wall seconds a placement may stay unstarted before it is reclaimed.
        cross_region_mode: tenant -> ``allowed`` / ``approval`` / ``forbidden`` (default allowed).
    """

    def __init__(self, bus: Bus, clock: Clock, policy: Policy, prices: PriceCatalog, *,
                 stale_after_s: float = 10.0, interval_s: float = 0.02, reclaim_after_s: float = 30.0,
                 cross_region_mode: dict[str, str] | None = None) -> None:
        self.bus = bus
        self.clock = clock
        self.policy = policy
        self.prices = prices
        self.stale_after_s = stale_after_s
        self.interval_s = interval_s
        self.reclaim_after_s = reclaim_after_s
        self.cross_region_mode = cross_region_mode or {}
        # governance (quotas, cross-region modes, approvals): services/scheduler/approvals.py
        self.base_policy = policy
        self.policy_holder = PolicyHolder()
        self.governor = TenancyGate(self.policy_holder, bus.subjects, prices)
        self._policy_follower = PolicyFollower(bus, self.policy_holder, name="scheduler-policy")
        self.jobs: dict[str, JobEntry] = {}
        self.clusters: dict[str, ClusterInfo] = {}
        self.counts = {"queued": 0, "placed": 0, "running": 0, "stopping": 0, "done": 0}
        self.queued: dict[tuple[str, int], tuple[JobEntry, ShardEntry]] = {}
        self.active: dict[tuple[str, int], tuple[JobEntry, ShardEntry]] = {}
        self.cancelling: dict[str, JobEntry] = {}
        self.applied_seq = 0
        self.cycles = 0
        self.last_cycle_ms = 0.0
        self.busy = False
        self._counterfactuals = 0
        self.on_cycle: list = []  # callables run after every cycle (e.g. a replay driver's wake-up)
        self._dirty = asyncio.Event()
        self._stop = asyncio.Event()
        # The whole stream (not just jobs/status/placements): applied_seq then tells anyone
        # comparing it with the stream's last sequence whether the scheduler has seen everything.
        self._events = StreamFollower(bus, "EVENTS", self._apply_event, name="scheduler-events")
        self._inventory = StreamFollower(bus, "INVENTORY", self._apply_inventory, name="scheduler-inventory",
                                         last_per_subject=True)
        self._status_sub = None
        self._stale: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Rebuild from the bus, then schedule until :meth:`stop`."""
        tasks = [asyncio.create_task(self._events.run(), name="scheduler-events"),
                 asyncio.create_task(self._inventory.run(), name="scheduler-inventory"),
                 asyncio.create_task(self._policy_follower.run(), name="scheduler-policy")]
        self._status_sub = await self.bus.nc.subscribe(f"{self.bus.prefix}.svc.scheduler.status",
                                                       cb=self._on_status_request)
        try:
            await self._events.caught_up.wait()
            await self._inventory.caught_up.wait()
            await self._policy_follower.initial.wait()
            log.info("scheduler: rebuilt %d jobs, %d clusters", len(self.jobs), len(self.clusters))
            self._dirty.set()
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._dirty.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass  # periodic cycle: staleness, aging, reclamation
                if self._stop.is_set():
                    break
                self._dirty.clear()
                self.busy = True
                try:
                    await self.cycle()
                except Exception:  # noqa: BLE001 - a cycle must never kill the scheduler
                    log.exception("scheduler cycle failed")
                finally:
                    self.busy = False
                    for hook in self.on_cycle:
                        hook()
                await asyncio.sleep(self.interval_s)
        finally:
            self._events.stop()
            self._inventory.stop()
            self._policy_follower.stop()
            if self._status_sub is not None:
                try:
                    await self._status_sub.unsubscribe()
                except Exception:  # noqa: BLE001 - connection may be closing
                    pass
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()
        self._dirty.set()

    def status(self) -> dict:
        """Counts (of shards) for dashboards and the replay driver's quiescence check."""
        unplaceable = sum(1 for _, s in self.queued.values() if s.unplaceable)
        timers = [st.pending.expires_at for st in self.governor.state.values() if st.pending is not None]
        return {"next_due": min(timers) if timers else None,  # business time of the next timer (approval expiry)
                "applied_seq": self.applied_seq, "dirty": self._dirty.is_set(), "busy": self.busy, "cycles": self.cycles,
                "last_cycle_ms": round(self.last_cycle_ms, 2), "unplaceable": unplaceable, "jobs": len(self.jobs),
                "clusters": len(self.clusters), "stale": sorted(self._stale), "policy": self.policy.version,
                **self.counts}

    async def _on_status_request(self, msg) -> None:
        await msg.respond(json.dumps(self.status()).encode())

    # ------------------------------------------------------------------ shard state

    def _set(self, job: JobEntry, shard: ShardEntry, state: str) -> None:
        """Move a shard to ``state``, keeping counts and indexes current."""
        key = (job.job_id, shard.index)
        self.counts[shard.state] -= 1
        self.counts[state] += 1
        shard.state = state
        if state == "queued":
            self.queued[key] = (job, shard)
        else:
            self.queued.pop(key, None)
        if state in ACTIVE:
            self.active[key] = (job, shard)
        else:
            self.active.pop(key, None)
        if state != "queued":
            shard.unplaceable = False
        self._dirty.set()

    def _requeue(self, job: JobEntry, shard: ShardEntry, *, avoid: str = "") -> None:
        if avoid:
            shard.avoid.add(avoid)
        shard.pending_reason = ""
        self._set(job, shard, "done" if job.cancel_requested else "queued")
        if job.cancel_requested:
            shard.outcome = "cancelled"

    # ------------------------------------------------------------------ state from events

    def _apply_event(self, d: Delivery) -> None:
        self.applied_seq = d.stream_sequence
        env = d.envelope
        handler = _EVENT_HANDLERS.get(env.type)
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
        if env.job_id in self.jobs:
            return
        sub = env.payload_as(JobSubmitted)
        job = JobEntry(env.job_id, env.tenant, env.project, sub.spec, env.occurred_at.timestamp(),
                       headers={k: v for k, v in d.headers.items() if k in ("traceparent", "tracestate")})
        job.shards = [ShardEntry(i) for i in range(sub.spec.shards)]
        self.jobs[env.job_id] = job
        for shard in job.shards:
            self.counts["queued"] += 1
            self.queued[(job.job_id, shard.index)] = (job, shard)
        self._dirty.set()

    def _on_cancel(self, env: Envelope, d: Delivery) -> None:
        job = self.jobs.get(env.job_id)
        if job is None or job.done:
            return
        job.cancel_requested = True
        self.cancelling[job.job_id] = job
        self._dirty.set()

    def _on_placed(self, env: Envelope, d: Delivery) -> None:
        placed = env.payload_as(JobPlaced)
        found = self._shard(env, placed.shard)
        if found is None:
            return
        job, shard = found
        if env.attempt <= shard.attempt:
            return  # our own write-through, or a stale duplicate
        self._bind(job, shard, env.attempt, env.cluster, env.region, placed)

    def _on_stop_order(self, env: Envelope, d: Delivery) -> None:
        """Our own stop order, read back after a restart: the shard gave up its resources."""
        stop = env.payload_as(JobStop)
        found = self._shard(env, stop.shard)
        if found is None:
            return
        job, shard = found
        if env.attempt == shard.attempt and shard.state in ACTIVE and stop.reason in ("preempted", "reclaimed"):
            self._unbind(shard)
            self._set(job, shard, "stopping")

    def _on_status(self, env: Envelope, d: Delivery) -> None:
        status = env.payload_as(JobStatus)
        found = self._shard(env, status.shard)
        if found is None:
            return
        job, shard = found
        if env.attempt != shard.attempt or shard.state in ("done", "queued"):
            return  # an attempt we already gave up on
        if env.type == "job.started":
            if shard.state == "placed":
                shard.started_at = env.occurred_at.timestamp()
                self._set(job, shard, "running")
            return
        self._unbind(shard)
        if env.type == "job.finished":
            shard.outcome = "succeeded"
            self._set(job, shard, "done")
        elif env.type == "job.failed":
            shard.failures += 1
            if shard.failures <= job.spec.retry_limit and not job.cancel_requested:
                self._requeue(job, shard, avoid=env.cluster)
            else:
                shard.outcome = "failed"
                self._set(job, shard, "done")
        elif env.type == "job.rejected":
            self._requeue(job, shard)
        elif env.type == "job.stopped":
            if status.reason == "cancelled" or job.cancel_requested:
                shard.outcome = "cancelled"
                self._set(job, shard, "done")
            else:
                shard.progress_s = max(shard.progress_s, status.progress_s)
                self._requeue(job, shard)

    def _bind(self, job: JobEntry, shard: ShardEntry, attempt: int, cluster: str, region: str,
              placed: JobPlaced) -> None:
        self._unbind(shard)
        shard.attempt = attempt
        shard.cluster, shard.region = cluster, region
        shard.placed = placed
        shard.placed_mono = time.monotonic()
        shard.started_at = None
        shard.stop_sent = False
        info = self.clusters.get(cluster)
        if info is not None:
            _allocate(info, placed, +1)
        self._set(job, shard, "placed")

    def _unbind(self, shard: ShardEntry) -> None:
        if shard.placed is None:
            return
        info = self.clusters.get(shard.cluster)
        if info is not None:
            _allocate(info, shard.placed, -1)
        shard.placed = None

    def _apply_inventory(self, d: Delivery) -> None:
        env = d.envelope
        info = self.clusters.get(env.cluster)
        now = time.monotonic()
        if env.type == "inventory.heartbeat":
            if info is not None:
                info.seen_mono = now
                if env.cluster in self._stale:
                    self._stale.discard(env.cluster)
                    info.cached = None
                    self._dirty.set()
            return
        if env.type != "inventory.snapshot":
            return
        snap = env.payload_as(InventorySnapshot)
        if info is None:
            info = self.clusters[env.cluster] = ClusterInfo(env.cluster, env.region, env.zone, snap, now)
            for _, shard in self.active.values():  # placements made before this inventory arrived
                if shard.placed is not None and shard.cluster == env.cluster:
                    _allocate(info, shard.placed, +1)
            self._dirty.set()
        else:
            changed = _capacity_key(info.snapshot) != _capacity_key(snap)
            info.snapshot, info.seen_mono = snap, now
            if changed:
                info.cached = None
                info.index = None  # nodes or health changed: rebuild everything
                self._dirty.set()
        self._stale.discard(env.cluster)

    # ------------------------------------------------------------------ the cycle

    def view(self) -> View:
        """The current resource view (immutable)."""
        now_mono = time.monotonic()
        now = self.clock.time()
        for info in self.clusters.values():  # node positions must be current before bindings map to them
            if info.cached is None:
                info.cached = _cluster_state(info, self.prices)
        running: dict[str, list[RunningWork]] = {}
        held: dict[str, list[int]] = {}  # tenant -> [milli-GPU, milli-CPU, MiB]
        for job, shard in self.active.values():
            p = shard.placed
            info = self.clusters.get(shard.cluster)
            if p is None or info is None:
                continue
            work = self._running_work(job, shard, p, info, now)
            if work is None:
                continue
            running.setdefault(shard.cluster, []).append(work)
            spec = job.spec
            h = held.setdefault(job.tenant, [0, 0, 0])
            h[0] += spec.total_gpu_milli
            h[1] += spec.cpu_milli * spec.workers
            h[2] += spec.memory_mib * spec.workers
        usage = {tenant: Usage(*h) for tenant, h in held.items()}
        clusters = []
        for info in sorted(self.clusters.values(), key=lambda c: c.name):
            age = now_mono - info.seen_mono
            if age > self.stale_after_s and info.name not in self._stale:
                self._stale.add(info.name)
                log.warning("scheduler: cluster %s is stale (%.1fs since last heartbeat)", info.name, age)
            if info.cached is None:
                info.cached = _cluster_state(info, self.prices)
            clusters.append(replace(info.cached, heartbeat_age_s=age, running=tuple(running.get(info.name, ()))))
        return View(tuple(clusters), now, self.stale_after_s, usage)

    @staticmethod
    def _running_work(job: "JobEntry", shard: ShardEntry, p: JobPlaced, info: ClusterInfo,
                      now: float) -> RunningWork | None:
        """The view's record of a placed/running shard (None if a node it is bound to is gone).

        Kept on the shard while nothing it depends on changes (attempt, start, placement,
        progress, the cluster's node positions), so a cycle does not rebuild every running job;
        a shard not started yet is expected to start ``now``, so it is rebuilt each time.
        """
        key = (shard.attempt, shard.started_at, shard.progress_s)
        cached = shard.view_cache  # (key, placement, positions, work): the objects themselves, compared by identity
        if cached is not None and cached[0] == key and cached[1] is p and cached[2] is info.position:
            return cached[3]
        spec = job.spec
        est = spec.estimated_duration_s
        left = max(0.0, est - shard.progress_s) if est is not None else math.inf
        start = shard.started_at if shard.started_at is not None else now
        bindings = tuple((info.position.get(b.node, -1), tuple(b.gpu_indices), b.gpu_milli, b.cpu_milli,
                          b.memory_mib) for b in p.bindings)
        work = None if any(b[0] < 0 for b in bindings) else RunningWork(
            job.job_id, shard.attempt, shard.index, job.tenant, spec.priority_value, spec.preemptible,
            spec.checkpointable, shard.started_at, start + left, p.card_model, bindings)
        if shard.started_at is not None:
            shard.view_cache = (key, p, info.position, work)
        return work

    def queue(self) -> list[QueuedJob]:
        """Shards waiting for a placement (cross-region mode from the governance policy in force,
        else the ``cross_region_mode`` given at construction)."""
        gov = self.policy_holder.current
        return [QueuedJob(job.job_id, shard.attempt + 1, job.spec, job.submitted_at, frozenset(shard.avoid),
                          shard.index, gov.mode_for(job.spec)[0] if gov is not None
                          else self.cross_region_mode.get(job.tenant, "allowed"), shard.progress_s)
                for job, shard in self.queued.values() if not job.cancel_requested]

    async def cycle(self) -> None:
        """One scheduling cycle (see the module docstring)."""
        t0 = time.perf_counter()
        self.policy = self.governor.effective_policy(self.base_policy)  # governance: weights, quota filter
        await self._reclaim()                                                        # 1
        await self._cancellations()
        expired = self.governor.expiries(self.jobs, self.clock.time())  # governance: approval timeouts
        if expired:
            await self.bus.publish_many(expired)
        queue = self.queue()
        if not queue or not self.clusters:
            return
        view = self.view()                                                           # 2
        view = replace(view, quota=self.governor.quota_book(  # governance: quota usage
            ActiveShard(job.tenant, shard.region, shard.placed) for job, shard in self.active.values()
            if shard.placed is not None))
        queue = self.governor.narrow(queue, view)  # governance: awaiting approval, home-only, quota room
        with tracer.start_as_current_span("scheduler.cycle", attributes={"queue": len(queue)}):
            decisions = decide(view, queue, self.policy)                             # 3
        decisions, requests = self.governor.gate(decisions, self.jobs, view, self.clock.time())  # governance
        stops, places, pendings = [], [], []
        self._counterfactuals = 0
        for p in decisions.placements:                                               # 4
            for victim in p.victims:
                stops.append((victim, p))
            places.append(self._placement_event(view, p, decisions.policy_version))
        for pend in decisions.pending:
            job, shard = self.jobs[pend.job.job_id], self.jobs[pend.job.job_id].shards[pend.job.shard]
            shard.unplaceable = not pend.fits_empty
            if pend.reason != shard.pending_reason:
                pendings.append((shard, pend.reason, self._pending_event(view, pend, decisions.policy_version)))
        stop_items = [(v, item) for v, p in stops
                      if (item := self._stop_event(self.jobs[v.job_id], self.jobs[v.job_id].shards[v.shard], "preempted",
                                                   for_job=p.job.job_id)) is not None]
        results = await self.bus.publish_many([item for _, item in stop_items] +
                                              [(s, e, h) for _, s, e, h in places] +
                                              [(s, e, h) for _, _, (s, e, h) in pendings] + requests)
        if requests:  # governance: the jobs whose approval request was acknowledged now wait
            self.governor.confirm(requests, results[len(results) - len(requests):])
        rest = results[len(stop_items):]                                             # 5
        for (victim, _), ok in zip(stop_items, results):
            job = self.jobs[victim.job_id]
            shard = job.shards[victim.shard]
            if ok and shard.attempt == victim.attempt and shard.state in ACTIVE:
                shard.stop_sent = True
                self._unbind(shard)
                self._set(job, shard, "stopping")
        for (p, _, env, _), ok in zip(places, rest[:len(places)]):
            if ok:
                job = self.jobs[p.job.job_id]
                self._bind(job, job.shards[p.job.shard], p.job.attempt, p.cluster, p.region, env.payload_as(JobPlaced))
        for (shard, reason, _), ok in zip(pendings, rest[len(places):]):
            if ok:
                shard.pending_reason = reason
        self.cycles += 1
        self.last_cycle_ms = (time.perf_counter() - t0) * 1000

    # ------------------------------------------------------------------ reclamation, cancellation

    async def _reclaim(self) -> None:
        """Take back placements never started within ``reclaim_after_s`` or on a stale cluster."""
        now_mono = time.monotonic()
        items, shards = [], []
        for job, shard in list(self.active.values()):
            if shard.state != "placed":
                continue
            stale = shard.cluster in self._stale
            if not stale and now_mono - shard.placed_mono <= self.reclaim_after_s:
                continue
            item = self._stop_event(job, shard, "reclaimed")
            if item is not None:
                items.append(item)
                shards.append((job, shard, stale))
        if not items:
            return
        for (job, shard, stale), ok in zip(shards, await self.bus.publish_many(items)):
            if ok:
                log.warning("scheduler: reclaiming %s/%d from %s (%s)", job.job_id, shard.index, shard.cluster,
                            "cluster stale" if stale else "never started")
                cluster = shard.cluster
                self._unbind(shard)
                self._requeue(job, shard, avoid="" if stale else cluster)

    async def _cancellations(self) -> None:
        for job in list(self.cancelling.values()):
            items = []
            for shard in job.shards:
                if shard.state == "queued":
                    shard.outcome = "cancelled"
                    self._set(job, shard, "done")
                elif shard.state in ACTIVE and not shard.stop_sent:
                    item = self._stop_event(job, shard, "cancelled")
                    if item is not None:
                        items.append((shard, item))
            if items:
                for (shard, _), ok in zip(items, await self.bus.publish_many([i for _, i in items])):
                    shard.stop_sent = shard.stop_sent or ok
            if job.done and not job.cancelled_sent:
                event = make_event("job.cancelled", JobStatus(reason="cancelled"), producer="scheduler",
                                   occurred_at=self.clock.time(), event_id=business_event_id(job.job_id, "cancelled"),
                                   tenant=job.tenant, project=job.project, job_id=job.job_id,
                                   attempt=max(s.attempt for s in job.shards), actor="scheduler",
                                   policy_version=self.policy.version)
                await self.bus.publish(self.bus.subjects.decisions(job.tenant, job.project), event, headers=job.headers)
                job.cancelled_sent = True
                self.cancelling.pop(job.job_id, None)
            elif job.done:
                self.cancelling.pop(job.job_id, None)

    def _stop_event(self, job: JobEntry, shard: ShardEntry, reason: str, *, for_job: str = ""):
        info = self.clusters.get(shard.cluster)
        if not shard.cluster or not shard.region:
            return None
        payload = JobStop(reason=reason, shard=shard.index, for_job=for_job,
                          checkpoint_interval_s=self.policy.checkpoint_interval_s if job.spec.checkpointable else 0.0)
        event = make_event("job.stop", payload, producer="scheduler", occurred_at=self.clock.time(),
                           event_id=business_event_id(job.job_id, shard.attempt, shard.index, "stop"),
                           region=shard.region, zone=info.zone if info else "", cluster=shard.cluster,
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=shard.attempt,
                           actor="scheduler", policy_version=self.policy.version)
        return self.bus.subjects.placements(shard.region, shard.cluster), event, job.headers

    # ------------------------------------------------------------------ events out

    def _placement_event(self, view: View, p: Placement, policy_version: str):
        job = self.jobs[p.job.job_id]
        payload = JobPlaced(
            spec=job.spec, card_model=p.card_model,
            bindings=tuple(WorkerBinding(worker=b.worker, node=b.node, gpu_indices=b.devices, gpu_milli=b.gpu_milli,
                                         cpu_milli=b.cpu_milli, memory_mib=b.memory_mib) for b in p.bindings),
            score=p.score, explanation=p.explanation, cross_region=p.cross_region, transfer_s=p.transfer_s,
            transfer_bytes=p.transfer_bytes, price_per_gpu_hour=p.price_per_gpu_hour, shard=p.job.shard,
            evaluations=tuple(_evaluation(e) for e in p.evaluations), resume_from_s=p.job.progress_s,
            queue=p.queue, est_cost=p.est_cost,
            counterfactual=placement_counterfactual(view, p, self.policy) if p.cross_region else "")
        event = make_event("job.placed", payload, producer="scheduler", occurred_at=self.clock.time(),
                           event_id=business_event_id(job.job_id, p.job.attempt, p.job.shard, "placed"),
                           region=p.region, zone=p.zone, cluster=p.cluster, tenant=job.tenant, project=job.project,
                           job_id=job.job_id, attempt=p.job.attempt, actor="scheduler", policy_version=policy_version)
        with tracer.start_as_current_span("scheduler.place", context=telemetry.context_from(job.headers),
                                          attributes={"job_id": job.job_id, "cluster": p.cluster}):
            headers = telemetry.inject_headers()
        return p, self.bus.subjects.placements(p.region, p.cluster), event, headers

    #: counterfactuals cost a decide() per relaxation: only for jobs that waited this long (or can
    #: never run as asked), and at most this many per cycle
    COUNTERFACTUAL_AFTER_S = 60.0
    COUNTERFACTUALS_PER_CYCLE = 32

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
                             fits_empty=pend.fits_empty, evaluations=tuple(_evaluation(e) for e in pend.evaluations),
                             shard=pend.job.shard, queue=pend.queue, reserved_cluster=res.cluster if res else "",
                             reserved_from=to_datetime(res.start_at) if res else None,
                             counterfactual=self._counterfactual(view, pend))
        event = make_event("job.pending", payload, producer="scheduler", occurred_at=self.clock.time(),
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=pend.job.attempt - 1,
                           actor="scheduler", policy_version=policy_version)
        return self.bus.subjects.decisions(job.tenant, job.project), event, job.headers


_EVENT_HANDLERS = {
    "job.submitted": SchedulerService._on_submitted,
    "job.cancel_requested": SchedulerService._on_cancel,
    "job.placed": SchedulerService._on_placed,
    "job.stop": SchedulerService._on_stop_order,
    "job.started": SchedulerService._on_status,
    "job.finished": SchedulerService._on_status,
    "job.failed": SchedulerService._on_status,
    "job.rejected": SchedulerService._on_status,
    "job.stopped": SchedulerService._on_status,
}


def _evaluation(e: ClusterEvaluation) -> dict:
    return {"cluster": e.cluster, "region": e.region, "passed": e.verdict.passed,
            "reason": e.verdict.reason.value if e.verdict.reason else "", "detail": e.verdict.detail,
            "scores": dict(e.scores), "total": e.total}


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
    """The cluster's immutable state; only nodes whose allocation changed are rebuilt."""
    snap = info.snapshot
    if info.index is None or len(info.nodes) != len(snap.nodes):
        info.nodes = [_node_state(n, info.alloc) for n in snap.nodes]
        info.position = {n.name: i for i, n in enumerate(snap.nodes)}
        info.index = ClusterIndex.build(tuple(info.nodes))
    else:
        for name in info.dirty_nodes:
            i = info.position.get(name)
            if i is not None:
                info.nodes[i] = _node_state(snap.nodes[i], info.alloc)
    info.dirty_nodes.clear()
    models = info.index.memory
    return ClusterState(
        name=info.name, region=info.region, zone=info.zone, nodes=tuple(info.nodes), maintenance=snap.maintenance,
        residency_tags=frozenset(snap.residency_tags), interconnect=snap.interconnect,
        prices={m: float(prices.gpu_hour(info.region, m)) for m in models},
        cpu_price_per_core_hour=float(prices.cpu_core_hour_in(info.region)), index=info.index)
