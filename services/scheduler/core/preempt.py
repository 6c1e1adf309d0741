"""Preemption and wait estimates: what-ifs over a cluster's running work.

Both are pure and work on clones of the cycle's :class:`~.fit.WorkingCluster`.

* :func:`estimated_start` -- when would a job fit here if running work ended when its
  submitters estimated (never the true runtime; overdue work by :func:`expected_end`)? Release
  work in order of expected end until the job fits.
* :func:`find_victims` -- the cheapest set of preemptible, strictly lower-priority work whose
  eviction lets the job fit. Cost of a victim = GPU-seconds of work lost:
  ``gpus x min(elapsed, checkpoint_interval)`` if checkpointable (it resumes from its last
  checkpoint), else ``gpus x elapsed`` (it restarts); placed-but-not-started work costs 0.
  Victims are taken cheapest first (checkpointable first at equal cost), then any victim not
  needed is given back (most costly first), so the set is minimal for that order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsched.jobs import JobSpec
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.snapshot import WHOLE, ClusterState, RunningWork


def lost_work(w: RunningWork, now: float, checkpoint_interval_s: float) -> float:
    """GPU-seconds (CPU-only work: core-seconds / 1000) an eviction of ``w`` throws away."""
    if w.started_at is None:
        return 0.0
    elapsed = max(0.0, now - w.started_at)
    lost = min(elapsed, checkpoint_interval_s) if w.checkpointable else elapsed
    size = w.gpu_milli / WHOLE if w.gpu_milli else sum(b[3] for b in w.bindings) / 1e6
    return size * lost


def expected_end(w: RunningWork, now: float) -> float:
    """When ``w`` is expected to end: its estimated end while that is ahead; once it overran
    its estimate (estimates are the submitters' guesses), half of what it has run so far from
    now, at least 5 minutes -- an overdue job is not about to free its cards "now"."""
    if w.est_end > now:
        return w.est_end
    ran = now - w.started_at if w.started_at is not None else 0.0
    return now + max(300.0, 0.5 * ran)


def estimated_start(spec: JobSpec, models: list[str], cluster: ClusterState, work: WorkingCluster,
                    now: float, timeline: list[RunningWork] | None = None) -> float | None:
    """Business time at which ``spec`` would fit on ``cluster`` (``now`` if it fits now).

    Args:
        timeline: the work holding ``work``'s resources (default ``cluster.running``); a cycle
            passes its own, without evicted victims and with the placements it just made.

    Returns:
        The estimate, or None when it would not fit even after all work with an estimate ends.
    """
    if work.fit(spec, models) is not None:
        return now
    trial = work.clone()
    search = _Search(spec)
    for end, w in sorted(((expected_end(w, now), w) for w in (cluster.running if timeline is None else timeline)),
                         key=lambda x: x[0]):
        if math.isinf(end):
            break
        trial.release_work(w)
        if search.fit(trial, w, models) is not None:
            return end
    return None


class _Search:
    """Fit attempts while work is released one piece at a time.

    The first attempt searches the whole cluster. Once a single-worker job fit nowhere, it can
    only come to fit on a node that got resources back since, so later attempts look at those
    nodes alone (:meth:`WorkingCluster.fit`'s ``only``) and find what a full search would; a
    gang's workers interact, so it is searched whole every time.
    """

    __slots__ = ("spec", "touched")

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.touched: set[int] | None = None  # None: the next attempt searches everything

    def fit(self, trial: WorkingCluster, released: RunningWork, models: list[str]) -> Fit | None:
        """Try again after ``released`` went back into ``trial``."""
        if self.touched is None:
            fit = trial.fit(self.spec, models)
        else:
            self.touched.update(b[0] for b in released.bindings)
            fit = trial.fit(self.spec, models, only=self.touched)
        if fit is None and self.spec.workers == 1:
            self.touched = set()  # it fits on no node now
        return fit


@dataclass(frozen=True, slots=True)
class Eviction:
    """A preemption plan on one cluster: the victims, the job's fit after they go, the cost."""

    cluster: str
    victims: tuple[RunningWork, ...]
    fit: Fit
    cost: float


def find_victims(spec: JobSpec, models: list[str], cluster: ClusterState, work: WorkingCluster, now: float,
                 checkpoint_interval_s: float, taken: set[tuple[str, int, int]],
                 timeline: list[RunningWork] | None = None) -> Eviction | None:
    """The cheapest minimal eviction that lets ``spec`` fit on ``cluster``, or None.

    Args:
        spec: the blocked job.
        models: its candidate card models here.
        cluster: the cluster (its ``running`` work are the candidates).
        work: the cycle's working copy (not modified).
        now: business time.
        checkpoint_interval_s: bound of lost work for checkpointable victims.
        taken: work already chosen as victims this cycle (never counted twice).
        timeline: the work holding ``work``'s resources (default ``cluster.running``).
    """
    prio = spec.priority_value
    candidates = [w for w in (cluster.running if timeline is None else timeline)
                  if w.preemptible and w.priority < prio and (w.job_id, w.attempt, w.shard) not in taken]
    if not candidates:
        return None
    if spec.gpus_per_worker:  # quick bound: even evicting every candidate would not free enough
        usable = {m: work.totals(m)[0] for m in models}
        for w in candidates:
            if w.card_model in usable:
                usable[w.card_model] += w.gpu_milli
        if max(usable.values(), default=0) < spec.total_gpu_milli:
            return None
    cost = {id(w): lost_work(w, now, checkpoint_interval_s) for w in candidates}
    candidates.sort(key=lambda w: (cost[id(w)], not w.checkpointable, -w.gpu_milli, w.job_id))
    trial = work.clone()
    search = _Search(spec)
    chosen: list[RunningWork] = []
    fit = None
    for w in candidates:
        trial.release_work(w)
        chosen.append(w)
        fit = search.fit(trial, w, models)
        if fit is not None:
            break
    if fit is None:
        return None
    for w in sorted(chosen, key=lambda w: -cost[id(w)]):  # give back what is not needed
        if len(chosen) == 1:
            break
        rest = [x for x in chosen if x is not w]
        check = work.clone()
        for x in rest:
            check.release_work(x)
        again = check.fit(spec, models)
        if again is not None:
            chosen, fit = rest, again
    return Eviction(cluster.name, tuple(chosen), fit, sum(cost[id(w)] for w in chosen))
