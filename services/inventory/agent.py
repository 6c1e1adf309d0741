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

Backends implement :class:`~services.inventory.backend.Backend` (the attempt lifecycle: launch,
stop, status stream, list for reconcile, logs). The agent predicts nothing: it launches through
the backend and reports what the backend's status stream says (``job.started`` when RUNNING,
``job.finished`` / ``job.failed`` with exit code and reason when it ends). :class:`TraceBackend`
is a simulated cluster on the business clock: attempts run for the runtime recorded in the trace
(annotation ``trace.runtime_s``) and end as the trace did (``trace.outcome``).

Reconcile (:meth:`ClusterAgent.rebuild`): after restoring its ledger from the bus, the agent lists
what runs on its cluster under fedsched's labels and adopts what belongs to a live attempt (the
ledger's, not ended, not older than the newest attempt seen), stops what does not (``job.stopped``
reason ``orphaned`` or ``superseded``), and -- on a backend whose cluster does not outlive the agent
(``trace``) -- relaunches live attempts with their recorded start (so they end on time); on a
durable backend a live attempt the cluster no longer has is reported ``job.failed`` reason ``lost``.

Fencing by attempt: per (job, shard) the agent keeps the highest attempt number seen in
placements and stop orders; a placement of a lower attempt is refused (``job.rejected`` reason
``superseded``), a placement of a higher one stops the older attempt still running here
(``superseded``), and ``job.stop`` for attempt N stops N and anything older.

Fencing by scheduler lease (issue 14 item 9, :mod:`fedsched.lease`): the agent keeps the
``fencing_token``s seen on its placements and stop orders with where each first appears in the
stream (:class:`~fedsched.lease.StreamFencing`, restored by :meth:`ClusterAgent.rebuild`), and
before each batch of orders reads the lease's current tenure from the KV bucket
(:func:`~fedsched.lease.read_tenure`), so an agent that has seen no order of a new active
scheduler yet still knows its token. A placement or stop order preceded in the stream by one with
a higher token, or with a token below the current tenure's and stored after that tenure began -- a
former active scheduler's order (:func:`~fedsched.lease.stale_order`) -- is refused: dead-lettered
with the reason "stale fencing token" (``fed.deadletter.agent-<cluster>``, and from there
``bus.dead_letter`` in the audit log), never applied. Judged in stream order (an order handed back
during an outage and redelivered after a newer holder's is still carried out). An order with a
token above the current tenure's was issued by no tenure (:func:`~fedsched.lease.unissued`: a
forged order): dead-lettered with that reason and never taken as the highest token seen.
:meth:`ClusterAgent.rebuild` judges its history by the same rule, so a restarted agent does not
take such an order either.

Gangs: a node that fails (drill :meth:`ClusterAgent.set_node_health`, an inventory refresh showing
it unhealthy, or the backend reporting ``node_failed``) under any worker of a running attempt stops
the whole attempt (every worker) and reports ``job.failed`` reason ``node_failed`` with no exit
code; the scheduler requeues the gang as one unit within its retry limit.
"""

from __future__ import annotations

import asyncio
import heapq
import functools
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from fedsched import telemetry
from fedsched.bounded import RecentDict, RecentSet
from fedsched.bus import Bus, Delivery, DurableConsumer, StreamFollower
from fedsched.clock import Clock, SystemClock, to_datetime
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.errors import DecodeError, UnavailableError
from fedsched.metrics import AgentMetrics
from fedsched.events import (AgentReconciled, Heartbeat, InventorySnapshot, JobPlaced, JobStatus, JobStop, NodeInventory, Subjects,
                             business_event_id, make_event, random_event_id)
from fedsched.events import Envelope, EventType
from fedsched.jobs import AttemptState, JobSpec
from fedsched.lease import StreamFencing, Tenure, read_tenure, unissued
from fedsched.logs import LogReply, LogRequest, chunks
from fedsched.ports import Publisher, PublishResult
from services.inventory.backend import (NODE_FAILED, TERMINAL_PHASES, AttemptKey, AttemptNotFound, AttemptSpec,
                                        AttemptStatus, Backend, BackendError, NoLogsKept, ObservedAttempt,
                                        Phase)
from services.inventory.trace import ClusterDef

log = logging.getLogger(__name__)

#: seconds JetStream waits for an agent's ack of a placement or stop order before redelivering it.
#: The consumer reports progress every quarter of it while a handler runs (a slow ``sbatch`` or
#: pod create keeps its order), so a short wait only shortens recovery: orders an agent killed
#: -9 had fetched but not acknowledged reach its successor within about this long, not the
#: scheduler's reclaim of placements "never started".
PLACEMENT_ACK_WAIT_S = 5.0
tracer = telemetry.tracer("fedsched.agent")

WHOLE = 1000


class SharedReads:
    """One read shared by the callers that ask before it is sent (issue 15).

    The agents of one process (``up --processes`` runs every cluster's agent in one, each on a
    connection of its own) each read the scheduler lease before each batch of orders; the
    batches of one scheduler cycle arrive together, so their reads are asked in the same pass of
    the event loop. A caller joins the read in flight only while it has not started (its request
    not yet written): each caller's read is therefore made after the caller asked for it --
    after its batch was fetched, which is all the fencing rule needs
    (:func:`fedsched.lease.stale_order`: a tenure that began before an order was stored is in any
    read made after the order was fetched, on any connection to the federation's servers). The
    read is made with the ``read`` of the caller that asked first; a caller that asks once the
    read has started gets a new one.

    Attributes:
        calls: reads made (for the counting test).
        joined: callers served by a read another caller asked for first.
    """

    def __init__(self) -> None:
        self._next: asyncio.Task | None = None  # the read asked for and not started yet
        self.calls = 0
        self.joined = 0

    async def __call__(self, read: Callable[[], Awaitable[Tenure | None]]) -> Tenure | None:
        """The lease's tenure, read after this call was made.

        Raises:
            UnavailableError: as ``read`` (every caller sharing it gets it).
        """
        pending = self._next
        if pending is None or pending.done() or pending.get_loop() is not asyncio.get_running_loop():
            pending = self._next = asyncio.ensure_future(self._one(read))
        else:
            self.joined += 1
        return await asyncio.shield(pending)

    async def _one(self, read: Callable[[], Awaitable[Tenure | None]]) -> Tenure | None:
        self._next = None  # started: a caller from now on gets a read of its own
        self.calls += 1
        return await read()


#: NATS connection -> (subject prefix, JetStream domain) -> the shared reads of that lease made on
#: that connection (weak: a closed connection's entry goes with it)
_SHARED_READS: "weakref.WeakKeyDictionary[object, dict[tuple[str, str], SharedReads]]" = weakref.WeakKeyDictionary()


def shared_lease_reader(reads: SharedReads, bus: Bus) -> Callable[[], Awaitable[Tenure | None]]:
    """An agent's ``tenure`` (:class:`ClusterAgent`): the scheduler lease's tenure read through
    ``reads``, on ``bus``'s connection when this agent asks first. Give one ``reads`` only to
    agents of one federation (a runtime's agents, each on a connection of its own: ``up
    --processes`` runs every cluster's agent in one process, issue 15) -- a read made on one's
    connection is then valid for each of them (see :class:`SharedReads`)."""
    return functools.partial(reads, functools.partial(read_tenure, bus))


def shared_tenure_reads(bus: Bus) -> SharedReads:
    """The :class:`SharedReads` of the scheduler lease of ``bus``'s federation (its prefix and
    JetStream domain) on ``bus``'s NATS connection: agents sharing a connection share their
    reads; two connections never share one (two federations in one process may both use the
    default prefix, and a read made on one's connection says nothing of the other's lease)."""
    per_connection = _SHARED_READS.setdefault(bus.nc, {})
    return per_connection.setdefault((bus.prefix, bus.js_domain), SharedReads())


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


#: fields of a placement the agent never reads once it has taken it, left out of the copy a
#: running attempt keeps (:func:`kept_placement`)
_NOT_KEPT = {"evaluations": (), "explanation": "", "counterfactual": ""}


def kept_placement(placed: JobPlaced) -> JobPlaced:
    """What a running attempt keeps of its placement: ``placed`` without the scheduler's
    explanations (``evaluations``: a dict per cluster considered, ``explanation``,
    ``counterfactual``), which the agent never reads. The ledger lives as long as the attempt
    runs -- 100,000 of them in a large federation -- and the garbage collector walks every object
    it holds at each full collection (issue 15: ~40% of the agents process's CPU): the evaluations
    were 7 of the ~24 objects per running attempt. ``placed`` itself if it has none."""
    if not (placed.evaluations or placed.explanation or placed.counterfactual):
        return placed
    return placed.model_copy(update=_NOT_KEPT)


@dataclass(slots=True)
class RunningJob:
    """A job attempt this agent launched and has not seen end (its resources are held in the
    ledger). ``started_at`` is the business time the backend reported it RUNNING (None before).
    ``placed`` is the placement as :func:`kept_placement` keeps it; ``key`` is (job id, attempt,
    shard), made once (slots: one object per running attempt, no ``__dict__``)."""

    ref: AttemptRef
    shard: int
    spec: JobSpec
    placed: JobPlaced
    started_at: float | None
    trace_headers: dict[str, str] = field(default_factory=dict)
    key: tuple[str, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = (self.ref.job_id, self.ref.attempt, self.shard)

    @property
    def attempt_key(self) -> AttemptKey:
        return AttemptKey(self.ref.job_id, self.ref.attempt, self.shard)

    def attempt_spec(self) -> AttemptSpec:
        """What the backend launches (the placement's bindings, the spec with its workload)."""
        return AttemptSpec(self.attempt_key, self.ref.tenant, self.ref.project, self.spec, self.placed.card_model,
                           self.placed.bindings, self.placed.resume_from_s, self.started_at)


@dataclass(slots=True)
class _TraceAttempt:
    spec: AttemptSpec
    started_at: float
    ends_at: float | None
    outcome: AttemptState
    nodes: tuple[str, ...]


#: the step of a status event's business id (job, attempt, shard, step) by type; every other
#: status is its attempt's end
_STATUS_STEP = {EventType.JOB_STARTED: "started", EventType.JOB_REJECTED: "rejected"}

TRACE_FAILURE = "exited with failure (trace outcome)"  #: message of a trace attempt that fails
TRACE_NO_LOGS = ("the trace backend keeps no logs: attempt {key} ran no workload (a simulated run from a trace); "
                 "logs exist for attempts on kubernetes and slurm clusters")


class TraceBackend:
    """A simulated cluster: nodes from a trace node list; attempts run for their recorded runtime
    on the business clock. Implements :class:`~services.inventory.backend.Backend`.

    Annotations it reads (the scheduler never does): ``trace.runtime_s`` (how long the job
    runs; default its estimate), ``trace.outcome`` (``failed`` ends every attempt in failure,
    as the trace's Failed pods did; exit code 1), and for failure drills ``trace.fail_attempts``
    (the first N attempts fail after ``trace.fail_after_s`` seconds, default 0). A resumed
    attempt runs only the rest: runtime - ``resume_from_s``. The workload is accepted and ignored.

    Running attempts sit in a heap by end time: :meth:`ready` pops those due (no scan of all
    running attempts per tick). Launch reports PENDING and RUNNING at the launch time (or at
    ``AttemptSpec.started_at`` for a relaunch after an agent restart: ``durable`` is False, the
    simulated cluster lives in the agent's process).

    Args:
        nodes: the cluster's nodes (from :func:`~services.inventory.trace.split_nodes`).
        clock: the business clock (the cluster observes ends on it).
        rdma: whether nodes sit on an RDMA fabric.
        poll_s: wall seconds between checks for due ends in :meth:`events`.
    """

    kind = "trace"
    durable = False
    #: ended attempts remembered (for logs and idempotent launch), oldest forgotten first
    REMEMBER_ENDED = 4096

    def __init__(self, nodes, *, clock: Clock, rdma: bool = False, poll_s: float = 0.01) -> None:
        self.clock = clock
        self.poll_s = poll_s
        self._nodes: dict[str, NodeInventory] = {}
        for n in nodes:
            inv = n if isinstance(n, NodeInventory) else NodeInventory(
                name=n.name.lower(), card_model=n.card_model, gpus=n.gpus, gpu_memory_gib=n.gpu_memory_gib,
                gpu_free_milli=(WHOLE,) * n.gpus, cpu_milli=n.cpu_milli, cpu_free_milli=n.cpu_milli,
                memory_mib=n.memory_mib, memory_free_mib=n.memory_mib, healthy=True, rdma=rdma)
            self._nodes[inv.name] = inv
        self._live: dict[AttemptKey, _TraceAttempt] = {}
        self._ended: OrderedDict[AttemptKey, int] = OrderedDict()  # key -> workers
        self._on_node: dict[str, set[AttemptKey]] = {}
        self._heap: list[tuple[float, int, AttemptKey]] = []
        self._seq = 0
        self._queue: list[AttemptStatus] = []
        self._wake = asyncio.Event()
        #: heap entries the last :meth:`ready` popped (due ends and stale entries; never a scan)
        self.last_ready_visits = 0
        #: called (no arguments) when :meth:`next_due` may have moved earlier: a launch, a stop, a
        #: node failure (the agent's drain loop sleeps until then; see :meth:`ClusterAgent.next_tick_s`)
        self.on_change: Callable[[], None] | None = None

    # -- the Backend protocol

    async def inventory(self) -> list[NodeInventory]:
        return list(self._nodes.values())

    def nodes(self) -> list[NodeInventory]:
        """The nodes now, without waiting (the trace cluster is in memory)."""
        return list(self._nodes.values())

    def next_due(self) -> float | None:
        """Business time (s) from which :meth:`ready` may hand over a status: now when one is
        queued, else the earliest end on the heap (an attempt stopped since may have left its
        entry there: then earlier than needed, never later), None when no running attempt has an
        end (only a launch or a node failure changes that: both call :attr:`on_change`)."""
        if self._queue:
            return self.clock.time()
        return self._heap[0][0] if self._heap else None

    def _changed(self) -> None:
        self._wake.set()
        if self.on_change is not None:
            self.on_change()

    async def launch(self, attempt: AttemptSpec) -> None:
        key = attempt.key
        if key in self._live or key in self._ended:
            return  # already on the cluster (or ran there): adopt, never a second copy
        for b in attempt.bindings:
            if b.node not in self._nodes:
                raise BackendError(f"node {b.node} is not in this cluster", retryable=False)
        started = attempt.started_at if attempt.started_at is not None else self.clock.time()
        ends_at, outcome = self.plan(attempt.spec, started, attempt=key.attempt, resume_from_s=attempt.resume_from_s)
        nodes = tuple(b.node for b in attempt.bindings)
        self._live[key] = _TraceAttempt(attempt, started, ends_at, outcome, nodes)
        for n in set(nodes):
            self._on_node.setdefault(n, set()).add(key)
        self._queue.append(AttemptStatus(key, Phase.PENDING, started))
        self._queue.append(AttemptStatus(key, Phase.RUNNING, started))
        if ends_at is not None:
            self._seq += 1
            heapq.heappush(self._heap, (ends_at, self._seq, key))
        self._changed()

    async def stop(self, key: AttemptKey, reason: str) -> None:
        if key in self._live:
            self._end(key)  # every worker at once; its heap entry is skipped when popped

    async def list_attempts(self) -> list[ObservedAttempt]:
        return [ObservedAttempt(k, Phase.RUNNING, a.started_at, a.nodes, a.spec.labels()) for k, a in self._live.items()]

    def ready(self) -> list[AttemptStatus]:
        out, self._queue = self._queue, []
        now = self.clock.time()
        self.last_ready_visits = 0
        while self._heap and self._heap[0][0] <= now:
            ends_at, _, key = heapq.heappop(self._heap)
            self.last_ready_visits += 1
            att = self._live.get(key)
            if att is None or att.ends_at != ends_at:
                continue  # stopped or failed before its end
            self._end(key)
            if att.outcome == AttemptState.FAILED:
                out.append(AttemptStatus(key, Phase.FAILED, ends_at, exit_code=1, reason="exit_code",
                                         message=TRACE_FAILURE))
            else:
                out.append(AttemptStatus(key, Phase.SUCCEEDED, ends_at, exit_code=0))
        return out

    async def events(self) -> AsyncIterator[AttemptStatus]:
        while True:
            for status in self.ready():
                yield status
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass

    async def logs(self, key: AttemptKey, worker: int | None = None, follow: bool = False) -> AsyncIterator[str]:
        """Raises :class:`NoLogsKept` for every attempt the agent knows ran here (the agent
        checks that first; this backend forgets ended attempts beyond :attr:`REMEMBER_ENDED`),
        AttemptNotFound for a worker outside a remembered attempt's gang."""
        workers = len(self._live[key].spec.bindings) if key in self._live else self._ended.get(key)
        if workers is not None and worker is not None and not 0 <= worker < max(workers, 1):
            raise AttemptNotFound(f"attempt {key} has no worker {worker} (workers 0..{workers - 1})")
        raise NoLogsKept(TRACE_NO_LOGS.format(key=key))
        yield  # an async generator, like every backend's logs

    # -- drills and the trace's rules

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Drill: the node fails (or recovers). Every attempt with a worker on a failed node is
        stopped whole and reported FAILED reason ``node_failed`` (no exit code) at the time now.

        Raises:
            KeyError: no such node.
        """
        self._nodes[node] = self._nodes[node].model_copy(update={"healthy": healthy})
        if healthy:
            return
        now = self.clock.time()
        for key in sorted(self._on_node.get(node, ())):
            att = self._live[key]
            worker = att.nodes.index(node)
            self._end(key)
            self._queue.append(AttemptStatus(key, Phase.FAILED, now, reason=NODE_FAILED, worker=worker, node=node,
                                             message=f"node {node} of worker {worker} failed"))
        self._changed()

    def _end(self, key: AttemptKey) -> None:
        att = self._live.pop(key)
        for n in set(att.nodes):
            on = self._on_node.get(n)
            if on is not None:
                on.discard(key)
        self._ended[key] = len(att.spec.bindings)
        while len(self._ended) > self.REMEMBER_ENDED:
            self._ended.popitem(last=False)

    def plan(self, spec: JobSpec, started_at: float, *, attempt: int = 1, resume_from_s: float = 0.0
             ) -> tuple[float | None, AttemptState]:
        """When an attempt started at ``started_at`` ends by the trace (None = until stopped) and
        how (:attr:`AttemptState.SUCCEEDED` or :attr:`AttemptState.FAILED`)."""
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
        backend: how work runs (:class:`~services.inventory.backend.Backend`).
        heartbeat_interval_s: wall seconds between heartbeats.
        snapshot_every: a full inventory snapshot every this many heartbeats, and at once when
            capacity or health changes (allocations are not capacity: the scheduler tracks its own
            placements; snapshots carry free resources for reconciliation and the capacity log).
        tick_s: wall seconds between drains of the backend's status changes (and retries of
            stops the backend could not carry out). On the wall clock (:class:`SystemClock`)
            with a backend that knows when its next status is due (``next_due``: the trace
            backend) the drain loop instead sleeps until then, at most ``idle_tick_s``, woken
            at once by a launch or a node failure (:meth:`next_tick_s`).
        idle_tick_s: longest sleep of that drain loop (wall seconds).
        metrics: where running jobs, placements received and backend errors are counted (labels
            region and cluster; default: a registry of its own, served by nobody).
        tenure: reads the scheduler lease's current tenure (None: the lease is not read, only the
            highest token seen fences; default with a bus: :func:`~fedsched.lease.read_tenure`,
            shared with the agents on the same connection, :func:`shared_tenure_reads`; a
            runtime shares it among all its agents with :func:`shared_lease_reader`).
        retain_done: ended attempts remembered (``done``) and (job, shard) fencing records kept
            (``highest``), the newest of each; older ones are forgotten so memory does not grow
            with history (:mod:`fedsched.bounded`). A placement of an attempt forgotten that
            long ago could run again, so keep it above what a redelivery can still bring.
    """

    def __init__(self, bus: Bus | None, clock: Clock, cluster: ClusterDef, backend: Backend, *,
                 publisher: Publisher | None = None, subjects: Subjects | None = None,
                 heartbeat_interval_s: float = 1.0, snapshot_every: int = 10, tick_s: float = 0.01,
                 idle_tick_s: float = 1.0, metrics: AgentMetrics | None = None, retain_done: int = 100_000,
                 tenure: Callable[[], Awaitable[Tenure | None]] | None = None) -> None:
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
        self.idle_tick_s = max(tick_s, idle_tick_s)
        self._poked = asyncio.Event()  # the drain loop's sleep ends early (see next_tick_s)
        if hasattr(backend, "on_change"):
            backend.on_change = self._poked.set
        self.producer = f"agent/{cluster.name}"
        self._status_subject = self.subjects.status(cluster.region, cluster.name)  # where its status events go
        #: node -> allocations; filled from ``backend.inventory()`` (:meth:`refresh_inventory`)
        self.ledger: dict[str, NodeLedger] = {}
        self.running: dict[tuple[str, int, int], RunningJob] = {}
        self.done: RecentSet[tuple[str, int, int]] = RecentSet(retain_done)
        #: fencing: (job, shard) -> the highest attempt seen in placements and stop orders
        self.highest: RecentDict[tuple[str, int], int] = RecentDict(retain_done)
        #: fencing: the scheduler-lease tokens seen on placements and stop orders, judged in stream order
        self.fencing = StreamFencing()
        self.stale_refused = 0  # orders refused for a stale fencing token
        #: reads the scheduler lease's tenure before each batch of orders (None: not read)
        self._read_tenure = tenure if tenure is not None else (
            shared_lease_reader(shared_tenure_reads(bus), bus) if bus is not None else None)
        self.tenure: Tenure | None = None  #: the scheduler lease's tenure, as last read
        #: (job, shard) -> key of the attempt running here (at most one after fencing)
        self._live: dict[tuple[str, int], tuple[str, int, int]] = {}
        #: reconcile actions of the last :meth:`rebuild`: (action, "job/attempt/shard")
        self.reconciled: list[tuple[str, str]] = []
        self._reconciled_keys: list[AttemptKey] = []
        self._stop_retry: dict[AttemptKey, str] = {}  # stops the backend could not carry out yet
        #: node -> keys of the running attempts with a worker there (a node failure stops these)
        self._on_node: dict[str, dict[tuple[str, int, int], None]] = {}  # (dict: in the order they started)
        #: attempt records the last drain (:meth:`finish_due`) visited: statuses reported, stops
        #: retried, gangs on failed nodes -- what changed, never the whole running set
        self.last_drain_visits = 0
        self._unreported: list[AttemptStatus] = []  # backend statuses not yet published (bus trouble)
        self._launched = 0  # placements launched by the batch handle() is in (drained once at its end)
        self._failed_nodes: set[str] = set()  # nodes seen failing whose gangs are not yet stopped
        self._log_tasks: set[asyncio.Task] = set()  # log requests being answered
        self._failed_nodes_seen = False  # a node failed since the last snapshot: publish one at once
        self._drain_lock = asyncio.Lock()  # one drain at a time: an attempt's statuses go out in order
        self.sequence = 0
        self._changed = asyncio.Event()  # capacity or health changed: snapshot at the next beat
        #: node -> its entry of the last snapshot published (``NodeInventory.model_dump(mode="json")``
        #: with the ledger's free resources); nodes in ``_stale_dumps`` changed since and are dumped
        #: again at the next snapshot, the others' entries are reused (:meth:`snapshot_payload`)
        self._node_dumps: dict[str, dict] = {}
        self._stale_dumps: set[str] = set()
        self._gpus_total = 0  # GPUs of the ledger's nodes (heartbeat), kept as nodes are added
        self._gpu_milli_free = 0  # milli-GPUs free on them (heartbeat), kept by _allocate
        self._stop = asyncio.Event()
        self._consumer: DurableConsumer | None = None
        self.paused = False  # failure drills: a paused agent stops heartbeating
        self.holding = False  # failure drills: a holding agent takes no placements
        self.silent = False  # failure drills: a silent agent is cut off (go_silent / resume)
        self._spawned: list[asyncio.Task] = []  # consumers restarted by resume()
        #: events of types this build does not know (a newer scheduler), skipped, not dead-lettered
        self.skipped = SkippedTypes(f"agent-{cluster.name}")
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self.metrics.attach(cluster.region, cluster.name, lambda: len(self.running))
        sync_nodes = getattr(backend, "nodes", None)  # in-memory backends: the ledger at once
        if callable(sync_nodes):
            self._merge_inventory(sync_nodes())

    @property
    def durable(self) -> str:
        """Durable consumer name of this agent."""
        return f"agent-{self.cluster.name}"

    async def lag(self) -> int:
        """Placements and stop orders for this cluster not yet acknowledged (its durable
        consumer's lag, from JetStream; everything on its subject before the consumer exists).

        Raises:
            nats.errors.Error: NATS unreachable.
        """
        consumer = self._consumer or DurableConsumer(
            self.bus, "EVENTS", self.durable, [self.subjects.placements(self.cluster.region, self.cluster.name)],
            self.handle, ack_wait_s=PLACEMENT_ACK_WAIT_S)
        return await consumer.lag()

    def _backend_error(self, operation: str) -> None:
        self.metrics.backend_error(self.cluster.region, self.cluster.name, operation)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Rebuild and reconcile, then consume placements, heartbeat and report the backend's
        status changes until :meth:`stop`."""
        await self.refresh_inventory()
        await self.rebuild()
        self._consumer = DurableConsumer(
            self.bus, "EVENTS", self.durable, [self.subjects.placements(self.cluster.region, self.cluster.name)],
            self.handle, batch=64, max_wait_s=0.2, ack_wait_s=PLACEMENT_ACK_WAIT_S)
        await self.publish_snapshot()
        if self.holding:
            self._consumer.stop()
        logs_sub = await self.bus.nc.subscribe(self.subjects.logs(self.cluster.region, self.cluster.name),
                                               cb=self._on_logs_request)
        tasks = [asyncio.create_task(self._consumer.run(), name=f"{self.durable}-consumer"),
                 asyncio.create_task(self._heartbeats(), name=f"{self.durable}-heartbeat"),
                 asyncio.create_task(self._ticker(), name=f"{self.durable}-ticker")]
        try:
            await self._stop.wait()
        finally:
            self._consumer.stop()
            try:
                await logs_sub.unsubscribe()
            except Exception as e:  # noqa: BLE001 - the connection may be closing
                log.debug("%s: logs unsubscribe: %r", self.producer, e)
            for t in [*tasks, *self._log_tasks, *self._spawned]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    # ------------------------------------------------------------------ inventory and drills

    async def refresh_inventory(self) -> None:
        """Read ``backend.inventory()`` into the ledger: new nodes are added, capacity, health,
        drain and taints updated (allocations kept). A node that turned unhealthy has its gangs
        stopped at the next :meth:`finish_due`. A backend error is logged (retried next time)."""
        try:
            nodes = await self.backend.inventory()
        except BackendError as e:
            self._backend_error("inventory")
            log.warning("%s: inventory not read: %s", self.producer, e)
            return
        self._merge_inventory(nodes)

    def _merge_inventory(self, nodes: list[NodeInventory]) -> None:
        for n in nodes:
            led = self.ledger.get(n.name)
            if led is None:
                led = self.ledger[n.name] = NodeLedger(n, list(n.gpu_free_milli) or [WHOLE] * n.gpus, n.cpu_milli,
                                                       n.memory_mib)
                self._gpus_total += len(led.gpu_free)
                self._gpu_milli_free += sum(led.gpu_free)
                self._stale_dumps.add(n.name)
                continue
            if led.inv is n:
                continue  # the very inventory merged last time (an in-memory backend's own nodes)
            if (led.inv.healthy, led.inv.unschedulable, led.inv.taints) == (n.healthy, n.unschedulable, n.taints):
                continue  # nothing to copy (every heartbeat reads every node: no copy per node per beat)
            self._changed.set()
            self._stale_dumps.add(n.name)
            if led.inv.healthy and not n.healthy:
                self._failed_nodes.add(n.name)
                self._poked.set()
            led.inv = led.inv.model_copy(update={"healthy": n.healthy, "unschedulable": n.unschedulable,
                                                 "taints": n.taints})

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
                self.handle, batch=64, max_wait_s=0.2, ack_wait_s=PLACEMENT_ACK_WAIT_S)
            self._spawned.append(asyncio.create_task(self._consumer.run(), name=f"{self.durable}-consumer"))

    def set_node_health(self, node: str, healthy: bool) -> None:
        """Drill: mark a node (un)healthy, on the backend too where it simulates nodes (trace).
        A failed node's gangs are stopped whole and reported ``job.failed`` reason
        ``node_failed`` at the next :meth:`finish_due`; the next heartbeat carries a fresh
        snapshot.

        Raises:
            KeyError: no such node.
        """
        ledger = self.ledger[node]
        if ledger.inv.healthy and not healthy:
            self._failed_nodes.add(node)
            self._poked.set()
        ledger.inv = ledger.inv.model_copy(update={"healthy": healthy})
        self._stale_dumps.add(node)
        drill = getattr(self.backend, "set_node_health", None)
        if callable(drill):
            drill(node, healthy)
        self._changed.set()

    async def rebuild(self) -> None:
        """Restore the ledger from this cluster's placements and status on the bus, then
        reconcile it with what the backend runs (:meth:`reconcile`)."""
        placements: dict[tuple[str, int, int], tuple[Delivery, JobPlaced]] = {}
        started: dict[tuple[str, int, int], float] = {}
        tenure = await self._read_tenure() if self._read_tenure is not None else None

        def on_placed(d: Delivery, env: Envelope) -> None:
            p = env.payload_as(JobPlaced)
            if self.fencing.judge(p.fencing_token, d, tenure) is not None:
                return  # refused when it arrived (stale fencing token)
            placements[(env.job_id, env.attempt, p.shard)] = (d, p)
            self._see_attempt(env.job_id, p.shard, env.attempt)

        def on_stop(d: Delivery, env: Envelope) -> None:
            stop = env.payload_as(JobStop)
            if self.fencing.judge(stop.fencing_token, d, tenure) is not None:
                return
            self._see_attempt(env.job_id, stop.shard, env.attempt)

        def on_started(d: Delivery, env: Envelope) -> None:
            s = env.payload_as(JobStatus)
            started[(env.job_id, env.attempt, s.shard)] = env.occurred_at.timestamp()

        def on_ended(d: Delivery, env: Envelope) -> None:
            s = env.payload_as(JobStatus)
            self.done.add((env.job_id, env.attempt, s.shard))

        folds = {"placed": on_placed, "stop": on_stop, "started": on_started, "ended": on_ended}

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
        await self.reconcile({key: (d, placed, started.get(key)) for key, (d, placed) in placements.items()
                              if key not in self.done})

    async def reconcile(self, ledger: dict[tuple[str, int, int], tuple[Delivery, JobPlaced, float | None]]) -> None:
        """Compare the ledger's open attempts (key -> (placement delivery, placement, start time
        or None if no ``job.started`` was published)) with ``backend.list_attempts()``:

        * an observed attempt that is live in the ledger (placed, not ended, not older than the
          highest attempt seen for its job and shard) is adopted: it keeps running, it is reported
          when it ends (and ``job.started`` is published, at the cluster's start time, if the
          cluster runs or ran it and the bus did not have it yet);
        * a placed attempt that never started and the cluster does not have is left alone: its
          placement, if not acknowledged, is redelivered, else the scheduler reclaims it;
        * an observed attempt that is not (ended on the bus, older, unknown) is stopped and a
          ``job.stopped`` published (an observed attempt that already ended is left alone: a
          durable cluster such as Slurm lists its finished jobs for a while): reason ``superseded`` for an older attempt of a job whose
          newer attempt this agent has seen, else ``orphaned`` (no ``started_at``: it was not a
          current attempt, nothing more is billed);
        * a live ledger attempt the cluster does not have: relaunched with its recorded start on a
          backend that does not outlive the agent (``durable`` False: trace), else reported
          ``job.failed`` reason ``lost``.

        Every action is recorded in :attr:`reconciled` and logged. A backend that cannot be listed
        (BackendError) leaves the ledger as rebuilt (retryable errors are logged, not raised).
        """
        self.reconciled = []
        self._reconciled_keys: list[AttemptKey] = []
        try:
            observed = {o.key: o for o in await self.backend.list_attempts()}
        except BackendError as e:
            self._backend_error("list")
            log.error("%s: cannot list the cluster's attempts, not reconciled: %s", self.producer, e)
            observed = None
        now = self.clock.time()
        for key, (d, placed, at) in ledger.items():
            env = d.envelope
            if key in self.done:
                continue
            akey = AttemptKey(*key)
            if env.attempt < self.highest.get((env.job_id, placed.shard), 0):
                continue  # fenced: handled below as observed-but-not-live, or never runs again
            seen = observed is not None and akey in observed
            if at is None and not seen:
                continue  # never started here: redelivery or the scheduler's reclaim decides
            if observed is not None and not seen and self.backend.durable:
                job = RunningJob(AttemptRef.of(env), placed.shard, placed.spec, placed, at, d.headers)
                self.done.add(key)
                self._note("lost", akey)
                await self._status(EventType.JOB_FAILED, job.ref, placed, now, started_at=at, reason="lost",
                                   headers=d.headers)
                continue
            if not self._fits(placed):
                log.error("%s: rebuilt job %s does not fit the ledger; skipping", self.producer, key)
                continue
            self._allocate(placed, +1)
            job = RunningJob(AttemptRef.of(env), placed.shard, placed.spec, kept_placement(placed), at, d.headers)
            self._hold(job)
            if seen:
                self._note("adopted", akey)
                o = observed[akey]
                # started while no agent watched (still running, or already ended: its end is
                # reported next, and is billed only from a start) -- the cluster's start time
                if at is None and (o.phase == Phase.RUNNING or (o.phase in TERMINAL_PHASES and o.started_at is not None)):
                    job.started_at = o.started_at if o.started_at is not None else now
                    await self._status(EventType.JOB_STARTED, job.ref, placed, job.started_at,
                                       started_at=job.started_at, headers=d.headers)
            else:
                self._note("relaunched", akey)
                try:
                    await self.backend.launch(job.attempt_spec())
                except BackendError as e:
                    self._backend_error("launch")
                    log.error("%s: relaunch of %s failed: %s", self.producer, akey, e)
        for akey, o in (observed or {}).items():
            key = (akey.job_id, akey.attempt, akey.shard)
            if key in self.running or o.phase in TERMINAL_PHASES:
                continue  # owned, or ended on a durable cluster (nothing to stop, nothing new to report)
            older = akey.attempt < self.highest.get((akey.job_id, akey.shard), 0)
            reason = "superseded" if older else "orphaned"
            self._note(reason, akey)
            await self._backend_stop(akey, reason)
            self.done.add(key)
            await self._orphan_status(akey, o, reason, now)
        if self.reconciled:
            log.info("%s: reconciled: %s", self.producer, ", ".join(f"{a} {k}" for a, k in self.reconciled))
            await self._publish_reconciled(ledger, observed or {}, now)

    def _note(self, action: str, key: AttemptKey) -> None:
        """Record one reconcile action (:attr:`reconciled`, published by :meth:`_publish_reconciled`)."""
        self.reconciled.append((action, str(key)))
        self._reconciled_keys.append(key)

    async def _publish_reconciled(self, ledger: dict, observed: dict, at: float) -> None:
        """One audited ``agent.reconciled`` per action of the last :meth:`reconcile` (id: the
        attempt, the action and the reconcile time, so a later restart's actions are new events).
        Routing names come from the ledger's placement, else from the labels on the cluster."""
        items = []
        for (action, _), key in zip(self.reconciled, self._reconciled_keys):
            job_id, attempt, shard = key.job_id, key.attempt, key.shard
            entry = ledger.get((job_id, attempt, shard))
            if entry is not None:
                env = entry[0].envelope
                tenant, project = env.tenant, env.project
            else:
                seen = observed.get(key)
                labels = seen.labels if seen is not None else {}
                tenant, project = labels.get("fedsched.io/tenant", ""), labels.get("fedsched.io/project", "")
            event = make_event(
                EventType.AGENT_RECONCILED, AgentReconciled(reason=action, shard=shard), producer=self.producer,
                occurred_at=at, event_id=business_event_id(job_id, attempt, shard, "reconcile", action,
                                                           round(at * 1000)),
                region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name, tenant=tenant,
                project=project, job_id=job_id, attempt=attempt, actor=self.producer)
            items.append((self.subjects.status(self.cluster.region, self.cluster.name), event, None))
        results = await self.publisher.publish_many(items)
        if not all(results):
            log.warning("%s: %d of %d reconcile events not acknowledged", self.producer,
                        sum(1 for r in results if not r), len(results))

    async def _orphan_status(self, key: AttemptKey, observed: ObservedAttempt, reason: str, at: float) -> None:
        """``job.stopped`` for an attempt found on the cluster that no live attempt owns (id step
        ``reconciled``: distinct from the attempt's own end, which may already be stored)."""
        labels = observed.labels
        payload = JobStatus(reason=reason, shard=key.shard)
        event = make_event(
            EventType.JOB_STOPPED, payload, producer=self.producer, occurred_at=at,
            event_id=business_event_id(key.job_id, key.attempt, key.shard, "reconciled"),
            region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name,
            tenant=labels.get("fedsched.io/tenant", ""), project=labels.get("fedsched.io/project", ""),
            job_id=key.job_id, attempt=key.attempt, actor=self.producer)
        await self.publisher.publish(self.subjects.status(self.cluster.region, self.cluster.name), event)

    # ------------------------------------------------------------------ logs

    #: most log requests answered at once (more are refused ``unavailable``)
    MAX_LOG_REQUESTS = 16

    async def serve_logs(self, request: LogRequest) -> AsyncIterator[LogReply]:
        """Answer a log request: replies of at most ``request.max_chunk_bytes`` of output, the
        last with ``eof``; an attempt that never ran here, or an unknown worker, gives one reply
        with code ``not_found``; a backend that keeps no logs (trace) one with ``no_logs``; a
        backend error one with ``unavailable``."""
        key = (request.job_id, request.attempt, request.shard)
        if key not in self.running and key not in self.done:
            yield LogReply(eof=True, code="not_found",
                           error=f"attempt {request.attempt} of job {request.job_id} did not run on {self.cluster.name}")
            return
        lines: list[str] = []
        try:
            stream = self.backend.logs(AttemptKey(*key), request.worker, request.follow)
            async for line in stream:
                lines.append(line)
                if sum(len(x) + 1 for x in lines) >= request.max_chunk_bytes:
                    for chunk in chunks(lines, request.max_chunk_bytes):
                        yield LogReply(data=chunk)
                    lines = []
        except AttemptNotFound as e:
            yield LogReply(eof=True, code="not_found", error=str(e))
            return
        except NoLogsKept as e:
            yield LogReply(eof=True, code="no_logs", error=f"{self.cluster.name}: {e}")
            return
        except BackendError as e:
            self._backend_error("logs")
            yield LogReply(eof=True, code="unavailable", error=str(e))
            return
        for chunk in chunks(lines, request.max_chunk_bytes):
            yield LogReply(data=chunk)
        yield LogReply(eof=True)

    async def _on_logs_request(self, msg) -> None:
        if not msg.reply:
            return
        if len(self._log_tasks) >= self.MAX_LOG_REQUESTS:
            await self.bus.nc.publish(msg.reply, LogReply(eof=True, code="unavailable",
                                                          error="agent busy with other log requests").model_dump_json().encode())
            return
        task = asyncio.create_task(self._answer_logs(msg))
        self._log_tasks.add(task)
        task.add_done_callback(self._log_tasks.discard)

    async def _answer_logs(self, msg) -> None:
        try:
            request = LogRequest.model_validate_json(msg.data)
        except ValueError as e:
            await self.bus.nc.publish(msg.reply, LogReply(eof=True, code="not_found",
                                                          error=f"bad log request: {e}").model_dump_json().encode())
            return
        # a reply must fit the server's max_payload even when JSON escapes every byte (x6)
        room = max(256, getattr(self.bus, "max_payload", 8 * request.max_chunk_bytes) // 8)
        if request.max_chunk_bytes > room:
            request = request.model_copy(update={"max_chunk_bytes": room})
        try:
            async for reply in self.serve_logs(request):
                await self.bus.nc.publish(msg.reply, reply.model_dump_json().encode())
        except Exception as e:  # noqa: BLE001 - a log request never takes the agent down
            log.warning("%s: log request failed: %r", self.producer, e)

    # ------------------------------------------------------------------ placements

    async def handle(self, deliveries: list[Delivery]) -> None:
        """Handle placements and stop orders for this cluster (the durable consumer's handler).

        Raises:
            DecodeError: an event type the agent does not handle (dead-lettered).
            UnavailableError: the backend could not be reached (retryable): the batch is retried.
        """
        if self._read_tenure is not None and any(d.envelope.known_type in ORDER_TYPES for d in deliveries):
            self.tenure = await self._read_tenure()  # UnavailableError: the batch is retried
        # what the cluster observed at the launches is reported once for the whole batch (one
        # drain: its statuses published together), not once per placement (issue 15)
        self._launched = 0
        for d in deliveries:
            env = d.envelope
            # continue the job's trace: status events carry this span's context
            with telemetry.child_span(d.headers, f"agent.{env.type}", tracer, job_id=env.job_id,
                                      cluster=self.cluster.name):
                handler = PLACEMENT_EVENTS.route(env.type, self.skipped)
                if handler is not None:
                    await handler(self, d)
                elif env.known_type is not None:  # a known type that has no business here
                    raise DecodeError(f"agent does not handle {env.type!r}")
        if self._launched:
            self._launched = 0
            await self.finish_due()  # before the batch is acknowledged (trace backend: running at once)

    async def _handle_placed(self, d: Delivery) -> None:
        await self._on_placed(d, d.envelope.payload_as(JobPlaced))

    async def _handle_stop(self, d: Delivery) -> None:
        await self._on_stop(d, d.envelope.payload_as(JobStop))

    @property
    def highest_token(self) -> int:
        """The highest scheduler-lease fencing token seen on an order."""
        return self.fencing.highest

    def _check_token(self, d: Delivery, token: int) -> None:
        """Fencing by scheduler lease: raise :class:`~fedsched.errors.DecodeError` (the consumer
        dead-letters the order with the reason) when the order ``d`` with ``token`` is stale
        (:func:`~fedsched.lease.stale_order`: a higher token precedes it in the stream -- judged
        in stream order, :class:`~fedsched.lease.StreamFencing` -- or it is below the lease's
        current tenure and stored after it began)."""
        env = d.envelope
        reason = self.fencing.judge(token, d, self.tenure)
        if reason is not None:
            self.stale_refused += 1
            whose = ("a forged order" if unissued(token, self.tenure) is not None
                     else "a former active scheduler's order")
            raise DecodeError(f"{reason}; {env.type} of {env.job_id} attempt {env.attempt} carries token {token}, "
                              f"{self.producer} has seen {self.highest_token} ({whose})")

    def _see_attempt(self, job_id: str, shard: int, attempt: int) -> int:
        """Record ``attempt`` for fencing; returns the highest attempt seen before it."""
        before = self.highest.get((job_id, shard), 0)
        if attempt > before:
            self.highest[(job_id, shard)] = attempt
        return before

    def _hold(self, job: RunningJob) -> None:
        self.running[job.key] = job
        self._live[(job.ref.job_id, job.shard)] = job.key
        for b in job.placed.bindings:
            self._on_node.setdefault(b.node, {})[job.key] = None

    def _unindex(self, job: RunningJob) -> None:
        for b in job.placed.bindings:
            on = self._on_node.get(b.node)
            if on is not None:
                on.pop(job.key, None)
                if not on:
                    del self._on_node[b.node]

    def _release(self, key: tuple[str, int, int]) -> RunningJob | None:
        """Drop ``key`` from the running set (resources back, marked done); the job or None."""
        job = self.running.pop(key, None)
        self.done.add(key)
        if job is None:
            return None
        self._unindex(job)
        if self._live.get((job.ref.job_id, job.shard)) == key:
            del self._live[(job.ref.job_id, job.shard)]
        self._allocate(job.placed, -1)
        return job

    async def _on_placed(self, d: Delivery, placed: JobPlaced) -> None:
        env = d.envelope
        key = (env.job_id, env.attempt, placed.shard)
        if key in self.running or key in self.done:
            return  # redelivery: already handled
        self._check_token(d, placed.fencing_token)
        self.metrics.received(self.cluster.region, self.cluster.name)
        now = self.clock.time()
        before = self._see_attempt(env.job_id, placed.shard, env.attempt)
        if env.attempt < before:  # fencing: a newer attempt of this job was already seen here
            await self._status(EventType.JOB_REJECTED, AttemptRef.of(env), placed, now, reason="superseded",
                               headers=d.headers)
            self.done.add(key)  # after the publish: a redelivery after a failed one reports it again
            return
        older = self._live.get((env.job_id, placed.shard))
        if older is not None and older != key:
            await self._stop_running(older, "superseded", now, headers=d.headers)
        problem = self._check(placed)
        if problem:
            await self._status(EventType.JOB_REJECTED, AttemptRef.of(env), placed, now, reason=problem, headers=d.headers)
            self.done.add(key)
            return
        self._allocate(placed, +1)
        job = RunningJob(AttemptRef.of(env), placed.shard, placed.spec, kept_placement(placed), None, d.headers)
        self._hold(job)
        try:
            await self.backend.launch(job.attempt_spec())
        except BackendError as e:
            self._backend_error("launch")
            self.running.pop(key, None)
            self._unindex(job)
            self._live.pop((env.job_id, placed.shard), None)
            self._allocate(placed, -1)
            if e.retryable:
                raise UnavailableError(f"backend: {e}") from e  # the placement is redelivered
            self.done.add(key)
            await self._status(EventType.JOB_FAILED, job.ref, placed, now, reason=f"launch failed: {e}",
                               headers=d.headers)
            return
        self._launched += 1  # reported by handle()'s drain after the batch

    async def _on_stop(self, d: Delivery, stop: JobStop) -> None:
        """Stop attempt N and anything older of the same job and shard running here (fencing)."""
        env = d.envelope
        key = (env.job_id, env.attempt, stop.shard)
        if key in self.done and key not in self.running and self.fencing.stale(stop.fencing_token, d.stream_sequence,
                                                                                      self.tenure):
            return  # redelivery of an order already carried out
        self._check_token(d, stop.fencing_token)
        self._see_attempt(env.job_id, stop.shard, env.attempt)
        live = self._live.get((env.job_id, stop.shard))
        now = self.clock.time()
        if live is not None and live != key and live[1] < env.attempt:
            await self._stop_running(live, "superseded", now, headers=d.headers)
        if key not in self.running:
            self.done.add(key)  # stop before start (or after end): nothing runs
            return
        job = self.running[key]
        progress = job.placed.resume_from_s
        if stop.checkpoint_interval_s > 0 and job.spec.checkpointable and job.started_at is not None:
            done_here = max(0.0, now - job.started_at)  # resumes from its last checkpoint
            progress += done_here // stop.checkpoint_interval_s * stop.checkpoint_interval_s
        await self._stop_running(key, stop.reason, now, headers=d.headers, progress_s=progress)

    async def _stop_running(self, key: tuple[str, int, int], reason: str, at: float, *,
                            headers: dict[str, str] | None = None, progress_s: float | None = None) -> None:
        """Stop a running attempt on the backend (every worker) and report ``job.stopped``."""
        job = self._release(key)
        if job is None:
            return
        await self._backend_stop(job.attempt_key, reason)
        await self._status(EventType.JOB_STOPPED, job.ref, job.placed, at, started_at=job.started_at, reason=reason,
                           headers=headers if headers is not None else job.trace_headers,
                           progress_s=job.placed.resume_from_s if progress_s is None else progress_s)

    async def _backend_stop(self, key: AttemptKey, reason: str) -> None:
        try:
            await self.backend.stop(key, reason)
            self._stop_retry.pop(key, None)
        except BackendError as e:
            self._backend_error("stop")
            log.warning("%s: stop of %s failed (%s): %s", self.producer, key,
                        "will retry" if e.retryable else "giving up", e)
            if e.retryable:
                self._stop_retry[key] = reason
                self._poked.set()

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
            if node.inv.unschedulable:
                return f"node {b.node} is drained"
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
            self._gpu_milli_free -= sign * b.gpu_milli * len(b.gpu_indices)
            node.cpu_free -= sign * b.cpu_milli
            node.mem_free -= sign * b.memory_mib
            self._stale_dumps.add(b.node)

    async def _status(self, type_: EventType, ref: AttemptRef, placed: JobPlaced, at: float, *, started_at: float | None = None,
                      reason: str = "", headers: dict[str, str] | None = None, progress_s: float = 0.0,
                      exit_code: int | None = None) -> None:
        """Publish one status event of an attempt (see :meth:`_status_item`).

        Raises:
            UnavailableError / PayloadTooLargeError: as :meth:`~fedsched.ports.Publisher.publish`.
        """
        subject, event, tp = self._status_item(type_, ref, placed, at, started_at=started_at, reason=reason,
                                               headers=headers, progress_s=progress_s, exit_code=exit_code)
        await self.publisher.publish(subject, event, headers=tp)

    def _status_item(self, type_: EventType, ref: AttemptRef, placed: JobPlaced, at: float, *,
                     started_at: float | None = None, reason: str = "", headers: dict[str, str] | None = None,
                     progress_s: float = 0.0, exit_code: int | None = None) -> tuple[str, Envelope, dict[str, str]]:
        """The status event ``type_`` of attempt ``ref`` at cluster time ``at`` (seconds), as a
        :meth:`~fedsched.ports.Publisher.publish_many` item ``(subject, event, trace headers)``;
        its event id is the business id (job, attempt, shard, step), so a report sent again is
        stored once."""
        spec = placed.spec
        step = _STATUS_STEP.get(type_, "ended")
        payload = JobStatus(
            card_model=placed.card_model, gpu_milli=spec.total_gpu_milli, cpu_milli=spec.cpu_milli * spec.workers,
            memory_mib=spec.memory_mib * spec.workers, started_at=to_datetime(started_at) if started_at else None,
            reason=reason, shard=placed.shard, data_version=spec.annotations.get("data.version", ""),
            kind=spec.kind.value, cross_region=placed.cross_region, progress_s=progress_s, exit_code=exit_code,
        )
        event = make_event(
            type_, payload, producer=self.producer, occurred_at=at,
            event_id=business_event_id(ref.job_id, ref.attempt, placed.shard, step),
            region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name, tenant=ref.tenant,
            project=ref.project, job_id=ref.job_id, attempt=ref.attempt, actor=self.producer,
            policy_version=ref.policy_version)
        # the attempt's own trace (its placement's context) always: a status drained while another
        # job's placement is being handled must not join that job's trace; without one, the bus
        # takes the active span's or starts a root
        tp = {k: v for k, v in (headers or {}).items() if k in ("traceparent", "tracestate")}
        if tp and telemetry.current_trace_id() == telemetry.trace_id_of(tp):
            tp = telemetry.inject_headers()  # inside this attempt's own span: a child of it
        return self._status_subject, event, tp

    # ------------------------------------------------------------------ time

    async def _ticker(self) -> None:
        while not self._stop.is_set():
            try:
                if self.silent:  # cut off: what ends is reported after resume()
                    await asyncio.sleep(self.tick_s)
                    continue
                await self.finish_due()
                if self._failed_nodes_seen and not self.paused:  # tell the scheduler now, not at the next beat
                    self._failed_nodes_seen = False
                    self._changed.clear()
                    await self.publish_snapshot()
            except Exception as e:  # noqa: BLE001 - an agent never crashes on a bad status; retried next tick
                log.warning("%s: status drain failed: %r", self.producer, e)
            self._poked.clear()  # (a change from here on ends the sleep)
            delay = self.next_tick_s()
            if delay <= self.tick_s:
                await asyncio.sleep(delay)
                continue
            try:
                await asyncio.wait_for(self._poked.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def next_tick_s(self) -> float:
        """Wall seconds until the next drain of the backend's statuses (issue 15: six idle agents
        polling every 10 ms took ~2% of a core).

        ``tick_s`` (polling), unless the clock is the wall clock (:class:`SystemClock`: business
        seconds are wall seconds) and the backend says when its next status is due
        (``next_due()``, business time; None = nothing running will end by itself) and nothing
        waits for a retry (unreported statuses, stops, failed nodes): then until that time,
        between ``tick_s`` and ``idle_tick_s``. What could make a status due earlier -- a launch
        or a node failure on the backend, a node seen failing, a stop to retry -- ends the sleep
        at once. A replay's clock jumps, so under any other clock the loop keeps polling.
        """
        next_due = getattr(self.backend, "next_due", None)
        if (next_due is None or not isinstance(self.clock, SystemClock) or self._unreported or self._stop_retry
                or self._failed_nodes):
            return self.tick_s
        due = next_due()
        if due is None:
            return self.idle_tick_s
        return min(max(due - self.clock.time(), self.tick_s), self.idle_tick_s)

    async def finish_due(self) -> int:
        """Report what the backend observed since the last call (``backend.ready()``), stop the
        gangs on nodes that failed, retry stops the backend could not carry out; returns how
        many attempts ended."""
        async with self._drain_lock:
            return await self._drain()

    async def _drain(self) -> int:
        """One drain; its cost is what changed (counted in ``last_drain_visits``): the backend
        hands over only the statuses it observed (the trace backend pops due ends off a heap),
        failed nodes reach only their own gangs (an index by node), stops are retried one by one."""
        ended = visits = 0
        for node in sorted(self._failed_nodes):
            self._failed_nodes.discard(node)
            self._failed_nodes_seen = True
            hit = await self.fail_node(node)
            ended += hit
            visits += hit
        for key, reason in list(self._stop_retry.items()):
            visits += 1
            await self._backend_stop(key, reason)
        # statuses whose report failed (the bus was away) are reported first next time: the
        # backend hands each change over once
        pending, self._unreported = self._unreported + self.backend.ready(), []
        visits += len(pending)
        self.last_drain_visits = visits
        try:
            ended += await self._report(pending)
        except BaseException:
            self.last_drain_visits = visits
            raise
        return ended

    async def _report(self, pending: list[AttemptStatus]) -> int:
        """Report ``pending`` backend statuses in order, their events published in one batch
        (:meth:`~fedsched.ports.Publisher.publish_many`: one flush, the acks awaited together)
        instead of one round trip each; returns how many running attempts they ended.

        Local state changes only for the statuses reported: from the first one not acknowledged
        on, every status is kept in :attr:`_unreported` and reported again by the next drain
        (same event ids: stored once), and :class:`~fedsched.errors.UnavailableError` is raised.
        A status refused for good (dead-lettered by the bus) counts as reported.
        """
        planned: list[tuple[int, tuple[str, Envelope, dict[str, str]], Callable[[], int]]] = []
        started: dict[tuple[str, int, int], float] = {}  # started by an earlier status of this batch
        ending: set[tuple[str, int, int]] = set()  # ended by an earlier status of this batch
        for i, status in enumerate(pending):
            plan = await self._plan_status(status, started, ending)
            if plan is not None:
                planned.append((i, *plan))
        if not planned:
            return 0
        results = await self.publisher.publish_many([item for _, item, _ in planned])
        ended = 0
        for (i, _, after), ok in zip(planned, results):
            if not ok and ok is not PublishResult.REFUSED:
                self._unreported = pending[i:] + self._unreported
                raise UnavailableError(f"{self.producer}: {len(pending) - i} status report(s) not acknowledged; "
                                       f"reported again at the next drain")
            ended += after()
        return ended

    async def _plan_status(self, status: AttemptStatus, started: dict[tuple[str, int, int], float],
                           ending: set[tuple[str, int, int]]
                           ) -> tuple[tuple[str, Envelope, dict[str, str]], Callable[[], int]] | None:
        """What reporting one backend status takes (the rules of :meth:`on_status`): the event to
        publish and what to change once it is acknowledged (returns 1 if that ends a running
        attempt), or None when there is nothing to report. ``started`` / ``ending``: what the
        earlier statuses of the same batch will have done to their attempts."""
        key = (status.key.job_id, status.key.attempt, status.key.shard)
        job = self.running.get(key)
        if job is None or key in ending or status.phase == Phase.PENDING:
            return None
        started_at = started.get(key, job.started_at)
        if status.phase == Phase.RUNNING:
            if started_at is not None:
                return None
            started[key] = status.at

            def after_start() -> int:
                job.started_at = status.at
                return 0

            return (self._status_item(EventType.JOB_STARTED, job.ref, job.placed, status.at, started_at=status.at,
                                      headers=job.trace_headers), after_start)
        if status.phase not in TERMINAL_PHASES:
            return None
        ending.add(key)

        def after_end() -> int:
            if started_at is not None and job.started_at is None:
                job.started_at = started_at
            self._release(key)
            return 1

        if status.phase == Phase.SUCCEEDED:
            return (self._status_item(EventType.JOB_FINISHED, job.ref, job.placed, status.at, started_at=started_at,
                                      headers=job.trace_headers, exit_code=status.exit_code), after_end)
        if status.reason == NODE_FAILED:
            await self._backend_stop(status.key, NODE_FAILED)  # the whole gang, whatever the backend did
            reason = NODE_FAILED
        elif status.phase == Phase.LOST:
            reason = "lost"
        else:
            reason = status.message or status.reason or f"exited with code {status.exit_code}"
        return (self._status_item(EventType.JOB_FAILED, job.ref, job.placed, status.at, started_at=started_at,
                                  reason=reason, headers=job.trace_headers, exit_code=status.exit_code), after_end)

    async def fail_node(self, node: str) -> int:
        """Stop, whole, every running attempt with a worker on ``node`` and report each
        ``job.failed`` reason ``node_failed`` (no exit code); returns how many."""
        now = self.clock.time()
        hit = list(self._on_node.get(node, ()))
        for key in hit:
            job = self._release(key)
            await self._backend_stop(job.attempt_key, NODE_FAILED)
            await self._status(EventType.JOB_FAILED, job.ref, job.placed, now, started_at=job.started_at,
                               reason=NODE_FAILED, headers=job.trace_headers)
        return len(hit)

    async def on_status(self, status: AttemptStatus) -> int:
        """Report one status change from the backend; 1 if it ended a running attempt, else 0.

        Only the attempts this agent runs are reported (an ended, stopped, fenced or unknown
        attempt's status is dropped: reconcile deals with what runs unowned). RUNNING ->
        ``job.started`` (once); SUCCEEDED -> ``job.finished``; FAILED -> ``job.failed`` with the
        exit code and reason (``node_failed`` stops the whole gang first); LOST -> ``job.failed``
        reason ``lost``. Event times are the cluster's (``status.at``). (:meth:`_drain`
        reports a whole drain's statuses at once through :meth:`_report`, by the same rules.)

        Raises:
            UnavailableError: not acknowledged; the status is reported again by the next drain.
        """
        return await self._report([status])

    async def _heartbeats(self) -> None:
        beats = 0
        while not self._stop.is_set():
            if not self.paused:
                try:
                    await self.refresh_inventory()  # node health, drain, taints as the cluster has them
                    if beats % self.snapshot_every == 0 or self._changed.is_set():
                        self._changed.clear()
                        await self.publish_snapshot()
                    await self.publish_heartbeat()
                except Exception as e:  # noqa: BLE001 - keep beating through bus trouble
                    log.info("%s: heartbeat failed: %r", self.producer, e)
                beats += 1
            await asyncio.sleep(self.heartbeat_interval_s)

    @staticmethod
    def _node_now(led: NodeLedger) -> NodeInventory:
        """One node as a snapshot reports it: its inventory with the ledger's free resources."""
        return led.inv.model_copy(update={"gpu_free_milli": tuple(led.gpu_free), "cpu_free_milli": led.cpu_free,
                                          "memory_free_mib": led.mem_free})

    def snapshot(self) -> InventorySnapshot:
        """The cluster's inventory now (every node made afresh, and the count of running attempts)."""
        return InventorySnapshot(
            nodes=tuple(self._node_now(l) for l in self.ledger.values()), running_jobs=len(self.running),
            storage_tier=self.cluster.storage_tier, interconnect=self.cluster.interconnect,
            residency_tags=self.cluster.residency_tags, sequence=self.sequence,
            backend=str(getattr(self.backend, "kind", "")))

    def snapshot_payload(self) -> dict:
        """:meth:`snapshot` as the event's payload (``model_dump(mode="json")``: nodes a list of
        dicts, tuples as lists), made from the entries of the last snapshot published: only the
        nodes whose allocations, health, drain or taints changed since are dumped again (issue
        15: a snapshot of 2,600 nodes every 10 s per agent copied and dumped every node, ~17% of
        the agents process's CPU at 100,000 running jobs). An entry is never changed once made
        (a changed node gets a new dict): payloads already published stay as they were."""
        dumps = self._node_dumps
        for name in self._stale_dumps:
            led = self.ledger.get(name)
            if led is not None:
                dumps[name] = self._node_now(led).model_dump(mode="json")
        self._stale_dumps.clear()
        payload = InventorySnapshot(
            nodes=(), running_jobs=len(self.running), storage_tier=self.cluster.storage_tier,
            interconnect=self.cluster.interconnect, residency_tags=self.cluster.residency_tags, sequence=self.sequence,
            backend=str(getattr(self.backend, "kind", ""))).model_dump(mode="json")
        payload["nodes"] = [dumps[name] for name in self.ledger]
        return payload

    async def publish_snapshot(self) -> None:
        """Publish a full inventory snapshot (in a new root trace: nothing traced caused it)."""
        self.sequence += 1
        # make_event's envelope, around the payload made from the cached node entries
        # (make_event would dump an InventorySnapshot model: every node again)
        event = Envelope(event_id=random_event_id(), type=EventType.INVENTORY_SNAPSHOT.value,
                         occurred_at=to_datetime(self.clock.time()), producer=self.producer,
                         payload=self.snapshot_payload(), region=self.cluster.region, zone=self.cluster.zone,
                         cluster=self.cluster.name, actor=self.producer)
        with telemetry.root_span("agent.inventory.snapshot", cluster=self.cluster.name):
            await self.publisher.publish(self.subjects.inventory(self.cluster.region, self.cluster.name), event)

    async def publish_heartbeat(self) -> None:
        """Publish a heartbeat with totals and the orders not yet read (``orders_backlog``:
        the scheduler does not reclaim what this agent has yet to read) in a new root trace."""
        self.sequence += 1
        payload = Heartbeat(sequence=self.sequence, gpus_total=self._gpus_total, gpu_milli_free=self._gpu_milli_free,
                            running_jobs=len(self.running),
                            orders_backlog=self._consumer.backlog if self._consumer is not None else 0)
        event = make_event(EventType.INVENTORY_HEARTBEAT, payload, producer=self.producer, occurred_at=self.clock.time(),
                           region=self.cluster.region, zone=self.cluster.zone, cluster=self.cluster.name,
                           actor=self.producer)
        with telemetry.root_span("agent.inventory.heartbeat", cluster=self.cluster.name):
            await self.publisher.publish(self.subjects.heartbeat(self.cluster.region, self.cluster.name), event)


#: The agent's consumer of its placements subject: placements and stop orders. Another known
#: type there is dead-lettered (it has no business on that subject); an unknown one is skipped.
#: Orders of the active scheduler (fenced by its lease's token).
ORDER_TYPES = frozenset({EventType.JOB_PLACED, EventType.JOB_STOP})

PLACEMENT_EVENTS: EventTable = EventTable({
    EventType.JOB_PLACED: ClusterAgent._handle_placed,
    EventType.JOB_STOP: ClusterAgent._handle_stop,
})

#: The agent's rebuild (its placements and status subjects): which fold of ``Agent.rebuild`` an
#: event takes. Every terminal status ends the attempt; ``job.cancelled`` is the scheduler's, for
#: a job that never held resources here (it is published on the decisions subject).
REBUILD_EVENTS: EventTable = EventTable({
    EventType.JOB_PLACED: "placed",
    EventType.JOB_STOP: "stop",
    EventType.JOB_STARTED: "started",
    EventType.JOB_FINISHED: "ended",
    EventType.JOB_FAILED: "ended",
    EventType.JOB_STOPPED: "ended",
    EventType.JOB_REJECTED: "ended",
}, ignores=frozenset({EventType.JOB_CANCELLED, EventType.AGENT_RECONCILED}))
