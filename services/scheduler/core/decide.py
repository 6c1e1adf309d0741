"""The scheduling decision: ``decide(view, queue, policy) -> Decisions``.

Pure: no I/O, no clock, no globals; the same inputs give the same decisions. The scheduler
service, the replay benchmark and the tests all call this one function.

One call:

1. order the queue (:func:`order_queue`: priority class, then arrival);
2. take a private working copy of each cluster's free resources;
3. for each job in order: run the hard filters per cluster (first failure is the reason);
   fit the gang on the clusters that pass (capacity, node by node); score the fits;
4. place the job on the best-scoring cluster (ties: cluster name) and allocate it in the working
   copy, so later jobs in the same call see it;
5. a job no cluster can take stays pending with the reason per cluster, and whether it would
   fit some cluster if that cluster were empty (``fits_empty``; False = unplaceable today).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from services.scheduler.core.filters import Context, candidate_models
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.policy import Policy
from services.scheduler.core.reasons import PASS, STATIC_REASONS, Reason, Verdict, fail, summarise
from services.scheduler.core.scorers import transfer_bytes, transfer_seconds
from services.scheduler.core.snapshot import WHOLE, ClusterIndex, ClusterState, QueuedJob, View


@dataclass(frozen=True, slots=True)
class ClusterEvaluation:
    """One cluster considered for one job: the verdict and, if it fits, the score terms."""

    cluster: str
    region: str
    verdict: Verdict
    scores: tuple[tuple[str, float], ...] = ()
    total: float | None = None


@dataclass(frozen=True, slots=True)
class NodeBinding:
    """A worker's node by name: devices and shares (milli-GPU per device, milli-CPU, MiB)."""

    worker: int
    node: str
    devices: tuple[int, ...]
    gpu_milli: int
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Placement:
    """A job bound to a cluster.

    Attributes:
        job: the queue entry.
        cluster, region, zone: where.
        card_model: the card model of every worker ("" for CPU-only jobs).
        bindings: one per worker.
        score: the chosen cluster's total score.
        evaluations: every cluster considered.
        cross_region: outside the job's home region.
        transfer_s / transfer_bytes: data to move before start.
        price_per_gpu_hour: list price of the chosen card model there.
        explanation: one line, why here.
    """

    job: QueuedJob
    cluster: str
    region: str
    zone: str
    card_model: str
    bindings: tuple[NodeBinding, ...]
    score: float
    evaluations: tuple[ClusterEvaluation, ...]
    cross_region: bool
    transfer_s: float
    transfer_bytes: int
    price_per_gpu_hour: float
    explanation: str


@dataclass(frozen=True, slots=True)
class Pending:
    """A job that stays queued: the summary reason, per-cluster verdicts, ``fits_empty``."""

    job: QueuedJob
    reason: str
    evaluations: tuple[ClusterEvaluation, ...]
    fits_empty: bool


@dataclass(frozen=True, slots=True)
class Decisions:
    """The result of one :func:`decide` call."""

    placements: tuple[Placement, ...]
    pending: tuple[Pending, ...]
    policy_version: str


def order_queue(queue: Iterable[QueuedJob]) -> list[QueuedJob]:
    """Queue order: higher priority class first, then earlier submission, then key."""
    return sorted(queue, key=lambda j: (-j.spec.priority_value, j.submitted_at, j.key))


def _shape(job: QueuedJob, models: Sequence[str]) -> tuple:
    s = job.spec
    return (tuple(models), s.workers, s.gpus_per_worker, s.gpu_milli, s.cpu_milli, s.memory_mib)


def _insufficient(job: QueuedJob, work: WorkingCluster, models: Sequence[str]) -> Verdict:
    s = job.spec
    if s.gpus_per_worker == 0:
        return fail(Reason.INSUFFICIENT, f"needs {s.workers}x {s.cpu_milli}m CPU / {s.memory_mib} MiB")
    parts = []
    for m in models[:3]:
        max_dev, max_idle, total_idle = work.summary(m)
        parts.append(f"{m}: {total_idle} idle cards, max {max_idle} on one node, best share {max_dev}m")
    want = (f"{s.workers}x {s.gpus_per_worker} GPU" if s.gpu_milli == WHOLE or s.gpus_per_worker > 1
            else f"{s.workers}x {s.gpu_milli}m GPU")
    return fail(Reason.INSUFFICIENT, f"needs {want}; " + "; ".join(parts))


def decide(view: View, queue: Iterable[QueuedJob], policy: Policy) -> Decisions:
    """Place what can be placed now; explain the rest.

    Args:
        view: the federation snapshot.
        queue: waiting jobs (any order; :func:`order_queue` orders them).
        policy: filters, scorers and weights.

    Returns:
        Placements in decision order, and the jobs left pending with their reasons.
    """
    clusters = tuple(c if c.index is not None else replace(c, index=ClusterIndex.build(c.nodes)) for c in view.clusters)
    prices = [p for c in clusters for p in c.prices.values() if p > 0]
    ctx = Context(view, policy.inter_region_bandwidth_bps, policy.egress_price_per_gb, max(prices, default=1.0))
    work: dict[str, WorkingCluster] = {}
    empty: dict[str, WorkingCluster] = {}
    failed_shapes: dict[str, set[tuple]] = {}
    placements: list[Placement] = []
    pending: list[Pending] = []

    for job in order_queue(queue):
        evaluations: list[ClusterEvaluation] = []
        best: tuple[float, str, ClusterState, Fit, WorkingCluster, tuple] | None = None
        static_ok: list[ClusterState] = []
        for cluster in clusters:
            verdict = PASS
            for flt in policy.filters:
                verdict = flt.check(job, cluster, ctx)
                if not verdict.passed:
                    break
            if not verdict.passed:
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, verdict))
                if verdict.reason not in STATIC_REASONS:
                    static_ok.append(cluster)
                continue
            static_ok.append(cluster)
            if cluster.name in job.avoid_clusters:
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region,
                                                     fail(Reason.AVOIDED, "an earlier attempt failed here")))
                continue
            wc = work.get(cluster.name)
            if wc is None:
                wc = work[cluster.name] = WorkingCluster(cluster)
            models = candidate_models(job, cluster)
            shape = _shape(job, models)
            fit = None if shape in failed_shapes.get(cluster.name, ()) else wc.fit(job.spec, models)
            if fit is None:
                failed_shapes.setdefault(cluster.name, set()).add(shape)
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, _insufficient(job, wc, models)))
                continue
            terms = tuple((sc.name, round(sc.score(job, cluster, fit, wc, ctx), 4)) for sc, _ in policy.weights)
            total = round(sum(w * v for (_, w), (_, v) in zip(policy.weights, terms)), 4)
            evaluations.append(ClusterEvaluation(cluster.name, cluster.region, PASS, terms, total))
            if best is None or (total, _neg(cluster.name)) > (best[0], _neg(best[1])):
                best = (total, cluster.name, cluster, fit, wc, terms)

        if best is None:
            fits_empty = _fits_somewhere_empty(job, static_ok, empty)
            verdicts = {e.cluster: e.verdict for e in evaluations}
            pending.append(Pending(job, summarise(verdicts), tuple(evaluations), fits_empty))
            continue

        total, _, cluster, fit, wc, terms = best
        wc.commit(fit)
        placements.append(_placement(job, cluster, fit, total, terms, evaluations, ctx))

    return Decisions(tuple(placements), tuple(pending), policy.version)


def _neg(name: str) -> tuple:
    # Tie-break on the lexicographically smallest cluster name (stable, deterministic).
    return tuple(-ord(ch) for ch in name)


def _fits_somewhere_empty(job: QueuedJob, clusters: list[ClusterState], cache: dict[str, WorkingCluster]) -> bool:
    for cluster in clusters:
        wc = cache.get(cluster.name)
        if wc is None:
            wc = cache[cluster.name] = WorkingCluster(cluster, empty=True)
        if wc.fit(job.spec, candidate_models(job, cluster)) is not None:
            return True
    return False


def _placement(job: QueuedJob, cluster: ClusterState, fit: Fit, total: float, terms: tuple,
               evaluations: list[ClusterEvaluation], ctx: Context) -> Placement:
    bindings = tuple(NodeBinding(b.worker, cluster.nodes[b.node].name, b.devices, b.gpu_milli, b.cpu_milli,
                                 b.memory_mib) for b in fit.bindings)
    passed = sorted((e for e in evaluations if e.total is not None), key=lambda e: -e.total)
    runner = next((e for e in passed if e.cluster != cluster.name), None)
    excluded = len(evaluations) - len(passed)
    explanation = (f"{cluster.name} ({cluster.region}) scored {total:.3f} ["
                   + ", ".join(f"{n} {v:.2f}" for n, v in terms) + f"]; {len(passed)} cluster(s) fit, {excluded} excluded"
                   + (f"; runner-up {runner.cluster} {runner.total:.3f}" if runner else ""))
    return Placement(
        job=job, cluster=cluster.name, region=cluster.region, zone=cluster.zone, card_model=fit.card_model,
        bindings=bindings, score=total, evaluations=tuple(evaluations),
        cross_region=cluster.region != job.spec.home_region,
        transfer_s=transfer_seconds(job, cluster, ctx), transfer_bytes=transfer_bytes(job, cluster),
        price_per_gpu_hour=cluster.prices.get(fit.card_model, 0.0), explanation=explanation,
    )
