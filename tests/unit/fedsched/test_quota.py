"""The quota book (pure): guaranteed quota, borrowing limits, cohorts, card classes, ceilings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedsched.jobs import JobSpec
from fedsched.quota import QuotaBook, QuotaRule
from services.scheduler.core import ClusterState, NodeState, QueuedJob, Reason, View, build_policy, decide
from services.scheduler.core.filters import Quota

A100, T4 = "nvidia-a100-80gb", "nvidia-t4-16gb"
NORTH, EAST = "cn-north-1", "cn-east-1"


def rule(tenant="search", models=None, regions=None, nominal=4000, borrow=0, cohort="", label=None) -> QuotaRule:
    return QuotaRule(tenant, frozenset(models) if models else None, frozenset(regions) if regions else None, nominal,
                     borrow, cohort, label or f"{tenant}/{','.join(models or ['*'])}/{','.join(regions or ['*'])}")


def book(*rules: QuotaRule, used: list[tuple[str, str, str, int]] = ()) -> QuotaBook:
    return QuotaBook.build(rules, used)


# (id, book, (tenant, model, region, milli), passes, detail fragment)
CASES = [
    ("no rule for the tenant: unlimited", book(rule(tenant="ads")), ("search", A100, NORTH, 10**6), True, ""),
    ("within the guarantee", book(rule()), ("search", A100, NORTH, 4000), True, ""),
    ("above the guarantee without a cohort", book(rule()), ("search", A100, NORTH, 4001), False,
     "no cohort to borrow from"),
    ("usage counts", book(rule(), used=[("search", A100, NORTH, 3000)]), ("search", T4, EAST, 2000), False,
     "3 GPU in use + 2 GPU > 4 GPU guaranteed"),
    ("rule for another model does not cover", book(rule(models=[T4])), ("search", A100, NORTH, 10**6), True, ""),
    ("rule for another region does not cover", book(rule(regions=[EAST])), ("search", A100, NORTH, 10**6), True, ""),
    ("card class covers its members", book(rule(models=[A100, T4])), ("search", T4, NORTH, 5000), False, "guaranteed"),
    ("fractional GPUs", book(rule(nominal=500)), ("search", T4, NORTH, 250), True, ""),
    ("borrow within the limit from a cohort with room",
     book(rule(cohort="c", borrow=2000), rule(tenant="ads", cohort="c")), ("search", A100, NORTH, 6000), True, ""),
    ("borrow beyond the borrowing limit",
     book(rule(cohort="c", borrow=1000), rule(tenant="ads", cohort="c")), ("search", A100, NORTH, 6000), False,
     "1 GPU borrowing limit"),
    ("borrow when the lender uses its guarantee",
     book(rule(cohort="c", borrow=None), rule(tenant="ads", cohort="c"), used=[("ads", A100, NORTH, 3000)]),
     ("search", A100, NORTH, 6000), False, "cohort c has 1 GPU unused to lend"),
    ("unlimited borrowing is bounded by the cohort",
     book(rule(cohort="c", borrow=None), rule(tenant="ads", cohort="c")), ("search", A100, NORTH, 8000), True, ""),
    ("every covering rule must admit",
     book(rule(nominal=8000), rule(models=[A100], nominal=2000, label="search/a100/*")), ("search", A100, NORTH, 3000),
     False, "quota search/a100/*"),
    ("CPU-only work is not limited", book(rule(nominal=0)), ("search", "", NORTH, 0), True, ""),
]


@pytest.mark.parametrize("name,b,args,passes,detail", CASES, ids=[c[0] for c in CASES])
def test_quota_check(name, b, args, passes, detail):
    verdict = b.check(*args)
    assert verdict.passed == passes
    if not passes:
        assert verdict.reason == Reason.QUOTA and detail in verdict.detail


def test_ceiling_is_the_most_a_tenant_could_ever_hold():
    b = book(rule(cohort="c", borrow=3000, label="s"), rule(tenant="ads", cohort="c", nominal=2000))
    assert b.ceiling("search", A100, NORTH) == (6000, b.rules[0])  # 4 + min(3, cohort 6 - 4) ... capped by cohort 6
    assert book(rule()).ceiling("search", A100, NORTH)[0] == 4000
    assert book(rule(tenant="ads")).ceiling("search", A100, NORTH) == (None, None)


def test_copy_is_independent():
    b = book(rule())
    twin = b.copy()
    twin.add("search", A100, NORTH, 4000)
    assert b.room("search", A100, NORTH, 4000) and not twin.room("search", A100, NORTH, 1)


def _cluster(name, region, model, gpus=8) -> ClusterState:
    node = NodeState("n1", model, 80, (1000,) * gpus, 64000, 262144, 64000, 262144)
    return ClusterState(name, region, region + "a", (node,), prices={model: 10.0})


def test_the_quota_filter_excludes_clusters_whose_region_has_no_room():
    b = book(rule(regions=[NORTH], nominal=1000), used=[("search", A100, NORTH, 1000)])
    view = View((_cluster("n1", NORTH, A100), _cluster("e1", EAST, A100)), 0.0, quota=b)
    job = QueuedJob("j1", 1, JobSpec(tenant="search", project="train", home_region=NORTH), 0.0)
    base = build_policy("federated")
    d = decide(view, [job], replace(base, filters=base.filters + (Quota(),)))
    assert [p.cluster for p in d.placements] == ["e1"]
    north = next(e for e in d.placements[0].evaluations if e.cluster == "n1")
    assert north.verdict.reason == Reason.QUOTA and "search/*/cn-north-1" in north.verdict.detail
