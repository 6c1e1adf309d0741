"""The scheduling decision: ``decide(view, queue, policy) -> Decisions``.

Pure: no I/O, no clock, no globals; the same inputs give the same decisions. The scheduler
service, the replay, the benchmarks and the tests all call this one function.

One call (numbered as in the code):

1. take the queue in fair order (:class:`~.queues.FairOrder`: effective priority with aging
   and the fast lane, then dominant-resource fair share between tenants);
2. for each job, run the hard filters per cluster (first failure is the reason; results are
   cached, see "Caches" below), then fit the gang node by node on the clusters that pass, on
   the cycle's private working copy, honouring reservations held by higher jobs;
3. score the fits (weighted plugins) and take the best (ties: cluster name); a
   ``prefer_local`` job whose home region is full waits for it when its estimated home start
   is near enough, else it goes abroad;
4. a job that fits nowhere -- for want of capacity or of its tenant's quota -- may preempt the
   cheapest work the preemption rules allow (:mod:`.preempt`: Kueue's withinClusterQueue,
   reclaimWithinCohort, borrowWithinCohort), or -- if the policy backfills -- reserve the
   cluster where it would start earliest; later jobs only backfill into a reserved cluster when
   they are estimated to end before the reservation starts;
5. what still cannot go stays pending with every cluster's verdict, the summary, and whether it
   would fit some cluster if that cluster were empty (``fits_empty``; False = unplaceable).

Caches. Within a call many jobs share verdicts, so the cycle memoises them; every cache is keyed
by everything its value reads (``decide(..., cache=False)`` computes everything afresh and must
decide the same, ``tests/unit/test_scheduler_cache.py``):

* filter verdicts: per cluster and everything the policy's filters read of the job (each
  filter declares it, :mod:`.filters`; e.g. the quota filter's key holds the tenant, when it has
  quota rules, and the GPU demand);
* candidate card models: allowed models, on-card memory, price ceiling, cluster;
* the viable/misfit split: filter keys, candidate-model inputs and the GPU shape (workers, GPUs
  per worker, share), invalidated by changes of capacity; whole fits that failed there, per CPU
  and memory request as well; and, per CPU and memory request and clusters taken out for the
  job (avoided, reserved), its candidate set -- candidates, ghosts, failed verdicts, per-region
  groups with their lowest-priced candidates and "outscored" verdicts (:class:`_CandidateSet`,
  :class:`_Group`) -- rebuilt only when the split's viable clusters or failed fits change;
* per (cluster, GPU shape) "slot", each value with what it holds for (:class:`Candidate`): the
  capacity check (until the card-model pool that admitted the shape changes; "surely not"
  until the cluster gets capacity back) and the "does not fit" verdict (the cluster's
  allocation version), both shared by every split of the shape; cluster-and-shape score bounds
  (the allocation version); gang fits per CPU and memory request (below);
* per-cluster values (estimated starts, preemption plans): cluster, its allocation version,
  candidate models and the request shape each value reads (CPU and memory too for the
  estimated start, which fits the whole request; a prefer_local job's home start is searched
  only as far as its wait limit, and an "not within" answer is reused for limits no larger);
* gang fits and the scores that read only the fit and its card-model pool (``score_scope =
  "fit"``: packing, fragmentation, headroom): cluster and the whole request shape, holding
  until that pool changes or the cluster gets capacity back (a CPU-only fit: until the cluster
  changes), so jobs of one shape share them; the scores that read the job's data, home or
  estimate (home, start, cost) are computed per job -- once per region (and unit price) in a
  search -- and their region-wide bounds once per region;
* "fits if empty": filter keys, candidate-model inputs and the whole request shape;
* preemption plans under quotas: cluster, its allocation version, the eviction epoch, tenant,
  priority, candidate models and the whole request (candidate pools and quota bounds per
  cluster, tenant, priority, model and demand);
* a pending job's verdicts: all of the above plus priority, the reservations the job is not
  estimated to end before (not the estimate itself: jobs of one request with different
  estimates share verdicts), clusters to avoid, the tenant (when quotas exist: preemption rules
  depend on it) and the cycle's eviction/reservation version. The per-cluster *codes* of shared verdicts are exact; an "insufficient" detail gives
  the cluster's free capacity when that cluster was first found too small this cycle.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from fedsched.jobs import Locality
from fedsched.reasons import PASS, STATIC_REASONS, Reason, Verdict, fail, summarise_counts
from services.scheduler.core.filters import Context, candidate_models, filter_key_functions, key_function
from services.scheduler.core.fit import Fit, WorkingCluster
from services.scheduler.core.policy import Policy
from services.scheduler.core.preempt import Eviction, estimated_start, find_victims, quota_victims
from services.scheduler.core.queues import FairOrder, queue_of
from services.scheduler.core.scorers import (costs_per_unit_hour, estimated_cost, remote_bytes, set_cost_reference,
                                             transfer_seconds)
from services.scheduler.core.snapshot import (WHOLE, ClusterIndex, ClusterState, QueuedJob, RunningWork, View,
                                              lowest_preemptible)


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


_MISSING = object()


def _models_key(job: QueuedJob) -> tuple:
    """What :func:`~.filters.candidate_models` reads of the job."""
    s = job.spec
    return s.card_models, s.min_gpu_memory_gib, s.max_price_per_gpu_hour


def _shape(job: QueuedJob, models: Sequence[str]) -> tuple:
    """The GPU request shape with its candidate models (what GPU-only figures read)."""
    s = job.spec
    return (tuple(models), s.workers, s.gpus_per_worker, s.gpu_milli)


def _full_shape(job: QueuedJob, models: Sequence[str]) -> tuple:
    """The whole request shape (what a gang fit reads: GPUs, CPU and memory per worker)."""
    s = job.spec
    return (tuple(models), s.workers, s.gpus_per_worker, s.gpu_milli, s.cpu_milli, s.memory_mib)


def _insufficient(job: QueuedJob, work: WorkingCluster, models: Sequence[str]) -> Verdict:
    """The "insufficient free resources" verdict of ``job`` on a cluster (its state ``work``):
    what a worker needs, and per candidate card model (at most 3) the cards free; where a node
    has the cards a worker needs, the most CPU (milli-CPUs) and memory (MiB) free on such a node
    too, so a shortage of CPU or memory next to free cards shows as such."""
    s = job.spec
    if s.gpus_per_worker == 0:
        return fail(Reason.INSUFFICIENT, f"needs {s.workers}x {s.cpu_milli}m CPU / {s.memory_mib} MiB")
    whole = s.gpu_milli == WHOLE or s.gpus_per_worker > 1
    parts = []
    for m in models[:3]:
        max_dev, max_idle, total_idle = work.summary(m)
        part = f"{m}: {total_idle} idle cards, max {max_idle} on one node, best share {max_dev}m"
        if (max_idle >= s.gpus_per_worker) if whole else (max_dev >= s.gpu_milli):
            cpu = mem = 0  # over the capacity classes whose free cards hold one worker's
            for gpu_free, cpu_free, mem_free in work.classes(m):
                if (sum(g == WHOLE for g in gpu_free) >= s.gpus_per_worker) if whole else (
                        max(gpu_free, default=0) >= s.gpu_milli):
                    cpu, mem = max(cpu, cpu_free), max(mem, mem_free)
            part += f"; nodes with the cards have at most {cpu}m CPU / {mem} MiB free"
        parts.append(part)
    want = (f"{s.workers}x {s.gpus_per_worker} GPU" if whole else f"{s.workers}x {s.gpu_milli}m GPU")
    return fail(Reason.INSUFFICIENT, f"needs {want} + {s.cpu_milli}m CPU / {s.memory_mib} MiB each; "
                                     + "; ".join(parts))


def _est_end(job: QueuedJob, now: float) -> float:
    est = job.spec.estimated_duration_s
    return now + est if est is not None else math.inf


class _Split:
    """For one GPU request shape: the clusters it may fit (``viable``, by
    :meth:`~.fit.WorkingCluster.could_fit`, which reads only the GPU shape) and the "does not
    fit" verdicts of the others (``misfits``), kept current as the cycle allocates; plus, per
    CPU and memory request, the viable clusters where a whole fit already failed (``failed``).

    Within a cycle capacity only shrinks -- except when an eviction gives some back, which starts
    a new ``epoch`` -- so a misfit stays a misfit, and only viable clusters that changed since the
    last use need a new look.
    """

    __slots__ = ("epoch", "seen", "viable", "misfits", "counts", "failed", "sets", "events")

    def __init__(self, epoch: int, seen: int) -> None:
        self.epoch = epoch
        self.seen = seen  # the cycle's allocation changes looked at (:attr:`_Cycle.changes`)
        self.viable: dict[str, Candidate] = {}
        self.misfits: list[ClusterEvaluation] = []
        self.counts: Counter = Counter()  # reasons of the misfits
        self.failed: dict[tuple[int, int], dict[str, ClusterEvaluation]] = {}
        #: (CPU and memory request -- None for the requests with no failed fit --, clusters
        #: taken out) -> :class:`_CandidateSet`, brought in step with ``events`` when next used
        #: (what every set is derived from)
        self.sets: dict[tuple, _CandidateSet] = {}
        #: what changed the sets, in order: (None, candidate) -- it left ``viable``; (CPU and
        #: memory request, candidate, verdict) -- that request's whole fit failed there
        self.events: list[tuple] = []

    def add_misfit(self, evaluation: ClusterEvaluation) -> None:
        """Record a cluster the shape surely does not fit."""
        self.misfits.append(evaluation)
        self.counts[evaluation.verdict.reason] += 1

    def misfit(self, cluster: ClusterState, verdict: Verdict) -> ClusterEvaluation:
        """Move ``cluster`` from viable to the misfits (and out of every candidate set); return
        its evaluation."""
        evaluation = ClusterEvaluation(cluster.name, cluster.region, verdict)
        cand = self.viable.pop(cluster.name, None)
        if cand is not None:
            self.add_misfit(evaluation)
            if self.sets:
                self.events.append((None, cand))
        return evaluation

    def fail(self, job: QueuedJob, name: str, evaluation: ClusterEvaluation) -> ClusterEvaluation:
        """Record that the job's whole request did not fit viable cluster ``name`` (its
        candidate sets, the only ones that read that request's failed fits, count it a ghost)."""
        failed = self.failed_for(job)
        request = (job.spec.cpu_milli, job.spec.memory_mib)
        if name in failed:  # (not met: failed clusters are not fitted again) its place would stay
            self.sets = {key: got for key, got in self.sets.items() if key[0] != request}
        elif self.sets:
            self.events.append((request, self.viable[name], evaluation))
        failed[name] = evaluation
        return evaluation

    def candidate_set(self, job: QueuedJob, out: tuple[str, ...], cy: "_Cycle") -> "_CandidateSet":
        """The :class:`_CandidateSet` of the job's CPU and memory request without the clusters
        ``out`` (avoided or reserved for it; in cluster order), built once and kept in step
        (not kept when the cycle does not cache). Requests whose whole fit failed nowhere yet
        see the same set, so they share one (its request is None: no failure applies to it)."""
        request = (job.spec.cpu_milli, job.spec.memory_mib)
        key = (request if self.failed.get(request) else None, out)
        got = self.sets.get(key) if cy.caching else None
        if got is not None and got.applied < len(self.events):
            got = got.catch_up(self.events, key[0])
        if got is None:
            got = _CandidateSet(self, self.failed_for(job), out, cy.position)
            got.applied = len(self.events)
            cy.sets_built += 1
            if cy.caching:
                self.sets[key] = got
        return got

    def failed_for(self, job: QueuedJob) -> dict[str, ClusterEvaluation]:
        """Viable clusters where a whole fit of this CPU and memory request failed (a fit reads
        them; the shape's other requests may still fit there)."""
        key = (job.spec.cpu_milli, job.spec.memory_mib)
        failed = self.failed.get(key)
        if failed is None:
            failed = self.failed[key] = {}
        return failed


class _CandidateSet:
    """A split's clusters as one CPU and memory request sees them (private): the verdicts of
    viable clusters where that whole request already failed (``failed_evals``), the clusters
    still to fit (``cands``) and the failed ones that still count in the cost reference
    (``ghosts``), both without the clusters taken out for the job (avoided, reserved), in
    cluster order; and their groups (:class:`_Group`). Derived from the split alone, so jobs of the
    request share it; the split keeps it in step (:meth:`drop`, :meth:`fail`): it is what a
    set built afresh from the split would be."""

    __slots__ = ("failed_evals", "cands", "ghosts", "groups", "out", "position", "applied")

    def __init__(self, split: _Split, failed: dict[str, ClusterEvaluation], out: tuple[str, ...],
                 position: dict[str, int]) -> None:
        viable = split.viable
        self.failed_evals = tuple(e for name, e in failed.items() if name in viable)
        self.cands = [c for name, c in viable.items() if name not in failed and name not in out]
        self.ghosts = [c for name, c in viable.items() if name in failed and name not in out]
        self.groups: dict[tuple, _Group] = {}
        self.out = out
        self.position = position  # cluster -> its place in the view (the order of cands and ghosts)
        self.applied = 0  # the split's events reflected here

    def catch_up(self, events: list[tuple], request: tuple[int, int] | None) -> "_CandidateSet | None":
        """Apply the split's events since the last use (those of this CPU and memory request --
        None: the set of the requests that failed nowhere, no failure applies -- and every
        cluster leaving the split); None when rebuilding the set would be cheaper."""
        pending = events[self.applied:]
        self.applied = len(events)
        if len(pending) > len(self.cands) + len(self.ghosts):
            return None
        for event in pending:
            if event[0] is None:
                self.drop(event[1])
            elif event[0] == request:
                self.fail(event[1], event[2])
        return self

    def group(self, home: str | None, at_home: bool = True) -> "_Group":
        """All candidates (``home`` None), or those in (``at_home``) or outside region ``home``."""
        key = (home, at_home)
        got = self.groups.get(key)
        if got is None:
            if home is None:
                got = _Group(list(self.cands), list(self.ghosts), self.position)
            else:
                got = _Group([c for c in self.cands if (c.cluster.region == home) == at_home],
                             [c for c in self.ghosts if (c.cluster.region == home) == at_home], self.position)
            self.groups[key] = got
        return got

    def drop(self, cand: "Candidate") -> None:
        """``cand``'s cluster left the split's viable clusters."""
        name = cand.cluster.name
        if any(e.cluster == name for e in self.failed_evals):
            self.failed_evals = tuple(e for e in self.failed_evals if e.cluster != name)
        if name in self.out:
            return
        position = self.position
        if not _remove(self.cands, cand, position):
            _remove(self.ghosts, cand, position)
        for got in self.groups.values():
            got.drop(cand)

    def fail(self, cand: "Candidate", evaluation: ClusterEvaluation) -> None:
        """The set's request did not fit ``cand``'s cluster (``evaluation``): a ghost now."""
        self.failed_evals += (evaluation,)
        if cand.cluster.name in self.out:
            return
        _remove(self.cands, cand, self.position)
        _insert(self.ghosts, cand, self.position)
        for got in self.groups.values():
            got.fail(cand)


def _remove(cands: list["Candidate"], cand: "Candidate", position: dict[str, int]) -> bool:
    """Take ``cand`` out of ``cands`` (in cluster order); whether it was there."""
    i = bisect_left(cands, position[cand.cluster.name], key=lambda c: position[c.cluster.name])
    if i < len(cands) and cands[i] is cand:
        del cands[i]
        return True
    return False


def _insert(cands: list["Candidate"], cand: "Candidate", position: dict[str, int]) -> None:
    """Put ``cand`` into ``cands`` (in cluster order) at its place."""
    cands.insert(bisect_left(cands, position[cand.cluster.name], key=lambda c: position[c.cluster.name]), cand)


class _Group:
    """Candidates one branch and bound searches, arranged once for every job that searches
    them (private): by region (candidate order), each region's candidates with distinct
    cheapest-model prices (what a ``region_price`` bound reads), per region the candidate with
    the lowest unit price among candidates and ghosts (the cost reference's), and each region's
    "outscored" verdicts, built on first use. Kept in step by its candidate set: a change
    rebuilds what it derived for that cluster's region alone (the regions' order may then
    differ from a group built afresh; nothing reads it)."""

    __slots__ = ("cands", "ghosts", "regions", "reps", "least", "lowest", "outscored", "home_firsts", "rankings",
                 "position", "places")

    def __init__(self, cands: list["Candidate"], ghosts: list["Candidate"], position: dict[str, int]) -> None:
        self.cands = cands
        self.ghosts = ghosts
        self.position = position
        regions: dict[str, list[Candidate]] = {}
        reps: dict[str, dict[tuple, Candidate]] = {}
        for c in cands:
            region = c.cluster.region
            regions.setdefault(region, []).append(c)
            distinct = reps.setdefault(region, {})
            if c.price_key not in distinct:
                distinct[c.price_key] = c
        self.regions = regions
        self.reps = {region: tuple(d.values()) for region, d in reps.items()}
        least: dict[str, tuple[float, ClusterState, str]] = {}
        for c in (*cands, *ghosts):
            unit = c.unit  # (precomputed: the cheapest model's price, CPU-only: the core-hour price)
            region = c.cluster.region
            held = least.get(region)
            if held is None or unit < held[0]:
                least[region] = (unit, c.cluster, c.price_key[0])
        self.least = least  # region -> (unit price, cluster, model) of its lowest-priced candidate or ghost
        self.lowest = tuple((cluster, model) for _, cluster, model in least.values())
        self.outscored: dict[tuple, tuple[ClusterEvaluation, ...]] = {}
        self.home_firsts: tuple[ClusterEvaluation, ...] | None = None
        self.rankings: dict[str, _Ranking] = {}
        self.places: tuple | None = None

    def search_places(self) -> tuple:
        """What a search asks the scorers about, built once: (the regions, index by region,
        (cluster, work, models) of each region's first candidate, of every price representative
        (regions in order), each region's slice of the latter, the representatives' unit
        prices, and (region index, unit price) -> the first representative of that region
        charging it)."""
        got = self.places
        if got is None:
            names = list(self.regions)
            firsts = [(c.cluster, c.work, c.models) for c in (self.regions[r][0] for r in names)]
            places, slices, units = [], [], []
            at_price: dict[tuple[int, float], int] = {}
            for i, r in enumerate(names):
                start = len(places)
                places.extend((c.cluster, c.work, c.models) for c in self.reps[r])
                for c in self.reps[r]:
                    at_price.setdefault((i, c.unit), len(units))
                    units.append(c.unit)
                slices.append((start, len(places)))
            got = self.places = (names, {r: i for i, r in enumerate(names)}, firsts, places, slices, units, at_price)
        return got

    def drop(self, cand: "Candidate") -> None:
        """``cand`` is no longer a candidate nor a ghost (its cluster left the split)."""
        if _remove(self.cands, cand, self.position):
            self._region_changed(cand, left=True)
        elif _remove(self.ghosts, cand, self.position):
            self._region_changed(cand, left=False)

    def fail(self, cand: "Candidate") -> None:
        """``cand`` is a ghost now (the group's request did not fit it)."""
        if _remove(self.cands, cand, self.position):
            _insert(self.ghosts, cand, self.position)
            self._region_changed(cand, left=True)

    def _region_changed(self, cand: "Candidate", left: bool) -> None:
        """Derive again what ``cand``'s region holds (``left``: it was among its candidates)."""
        region = cand.cluster.region
        if left:
            self.home_firsts = self.places = None
            self.outscored.pop((region, True), None)
            self.outscored.pop((region, False), None)
            members = self.regions[region]
            _remove(members, cand, self.position)
            if members:
                distinct: dict[tuple, Candidate] = {}
                for c in members:
                    if c.price_key not in distinct:
                        distinct[c.price_key] = c
                self.reps[region] = tuple(distinct.values())
                ranking = self.rankings.get(region)
                if ranking is not None:
                    ranking.drop(cand)
            else:
                del self.regions[region], self.reps[region]
                self.rankings.pop(region, None)
        if self.least[region][1] is not cand.cluster:
            return  # the region's first lowest-priced candidate or ghost stays first
        held = None
        for c in (*self.regions.get(region, ()), *self.ghosts):
            if c.cluster.region == region and (held is None or c.unit < held[0]):
                held = (c.unit, c.cluster, c.price_key[0])
        if held is None:
            del self.least[region]
        else:
            self.least[region] = held
        self.lowest = tuple((cluster, model) for _, cluster, model in self.least.values())

    def ranking(self, region: str, cy: "_Cycle", job: QueuedJob) -> "_Ranking | None":
        """The region's candidates kept in order of the policy's cluster-and-shape bound, up to
        date, when that order is the order of a job's bounds (:class:`_Ranking`); else None."""
        if cy.rank_scope is None or len(self.reps[region]) != 1:
            return None  # other varying bounds, or more than one cheapest-model price here
        got = self.rankings.get(region)
        if got is None:
            got = self.rankings[region] = _Ranking(self.regions[region], cy, job, region)
        else:
            got.refresh(cy, job)
        return got if got.exact else None

    def home_first(self, cy: "_Cycle") -> tuple[ClusterEvaluation, ...]:
        """The "home goes first" verdicts of every candidate (candidate order), built once."""
        got = self.home_firsts
        if got is None:
            got = self.home_firsts = tuple(cy.home_first(c.cluster) for c in self.cands)
        return got

    def outscore(self, cy: "_Cycle", region: str, exact: bool) -> tuple[ClusterEvaluation, ...]:
        """The "outscored" verdicts of every candidate of ``region`` (candidate order)."""
        key = (region, exact)
        got = self.outscored.get(key)
        if got is None:
            got = []
            _outscore(cy, [c.cluster for c in self.regions[region]], got, exact=exact)
            got = self.outscored[key] = tuple(got)
        return got


class _Ranking:
    """A region's candidates in a group in order of the policy's one cluster-and-shape bound
    (:attr:`_Cycle.rank_scope`), highest first, ties by name, kept in order as the cycle
    allocates (private): ``order`` holds (-bound, name, candidate).

    Where every other varying bound of the region's candidates is one value (one cheapest-model
    price in the region), a job's total bound on a candidate is a non-decreasing function of its
    cluster-and-shape bound -- the same sums of the same terms, rounded to 9 places -- so this
    order is the one :meth:`_Bounds.ranked` sorts each job's candidates into, unless two
    different bounds lie so close that rounding could tie their totals (then ``exact`` is False
    and the search ranks the region itself). The branch and bound then computes the totals of
    the candidates it visits only, not of the whole region."""

    __slots__ = ("order", "tail", "entries", "seen", "exact", "weight", "margin", "region")

    def __init__(self, cands: list["Candidate"], cy: "_Cycle", job: QueuedJob, region: str) -> None:
        scope = cy.rank_scope
        # (entries compare by bound and name, names are unique: a candidate is never compared)
        self.entries = {c.cluster.name: (-cy.shape_bound(scope, job, c), c.cluster.name, c) for c in cands}
        self.region = region  # (every candidate's)
        self.order = sorted(self.entries.values())
        #: each entry's "outscored" verdict, in the order's order (a search extends its verdicts
        #: with the part past the candidate it stops at)
        self.tail = [cy.outscored_verdict(entry[2].cluster, True) for entry in self.order]
        self.seen = cy.changes
        self.weight, self.margin = scope.weight, cy.rank_margin
        self.exact = self._check()

    def refresh(self, cy: "_Cycle", job: QueuedJob) -> None:
        """Bring the order up to date with the allocation changes since the last look: the
        candidates whose cluster changed since get their bound anew and move to their place."""
        seen = self.seen
        if seen == cy.changes:
            return
        self.seen = cy.changes
        entries, order, scope = self.entries, self.order, cy.rank_scope
        moved = False
        # the region's clusters changed since, newest first (the order of ``cy.last_change``)
        for name, n in reversed(cy.region_change.get(self.region, {}).items()):
            if n <= seen:
                break
            entry = entries.get(name)
            if entry is None:
                continue
            neg = -cy.shape_bound(scope, job, entry[2])
            if neg != entry[0]:
                verdict = self._take_out(entry)
                entry = entries[name] = (neg, name, entry[2])
                i = bisect_left(order, entry)
                order.insert(i, entry)
                self.tail.insert(i, verdict)
                if self.exact:  # the new neighbours only (the others were checked)
                    self.exact = self._apart(i - 1, i) and self._apart(i, i + 1)
                else:
                    moved = True
        if moved:
            self.exact = self._check()

    def drop(self, cand: "Candidate") -> None:
        """Take ``cand`` out of the order."""
        self._take_out(self.entries.pop(cand.cluster.name))
        if not self.exact:
            self.exact = self._check()

    def _take_out(self, entry: tuple) -> ClusterEvaluation:
        """Remove ``entry`` from the order (and its verdict from the tail: returned); if the
        order was exact, check its old neighbours, adjacent now."""
        order = self.order
        i = bisect_left(order, entry[:2])
        del order[i]
        verdict = self.tail.pop(i)
        if self.exact:
            self.exact = self._apart(i - 1, i)
        return verdict

    def _apart(self, i: int, j: int) -> bool:
        """Whether entries ``i`` and ``j`` of the order (neighbours; either may be past an end)
        are equal or further apart, weighted, than the rounding can hide."""
        order = self.order
        if i < 0 or j >= len(order):
            return True
        a, b = order[i][0], order[j][0]
        return a == b or self.weight * (b - a) > self.margin

    def _check(self) -> bool:
        """Whether every two neighbouring different bounds, weighted, differ by more than the
        rounding can hide (:attr:`_Cycle.rank_margin`)."""
        w, margin = self.weight, self.margin
        order = self.order
        return all(a[0] == b[0] or w * (b[0] - a[0]) > margin for a, b in zip(order, order[1:]))


class _Cycle:
    """The mutable state of one decide() call (private)."""

    def __init__(self, view: View, policy: Policy, cache: bool = True) -> None:
        self.caching = cache
        self.clusters = tuple(c if c.index is not None else replace(c, index=ClusterIndex.build(c.nodes))
                              for c in view.clusters)
        self.by_name = {c.name: c for c in self.clusters}
        self.position = {c.name: i for i, c in enumerate(self.clusters)}
        prices = [p for c in self.clusters for p in c.prices.values() if p > 0]
        pairs = {(a, b): bps for a, b, bps in policy.region_bandwidth_bps}
        self.ctx = Context(view, policy.inter_region_bandwidth_bps, policy.egress_price_per_gb,
                           max(prices, default=1.0), region_bandwidth_bps=pairs)
        self.filter_key = key_function(policy.filters, self.ctx)
        #: per filter, what it alone reads of a job; (filter, that) -> {cluster: its failed
        #: verdict} over every cluster; filter keys -> {cluster: the first failed verdict}
        self.filter_keys = filter_key_functions(policy.filters, self.ctx)
        self.filter_fails: dict[tuple, dict[str, Verdict]] = {}
        self.first_fails: dict[tuple, dict[str, Verdict]] = {}
        self.view = view
        self.policy = policy
        self.scopes = [ScorerScope(i, sc, w, getattr(sc, "bound_scope", "cluster"))
                       for i, (sc, w) in enumerate(policy.weights)]
        self.varying_scopes = [s for s in self.scopes if s.scope not in ("const", "region")]
        #: (kind, scope) per weighted scorer, in order: 0 = const, 1 = region, 2 = region_price,
        #: 3 = one per cluster (cluster, cluster_shape: at most 1 in a region's bound)
        self.bound_kinds = tuple(({"const": 0, "region": 1, "region_price": 2}.get(s.scope, 3), s) for s in self.scopes)
        #: per weighted scorer, its ``bounds`` (many places at once) or None
        self.bound_many = tuple(getattr(s.scorer, "bounds", None) for s in self.scopes)
        # the policy's one cluster-and-shape bound, when every other varying bound is a
        # region-and-price one: a region's candidates are then kept in order of it (:class:`_Ranking`)
        shape_scopes = [s for s in self.varying_scopes if s.scope == "cluster_shape"]
        self.rank_scope = (shape_scopes[0] if cache and len(shape_scopes) == 1 and shape_scopes[0].weight >= 0
                           and all(s.scope in ("cluster_shape", "region_price") for s in self.varying_scopes)
                           else None)
        #: the least difference of two weighted cluster-and-shape bounds that survives a job's
        #: total bound being rounded to 9 places (1e-9, plus the float error of adding the terms)
        self.rank_margin = 4e-9 + 1e-14 * (1.0 + sum(abs(w) for _, w in policy.weights))
        # cluster -> lowest priority of its preemptible work (clusters without any are absent)
        self.lowest_victim = {c.name: low for c in self.clusters
                              if (low := lowest_preemptible(c.running)) is not None}
        self.least_victim = min(self.lowest_victim.values(), default=math.inf)  # over every cluster
        self.work: dict[str, WorkingCluster] = {}
        self.empty: dict[str, WorkingCluster] = {}
        self.static: dict[tuple, Verdict] = {}
        self.reservations: dict[str, Reservation] = {}
        self.victims: set[tuple[str, int, int]] = set()
        self.timelines: dict[str, list[RunningWork]] = {}
        # placements (job, fit) made since the cluster's timeline was last read (their records
        # are appended when it is next read)
        self.added: dict[str, list[tuple[QueuedJob, Fit]]] = {}
        self.placed = 0
        self.version = 0  # bumped by every eviction and reservation (memo validity)
        self.placed_jobs: list[QueuedJob] = []  # placed this cycle: never victims (:attr:`placed_keys`)
        self._placed_keys: set[tuple[str, int, int]] = set()  # of placed_jobs[:_placed_seen]
        self._placed_seen = 0
        self.cluster_version: dict[str, int] = {}  # bumped when a cluster's allocations change
        self.value_cache: dict[tuple, object] = {}
        self.splits: dict[tuple, _Split] = {}
        self.outscored: dict[tuple, ClusterEvaluation] = {}
        self.term_memo: dict[str, dict[float, tuple[str, float]]] = {}  # (:meth:`term_tuple`)
        self.changes = 0  # allocation changes so far (placements and evictions)
        #: cluster -> the number of its last allocation change (``changes`` after it), least
        #: recently changed first: the clusters changed since change ``n`` are a suffix of it
        self.last_change: dict[str, int] = {}
        #: region -> the part of ``last_change`` in that region, in the same order
        self.region_change: dict[str, dict[str, int]] = {}
        self.epoch = 0  # bumped when capacity comes back (evictions)
        self.reserve_tries = 0
        self.static_pass: dict[tuple, tuple] = {}
        self.static_counts: dict[tuple, Counter] = {}
        self.model_cache: dict[tuple, list[str]] = {}
        self.pending_memo: dict[tuple, tuple] = {}
        self.fits_empty_cache: dict[tuple, bool] = {}
        # (cluster, GPU shape) -> the candidates' slot (Candidate.slot): their gang fits and
        # fit-only scores per CPU and memory request, and their cluster-and-shape bounds
        self.slots: dict[tuple, dict] = {}
        # (candidate-model inputs, GPU shape) -> cluster -> its Candidate (models, shape, slot,
        # price key, unit price: the same for every split of the shape)
        self.infos: dict[tuple, dict[str, Candidate]] = {}
        # work done on (cluster, request shape) pairs, for decide(stats=...): capacity checks
        # (could_fit, on first sight and after the cluster changed) and gang fits computed
        self.checks = 0
        self.fits = 0
        self.sets_built = 0  # candidate sets (:class:`_CandidateSet`) built
        self.shared = 0  # pending verdicts taken from an earlier job's (``pending_memo``)
        self.home_firsts: dict[str, ClusterEvaluation] = {}
        self.fit_scored = {i for i, (sc, _) in enumerate(policy.weights) if getattr(sc, "score_scope", "job") == "fit"}
        #: per weighted scorer: (index, scorer, weight, name, score scope) -- what :func:`_score`
        #: reads; without the caches every score is computed afresh (scope "job")
        self.scoring = tuple((i, sc, w, sc.name, getattr(sc, "score_scope", "job") if cache else "job")
                             for i, (sc, w) in enumerate(policy.weights))
        # when the scorers reading the job and the region come first and those reading the fit
        # last (federated's order), a fit's terms are the search's region terms then the fit's
        # (:func:`_score`): the split between them, else None
        kinds = [scope for *_, scope in self.scoring]
        at = next((k for k, kind in enumerate(kinds) if kind == "fit"), len(kinds))
        self.score_parts = (at if all(kind in ("region", "region_price") for kind in kinds[:at])
                            and all(kind == "fit" for kind in kinds[at:]) else None)
        self.score_weights = tuple(w for _, w in policy.weights)
        self.score_names = tuple(name for _, _, _, name, _ in self.scoring)
        #: the fit part's scorers, weights and names (``score_parts`` on)
        at = self.score_parts or 0
        self.fit_scoring = (tuple(sc for _, sc, _, _, _ in self.scoring[at:]), self.score_weights[at:],
                            self.score_names[at:])
        #: the region terms of a scored fit can be read from the search's bounds
        #: (``score_is_bound`` scorers whose bound and score scopes agree)
        self.scores_from_bounds = self.score_parts is not None and all(
            getattr(sc, "score_is_bound", False) and getattr(sc, "bound_scope", "cluster") == scope
            for _, sc, _, _, scope in self.scoring[:self.score_parts])
        # preemption under quotas: per-cluster summaries of evictable work, tenants' cohorts,
        # the rules covering each running work (all pure functions of the view)
        self.evict_summary: dict[str, tuple] = {}
        self.cohorts: dict[str, set[str]] = {}
        self.covers: dict[int, tuple[int, ...]] = {}
        self.pools: dict[tuple, object] = {}

    def timeline(self, cluster: ClusterState) -> list[RunningWork]:
        """Work holding the cluster's resources now, this cycle's evictions and placements applied."""
        t = self.timelines.get(cluster.name)
        if t is None:
            t = self.timelines[cluster.name] = list(cluster.running)
        added = self.added.pop(cluster.name, None)
        if added:
            t.extend(self._work(job, fit) for job, fit in added)
        return t

    def _work(self, job: QueuedJob, fit: Fit) -> RunningWork:
        """The record of ``job`` placed with ``fit`` this cycle (started now)."""
        est = job.spec.estimated_duration_s
        end = self.view.now + max(0.0, est - job.progress_s) if est is not None else math.inf
        return RunningWork(job.job_id, job.attempt, job.shard, job.spec.tenant, job.spec.priority_value,
                           job.spec.preemptible, job.spec.checkpointable, self.view.now, end, fit.card_model,
                           tuple((b.node, b.devices, b.gpu_milli, b.cpu_milli, b.memory_mib) for b in fit.bindings))

    def record(self, job: QueuedJob, cluster: ClusterState, fit: Fit, victims: tuple[RunningWork, ...]) -> None:
        """Keep the timeline current after a placement (and its evictions)."""
        if victims:
            t = self.timeline(cluster)
            gone = {(v.job_id, v.attempt, v.shard) for v in victims}
            t[:] = [w for w in t if (w.job_id, w.attempt, w.shard) not in gone]
            t.append(self._work(job, fit))
        else:  # its record is made when the cluster's timeline is next read (if it is)
            added = self.added.get(cluster.name)
            if added is None:
                self.added[cluster.name] = [(job, fit)]
            else:
                added.append((job, fit))
        self.placed += 1
        self.cluster_version[cluster.name] = self.cluster_version.get(cluster.name, 0) + 1
        self.changes += 1
        self.last_change.pop(cluster.name, None)  # re-inserted last: the order stays by recency
        self.last_change[cluster.name] = self.changes
        in_region = self.region_change.get(cluster.region)
        if in_region is None:
            in_region = self.region_change[cluster.region] = {}
        in_region.pop(cluster.name, None)
        in_region[cluster.name] = self.changes
        self.placed_jobs.append(job)
        if victims:
            self.version += 1

    @property
    def placed_keys(self) -> set[tuple[str, int, int]]:
        """(job id, attempt, shard) of the work placed this cycle (never victims), made when
        asked (preemption only) from the placements since the last ask."""
        keys, jobs = self._placed_keys, self.placed_jobs
        if self._placed_seen < len(jobs):
            keys.update((j.job_id, j.attempt, j.shard) for j in jobs[self._placed_seen:])
            self._placed_seen = len(jobs)
        return keys

    def term_tuple(self, names: Sequence[str], values: Sequence[float]) -> tuple:
        """The score terms ``(name, round(value, 4))`` of ``values`` (scorers ``names``), each
        kept per scorer and value (a nonzero float: equal ones are the same bits), so jobs
        scoring a value again share its term (fewer objects for the collector)."""
        by_value = self.term_memo
        out = []
        for name, value in zip(names, values):
            if type(value) is float and value:
                memo = by_value.get(name)
                if memo is None:
                    memo = by_value[name] = {}
                term = memo.get(value)
                if term is None:
                    term = memo[value] = (name, round(value, 4))
            else:
                term = (name, round(value, 4))
            out.append(term)
        return tuple(out)

    def static_key(self, job: QueuedJob) -> tuple:
        """The job's filter keys: every property of the job any filter of the policy reads."""
        return self.filter_key(job)

    def eligible(self, job: QueuedJob, skey: tuple) -> tuple[list[ClusterState], list[ClusterEvaluation],
                                                             list[ClusterState]]:
        """Clusters passing the hard filters, the failed clusters' evaluations (a fresh list the
        caller may extend), and the clusters failing only for reasons that can change."""
        cached = self.static_pass.get(skey) if self.caching else None
        if cached is None:
            eligible, failed, static_ok = [], [], []
            fails = self._first_fails(job, skey) if self.caching else None
            for cluster in self.clusters:
                verdict = (fails.get(cluster.name, PASS) if fails is not None
                           else self.static_verdict(job, skey, cluster))
                if verdict.passed:
                    eligible.append(cluster)
                    static_ok.append(cluster)
                else:
                    failed.append(ClusterEvaluation(cluster.name, cluster.region, verdict))
                    if verdict.reason not in STATIC_REASONS:
                        static_ok.append(cluster)
            cached = self.static_pass[skey] = (eligible, tuple(failed), static_ok)
            self.static_counts[skey] = Counter(e.verdict.reason for e in failed)
        return cached[0], list(cached[1]), cached[2]

    def split(self, job: QueuedJob, skey: tuple, eligible: list[ClusterState]) -> _Split:
        """The :class:`_Split` of the job's request shape, brought up to date."""
        s = job.spec
        key = (skey, _models_key(job), s.workers, s.gpus_per_worker, s.gpu_milli)  # could_fit: the GPU shape
        entry = self.splits.get(key) if self.caching else None
        if entry is None or entry.epoch != self.epoch:
            entry = self.splits[key] = _Split(self.epoch, self.changes)
            infos = self.infos.get(key[1:]) if self.caching else None
            if infos is None:
                infos = self.infos[key[1:]] = {}
            viable, versions = entry.viable, self.cluster_version
            for cluster in eligible:
                # fast path: a candidate whose capacity check (and, if it may not fit, "does not
                # fit" verdict at this allocation) another split of the shape made and that
                # still holds (the same as _classify, without the calls)
                cand = infos.get(cluster.name) if self.caching else None
                if cand is not None:
                    slot = cand.slot
                    held = slot.get("could")
                    if held is not None and _could_holds(held, cand.work):
                        if held[0]:
                            viable[cluster.name] = cand
                            continue
                        misfit = slot.get("misfit")
                        if misfit is not None and misfit[0] == versions.get(cluster.name, 0):
                            entry.add_misfit(misfit[1])
                            continue
                self._classify(job, entry, cluster, infos)
            return entry
        seen = entry.seen
        if seen < self.changes:
            entry.seen = self.changes
            viable = entry.viable  # (in cluster order: the order misfits are recorded in)
            hits = []
            for name, n in reversed(self.last_change.items()):  # the clusters changed since, newest first
                if n <= seen:
                    break
                if name in viable:
                    hits.append(name)
            if len(hits) > 1:
                hits.sort(key=self.position.__getitem__)
            for name in hits:
                cand = viable[name]
                work = cand.work
                held = cand.slot.get("could")  # (could_fit's kept answer, read here when it holds)
                if held is not None and (work.changes.get(held[1], 0) == held[2] if held[0]
                                         else work.returns == held[1]):
                    if held[0]:
                        continue
                elif self.could_fit(job, cand.cluster, work, cand.models, cand.slot):
                    continue
                entry.misfit(cand.cluster, _insufficient(job, work, cand.models))
        return entry

    def could_fit(self, job: QueuedJob, cluster: ClusterState, wc: WorkingCluster, models: list[str],
                  slot: dict) -> bool:
        """:meth:`~.fit.WorkingCluster.could_fit` of the job's GPU shape on ``cluster``, memoised
        in the (cluster, shape) ``slot``: every split of the shape (jobs that differ in what the
        filters read) shares it. A "may fit" holds until the pool that admitted the shape
        changes, a "surely not" until the cluster gets capacity back
        (:meth:`~.fit.WorkingCluster.could_fit_on`)."""
        if not self.caching:
            self.checks += 1
            return wc.could_fit(job.spec, models)
        held = slot.get("could")
        if held is None or not _could_holds(held, wc):
            self.checks += 1
            held = slot["could"] = _could(wc, wc.could_fit_on(job.spec, models))
        return held[0]

    def _classify(self, job: QueuedJob, entry: _Split, cluster: ClusterState, infos: dict[str, "Candidate"]) -> None:
        """Put ``cluster`` among the split's viable clusters or its misfits. ``infos``: the
        job's :class:`Candidate` per cluster for its candidate-model inputs and GPU shape
        (models, shape, slot, price key, unit price), shared by every split of that shape."""
        cand = infos.get(cluster.name)
        if cand is None:
            models = self.models(job, cluster)
            shape = _shape(job, models)
            slot = self.slots.get((cluster.name, shape))
            if slot is None:
                slot = self.slots[(cluster.name, shape)] = {}
            cheapest = models[0] if models else ""
            unit = cluster.prices.get(cheapest, 0.0) if job.spec.gpus_per_worker else cluster.cpu_price_per_core_hour
            cand = infos[cluster.name] = Candidate(cluster, self.wc(cluster), models, shape,
                                                   (cheapest, cluster.prices.get(cheapest)), unit, slot)
        slot = cand.slot
        if self.could_fit(job, cluster, cand.work, cand.models, slot):
            entry.viable[cluster.name] = cand
        else:  # the verdict as first found at this allocation, shared by the shape's splits
            version = self.cluster_version.get(cluster.name, 0)
            held = slot.get("misfit") if self.caching else None
            if held is None or held[0] != version:
                held = (version, ClusterEvaluation(cluster.name, cluster.region,
                                                   _insufficient(job, cand.work, cand.models)))
                if self.caching:
                    slot["misfit"] = held
            entry.add_misfit(held[1])

    def fit(self, job: QueuedJob, c: "Candidate") -> tuple[Fit | None, dict[int, tuple]]:
        """The job's gang fit on candidate ``c`` (:meth:`~.fit.WorkingCluster.fit`, tentative)
        and the values of the policy's scorers whose score reads only the fit, the request shape
        and the allocation of the fit's card-model pool (``score_scope = "fit"``; by scorer
        index, filled by :func:`_score`), memoised per (cluster, shape) so jobs of one shape
        share them. A GPU fit reads its card model's pool, and the models tried before it did
        not fit and cannot while capacity only shrinks: it holds until that pool changes or
        the cluster gets capacity back, "no fit" until the latter (``WorkingCluster.changes``,
        ``returns``). A CPU-only fit may land in any pool: it holds until the cluster changes."""
        if not self.caching:
            return c.work.fit(job.spec, c.models), {}
        s = job.spec
        key = ("fit", s.cpu_milli, s.memory_mib)
        work, slot = c.work, c.slot
        hit = slot.get(key)
        if hit is not None:
            pool, count, returns, fit, scores = hit
            if returns == work.returns and (
                    (work.changes.get(pool, 0) == count) if pool is not None else
                    fit is None or count == self.cluster_version.get(c.cluster.name, 0)):
                return fit, scores
        fit = work.fit(s, c.models)
        self.fits += 1
        scores: dict[int, tuple] = {}
        if fit is None:
            slot[key] = (None, None, work.returns, None, scores)
        elif s.gpus_per_worker:
            slot[key] = (fit.card_model, work.changes.get(fit.card_model, 0), work.returns, fit, scores)
        else:
            slot[key] = (None, self.cluster_version.get(c.cluster.name, 0), work.returns, fit, scores)
        return fit, scores

    def shape_bound(self, scope: "ScorerScope", job: QueuedJob, c: "Candidate") -> float:
        """The ``cluster_shape`` bound of ``scope`` on candidate ``c``, memoised in its slot
        until the cluster's allocation changes (every job of the shape shares it)."""
        version = self.cluster_version.get(c.cluster.name, 0)
        held = c.slot.get(scope.index)
        if held is None or held[0] != version:
            held = c.slot[scope.index] = (version, scope.scorer.bound(job, c.cluster, c.work, self.ctx, c.models))
        return held[1]

    def outscored_verdict(self, cluster: ClusterState, exact: bool) -> ClusterEvaluation:
        """The shared "outscored" evaluation of ``cluster`` (``exact`` False: not scored, the
        policy's cap on scored fits), one object per cycle."""
        e = self.outscored.get((cluster.name, exact))
        if e is None:
            e = self.outscored[(cluster.name, exact)] = ClusterEvaluation(cluster.name, cluster.region,
                                                                          _OUTSCORED if exact else _NOT_SCORED)
        return e

    def home_first(self, cluster: ClusterState) -> ClusterEvaluation:
        """The shared "home goes first" verdict of ``cluster`` (one object per cycle)."""
        e = self.home_firsts.get(cluster.name)
        if e is None:
            e = self.home_firsts[cluster.name] = ClusterEvaluation(cluster.name, cluster.region, _HOME_FIRST)
        return e

    def models(self, job: QueuedJob, cluster: ClusterState) -> list[str]:
        """The job's candidate card models on ``cluster`` (cached per request shape)."""
        key = (_models_key(job), cluster.name)
        models = self.model_cache.get(key) if self.caching else None
        if models is None:
            models = self.model_cache[key] = candidate_models(job, cluster)
        return models

    def cached(self, kind: str, cluster: ClusterState, key: tuple, compute):
        """Memoise ``compute()`` per (kind, cluster, key) until the cluster's state changes."""
        if not self.caching:
            return compute()
        full = (kind, cluster.name, self.cluster_version.get(cluster.name, 0), key)
        value = self.value_cache.get(full, _MISSING)
        if value is _MISSING:
            value = self.value_cache[full] = compute()
        return value

    def memo_key(self, job: QueuedJob, skey: tuple) -> tuple:
        """Everything a pending verdict depends on: the filter keys, the candidate-model inputs,
        the request shape, priority (preemption), the reservations the job is not estimated to
        end before (they take their clusters out for it: the one thing its estimate decides on
        the way to "pending" -- memoised verdicts are only kept once no further reservation
        will be made, :meth:`reservations_full`), clusters to avoid and, when quotas exist, the
        tenant (the preemption rules read it). Within a cycle capacity only shrinks, except
        when an eviction gives some back or a reservation changes the rules: those bump
        ``version``, so a memoised "fits nowhere" stays true until then. The verdicts' order
        (presentation) follows the first job's score bounds."""
        s = job.spec
        tenant = s.tenant if self.view.quota is not None else None
        held: tuple[str, ...] = ()
        if self.reservations:
            end = _est_end(job, self.view.now)
            held = tuple(name for name, r in self.reservations.items() if end > r.start_at)
        return (self.version, skey, _models_key(job), s.workers, s.gpus_per_worker, s.gpu_milli, s.cpu_milli,
                s.memory_mib, s.priority_value, held, job.avoid_clusters, tenant)

    def reservations_full(self) -> bool:
        """No further reservation will be made this cycle."""
        return (not self.policy.backfill or len(self.reservations) >= self.policy.reservations
                or self.reserve_tries >= 4 * self.policy.reservations)

    def fits_empty(self, job: QueuedJob, skey: tuple, clusters: list[ClusterState]) -> bool:
        """Would the job fit some of ``clusters`` if it were empty (cached per request shape)?"""
        s = job.spec
        key = (skey, _models_key(job), s.workers, s.gpus_per_worker, s.gpu_milli, s.cpu_milli, s.memory_mib)
        cached = self.fits_empty_cache.get(key) if self.caching else None
        if cached is None:
            cached = self.fits_empty_cache[key] = _fits_somewhere_empty(job, clusters, self)
        return cached

    def wc(self, cluster: ClusterState) -> WorkingCluster:
        w = self.work.get(cluster.name)
        if w is None:
            w = self.work[cluster.name] = WorkingCluster(cluster)
        return w

    def may_evict_there(self, job: QueuedJob, cluster: ClusterState, by_priority: bool) -> bool:
        """A quick necessary condition for :func:`~.preempt.quota_victims` on ``cluster``: some
        preemptible work there that a rule of :mod:`.preempt` could let this job evict (judged on
        the cycle's starting work and quota usage: the cycle only removes candidates)."""
        book = self.view.quota
        summary = self.evict_summary.get(cluster.name)
        if summary is None:
            own: dict[str, int] = {}
            uncovered = math.inf
            borrowing: dict[str, int] = {}  # cohort -> lowest priority of its borrowing work here
            for w in cluster.running:
                if not w.preemptible:
                    continue
                own[w.tenant] = min(own.get(w.tenant, w.priority), w.priority)
                rules = book.covering(w.tenant, w.card_model, cluster.region) if w.card_model else ()
                if not rules:
                    uncovered = min(uncovered, w.priority)
                for i in rules:
                    r = book.rules[i]
                    if r.cohort and book.used.get(i, 0) > r.nominal_milli:
                        borrowing[r.cohort] = min(borrowing.get(r.cohort, w.priority), w.priority)
            summary = self.evict_summary[cluster.name] = (own, uncovered, borrowing)
        own, uncovered, borrowing = summary
        spec, policy = job.spec, self.policy
        prio = spec.priority_value
        if by_priority and (own.get(spec.tenant, prio) < prio or uncovered < prio):
            return True
        cohorts = self.cohorts.get(spec.tenant)
        if cohorts is None:
            cohorts = self.cohorts[spec.tenant] = {r.cohort for r in book.rules if r.tenant == spec.tenant and r.cohort}
        for c in cohorts:
            low = borrowing.get(c)
            if low is None:
                continue
            if policy.reclaim_within_cohort == "any" or (low < prio and (
                    policy.reclaim_within_cohort == "lower_priority" or (by_priority and policy.borrow_within_cohort))):
                return True
        return False

    def passes_but_quota(self, job: QueuedJob, skey: tuple, cluster: ClusterState) -> bool:
        """Every filter but the quota one passes (evictions of the tenant's own work may give
        the quota back)."""
        key = (skey, cluster.name, "but quota")
        ok = self.static.get(key) if self.caching else None
        if ok is None:
            ok = self.static[key] = all(flt.check(job, cluster, self.ctx).passed for flt in self.policy.filters
                                        if flt.name != "quota")
        return ok

    def static_verdict(self, job: QueuedJob, skey: tuple, cluster: ClusterState) -> Verdict:
        """The first failing filter's verdict on ``cluster`` (PASS if none fails)."""
        if self.caching:
            return self._first_fails(job, skey).get(cluster.name, PASS)
        v = PASS
        for flt in self.policy.filters:
            v = flt.check(job, cluster, self.ctx)
            if not v.passed:
                break
        return v

    def _first_fails(self, job: QueuedJob, skey: tuple) -> dict[str, Verdict]:
        """Per filter keys, the clusters some filter fails and the first such filter's verdict.
        Each filter is checked once per cluster and what it reads of a job
        (:func:`~.filters.filter_key_functions`): jobs that agree on that share its verdicts."""
        got = self.first_fails.get(skey)
        if got is None:
            got = self.first_fails[skey] = {}
            for k, flt in enumerate(self.policy.filters):
                key = (k, self.filter_keys[k](job))
                fails = self.filter_fails.get(key)
                if fails is None:
                    fails = self.filter_fails[key] = {}
                    for cluster in self.clusters:
                        v = flt.check(job, cluster, self.ctx)
                        if not v.passed:
                            fails[cluster.name] = v
                for name, v in fails.items():
                    if name not in got:  # an earlier filter's failure comes first
                        got[name] = v
        return got


def decide(view: View, queue: Iterable[QueuedJob], policy: Policy, *, cache: bool = True,
           stats: dict[str, int] | None = None) -> Decisions:
    """Place what can be placed now; preempt or reserve for blocked jobs; explain the rest.

    Args:
        view: the federation snapshot.
        queue: waiting jobs (any order).
        policy: filters, scorers, weights and queueing/preemption parameters.
        cache: share verdicts between jobs within the call (module docstring, "Caches"). False
            computes every verdict afresh: slower, and the same decisions (the property test of
            the caches uses it; nothing else should).
        stats: if given, filled with the cycle's work on (cluster, request shape) pairs:
            ``checks`` (capacity checks of a shape on a cluster: once per shape and cluster, and
            again only after that cluster's allocation changed), ``fits`` (gang fits computed;
            a fit is shared by the jobs of one whole request shape until the cluster changes),
            ``changes`` (allocation changes: placements and evictions), ``jobs``, ``sets``
            (candidate sets built: once per split and CPU and memory request, again only after
            the split's viable clusters or that request's failed fits changed), ``shared``
            (pending jobs given the verdicts of an earlier job that agrees on everything they
            read, :meth:`_Cycle.memo_key`, instead of a search).

    Returns:
        Placements in decision order (with their victims, if any), pending jobs with reasons,
        and the reservations held.
    """
    cy = _Cycle(view, policy, cache)
    order = FairOrder(queue, view, policy)
    placements: list[Placement] = []
    pending: list[Pending] = []
    now = view.now

    figures = cy.ctx.memo
    for job in order:                                                               # 1
        figures.clear()  # per-job figures only (:class:`~.filters.Context`): the last job's are done
        skey = cy.static_key(job)
        eligible, evaluations, static_ok = cy.eligible(job, skey)                  # 2
        memo_key = cy.memo_key(job, skey)
        memo = cy.pending_memo.get(memo_key) if cy.caching else None
        if memo is not None:  # same request shape, same state: the same verdicts, shared
            pending.append(Pending(job, memo[0], memo[1], memo[2], queue_of(job, policy.fast_lane_s)))
            cy.shared += 1
            continue
        split = cy.split(job, skey, eligible)
        evaluations.extend(split.misfits)  # clusters it surely does not fit now: shared verdicts
        failed = split.failed_for(job)  # and those where the same whole request did not fit
        viable = split.viable
        # clusters taken out for this job, in cluster order: avoided (an earlier attempt failed
        # there) or held by a reservation it is not estimated to end before
        out: tuple[str, ...] = ()
        if job.avoid_clusters or cy.reservations:
            end = _est_end(job, now)
            taken = {n for n in job.avoid_clusters if n in viable}
            taken.update(n for n, r in cy.reservations.items() if end > r.start_at and n in viable)
            out = tuple(sorted(taken, key=cy.position.__getitem__))
        # the candidates and what jobs of this request learnt of them, shared until they change:
        # viable clusters where an earlier job's identical request did not fit are not fitted
        # again ("ghosts"), but still part of the cost reference, as they are when nothing is
        # cached (there they fail only in the branch and bound, after the reference is set)
        cset = split.candidate_set(job, out, cy)
        failed_evals = cset.failed_evals
        evaluations.extend(failed_evals)
        shared_len = len(evaluations)
        avoided = []
        for name in out:
            if name in failed:
                continue
            cand = viable[name]
            cluster = cand.cluster
            res = cy.reservations.get(name)
            if res is not None and _est_end(job, now) <= res.start_at:
                res = None  # it ends before the reservation starts: backfill
            if cy.fit(job, cand)[0] is None:
                # "avoided" and "reserved" only where it would fit: else the verdict is the misfit
                # (what the split learns from other jobs, so it does not depend on the caches)
                evaluations.append(split.fail(job, name, ClusterEvaluation(
                    name, cluster.region, _insufficient(job, cand.work, cand.models))))
                continue
            if name in job.avoid_clusters:
                evaluations.append(ClusterEvaluation(name, cluster.region,
                                                     fail(Reason.AVOIDED, "an earlier attempt failed here")))
                avoided.append(cand)
                continue
            evaluations.append(ClusterEvaluation(name, cluster.region, fail(
                Reason.RESERVED, f"held for {res.job_key} from ~{(res.start_at - now) / 60:.0f} min; "
                                 f"this job is not estimated to end before")))
        home_first = job.spec.locality == Locality.PREFER_LOCAL
        # a job whose tenant must ask before going abroad runs at home whenever home can take it
        # now: an approver is asked only when going abroad is the alternative to waiting
        ask_first = job.cross_region == "approval"
        groups = ([cset.group(job.spec.home_region, True), cset.group(job.spec.home_region, False)]
                  if home_first or ask_first else [cset.group(None)])
        best = None
        passed: list[ClusterEvaluation] = []  # the clusters that fit and were scored
        for g, group in enumerate(groups):
            best = _branch_and_bound(job, group, cy, evaluations, split, passed)  # 3
            if best is not None:
                for later in groups[g + 1:]:  # abroad, not tried: every cluster still gets a verdict
                    evaluations.extend(later.home_first(cy))
                break
        if best is None and avoided:  # failover found nowhere else: the failed cluster beats waiting
            retry = [c for c in avoided if c.cluster.name not in cy.reservations]
            best = _branch_and_bound(job, _Group(retry, [], cy.position), cy, evaluations, split, passed)

        if best is not None:
            cluster, fit, wc, terms, total = best.cluster, best.fit, best.work, best.terms, best.total
            if (home_first and cluster.region != job.spec.home_region and policy.prefer_local_max_wait_s > 0):
                # data follows or job follows: wait for home only while that is no slower than
                # moving the data abroad (plus a little slack), and never longer than the cap
                limit = min(policy.prefer_local_max_wait_s,
                            transfer_seconds(job, cluster, cy.ctx) + policy.prefer_local_slack_s)
                limit -= now - job.submitted_at  # the limit is on the whole wait, not per cycle
                start = _home_start(job, cy, static_ok, limit)
                if start is not None:
                    evaluations.append(ClusterEvaluation(job.spec.home_region, job.spec.home_region, fail(
                        Reason.WAIT_FOR_HOME, f"home region frees up in ~{(start - now) / 60:.0f} min, no later "
                                              f"than moving the data to {cluster.name} would start it")))
                    pending.append(Pending(job, f"prefer_local: waiting for {job.spec.home_region}, est. start in "
                                                f"{(start - now) / 60:.0f} min", tuple(evaluations), True,
                                           queue_of(job, policy.fast_lane_s)))
                    continue
            wc.commit(fit)
            cy.record(job, cluster, fit, ())
            placements.append(_placement(job, cluster, fit, total, terms, evaluations, cy, (), passed))
            order.placed(job)
            continue

        if policy.preemption and (job.spec.priority_value >= policy.preempt_min_priority  # 4
                                  or (view.quota is not None and policy.reclaim_within_cohort != "never")):
            eviction = _preempt(job, cy, static_ok, skey)
            if eviction is not None:
                cluster = cy.by_name[eviction.cluster]
                wc = cy.wc(cluster)
                for w in eviction.victims:
                    wc.release_work(w)
                    cy.victims.add((w.job_id, w.attempt, w.shard))
                cy.epoch += 1  # capacity came back: cached misfits are stale
                wc.commit(eviction.fit)
                cy.record(job, cluster, eviction.fit, eviction.victims)
                evaluations.append(ClusterEvaluation(cluster.name, cluster.region, PASS,
                                                     (("preemption_cost_gpu_s", round(eviction.cost, 1)),), 0.0))
                placements.append(_placement(job, cluster, eviction.fit, 0.0, (), evaluations, cy, eviction.victims))
                order.placed(job)
                continue

        reservation = None
        if (policy.backfill and len(cy.reservations) < policy.reservations and cy.reserve_tries < 4 * policy.reservations
                and now - job.submitted_at >= policy.reserve_after_s):
            cy.reserve_tries += 1
            reservation = _reserve(job, cy, static_ok, skey)
        # reasons counted in the order first met: the filters', the split's misfits', the failed
        # fits', then this job's own verdicts (what adding Counters in that order gives)
        tally = dict(cy.static_counts[skey])
        for r, n in split.counts.items():
            tally[r] = tally.get(r, 0) + n
        for e in failed_evals:
            r = e.verdict.reason
            tally[r] = tally.get(r, 0) + 1
        for k in range(shared_len, len(evaluations)):
            v = evaluations[k].verdict
            if not v.passed:
                tally[v.reason] = tally.get(v.reason, 0) + 1
        reason = summarise_counts(Counter(tally))
        if reservation is not None:
            reason = (f"reserved {reservation.cluster} from ~{(reservation.start_at - now) / 60:.0f} min "
                      f"(est.); {reason}")
        fits_empty = cy.fits_empty(job, skey, static_ok)
        frozen = tuple(evaluations)
        if reservation is None and cy.reservations_full() and cy.caching:
            cy.pending_memo[memo_key] = (reason, frozen, fits_empty)
        pending.append(Pending(job, reason, frozen, fits_empty, queue_of(job, policy.fast_lane_s), reservation))   # 5

    if stats is not None:
        stats.update(checks=cy.checks, fits=cy.fits, changes=cy.changes, jobs=len(placements) + len(pending),
                     sets=cy.sets_built, shared=cy.shared)
    return Decisions(tuple(placements), tuple(pending), policy.version, tuple(cy.reservations.values()))


class Candidate(NamedTuple):
    """A cluster a job's GPU shape may fit this cycle: the cluster, its working state, the card
    models the job may use there (cheapest first), the request's shape key, the cheapest
    model and its list price there (``price_key``: what a ``region_price`` bound reads besides
    the region) and the unit price the cost reference compares (currency per GPU-hour of the
    cheapest model; CPU-only: per core-hour)."""

    cluster: ClusterState
    work: WorkingCluster
    models: list[str]
    shape: tuple
    price_key: tuple = ("", None)
    unit: float = 0.0
    #: memo of what reads the cluster and the GPU shape (shared by every candidate of that pair
    #: this cycle), each with what it holds for: ``"could"`` -> capacity check (:func:`_could`),
    #: ``"misfit"`` -> (cluster version, the "does not fit" verdict), ``("fit", CPU, memory)``
    #: -> (pool, its change count, capacity returns, fit, fit-only scores; :meth:`_Cycle.fit`),
    #: scorer index -> (cluster version, ``cluster_shape`` bound)
    slot: dict | None = None


class ScorerScope(NamedTuple):
    """A weighted scorer of the policy and how far its upper bound is shared (``bound_scope``):
    ``const`` (every cluster), ``region``, ``region_price`` (a region and its cheapest model's
    price), ``cluster_shape`` (a cluster and the request shape) or ``cluster``."""

    index: int
    scorer: object
    weight: float
    scope: str


class Best(NamedTuple):
    """The best fit found so far: where, the fit, the working cluster, the score terms and the
    weighted total."""

    cluster: ClusterState
    fit: Fit
    work: WorkingCluster
    terms: tuple
    total: float

    def beaten_by(self, total: float, name: str) -> bool:
        """Whether a fit scoring ``total`` on cluster ``name`` is better (ties: lower name)."""
        return total > self.total or (total == self.total and name < self.cluster.name)


class _Bounds:
    """Upper bounds of a job's score terms on its candidates, each computed once per the extent
    its scorer declares (:class:`ScorerScope`); cluster-and-shape bounds live in the
    candidates' slots (memoised until the cluster's allocation changes)."""

    def __init__(self, job: QueuedJob, cy: "_Cycle") -> None:
        self.job, self.cy = job, cy
        self.shared: dict[int, float] = {}  # const scopes' values
        self.scores: dict[tuple, tuple] = {}  # region-wide (score, term) of this search (:func:`_score`)
        self.columns: list = []  # per scope, its bounds of the search (:meth:`order`)
        self.index: dict[str, int] = {}  # region -> its place in the columns
        self.slices: list[tuple[int, int]] = []  # region -> its price representatives' place
        self.units: list[float] = []  # the price representatives' unit prices
        self.at_price: dict[tuple[int, float], int] = {}  # (region index, unit price) -> its first representative
        self.plans: dict[str, tuple[float, list]] = {}  # region -> plan

    def order(self, group: _Group) -> list[tuple[float, str]]:
        """The group's regions as (-bound, region), best first (ties by name): a region's bound
        is an upper bound of the total score on any of its candidates -- its shared terms, the
        best price term of its clusters and 1 for every cluster-specific term, weighted and
        summed in the policy's scorer order, rounded to 9 places. A scorer's bounds on all the
        regions (their first candidates; for a ``region_price`` bound every price
        representative) are asked at once and kept for :meth:`plan`."""
        job, cy = self.job, self.cy
        ctx, shared = cy.ctx, self.shared
        names, index, firsts, places, slices, units, at_price = group.search_places()
        bounds = [0.0] * len(names)  # each region's summed in scope order
        columns = []  # per scope: its value (const) or values per region (region), its bounds on the places
        for (kind, s), many in zip(cy.bound_kinds, cy.bound_many):
            w = s.weight
            if kind == 1 or kind == 2:
                asked = firsts if kind == 1 else places
                got = (many(job, asked, ctx) if many is not None else
                       [s.scorer.bound(job, cluster, work, ctx, models) for cluster, work, models in asked])
                best = got if kind == 1 else [max(got[a:b]) for a, b in slices]  # (max: the first highest)
                bounds = [b + w * v for b, v in zip(bounds, best)]
            elif kind == 0:
                value = shared.get(s.index)
                if value is None:
                    cluster, work, models = firsts[0]
                    value = shared[s.index] = s.scorer.bound(job, cluster, work, ctx, models)
                got = value
                bounds = [b + w * value for b in bounds]
            else:  # cluster, cluster_shape: at most 1
                got = None
                bounds = [b + w for b in bounds]
            columns.append(got)
        self.columns, self.index, self.slices, self.units, self.at_price = columns, index, slices, units, at_price
        out = [(-round(b, 9), r) for b, r in zip(bounds, names)]
        out.sort()
        return out

    def region_terms(self, region: str, price: float, score: Callable[[Any], float]) -> tuple:
        """The values, in scorer order, of the region scorers on a fit in ``region`` paying
        ``price``, which are their bounds there (:attr:`_Cycle.scores_from_bounds`): a
        ``region`` scorer's is the bound this search gave the region; a ``region_price``
        scorer's the bound at the price representative charging ``price``, or, when no
        representative charges it (the fit is not of the cheapest candidate model, or the
        price is NaN), ``score(scorer)`` -- the scorer's score of the fit."""
        i = self.index[region]
        k = self.at_price.get((i, price)) if price == price else None  # (a NaN charges nothing)
        cy = self.cy
        at = cy.score_parts
        return tuple(column[i] if kind == 1 else column[k] if k is not None else score(s.scorer)
                     for (kind, s), column in zip(cy.bound_kinds[:at], self.columns[:at]))

    def plan(self, group: _Group, region: str) -> tuple[float, list]:
        """The job's sum of the terms one value holds for the whole region (``const``,
        ``region``; in scope order) and, per varying scope in scope order, (kind, scope,
        weighted price bounds by price key): kind 0 = ``region_price``, 1 = ``cluster_shape``
        (memoised in the slots), 2 = computed per cluster."""
        got = self.plans.get(region)
        if got is None:
            cy = self.cy
            i = self.index[region]
            same = sum([s.weight * (column if kind == 0 else column[i])
                        for (kind, s), column in zip(cy.bound_kinds, self.columns) if kind <= 1])
            first = self.slices[i][0]
            plan = []
            for (kind, s), column in zip(cy.bound_kinds, self.columns):
                if kind == 2:
                    plan.append((0, s, {c.price_key: s.weight * column[first + k]
                                        for k, c in enumerate(group.reps[region])}))
                elif kind == 3:
                    plan.append((1 if s.scope == "cluster_shape" and cy.caching else 2, s, None))
            got = self.plans[region] = (same, plan)
        return got

    def shape_terms(self, group: _Group, region: str) -> tuple[float, float, float, list]:
        """For a region whose candidates share one cheapest-model price and whose only other
        varying bound is the one cluster-and-shape bound (:class:`_Ranking`): (the region-wide
        sum, the varying terms summed before that bound's, its weight, the terms after it), so
        a candidate's bound is ``round(same + (((before + weight * b) + after[0]) + ...), 9)``
        -- the terms of :meth:`ranked`, added in the same order."""
        same, plan = self.plan(group, region)
        price_key = group.reps[region][0].price_key
        before, weight, after = 0, None, []
        for kind, s, weighted in plan:
            if kind == 1:
                weight = s.weight
            elif weight is None:
                before += weighted[price_key]
            else:
                after.append(weighted[price_key])
        return same, before, weight, after

    def ranked(self, group: _Group, region: str) -> list[tuple[float, str, Candidate]]:
        """A region's candidates in ``group`` as (bound, name, candidate), best bound first
        (ties by name); the terms shared by the whole region are computed once."""
        cy = self.cy
        same, plan = self.plan(group, region)
        # each candidate's varying terms summed in scope order, one scope at a time (as
        # ``t = 0; t += term`` per candidate would)
        cands = group.regions[region]
        job, ctx = self.job, cy.ctx
        sums: list = [0] * len(cands)
        for kind, s, weighted in plan:
            if kind == 0:
                terms = [weighted[c.price_key] for c in cands]
            elif kind == 1:  # memoised until the cluster's allocation changes
                w = s.weight
                terms = [w * cy.shape_bound(s, job, c) for c in cands]
            else:
                w, bound = s.weight, s.scorer.bound
                terms = [w * bound(job, c.cluster, c.work, ctx, c.models) for c in cands]
            sums = [t + term for t, term in zip(sums, terms)]
        out = [(round(same + t, 9), c.cluster.name, c) for t, c in zip(sums, cands)]
        out.sort(key=_by_bound)
        return out


def _could(wc: WorkingCluster, witness: str | None) -> tuple:
    """A capacity check's answer as kept in a slot: (True, the pool that admits the shape, its
    change count) or (False, the cluster's count of capacity given back)."""
    if witness is None:
        return (False, wc.returns)
    return (True, witness, wc.changes.get(witness, 0))


def _could_holds(held: tuple, wc: WorkingCluster) -> bool:
    """Whether a kept capacity check (:func:`_could`) still holds on ``wc``."""
    if held[0]:
        return wc.changes.get(held[1], 0) == held[2]
    return wc.returns == held[1]


def _by_bound(r: tuple) -> tuple:
    return -r[0], r[1]


def _score(job: QueuedJob, c: Candidate, fit: Fit, cy: "_Cycle", shared: dict[int, tuple],
           bounds: "_Bounds") -> tuple[tuple, float]:
    """(terms, weighted total) of a fit: terms as (scorer name, value) rounded to 4 places.
    ``shared`` holds the (value, term) of the fit-only scorers already computed for this fit
    (by scorer index, :meth:`_Cycle.fit`); new ones are added to it. ``memo``: the (value,
    term) of the scorers whose score reads only the job and the region (``score_scope =
    "region"``, by scorer index and region) or also the unit price the fit pays
    (``"region_price"``, by scorer index, region and that price) already computed in this
    search (``bounds.scores``). Evaluations that share a value share its term. With the region
    scorers first and the fit scorers last (:attr:`_Cycle.score_parts`), each part's (values,
    terms) is kept whole instead: in ``bounds.scores`` by (region, unit price), in ``shared``
    under -1; the region values are the search's bounds where its scorers say they agree
    (:attr:`_Cycle.scores_from_bounds`)."""
    cluster, work, ctx = c.cluster, c.work, cy.ctx
    memo = bounds.scores
    at = cy.score_parts
    if at is not None:  # (region terms, fit terms): each part computed once and shared
        price = (cluster.prices.get(fit.card_model, 0.0) if job.spec.gpus_per_worker
                 else cluster.cpu_price_per_core_hour)
        key = (cluster.region, price)
        region_part = memo.get(key)
        if region_part is None:
            if cy.scores_from_bounds:
                values = bounds.region_terms(cluster.region, price, lambda sc: sc.score(job, cluster, fit, work, ctx))
            else:
                values = tuple(sc.score(job, cluster, fit, work, ctx) for _, sc, _, _, _ in cy.scoring[:at])
            region_part = memo[key] = (values, cy.term_tuple(cy.score_names, values),
                                       _float_sum([w * v for w, v in zip(cy.score_weights, values)]))
        fit_part = shared.get(-1)
        if fit_part is None:
            fit_scorers, fit_weights, fit_names = cy.fit_scoring
            values = tuple([sc.score(job, cluster, fit, work, ctx) for sc in fit_scorers])
            weighted = [w * v for w, v in zip(fit_weights, values)]
            fit_part = shared[-1] = (values, cy.term_tuple(fit_names, values),
                                     weighted if all(type(t) is float for t in weighted) else None)
        partial, weighted = region_part[2], fit_part[2]
        if partial is not None and weighted is not None:  # the sum below, region terms added first
            for t in weighted:
                partial += t
            return region_part[1] + fit_part[1], round(partial, 4)
        values = region_part[0] + fit_part[0]
        return region_part[1] + fit_part[1], round(sum([w * v for w, v in zip(cy.score_weights, values)]), 4)
    terms = []
    weighted = []
    for i, sc, w, name, scope in cy.scoring:
        if scope == "job":
            v = sc.score(job, cluster, fit, work, ctx)
            terms.append((name, round(v, 4)))
        else:
            if scope == "fit":
                held, key = shared.get(i), i
            else:
                key = ((i, cluster.region) if scope == "region" else
                       (i, cluster.region, cluster.prices.get(fit.card_model, 0.0) if job.spec.gpus_per_worker
                        else cluster.cpu_price_per_core_hour))
                held = memo.get(key)
            if held is None:
                v = sc.score(job, cluster, fit, work, ctx)
                held = (shared if scope == "fit" else memo)[key] = (v, (name, round(v, 4)))
            v = held[0]
            terms.append(held[1])
        weighted.append(w * v)
    return tuple(terms), round(sum(weighted), 4)


def _float_sum(terms: list) -> float | None:
    """``sum(terms)`` as :func:`sum` adds floats -- ``0 + terms[0]``, then each further term in
    turn -- so more float terms added to it one by one give ``sum`` of them all, bit for bit;
    None unless there are terms and every one is a float (``sum`` adds ints exactly first,
    and of no terms is the int 0)."""
    if not terms or not all(type(t) is float for t in terms):
        return None
    total = 0.0
    for t in terms:
        total += t
    return total


def _reserved(cy: "_Cycle", job: QueuedJob, name: str, now: float) -> bool:
    """Whether cluster ``name`` is held by a reservation this job does not end before."""
    res = cy.reservations.get(name)
    return res is not None and _est_end(job, now) > res.start_at


def _branch_and_bound(job: QueuedJob, group: _Group, cy: "_Cycle", evaluations: list[ClusterEvaluation],
                      split: "_Split", passed: list[ClusterEvaluation]) -> Best | None:
    """The best-scoring fit among the ``group``'s candidates, fitting only those whose score
    bound could still beat the best found (exact, up to ``policy.max_scored_fits``: the same
    choice as fitting and scoring all of them; ``tests/unit/scheduler/test_policy.py`` checks
    it).

    The cost scale is set first: the cheapest cost per GPU-hour among the candidates and the
    group's ghosts (clusters known not to fit this request this cycle, not fitted, which still
    count, so the reference does not depend on what the cycle cached); within a region the
    egress is the same, so cost rises with the unit price: one look per region, at its
    lowest-priced candidate (:class:`_Group`), gives the same minimum as one per candidate.

    Bounds come in two levels (:class:`_Bounds`): a region's and a cluster's; a region that
    cannot beat the best found is never expanded (its verdicts are the group's shared
    "outscored" ones). Bounds are compared rounded as the totals are (4 places): a bound a
    hair below the best's rounded total may still round to a tie that the lower name wins.
    Appends a verdict per candidate to ``evaluations`` (and the passing ones,
    fitted and scored, to ``passed`` too); returns the best fit or None.
    """
    if not group.cands:
        return None
    ctx = cy.ctx
    set_cost_reference(job, min(costs_per_unit_hour(job, group.lowest, ctx)), ctx)
    bounds = _Bounds(job, cy)
    regions = bounds.order(group)
    best: Best | None = None
    scored = 0
    limit = cy.policy.max_scored_fits
    for neg_bound, region in regions:
        capped = bool(limit and scored >= limit)
        if best is not None and (best.total > round(-neg_bound, 4) or capped):
            evaluations.extend(group.outscore(cy, region, not capped))
            continue
        ranking = group.ranking(region, cy, job)
        # (bound, name, candidate) best first; kept in order, a candidate's bound is computed
        # only when the search reaches it (a fit failing below changes the order only when the
        # group is next used: :meth:`_Split.candidate_set`)
        if ranking is not None:
            ranked = ranking.order
            same, before, weight, after = bounds.shape_terms(group, region)
        else:
            ranked = bounds.ranked(group, region)
        for k, (bound, name, c) in enumerate(ranked):
            if ranking is not None:  # (bound: minus the cluster-and-shape bound)
                t = before + weight * -bound
                for term in after:
                    t += term
                bound = round(same + t, 9)
            capped = bool(limit and scored >= limit)
            if best is not None:
                # totals are rounded to 4 places: a fit here scores at most the bound so rounded
                # (rounding is monotone), and ties go to the lower name
                reach = round(bound, 4)
                if reach < best.total or capped:
                    if ranking is not None and not capped:
                        evaluations.extend(ranking.tail[k:])  # (the same verdicts, kept in the order's order)
                    else:
                        _outscore(cy, [r[2].cluster for r in ranked[k:]], evaluations, exact=not capped)
                    break
                if reach == best.total and name > best.cluster.name:
                    # at most a tie it would lose; the next (lower bound, any name) may still tie and win
                    evaluations.append(ranking.tail[k] if ranking is not None
                                       else cy.outscored_verdict(c.cluster, True))
                    continue
            fit, shared = cy.fit(job, c)
            if fit is None:
                evaluations.append(split.fail(job, name, ClusterEvaluation(name, c.cluster.region,
                                                                           _insufficient(job, c.work, c.models))))
                continue
            terms, total = _score(job, c, fit, cy, shared, bounds)
            e = ClusterEvaluation(name, c.cluster.region, PASS, terms, total)
            evaluations.append(e)
            passed.append(e)
            scored += 1
            if best is None or best.beaten_by(total, name):
                best = Best(c.cluster, fit, c.work, terms, total)
    return best


#: a cluster abroad not fitted because the home region takes the job now (prefer_local, or a
#: tenant that asks before going abroad): outscored by the home placement
_HOME_FIRST = fail(Reason.OUTSCORED, "passes the filters; not fitted: the home region can take the job now, "
                                     "and home goes first (locality prefer_local or cross-region approval)")
_OUTSCORED = fail(Reason.OUTSCORED, "passes the filters, but even its best possible score is below the "
                                    "chosen cluster's (see the placement)")
_NOT_SCORED = fail(Reason.OUTSCORED, "passes the filters; not fitted: enough higher-ranked clusters were scored "
                                     "(policy max_scored_fits)")


def _outscore(cy: "_Cycle", clusters: list[ClusterState], evaluations: list[ClusterEvaluation], *,
              exact: bool = True) -> None:
    for c in clusters:
        evaluations.append(cy.outscored_verdict(c, exact))


def _start(job: QueuedJob, cy: _Cycle, cluster: ClusterState) -> float | None:
    """The job's estimated start on ``cluster`` (:func:`~.preempt.estimated_start`; None if
    never), memoised per whole request shape until the cluster's allocation changes (it reads
    the shape, the cluster's allocation and its timeline, which change together)."""
    models = cy.models(job, cluster)
    return cy.cached("start", cluster, _full_shape(job, models), lambda: estimated_start(
        job.spec, models, cluster, cy.wc(cluster), cy.view.now, cy.timeline(cluster)))


def _home_start(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState], limit: float) -> float | None:
    """Earliest estimated start in the job's home region if it is at most ``limit`` seconds from
    now (``start - now <= limit``), else None: work ending later is never released (the caller
    only waits for home within the limit, so the answer is the same as a full search's)."""
    if limit < 0:
        return None  # a start is never before now
    best = None
    now = cy.view.now
    for cluster in static_ok:
        if cluster.region != job.spec.home_region:
            continue
        models = cy.models(job, cluster)
        key = ("start within", cluster.name, cy.cluster_version.get(cluster.name, 0), _full_shape(job, models))
        held = cy.value_cache.get(key) if cy.caching else None
        # held: (start, limit it was searched with); inf = not within that limit
        if held is None or (held[0] == math.inf and held[1] < limit):
            start = estimated_start(job.spec, models, cluster, cy.wc(cluster), now, cy.timeline(cluster),
                                    within=limit)
            held = (start, limit)
            if cy.caching:
                cy.value_cache[key] = held
        start = held[0]
        if start is not None and start - now <= limit and (best is None or start < best):
            best = start
    return best


def _preempt(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState], skey: tuple) -> Eviction | None:
    """The cheapest eviction over ``static_ok`` by the preemption rules (:mod:`.preempt`):
    without quotas, lower-priority preemptible work; with quotas, rules (a), (b), (c) and (0),
    also on clusters where only the job's quota -- which evictions of its tenant's work give
    back -- blocks it."""
    best = None
    prio = job.spec.priority_value
    book = cy.view.quota
    if book is None and cy.least_victim >= prio:
        return None  # nothing preemptible of lower priority runs anywhere
    policy = cy.policy
    for cluster in static_ok:
        if book is None:
            if cy.lowest_victim.get(cluster.name, prio) >= prio:
                continue  # nothing preemptible of lower priority runs there
        elif not cy.may_evict_there(job, cluster, prio >= policy.preempt_min_priority):
            continue  # no work there any rule lets this job evict
        verdict = cy.static_verdict(job, skey, cluster)
        if not verdict.passed and not (verdict.reason == Reason.QUOTA and cy.passes_but_quota(job, skey, cluster)):
            continue
        if cluster.name in job.avoid_clusters or cluster.name in cy.reservations:
            continue
        if book is None:
            ev = find_victims(job.spec, cy.models(job, cluster), cluster, cy.wc(cluster), cy.view.now,
                              policy.checkpoint_interval_s, cy.victims | cy.placed_keys, cy.timeline(cluster))
        else:
            models = cy.models(job, cluster)
            by_priority = prio >= policy.preempt_min_priority
            # the plan reads the cluster's work and allocation (its version, the epoch of
            # evictions), the tenant, priority, card models and the whole request
            ev = cy.cached("evict", cluster, (cy.epoch, job.spec.tenant, prio, by_priority, _full_shape(job, models)),
                           lambda: quota_victims(
                               job.spec, models, cluster, cy.wc(cluster), cy.view.now, policy.checkpoint_interval_s,
                               cy.victims | cy.placed_keys, cy.timeline(cluster), book, by_priority=by_priority,
                               reclaim=policy.reclaim_within_cohort, borrow=policy.borrow_within_cohort,
                               covers=cy.covers, pools=cy.pools, epoch=cy.epoch))
        if ev is not None and (best is None or (ev.cost, len(ev.victims), ev.cluster) < (best.cost, len(best.victims),
                                                                                          best.cluster)):
            best = ev
    return best


def _reserve(job: QueuedJob, cy: _Cycle, static_ok: list[ClusterState], skey: tuple) -> Reservation | None:
    best: tuple[float, str] | None = None
    for cluster in static_ok:
        if cluster.name in cy.reservations or cluster.name in job.avoid_clusters:
            continue
        if not cy.static_verdict(job, skey, cluster).passed:
            continue
        start = _start(job, cy, cluster)
        if start is not None and (best is None or (start, cluster.name) < best):
            best = (start, cluster.name)
    if best is None:
        return None
    res = Reservation(job.key, best[1], best[0], cy.placed)
    cy.reservations[best[1]] = res
    cy.version += 1
    return res


def _fits_somewhere_empty(job: QueuedJob, clusters: list[ClusterState], cy: _Cycle) -> bool:
    for cluster in clusters:
        wc = cy.empty.get(cluster.name)
        if wc is None:
            wc = cy.empty[cluster.name] = WorkingCluster(cluster, empty=True)
        if wc.fit(job.spec, cy.models(job, cluster)) is not None:
            return True
    return False


def _placement(job: QueuedJob, cluster: ClusterState, fit: Fit, total: float, terms: tuple,
               evaluations: list[ClusterEvaluation], cy: _Cycle, victims: tuple[RunningWork, ...],
               scored: list[ClusterEvaluation] | None = None) -> Placement:
    """The placement of ``job`` on ``cluster`` with its one-line explanation. ``scored``: the
    evaluations that passed, if the caller kept them (else they are looked up in
    ``evaluations``)."""
    bindings = tuple(NodeBinding(b.worker, cluster.nodes[b.node].name, b.devices, b.gpu_milli, b.cpu_milli,
                                 b.memory_mib) for b in fit.bindings)
    if scored is None:
        scored = [e for e in evaluations if e.verdict.passed]
    # the other scored clusters, and the first of the highest-scoring among them (the runner-up)
    others, runner = 0, None
    name = cluster.name
    for e in scored:
        if e.total is not None and e.cluster != name:
            others += 1
            if runner is None or e.total > runner.total:
                runner = e
    excluded = len(evaluations) - len(scored)
    if victims:
        explanation = (f"{cluster.name} ({cluster.region}) after preempting {len(victims)} lower-priority job(s) "
                       f"({', '.join(v.job_id for v in victims[:3])}{'...' if len(victims) > 3 else ''}); "
                       f"no cluster had room; {excluded} not chosen (see each verdict)")
    else:
        explanation = (f"{cluster.name} ({cluster.region}) scored {total:.3f} ["
                       + ", ".join(f"{n} {v:.2f}" for n, v in terms) + f"]; {others + 1} cluster(s) fit, "
                       f"{excluded} not chosen (see each verdict)"
                       + (f"; runner-up {runner.cluster} {runner.total:.3f}" if runner else ""))
    return Placement(
        job=job, cluster=cluster.name, region=cluster.region, zone=cluster.zone, card_model=fit.card_model,
        bindings=bindings, score=total, evaluations=tuple(evaluations),
        cross_region=cluster.region != job.spec.home_region,
        transfer_s=transfer_seconds(job, cluster, cy.ctx), transfer_bytes=remote_bytes(job, cluster, cy.ctx),
        price_per_gpu_hour=cluster.prices.get(fit.card_model, 0.0),
        est_cost=round(estimated_cost(job, cluster, fit.card_model, cy.ctx), 6),
        queue=queue_of(job, cy.policy.fast_lane_s), victims=victims, explanation=explanation,
    )
