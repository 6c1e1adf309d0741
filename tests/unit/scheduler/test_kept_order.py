"""What a cycle keeps in step as it allocates decides what building it afresh would decide.

* kept candidate sets and groups (:class:`~services.scheduler.core.decide._CandidateSet`): a
  cluster leaving a split's viable clusters, or a request's whole fit failing there, is brought
  into the sets and their groups when they are next used -- ``decide`` gives the same
  decisions, every verdict in the same order, as when each job gets a set built afresh from its
  split;
* kept region rankings (:class:`~services.scheduler.core.decide._Ranking`): a region's
  candidates kept in order of the packing bound give the same decisions, every verdict in the
  same order, as ranking each job's bounds on them afresh (``_Bounds.ranked``), including
  where different bounds lie within the rounding margin;
* a scorer's bounds on many places at once (``bounds``) equal its bounds one by one, and a
  scored fit's region terms read from the search's bounds (``score_is_bound``) decide as
  scores computed;
* per-pool memos (:attr:`~services.scheduler.core.fit.WorkingCluster.changes`,
  :attr:`~services.scheduler.core.fit.WorkingCluster.returns`): a fit, or a capacity check's
  answer, held while its pool's change count (and the count of capacity given back) stands
  equals a fit or check made afresh, through commits, releases and released work.
"""

from __future__ import annotations

import importlib
import math
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsched.jobs import Dataset, JobSpec, Locality
from services.scheduler.core import ClusterState, NodeState, QueuedJob, RunningWork, View, build_policy, decide
from services.scheduler.core.filters import Context
from services.scheduler.core.fit import WorkingCluster
from services.scheduler.core.scorers import Cost, HomeRegion, StartTime, set_cost_reference

decide_module = importlib.import_module("services.scheduler.core.decide")  # (the package exports decide())

T4, V100, G2 = "nvidia-t4-16gb", "nvidia-v100-32gb", "alibaba-g2"
MEM = {T4: 16, V100: 32, G2: 24}
REGIONS = ("cn-north-1", "cn-east-1", "us-east-1")
NOW = 1.7e9


# The strategies federation() draws from, made once: a strategy built inside the composite is
# built, validated and labelled again at every draw (that was ~70% of these tests' time); the
# same strategies in the same order draw the same examples.
_PRICE = st.sampled_from((2.0, 3.0, 3.0, 5.5))
_N_CLUSTERS = st.integers(3, 9)
_REGION = st.sampled_from(REGIONS)
_MODELS = st.sampled_from(((T4,), (V100,), (T4, V100), (T4, G2)))
_N_NODES = st.integers(1, 4)
_GPUS = st.sampled_from((1, 2, 4))
_USED = st.sampled_from((0, 0, 250, 500, 1000))
_ENDS_IN = st.sampled_from((300, 7200, math.inf))
_CPU = st.sampled_from((64000, 64000, 3000))
_MARKUP = st.sampled_from((0.0, 0.0, 0.25))
_SHAPES = st.lists(st.tuples(st.sampled_from((0, 1, 1, 1, 2)), st.sampled_from((250, 500, 1000)),
                             st.sampled_from((1, 1, 2)), st.sampled_from((1000, 2500, 8000)),
                             st.sampled_from(((), (), (T4,)))), min_size=1, max_size=4)
_N_JOBS = st.integers(10, 50)
_DATA = st.sampled_from((0, 10**9, 3 * 10**11))
_LOCALITY = st.sampled_from((Locality.GLOBAL, Locality.GLOBAL, Locality.PREFER_LOCAL))
_ESTIMATE = st.sampled_from((None, 600.0, 36000.0))
_WAITED = st.sampled_from((0, 600, 4000))


@st.composite
def federation(draw):
    """3-9 clusters over three regions, each with 1-4 nodes of 1-2 card models, cards partly
    used, some nodes short of CPU (whole fits fail where cards are left), list prices per region
    and model (one or several cheapest-model prices in a region); 10-50 jobs of a few request
    shapes, homes, data and estimates (the packing bound and the cost term order the clusters)."""
    prices = {(r, m): draw(_PRICE) for r in REGIONS for m in MEM}
    clusters = []
    for i in range(draw(_N_CLUSTERS)):
        region = draw(_REGION)
        models = draw(_MODELS)
        nodes, running = [], []
        for n in range(draw(_N_NODES)):
            model = models[n % len(models)]
            gpus = draw(_GPUS)
            free = [1000 - draw(_USED) for _ in range(gpus)]
            for d, f in enumerate(free):
                if f < 1000:
                    running.append(RunningWork(f"w{i}-{n}-{d}", 1, 0, "ads", 50, False, False, NOW - 600,
                                               NOW + draw(_ENDS_IN), model,
                                               ((n, (d,), 1000 - f, 1000, 1024),)))
            cpu = draw(_CPU)
            nodes.append(NodeState(f"c{i}-n{n}", model, MEM[model], tuple(free), cpu, 262144, 64000, 262144))
        clusters.append(ClusterState(f"c{i}", region, region + "a", tuple(nodes),
                                     prices={m: prices[(region, m)] + draw(_MARKUP) for m in models},
                                     running=tuple(running)))
    shapes = draw(_SHAPES)
    queue = []
    for k in range(draw(_N_JOBS)):
        g, m, w, c, models = draw(st.sampled_from(shapes))
        data = draw(_DATA)
        spec = JobSpec(tenant="search", project="p", home_region=draw(_REGION),
                       gpus_per_worker=g, gpu_milli=m if g == 1 else 1000, workers=w, cpu_milli=c,
                       card_models=models, locality=draw(_LOCALITY),
                       datasets=(Dataset(name=f"search/d{k}", home_region=draw(_REGION),
                                         size_bytes=data),) if data else (),
                       estimated_duration_s=draw(_ESTIMATE))
        queue.append(QueuedJob(f"j{k}", 1, spec, NOW - draw(_WAITED)))
    return View(tuple(clusters), NOW), queue


POLICIES = st.sampled_from(("federated", "federated", "cheapest", "least-loaded"))
SETTINGS = dict(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


def _fresh_sets(monkeypatch) -> None:
    """Every job gets a candidate set (and groups, rankings) built afresh from its split."""
    def candidate_set(self, job, out, cy):
        cy.sets_built += 1
        return decide_module._CandidateSet(self, self.failed_for(job), out, cy.position)

    monkeypatch.setattr(decide_module._Split, "candidate_set", candidate_set)


@settings(**SETTINGS)
@given(case=federation(), name=POLICIES)
def test_kept_candidate_sets_decide_as_sets_built_afresh_for_every_job(case, name):
    view, queue = case
    policy = build_policy(name)
    kept = decide(view, queue, policy)
    with pytest.MonkeyPatch.context() as mp:
        _fresh_sets(mp)
        fresh = decide(view, queue, policy)
    assert kept == fresh


@settings(**SETTINGS)
@given(case=federation(), name=POLICIES)
def test_kept_region_rankings_decide_as_ranking_every_job_afresh(case, name):
    view, queue = case
    policy = build_policy(name)
    kept = decide(view, queue, policy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decide_module._Group, "ranking", lambda self, region, cy, job: None)
        ranked = decide(view, queue, policy)
    assert kept == ranked


@settings(**SETTINGS)
@given(case=federation(), name=POLICIES)
def test_region_terms_read_from_a_searchs_bounds_decide_as_scores_computed(case, name):
    """``score_is_bound`` scorers (home, start, cost): a scored fit's region terms taken from
    the search's bounds give the same decisions, every verdict and term, as scoring it."""
    view, queue = case
    policy = build_policy(name)
    read = decide(view, queue, policy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decide_module._Bounds, "region_terms",  # every region term scored, none read
                   lambda self, region, price, score: tuple(score(s.scorer)
                                                            for _, s in self.cy.bound_kinds[:self.cy.score_parts]))
        scored = decide(view, queue, policy)
    assert read == scored


def test_bounds_within_the_rounding_margin_are_ranked_afresh(monkeypatch):
    """Two clusters whose packing bounds differ by less than the rounding can hide: the kept
    order is not used for their region (``exact`` False), and the decision is the one ranking
    each job's bounds gives (ties by name)."""
    def one(name: str, free: int) -> ClusterState:
        return ClusterState(name, REGIONS[0], REGIONS[0] + "a",
                            (NodeState(f"{name}-n0", T4, 16, (1000,) * 8, 64000, 262144, 64000, 262144),
                             NodeState(f"{name}-n1", T4, 16, (free,) + (0,) * 7, 64000, 262144, 64000, 262144)),
                            prices={T4: 3.0})

    # packing bounds 1 - (free - 250) / 16000 with 9,000 and 8,999 milli-GPUs free: 1/16,000 apart,
    # weighed 1e-5: ~6e-10, below the 4e-9 the rounding to 9 places can hide
    view = View((one("b", 1000), one("a", 999)), NOW)
    queue = [QueuedJob(f"j{k}", 1, JobSpec(tenant="search", project="p", home_region=REGIONS[0], gpus_per_worker=1,
                                           gpu_milli=250, cpu_milli=1000), NOW - k) for k in range(3)]
    policy = build_policy("federated", weights={"home": 0.1, "cost": 0.45, "packing": 1e-5})
    exact_seen = []
    ranking = decide_module._Group.ranking

    def watch(self, region, cy, job):
        got = ranking(self, region, cy, job)
        exact_seen.append(self.rankings[region].exact)
        return got

    monkeypatch.setattr(decide_module._Group, "ranking", watch)
    kept = decide(view, queue, policy)
    monkeypatch.setattr(decide_module._Group, "ranking", lambda self, region, cy, job: None)
    assert kept == decide(view, queue, policy)
    assert exact_seen and exact_seen[0] is False  # (the first placement moves the bounds apart)


@st.composite
def pool_and_steps(draw):
    """A cluster of 2-6 nodes of two card models and a sequence of allocation steps: commit a
    fit of one of a few shapes, release an earlier commit, or give back work that was running."""
    nodes, running = [], []
    for n in range(draw(st.integers(2, 6))):
        model = (T4, V100)[n % 2]
        free = tuple(1000 - draw(st.sampled_from((0, 500, 1000))) for _ in range(draw(st.sampled_from((1, 2, 4)))))
        for d, f in enumerate(free):
            if f < 1000:
                running.append(RunningWork(f"w{n}-{d}", 1, 0, "ads", 50, True, False, NOW - 60, math.inf, model,
                                           ((n, (d,), 1000 - f, 1000, 1024),)))
        nodes.append(NodeState(f"n{n}", model, MEM[model], free, draw(st.sampled_from((4000, 64000))), 262144,
                               64000, 262144))
    c = ClusterState("c", REGIONS[0], REGIONS[0] + "a", tuple(nodes), running=tuple(running))
    specs = [JobSpec(tenant="search", project="p", home_region=REGIONS[0], gpus_per_worker=g,
                     gpu_milli=m if g == 1 else 1000, workers=w, cpu_milli=cpu)
             for g, m, w, cpu in draw(st.lists(st.tuples(st.sampled_from((0, 1, 1, 2)), st.sampled_from((250, 500, 1000)),
                                                         st.sampled_from((1, 2)), st.sampled_from((1000, 3000))),
                                               min_size=1, max_size=4))]
    steps = draw(st.lists(st.tuples(st.sampled_from(("commit", "commit", "release", "return")),
                                    st.integers(0, 20)), min_size=1, max_size=12))
    return c, specs, steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool_and_steps())
def test_fits_and_checks_held_while_their_pool_stands_equal_fresh_ones(case):
    c, specs, steps = case
    models = [T4, V100]
    wc = WorkingCluster(c)
    held: dict[int, tuple] = {}  # spec index -> (fit, its pool, the pool's count, returns, check, its token)
    done, work = [], list(c.running)

    def hold(k: int) -> None:
        spec = specs[k]
        fit = wc.fit(spec, models)
        witness = wc.could_fit_on(spec, models)
        pool = fit.card_model if fit is not None and spec.gpus_per_worker else None
        held[k] = (fit, pool, wc.changes.get(pool, 0), wc.returns, witness, wc.changes.get(witness, 0))

    for k in range(len(specs)):
        hold(k)
    for action, pick in steps:
        if action == "commit":
            fit = wc.fit(specs[pick % len(specs)], models)
            if fit is not None:
                wc.commit(fit)
                done.append(fit)
        elif action == "release" and done:
            wc.release(done.pop(pick % len(done)))
        elif action == "return" and work:
            wc.release_work(work.pop(pick % len(work)))
        for k, spec in enumerate(specs):
            fit, pool, count, returns, witness, witness_count = held[k]
            if returns == wc.returns and (fit is None or (pool is not None and wc.changes.get(pool, 0) == count)):
                assert wc.fit(spec, models) == fit  # the memo's rule: it still holds
            if witness is not None and wc.changes.get(witness, 0) == witness_count:
                assert wc.could_fit(spec, models)
            if witness is None and returns == wc.returns:
                assert not wc.could_fit(spec, models)
            hold(k)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=federation(), bandwidth=st.booleans(), deadline=st.sampled_from((None, 60.0, 3600.0)),
       reference=st.sampled_from((None, 0.5, 4.0)))
def test_a_scorers_bounds_at_once_equal_its_bounds_one_by_one(case, bandwidth, deadline, reference):
    """``bounds(job, places, ctx)`` (home, start, cost: what decide asks once per search) gives
    every place the very float ``bound`` gives it, with and without per-region bandwidths, start
    deadlines and a cost reference."""
    view, queue = case
    pairs = {(a, b): 2e8 for a in REGIONS for b in REGIONS if a != b} if bandwidth else {}
    for job in queue[:8]:
        if deadline is not None:
            job = QueuedJob(job.job_id, 1, job.spec.model_copy(update={
                "start_deadline": datetime.fromtimestamp(NOW + deadline, UTC)}), job.submitted_at)
        ctx = Context(view, 1.25e9, 0.5, 6.0, region_bandwidth_bps=pairs)
        if reference is not None:
            set_cost_reference(job, reference, ctx)
        places = [(c, WorkingCluster(c), sorted(c.prices, key=c.prices.get)) for c in view.clusters]
        for scorer in (HomeRegion(), StartTime(), Cost()):
            one_by_one = [scorer.bound(job, c, w, ctx, models) for c, w, models in places]
            assert scorer.bounds(job, places, ctx) == one_by_one
