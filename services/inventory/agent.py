"""The region agent: one per cluster, beside it.

It publishes the cluster's inventory (snapshots) and heartbeats, consumes the placements for
its own cluster (``<p>.placements.<region>.<cluster>``, a durable consumer), checks each against
its own ledger of node allocations (the cluster's ground truth: a placement that does not fit is
refused with ``job.rejected``, never over-committed), launches it through a backend, and reports
``job.started`` / ``job.finished`` / ``job.failed`` / ``job.stopped``.

Restart: before consuming, the agent rebuilds its running set from its own history on the bus
(placements and status of its cluster), so jobs started before a crash keep running and end on
time. Status events have deterministic ids (job, attempt, shard, step): reporting twice is
harmless.

Seams: the rules (:meth:`ClusterAgent.handle`, :meth:`ClusterAgent.finish_due`, the
snapshots and heartbeats) publish through a :class:`~fedsched.ports.Publisher` and read the
business :class:`~fedsched.clock.Clock`; the bus itself is needed only by :meth:`ClusterAgent.run`
and :meth:`ClusterAgent.rebuild` (consumers). ``tests/unit/inventory/test_agent_cycles.py`` drives them
on fakes.

Backends implement :class:`Backend`; :class:`TraceBackend` runs jobs for the runtime recorded in
the trace (annotation ``trace.runtime_s``) on the business clock, ending them as the trace did
(``trace.outcome``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from fedsched import telemetry
from fedsched.bus import Bus, Delivery, DurableConsumer, StreamFollower
from fedsched.clock import Clock, to_datetime
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.errors import DecodeError
from fedsched.events import (Heartbeat, InventorySnapshot, JobPlaced, JobStatus, JobStop, NodeInventory, Subjects,
                             business_event_id, make_event)
from fedsched.events import Envelope, EventType
from fedsched.jobs import AttemptState, JobSpec
from fedsched.ports import Publisher
from services.inventory.trace import ClusterDef

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.agent")

WHOLE = 1000


@dataclass
class NodeLedger:
    """Allocations on one node (milli-GPU per device, milli-CPU, MiB)."""

    inv: NodeInventory
    gpu_free: list[int]
    cpu_free: int
    mem_free: int


@dataclass(frozen=True, slots=True)
class AttemptRef:
    """The routing names of one job attempt (what status events carry in their envelope)."""

    job_id: str
    attempt: int
    tenant: str
    project: str
    policy_version: str = ""

    @classmethod
    def of(cls, env) -> "AttemptRef":
        """From the envelope of the placement."""
        return cls(env.job_id, env.attempt, env.tenant, env.project, env.policy_version)


@dataclass
class RunningJob:
    """A job attempt this agent runs."""

    ref: AttemptRef
    shard: int
    spec: JobSpec
    placed: JobPlaced
    started_at: float
    ends_at: float | None
    outcome: AttemptState
    trace_headers: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.ref.job_id, self.ref.attempt, self.shard)


class Backend(Protocol):
    """How an agent runs work on its cluster."""

    def nodes(self) -> list[NodeInventory]:
        """The cluster's nodes with capacity (free fields are filled in by the agent)."""
        ...

    def plan(self, spec: JobSpec, started_at: float, *, attempt: int = 1, resume_from_s: float = 0.0
             ) -> tuple[float | None, AttemptState]:
        """When a job attempt started at ``started_at`` will end (None = until stopped) and how
        (:attr:`AttemptState.SUCCEEDED` or :attr:`AttemptState.FAILED`); ``resume_from_s`` of
        work is already done."""
        ...


class TraceBackend:
    """Nodes from a trace node list; jobs run for their recorded runtime on the business clock.

    Annotations it reads (the scheduler never does): ``trace.runtime_s`` (how long the job
    runs; default its estimate), ``trace.outcome`` (``failed`` ends every attempt in failure,
    as the trace's Failed pods did), and for failure drills ``trace.fail_attempts`` (the first N
    attempts fail after ``trace.fail_after_s`` seconds, default 0). A resumed attempt runs only
    the rest: runtime - ``resume_from_s``.

    Args:
        nodes: the cluster's nodes (from :func:`~services.inventory.trace.split_nodes`).
        rdma: whether nodes sit on an RDMA fabric.
    """

    def __init__(self, nodes, *, rdma: bool = False) -> None:
        self._nodes = [
            NodeInventory(name=n.name.lower(), card_model=n.card_model, gpus=n.gpus, gpu_memory_gib=n.gpu_memory_gib,
                          gpu_free_milli=(WHOLE,) * n.gpus, cpu_milli=n.cpu_milli, cpu_free_milli=n.cpu_milli,
                          memory_mib=n.memory_mib, memory_free_mib=n.memory_mib, healthy=True, rdma=rdma)
            for n in nodes
        ]

    def nodes(self) -> list[NodeInventory]:
        return list(self._nodes)

    def plan(self, spec: JobSpec, started_at: float, *, attempt: int = 1, resume_from_s: float = 0.0
             ) -> tuple[float | None, AttemptState]:
        ann = spec.annotations
        runtime = _seconds(ann.get("trace.runtime_s"), spec.estimated_duration_s)
        if attempt <= int(_seconds(ann.get("trace.fail_attempts"), 0) or 0):
            return started_at + (_seconds(ann.get("trace.fail_after_s"), 0.0) or 0.0), AttemptState.FAILED
        outcome = AttemptState.FAILED if ann.get("trace.outcome") == AttemptState.FAILED else AttemptState.SUCCEEDED
        if runtime is None:
            return None, outcome
        return started_at + max(0.0, runtime - resume_from_s), outcome


def _seconds(raw: str | None, default):
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return max(0.0, value) if value == value else default


class ClusterAgent:
    """The agent of one cluster.

    Args:
        bus: NATS connection; needed only by :meth:`run` / :meth:`rebuild` (None for an agent
            driven by hand through :meth:`handle` and :meth:`finish_due`).
        clock: business clock.
        publisher: where its events go (default: ``bus``).
        subjects: subject names (default: ``bus.subjects``).
        cluster: which cluster (names, fabric, residency tags).
        backend: how work runs.
        heartbeat_interval_s: wall seconds between heartbeats.
        snapshot_every: a full inventory snapshot every this many heartbeats, and at once when
            capacity or health changes (allocations are not capacity: the scheduler tracks its own
            placements; snapshots carry free resources for reconciliation and the capacity log).
        tick_s: wall seconds between checks for jobs that ended.
    """

    def __init__(self, bus: Bus | None, clock: Clock, cluster: ClusterDef, backend: Backend, *,
                 publisher: Publisher | None = None, subjects: Subjects | None = None,
                 heartbeat_interval_s: float = 1.0, snapshot_every: int = 10, tick_s: float = 0.01) -> None:
        if bus is None and (publisher is None or subjects is None):
            raise ValueError("an agent without a bus needs a publisher and subjects")
        self.bus = bus
        self.publisher: Publisher = publisher if publisher is not None else bus
        self.subjects: Subjects = subjects if subjects is not None else bus.subjects
        self.clock = clock
        self.cluster = cluster
        self.backend = backend
        self.heartbeat_interval_s = heartbeat_interval_s
        self.snapshot_every = snapshot_every
        self.tick_s = tick_s
        self.producer = f"agent/{cluster.name}"
        self.ledger: dict[str, NodeLedger] = {
            n.name: NodeLedger(n, list(n.gpu_free_milli), n.cpu_milli, n.memory_mib) for n in backend.nodes()}
        self.running: dict[tuple[str, int, int], RunningJob] = {}
        self.done: set[tuple[str, int, int]] = set()
        self.sequence = 0
        self._changed = asyncio.Event()  # capacity or health changed: snapshot at the next beat
        self._stop = asyncio.Event()
        self._consumer: DurableConsumer | None = None
        self.paused = False  # failure drills: a paused agent stops heartbeating
        self.holding = False  # failure drills: a holding agent takes no placements
        self.silent = False  # failure drills: a silent agent is cut off (go_silent / resume)
        self._spawned: list[asyncio.Task] = []  # consumers restarted by resume()
        #: events of types this build does not know (a newer scheduler), skipped, not dead-lettered
        self.skipped = SkippedTypes(f"agent-{cluster.name}")

    @property
    def durable(self) -> str:
        """Durable consumer name of this agent."""
        return f"agent-{self.cluster.name}"

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Rebuild, then consume placements, heartbeat and end jobs until :meth:`stop`."""
        await self.rebuild()
        self._consumer = DurableConsumer(
            self.bus, "EVENTS", self.durable, [self.subjects.placements(self.cluster.region, self.cluster.name)],
            self.handle, batch=64, max_wait_s=0.2)
        await self.publish_snapshot()
        if self.holding:
            self._consumer.stop()
        tasks = [asyncio.create_task(self._consumer.run(), name=f"{self.durable}-consumer"),
                 asyncio.create_task(self._heartbeats(), name=f"{self.durable}-heartbeat"),
                 asyncio.create_task(self._ticker(), name=f"{self.durable}-ticker")]
        try:
            await self._stop.wait()
        finally:
            self._consumer.stop()
            tasks += self._spawned
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    # ------------------------------------------------------------------ drills

    def hold_placements(self) -> None:
        """Drill: stop taking placements (they stay on the bus, unacknowledged) -- a cluster
        that is alive but does not start work."""
        self.holding = True
        if self._consumer is not None:
            self._consumer.stop()

    def go_silent(self) -> None:
        """Drill: the cluster is cut off from the federation -- no heartbeats, snapshots or
        status events, no placements or stop orders taken (they wait on the bus) -- while the
        jobs it runs keep running. Their ends are reported after :meth:`resume`."""
        self.silent = True
        self.paused = True
        if self._consumer is not None:
            self._consumer.stop()

    def resume(self) -> None:
        """Drill: the cut-off cluster is back: it heartbeats, takes the placements and stop
        orders that waited for it (a stop order of an attempt declared lost meanwhile among
        them) and reports what ended while it was away."""
        self.silent = False
        self.paused = False
        self._changed.set()  # a snapshot at the next beat
        if self._consumer is not None and not self.holding and not self._stop.is_set():
            self._consumer = DurableConsumer(
                self.bus, "EVENTS", self.durable, [self.subjects.placements(self.cluster.region, self.cluster.name)],
                self.handle, batch=64, max_wait_s=0.2)
            self._spawned.append(asyncio.create_task(self._consumer.run(), name=f"{self.durable}-consumer"))

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Drill: mark a node (un)healthy; the next heartbeat carries a fresh snapshot."""
        ledger = self.ledger[node]
        ledger.inv = ledger.inv.model_copy(update={"healthy": healthy})
        self._changed.set()

    async def rebuild(self) -> None:
        """Restore the running set from this cluster's placements and status on the bus."""
        placements: dict[tuple[str, int, int], tuple[Delivery, JobPlaced]] = {}
        started: dict[tuple[str, int, int], float] = {}

        def on_placed(d: Delivery, env: Envelope) -> None:
            p = env.payload_as(JobPlaced)
            placements[(env.job_id, env.attempt, p.shard)] = (d, p)

        def on_started(d: Delivery, env: Envelope) -> None:
            s = env.payload_as(JobStatus)
            started[(env.job_id, env.attempt, s.shard)] = env.occurred_at.timestamp()

        def on_ended(d: Delivery, env: Envelope) -> None:
            s = env.payload_as(JobStatus)
            self.done.add((env.job_id, env.attempt, s.shard))

        folds = {"placed": on_placed, "started": on_started, "ended": on_ended}

        def fold(d: Delivery) -> None:
            env = d.envelope
            if env.cluster != self.cluster.name:
                return
            kind = REBUILD_EVENTS.route(env.type, self.skipped)
            if kind is not None:
                folds[kind](d, env)

        # one fixed-name, single-filter consumer per subject: NATS permissions can confine an agent
        # to exactly these (see deploy/nats/accounts.conf)
        followers = [StreamFollower(self.bus, "EVENTS", fold, name=f"{self.durable}-rebuild-{kind}", filter_subjects=[subject],
                                    fixed_name=True)
                     for kind, subject in (("p", self.subjects.placements(self.cluster.region, self.cluster.name)),
                                           ("s", self.subjects.status(self.cluster.region, self.cluster.name)))]
        tasks = [asyncio.create_task(f.run()) for f in followers]
        for f in followers:
            await f.caught_up.wait()
            f.stop()
        await asyncio.gather(*tasks)
        for f in followers:
            await f.delete()
        for key, at in started.items():
            if key in self.done or key not in placements:
                continue
            d, placed = placements[key]
            env = d.envelope
            if not self._fits(placed):
                log.error("%s: rebuilt job %s does not fit the ledger; skipping", self.producer, key)
                continue
            self._allocate(placed, +1)
            ends_at, outcome = self.backend.plan(placed.spec, at, attempt=env.attempt, resume_from_s=placed.resume_from_s)
            self.running[key] = RunningJob(AttemptRef.of(env), placed.shard, placed.spec, placed, at, ends_at, outcome,
                                           d.headers)
        if self.running:
            log.info("%s: resumed %d running job(s)", self.producer, len(self.running))

    # ------------------------------------------------------------------ placements

    async def handle(self, deliveries: list[Delivery]) -> None:
        """Handle placements and stop orders for this cluster (the durable consumer's handler).

        Raises:
            DecodeError: an event type the agent does not handle (dead-lettered).
        """
        for d in deliveries:
            env = d.envelope
            # continue the job's trace: status events carry this span's context
            with tracer.start_as_current_span(f"agent.{env.type}", context=telemetry.context_from(d.headers),
                                              attributes={"job_id": env.job_id, "cluster": self.cluster.name}):
                handler = PLACEMENT_EVENTS.route(env.type, self.skipped)
                if handler is not None:
                    await handler(self, d)
                elif env.known_type is not None:  # a known type that has no business here
                    raise DecodeError(f"agent does not handle {env.type!r}")

    async def _handle_placed(self, d: Delivery) -> None:
        await self._on_placed(d, d.envelope.payload_as(JobPlaced))

    async def _handle_stop(self, d: Delivery) -> None:
        await self._on_stop(d, d.envelope.payload_as(JobStop))

    async def _on_placed(self, d: Delivery, placed: JobPlaced) -> None:
        env = d.envelope
        key = (env.job_id, env.attempt, placed.shard)
        if key in self.running or key in self.done:
            return  # redelivery: already handled
        problem = self._check(placed)
        now = self.clock.time()
        if problem:
            self.done.add(key)
            await self._status(EventType.JOB_REJECTED, AttemptRef.of(env), placed, now, reason=problem, headers=d.headers)
            return
        self._allocate(placed, +1)
        ends_at, outcome = self.backend.plan(placed.spec, now, attempt=env.attempt, resume_from_s=placed.resume_from_s)
        job = RunningJob(AttemptRef.of(env), placed.shard, placed.spec, placed, now, ends_at, outcome, d.headers)
        self.running[key] = job
        await self._status(EventType.JOB_STARTED, job.ref, placed, now, started_at=now, headers=d.headers)

    async def _on_stop(self, d: Delivery, stop: JobStop) -> None:
        env = d.envelope
        key = (env.job_id, env.attempt, stop.shard)
        job = self.running.pop(key, None)
        if job is None:
            self.done.add(key)  # stop before start (or after end): nothing runs
            return
        self._allocate(job.placed, -1)
        self.done.add(key)
        now = self.clock.time()
        progress = job.placed.resume_from_s
        if stop.checkpoint_interval_s > 0 and job.spec.checkpointable:  # resumes from its last checkpoint
            done_here = max(0.0, now - job.started_at)
            progress += done_here // stop.checkpoint_interval_s * stop.checkpoint_interval_s
        await self._status(EventType.JOB_STOPPED, job.ref, job.placed, now, started_at=job.started_at, reason=stop.reason,
                           headers=d.headers, progress_s=progress)

    def _check(self, placed: JobPlaced) -> str:
        """"" if the placement fits the ledger, else why not."""
        spec = placed.spec
        if len(placed.bindings) != spec.workers:
            return f"placement binds {len(placed.bindings)} workers, job has {spec.workers}"
        need: dict[tuple[str, int], int] = {}
        cpu: dict[str, int] = {}
        mem: dict[str, int] = {}
        for b in placed.bindings:
            node = self.ledger.get(b.node)
            if node is None:
                return f"node {b.node} is not in cluster {self.cluster.name}"
            if not node.inv.healthy:
                return f"node {b.node} is not healthy"
            if spec.gpus_per_worker and node.inv.card_model not in (placed.card_model,):
                return f"node {b.node} has {node.inv.card_model}, placement says {placed.card_model}"
            if len(b.gpu_indices) != spec.gpus_per_worker:
                return f"worker {b.worker} bound to {len(b.gpu_indices)} GPUs, needs {spec.gpus_per_worker}"
            for i in b.gpu_indices:
                if not 0 <= i < len(node.gpu_free):
                    return f"node {b.node} has no GPU {i}"
                need[(b.node, i)] = need.get((b.node, i), 0) + b.gpu_milli
            cpu[b.node] = cpu.get(b.node, 0) + b.cpu_milli
            mem[b.node] = mem.get(b.node, 0) + b.memory_mib
        for (node, i), milli in need.items():
            if self.ledger[node].gpu_free[i] < milli:
                return f"GPU {i} of {node} has {self.ledger[node].gpu_free[i]}m free, needs {milli}m"
        for node, c in cpu.items():
            if self.ledger[node].cpu_free < c:
                return f"{node} has {self.ledger[node].cpu_free}m CPU free, needs {c}m"
        for node, m in mem.items():
            if self.ledger[node].mem_free < m:
                return f"{node} has {self.ledger[node].mem_free} MiB free, needs {m} MiB"
        return ""

    def _fits(self, placed: JobPlaced) -> bool:
        return self._check(placed) == ""

    def _allocate(self, placed: JobPlaced, sign: int) -> None:
        for b in placed.bindings:
            node = self.ledger[b.node]
            for i in b.gpu_indices:
                node.gpu_free[i] -= sign * b.gpu_milli
            node.cpu_free -= sign * b.cpu_milli
            node.mem_free -= sign * b.memory_mib

    async def _status(self, type_: EventType, ref: AttemptRef, placed: JobPlaced, at: float, *, started_at: float | None = None,
                      reason: str = "", headers: dict[str, str] | None = None, progress_s: float = 0.0) -> None:
        spec = placed.spec
        step = {EventType.JOB_STARTED: "started", EventType.JOB_REJECTED: "rejected"}.get(type_, "ended")
        payload = JobStatus(
            card_model=placed.card_model, gpu_milli=spec.total_gpu_milli, cpu_milli=spec.cpu_milli * spec.workers,
            memory_mib=spec.memory_mib * spec.workers, started_at=to_datetime(started_at) if started_at else None,
            reason=reason, shard=placed.shard, data_version=spec.annotations.get("data.version", ""),
            kind=spec.kind.value, cross_region=placed.cross_region, progress_s=progress_s,
        )
        event = make_event(
            type_, payload, producer=self.producer, occurred_at=at,
            event_id=business_event_id(ref.job_id, ref.attempt, placed.shard, step),
            region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name, tenant=ref.tenant,
            project=ref.project, job_id=ref.job_id, attempt=ref.attempt, actor=self.producer,
            policy_version=ref.policy_version)
        # inside a span (placement handling) the current context wins; for jobs ending later the
        # placement's trace context is carried over explicitly
        current = telemetry.current_trace_id()
        tp = {} if current else {k: v for k, v in (headers or {}).items() if k in ("traceparent", "tracestate")}
        await self.publisher.publish(self.subjects.status(self.cluster.region, self.cluster.name), event, headers=tp)

    # ------------------------------------------------------------------ time

    async def _ticker(self) -> None:
        while not self._stop.is_set():
            if not self.silent:
                await self.finish_due()
            await asyncio.sleep(self.tick_s)

    async def finish_due(self) -> int:
        """End every running job whose end time has come; returns how many ended."""
        now = self.clock.time()
        due = sorted((j for j in self.running.values() if j.ends_at is not None and j.ends_at <= now),
                     key=lambda j: j.ends_at)
        for job in due:
            self.running.pop(job.key, None)
            self._allocate(job.placed, -1)
            self.done.add(job.key)
            failed = job.outcome == AttemptState.FAILED
            type_ = EventType.JOB_FAILED if failed else EventType.JOB_FINISHED
            await self._status(type_, job.ref, job.placed, job.ends_at, started_at=job.started_at,
                               reason="exited with failure (trace outcome)" if failed else "",
                               headers=job.trace_headers)
        return len(due)

    async def _heartbeats(self) -> None:
        beats = 0
        while not self._stop.is_set():
            if not self.paused:
                try:
                    if beats % self.snapshot_every == 0 or self._changed.is_set():
                        self._changed.clear()
                        await self.publish_snapshot()
                    await self.publish_heartbeat()
                except Exception as e:  # noqa: BLE001 - keep beating through bus trouble
                    log.info("%s: heartbeat failed: %r", self.producer, e)
                beats += 1
            await asyncio.sleep(self.heartbeat_interval_s)

    def snapshot(self) -> InventorySnapshot:
        """The cluster's inventory now."""
        nodes = tuple(
            l.inv.model_copy(update={"gpu_free_milli": tuple(l.gpu_free), "cpu_free_milli": l.cpu_free,
                                     "memory_free_mib": l.mem_free})
            for l in self.ledger.values())
        return InventorySnapshot(
            nodes=nodes, running=tuple(sorted(f"{j}/{a}/{s}" for j, a, s in self.running)),
            storage_tier=self.cluster.storage_tier, interconnect=self.cluster.interconnect,
            residency_tags=self.cluster.residency_tags, sequence=self.sequence)

    async def publish_snapshot(self) -> None:
        """Publish a full inventory snapshot (in a new root trace: nothing traced caused it)."""
        self.sequence += 1
        event = make_event(EventType.INVENTORY_SNAPSHOT, self.snapshot(), producer=self.producer, occurred_at=self.clock.time(),
                           region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name,
                           actor=self.producer)
        with telemetry.root_span("agent.inventory.snapshot", cluster=self.cluster.name):
            await self.publisher.publish(self.subjects.inventory(self.cluster.region, self.cluster.name), event)

    async def publish_heartbeat(self) -> None:
        """Publish a heartbeat with totals (in a new root trace)."""
        self.sequence += 1
        payload = Heartbeat(sequence=self.sequence, gpus_total=sum(len(l.gpu_free) for l in self.ledger.values()),
                            gpu_milli_free=sum(sum(l.gpu_free) for l in self.ledger.values()),
                            running_jobs=len(self.running))
        event = make_event(EventType.INVENTORY_HEARTBEAT, payload, producer=self.producer, occurred_at=self.clock.time(),
                           region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name,
                           actor=self.producer)
        with telemetry.root_span("agent.inventory.heartbeat", cluster=self.cluster.name):
            await self.publisher.publish(self.subjects.heartbeat(self.cluster.region, self.cluster.name), event)


#: The agent's consumer of its placements subject: placements and stop orders. Another known
#: type there is dead-lettered (it has no business on that subject); an unknown one is skipped.
PLACEMENT_EVENTS: EventTable = EventTable({
    EventType.JOB_PLACED: ClusterAgent._handle_placed,
    EventType.JOB_STOP: ClusterAgent._handle_stop,
})

#: The agent's rebuild (its placements and status subjects): which fold of ``Agent.rebuild`` an
#: event takes. Every terminal status ends the attempt; ``job.cancelled`` is the scheduler's, for
#: a job that never held resources here (it is published on the decisions subject).
REBUILD_EVENTS: EventTable = EventTable({
    EventType.JOB_PLACED: "placed",
    EventType.JOB_STARTED: "started",
    EventType.JOB_FINISHED: "ended",
    EventType.JOB_FAILED: "ended",
    EventType.JOB_STOPPED: "ended",
    EventType.JOB_REJECTED: "ended",
}, ignores=frozenset({EventType.JOB_STOP, EventType.JOB_CANCELLED}))
