"""Soft scores: among clusters that pass every filter, which is best for this job?

Each scorer returns a value in [0, 1] (1 = best) for (job, cluster, fit); the policy weighs
them: ``total = sum(weight_i * score_i)``. Formulas are in each scorer's docstring.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from services.scheduler.core.filters import Context
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.snapshot import ClusterState, QueuedJob


class Scorer(Protocol):
    """A soft preference."""

    name: str

    def score(self, job: QueuedJob, cluster: ClusterState, fit: Fit, work: WorkingCluster, ctx: Context) -> float:
        """Preference for placing ``job`` with ``fit`` on ``cluster``, in [0, 1]."""
        ...


def transfer_bytes(job: QueuedJob, cluster: ClusterState) -> int:
    """Bytes of the job's datasets that live outside the cluster's region."""
    return sum(d.size_bytes for d in job.spec.datasets if d.home_region != cluster.region)


def transfer_seconds(job: QueuedJob, cluster: ClusterState, ctx: Context) -> float:
    """Estimated time to move the job's remote datasets: bytes / inter-region bandwidth (s)."""
    return transfer_bytes(job, cluster) / ctx.inter_region_bandwidth_bps


class HomeRegion:
    """1 in the job's home region, else 0 (data and people usually live at home)."""

    name = "home"

    def score(self, job, cluster, fit, work, ctx) -> float:
        return 1.0 if cluster.region == job.spec.home_region else 0.0


class DataTransfer:
    """Prefer where the data is: ``1 / (1 + t / 600)`` with ``t`` = transfer seconds
    (10 minutes of transfer halves the score); 1 when nothing moves."""

    name = "transfer"

    def score(self, job, cluster, fit, work, ctx) -> float:
        t = transfer_seconds(job, cluster, ctx)
        return 1.0 / (1.0 + t / 600.0)


class Price:
    """Cheaper is better: ``1 - price / max_price`` over the view's GPU-hour prices."""

    name = "price"

    def score(self, job, cluster, fit, work, ctx) -> float:
        if not fit.card_model:
            return 1.0
        return max(0.0, 1.0 - cluster.prices.get(fit.card_model, 0.0) / ctx.max_price)


def _used_after(job: QueuedJob, fit: Fit, work: WorkingCluster) -> float:
    capacity = work.capacity_milli(fit.card_model or None)
    if capacity <= 0:
        return 1.0
    free_after = work.free_milli(fit.card_model or None) - job.spec.total_gpu_milli
    return 1.0 - max(0, free_after) / capacity


class Packing:
    """Bin-packing: prefer the cluster whose card pool is fullest after this placement,
    ``1 - free_after / capacity`` of the chosen card model, so other pools stay whole for big
    gangs (fragmentation-aware, cf. FGD, Weng et al. ATC'23)."""

    name = "packing"

    def score(self, job, cluster, fit, work, ctx) -> float:
        return _used_after(job, fit, work)


class Headroom:
    """Spreading (the "least loaded" multi-cluster baseline): ``free_after / capacity``."""

    name = "headroom"

    def score(self, job, cluster, fit, work, ctx) -> float:
        return 1.0 - _used_after(job, fit, work)


class Random:
    """A deterministic pseudo-random preference: sha256(job, attempt, cluster) scaled to [0, 1)."""

    name = "random"

    def score(self, job, cluster, fit, work, ctx) -> float:
        digest = hashlib.sha256(f"{job.job_id}/{job.attempt}/{cluster.name}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64
