"""Score memos give the values computed afresh, bit for bit.

* :class:`~services.scheduler.core.scorers.Fragmentation` keeps a one-node fit's score per
  (free cards, devices, share): a memoised score equals the score of a scorer with no memo,
  for any node state and binding, and a full memo is emptied, not grown;
* :func:`~services.scheduler.core.scorers.costs_per_unit_hour` (many places at once) equals
  :func:`~services.scheduler.core.scorers.cost_per_unit_hour` one by one, in either order of
  asking, GPU and CPU-only;
* ``_float_sum`` plus further float terms added one by one is :func:`sum` of them all (what a
  scored fit's total reads), and it declines (None) where ``sum`` would not add floats;
* the kept score terms (``_Cycle.term_tuple``) print as terms made afresh, and keep ``0.0``
  apart from ``-0.0`` and ``1`` apart from ``1.0``.
"""

from __future__ import annotations

import importlib

from hypothesis import given, settings
from hypothesis import strategies as st

from fedsched.jobs import Dataset, JobSpec
from services.scheduler.core import ClusterState, NodeState, QueuedJob, View, build_policy
from services.scheduler.core.filters import Context
from services.scheduler.core.fit import Binding, Fit, WorkingCluster
from services.scheduler.core.scorers import Fragmentation, cost_per_unit_hour, costs_per_unit_hour

decide_module = importlib.import_module("services.scheduler.core.decide")  # (the package exports decide())

T4, V100 = "nvidia-t4-16gb", "nvidia-v100-32gb"
NOW = 1.7e9


def _cluster(name: str, region: str, free: list[tuple[int, ...]], prices: dict[str, float]) -> ClusterState:
    nodes = tuple(NodeState(f"{name}-n{i}", T4, 16, f, 32000, 65536, 32000, 65536) for i, f in enumerate(free))
    return ClusterState(name, region, f"{region}a", nodes, prices=prices, cpu_price_per_core_hour=0.04)


card = st.sampled_from((0, 100, 250, 500, 750, 1000))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(card, min_size=1, max_size=8), min_size=1, max_size=4), st.data())
def test_a_memoised_one_node_fragmentation_score_is_the_score_computed_afresh(free, data):
    c = _cluster("c1", "r1", [tuple(f) for f in free], {T4: 1.0})
    work = WorkingCluster(c)
    memo = Fragmentation()
    for _ in range(3):  # asked again: from the memo
        node = data.draw(st.integers(0, len(free) - 1))
        devices = free[node]
        share = data.draw(st.sampled_from((250, 500, 1000)))
        room = [d for d, f in enumerate(devices) if f >= share]
        if not room:
            continue
        picked = tuple(data.draw(st.lists(st.sampled_from(room), min_size=1, max_size=len(room), unique=True)))
        fit = Fit(T4, (Binding(0, node, tuple(sorted(picked)), share, 1000, 1024),))
        fresh = Fragmentation()
        fresh.ONE_NODE_MEMO = 0  # empties before every store: computed each time
        assert repr(memo.score(None, c, fit, work, None)) == repr(fresh.score(None, c, fit, work, None))
        assert repr(memo.score(None, c, fit, work, None)) == repr(fresh._score(fit.bindings, work.gpu_free))


def test_a_full_fragmentation_memo_is_emptied():
    c = _cluster("c1", "r1", [(1000, 1000, 500, 0)], {T4: 1.0})
    work = WorkingCluster(c)
    scorer = Fragmentation()
    scorer.ONE_NODE_MEMO = 2
    for share in (250, 500, 750, 1000):
        scorer.score(None, c, Fit(T4, (Binding(0, 0, (0,), share, 1000, 1024),)), work, None)
        assert len(scorer._one_node) <= 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("cn-north-1", "cn-east-1", "us-east-1")), st.sampled_from((1.5, 2.0, 3.25, 0.0))),
                min_size=1, max_size=8),
       st.integers(0, 2), st.sampled_from((None, 600.0, 7200.0)), st.booleans())
def test_unit_costs_on_many_places_at_once_are_those_one_by_one(spots, gpus, estimate, batch_first):
    clusters = [_cluster(f"c{i}", region, [(1000,)], {T4: price, V100: price * 2})
                for i, (region, price) in enumerate(spots)]
    spec = JobSpec(tenant="t", project="p", home_region="cn-north-1", gpus_per_worker=gpus, gpu_milli=1000 if gpus else 0,
                   cpu_milli=2000, estimated_duration_s=estimate,
                   datasets=(Dataset(name="d", home_region="cn-east-1", size_bytes=3_000_000_000),))
    job = QueuedJob("j1", 1, spec, NOW)
    places = [(c, T4 if k % 2 else V100) for k, c in enumerate(clusters)]
    many_ctx, one_ctx = Context(View(tuple(clusters), NOW)), Context(View(tuple(clusters), NOW))
    if batch_first:
        many = costs_per_unit_hour(job, places, many_ctx)
        one = [cost_per_unit_hour(job, c, m, one_ctx) for c, m in places]
    else:
        one = [cost_per_unit_hour(job, c, m, one_ctx) for c, m in places]
        many = costs_per_unit_hour(job, places, one_ctx)  # (from the memo the single looks filled)
    fresh = [cost_per_unit_hour(job, c, m, Context(View(tuple(clusters), NOW))) for c, m in places]
    assert [repr(v) for v in many] == [repr(v) for v in one] == [repr(v) for v in fresh]


floats = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False) | st.sampled_from((0.0, -0.0, 1e-17, 0.1, 0.2))


@given(st.lists(floats, min_size=1, max_size=5), st.lists(floats, max_size=4))
def test_a_float_sum_continued_term_by_term_is_sum_of_all_terms(first, more):
    partial = decide_module._float_sum(list(first))
    for t in more:
        partial += t
    assert repr(partial) == repr(sum(first + more))


def test_a_float_sum_declines_where_sum_would_not_add_floats():
    assert decide_module._float_sum([]) is None  # sum([]) is the int 0
    assert decide_module._float_sum([1, 0.5]) is None  # ints are added exactly first


def test_kept_score_terms_are_shared_and_keep_signed_zeros_and_ints_apart():
    cy = decide_module._Cycle(View((), NOW), build_policy("federated"))
    first, again = cy.term_tuple(("home", "start"), (0.25, 0.5)), cy.term_tuple(("home", "start"), (0.25, 0.5))
    assert first == again and all(a is b for a, b in zip(first, again))  # one object per scorer and value
    assert repr(cy.term_tuple(("home", "home"), (-0.0, 0.0))) == "(('home', -0.0), ('home', 0.0))"
    assert repr(cy.term_tuple(("home", "home"), (1, 1.0))) == "(('home', 1), ('home', 1.0))"


@given(st.lists(st.tuples(st.sampled_from(("home", "start", "cost")),
                          floats | st.integers(-2, 2) | st.just(float("nan"))), max_size=12))
def test_kept_score_terms_print_as_terms_made_afresh(pairs):
    cy = decide_module._Cycle(View((), NOW), build_policy("federated"))
    names, values = [n for n, _ in pairs], [v for _, v in pairs]
    for _ in range(2):  # the second time from the memo
        got = cy.term_tuple(names, values)
        assert repr(got) == repr(tuple((n, round(v, 4)) for n, v in pairs))
