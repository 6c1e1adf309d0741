"""The immutable inputs of a scheduling decision: the resource view and the queue.

A :class:`View` is a frozen snapshot of every cluster (its nodes with free resources, health,
freshness, prices) at one business time. A :class:`QueuedJob` is a job waiting for a placement.
Nothing here does I/O; the scheduler service builds these from the bus.

Units: GPU shares in milli-GPU per device (1000 = one whole card), CPU in milli-cores,
memory in MiB, on-card memory in GiB, ages in seconds, prices per GPU-hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

from fedsched.jobs import JobSpec

if TYPE_CHECKING:
    from fedsched.quota import QuotaBook

WHOLE = 1000  #: milli-GPUs in one card


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node: capacity and what is free right now.

    Attributes:
        name: node name.
        card_model: canonical card model ("" for a CPU-only node).
        gpu_memory_gib: on-card memory of its cards (None = not disclosed).
        gpu_free: free milli-GPU per device (len = number of cards; 1000 = idle card).
        cpu_free_milli / memory_free_mib: free CPU and host memory.
        cpu_milli / memory_mib: capacity (for fits-when-empty checks).
        healthy: node condition Ready and not cordoned.
        rdma: attached to an RDMA/InfiniBand fabric.
    """

    name: str
    card_model: str
    gpu_memory_gib: int | None
    gpu_free: tuple[int, ...]
    cpu_free_milli: int
    memory_free_mib: int
    cpu_milli: int
    memory_mib: int
    healthy: bool = True
    rdma: bool = False

    @property
    def gpus(self) -> int:
        """Number of cards."""
        return len(self.gpu_free)

    @property
    def whole_free(self) -> int:
        """Cards with nothing allocated."""
        return sum(1 for g in self.gpu_free if g == WHOLE)


@dataclass(frozen=True, slots=True)
class RunningWork:
    """A job attempt holding resources on a cluster (placed or running).

    The core needs it for preemption (who could be evicted, at what cost), backfill (when the
    cluster frees up) and wait estimates.

    Attributes:
        job_id, attempt, shard, tenant: identity.
        priority: numeric priority (higher = more important).
        preemptible / checkpointable: may be evicted / resumes from a checkpoint.
        started_at: business time it started (None = placed, not started yet).
        est_end: estimated business end time, from the submitter's estimate (never the true
            runtime); ``inf`` when the job gave no estimate.
        card_model: its card model ("" for CPU-only).
        bindings: per worker ``(node index, devices, milli-GPU per device, milli-CPU, MiB)``.
    """

    job_id: str
    attempt: int
    shard: int
    tenant: str
    priority: int
    preemptible: bool
    checkpointable: bool
    started_at: float | None
    est_end: float
    card_model: str
    bindings: tuple[tuple[int, tuple[int, ...], int, int, int], ...]

    @property
    def gpu_milli(self) -> int:
        """Milli-GPUs it holds."""
        return sum(len(devs) * milli for _, devs, milli, _, _ in self.bindings)


class RunningSet(Sequence):
    """A cluster's running work as the scheduler service hands it over: an immutable sequence of
    :class:`RunningWork` (what :attr:`ClusterState.running` holds; a plain tuple is equally valid).

    ``started`` is work that started (records kept by the service from cycle to cycle);
    ``pending`` describes work placed but not started yet, which is expected to start at the
    view's business time ``now``: each entry is the :class:`RunningWork` fields in order with
    ``started_at`` None and, instead of ``est_end``, the seconds of estimated work left
    (``inf`` = no estimate). Their records (``est_end = now + left``) are built on first
    iteration, so a cycle that never reads this cluster's work builds none. Iteration order:
    ``started`` then ``pending`` (the order of the tuple the service built before).

    :meth:`lowest_preemptible` answers from the entries (no records built).
    """

    __slots__ = ("started", "pending", "now", "ends", "pending_sorted", "_all", "_started_low", "_pending_low",
                 "_pending_records", "_pending_order")

    def __init__(self, started: tuple[RunningWork, ...], pending: Sequence[tuple], now: float,
                 started_lowest: int | None | object = ..., ends: Any = None, *,
                 pending_sorted: bool = False, pending_lowest: int | None | object = ...) -> None:
        """``started_lowest``: :meth:`lowest_preemptible` of ``started`` alone if the caller
        keeps it with the tuple (``...`` = compute it when asked); ``pending_lowest`` the same
        of ``pending``. ``ends``: the same started work kept in order of estimated end
        (:class:`~.preempt.EndOrder`, kept by the service as work starts and ends), so what
        frees up first is read without sorting it all (:func:`~.preempt.estimated_start`);
        None = sort when asked. ``pending_sorted``: ``pending`` is in nondecreasing
        :func:`pending_end_key` (the service keeps it so), so it is read in end order lazily.

        ``pending`` may be a container the caller keeps changing between views (a sorted list
        kept incrementally): it must not change while a cycle reads this set (the service
        builds the view and decides before anything awaits)."""
        self.started = started
        self.pending = pending
        self.now = now
        self.ends = ends
        self.pending_sorted = pending_sorted
        self._all: tuple[RunningWork, ...] | None = None if pending else started
        self._started_low = started_lowest
        self._pending_low = pending_lowest
        self._pending_records: tuple[RunningWork, ...] | None = None
        self._pending_order: tuple[float, list] | None = None  # (now, sorted (expected end, work))

    def pending_records(self) -> tuple[RunningWork, ...]:
        """The records of the placed, not started work alone (``est_end = now + left``), built
        once (the same objects :meth:`__iter__` yields after them)."""
        got = self._pending_records
        if got is None:
            got = self._pending_records = self._records()[len(self.started):] if self._all is not None else tuple(
                RunningWork(j, at, sh, te, pr, pe, ck, None, self.now + left, cm, b)
                for j, at, sh, te, pr, pe, ck, left, cm, b in self.pending)
        return got

    def pending_in_end_order(self, now: float) -> Iterable[tuple[float, RunningWork]]:
        """``(expected_end(w, now), w)`` of :meth:`pending_records` in nondecreasing expected
        end (:func:`expected_end`). When ``pending`` is kept sorted
        (``pending_sorted``) and ``now`` is the set's own, a lazy stream: records are built as
        they are read (a wait estimate stops once the job fits), nothing is sorted. Otherwise
        sorted once and kept for the last ``now`` asked (a cycle's wait estimates sort a
        cluster's unstarted work once, not each time). Treat as read-only."""
        if self.pending_sorted and now == self.now:
            return ((now + pending_end_key(e), RunningWork(e[0], e[1], e[2], e[3], e[4], e[5], e[6], None,
                                                           now + e[7], e[8], e[9]))
                    for e in self.pending)
        kept = self._pending_order
        if kept is None or kept[0] != now:
            order = sorted(((expected_end(w, now), w) for w in self.pending_records()), key=_first_of)
            kept = self._pending_order = (now, order)
        return kept[1]

    def _records(self) -> tuple[RunningWork, ...]:
        a = self._all
        if a is None:
            now = self.now
            a = self._all = self.started + tuple(
                RunningWork(j, at, sh, te, pr, pe, ck, None, now + left, cm, b)
                for j, at, sh, te, pr, pe, ck, left, cm, b in self.pending)
        return a

    def __iter__(self) -> Iterator[RunningWork]:
        return iter(self._records())

    def __len__(self) -> int:
        return len(self.started) + len(self.pending)

    def __getitem__(self, i):
        return self._records()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RunningSet, tuple)):
            return self._records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._records())

    def __repr__(self) -> str:
        return f"RunningSet({len(self.started)} started, {len(self.pending)} pending)"

    def lowest_preemptible(self) -> int | None:
        """The lowest priority of its preemptible work (None if none is preemptible).
        O(started + pending), without building the pending records."""
        low = self._started_low
        if low is ...:
            low = self._started_low = min((w.priority for w in self.started if w.preemptible), default=None)
        plow = self._pending_low
        if plow is ...:
            plow = self._pending_low = min((e[4] for e in self.pending if e[5]), default=None)
        return plow if low is None else low if plow is None else min(low, plow)


def _first_of(item: tuple) -> float:
    return item[0]


#: work left below this (seconds) is recorded as none left in a pending entry (see
#: :func:`pending_end_key`)
MIN_LEFT_S = 1e-3

#: an overdue job (past its estimated end) is expected to end at least this long from now
#: (:func:`expected_end`)
OVERDUE_FLOOR_S = 300.0


def expected_end(w: RunningWork, now: float) -> float:
    """When ``w`` is expected to end: its estimated end while that is ahead; once it overran
    its estimate (estimates are the submitters' guesses), half of what it has run so far from
    now, at least :data:`OVERDUE_FLOOR_S` (5 minutes) -- an overdue job is not about to free its
    cards "now"."""
    if w.est_end > now:
        return w.est_end
    ran = now - w.started_at if w.started_at is not None else 0.0
    return now + max(OVERDUE_FLOOR_S, 0.5 * ran)


def pending_end_key(entry: tuple) -> float:
    """Seconds from a view's ``now`` to the expected end (:func:`expected_end`) of a
    :class:`RunningSet` pending entry (placed, expected to start at ``now``): its work left
    (``inf`` = no estimate), or :data:`OVERDUE_FLOOR_S` when none is left (its record ends at
    ``now``, so it counts as overdue work that has not run). Independent of ``now``: entries
    kept in this order stay in expected-end order from view to view. Exact when ``left`` is 0 or
    at least :data:`MIN_LEFT_S` (the scheduler service rounds less to 0): ``now + left > now``
    then holds for any ``now`` before the year 100,000."""
    left = entry[7]
    return left if left > 0 else OVERDUE_FLOOR_S


def lowest_preemptible(running: Iterable[RunningWork]) -> int | None:
    """The lowest priority of preemptible work in ``running`` (None if none): the same answer
    for a tuple or a :class:`RunningSet` (which answers without building its pending records)."""
    if isinstance(running, RunningSet):
        return running.lowest_preemptible()
    return min((w.priority for w in running if w.preemptible), default=None)


@dataclass(frozen=True, slots=True)
class Usage:
    """Resources a tenant holds across the federation (milli-GPU, milli-CPU, MiB)."""

    gpu_milli: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0

    def plus(self, gpu_milli: int, cpu_milli: int, memory_mib: int) -> "Usage":
        """This usage with more added."""
        return Usage(self.gpu_milli + gpu_milli, self.cpu_milli + cpu_milli, self.memory_mib + memory_mib)


@dataclass(frozen=True, slots=True)
class ClusterIndex:
    """Static lookups over a cluster's nodes (depend on models and health, not on free capacity).

    Attributes:
        by_model: card model -> indices of healthy GPU nodes with that model.
        memory: card model -> on-card memory in GiB (None = not disclosed).
        healthy: indices of healthy nodes.
        pool: per node, its capacity-class pool (:func:`pool_of`; None = unhealthy).
        capacity: healthy capacity (milli-GPU, milli-CPU, MiB).
        empty: the cluster's :class:`CapacityClasses` as if nothing ran (for "could it ever
            fit" checks; built once per inventory, not per cycle).
    """

    by_model: Mapping[str, tuple[int, ...]]
    memory: Mapping[str, int | None]
    healthy: tuple[int, ...]
    pool: tuple[str | None, ...] = ()
    capacity: tuple[int, int, int] = (0, 0, 0)
    empty: "CapacityClasses | None" = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, nodes: tuple["NodeState", ...]) -> "ClusterIndex":
        """Index ``nodes`` (O(nodes))."""
        by_model: dict[str, list[int]] = {}
        memory: dict[str, int | None] = {}
        healthy = []
        pools: list[str | None] = []
        gpu = cpu = mem = 0
        for i, n in enumerate(nodes):
            pools.append(pool_of(n))
            if not n.healthy:
                continue
            healthy.append(i)
            gpu += len(n.gpu_free) * WHOLE
            cpu += n.cpu_milli
            mem += n.memory_mib
            if n.card_model and n.gpu_free:
                by_model.setdefault(n.card_model, []).append(i)
                memory.setdefault(n.card_model, n.gpu_memory_gib)
        pool = tuple(pools)
        empty = CapacityClasses.build(nodes, pool, empty=True)
        return cls({m: tuple(v) for m, v in by_model.items()}, memory, tuple(healthy), pool, (gpu, cpu, mem), empty)


def pool_of(node: "NodeState") -> str | None:
    """The capacity-class pool of a node: its card model for a healthy GPU node, ``""`` for a
    healthy node without cards (or without a card model), None for an unhealthy node (never
    used)."""
    if not node.healthy:
        return None
    return node.card_model if node.card_model and node.gpu_free else ""


Signature = tuple  #: ``(gpu_free per device, free milli-CPU, free MiB)`` of a node


@dataclass(frozen=True, slots=True)
class CapacityClasses:
    """A cluster's healthy nodes grouped into capacity classes: nodes with the same pool (card
    model) and the same free state -- free milli-GPU per device, free milli-CPU, free MiB --
    collapse into one class, its node indices in ascending order. Gang fitting looks at classes, not nodes
    (:class:`~.fit.WorkingCluster`); the nodes of one class are interchangeable for every fit
    rule, which then picks the lowest node index of the chosen class, so a class-based fit
    chooses the node a node-by-node scan would.

    Classes are exact (no buckets): every quantity a fit or tie-break reads is part of the
    signature. A cluster of 5,000 nodes of a few node types has tens to hundreds of classes.

    Attributes:
        pools: pool (card model, ``""`` for nodes without cards) -> signature -> node indices,
            ascending (a cycle's working copy reads a class's lowest node without sorting, and
            shares the tuple until the cycle changes the class: :class:`~.fit.WorkingCluster`).
        gpu_free / cpu_free / mem_free: per node (all nodes, by index) the free state.
    """

    pools: Mapping[str, Mapping[Signature, tuple[int, ...]]]
    gpu_free: tuple[tuple[int, ...], ...]
    cpu_free: tuple[int, ...]
    mem_free: tuple[int, ...]

    @classmethod
    def build(cls, nodes: tuple["NodeState", ...], pools_of: tuple[str | None, ...] | None = None, *,
              empty: bool = False) -> "CapacityClasses":
        """Group ``nodes`` (O(nodes)); ``empty`` groups their capacity instead of what is free."""
        if empty:
            gpu = tuple((WHOLE,) * len(n.gpu_free) for n in nodes)
            cpu = tuple(n.cpu_milli for n in nodes)
            mem = tuple(n.memory_mib for n in nodes)
        else:
            gpu = tuple(n.gpu_free for n in nodes)
            cpu = tuple(n.cpu_free_milli for n in nodes)
            mem = tuple(n.memory_free_mib for n in nodes)
        if pools_of is None or len(pools_of) != len(nodes):
            pools_of = tuple(pool_of(n) for n in nodes)
        groups: dict[str, dict[Signature, list[int]]] = {}
        for i, p in enumerate(pools_of):
            if p is not None:
                groups.setdefault(p, {}).setdefault((gpu[i], cpu[i], mem[i]), []).append(i)
        return cls({p: {sig: tuple(v) for sig, v in g.items()} for p, g in groups.items()}, gpu, cpu, mem)

    def updated(self, nodes: tuple["NodeState", ...], changed: Iterable[int],
                pools_of: tuple[str | None, ...]) -> "CapacityClasses":
        """These classes after the free state of the nodes at indices ``changed`` became what
        ``nodes`` says (nodes and health unchanged); O(changed + size of the classes touched),
        not O(nodes). ``self`` is not modified."""
        gpu, cpu, mem = list(self.gpu_free), list(self.cpu_free), list(self.mem_free)
        leave: dict[tuple[str, Signature], set[int]] = {}
        join: dict[tuple[str, Signature], set[int]] = {}
        for i in set(changed):
            p = pools_of[i]
            n = nodes[i]
            old = (gpu[i], cpu[i], mem[i])
            new = (n.gpu_free, n.cpu_free_milli, n.memory_free_mib)
            gpu[i], cpu[i], mem[i] = new
            if p is None or old == new:
                continue
            leave.setdefault((p, old), set()).add(i)
            join.setdefault((p, new), set()).add(i)
        pools = dict(self.pools)
        copied: set[str] = set()
        for (p, sig), ids in list(leave.items()) + list(join.items()):
            if p not in copied:
                pools[p] = dict(pools.get(p, {}))
                copied.add(p)
        for (p, sig), ids in leave.items():
            rest = tuple(i for i in pools[p][sig] if i not in ids)
            if rest:
                pools[p][sig] = rest
            else:
                del pools[p][sig]
        for (p, sig), ids in join.items():
            pools[p][sig] = tuple(sorted((*pools[p].get(sig, ()), *sorted(ids))))  # two ascending runs: merged
        return CapacityClasses(pools, tuple(gpu), tuple(cpu), tuple(mem))

    @property
    def count(self) -> int:
        """Number of classes."""
        return sum(len(g) for g in self.pools.values())


@dataclass(frozen=True, slots=True)
class ClusterState:
    """One cluster as the scheduler sees it.

    Attributes:
        name, region, zone: canonical names.
        nodes: every node.
        heartbeat_age_s: wall seconds since the agent's last heartbeat.
        maintenance: drained (no new placements).
        residency_tags: compliance tags the cluster satisfies.
        interconnect: ``rdma``/``infiniband``/``ethernet`` between nodes.
        prices: canonical card model -> price per GPU-hour (currency units); CPU-only work is
            priced at ``cpu_price_per_core_hour``.
        index: precomputed :class:`ClusterIndex` of ``nodes`` (optional; builders that reuse it
            across snapshots save the O(nodes) pass). Must match ``nodes`` when given.
        classes: precomputed :class:`CapacityClasses` of ``nodes`` (optional, same contract:
            the scheduler service updates them from the nodes whose allocation changed).
        running: work holding resources here (its allocations are already subtracted from the
            nodes' free resources).
    """

    name: str
    region: str
    zone: str
    nodes: tuple[NodeState, ...]
    heartbeat_age_s: float = 0.0
    maintenance: bool = False
    residency_tags: frozenset[str] = frozenset()
    interconnect: str = "ethernet"
    prices: Mapping[str, float] = field(default_factory=dict)
    cpu_price_per_core_hour: float = 0.0
    index: ClusterIndex | None = field(default=None, compare=False, repr=False)
    running: tuple[RunningWork, ...] = ()
    classes: CapacityClasses | None = field(default=None, compare=False, repr=False)

    def idx(self) -> ClusterIndex:
        """The node index (given, or built now)."""
        return self.index if self.index is not None else ClusterIndex.build(self.nodes)

    def capacity_classes(self) -> CapacityClasses:
        """The nodes' capacity classes (given, or built now: O(nodes))."""
        return self.classes if self.classes is not None else CapacityClasses.build(self.nodes, self.idx().pool)

    def prepared(self) -> "ClusterState":
        """This cluster with its index and capacity classes computed (what a service that keeps
        them across cycles hands :func:`~.decide.decide`)."""
        index = self.idx()
        if self.index is index and self.classes is not None:
            return self
        return replace(self, index=index, classes=CapacityClasses.build(self.nodes, index.pool))

    @property
    def card_models(self) -> frozenset[str]:
        """Card models present on healthy nodes."""
        return frozenset(self.idx().by_model)

    @property
    def gpu_capacity_milli(self) -> int:
        """Total milli-GPUs on healthy nodes."""
        return sum(len(n.gpu_free) * WHOLE for n in self.nodes if n.healthy)

    @property
    def gpu_free_milli(self) -> int:
        """Free milli-GPUs on healthy nodes."""
        return sum(sum(n.gpu_free) for n in self.nodes if n.healthy)


@dataclass(frozen=True, slots=True)
class View:
    """The federation at one instant.

    Attributes:
        clusters: every known cluster, in a stable order (by name).
        now: business time (seconds since the Unix epoch).
        stale_after_s: inventories older than this (heartbeat age) are excluded.
        tenant_usage: what each tenant holds now (for dominant-resource fair share).
        quota: tenants' quota rules with the usage in force (a
            :class:`~fedsched.quota.QuotaBook`; None = no quotas). Read-only here.
    """

    clusters: tuple[ClusterState, ...]
    now: float
    stale_after_s: float = 10.0
    tenant_usage: Mapping[str, Usage] = field(default_factory=dict)
    quota: "QuotaBook | None" = None

    def cluster(self, name: str) -> ClusterState | None:
        """The cluster called ``name``, or None."""
        for c in self.clusters:
            if c.name == name:
                return c
        return None


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A job (or one shard of a split batch job) waiting for a placement.

    Attributes:
        job_id: the job.
        attempt: the placement attempt this decision would create (1-based).
        spec: what it asks for.
        submitted_at: business time it was accepted (s since the Unix epoch); aging counts from
            here.
        avoid_clusters: clusters where earlier attempts failed (failover prefers others).
        shard: shard index for split batch jobs.
        cross_region: the tenant's cross-region mode for this job class: ``allowed``,
            ``approval`` (the core may propose a placement abroad; the service asks an approver
            before publishing it) or ``forbidden`` (home region only).
        progress_s: work already done and checkpointed by earlier attempts (s), for resumes.
    """

    job_id: str
    attempt: int
    spec: JobSpec
    submitted_at: float
    avoid_clusters: frozenset[str] = frozenset()
    shard: int = 0
    cross_region: str = "allowed"
    progress_s: float = 0.0

    @property
    def key(self) -> str:
        """Unique key of this queue entry (``job_id`` or ``job_id#shard``)."""
        return f"{self.job_id}#{self.shard}" if self.spec.shards > 1 else self.job_id
