"""The scheduler service: keeps the global resource view and runs the pure core on it.

State is rebuilt from the bus on start (event sourcing): the job events on ``P_EVENTS`` from
the first sequence (submissions, its own placements, agents' status) and the newest inventory of
every cluster. Then it follows both streams and runs a cycle whenever something changed:

1. build the :class:`~services.scheduler.core.View` (inventory capacity minus the allocations of
   placed and running jobs; heartbeat ages) and the queue;
2. ``decide(view, queue, policy)`` -- pure;
3. publish placements to each cluster's subject and changed pending reasons (one pipelined
   batch, message id = (job, attempt) so a retried publish is never a second placement);
4. update local state only for what JetStream acknowledged.

Its own placement events come back through the follower; applying them is a no-op (same
attempt), so local write-through state and the rebuilt state agree.

A status endpoint (core NATS request/reply on ``<p>.svc.scheduler.status``) reports the applied
stream sequence and queue sizes; the replay driver uses it to detect quiescence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, StreamFollower
from fedsched.clock import Clock
from fedsched.events import (Envelope, InventorySnapshot, JobPending, JobPlaced, JobStatus, JobStop, JobSubmitted,
                             WorkerBinding, business_event_id, make_event)
from fedsched.jobs import JobSpec
from fedsched.policystore import PolicyFollower, PolicyHolder
from fedsched.pricing import PriceCatalog
from services.scheduler.approvals import Governor
from services.scheduler.core import (ClusterEvaluation, ClusterIndex, ClusterState, NodeState, Pending, Placement,
                                     Policy, QueuedJob, View, decide)

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.scheduler")


@dataclass
class JobEntry:
    """The scheduler's record of one job.

    Attributes:
        state: ``queued``, ``placed``, ``running`` or ``done``.
        attempt: number of the latest placement (0 = never placed).
        failures: failed attempts so far (retry budget: ``spec.retry_limit``).
        avoid: clusters where an attempt failed (failover prefers others).
        placed: the current placement (its bindings are allocated while placed/running).
        headers: trace context of the submission (placements continue that trace).
        pending_reason: the last published pending summary.
        unplaceable: the last decision found no cluster that could hold it even if empty.
    """

    job_id: str
    tenant: str
    project: str
    spec: JobSpec
    submitted_at: float
    state: str = "queued"
    attempt: int = 0
    failures: int = 0
    avoid: set[str] = field(default_factory=set)
    cluster: str = ""
    region: str = ""
    placed: JobPlaced | None = None
    headers: dict[str, str] = field(default_factory=dict)
    pending_reason: str = ""
    unplaceable: bool = False
    cancel_requested: bool = False
    stop_sent: bool = False


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
        stale_after_s: wall seconds after which a silent cluster is excluded.
        interval_s: minimum wall seconds between cycles.
    """

    def __init__(self, bus: Bus, clock: Clock, policy: Policy, prices: PriceCatalog, *,
                 stale_after_s: float = 10.0, interval_s: float = 0.02) -> None:
        self.bus = bus
        self.clock = clock
        self.policy = policy
        self.prices = prices
        self.stale_after_s = stale_after_s
        self.interval_s = interval_s
        self.jobs: dict[str, JobEntry] = {}
        self.counts = {"queued": 0, "placed": 0, "running": 0, "done": 0}
        self.queued: dict[str, JobEntry] = {}
        self.cancelling: dict[str, JobEntry] = {}
        self.clusters: dict[str, ClusterInfo] = {}
        self.applied_seq = 0
        self.cycles = 0
        self.last_cycle_ms = 0.0
        self.busy = False
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
        # governance (quotas, cross-region modes, approvals): services/scheduler/approvals.py
        self.base_policy = policy
        self.policy_holder = PolicyHolder()
        self.governor = Governor(self.policy_holder, bus.subjects, prices)
        self._policy_follower = PolicyFollower(bus, self.policy_holder, name="scheduler-policy")

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Rebuild from the bus, then schedule until :meth:`stop`."""
        tasks = [asyncio.create_task(self._events.run(), name="scheduler-events"),
                 asyncio.create_task(self._inventory.run(), name="scheduler-inventory"),
                 asyncio.create_task(self._policy_follower.run(), name="scheduler-policy")]
        self._status_sub = await self.bus.nc.subscribe(f"{self.bus.prefix}.svc.scheduler.status", cb=self._on_status_request)
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
                    pass  # periodic cycle: staleness, aging
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
                await self._status_sub.unsubscribe()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()
        self._dirty.set()

    def _set(self, job: JobEntry, state: str) -> None:
        """Move ``job`` to ``state``, keeping the counts and the queue index current."""
        self.counts[job.state] -= 1
        self.counts[state] += 1
        job.state = state
        if state == "queued":
            self.queued[job.job_id] = job
        else:
            self.queued.pop(job.job_id, None)
        if state == "done":
            self.cancelling.pop(job.job_id, None)

    def status(self) -> dict:
        """Counts for dashboards and the replay driver's quiescence check."""
        counts = dict(self.counts)
        unplaceable = sum(1 for j in self.queued.values() if j.unplaceable)
        return {"applied_seq": self.applied_seq, "dirty": self._dirty.is_set(), "busy": self.busy, "cycles": self.cycles,
                "last_cycle_ms": round(self.last_cycle_ms, 2), "unplaceable": unplaceable,
                "clusters": len(self.clusters), "stale": sorted(self._stale), "policy": self.policy.version, **counts}

    async def _on_status_request(self, msg) -> None:
        await msg.respond(json.dumps(self.status()).encode())

    # ------------------------------------------------------------------ state from events

    def _apply_event(self, d: Delivery) -> None:
        self.applied_seq = d.stream_sequence
        env = d.envelope
        handler = _EVENT_HANDLERS.get(env.type)
        if handler is not None:
            handler(self, env, d)
        if self.governor.apply(env):  # governance: approval requests and outcomes
            self._dirty.set()

    def _on_submitted(self, env: Envelope, d: Delivery) -> None:
        if env.job_id in self.jobs:
            return
        sub = env.payload_as(JobSubmitted)
        job = JobEntry(env.job_id, env.tenant, env.project, sub.spec, env.occurred_at.timestamp(),
                       headers={k: v for k, v in d.headers.items() if k in ("traceparent", "tracestate")})
        self.jobs[env.job_id] = job
        self.counts["queued"] += 1
        self.queued[job.job_id] = job
        self._dirty.set()

    def _on_cancel(self, env: Envelope, d: Delivery) -> None:
        job = self.jobs.get(env.job_id)
        if job is None or job.state == "done":
            return
        job.cancel_requested = True
        self.cancelling[job.job_id] = job
        self._dirty.set()

    def _on_placed(self, env: Envelope, d: Delivery) -> None:
        job = self.jobs.get(env.job_id)
        if job is None or env.attempt <= job.attempt:
            return  # our own write-through, or a stale duplicate
        placed = env.payload_as(JobPlaced)
        self._bind(job, env.attempt, env.cluster, env.region, placed)

    def _on_status(self, env: Envelope, d: Delivery) -> None:
        job = self.jobs.get(env.job_id)
        if job is None or env.attempt != job.attempt or job.state in ("done",):
            return
        if env.type == "job.cancelled":
            self._set(job, "done")
            return
        if job.state == "queued":
            return  # status of an attempt we already gave up on
        if env.type == "job.started":
            self._set(job, "running")
            return
        self._unbind(job)
        if env.type == "job.finished":
            self._set(job, "done")
        elif env.type == "job.failed":
            job.failures += 1
            if job.failures <= job.spec.retry_limit and not job.cancel_requested:
                job.avoid.add(env.cluster)
                self._set(job, "queued")
            else:
                self._set(job, "done")
        elif env.type == "job.rejected":
            self._set(job, "done" if job.cancel_requested else "queued")
        elif env.type == "job.stopped":
            reason = env.payload_as(JobStatus).reason
            self._set(job, "done" if reason == "cancelled" or job.cancel_requested else "queued")
        self._dirty.set()

    def _bind(self, job: JobEntry, attempt: int, cluster: str, region: str, placed: JobPlaced) -> None:
        if job.placed is not None:
            self._unbind(job)
        job.attempt = attempt
        job.cluster, job.region = cluster, region
        job.placed = placed
        self._set(job, "placed")
        job.unplaceable = False
        info = self.clusters.get(cluster)
        if info is not None:
            _allocate(info, placed, +1)

    def _unbind(self, job: JobEntry) -> None:
        if job.placed is None:
            return
        info = self.clusters.get(job.cluster)
        if info is not None:
            _allocate(info, job.placed, -1)
        job.placed = None

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
            for job in self.jobs.values():  # placements made before this inventory arrived
                if job.placed is not None and job.cluster == env.cluster:
                    _allocate(info, job.placed, +1)
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
        clusters = []
        for info in sorted(self.clusters.values(), key=lambda c: c.name):
            age = now_mono - info.seen_mono
            stale = age > self.stale_after_s
            if stale and info.name not in self._stale:
                self._stale.add(info.name)
                log.warning("scheduler: cluster %s is stale (%.1fs since last heartbeat)", info.name, age)
            if info.cached is None:
                info.cached = _cluster_state(info, self.prices)
            clusters.append(replace(info.cached, heartbeat_age_s=age))
        return View(tuple(clusters), self.clock.time(), self.stale_after_s)

    def queue(self) -> list[QueuedJob]:
        """Jobs waiting for a placement."""
        return [QueuedJob(j.job_id, j.attempt + 1, j.spec, j.submitted_at, frozenset(j.avoid))
                for j in self.queued.values() if not j.cancel_requested]

    async def cycle(self) -> None:
        """One scheduling cycle (see the module docstring)."""
        t0 = time.perf_counter()
        self.policy = self.governor.effective_policy(self.base_policy)  # governance: weights, quota filter
        await self._cancellations()
        expired = self.governor.expiries(self.jobs, self.clock.time())  # governance: approval timeouts
        if expired:
            await self.bus.publish_many(expired)
        queue = self.queue()
        if not queue or not self.clusters:
            return
        view = self.view()
        view = replace(view, quota=self.governor.quota_book(self.jobs.values()))  # governance: quota usage
        queue = self.governor.narrow(queue, view)  # governance: awaiting approval, home-only, quota room
        with tracer.start_as_current_span("scheduler.cycle", attributes={"queue": len(queue)}):
            decisions = decide(view, queue, self.policy)
        decisions, requests = self.governor.gate(decisions, self.jobs, view, self.clock.time())  # governance
        items = []
        for p in decisions.placements:
            items.append(self._placement_event(p, decisions.policy_version))
        pending_items = []
        for pend in decisions.pending:
            job = self.jobs[pend.job.job_id]
            job.unplaceable = not pend.fits_empty
            if pend.reason != job.pending_reason:
                pending_items.append((job, pend.reason, self._pending_event(pend, decisions.policy_version)))
        results = await self.bus.publish_many([(s, e, h) for _, s, e, h in items] +
                                              [(s, e, h) for _, _, (s, e, h) in pending_items] + requests)
        if requests:  # governance: the jobs whose approval request was acknowledged now wait
            self.governor.confirm(requests, results[len(items) + len(pending_items):])
        for (p, _, env, _), ok in zip(items, results):
            if ok:
                job = self.jobs[p.job.job_id]
                self._bind(job, p.job.attempt, p.cluster, p.region, env.payload_as(JobPlaced))
        for (job, reason, _), ok in zip(pending_items, results[len(items):]):
            if ok:
                job.pending_reason = reason
        self.cycles += 1
        self.last_cycle_ms = (time.perf_counter() - t0) * 1000
        if decisions.placements:
            log.debug("cycle %d: %d placed, %d pending, %.1f ms", self.cycles, len(decisions.placements),
                      len(decisions.pending), self.last_cycle_ms)

    async def _cancellations(self) -> None:
        for job in list(self.cancelling.values()):
            if job.state == "done":
                continue
            if job.state == "queued":
                event = make_event("job.cancelled", JobStatus(reason="cancelled before placement"), producer="scheduler",
                                   occurred_at=self.clock.time(), event_id=business_event_id(job.job_id, "cancelled"),
                                   tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=job.attempt,
                                   actor="scheduler", policy_version=self.policy.version)
                await self.bus.publish(self.bus.subjects.decisions(job.tenant, job.project), event, headers=job.headers)
                self._set(job, "done")
            elif job.placed is not None and not job.stop_sent:
                info = self.clusters.get(job.cluster)
                event = make_event("job.stop", JobStop(reason="cancelled", shard=job.placed.shard), producer="scheduler",
                                   occurred_at=self.clock.time(),
                                   event_id=business_event_id(job.job_id, job.attempt, "stop"),
                                   region=job.region, zone=info.zone if info else "", cluster=job.cluster,
                                   tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=job.attempt,
                                   actor="scheduler", policy_version=self.policy.version)
                await self.bus.publish(self.bus.subjects.placements(job.region, job.cluster), event, headers=job.headers)
                job.stop_sent = True

    def _placement_event(self, p: Placement, policy_version: str):
        job = self.jobs[p.job.job_id]
        payload = JobPlaced(
            spec=job.spec, card_model=p.card_model,
            bindings=tuple(WorkerBinding(worker=b.worker, node=b.node, gpu_indices=b.devices, gpu_milli=b.gpu_milli,
                                         cpu_milli=b.cpu_milli, memory_mib=b.memory_mib) for b in p.bindings),
            score=p.score, explanation=p.explanation, cross_region=p.cross_region, transfer_s=p.transfer_s,
            transfer_bytes=p.transfer_bytes, price_per_gpu_hour=p.price_per_gpu_hour, shard=p.job.shard,
            evaluations=tuple(_evaluation(e) for e in p.evaluations))
        event = make_event("job.placed", payload, producer="scheduler", occurred_at=self.clock.time(),
                           event_id=business_event_id(job.job_id, p.job.attempt, p.job.shard, "placed"),
                           region=p.region, zone=p.zone, cluster=p.cluster, tenant=job.tenant, project=job.project,
                           job_id=job.job_id, attempt=p.job.attempt, actor="scheduler", policy_version=policy_version)
        with tracer.start_as_current_span("scheduler.place", context=telemetry.context_from(job.headers),
                                          attributes={"job_id": job.job_id, "cluster": p.cluster}):
            headers = telemetry.inject_headers()
        return p, self.bus.subjects.placements(p.region, p.cluster), event, headers

    def _pending_event(self, pend: Pending, policy_version: str):
        job = self.jobs[pend.job.job_id]
        payload = JobPending(reason=pend.reason, reasons={e.cluster: str(e.verdict) for e in pend.evaluations},
                             fits_empty=pend.fits_empty, evaluations=tuple(_evaluation(e) for e in pend.evaluations))
        event = make_event("job.pending", payload, producer="scheduler", occurred_at=self.clock.time(),
                           tenant=job.tenant, project=job.project, job_id=job.job_id, attempt=job.attempt,
                           actor="scheduler", policy_version=policy_version)
        return self.bus.subjects.decisions(job.tenant, job.project), event, job.headers


_EVENT_HANDLERS = {
    "job.submitted": SchedulerService._on_submitted,
    "job.cancel_requested": SchedulerService._on_cancel,
    "job.placed": SchedulerService._on_placed,
    "job.started": SchedulerService._on_status,
    "job.finished": SchedulerService._on_status,
    "job.failed": SchedulerService._on_status,
    "job.rejected": SchedulerService._on_status,
    "job.stopped": SchedulerService._on_status,
    "job.cancelled": SchedulerService._on_status,
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
