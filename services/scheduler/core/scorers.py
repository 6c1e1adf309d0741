"""Soft scores: among clusters that pass every filter, which is best for this job?

Each scorer returns a value in [0, 1] (1 = best) for (job, cluster, fit); the policy weighs
them: ``total = sum(weight_i * score_i)``. A score depends only on its own cluster, never on the
other candidates, and each scorer also gives an upper ``bound`` computable before the fit (the
exact value where the fit does not matter). :func:`~.decide.decide` evaluates clusters in order
of their bound and stops once the best total found beats every remaining bound (branch and
bound: the same choice as scoring every cluster, without fitting most of them). Formulas are in
each scorer's docstring.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Mapping, Protocol

from services.scheduler.core.filters import Context
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.snapshot import WHOLE, ClusterState, QueuedJob


class Scorer(Protocol):
    """A soft preference."""

    name: str

    def score(self, job: QueuedJob, cluster: ClusterState, fit: Fit, work: WorkingCluster, ctx: Context) -> float:
        """Preference for placing ``job`` with ``fit`` on ``cluster``, in [0, 1]."""
        ...

    def bound(self, job: QueuedJob, cluster: ClusterState, work: WorkingCluster, ctx: Context,
              models: list[str]) -> float:
        """An upper bound of :meth:`score` over every fit ``job`` could get on ``cluster``
        (``models``: its candidate card models there, cheapest first)."""
        ...

    # optional, for a ``region`` or ``region_price`` bound: ``bounds(job, places, ctx) ->
    # list[float]``, :meth:`bound` of each (cluster, work, models) of ``places`` in one call
    # (decide asks a job's bounds on every region of a search at once; without it, one by one)


class _Bounded:
    """Default bound: 1 (no better bound known)."""

    bound_scope = "const"

    def bound(self, job, cluster, work, ctx, models) -> float:
        return 1.0


#: ``score_scope = "fit"`` says a scorer's score reads only the fit, the request shape and the
#: allocation of the fit's card-model pool in the cluster (its nodes' free state, the pool's
#: totals; not the job's data, home or estimate): decide() computes it once per (pool
#: allocation, fit) and shares it between jobs of that shape. ``"region"``: it reads
#: only the job and the cluster's region; ``"region_price"``: only the job, the cluster's region,
#: the unit price the fit pays there (its card model's list price; CPU-only work: the core-hour
#: price) and the job's cost reference (:func:`set_cost_reference`): decide() computes either
#: once per region (and price) in a job's search. The default is ``"job"`` (computed per fit).
#:
#: ``score_is_bound = True`` says a ``region`` or ``region_price`` scorer's score of a fit is its
#: bound on the fit's place whenever the fit pays the unit price that bound reads (its cheapest
#: candidate model's list price; CPU-only work: the core-hour price) -- for a ``region`` scorer,
#: always: decide() then takes a scored fit's term from the search's bounds.
#:
#: ``bound_scope`` of a scorer says what its bound depends on, so decide() can compute it once
#: per job for all clusters sharing that key: ``const``, ``region``, ``region_price`` (region and
#: the price of the cheapest candidate card model), ``cluster_shape`` (the cluster's state and the
#: request's shape: memoised until the cluster changes) or ``cluster`` (the default).


def transfer_bytes(job: QueuedJob, cluster: ClusterState) -> int:
    """Bytes of the job's datasets that live outside the cluster's region."""
    region = cluster.region
    total = 0
    for d in job.spec.datasets:
        if d.home_region != region:
            total += d.size_bytes
    return total


def remote_bytes(job: QueuedJob, cluster: ClusterState, ctx: Context) -> int:
    """:func:`transfer_bytes`, memoised per job and region in ``ctx.memo`` (the cycle's)."""
    key = ("bytes", job.job_id, job.shard, cluster.region)
    value = ctx.memo.get(key)
    if value is None:
        value = ctx.memo[key] = transfer_bytes(job, cluster)
    return value


def transfer_seconds(job: QueuedJob, cluster: ClusterState, ctx: Context) -> float:
    """Estimated time to move the job's remote datasets (s): each dataset's bytes / the bandwidth
    from its home region to the cluster's (``ctx.region_bandwidth_bps``, else
    ``ctx.inter_region_bandwidth_bps``), summed (moved one after another)."""
    if not ctx.region_bandwidth_bps:
        return remote_bytes(job, cluster, ctx) / ctx.inter_region_bandwidth_bps
    key = ("secs", job.job_id, job.shard, cluster.region)
    value = ctx.memo.get(key)
    if value is None:
        bw, default = ctx.region_bandwidth_bps, ctx.inter_region_bandwidth_bps
        value = ctx.memo[key] = sum(d.size_bytes / bw.get((d.home_region, cluster.region), default)
                                    for d in job.spec.datasets if d.home_region != cluster.region)
    return value


def egress_cost(job: QueuedJob, cluster: ClusterState, ctx: Context) -> float:
    """Estimated egress charge: remote bytes / 1e9 x price per GB (currency units)."""
    return remote_bytes(job, cluster, ctx) / 1e9 * ctx.egress_price_per_gb


def estimated_hours(job: QueuedJob) -> float:
    """The submitter's runtime estimate in hours (1 h when none was given)."""
    est = job.spec.estimated_duration_s
    return (est if est is not None and est > 0 else 3600.0) / 3600.0


def _costing(job: QueuedJob, ctx: Context) -> tuple:
    """What the cost figures read of the job, memoised per job in ``ctx.memo``: (GPUs per
    worker, the gang's milli-GPUs, milli-CPU per worker, workers, estimated hours, the
    estimated GPU-hours -- CPU-only: core-hours -- at least 1e-9)."""
    key = ("costing", job.job_id, job.shard)
    got = ctx.memo.get(key)
    if got is None:
        spec = job.spec
        gpu, total, cpu, workers = spec.gpus_per_worker, spec.total_gpu_milli, spec.cpu_milli, spec.workers
        hours = estimated_hours(job)
        units = total / WHOLE if gpu else cpu * workers / 1000
        got = ctx.memo[key] = (gpu, total, cpu, workers, hours, max(units * hours, 1e-9))
    return got


def estimated_cost(job: QueuedJob, cluster: ClusterState, card_model: str, ctx: Context) -> float:
    """Estimated cost of running ``job`` here: compute + egress (currency units).

    compute = price(card model) x GPUs x estimated hours (CPU-only: cores x hours x CPU price).
    """
    gpu, total, cpu, workers, hours, _ = _costing(job, ctx)
    if gpu:
        compute = cluster.prices.get(card_model, 0.0) * total / WHOLE * hours
    else:
        compute = cluster.cpu_price_per_core_hour * cpu * workers / 1000 * hours
    return compute + egress_cost(job, cluster, ctx)


class HomeRegion:
    """1 in the job's home region, else 0 (data and people usually live at home)."""

    name = "home"
    bound_scope = "region"
    score_scope = "region"
    score_is_bound = True  # (bound() is score())

    def score(self, job, cluster, fit, work, ctx) -> float:
        return 1.0 if cluster.region == job.spec.home_region else 0.0

    def bound(self, job, cluster, work, ctx, models) -> float:
        return self.score(job, cluster, None, work, ctx)

    def bounds(self, job, places, ctx) -> list[float]:
        home = job.spec.home_region
        return [1.0 if cluster.region == home else 0.0 for cluster, _, _ in places]


class StartTime:
    """Earlier start is better, and a missed deadline is worst.

    ``delay`` = data transfer before start (remote bytes / inter-region bandwidth); the score is
    ``1 / (1 + delay / 1800)`` (half an hour of delay halves it), and 0 when ``now + delay``
    passes the job's start deadline.
    """

    name = "start"
    bound_scope = "region"
    score_scope = "region"  # transfer time from the datasets' regions; the deadline
    score_is_bound = True  # (bound() is score())

    def score(self, job, cluster, fit, work, ctx) -> float:
        delay = transfer_seconds(job, cluster, ctx)
        deadline = job.spec.start_deadline
        if deadline is not None and ctx.view.now + delay > deadline.timestamp():
            return 0.0
        return 1.0 / (1.0 + delay / 1800.0)

    def bound(self, job, cluster, work, ctx, models) -> float:
        return self.score(job, cluster, None, work, ctx)

    def bounds(self, job, places, ctx) -> list[float]:
        deadline = job.spec.start_deadline
        limit = deadline.timestamp() if deadline is not None else None
        now = ctx.view.now
        # one bandwidth everywhere: the bytes outside each region (as transfer_bytes adds them)
        datasets = None if ctx.region_bandwidth_bps else [(d.home_region, d.size_bytes) for d in job.spec.datasets]
        bandwidth = ctx.inter_region_bandwidth_bps
        out = []
        for cluster, _, _ in places:
            if datasets is None:
                delay = transfer_seconds(job, cluster, ctx)
            else:
                region, total = cluster.region, 0
                for home, size in datasets:
                    if home != region:
                        total += size
                delay = total / bandwidth
            out.append(0.0 if limit is not None and now + delay > limit else 1.0 / (1.0 + delay / 1800.0))
        return out


def cost_per_unit_hour(job: QueuedJob, cluster: ClusterState, card_model: str, ctx: Context) -> float:
    """:func:`estimated_cost` per GPU-hour (CPU-only: per core-hour) of the job's estimate.

    It reads of the cluster only its region (egress) and the unit price (of ``card_model``;
    CPU-only: the core-hour price), so it is memoised in ``ctx.memo`` per job and (region, unit
    price) (:func:`_unit_costs`): a job's cost reference, its cost bounds and its cost scores
    share one value."""
    price = cluster.prices.get(card_model, 0.0) if job.spec.gpus_per_worker else cluster.cpu_price_per_core_hour
    table = _unit_costs(job, ctx)
    key = (cluster.region, price)
    value = table.get(key)
    if value is None:
        value = table[key] = estimated_cost(job, cluster, card_model, ctx) / _costing(job, ctx)[5]
    return value


def costs_per_unit_hour(job: QueuedJob, places, ctx: Context) -> list[float]:
    """:func:`cost_per_unit_hour` of each (cluster, card model) of ``places``, in order (one
    look-up of the job's memo for all of them)."""
    table = _unit_costs(job, ctx)
    gpu, total, cpu, workers, hours, units = _costing(job, ctx)
    out = []
    for cluster, card_model in places:
        price = cluster.prices.get(card_model, 0.0) if gpu else cluster.cpu_price_per_core_hour
        key = (cluster.region, price)
        value = table.get(key)
        if value is None:  # estimated_cost(...) / units, the same operations in the same order
            compute = price * total / WHOLE * hours if gpu else price * cpu * workers / 1000 * hours
            value = table[key] = (compute + egress_cost(job, cluster, ctx)) / units
        out.append(value)
    return out


def _unit_costs(job: QueuedJob, ctx: Context) -> dict[tuple[str, float], float]:
    """The job's memo of :func:`cost_per_unit_hour`: (region, unit price) -> value (kept in
    ``ctx.memo``, the cycle's)."""
    key = ("unit cost", job.job_id, job.shard)
    table = ctx.memo.get(key)
    if table is None:
        table = ctx.memo[key] = {}
    return table


class Cost:
    """Cheaper is better: ``c_min / c``, with ``c`` the estimated cost per GPU-hour here
    (compute price plus the egress charge spread over the estimated GPU-hours,
    :func:`cost_per_unit_hour`, with the cheapest allowed card model) and ``c_min`` the lowest
    such cost among the clusters the job could use this cycle (:func:`set_cost_reference`): the
    cheapest place scores 1, one twice as dear 0.5. Without a reference (outside decide) the
    dearest GPU-hour price of the view stands in: ``1 / (1 + c / p_max)``."""

    name = "cost"
    bound_scope = "region_price"
    score_scope = "region_price"
    score_is_bound = True  # (both read cost_per_unit_hour at the region and that unit price)

    def score(self, job, cluster, fit, work, ctx) -> float:
        return _relative_cost(job, cost_per_unit_hour(job, cluster, fit.card_model, ctx), ctx)

    def bound(self, job, cluster, work, ctx, models) -> float:
        cheapest = models[0] if models else ""  # candidate models come cheapest first
        return _relative_cost(job, cost_per_unit_hour(job, cluster, cheapest, ctx), ctx)

    def bounds(self, job, places, ctx) -> list[float]:
        ref = ctx.memo.get(("cost_ref", job.job_id, job.shard))
        out = []
        costs = costs_per_unit_hour(job, [(cluster, models[0] if models else "") for cluster, _, models in places], ctx)
        for cost in costs:
            out.append(1.0 / (1.0 + cost / ctx.max_price) if ref is None else 1.0 if cost <= 0 else
                       min(1.0, ref / cost))  # (as _relative_cost)
        return out


def set_cost_reference(job: QueuedJob, cost_per_hour: float, ctx: Context) -> None:
    """Record the lowest cost per GPU-hour the job could get this cycle (the Cost scale)."""
    ctx.memo[("cost_ref", job.job_id, job.shard)] = cost_per_hour


def _relative_cost(job: QueuedJob, cost: float, ctx: Context) -> float:
    ref = ctx.memo.get(("cost_ref", job.job_id, job.shard))
    if ref is None:
        return 1.0 / (1.0 + cost / ctx.max_price)
    if cost <= 0:
        return 1.0
    return min(1.0, ref / cost)


def _used_after(job: QueuedJob, fit: Fit, work: WorkingCluster) -> float:
    return _after(job, work, fit.card_model)


def _after(job: QueuedJob, work: WorkingCluster, model: str) -> float:
    free, capacity = work.totals(model) if model else (0, 0)
    if capacity <= 0:
        return 1.0
    return 1.0 - max(0, free - job.spec.total_gpu_milli) / capacity


class Packing:
    """Consolidation: prefer the cluster whose card pool is fullest after this placement,
    ``1 - free_after / capacity`` of the chosen card model, so other pools stay empty for big
    gangs (1 for CPU-only work, which takes no card). Bound: the best of the candidate models'
    pools (the fit takes one of them)."""

    name = "packing"
    bound_scope = "cluster_shape"
    score_scope = "fit"  # reads the fit's card model, the request's GPUs and the allocation

    def score(self, job, cluster, fit, work, ctx) -> float:
        model = fit.card_model  # (_used_after, inlined: one call per fresh fit)
        free, capacity = work.totals(model) if model else (0, 0)
        if capacity <= 0:
            return 1.0
        return 1.0 - max(0, free - job.spec.total_gpu_milli) / capacity

    def bound(self, job, cluster, work, ctx, models) -> float:
        if not job.spec.gpus_per_worker:  # CPU-only: the fit has no card model, it scores 1
            return 1.0
        demand = job.spec.total_gpu_milli
        best = 0.0 if models else 1.0
        for m in models:
            free, capacity = work.totals(m)
            if capacity <= 0:
                return 1.0
            value = 1.0 - max(0, free - demand) / capacity
            if value > best:
                best = value
        return best


#: Task sizes (milli-GPU; > 1000 = whole cards on one node) and their popularity, for the
#: fragmentation measure. Roughly the openb mix: most tasks take a share of one card or one card.
DEFAULT_TASK_MIX: Mapping[int, float] = {250: 0.15, 500: 0.25, 1000: 0.45, 2000: 0.05, 4000: 0.05, 8000: 0.05}


def node_fragmentation(free: tuple[int, ...], mix: Mapping[int, float]) -> float:
    """Expected milli-GPUs of a node that a random task from ``mix`` could not use.

    After FGD (Weng et al., ATC'23, eq. 1-2): for a task of ``m`` milli (< 1000, one card), the
    free share on cards with less than ``m`` free is a fragment; for a task of ``k`` whole cards,
    everything free is a fragment if fewer than ``k`` cards are idle, else the partial cards are.
    Pure, so memoised (node states repeat a lot).
    """
    return _fragmentation(free, tuple(mix.items()))


@lru_cache(maxsize=65536)
def _fragmentation(free: tuple[int, ...], mix: tuple[tuple[int, float], ...]) -> float:
    total = sum(free)
    if total == 0:
        return 0.0
    idle = sum(1 for g in free if g == WHOLE)
    partial = total - idle * WHOLE
    frag = 0.0
    for size, p in mix:
        if size < WHOLE:
            frag += p * sum(g for g in free if g < size)
        else:
            k = size // WHOLE
            frag += p * (partial if idle >= k else total)
    return frag


class Fragmentation(_Bounded):
    """Fragmentation-aware placement (the FGD idea, at cluster level): prefer the cluster where
    this placement adds the least expected fragmentation, ``1 / (1 + max(0, dF) / 1000)``, with
    ``dF`` the change of :func:`node_fragmentation` summed over the nodes it lands on.

    The score of a fit on one node reads only that node's free cards before the fit, the
    devices and the share: memoised per (free cards, devices, share) in ``_one_node`` (a pure
    function of them; at most ``ONE_NODE_MEMO`` entries, emptied when full)."""

    name = "fragmentation"
    score_scope = "fit"  # reads the fit's bindings and the nodes' free cards
    ONE_NODE_MEMO = 65536

    def __init__(self, mix: Mapping[int, float] = DEFAULT_TASK_MIX) -> None:
        self.mix = dict(mix)
        self._mix_items = tuple(self.mix.items())  # the memo key :func:`node_fragmentation` builds
        #: (free cards of the node, devices, milli-GPU per device) -> score of a one-node fit
        self._one_node: dict[tuple, float] = {}

    def score(self, job, cluster, fit, work, ctx) -> float:
        if not fit.card_model:
            return 1.0
        bindings = fit.bindings
        if len(bindings) == 1:  # (most fits) one node: memoised per its state and the binding
            b = bindings[0]
            key = (work.gpu_free[b.node], b.devices, b.gpu_milli)
            got = self._one_node.get(key)
            if got is None:
                if len(self._one_node) >= self.ONE_NODE_MEMO:
                    self._one_node.clear()
                got = self._one_node[key] = self._score(bindings, work.gpu_free)
            return got
        return self._score(bindings, work.gpu_free)

    def _score(self, bindings, gpu_free) -> float:
        """The score of bindings on nodes with free cards ``gpu_free`` (by node index)."""
        touched: dict[int, list[int]] = {}
        for b in bindings:
            free = touched.setdefault(b.node, list(gpu_free[b.node]))
            for d in b.devices:
                free[d] -= b.gpu_milli
        mix = self._mix_items
        delta = sum(_fragmentation(tuple(after), mix) - _fragmentation(gpu_free[n], mix)
                    for n, after in touched.items())
        return 1.0 / (1.0 + max(0.0, delta) / 1000.0)


class Headroom:
    """Spreading (the "least loaded" multi-cluster baseline): ``free_after / capacity`` of the
    chosen card model's pool (0 for CPU-only work, which takes no card)."""

    name = "headroom"
    bound_scope = "cluster_shape"
    score_scope = "fit"

    def score(self, job, cluster, fit, work, ctx) -> float:
        return 1.0 - _used_after(job, fit, work)

    def bound(self, job, cluster, work, ctx, models) -> float:
        if not job.spec.gpus_per_worker:  # CPU-only: the fit has no card model, it scores 0
            return 0.0
        return max((1.0 - _after(job, work, m) for m in models), default=1.0)


class Random:
    """A deterministic pseudo-random preference: sha256(job, attempt, cluster) scaled to [0, 1)."""

    name = "random"

    def score(self, job, cluster, fit, work, ctx) -> float:
        digest = hashlib.sha256(f"{job.job_id}/{job.attempt}/{cluster.name}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def bound(self, job, cluster, work, ctx, models) -> float:
        return self.score(job, cluster, None, work, ctx)
