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
* :func:`quota_victims` -- the same search under the preemption rules below, when quotas
  exist (a quota, not only capacity, may be what blocks the job).

Preemption rules, in Kueue's terms (``ClusterQueue.spec.preemption``; a tenant's quota rules
play its ClusterQueue, :attr:`~.quota.QuotaRule.cohort` the cohort; see Kueue's "Preemption"
concept page, classic preemption). A blocked job J of tenant t and priority p, placed on card
model m in region g, may evict running work w only if w is preemptible and was not placed or
chosen as a victim this cycle, and one of these holds:

(a) *withinClusterQueue: LowerPriority* -- w is t's own work and ``w.priority < p``. Evicting it
    gives back the cards *and* t's quota, so a job blocked by its tenant's quota (not by
    capacity) preempts its tenant's lower-priority work;
(b) *reclaimWithinCohort* (``policy.reclaim_within_cohort``: ``any`` (default) | ``lower_priority``
    | ``never``) -- J fits within t's guarantee (for every rule of t covering (m, g):
    used + J's demand <= nominal, after J's other victims go), and w belongs to another tenant of
    the cohort of such a rule that is *borrowing* (its rule covering w is above nominal, counting
    the victims chosen so far): a tenant takes back the guarantee it lent. With ``any`` the
    borrower's priority does not matter, and J needs no ``preempt_min_priority``;
(c) *borrowWithinCohort* (``policy.borrow_within_cohort``, default off) -- J must borrow (some
    rule of t would go above nominal): then only (a) applies, i.e. J never preempts other
    tenants to borrow; with the switch on, also lower-priority work of borrowing tenants of the
    cohort (Kueue's ``borrowWithinCohort.policy: LowerPriority``);
(0) w is covered by no quota rule (CPU-only work, or a tenant without rules for (its model, g))
    and ``w.priority < p``, and J does not borrow -- the rule of a federation without quotas,
    where every tenant's work is of this kind.

Work of another tenant that is within its guarantee, or borrows in another cohort, is never
evicted; non-preemptible work never is; under (a), (c) and (0) neither is work of equal or
higher priority. After the eviction the job must fit the cluster and pass its quota with the
victims' usage given back. ``policy.preempt_min_priority`` applies to (a), (c) and (0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from heapq import merge
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from sortedcontainers import SortedKeyList

from fedsched.jobs import JobSpec
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.snapshot import OVERDUE_FLOOR_S, WHOLE, ClusterState, RunningWork, expected_end

if TYPE_CHECKING:
    from fedsched.quota import QuotaBook


def lost_work(w: RunningWork, now: float, checkpoint_interval_s: float) -> float:
    """GPU-seconds (CPU-only work: core-seconds / 1000) an eviction of ``w`` throws away."""
    if w.started_at is None:
        return 0.0
    elapsed = max(0.0, now - w.started_at)
    lost = min(elapsed, checkpoint_interval_s) if w.checkpointable else elapsed
    size = w.gpu_milli / WHOLE if w.gpu_milli else sum(b[3] for b in w.bindings) / 1e6
    return size * lost




def _first(item: tuple[float, RunningWork]) -> float:
    return item[0]


class EndOrder:
    """One cluster's started work in order of estimated end (:attr:`RunningWork.est_end`),
    kept by the scheduler service as work starts and ends (O(log n) each, a
    :class:`sortedcontainers.SortedKeyList`), handed to the core with the cluster's
    :class:`~.snapshot.RunningSet` (its ``ends``). :meth:`expected_ends` then gives the work in
    order of :func:`expected_end` without sorting it all, so a wait estimate reads the work that
    frees up first and stops once the job fits: at 100,000 running jobs, sorting every
    cluster's work for each cross-region placement's counterfactual was 55% of a cycle.

    Raises:
        ValueError: :meth:`remove` of work not held.
    """

    __slots__ = ("_by_end",)

    def __init__(self, works: Iterable[RunningWork] = ()) -> None:
        self._by_end = SortedKeyList(works, key=_est_end)

    def add(self, w: RunningWork) -> None:
        """Hold ``w`` (started work)."""
        self._by_end.add(w)

    def remove(self, w: RunningWork) -> None:
        """Stop holding ``w`` (equal by value; ValueError when not held)."""
        self._by_end.remove(w)

    def __len__(self) -> int:
        return len(self._by_end)

    def __iter__(self) -> Iterator[RunningWork]:
        return iter(self._by_end)

    def expected_ends(self, now: float, pending: Iterable[RunningWork] = (),
                      pending_in_order: Iterable[tuple[float, RunningWork]] | None = None,
                      ) -> Iterator[tuple[float, RunningWork]]:
        """``(expected_end(w, now), w)`` for the held work and ``pending`` (placed, not started)
        in nondecreasing expected end -- the order ``sorted`` by expected end gives, up to the
        order among equal ends (:func:`estimated_start` returns the same estimate for any order
        of equal ends: releasing work only adds capacity). Lazy: work not overdue comes from
        the kept order (est_end > now: expected end = est_end); the overdue work (expected
        ``now + max(OVERDUE_FLOOR_S, ran / 2)``, never before ``now + OVERDUE_FLOOR_S``) is
        sorted only once the stream gets that far. ``pending_in_order``: the pending work's
        ``(expected end, work)`` already sorted (:meth:`~.snapshot.RunningSet.pending_in_end_order`,
        made once per view), in place of ``pending``."""
        ahead = ((w.est_end, w) for w in self._by_end.irange_key(min_key=now, inclusive=(False, True)))
        if pending_in_order is None:
            pending_in_order = sorted(((expected_end(w, now), w) for w in pending), key=_first)
        early = merge(ahead, pending_in_order, key=_first)
        floor = now + OVERDUE_FLOOR_S
        for item in early:
            if item[0] >= floor:
                yield from merge((item,), early, self._overdue(now), key=_first)
                return
            yield item
        yield from self._overdue(now)

    def _overdue(self, now: float) -> list[tuple[float, RunningWork]]:
        return sorted(((expected_end(w, now), w) for w in self._by_end.irange_key(max_key=now)), key=_first)


def _est_end(w: RunningWork) -> float:
    return w.est_end


def _in_end_order(running: Iterable[RunningWork], now: float) -> Iterator[tuple[float, RunningWork]]:
    """``running``'s work as ``(expected end, work)`` in nondecreasing expected end: from its
    kept order when it is a :class:`~.snapshot.RunningSet` with ``ends``, else sorted."""
    ends = getattr(running, "ends", None)
    if ends is not None:
        return ends.expected_ends(now, pending_in_order=running.pending_in_end_order(now))
    return iter(sorted(((expected_end(w, now), w) for w in running), key=_first))


def estimated_start(spec: JobSpec, models: list[str], cluster: ClusterState, work: WorkingCluster,
                    now: float, timeline: list[RunningWork] | None = None,
                    within: float | None = None) -> float | None:
    """Business time at which ``spec`` would fit on ``cluster`` (``now`` if it fits now).

    Work is released in order of :func:`expected_end` until the job fits; ``cluster.running``'s
    kept order (:class:`EndOrder`) is read lazily, so the work looked at is what frees up before
    the answer, not all of it.

    Args:
        timeline: the work holding ``work``'s resources (default ``cluster.running``); a cycle
            passes its own, without evicted victims and with the placements it just made.
        within: seconds (>= 0); when given, only work expected to end at most this long after ``now``
            (``end - now <= within``) is released: a later start is reported as ``math.inf``
            without being searched (the prefer_local wait only asks whether home frees up in time).

    Returns:
        The estimate; None when it would not fit even after all work with an estimate ends;
        ``math.inf`` when ``within`` is given and it would not start within it.
    """
    if work.fit(spec, models) is not None:
        return now
    trial = None
    search = _Search(spec)
    for end, w in _in_end_order(cluster.running if timeline is None else timeline, now):
        if within is not None and end - now > within:
            break
        if math.isinf(end):
            break
        if trial is None:
            trial = work.clone()
        trial.release_work(w)
        if search.fit(trial, w, models) is not None:
            return end
    return math.inf if within is not None else None


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


Allow = Callable[[RunningWork, list[RunningWork]], bool]  #: (work, victims so far) -> may it be evicted too?
Admit = Callable[[Fit, list[RunningWork]], bool]  #: (fit, victims) -> may the job run so?


def find_victims(spec: JobSpec, models: list[str], cluster: ClusterState, work: WorkingCluster, now: float,
                 checkpoint_interval_s: float, taken: set[tuple[str, int, int]],
                 timeline: list[RunningWork] | None = None, *, allow: Allow | None = None,
                 admit: Admit | None = None, feasible: Callable[[list[RunningWork]], bool] | None = None,
                 pool: list[RunningWork] | None = None) -> Eviction | None:
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
        allow: which preemptible work may be evicted, given the victims chosen so far (default:
            strictly lower priority than ``spec``); see :func:`quota_victims`. It must stay true
            when other victims are given back, and hold with no victims whenever it holds with
            some (the candidates are what it allows with none).
        admit: whether the job may run with a fit once these victims go (default: yes).
        feasible: a necessary condition on all the candidates together (e.g. that evicting them
            all would make room in the quota); False ends the search early.
        pool: the work ``allow`` admits with no victims, if the caller has it (work placed or
            evicted this cycle must then be in ``taken``).
    """
    prio = spec.priority_value
    if pool is not None:
        candidates = [w for w in pool if (w.job_id, w.attempt, w.shard) not in taken]
    else:
        candidates = [w for w in (cluster.running if timeline is None else timeline)
                      if w.preemptible and (w.job_id, w.attempt, w.shard) not in taken
                      and (w.priority < prio if allow is None else allow(w, []))]
    if not candidates or (feasible is not None and not feasible(candidates)):
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
        if allow is not None and not allow(w, chosen):
            continue
        trial.release_work(w)
        chosen.append(w)
        fit = search.fit(trial, w, models)
        if fit is not None and (admit is None or admit(fit, chosen)):
            break
        fit = None
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
        if again is not None and (admit is None or admit(again, rest)):
            chosen, fit = rest, again
    return Eviction(cluster.name, tuple(chosen), fit, sum(cost[id(w)] for w in chosen))


def quota_victims(spec: JobSpec, models: list[str], cluster: ClusterState, work: WorkingCluster, now: float,
                  checkpoint_interval_s: float, taken: set[tuple[str, int, int]], timeline: list[RunningWork] | None,
                  book: "QuotaBook", *, by_priority: bool, reclaim: str, borrow: bool,
                  covers: dict[int, tuple[int, ...]] | None = None, pools: dict[tuple, object] | None = None,
                  epoch: int = 0) -> Eviction | None:
    """The cheapest eviction on ``cluster`` the preemption rules allow (module docstring).

    Tried per card model (quota rules depend on it) and twice: J within its tenant's guarantee
    (rules a, b, 0), then J borrowing (a, and c when ``borrow``); the cheapest plan wins (lost
    GPU-seconds, then fewer victims).

    Args:
        spec, models, cluster, work, now, checkpoint_interval_s, taken, timeline: as
            :func:`find_victims`.
        book: quota rules and the usage in force (milli-GPUs).
        by_priority: J may preempt by priority (its class is at least ``preempt_min_priority``):
            rules a, c and 0; reclaiming (b) needs no minimum.
        reclaim: ``any`` | ``lower_priority`` | ``never`` (``Policy.reclaim_within_cohort``).
        borrow: ``Policy.borrow_within_cohort``.
        covers: a memo ``id(work) -> indices of the rules covering it here`` the caller may keep
            while the work objects and the book live (a cycle).
        pools: a memo of candidate lists (work of ``cluster.running`` a rule allows before any
            victim is chosen) per (cluster, tenant, priority, card model, pass, by_priority) for
            the same lifetime, and of whether evicting all of them would make quota room (per
            demand and ``epoch``); then ``taken`` must hold the work placed or evicted since.
        epoch: bumped by the caller whenever work is evicted (the candidates change).
    """
    tenant, prio, region, demand = spec.tenant, spec.priority_value, cluster.region, spec.total_gpu_milli
    rules = book.rules

    memo = covers if covers is not None else {}

    def covering(w: RunningWork) -> tuple[int, ...]:
        hit = memo.get(id(w))
        if hit is None:
            hit = memo[id(w)] = book.covering(w.tenant, w.card_model, region) if w.card_model else ()
        return hit

    def used_after(i: int, victims: list[RunningWork]) -> int:
        return book.used.get(i, 0) - sum(v.gpu_milli for v in victims if i in covering(v))

    def borrowing(w: RunningWork, cohorts: set[str], victims: list[RunningWork]) -> bool:
        return any(rules[i].cohort in cohorts and used_after(i, victims) > rules[i].nominal_milli
                   for i in covering(w))

    best = None
    for model in models if spec.gpus_per_worker else [""]:
        own = book.covering(tenant, model, region) if model else ()
        if pools is not None and all(  # every pass known to have no candidates, or no quota room
                pools.get(pk) is not None and (not pools[pk] or pools.get((pk, demand, epoch)) is False)
                for pk in ((cluster.name, tenant, prio, model, k, by_priority)
                           for k in ((0, 1) if own and by_priority else (0,)))):
            continue
        cohorts = {rules[i].cohort for i in own if rules[i].cohort}

        def within(victims: list[RunningWork]) -> bool:
            return all(used_after(i, victims) + demand <= rules[i].nominal_milli for i in own)

        def quota_ok(fit: Fit, victims: list[RunningWork]) -> bool:
            if not fit.card_model:
                return True
            trial = book.copy()
            for v in victims:
                trial.add(v.tenant, v.card_model, region, -v.gpu_milli)
            return trial.room(tenant, fit.card_model, region, demand)

        def allow_within(w: RunningWork, victims: list[RunningWork]) -> bool:
            if w.tenant == tenant:
                return by_priority and w.priority < prio                               # (a)
            if not covering(w):
                return by_priority and w.priority < prio                               # (0)
            if reclaim == "never" or (reclaim == "lower_priority" and w.priority >= prio):
                return False
            return borrowing(w, cohorts, victims)                                      # (b)

        def allow_borrow(w: RunningWork, victims: list[RunningWork]) -> bool:
            if not by_priority or w.priority >= prio:
                return False
            if w.tenant == tenant:
                return True                                                            # (a)
            return borrow and bool(covering(w)) and borrowing(w, cohorts, victims)    # (c)

        def room_if_all_go(victims: list[RunningWork]) -> bool:
            return quota_ok(Fit(model, ()), victims)

        passes = [(allow_within, lambda fit, victims: within(victims) and quota_ok(fit, victims),
                   lambda victims: within(victims) and room_if_all_go(victims))]
        if own and by_priority:
            passes.append((allow_borrow, quota_ok, room_if_all_go))
        for k, (allow, admit, feasible) in enumerate(passes):
            pool = None
            if pools is not None:
                pool_key = (cluster.name, tenant, prio, model, k, by_priority)
                pool = pools.get(pool_key)
                if pool is None:
                    pool = pools[pool_key] = [w for w in cluster.running if w.preemptible and allow(w, [])]
                if not pool or pools.get((pool_key, demand, epoch)) is False:
                    continue
                feasible = _memoised(pools, (pool_key, demand, epoch), feasible)
            ev = find_victims(spec, [model] if model else models, cluster, work, now, checkpoint_interval_s, taken,
                              timeline, allow=allow, admit=admit, feasible=feasible, pool=pool)
            if ev is not None and (best is None or (ev.cost, len(ev.victims)) < (best.cost, len(best.victims))):
                best = ev
    return best


def _memoised(memo: dict, key: tuple, test: Callable[[list[RunningWork]], bool]) -> Callable[[list[RunningWork]], bool]:
    def once(candidates: list[RunningWork]) -> bool:
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = test(candidates)
        return hit
    return once
