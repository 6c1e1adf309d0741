"""Capacity classes (services/scheduler/core/snapshot.py, fit.py): a gang fitted against classes
of identical nodes gets the same answer as fitting it node by node.

The brute force here is independent of the fitting code: it tries every assignment of the
gang's workers to nodes and checks each node can hold the workers it was given (cards, shares,
CPU, memory). The class-based fit must agree on feasibility, and must choose exactly the nodes
and devices the node-by-node scan (``fit(..., only=every node)``) chooses.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsched.jobs import JobSpec
from services.scheduler.core import fit as fit_module
from services.scheduler.core.snapshot import WHOLE, CapacityClasses, ClusterIndex
from tests.builders import G2, T4, cluster, node

MODELS = (T4, G2)


def WorkingCluster(c):  # noqa: N802 - the class under test, with every full search over classes
    """A working cluster that searches capacity classes even for these small pools (by default
    pools of up to ``SCAN_NODES_UP_TO`` nodes are scanned node by node)."""
    wc = fit_module.WorkingCluster(c)
    wc.scan_nodes_up_to = 0
    return wc
SHARES = (0, 250, 300, 500, 700, 1000, 1000, 1000)  # idle cards more often: whole-card gangs compete


def _node_holds(n_free: tuple[int, ...], cpu_free: int, mem_free: int, spec: JobSpec, k: int) -> bool:
    """Can one node hold ``k`` workers of ``spec``? (exhaustive over the workers' cards)"""
    if k == 0:
        return True
    if cpu_free < k * spec.cpu_milli or mem_free < k * spec.memory_mib:
        return False
    g = spec.gpus_per_worker
    if g == 0:
        return True
    if g > 1 or spec.gpu_milli == WHOLE:
        return sum(1 for f in n_free if f == WHOLE) >= k * g
    # k fractional workers, each on one card: try every card for every worker
    for cards in itertools.product(range(len(n_free)), repeat=k):
        used = [0] * len(n_free)
        for d in cards:
            used[d] += spec.gpu_milli
        if all(used[d] <= n_free[d] for d in range(len(n_free))):
            return True
    return False


def brute_force_fits(nodes, spec: JobSpec, models: list[str]) -> bool:
    """Whether some card model of ``models`` (CPU-only: any healthy node) takes the whole gang,
    by trying every worker -> node assignment."""
    pools = [[i for i, n in enumerate(nodes) if n.healthy]] if spec.gpus_per_worker == 0 else [
        [i for i, n in enumerate(nodes) if n.healthy and n.card_model == m and n.gpu_free] for m in models]
    for pool in pools:
        for assignment in itertools.product(pool, repeat=spec.workers):
            if all(_node_holds(nodes[i].gpu_free, nodes[i].cpu_free_milli, nodes[i].memory_free_mib, spec,
                               assignment.count(i)) for i in set(assignment)):
                return True
    return False


@st.composite
def small_cluster(draw):
    count = draw(st.integers(1, 5))
    nodes = []
    for i in range(count):
        gpus = draw(st.sampled_from((0, 1, 2, 4)))
        free = tuple(draw(st.sampled_from(SHARES)) for _ in range(gpus))
        cpu = draw(st.sampled_from((2000, 8000, 64000)))
        n = node(f"n{i}", draw(st.sampled_from(MODELS)) if gpus else "", gpus, free, cpu=cpu,
                 mem=draw(st.sampled_from((4096, 262144))), healthy=draw(st.booleans() | st.just(True)))
        nodes.append(n)
    if draw(st.booleans()) and count > 1:  # duplicates: classes with several nodes
        nodes += [node(f"d{i}", n.card_model, n.gpus, n.gpu_free, cpu=n.cpu_free_milli, mem=n.memory_free_mib)
                  for i, n in enumerate(nodes[:2])]
    return cluster("c1", nodes=tuple(nodes))


@st.composite
def gang(draw):
    gpus = draw(st.sampled_from((0, 1, 1, 2, 4)))
    milli = draw(st.sampled_from((250, 300, 500, 1000))) if gpus == 1 else WHOLE
    return JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=gpus,
                   gpu_milli=milli if gpus else 0, workers=draw(st.integers(1, 3)),
                   cpu_milli=draw(st.sampled_from((1000, 4000, 16000))), memory_mib=draw(st.sampled_from((1024, 8192))))


def _spec(gpus: int, milli: int = WHOLE, workers: int = 1, cpu: int = 1000) -> JobSpec:
    return JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=gpus,
                   gpu_milli=milli if gpus else 0, workers=workers, cpu_milli=cpu)


BEST_FIT = [  # (id, nodes, job, chosen node index, devices): the node scan's rules, by table
    ("fewest idle cards that fit", (node("a", T4, 4), node("b", T4, 2)), _spec(2), 1, (0, 1)),
    ("equal fits: the lowest node", (node("a", T4, 2), node("b", T4, 2)), _spec(2), 0, (0, 1)),
    ("a share on the fullest partial card", (node("a", T4, 2, (1000, 600)), node("b", T4, 2, (1000, 400))),
     _spec(1, 300), 1, (1,)),
    ("an exact partial fit on the lowest node wins", (node("a", T4, 2, (500, 1000)), node("b", T4, 1, (500,))),
     _spec(1, 500), 0, (0,)),
    ("CPU-only work on a node whose cards are busy", (node("a", T4, 2), node("b", T4, 2, (0, 0))),
     _spec(0), 1, ()),
]


@pytest.mark.parametrize("name,nodes,spec,chosen,devices", BEST_FIT, ids=[c[0] for c in BEST_FIT])
def test_class_fit_follows_the_best_fit_rules(name, nodes, spec, chosen, devices):
    (b,) = WorkingCluster(cluster("c1", nodes=nodes)).fit(spec, [T4]).bindings
    assert (b.node, b.devices) == (chosen, devices)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cluster(), gang(), st.permutations(MODELS))
def test_class_fit_agrees_with_brute_force_and_with_the_node_scan(c, spec, models):
    models = list(models)
    by_classes = WorkingCluster(c).fit(spec, models)
    by_nodes = WorkingCluster(c).fit(spec, models, only=set(range(len(c.nodes))))
    assert (by_classes is not None) == brute_force_fits(c.nodes, spec, models)
    assert by_classes == by_nodes  # same card model, same nodes, same devices


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cluster(), st.lists(gang(), min_size=1, max_size=6))
def test_classes_stay_in_step_with_the_nodes_through_commits_and_releases(c, specs):
    """After a sequence of commits (and releasing half of them) the working cluster's classes are
    those built from scratch out of its per-node state, and fits keep agreeing."""
    wc = WorkingCluster(c)
    done = []
    for spec in specs:
        fit = wc.fit(spec, list(MODELS))
        if fit is not None:
            wc.commit(fit)
            done.append(fit)
    for fit in done[::2]:
        wc.release(fit)
    rebuilt = {}
    for i, n in enumerate(c.nodes):
        if n.healthy:
            pool = n.card_model if n.card_model and n.gpu_free else ""
            rebuilt.setdefault(pool, {}).setdefault((wc.gpu_free[i], wc.cpu_free[i], wc.mem_free[i]), set()).add(i)
    for pool, classes in rebuilt.items():
        assert {sig: cls.members for sig, cls in wc.classes(pool).items()} == classes
    for model in MODELS:  # the per-model figures kept as nodes change, against a recount
        held = [wc.gpu_free[i] for i, n in enumerate(c.nodes) if n.healthy and n.card_model == model and n.gpu_free]
        assert wc.totals(model) == (sum(map(sum, held)), sum(map(len, held)) * WHOLE)
        assert wc.summary(model) == (max((max(d) for d in held), default=0),
                                     max((d.count(WHOLE) for d in held), default=0),
                                     sum(d.count(WHOLE) for d in held))
    for spec in specs:
        assert wc.clone().fit(spec, list(MODELS)) == wc.clone().fit(spec, list(MODELS), only=set(range(len(c.nodes))))


@settings(max_examples=150, deadline=None)
@given(small_cluster(), st.lists(st.tuples(st.integers(0, 6), st.sampled_from(SHARES), st.integers(0, 64000)),
                                 max_size=8))
def test_updated_classes_equal_classes_built_afresh(c, changes):
    """The service's incremental update (only the nodes that changed) gives the classes a full
    build gives."""
    index = ClusterIndex.build(c.nodes)
    before = CapacityClasses.build(c.nodes, index.pool)
    nodes = list(c.nodes)
    touched = []
    for i, share, cpu in changes:
        i %= len(nodes)
        n = nodes[i]
        free = tuple(share if d == 0 else f for d, f in enumerate(n.gpu_free))
        nodes[i] = node(n.name, n.card_model, n.gpus, free, cpu=cpu, mem=n.memory_free_mib, healthy=n.healthy)
        touched.append(i)
    after = before.updated(tuple(nodes), touched, index.pool)
    fresh = CapacityClasses.build(tuple(nodes), index.pool)
    assert after == fresh
    assert before == CapacityClasses.build(c.nodes, index.pool)  # not modified


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cluster(), gang(), gang())
def test_a_clone_and_its_original_change_independently(c, first, second):
    """Clones share classes copy-on-write: a commit on either side leaves the other as it was."""
    wc = WorkingCluster(c)
    wc.fit(first, list(MODELS))  # materialise the pools before cloning
    before = {p: {sig: set(cls.members) for sig, cls in wc.classes(p).items()} for p in list(wc._classes)}
    other = wc.clone()
    fit = other.fit(first, list(MODELS))
    if fit is not None:
        other.commit(fit)
    assert {p: {sig: set(cls.members) for sig, cls in wc.classes(p).items()} for p in before} == before
    fit = wc.fit(second, list(MODELS))
    if fit is not None:
        wc.commit(fit)
        twin = other.clone()
        for b in fit.bindings:  # the clone's own state is untouched by the original's commit
            assert twin.gpu_free[b.node] == other.gpu_free[b.node]
    assert other.fit(second, list(MODELS)) == other.fit(second, list(MODELS), only=set(range(len(c.nodes))))
    assert wc.fit(first, list(MODELS)) == wc.fit(first, list(MODELS), only=set(range(len(c.nodes))))


def test_a_clone_copies_a_pools_classes_only_when_that_pool_changes():
    """Counting: a clone copies no capacity class and no per-node list; the first change of a
    pool on either side copies that pool's classes alone (and the per-node lists), on that
    side, once (a what-if that releases work on one card model never pays for the others)."""
    c = cluster("c1", nodes=tuple(node(f"t{i}", T4, 2, free=(1000, 500 * (i % 3))) for i in range(12))
                + tuple(node(f"g{i}", G2, 4) for i in range(12)))
    wc = WorkingCluster(c)
    t4_before = {sig: set(cls.members) for sig, cls in wc.classes(T4).items()}
    wc.classes(G2)
    other = wc.clone()
    assert all(other._classes[p] is wc._classes[p] for p in (T4, G2))  # shared: nothing copied
    assert other.gpu_free is wc.gpu_free and other.cpu_free is wc.cpu_free  # per-node lists too
    nodes_before = list(wc.gpu_free)
    one = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1, gpu_milli=1000,
                  cpu_milli=1000)
    fit = other.fit(one, [T4])
    assert fit is not None and fit.card_model == T4
    other.commit(fit)
    copied = other.classes(T4)
    assert copied is not wc._classes[T4]  # the clone's changed pool is its own now
    assert other._classes[G2] is wc._classes[G2]  # the untouched pool is still shared
    assert {sig: set(cls.members) for sig, cls in wc.classes(T4).items()} == t4_before  # the original as it was
    assert other.gpu_free is not wc.gpu_free and list(wc.gpu_free) == nodes_before != list(other.gpu_free)
    again = other.fit(one, [T4])
    other.commit(again)
    assert other.classes(T4) is copied  # a second change copies nothing more
    fit = wc.fit(one, [T4])  # the original changes the pool it shared before the clone copied it: its own copy
    wc.commit(fit)
    assert wc.classes(T4) is not copied and wc._classes[G2] is other._classes[G2]
    assert sum(len(cls.members) for cls in wc.classes(T4).values()) == 12
