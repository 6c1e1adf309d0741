"""The pure scheduling core: table-driven cases and hypothesis properties of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsched.jobs import Dataset, JobKind, Locality, PriorityClass
from services.scheduler.core import Reason, build_policy, decide, order_queue
from tests.builders import G2, T4, V100, cluster, job, node, view

FED = build_policy("federated")


# ---------------------------------------------------------------- table: filters

FILTER_CASES = [
    ("card model not offered", job(models=(V100,)), cluster("c1", nodes=(node("n1", T4),)), Reason.CARD_MODEL),
    ("stale inventory", job(), cluster("c1", nodes=(node("n1"),), age=60), Reason.STALE),
    ("maintenance", job(), cluster("c1", nodes=(node("n1"),), maintenance=True), Reason.MAINTENANCE),
    ("no healthy node", job(), cluster("c1", nodes=(node("n1", healthy=False),)), Reason.UNHEALTHY),
    ("forbidden region", job(forbidden_regions=("cn-north-1",)), cluster("c1", nodes=(node("n1"),)),
     Reason.REGION_FORBIDDEN),
    ("not in allowed regions", job(allowed_regions=("cn-east-1",)), cluster("c1", nodes=(node("n1"),)),
     Reason.REGION_NOT_ALLOWED),
    ("must stay local", job(home="cn-east-1", locality=Locality.MUST_LOCAL), cluster("c1", nodes=(node("n1"),)),
     Reason.NOT_HOME),
    ("residency tag missing", job(residency_tags=("finance",)), cluster("c1", nodes=(node("n1"),)), Reason.RESIDENCY),
    ("gpu memory too small", job(min_gpu_memory_gib=32), cluster("c1", nodes=(node("n1", T4),)), Reason.GPU_MEMORY),
    ("rdma missing", job(workers=2, kind=JobKind.TRAINING, requires_rdma=True), cluster("c1", nodes=(node("n1"),)),
     Reason.INTERCONNECT),
    ("price above ceiling", job(max_price_per_gpu_hour=1.0), cluster("c1", nodes=(node("n1"),)), Reason.PRICE),
    ("gang does not fit now", job(gpus=8), cluster("c1", nodes=(node("n1", gpus=4),)), Reason.INSUFFICIENT),
    ("fractional share does not fit", job(milli=600), cluster("c1", nodes=(node("n1", gpus=1, free=(500,)),)),
     Reason.INSUFFICIENT),
    ("cpu does not fit", job(cpu=128000), cluster("c1", nodes=(node("n1"),)), Reason.INSUFFICIENT),
]


@pytest.mark.parametrize("name,j,c,reason", FILTER_CASES, ids=[c[0] for c in FILTER_CASES])
def test_a_failed_hard_filter_keeps_the_job_pending_with_its_reason(name, j, c, reason):
    d = decide(view(c), [j], FED)
    assert not d.placements
    (p,) = d.pending
    assert p.evaluations[0].verdict.reason == reason
    assert reason.value in p.reason


def test_unplaceable_is_told_apart_from_busy():
    busy = cluster("c1", nodes=(node("n1", gpus=2, free=(0, 0)),))
    never = cluster("c2", nodes=(node("n2", gpus=2),))
    d = decide(view(busy), [job(gpus=2)], FED)
    assert d.pending[0].fits_empty is True
    d = decide(view(never), [job(gpus=4)], FED)
    assert d.pending[0].fits_empty is False


# ---------------------------------------------------------------- table: placement

def test_prefers_home_region_when_both_fit_at_a_similar_price():
    home = cluster("home", "cn-north-1", (node("h1"),))
    away = cluster("away", "cn-south-1", (node("a1"),), prices={T4: 5.5})
    (p,) = decide(view(away, home), [job()], FED).placements
    assert p.cluster == "home" and not p.cross_region


def test_goes_abroad_when_it_is_much_cheaper_there():
    home = cluster("home", "cn-north-1", (node("h1"),))
    away = cluster("away", "cn-south-1", (node("a1"),), prices={T4: 1.0})
    (p,) = decide(view(away, home), [job()], FED).placements
    assert p.cluster == "away" and p.cross_region


def test_a_job_that_needs_approval_to_go_abroad_stays_home_when_home_can_run_it_now():
    from dataclasses import replace as _replace

    home = cluster("home", "cn-north-1", (node("h1"),))
    away = cluster("away", "cn-south-1", (node("a1"),), prices={T4: 1.0})
    (p,) = decide(view(away, home), [_replace(job(), cross_region="approval")], FED).placements
    assert p.cluster == "home" and not p.cross_region  # no approver is asked to save a little
    full_home = cluster("home", "cn-north-1", (node("h1", free=(0, 0)),))
    (p,) = decide(view(away, full_home), [_replace(job(), cross_region="approval")], FED).placements
    assert p.cluster == "away"  # home cannot: going abroad is proposed (and the governor asks)


def test_goes_cross_region_when_home_is_full_and_says_why():
    home = cluster("home", "cn-north-1", (node("h1", free=(0, 0)),))
    away = cluster("away", "cn-south-1", (node("a1"),))
    (p,) = decide(view(home, away), [job()], FED).placements
    assert p.cluster == "away" and p.cross_region
    assert "away" in p.explanation
    verdicts = {e.cluster: e.verdict for e in p.evaluations}
    assert verdicts["home"].reason == Reason.INSUFFICIENT


def test_data_transfer_is_estimated_for_remote_data():
    away = cluster("away", "cn-south-1", (node("a1"),))
    j = job(datasets=(Dataset(name="d", home_region="cn-north-1", size_bytes=125 * 10**9),))
    (p,) = decide(view(away), [j], FED).placements
    assert p.transfer_bytes == 125 * 10**9
    assert p.transfer_s == pytest.approx(100.0)  # 125 GB at 1.25 GB/s


def test_fractional_jobs_share_a_card_before_breaking_a_new_one():
    c = cluster("c1", nodes=(node("n1", gpus=2, free=(600, 1000)),))
    (p,) = decide(view(c), [job(milli=500)], FED).placements
    assert p.bindings[0].devices == (0,)


def test_whole_gpu_gang_goes_to_the_node_with_fewest_idle_cards():
    c = cluster("c1", nodes=(node("big", gpus=8), node("small", gpus=2)))
    (p,) = decide(view(c), [job(gpus=2)], FED).placements
    assert p.bindings[0].node == "small"


def test_gang_all_workers_in_one_cluster_or_none():
    a = cluster("a", nodes=(node("a1", gpus=2),))
    b = cluster("b", nodes=(node("b1", gpus=2),))
    d = decide(view(a, b), [job(gpus=2, workers=2)], FED)
    assert not d.placements  # 4 GPUs exist, but not in one cluster
    assert d.pending[0].fits_empty is False


def test_two_jobs_in_one_cycle_never_share_the_same_cards():
    c = cluster("c1", nodes=(node("n1", gpus=2),))
    d = decide(view(c), [job("a", gpus=2), job("b", gpus=2)], FED)
    assert [p.job.job_id for p in d.placements] == ["a"]
    assert [p.job.job_id for p in d.pending] == ["b"]


def test_queue_order_is_priority_then_arrival():
    jobs = [job("low", priority=PriorityClass.LOW, at=0), job("high-late", priority=PriorityClass.HIGH, at=5),
            job("high-early", priority=PriorityClass.HIGH, at=1)]
    assert [j.job_id for j in order_queue(jobs)] == ["high-early", "high-late", "low"]


def test_cpu_only_job_prefers_nodes_without_idle_gpus():
    c = cluster("c1", nodes=(node("idle", gpus=2), node("busy", gpus=2, free=(0, 0))))
    (p,) = decide(view(c), [job(gpus=0, cpu=4000)], FED).placements
    assert p.bindings[0].node == "busy" and p.card_model == ""


@pytest.mark.parametrize("policy,expect", [("local-only", "home"), ("cheapest", "cheap"), ("least-loaded", "empty")])
def test_baseline_policies(policy, expect):
    home = cluster("home", "cn-north-1", (node("h1", gpus=4, free=(0, 0, 1000, 1000)),), prices={T4: 9.0})
    cheap = cluster("cheap", "cn-south-1", (node("c1", gpus=4, free=(0, 1000, 1000, 1000)),), prices={T4: 1.0})
    empty = cluster("empty", "cn-east-1", (node("e1", gpus=8),), prices={T4: 5.0})
    (p,) = decide(view(home, cheap, empty), [job()], build_policy(policy)).placements
    assert p.cluster == expect


def test_decide_is_pure_and_deterministic():
    c = cluster("c1", nodes=(node("n1", gpus=4),))
    v = view(c)
    q = [job("a"), job("b", milli=300)]
    assert decide(v, q, FED) == decide(v, q, FED)
    assert c.nodes[0].gpu_free == (1000,) * 4  # input untouched


# ---------------------------------------------------------------- properties

MODELS = (T4, V100, G2)
REGIONS = ("cn-north-1", "cn-east-1", "cn-south-1")

node_st = st.builds(
    lambda i, model, gpus, used, cpu: node(f"n{i}", model, gpus,
                                           tuple(max(0, 1000 - u) for u in used[:gpus]) + (1000,) * max(0, gpus - len(used)),
                                           cpu),
    st.integers(0, 10**6), st.sampled_from(MODELS), st.sampled_from((1, 2, 4, 8)),
    st.lists(st.sampled_from((0, 200, 500, 1000)), max_size=8), st.sampled_from((8000, 64000)))


@st.composite
def views(draw):
    n = draw(st.integers(1, 4))
    clusters = []
    for i in range(n):
        nodes = draw(st.lists(node_st, min_size=1, max_size=5))
        nodes = tuple(n_.__class__(f"c{i}-{k}", *[getattr(n_, f) for f in
                                                   ("card_model", "gpu_memory_gib", "gpu_free", "cpu_free_milli",
                                                    "memory_free_mib", "cpu_milli", "memory_mib", "healthy", "rdma")])
                      for k, n_ in enumerate(nodes))
        clusters.append(cluster(f"c{i}", draw(st.sampled_from(REGIONS)), nodes, age=draw(st.sampled_from((0.0, 60.0))),
                                tags=frozenset(draw(st.sets(st.sampled_from(("finance", "pii")), max_size=1)))))
    return view(*clusters)


@st.composite
def queues(draw):
    out = []
    for i in range(draw(st.integers(1, 12))):
        gpus = draw(st.sampled_from((0, 1, 1, 2, 4, 8)))
        milli = draw(st.sampled_from((1000, 500, 250))) if gpus == 1 else 1000
        out.append(job(f"j{i}", gpus=gpus, milli=milli, workers=draw(st.sampled_from((1, 1, 2))),
                       models=tuple(draw(st.sets(st.sampled_from(MODELS), max_size=2))),
                       home=draw(st.sampled_from(REGIONS)),
                       priority=draw(st.sampled_from(list(PriorityClass))), at=float(i),
                       residency_tags=tuple(draw(st.sets(st.sampled_from(("finance",)), max_size=1))),
                       locality=draw(st.sampled_from(list(Locality))), cpu=draw(st.sampled_from((500, 16000)))))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=views(), q=queues(), policy=st.sampled_from(("federated", "local-only", "least-loaded", "cheapest", "random")))
def test_core_invariants(v, q, policy):
    d = decide(v, q, build_policy(policy))
    assert len(d.placements) + len(d.pending) == len(q)
    by_name = {c.name: c for c in v.clusters}
    used: dict[tuple[str, str, int], int] = {}
    cpu: dict[tuple[str, str], int] = {}
    for p in d.placements:
        spec = p.job.spec
        c = by_name[p.cluster]
        # gang: every worker bound, all in this one cluster
        assert len(p.bindings) == spec.workers
        nodes = {n.name: n for n in c.nodes}
        # hard filters hold
        assert c.heartbeat_age_s <= v.stale_after_s
        assert set(spec.residency_tags) <= c.residency_tags
        if spec.locality == Locality.MUST_LOCAL or policy == "local-only":
            assert c.region == spec.home_region
        for b in p.bindings:
            n = nodes[b.node]
            assert n.healthy
            if spec.gpus_per_worker:
                assert n.card_model == p.card_model
                if spec.card_models:
                    assert n.card_model in spec.card_models
            assert len(b.devices) == spec.gpus_per_worker
            for dev in b.devices:
                used[(p.cluster, b.node, dev)] = used.get((p.cluster, b.node, dev), 0) + b.gpu_milli
            cpu[(p.cluster, b.node)] = cpu.get((p.cluster, b.node), 0) + b.cpu_milli
    # never over-allocates a card or a node's CPU
    for (cname, nname, dev), milli in used.items():
        n = next(n for n in by_name[cname].nodes if n.name == nname)
        assert milli <= n.gpu_free[dev]
    for (cname, nname), c_ in cpu.items():
        n = next(n for n in by_name[cname].nodes if n.name == nname)
        assert c_ <= n.cpu_free_milli
    # a pending job that fits_empty=False fits no cluster even when empty
    for pend in d.pending:
        assert pend.reason


@settings(max_examples=80, deadline=None)
@given(v=views(), q=queues())
def test_priority_order_is_respected(v, q):
    """A lower-priority job is never placed in a cycle where a higher-priority job with the same
    request shape (which would fit wherever the lower one fits) stays pending."""
    d = decide(v, q, FED)
    pending = {p.job.job_id for p in d.pending}
    for p in d.placements:
        for other in q:
            if other.job_id in pending and other.spec.priority_value > p.job.spec.priority_value:
                same = (other.spec.model_dump(exclude={"priority"}) == p.job.spec.model_dump(exclude={"priority"}))
                assert not same
