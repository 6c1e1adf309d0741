"""Preemption rules with quotas, in Kueue's terms (issue 13, item 2; rules in
``services/scheduler/core/preempt.py``):

(a) within the tenant's own quota, by priority (``withinClusterQueue: LowerPriority``) -- also
    when the tenant's quota, not capacity, is what blocks;
(b) reclaim of lent guarantee within the cohort (``reclaimWithinCohort: any | lower_priority |
    never``);
(c) never preempting to borrow unless configured (``borrowWithinCohort``, default off);
(0) work no quota covers: by priority, as without quotas.

Every case is one cluster of 1 node x 8 GPUs and one queued job; the table gives the running
work, the quota rules, the policy switches, and the victims (or the reason the job waits).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fedsched.jobs import JobSpec, PriorityClass
from services.scheduler.core import ClusterState, NodeState, QueuedJob, Reason, RunningWork, View, build_policy, decide
from services.scheduler.core.filters import Quota
from fedsched.quota import QuotaBook, QuotaRule

T4, NORTH, NOW = "nvidia-t4-16gb", "cn-north-1", 1.7e9
LOW, NORMAL, HIGH, CRITICAL = PriorityClass.LOW, PriorityClass.NORMAL, PriorityClass.HIGH, PriorityClass.CRITICAL
PRIO = {p: JobSpec(tenant="t", project="p", home_region=NORTH, priority=p).priority_value for p in PriorityClass}


def run(job_id: str, tenant: str, gpus: int, priority: PriorityClass, preemptible: bool = True,
        first: int = 0) -> RunningWork:
    """Running work on GPUs ``first .. first + gpus - 1`` of the one node."""
    return RunningWork(job_id, 1, 0, tenant, PRIO[priority], preemptible, False, NOW - 600, math.inf, T4,
                       ((0, tuple(range(first, first + gpus)), 1000, 1000, 0),))


def rule(tenant: str, gpus: int, cohort: str = "", borrow: int | None = 0) -> QuotaRule:
    return QuotaRule(tenant, None, None, gpus * 1000, None if borrow is None else borrow * 1000, cohort,
                     f"{tenant}/*/*")


def situation(running: list[RunningWork], rules: list[QuotaRule] | None):
    used = [0] * 8
    for w in running:
        for _, devs, milli, _, _ in w.bindings:
            for d in devs:
                used[d] += milli
    node = NodeState("n1", T4, 16, tuple(1000 - u for u in used), 64000, 262144, 64000, 262144)
    cluster = ClusterState("c1", NORTH, NORTH + "a", (node,), prices={T4: 6.0}, running=tuple(running))
    book = None if rules is None else QuotaBook.build(rules, [(w.tenant, T4, NORTH, w.gpu_milli) for w in running])
    return View((cluster,), NOW, quota=book)


def queued(tenant: str, gpus: int, priority: PriorityClass) -> QueuedJob:
    spec = JobSpec(tenant=tenant, project="p", home_region=NORTH, gpus_per_worker=gpus, cpu_milli=1000,
                   priority=priority)
    return QueuedJob("J", 1, spec, NOW - 60)


BORROWER = [run("B", "t2", 8, NORMAL)]  # t2 borrows all 8 of t1's guarantee
COHORT = [rule("t1", 8, "c", None), rule("t2", 0, "c", None)]

# (case, running, rules (None = no quotas), job (tenant, GPUs, priority), policy params,
#  expected victims (None = the job waits), reason code while it waits)
CASES = [
    # the example, and the same without the quota
    ("(a) quota blocks: H preempts its tenant's lower-priority L in one cycle",
     [run("L", "t1", 8, LOW)], [rule("t1", 8)], ("t1", 8, HIGH), {}, {"L"}, None),
    ("no quotas: H preempts L (unchanged)", [run("L", "t1", 8, LOW)], None, ("t1", 8, HIGH), {}, {"L"}, None),
    ("(a) equal priority is never a victim", [run("L", "t1", 8, HIGH)], [rule("t1", 8)], ("t1", 8, HIGH), {},
     None, Reason.QUOTA),
    ("(a) higher priority is never a victim", [run("L", "t1", 8, CRITICAL)], [rule("t1", 8)], ("t1", 8, HIGH), {},
     None, Reason.QUOTA),
    ("(a) non-preemptible work is never a victim", [run("L", "t1", 8, LOW, preemptible=False)], [rule("t1", 8)],
     ("t1", 8, HIGH), {}, None, Reason.QUOTA),
    ("(a) only as much as needed: one of two", [run("L1", "t1", 4, LOW), run("L2", "t1", 4, LOW, first=4)],
     [rule("t1", 8)], ("t1", 4, HIGH), {}, 1, None),
    ("(a) below preempt_min_priority: no preemption", [run("L", "t1", 8, PriorityClass.BEST_EFFORT)],
     [rule("t1", 8)], ("t1", 8, LOW), {}, None, Reason.QUOTA),
    # (b) reclaim
    ("(b) t1 reclaims its lent guarantee from borrower t2 (equal priority)", BORROWER, COHORT, ("t1", 8, NORMAL),
     {}, {"B"}, None),
    ("(b) any: even a higher-priority borrower", [run("B", "t2", 8, CRITICAL)], COHORT, ("t1", 8, NORMAL), {},
     {"B"}, None),
    ("(b) any: a low-priority job reclaims too (no preempt_min_priority)", BORROWER, COHORT, ("t1", 8, LOW), {},
     {"B"}, None),
    ("(b) lower_priority: an equal-priority borrower stays", BORROWER, COHORT, ("t1", 8, NORMAL),
     {"reclaim_within_cohort": "lower_priority"}, None, Reason.INSUFFICIENT),
    ("(b) lower_priority: a lower-priority borrower goes", [run("B", "t2", 8, LOW)], COHORT, ("t1", 8, NORMAL),
     {"reclaim_within_cohort": "lower_priority"}, {"B"}, None),
    ("(b) never: no reclaim", [run("B", "t2", 8, LOW)], COHORT, ("t1", 8, NORMAL),
     {"reclaim_within_cohort": "never"}, None, Reason.INSUFFICIENT),
    ("(b) a non-preemptible borrower stays", [run("B", "t2", 8, LOW, preemptible=False)], COHORT, ("t1", 8, NORMAL),
     {}, None, Reason.INSUFFICIENT),
    ("(b) a tenant within its own guarantee is not reclaimed from", [run("B", "t2", 8, LOW)],
     [rule("t1", 8, "c", None), rule("t2", 8, "c", None)], ("t1", 8, HIGH), {}, None, Reason.INSUFFICIENT),
    ("(b) a borrower of another cohort is not reclaimed from", [run("B", "t2", 8, LOW)],
     [rule("t1", 8, "c", None), rule("t2", 0, "other", None), rule("t3", 8, "other")], ("t1", 8, HIGH), {},
     None, Reason.INSUFFICIENT),
    ("(b) only the borrowed part: 4 of t2's 6 stay within its guarantee",
     [run("B1", "t2", 2, LOW), run("B2", "t2", 4, LOW, first=2)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c", None)], ("t1", 4, NORMAL), {}, {"B1"}, None),
    # (c) borrow
    ("(c) off: a job that must borrow does not preempt the cohort", [run("B", "t2", 6, LOW)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c", None)], ("t1", 6, HIGH), {}, None, Reason.QUOTA),
    ("(c) on: it preempts a lower-priority borrower", [run("B", "t2", 6, LOW)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c", None)], ("t1", 6, HIGH), {"borrow_within_cohort": True},
     {"B"}, None),
    ("(c) on: never an equal-priority borrower", [run("B", "t2", 6, HIGH)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c", None)], ("t1", 6, HIGH), {"borrow_within_cohort": True},
     None, Reason.QUOTA),
    ("(c) on: never a tenant within its guarantee", [run("B", "t2", 4, LOW)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c", None)], ("t1", 6, HIGH), {"borrow_within_cohort": True},
     None, Reason.QUOTA),
    ("(c) off: a borrowing job still preempts its own lower-priority work",
     [run("L", "t1", 4, LOW), run("B", "t2", 4, LOW, first=4)],
     [rule("t1", 2, "c", None), rule("t2", 4, "c", None), rule("t3", 4, "c")], ("t1", 4, HIGH), {}, {"L"}, None),
    # (0) work no quota covers
    ("(0) uncovered work goes by priority", [run("U", "t9", 8, LOW)], [rule("t1", 8)], ("t1", 8, HIGH), {},
     {"U"}, None),
    ("(0) uncovered work of equal priority stays", [run("U", "t9", 8, HIGH)], [rule("t1", 8)], ("t1", 8, HIGH), {},
     None, Reason.INSUFFICIENT),
    ("(0) a job without quota never evicts work within another tenant's guarantee", [run("L", "t1", 8, LOW)],
     [rule("t1", 8)], ("t9", 8, CRITICAL), {}, None, Reason.INSUFFICIENT),
    ("(0) a borrowing job does not evict uncovered work", [run("U", "t9", 8, LOW)],
     [rule("t1", 4, "c", None), rule("t2", 4, "c")], ("t1", 8, HIGH), {"borrow_within_cohort": True}, None,
     Reason.INSUFFICIENT),
]


@pytest.mark.parametrize("name,running,rules,ask,params,victims,reason", CASES, ids=[c[0] for c in CASES])
def test_preemption_rules(name, running, rules, ask, params, victims, reason):
    policy = build_policy("federated", **params)
    if rules is not None:
        policy = replace(policy, filters=policy.filters + (Quota(),))
    d = decide(situation(running, rules), [queued(*ask)], policy)
    if victims is None:
        assert not d.placements
        (p,) = d.pending
        assert p.evaluations[0].verdict.reason == reason, p.reason
        return
    (p,) = d.placements  # placed within this one cycle
    chosen = {v.job_id for v in p.victims}
    if isinstance(victims, int):
        assert len(chosen) == victims
    else:
        assert chosen == victims
    for v in p.victims:  # the rules' invariants
        assert v.preemptible


def test_reclaim_modes_are_validated():
    from fedsched.errors import ValidationError
    with pytest.raises(ValidationError, match="reclaim_within_cohort"):
        build_policy("federated", reclaim_within_cohort="sometimes")


# ---------------------------------------------------------------- through the governor's gate

def test_the_gate_admits_a_preemption_that_gives_its_victims_quota_back():
    """The example end to end in the scheduler's pure parts: policy YAML quota, the effective
    policy, decide, and the in-order quota admission (which counts L until it is evicted)."""
    from services.scheduler.core import ClusterState as CS
    from tests.builders import gate_entry as _entry, queued_of as _queued, tenancy_gate as _governor
    BASE = build_policy("federated")

    gov = _governor("quotas: [{tenant: search, guaranteed_gpus: 8}]\n")
    low = _entry("L", "search", gpus=8, placed_on=NORTH, priority=LOW, preemptible=True)
    high = _entry("H", "search", gpus=8, priority=HIGH)
    jobs = {e.job_id: e for e in (low, high)}
    node = NodeState("h1", "nvidia-t4-16gb", 16, (0,) * 8, 64000, 262144, 64000, 262144)
    work = RunningWork("L", 1, 0, "search", PRIO[LOW], True, False, NOW - 600, math.inf, "nvidia-t4-16gb",
                       ((0, tuple(range(8)), 1000, 1000, 0),))
    view = View((CS("cn-north-1-c1", NORTH, NORTH + "a", (node,), prices={"nvidia-t4-16gb": 6.0},
                    running=(work,)),), NOW, quota=gov.quota_book(jobs.values()))
    policy = gov.effective_policy(BASE)
    d = decide(view, gov.narrow([_queued(high)], view), policy)
    kept, _ = gov.gate(d, jobs, view, NOW)
    (p,) = kept.placements
    assert p.job.job_id == "H" and [v.job_id for v in p.victims] == ["L"]
    # without the eviction the same quota holds H back
    quiet = replace(policy, preemption=False)
    d = decide(view, [_queued(high)], quiet)
    assert not d.placements and d.pending[0].evaluations[0].verdict.reason == Reason.QUOTA
