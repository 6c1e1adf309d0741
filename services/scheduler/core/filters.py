"""Hard filters: a failed filter excludes the cluster for this job.

Each filter is a small object with a ``name`` and ``check(job, cluster, ctx) -> Verdict``; it
never raises and never mutates. It also says what of the job ``check`` reads (the cluster and
the context are fixed for a cycle), because decide() caches a verdict per (cluster, those
properties of every filter) and two jobs that agree on them get the same verdict: either
``reads``, attribute paths of the :class:`~.snapshot.QueuedJob` (``"spec.card_models"``), or a
``key(job, ctx) -> tuple`` method when that depends on the context (the quota filter: the
tenant matters only if it has rules). A filter that declares neither is never shared between
jobs (:func:`key_function`). The gang-capacity check needs the cycle's working allocation, so
it lives in :mod:`.decide` (it is reported with the same :class:`~.reasons.Verdict` type).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Mapping, Protocol, Sequence

from fedsched.reasons import PASS, Reason, Verdict, fail
from services.scheduler.core.snapshot import ClusterState, QueuedJob, View
from fedsched.jobs import Locality


@dataclass(frozen=True, slots=True)
class Context:
    """What filters and scorers may read besides the job and the cluster.

    Attributes:
        view: the snapshot (``now``, staleness bound, all clusters for normalising).
        inter_region_bandwidth_bps: bytes per second between regions, for transfer time.
        region_bandwidth_bps: (from region, to region) -> bytes per second, where the topology
            gives the pair (else ``inter_region_bandwidth_bps``).
        egress_price_per_gb: currency units per GB moved between regions.
        max_price: the highest GPU-hour price in the view (for normalising), > 0.
        memo: a cycle's memo for pure per-job figures (per region, unit price...) such as bytes
            to move; every key names its job. decide() empties it before each job.
    """

    view: View
    inter_region_bandwidth_bps: float = 1.25e9
    egress_price_per_gb: float = 0.5
    max_price: float = 1.0
    region_bandwidth_bps: Mapping[tuple[str, str], float] = field(default_factory=dict, compare=False)
    memo: dict = field(default_factory=dict, compare=False)  # memo of pure per-job figures


class Filter(Protocol):
    """A hard constraint."""

    name: str
    #: attribute paths of the job :meth:`check` reads (or define ``key(job, ctx) -> tuple``)
    reads: tuple[str, ...]

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        """PASS, or the reason this cluster cannot take ``job``."""
        ...


def _entry(job: QueuedJob) -> tuple:
    return (job.job_id, job.shard, job.attempt)


def key_function(filters: Sequence[Filter], ctx: Context) -> Callable[[QueuedJob], tuple]:
    """``job -> tuple`` of everything ``filters`` read of a job: the ``reads`` paths of all of
    them (one C-level getter), the ``key(job, ctx)`` of those that define one, and the queue
    entry's identity if any filter declares neither (its verdicts are then never shared)."""
    paths: list[str] = []
    keyed = []
    for flt in filters:
        key = getattr(flt, "key", None)
        reads = getattr(flt, "reads", None)
        if key is not None:
            keyed.append(key)
        elif reads is not None:
            paths.extend(p for p in reads if p not in paths)
        else:
            keyed.append(lambda job, ctx: _entry(job))
    getter = attrgetter(*paths) if paths else (lambda job: ())
    if len(paths) == 1:
        getter = (lambda one: lambda job: (one(job),))(getter)
    if not keyed:
        return getter
    return lambda job: (getter(job), *[key(job, ctx) for key in keyed])


def filter_key_functions(filters: Sequence[Filter], ctx: Context) -> list[Callable[[QueuedJob], object]]:
    """Per filter, ``job -> key`` of what that filter alone reads of a job (its ``reads`` paths,
    its ``key(job, ctx)``, or the queue entry's identity if it declares neither): jobs that
    agree on it get the same verdict from that filter on any one cluster."""
    out: list[Callable[[QueuedJob], object]] = []
    for flt in filters:
        key = getattr(flt, "key", None)
        reads = getattr(flt, "reads", None)
        if key is not None:
            out.append((lambda key: lambda job: key(job, ctx))(key))
        elif reads is not None:
            out.append(attrgetter(*reads) if reads else (lambda job: ()))
        else:
            out.append(_entry)
    return out


class Healthy:
    """The cluster is alive (fresh heartbeat), not in maintenance, and has healthy nodes."""

    name = "healthy"
    reads = ()

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        if cluster.heartbeat_age_s > ctx.view.stale_after_s:
            return fail(Reason.STALE, f"last heartbeat {cluster.heartbeat_age_s:.0f}s ago "
                                      f"(limit {ctx.view.stale_after_s:.0f}s)")
        if cluster.maintenance:
            return fail(Reason.MAINTENANCE, "drained for maintenance")
        if not any(n.healthy for n in cluster.nodes):
            return fail(Reason.UNHEALTHY, "no healthy node")
        return PASS

class Regions:
    """Allowed / forbidden regions, and the must-stay-local locality class."""

    name = "regions"
    reads = ("spec.forbidden_regions", "spec.allowed_regions", "spec.locality", "spec.home_region")

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        spec = job.spec
        if cluster.region in spec.forbidden_regions:
            return fail(Reason.REGION_FORBIDDEN, f"{cluster.region} is forbidden for this job")
        if spec.allowed_regions and cluster.region not in spec.allowed_regions:
            return fail(Reason.REGION_NOT_ALLOWED, f"{cluster.region} not in {', '.join(spec.allowed_regions)}")
        if spec.locality == Locality.MUST_LOCAL and cluster.region != spec.home_region:
            return fail(Reason.NOT_HOME, f"must stay in {spec.home_region}")
        return PASS

class CrossRegionMode:
    """The tenant's cross-region mode for the job's class: ``forbidden`` keeps it at home."""

    name = "cross_region_mode"
    reads = ("cross_region", "spec.home_region")

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        if job.cross_region == "forbidden" and cluster.region != job.spec.home_region:
            return fail(Reason.NOT_HOME, f"tenant policy forbids leaving {job.spec.home_region}")
        return PASS

class HomeOnly:
    """Every job stays in its home region (the ``local-only`` baseline policy)."""

    name = "home_only"
    reads = ("spec.home_region",)

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        if cluster.region != job.spec.home_region:
            return fail(Reason.NOT_HOME, f"policy keeps jobs in their home region {job.spec.home_region}")
        return PASS

class Residency:
    """The cluster carries every data-residency / compliance tag the job has."""

    name = "residency"
    reads = ("spec.residency_tags",)

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        missing = set(job.spec.residency_tags) - cluster.residency_tags
        if missing:
            return fail(Reason.RESIDENCY, "cluster lacks " + ", ".join(sorted(missing)))
        return PASS

class CardModels:
    """The cluster offers an allowed card model with enough on-card memory."""

    name = "card_model"
    reads = ("spec.gpus_per_worker", "spec.card_models", "spec.min_gpu_memory_gib")

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        spec = job.spec
        if spec.gpus_per_worker == 0:
            return PASS
        if not candidate_models(job, cluster, within_price=False):
            offered = sorted(cluster.card_models)
            if spec.card_models and not set(spec.card_models) & set(offered):
                return fail(Reason.CARD_MODEL, f"wants {', '.join(spec.card_models)}; offers {', '.join(offered) or 'none'}")
            if spec.min_gpu_memory_gib:
                return fail(Reason.GPU_MEMORY, f"needs >= {spec.min_gpu_memory_gib} GiB per card")
            return fail(Reason.CARD_MODEL, "no GPU nodes")
        return PASS

class Interconnect:
    """Multi-node gangs that need RDMA run only where the fabric has it."""

    name = "interconnect"
    reads = ("spec.requires_rdma",)

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        if job.spec.requires_rdma and cluster.interconnect not in ("rdma", "infiniband"):
            return fail(Reason.INTERCONNECT, f"needs RDMA; cluster fabric is {cluster.interconnect}")
        return PASS

class PriceCeiling:
    """The cheapest allowed card here is within the job's price ceiling."""

    name = "price"
    reads = ("spec.max_price_per_gpu_hour", "spec.gpus_per_worker", "spec.card_models", "spec.min_gpu_memory_gib")

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        ceiling = job.spec.max_price_per_gpu_hour
        if not ceiling or job.spec.gpus_per_worker == 0:
            return PASS
        prices = [cluster.prices.get(m, 0.0) for m in candidate_models(job, cluster, within_price=False)]
        if prices and min(prices) > ceiling:
            return fail(Reason.PRICE, f"cheapest card {min(prices):.2f}/GPU-h > ceiling {ceiling:.2f}")
        return PASS

def candidate_models(job: QueuedJob, cluster: ClusterState, *, within_price: bool = True) -> list[str]:
    """Card models of ``cluster`` that ``job`` may use (allowed, memory and -- unless
    ``within_price`` is False -- price ceiling), cheapest first."""
    spec = job.spec
    allowed = set(spec.card_models)
    out = []
    for model, mem in cluster.idx().memory.items():
        if allowed and model not in allowed:
            continue
        if spec.min_gpu_memory_gib and (mem is None or mem < spec.min_gpu_memory_gib):
            continue
        if within_price and spec.max_price_per_gpu_hour and cluster.prices.get(model, 0.0) > spec.max_price_per_gpu_hour:
            continue
        out.append(model)
    return sorted(out, key=lambda m: (cluster.prices.get(m, 0.0), m))


#: The standard hard filters, cheapest first.
STANDARD_FILTERS: tuple[Filter, ...] = (Healthy(), Regions(), CrossRegionMode(), Residency(), CardModels(), Interconnect(),
                                        PriceCeiling())


class Quota:
    """The tenant's quota (``view.quota``) has room for the job on some allowed card model in
    this cluster's region (rules and formula in :mod:`.quota`). Without quotas in the view, or
    for CPU-only jobs, it passes. Which model the gang fit then picks is re-checked when the
    cycle's placements are admitted in order (``services.scheduler.approvals``).
    """

    name = "quota"

    def check(self, job: QueuedJob, cluster: ClusterState, ctx: Context) -> Verdict:
        book = ctx.view.quota
        spec = job.spec
        if book is None or spec.gpus_per_worker == 0 or not book.limits(spec.tenant):
            return PASS
        first = PASS
        for model in candidate_models(job, cluster, within_price=False):
            verdict = book.check(spec.tenant, model, cluster.region, spec.total_gpu_milli)
            if verdict.passed:
                return PASS
            if first.passed:
                first = verdict
        return first

    def key(self, job: QueuedJob, ctx: Context) -> tuple:
        """What :meth:`check` reads of the job: the tenant (only when it has rules: tenants
        without any share one verdict, PASS), whether it wants GPUs, its GPU demand (milli-GPU)
        and what picks its card models."""
        s, book = job.spec, ctx.view.quota
        tenant = s.tenant if book is not None and book.limits(s.tenant) else None
        return tenant, s.gpus_per_worker > 0, s.total_gpu_milli, s.card_models, s.min_gpu_memory_gib
