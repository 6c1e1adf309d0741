"""The scheduling decision: ``decide(view, queue, policy) -> Decisions``.

Pure: no I/O, no clock, no globals; the same inputs give the same decisions. The scheduler
service, the replay, the benchmarks and the tests all call this one function.

One call (numbered as in the code):

1. take the queue in fair order (:class:`~.queues.FairOrder`: effective priority with aging
   and the fast lane, then dominant-resource fair share between tenants);
2. for each job, run the hard filters per cluster (first failure is the reason; results are
   cached per job shape), then fit the gang node by node on the clusters that pass, on the
   cycle's private working copy, honouring reservations held by higher jobs;
3. score the fits (weighted plugins) and take the best (ties: cluster name); a
   ``prefer_local`` job whose home region is full waits for it when its estimated home start
   is near enough, else it goes abroad;
4. a job that fits nowhere may preempt cheaper, preemptible, lower-priority work
   (:mod:`.preempt`), or -- if the policy backfills -- reserve the cluster where it would start
   earliest; later jobs only backfill into a reserved cluster when they are estimated to end
   before the reservation starts;
5. what still cannot go stays pending with every cluster's verdict, the summary, and whether it
   would fit some cluster if that cluster were empty (``fits_empty``; False = unplaceable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from fedsched.jobs import Locality
from services.scheduler.core.filters import Context, candidate_models
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.policy import Policy
from services.scheduler.core.preempt import Eviction, estimated_start, find_victims
from services.scheduler.core.queues import FairOrder, queue_of
from services.scheduler.core.reasons import PASS, STATIC_REASONS, Reason, Verdict, fail, summarise
from services.scheduler.core.scorers import estimated_cost, transfer_bytes, transfer_seconds
from services.scheduler.core.snapshot import WHOLE, ClusterIndex, ClusterState, QueuedJob, RunningWork, View


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
        est_cost: estimated cost (compute over the estimated runtime + egress).
        queue: the queue it was taken from.
        victims: work evicted to make room (empty unless it preempted).
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
    est_cost: float
    queue: str
    victims: tuple[RunningWork, ...]
    explanation: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """Capacity held for a blocked head job: on ``cluster`` from ``start_at`` (estimated);
    ``after`` placements of this cycle were made before it (only later ones are backfill)."""

    job_key: str
    cluster: str
    start_at: float
    after: int = 0


@dataclass(frozen=True, slots=True)
class Pending:
    """A job that stays queued: the summary reason, per-cluster verdicts, ``fits_empty``, and
    the reservation it holds (if any)."""

    job: QueuedJob
    reason: str
    evaluations: tuple[ClusterEvaluation, ...]
    fits_empty: bool
    queue: str = ""
    reservation: Reservation | None = None


@dataclass(frozen=True, slots=True)
class Decisions:
    """The result of one :func:`decide` call."""

    placements: tuple[Placement, ...]
    pending: tuple[Pending, ...]
    policy_version: str
    reservations: tuple[Reservation, ...] = ()


def order_queue(queue: Iterable[QueuedJob], view: View | None = None, policy: Policy | None = None) -> list[QueuedJob]:
    """The order :func:`decide` considers jobs in, without placing anything (shares as of now)."""
    from services.scheduler.core.policy import build_policy

    return list(FairOrder(queue, view or View((), 0.0), policy or build_policy()))


def _static_key(job: QueuedJob) -> tuple:
    s = job.spec
    return (s.card_models, s.min_gpu_memory_gib, s.requires_rdma, s.home_region, s.locality, s.allowed_regions,
            s.forbidden_regions, s.residency_tags, s.max_price_per_gpu_hour, job.cross_region, s.gpus_per_worker > 0)


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


def _est_end(job: QueuedJob, now: float) -> float:
    est = job.spec.estimated_duration_s
    return now + est if est is not None else math.inf


class _Cycle:
    """The mutable state of one decide() call (private)."""

    def __init__(self, view: View, policy: Policy) -> None:
        self.clusters = tuple(c if c.index is not None else replace(c, index=ClusterIndex.build(c.nodes))
                              for c in view.clusters)
        self.by_name = {c.name: c for c in self.clusters}
        prices = [p for c in self.clusters for p in c.prices.values() if p > 0]
        self.ctx = Context(view, policy.inter_region_bandwidth_bps, policy.egress_price_per_gb, max(prices, default=1.0))
        self.view = view
        self.policy = policy
        self.work: dict[str, WorkingCluster] = {}
        self.empty: dict[str, WorkingCluster] = {}
        self.static: dict[tuple, Verdict] = {}
        self.failed_shapes: dict[str, set[tuple]] = {}
        self.reservations: dict[str, Reservation] = {}
        self.victims: set[tuple[str, int, int]] = set()
        self.timelines: dict[str, list[RunningWork]] = {}
        self.placed = 0

    def timeline(self, cluster: ClusterState) -> list[RunningWork]:
        """Work holding the cluster's resources now, this cycle's evictions and placements applied."""
        t = self.timelines.get(cluster.name)
        if t is None:
            t = self.timelines[cluster.name] = list(cluster.running)
        return t

    def record(self, job: QueuedJob, cluster: ClusterState, fit: Fit, victims: tuple[RunningWork, ...]) -> None:
        """Keep the timeline current after a placement (and its evictions)."""
        t = self.timeline(cluster)
        if victims:
            gone = {(v.job_id, v.attempt, v.shard) for v in victims}
            t[:] = [w for w in t if (w.job_id, w.attempt, w.shard) not in gone]
        est = job.spec.estimated_duration_s
        end = self.view.now + max(0.0, est - job.progress_s) if est is not None else math.inf
        t.append(RunningWork(job.job_id, job.attempt, job.shard, job.spec.tenant, job.spec.priority_value,
                             job.spec.preemptible, job.spec.checkpointable, self.view.now, end, fit.card_model,
                             tuple((b.node, b.devices, b.gpu_milli, b.cpu_milli, b.memory_mib) for b in fit.bindings)))
        self.placed += 1

    def wc(self, cluster: ClusterState) -> WorkingCluster:
        w = self.work.get(cluster.name)
        if w is None:
            w = self.work[cluster.name] = WorkingCluster(cluster)
        return w

    def static_verdict(self, job: QueuedJob, skey: tuple, cluster: ClusterState) -> Verdict:
        key = (skey, cluster.name)
        v = self.static.get(key)
        if v is None:
            v = PASS
            for flt in self.policy.filters:
                v = flt.check(job, cluster, self.ctx)
                if not v.passed:
                    break
            self.static[key] = v
        return v


def decide(view: View, queue: Iterable[QueuedJob], policy: Policy) -> Decisions:
    """Place what can be placed now; preempt or reserve for blocked jobs; explain the rest.

    Args:
        view: the federation snapshot.
        queue: waiting jobs (any order).
        policy: filters, scorers, weights and queueing/preemption parameters.

    Returns:
        Placements in decision order (with their victims, if any), pending jobs with reasons,
        and the reservations held.
    """
    cy = _Cycle(view, policy)
    order = FairOrder(queue, view, policy)
    placements: list[Placement] = []
    pending: list[Pending] = []
    now = view.now
    weights = policy.weights

    for job in order:                                                               # 1
        skey = _static_key(job)
        evaluations: list[ClusterEvaluation] = []
        fits: list[tuple[ClusterState, Fit, WorkingCluster, list[str]]] = []
        static_ok: list[ClusterState] = []
        for cluster in cy.clusters:                                                 # 2
            verdict = cy.static_verdict(job, skey, cluster)
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
            res = cy.reservations.get(cluster.name)
            if res is not None and _est_end(job, now) > res.start_at:
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, fail(
                    Reason.RESERVED, f"held for {res.job_key} from ~{(res.start_at - now) / 60:.0f} min; "
                                     f"this job is not estimated to end before")))
                continue
            wc = cy.wc(cluster)
            models = candidate_models(job, cluster)
            shape = _shape(job, models)
            fit = None if shape in cy.failed_shapes.get(cluster.name, ()) else wc.fit(job.spec, models)
            if fit is None:
                cy.failed_shapes.setdefault(cluster.name, set()).add(shape)
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, _insufficient(job, wc, models)))
                continue
            fits.append((cluster, fit, wc, models))

        if not fits and job.avoid_clusters:  # failover found nowhere else: the failed cluster beats waiting
            for cluster in cy.clusters:
                if cluster.name not in job.avoid_clusters or not cy.static_verdict(job, skey, cluster).passed:
                    continue
                if cluster.name in cy.reservations:
                    continue
                wc = cy.wc(cluster)
                models = candidate_models(job, cluster)
                fit = wc.fit(job.spec, models)
                if fit is not None:
                    fits.append((cluster, fit, wc, models))

        if fits:                                                                    # 3
            scored = _score(job, fits, cy)
            for cluster, fit, wc, terms, total in scored:
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, PASS, terms, total))
            choices = scored
            if job.spec.locality == Locality.PREFER_LOCAL:  # home first when home has room
                choices = [x for x in scored if x[0].region == job.spec.home_region] or scored
            best = max(choices, key=lambda x: (x[4], [-ord(ch) for ch in x[0].name]))
            cluster, fit, wc, terms, total = best
            if (job.spec.locality == Locality.PREFER_LOCAL and cluster.region != job.spec.home_region
                    and policy.prefer_local_max_wait_s > 0):
                start = _home_start(job, cy, static_ok)
                if start is not None and start - now <= policy.prefer_local_max_wait_s:
                    evaluations.append(ClusterEvaluation(job.spec.home_region, job.spec.home_region, fail(
                        Reason.WAIT_FOR_HOME, f"home region frees up in ~{(start - now) / 60:.0f} min "
                                              f"(limit {policy.prefer_local_max_wait_s / 60:.0f} min)")))
                    pending.append(Pending(job, f"prefer_local: waiting for {job.spec.home_region}, est. start in "
                                                f"{(start - now) / 60:.0f} min", tuple(evaluations), True,
                                           queue_of(job, policy.fast_lane_s)))
                    continue
            wc.commit(fit)
            cy.record(job, cluster, fit, ())
            placements.append(_placement(job, cluster, fit, total, terms, evaluations, cy, ()))
            order.placed(job)
            continue

        if policy.preemption and job.spec.priority_value >= policy.preempt_min_priority:   # 4
            eviction = _preempt(job, cy, static_ok)
            if eviction is not None:
                cluster = cy.by_name[eviction.cluster]
                wc = cy.wc(cluster)
                for w in eviction.victims:
                    wc.release_work(w)
                    cy.victims.add((w.job_id, w.attempt, w.shard))
                cy.failed_shapes.pop(cluster.name, None)  # capacity came back: cached misfits are stale
                wc.commit(eviction.fit)
                cy.record(job, cluster, eviction.fit, eviction.victims)
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, PASS,
                                                     (("preemption_cost_gpu_s", round(eviction.cost, 1)),), 0.0))
                placements.append(_placement(job, cluster, eviction.fit, 0.0, (), evaluations, cy, eviction.victims))
                order.placed(job)
                continue

        reservation = None
        if policy.backfill and len(cy.reservations) < policy.reservations:
            reservation = _reserve(job, cy, static_ok)
        verdicts = {e.cluster: e.verdict for e in evaluations}
        reason = summarise(verdicts)
        if reservation is not None:
            reason = (f"reserved {reservation.cluster} from ~{(reservation.start_at - now) / 60:.0f} min "
                      f"(est.); {reason}")
        pending.append(Pending(job, reason, tuple(evaluations), _fits_somewhere_empty(job, static_ok, cy),
                               queue_of(job, policy.fast_lane_s), reservation))                   # 5

    return Decisions(tuple(placements), tuple(pending), policy.version, tuple(cy.reservations.values()))


def _score(job: QueuedJob, fits, cy: _Cycle):
    """Weighted scores of every fitting cluster; relative scorers normalised to min/cost."""
    raw = []
    for cluster, fit, wc, _ in fits:
        raw.append([sc.score(job, cluster, fit, wc, cy.ctx) for sc, _ in cy.policy.weights])
    for i, (sc, _) in enumerate(cy.policy.weights):
        if getattr(sc, "relative", False):
            best = min(r[i] for r in raw)
            for r in raw:
                r[i] = 1.0 if r[i] <= 0 else (best / r[i] if best > 0 else 0.0)
    out = []
    for (cluster, fit, wc, _), values in zip(fits, raw):
        terms = tuple((sc.name, round(v, 4)) for (sc, _), v in zip(cy.policy.weights, values))
        total = round(sum(w * v for (_, w), v in zip(cy.policy.weights, values)), 4)
        out.append((cluster, fit, wc, terms, total))
    return out


def _home_start(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState]) -> float | None:
    """Earliest estimated start in the job's home region (None if never)."""
    best = None
    for cluster in static_ok:
        if cluster.region != job.spec.home_region:
            continue
        start = estimated_start(job.spec, candidate_models(job, cluster), cluster, cy.wc(cluster), cy.view.now,
                                cy.timeline(cluster))
        if start is not None and (best is None or start < best):
            best = start
    return best


def _preempt(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState]) -> Eviction | None:
    best = None
    for cluster in static_ok:
        if cy.static_verdict(job, _static_key(job), cluster).passed is False:
            continue
        if cluster.name in job.avoid_clusters or cluster.name in cy.reservations:
            continue
        ev = find_victims(job.spec, candidate_models(job, cluster), cluster, cy.wc(cluster), cy.view.now,
                          cy.policy.checkpoint_interval_s, cy.victims, cy.timeline(cluster))
        if ev is not None and (best is None or (ev.cost, len(ev.victims), ev.cluster) < (best.cost, len(best.victims),
                                                                                          best.cluster)):
            best = ev
    return best


def _reserve(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState]) -> Reservation | None:
    best: tuple[float, str] | None = None
    for cluster in static_ok:
        if cluster.name in cy.reservations or cluster.name in job.avoid_clusters:
            continue
        if not cy.static_verdict(job, _static_key(job), cluster).passed:
            continue
        start = estimated_start(job.spec, candidate_models(job, cluster), cluster, cy.wc(cluster), cy.view.now,
                                cy.timeline(cluster))
        if start is not None and (best is None or (start, cluster.name) < best):
            best = (start, cluster.name)
    if best is None:
        return None
    res = Reservation(job.key, best[1], best[0], cy.placed)
    cy.reservations[best[1]] = res
    return res


def _fits_somewhere_empty(job: QueuedJob, clusters: list[ClusterState], cy: _Cycle) -> bool:
    for cluster in clusters:
        wc = cy.empty.get(cluster.name)
        if wc is None:
            wc = cy.empty[cluster.name] = WorkingCluster(cluster, empty=True)
        if wc.fit(job.spec, candidate_models(job, cluster)) is not None:
            return True
    return False


def _placement(job: QueuedJob, cluster: ClusterState, fit: Fit, total: float, terms: tuple,
               evaluations: list[ClusterEvaluation], cy: _Cycle, victims: tuple[RunningWork, ...]) -> Placement:
    bindings = tuple(NodeBinding(b.worker, cluster.nodes[b.node].name, b.devices, b.gpu_milli, b.cpu_milli,
                                 b.memory_mib) for b in fit.bindings)
    passed = sorted((e for e in evaluations if e.total is not None and e.cluster != cluster.name), key=lambda e: -e.total)
    runner = passed[0] if passed else None
    excluded = sum(1 for e in evaluations if not e.verdict.passed)
    if victims:
        explanation = (f"{cluster.name} ({cluster.region}) after preempting {len(victims)} lower-priority job(s) "
                       f"({', '.join(v.job_id for v in victims[:3])}{'...' if len(victims) > 3 else ''}); "
                       f"no cluster had room; {excluded} excluded")
    else:
        explanation = (f"{cluster.name} ({cluster.region}) scored {total:.3f} ["
                       + ", ".join(f"{n} {v:.2f}" for n, v in terms) + f"]; {len(passed) + 1} cluster(s) fit, "
                       f"{excluded} excluded" + (f"; runner-up {runner.cluster} {runner.total:.3f}" if runner else ""))
    return Placement(
        job=job, cluster=cluster.name, region=cluster.region, zone=cluster.zone, card_model=fit.card_model,
        bindings=bindings, score=total, evaluations=tuple(evaluations),
        cross_region=cluster.region != job.spec.home_region,
        transfer_s=transfer_seconds(job, cluster, cy.ctx), transfer_bytes=transfer_bytes(job, cluster),
        price_per_gpu_hour=cluster.prices.get(fit.card_model, 0.0),
        est_cost=round(estimated_cost(job, cluster, fit.card_model, cy.ctx), 6),
        queue=queue_of(job, cy.policy.fast_lane_s), victims=victims, explanation=explanation,
    )
