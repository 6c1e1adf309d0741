"""Scorers, queues, fair share, preemption and backfill of the pure core (table-driven and
hypothesis properties)."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsched.jobs import Dataset, JobKind, Locality, PriorityClass
from services.scheduler.core import RunningWork, Usage, View, build_policy, decide
from services.scheduler.core.fit import WorkingCluster
from services.scheduler.core.preempt import estimated_start, find_victims, lost_work
from services.scheduler.core.queues import FairOrder, effective_priority, queue_of
from services.scheduler.core.scorers import node_fragmentation
from tests.builders import T4, V100, cluster, job, node, view, without_bounds

FED = build_policy("federated")
NOW = 1000.0


def work(job_id, node_i=0, devices=(0,), milli=1000, *, prio=10, preemptible=True, ckpt=False, started=0.0,
         end=math.inf, tenant="ads", model=T4) -> RunningWork:
    return RunningWork(job_id, 1, 0, tenant, prio, preemptible, ckpt, started, end, model,
                       ((node_i, tuple(devices), milli, 1000, 0),))


def busy_cluster(name, works, gpus=2, region="cn-north-1", **kw):
    used = [0] * gpus
    for w in works:
        for _, devs, milli, _, _ in w.bindings:
            for d in devs:
                used[d] += milli
    n = node("n0", gpus=gpus, free=tuple(1000 - u for u in used))
    n = replace(n, cpu_free_milli=n.cpu_milli - 1000 * len(works))
    return replace(cluster(name, region, (n,), **kw), running=tuple(works))


# ---------------------------------------------------------------- scorers

def test_fragmentation_measure_follows_fgd():
    mix = {500: 0.5, 2000: 0.5}
    assert node_fragmentation((1000, 1000), mix) == 0.0      # two idle cards: nothing is a fragment
    assert node_fragmentation((300, 1000), mix) == pytest.approx(0.5 * 300 + 0.5 * 1300)
    assert node_fragmentation((0, 0), mix) == 0.0


def test_fragmentation_prefers_filling_a_partial_card_to_breaking_an_idle_node():
    partial = cluster("partial", nodes=(node("p", gpus=2, free=(500, 0)),))
    idle = cluster("idle", nodes=(node("i", gpus=2),))
    policy = build_policy("federated", weights={"fragmentation": 1.0})
    (p,) = decide(view(idle, partial), [job(milli=500)], policy).placements
    assert p.cluster == "partial"
    score = dict(next(e for e in p.evaluations if e.cluster == "idle").scores)["fragmentation"]
    assert score < 1.0


def test_cost_scorer_is_relative_and_counts_egress():
    home = cluster("home", "cn-north-1", (node("h"),), prices={T4: 6.0})
    cheap_far = cluster("far", "cn-south-1", (node("f"),), prices={T4: 5.0})
    big_data = job(datasets=(Dataset(name="d", home_region="cn-north-1", size_bytes=10**12),), estimated_duration_s=3600)
    policy = build_policy("cheapest")
    (p,) = decide(view(home, cheap_far), [big_data], policy).placements
    assert p.cluster == "home"  # 1 TB of egress at 0.5/GB outweighs a cheaper GPU-hour
    small = job("s", estimated_duration_s=3600)
    (p,) = decide(view(home, cheap_far), [small], policy).placements
    assert p.cluster == "far"


def test_start_scorer_zero_when_the_transfer_misses_the_deadline():
    far = cluster("far", "cn-south-1", (node("f"),))
    deadline = datetime.fromtimestamp(NOW + 60, UTC)
    j = job(datasets=(Dataset(name="d", home_region="cn-north-1", size_bytes=10**12),), start_deadline=deadline)
    (p,) = decide(view(far), [j], build_policy("federated")).placements
    assert dict(p.evaluations[0].scores)["start"] == 0.0


# ---------------------------------------------------------------- queues and fair share

def test_queue_assignment():
    assert queue_of(job(estimated_duration_s=60), 600) == "fast"
    assert queue_of(job(kind=JobKind.INFERENCE, estimated_duration_s=6000), 600) == "inference"
    assert queue_of(job(kind=JobKind.FINE_TUNE), 600) == "training"
    assert queue_of(job(kind=JobKind.EVALUATION), 600) == "batch"


def test_aging_lifts_a_waiting_job_but_only_so_far():
    old_low = job("old", priority=PriorityClass.LOW, at=NOW - 10 * 3600)
    assert effective_priority(old_low, NOW, FED) == 10 + 10 * 6  # capped at 6 steps
    fresh = job("fresh", priority=PriorityClass.LOW, at=NOW)
    assert effective_priority(fresh, NOW, FED) == 10


def test_drf_orders_equal_priority_jobs_by_dominant_share():
    v = View((cluster("c", nodes=(node("n", gpus=8),)),), NOW, tenant_usage={"ads": Usage(4000, 0, 0)})
    a = replace(job("ads-1", at=NOW), spec=job().spec.model_copy(update={"tenant": "ads"}))
    b = replace(job("search-1", at=NOW + 1), spec=job().spec.model_copy(update={"tenant": "search"}))
    assert [j.job_id for j in FairOrder([a, b], v, FED)] == ["search-1", "ads-1"]


# ---------------------------------------------------------------- preemption and backfill

def test_lost_work_is_bounded_by_the_checkpoint_interval():
    assert lost_work(work("a", started=0.0, ckpt=True), 7200, 1800) == 1800
    assert lost_work(work("a", started=0.0, ckpt=False), 7200, 1800) == 7200
    assert lost_work(replace(work("a"), started_at=None), 7200, 1800) == 0


def test_preemption_picks_the_cheapest_sufficient_victims_checkpointable_first():
    victims = [work("plain", devices=(0,), ckpt=False, started=NOW - 600),
               work("ckpt", devices=(1,), ckpt=True, started=NOW - 7200)]
    c = busy_cluster("c", victims)
    ev = find_victims(job(priority=PriorityClass.HIGH).spec, [T4], c, WorkingCluster(c), NOW, 1800, set())
    assert [v.job_id for v in ev.victims] == ["plain"]  # 600 GPU-s lost beats 1800 GPU-s
    two = find_victims(job(gpus=2, priority=PriorityClass.HIGH).spec, [T4], c, WorkingCluster(c), NOW, 1800, set())
    assert sorted(v.job_id for v in two.victims) == ["ckpt", "plain"]


def test_no_preemption_of_equal_priority_or_protected_work():
    c = busy_cluster("c", [work("same", prio=100, devices=(0, 1), milli=1000),])
    assert find_victims(job(priority=PriorityClass.HIGH).spec, [T4], c, WorkingCluster(c), NOW, 1800, set()) is None
    c = busy_cluster("c", [work("protected", preemptible=False, devices=(0, 1))])
    assert find_victims(job(priority=PriorityClass.HIGH).spec, [T4], c, WorkingCluster(c), NOW, 1800, set()) is None


def test_decide_preempts_for_a_blocked_high_priority_job():
    c = busy_cluster("c", [work("low", devices=(0, 1), started=NOW - 60)])
    d = decide(View((c,), NOW), [job("urgent", gpus=2, priority=PriorityClass.HIGH)], FED)
    (p,) = d.placements
    assert [v.job_id for v in p.victims] == ["low"] and "preempting" in p.explanation


def test_estimated_start_uses_estimates_of_running_work():
    c = busy_cluster("c", [work("a", devices=(0,), end=NOW + 600), work("b", devices=(1,), end=NOW + 3600)])
    wc = WorkingCluster(c)
    assert estimated_start(job().spec, [T4], c, wc, NOW) == NOW + 600
    assert estimated_start(job(gpus=2).spec, [T4], c, wc, NOW) == NOW + 3600


def test_backfill_only_runs_work_that_ends_before_the_reservation():
    c = busy_cluster("c", [work("a", devices=(0,), prio=100, preemptible=False, end=NOW + 3600)], gpus=4)
    head = job("head", gpus=4, priority=PriorityClass.HIGH, at=0)
    short = job("short", priority=PriorityClass.LOW, at=1, estimated_duration_s=600)
    long = job("long", priority=PriorityClass.LOW, at=2, estimated_duration_s=36000)
    d = decide(View((c,), NOW), [head, short, long], FED)
    assert [p.job.job_id for p in d.placements] == ["short"]
    (res,) = d.reservations
    assert res.job_key == "head" and res.start_at == NOW + 3600
    long_pending = next(p for p in d.pending if p.job.job_id == "long")
    assert "reserved_for_higher_priority" in long_pending.reason


def test_prefer_local_waits_for_a_home_region_that_frees_up_soon():
    home = busy_cluster("home", [work("a", devices=(0, 1), prio=100, preemptible=False, end=NOW + 600)],
                        region="cn-north-1")
    away = cluster("away", "cn-east-1", (node("x"),))
    big_data = (Dataset(name="d", home_region="cn-north-1", size_bytes=10**12),)  # 800 s to move
    j = job(locality=Locality.PREFER_LOCAL, priority=PriorityClass.LOW, datasets=big_data, at=NOW)
    d = decide(View((home, away), NOW), [j], FED)
    assert not d.placements and "waiting for cn-north-1" in d.pending[0].reason
    no_data = job("light", locality=Locality.PREFER_LOCAL, priority=PriorityClass.LOW, at=NOW)
    (p,) = decide(View((home, away), NOW), [no_data], FED).placements  # nothing to move: 10 min is too long
    assert p.cluster == "away"
    later = busy_cluster("home", [work("a", devices=(0, 1), prio=100, preemptible=False, end=NOW + 7200)])
    (p,) = decide(View((later, away), NOW), [j], FED).placements  # 2 h: beyond the 30 min cap
    assert p.cluster == "away"
    waited = replace(j, submitted_at=NOW - 1700)  # has waited 28 min already: the cap is on the whole wait
    (p,) = decide(View((home, away), NOW), [waited], FED).placements
    assert p.cluster == "away"


def test_overdue_work_is_not_expected_to_free_its_cards_now():
    from services.scheduler.core.preempt import expected_end
    overdue = work("late", started=NOW - 4000, end=NOW - 100)
    assert expected_end(overdue, NOW) == NOW + 2000  # half of its 4000 s so far
    assert expected_end(work("fresh", started=NOW - 10, end=NOW - 1), NOW) == NOW + 300
    assert expected_end(work("ok", end=NOW + 50), NOW) == NOW + 50


# ---------------------------------------------------------------- properties

@st.composite
def contended(draw):
    """A few clusters full of running work and a queue of mixed jobs."""
    clusters = []
    for i in range(draw(st.integers(1, 3))):
        gpus = draw(st.sampled_from((2, 4, 8)))
        works, dev = [], 0
        while dev < gpus and draw(st.booleans()):
            size = draw(st.integers(1, gpus - dev))
            works.append(work(f"w{i}-{dev}", devices=tuple(range(dev, dev + size)), milli=1000,
                              prio=draw(st.sampled_from((0, 10, 50, 100))), preemptible=draw(st.booleans()),
                              ckpt=draw(st.booleans()), started=NOW - draw(st.integers(0, 7200)),
                              end=NOW + draw(st.sampled_from((60, 600, 3600, math.inf))),
                              tenant=draw(st.sampled_from(("ads", "search")))))
            dev += size
        clusters.append(busy_cluster(f"c{i}", works, gpus=gpus, region=("cn-north-1", "cn-east-1")[i % 2]))
    queue = [job(f"j{k}", gpus=draw(st.sampled_from((1, 2, 4))), at=float(k),
                 priority=draw(st.sampled_from(list(PriorityClass))),
                 estimated_duration_s=draw(st.sampled_from((60.0, 600.0, 7200.0))))
             for k in range(draw(st.integers(1, 8)))]
    usage = {"ads": Usage(draw(st.integers(0, 8000)), 0, 0), "search": Usage(draw(st.integers(0, 8000)), 0, 0)}
    return View(tuple(clusters), NOW, tenant_usage=usage), queue


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=contended())
def test_preemption_only_evicts_preemptible_lower_priority_work_once(case):
    v, q = case
    d = decide(v, q, FED)
    seen = set()
    for p in d.placements:
        for w in p.victims:
            assert w.preemptible and w.priority < p.job.spec.priority_value
            assert (w.job_id, w.attempt) not in seen
            seen.add((w.job_id, w.attempt))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=contended())
def test_backfill_never_delays_the_reserved_head_job(case):
    v, q = case
    d = decide(v, q, FED)
    by_name = {c.name: c for c in v.clusters}
    for res in d.reservations:
        for p in d.placements[res.after:]:  # placed after the reservation: backfill
            if p.cluster == res.cluster and not p.victims:
                end = v.now + (p.job.spec.estimated_duration_s or math.inf)
                assert end <= res.start_at  # backfilled work ends (by estimate) before the reservation
        # replay the whole cycle on the reserved cluster, then ask when the head job could start
        head = next(j for j in q if j.key == res.job_key)
        c = by_name[res.cluster]
        final = WorkingCluster(c)
        timeline = list(c.running)
        index = {n.name: i for i, n in enumerate(c.nodes)}
        for p in d.placements:
            if p.cluster != c.name:
                continue
            for victim in p.victims:
                final.release_work(victim)
                timeline.remove(victim)
            bindings = tuple((index[b.node], b.devices, b.gpu_milli, b.cpu_milli, b.memory_mib) for b in p.bindings)
            placed = RunningWork(p.job.job_id, 1, 0, "t", 0, False, False, v.now,
                                 v.now + (p.job.spec.estimated_duration_s or math.inf), p.card_model, bindings)
            final.hold_work(placed)
            timeline.append(placed)
        assert estimated_start(head.spec, [T4], c, final, v.now, timeline) <= res.start_at


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=contended())
def test_drf_order_is_respected_among_equal_priorities(case):
    v, q = case
    order = list(FairOrder(q, v, FED))
    assert sorted(j.key for j in order) == sorted(j.key for j in q)
    prio = [effective_priority(j, v.now, FED) for j in order]
    assert prio == sorted(prio, reverse=True)
    # within a priority level, the first job comes from the tenant with the lowest share
    for level in set(prio):
        members = [j for j, p in zip(order, prio) if p == level]
        tenants = {j.spec.tenant for j in members}
        if len(tenants) > 1:
            shares = {t: FairOrder([], v, FED).share(t) for t in tenants}
            assert shares[members[0].spec.tenant] == min(shares.values())


# ---------------------------------------------------------------- remaining scorers, one table

@pytest.mark.parametrize("policy,expect", [
    ("federated", "home"),          # home region wins when both fit
    ("least-loaded", "roomy"),      # the most free capacity after placement
    ("local-only", "home"),
])
def test_each_policy_prefers_its_cluster(policy, expect):
    home = cluster("home", "cn-north-1", (node("h", gpus=4, free=(0, 0, 1000, 1000)),))
    roomy = cluster("roomy", "cn-east-1", (node("r", gpus=8),))
    (p,) = decide(View((home, roomy), NOW), [job()], build_policy(policy)).placements
    assert p.cluster == expect


def test_random_policy_is_deterministic_per_job_and_spreads():
    cs = tuple(cluster(f"c{i}", ("cn-north-1", "cn-east-1")[i % 2], (node(f"n{i}", gpus=8),)) for i in range(4))
    policy = build_policy("random")
    first = [decide(View(cs, NOW), [job(f"j{k}")], policy).placements[0].cluster for k in range(40)]
    again = [decide(View(cs, NOW), [job(f"j{k}")], policy).placements[0].cluster for k in range(40)]
    assert first == again and len(set(first)) > 1


def test_cross_region_mode_forbidden_keeps_the_job_home():
    away = cluster("away", "cn-east-1", (node("x"),))
    home_full = cluster("home", "cn-north-1", (node("h", free=(0, 0)),))
    j = replace(job(), cross_region="forbidden")
    d = decide(View((home_full, away), NOW), [j], FED)
    assert not d.placements
    verdicts = {e.cluster: e.verdict.reason for e in d.pending[0].evaluations}
    assert verdicts["away"].value == "outside_home_region"


def test_branch_and_bound_matches_scoring_every_cluster():
    """Pruning never changes the choice: the same as scoring every fitting cluster."""
    cs = tuple(cluster(f"c{i:02d}", ("cn-north-1", "cn-east-1", "cn-south-1")[i % 3],
                       (node(f"n{i}", gpus=(2, 4, 8)[i % 3], free=tuple(1000 if (i + g) % 3 else 0
                                                                        for g in range((2, 4, 8)[i % 3]))),),
                       prices={T4: 4.0 + i % 5})
               for i in range(12))
    exact = build_policy("federated", max_scored_fits=0)
    brute = without_bounds(exact)
    for k in range(30):
        j = job(f"j{k}", gpus=(1, 2)[k % 2], home=("cn-north-1", "cn-east-1", "cn-south-1")[k % 3],
                estimated_duration_s=600.0 * (k + 1))
        pruned = decide(View(cs, NOW), [j], exact).placements[0]
        full = decide(View(cs, NOW), [j], brute).placements[0]
        assert (pruned.cluster, pruned.score) == (full.cluster, full.score)
        assert sum(e.total is not None for e in pruned.evaluations) <= sum(e.total is not None for e in full.evaluations)



def test_a_tie_after_rounding_goes_to_the_lower_name_though_its_bound_is_below():
    """Totals are rounded to 4 places, bounds are not: c1's bound (exact: packing is the only term that differs)
    lies below c2's total as rounded (1.0041), yet c1 scores 1.0041 too and wins the tie by
    name. Found by test_shape_sharing's price property (seed 13): the search took c2, pruning
    c1 by comparing its unrounded bound with the rounded total."""
    def two(n0, cpu0, n1):  # (milli-GPUs free per card, milli-CPUs free) of 4-card nodes of 64 cores
        return (replace(node("n0", V100, gpus=4, free=n0), cpu_free_milli=cpu0),
                replace(node("n1", V100, gpus=4, free=n1), cpu_free_milli=60000))
    cs = (cluster("c1", "cn-north-1", two((1000, 1000, 500, 1000), 63000, (500, 1000, 500, 0)), prices={V100: 3.5}),
          cluster("c2", "cn-east-1", two((1000, 1000, 1000, 1000), 64000, (500, 500, 0, 0)), prices={V100: 3.5}))
    exact = build_policy("cheapest", max_scored_fits=0)
    brute = without_bounds(exact)
    queue = [job("j0", milli=250, models=(V100,), cpu=8000,  # (its data draws it home: c1)
                 datasets=(Dataset(name="search/d0", home_region="cn-north-1", size_bytes=10**9),)),
             job("j1", milli=250, models=(V100,), cpu=8000, locality=Locality.PREFER_LOCAL),
             job("j2", milli=250, models=(V100,), cpu=8000)]
    for policy in (exact, brute):
        for cache in (True, False):
            d = decide(View(cs, NOW), queue, policy, cache=cache)
            assert [(p.cluster, p.score) for p in d.placements] == [("c1", 1.0034), ("c1", 1.0037), ("c1", 1.0041)]
            assert {e.cluster: e.total for e in d.placements[-1].evaluations} == {"c1": 1.0041, "c2": 1.0041}



def test_cpu_only_work_scores_packing_1_everywhere_so_the_tie_goes_to_the_lower_name():
    """A CPU-only fit takes no card: packing scores it 1 on any cluster, and its bound must say
    so. It said ``1 - free/capacity`` of the cards (0 on an idle pool), so the cached search,
    taking the fuller c1 first, pruned the idle c0 that ties it at 1.0 and wins by name
    (found by test_shape_sharing's branch-and-bound property)."""
    cs = (cluster("c0", nodes=(node("n0", T4, gpus=4),), prices={T4: 2.0}),
          cluster("c1", nodes=(replace(node("n1", T4, gpus=4, free=(1000, 1000, 1000, 500)), cpu_free_milli=63000),),
                  prices={T4: 2.0}))
    for name in ("federated", "cheapest", "local-only"):
        for cache in (True, False):
            p = decide(View(cs, NOW), [job("cpu", gpus=0)], build_policy(name), cache=cache).placements[0]
            assert (p.cluster, p.card_model) == ("c0", ""), (name, cache)
            assert p.score == (1.01 if name == "cheapest" else 1.0)  # (cost 1 + 0.01 x packing 1)


def test_an_insufficient_verdict_says_when_cpu_is_short_next_to_free_cards():
    """The verdict named only cards ("1 idle cards, best share 1000m"), so a job short of CPU on
    the node with the free card read as a contradiction; it now gives the request's CPU and
    memory and the most free on nodes whose cards could hold a worker (none: not said)."""
    c = cluster("c0", nodes=(replace(node("n0", V100, gpus=4, free=(1000, 0, 0, 0)), cpu_free_milli=7000),),
                prices={V100: 3.0})
    short_cpu = decide(view(c), [job("a", milli=250, models=(V100,), cpu=8000)], build_policy("federated"))
    detail = short_cpu.pending[0].evaluations[0].verdict.detail
    assert detail == ("needs 1x 250m GPU + 8000m CPU / 0 MiB each; nvidia-v100-32gb: 1 idle cards, max 1 on one "
                      "node, best share 1000m; nodes with the cards have at most 7000m CPU / 262144 MiB free")
    short_cards = decide(view(c), [job("b", gpus=2, models=(V100,))], build_policy("federated"))
    assert short_cards.pending[0].evaluations[0].verdict.detail == (
        "needs 1x 2 GPU + 1000m CPU / 0 MiB each; nvidia-v100-32gb: 1 idle cards, max 1 on one node, best share 1000m")


# ---------------------------------------------------------------- what-if searches: narrowed fits are exact

@st.composite
def loaded_clusters(draw):
    """A cluster of 1-6 nodes with 0-10 running jobs placed by the core's own fit."""
    nodes = tuple(node(f"n{k}", draw(st.sampled_from((T4, V100))), gpus=draw(st.sampled_from((1, 2, 4, 8))),
                       cpu=draw(st.sampled_from((8000, 32000, 96000))), mem=draw(st.sampled_from((65536, 262144))))
                  for k in range(draw(st.integers(1, 6))))
    c = cluster("c", nodes=nodes)
    wc = WorkingCluster(c)
    running = []
    for i in range(draw(st.integers(0, 10))):
        gpus = draw(st.sampled_from((0, 1, 1, 2, 4)))
        spec = job(f"r{i}", gpus=gpus, milli=draw(st.sampled_from((1000, 500, 300))) if gpus == 1 else 1000,
                   workers=draw(st.sampled_from((1, 1, 2))), cpu=draw(st.sampled_from((1000, 8000, 24000)))).spec
        fit = wc.fit(spec, [T4, V100])
        if fit is None:
            continue
        wc.commit(fit)
        running.append(RunningWork(f"r{i}", 1, 0, "ads", draw(st.integers(0, 20)), draw(st.booleans()),
                                   draw(st.booleans()), 0.0, draw(st.sampled_from((1500.0, 3000.0, math.inf))),
                                   fit.card_model, tuple((b.node, b.devices, b.gpu_milli, b.cpu_milli, b.memory_mib)
                                                         for b in fit.bindings)))
    frozen = replace(c, nodes=tuple(replace(n, gpu_free=wc.gpu_free[i], cpu_free_milli=wc.cpu_free[i],
                                            memory_free_mib=wc.mem_free[i]) for i, n in enumerate(nodes)),
                     running=tuple(running))
    return frozen


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=loaded_clusters(), gpus=st.sampled_from((0, 1, 2, 4, 8)), milli=st.sampled_from((1000, 500)),
       workers=st.sampled_from((1, 1, 2)), cpu=st.sampled_from((1000, 16000, 64000)))
def test_estimated_start_and_victims_equal_a_full_search_each_time(c, gpus, milli, workers, cpu):
    """The what-if searches look only at nodes that got resources back; the answer must be the
    one that searching the whole cluster after every release gives."""
    from services.scheduler.core import preempt

    spec = job("j", gpus=gpus, milli=milli if gpus == 1 else 1000, workers=workers, cpu=cpu,
               priority=PriorityClass.HIGH).spec
    models = [T4, V100]
    narrowed = (estimated_start(spec, models, c, WorkingCluster(c), NOW),
                find_victims(spec, models, c, WorkingCluster(c), NOW, 600.0, set()))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(preempt._Search, "fit", lambda self, trial, released, models: trial.fit(self.spec, models))
        full = (estimated_start(spec, models, c, WorkingCluster(c), NOW),
                find_victims(spec, models, c, WorkingCluster(c), NOW, 600.0, set()))
    assert narrowed == full
