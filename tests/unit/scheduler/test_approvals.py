"""The scheduler's governor (pure parts): approval requests with their reason and cost, the
approval state machine, narrowing, quota admission of a cycle's placements, effective policy."""

from __future__ import annotations

from fedsched.clock import to_datetime
from fedsched.events import ApprovalDecided, approval_outcome_id, make_event
from fedsched.jobs import Locality
from services.scheduler.core import ClusterState, NodeState, View, build_policy, decide
from tests.builders import gate_entry, queued_of, tenancy_gate

T4 = "nvidia-t4-16gb"
NOW = 1.7e9
BASE = build_policy("federated")


def _node(name: str, free: int) -> NodeState:
    return NodeState(name, T4, 16, (1000,) * free + (0,) * (8 - free), 64000, 262144, 64000, 262144)


def _view(home_free: int = 0, quota=None) -> View:
    home = ClusterState("cn-north-1-c1", "cn-north-1", "cn-north-1a", (_node("h1", home_free),), prices={T4: 6.0})
    away = ClusterState("cn-east-1-c1", "cn-east-1", "cn-east-1a", (_node("e1", 8),), prices={T4: 5.4})
    return View((home, away), NOW, quota=quota)


def test_a_cross_region_placement_under_approval_becomes_a_request_with_reason_and_cost():
    gov = tenancy_gate()
    busy = gate_entry("j-busy", "search", gpus=8, hours=3, placed_on="cn-north-1")
    job = gate_entry("j-new", data_gb=900)  # 900 GB at 1.25 GB/s: 12 min of transfer
    jobs = {e.job_id: e for e in (busy, job)}
    gov.started["j-busy"] = NOW
    view = _view(home_free=0)
    decisions = decide(view, gov.narrow([queued_of(job)], view), gov.effective_policy(BASE))
    assert decisions.placements[0].region == "cn-east-1"
    kept, items = gov.gate(decisions, jobs, view, NOW)
    assert not kept.placements and len(items) == 1
    subject, event, _ = items[0]
    req = event.payload
    assert subject == "fed.governance.approval.ads.train" and event.type == "approval.requested"
    assert req["reason"].startswith("home region cn-north-1: insufficient_free_resources (1 cluster), est. wait 3 h; "
                                    "cn-east-1-c1 (cn-east-1) can run it now, +12 min data transfer; est. cost ")
    assert req["reason"].endswith("tenant ads requires approval")
    assert "est. cost 460.80 CNY (at home 12.00)" in req["reason"]  # people read cents; the payload is exact
    # 1 GPU x 2 h x 5.4 + 900 GB x 0.5 egress = 460.8; at home 1 x 2 x 6.0 = 12
    assert req["cost"] == "460.800000" and req["home_cost"] == "12.000000" and req["estimated_wait_s"] == 3 * 3600
    assert event.actor == "scheduler" and event.policy_version == gov.holder.version
    assert event.payload["expires_at"].startswith(to_datetime(NOW + 3600).isoformat()[:19])

    gov.confirm(items, [True])
    assert gov.narrow([queued_of(job)], view) == []  # held back while it waits
    approval_id = req["approval_id"]
    approved = make_event("approval.approved", ApprovalDecided(approval_id=approval_id, proposed_region="cn-east-1"),
                          producer="admission", occurred_at=NOW + 5, event_id=approval_outcome_id(approval_id),
                          tenant="ads", project="train", job_id="j-new", actor="bob")
    assert gov.apply(approved)
    decisions = decide(view, gov.narrow([queued_of(job)], view), gov.effective_policy(BASE))
    kept, items = gov.gate(decisions, jobs, view, NOW + 6)
    assert [p.region for p in kept.placements] == ["cn-east-1"] and not items  # approved: placed cross-region


def test_rejected_or_expired_requests_keep_the_job_home():
    gov = tenancy_gate("approvals: {timeout_s: 60}\n")
    job = gate_entry("j-1")
    jobs = {"j-1": job}
    view = _view(home_free=0)
    _, items = gov.gate(decide(view, [queued_of(job)], gov.effective_policy(BASE)), jobs, view, NOW)
    gov.confirm(items, [True])
    assert gov.expiries(jobs, NOW + 59) == []
    (expired,) = gov.expiries(jobs, NOW + 61)
    assert expired[1].type == "approval.expired" and expired[1].event_id == approval_outcome_id(
        items[0][1].payload["approval_id"])
    assert gov.expiries(jobs, NOW + 62) == []  # not re-sent while it travels
    gov.apply(expired[1])
    (narrowed,) = gov.narrow([queued_of(job)], view)
    assert narrowed.spec.locality == Locality.MUST_LOCAL
    late = make_event("approval.approved", ApprovalDecided(approval_id=items[0][1].payload["approval_id"]),
                      producer="admission", occurred_at=NOW + 70, tenant="ads", project="train", job_id="j-1")
    assert not gov.apply(late)  # the first outcome wins


def test_forbidden_jobs_are_narrowed_home_and_allowed_ones_pass():
    gov = tenancy_gate()
    finance = gate_entry("j-f", residency_tags=("finance",))
    search = gate_entry("j-s", "search")
    view = _view(home_free=0)
    narrowed = {q.job_id: q for q in gov.narrow([queued_of(finance), queued_of(search)], view)}
    assert narrowed["j-f"].spec.locality == Locality.MUST_LOCAL
    assert narrowed["j-s"].spec.locality == Locality.GLOBAL
    d = decide(view, list(narrowed.values()), gov.effective_policy(BASE))
    kept, items = gov.gate(d, {"j-f": finance, "j-s": search}, view, NOW)
    assert [p.job.job_id for p in kept.placements] == ["j-s"] and not items


def test_placements_of_one_cycle_are_admitted_in_order_against_the_quota():
    gov = tenancy_gate("quotas: [{tenant: search, guaranteed_gpus: 2}]\n")
    jobs = {f"j{i}": gate_entry(f"j{i}", "search") for i in range(3)}
    view = _view(home_free=8, quota=gov.quota_book(jobs.values()))
    policy = gov.effective_policy(BASE)
    assert policy.version.endswith("/" + gov.holder.version) and "quota" in [f.name for f in policy.filters]
    d = decide(view, [queued_of(e) for e in jobs.values()], policy)
    assert len(d.placements) == 3  # decide alone does not see the cycle's own usage
    kept, _ = gov.gate(d, jobs, view, NOW)
    assert len(kept.placements) == 2
    (held,) = [p for p in kept.pending if p.reason.startswith("held: quota_exceeded")]
    assert "quota search/*/*: 2 GPU in use + 1 GPU > 2 GPU guaranteed" in held.reason


def test_an_approval_request_carries_every_clusters_verdict_of_the_proposal():
    gov = tenancy_gate()
    job = gate_entry("j-new")
    view = _view(home_free=0)
    decisions = decide(view, gov.narrow([queued_of(job)], view), gov.effective_policy(BASE))
    _, items = gov.gate(decisions, {job.job_id: job}, view, NOW)
    req = items[0][1].payload
    verdicts = {e["cluster"]: (e["passed"], e["reason"]) for e in req["evaluations"]}
    assert verdicts == {"cn-east-1-c1": (True, ""), "cn-north-1-c1": (False, "insufficient_free_resources")}
    assert req["queue"] == decisions.placements[0].queue != ""
