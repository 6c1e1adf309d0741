"""The immutable inputs of a scheduling decision: the resource view and the queue.

A :class:`View` is a frozen snapshot of every cluster (its nodes with free resources, health,
freshness, prices) at one business time. A :class:`QueuedJob` is a job waiting for a placement.
Nothing here does I/O; the scheduler service builds these from the bus.

Units: GPU shares in milli-GPU per device (1000 = one whole card), CPU in milli-cores,
memory in MiB, on-card memory in GiB, ages in seconds, prices per GPU-hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

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
    """

    by_model: Mapping[str, tuple[int, ...]]
    memory: Mapping[str, int | None]
    healthy: tuple[int, ...]

    @classmethod
    def build(cls, nodes: tuple["NodeState", ...]) -> "ClusterIndex":
        """Index ``nodes`` (O(nodes))."""
        by_model: dict[str, list[int]] = {}
        memory: dict[str, int | None] = {}
        healthy = []
        for i, n in enumerate(nodes):
            if not n.healthy:
                continue
            healthy.append(i)
            if n.card_model and n.gpu_free:
                by_model.setdefault(n.card_model, []).append(i)
                memory.setdefault(n.card_model, n.gpu_memory_gib)
        return cls({m: tuple(v) for m, v in by_model.items()}, memory, tuple(healthy))


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

    def idx(self) -> ClusterIndex:
        """The node index (given, or built now)."""
        return self.index if self.index is not None else ClusterIndex.build(self.nodes)

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
