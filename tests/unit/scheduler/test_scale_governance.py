"""The governance parts of a scheduling cycle do not walk what is active (issue 15, item 1).

* Quota usage: the service keeps the milli-GPUs of placed and running shards as running totals
  per (tenant, card model, region), so the cycle's quota book costs one visit per total
  (``last_cycle_visit_counts["quota"]``), not one per running shard; the totals must equal a
  recount over every placed or running shard through placements, starts, ends, failures,
  reclaims and a lost cluster.
* Approval expiries: open requests are kept in a heap by deadline, so
  :meth:`TenancyGate.expiries` looks only at the due ones (``last_expiry_visits``), not at
  every approval.
"""

from __future__ import annotations

from collections import Counter

from fedsched.clock import to_datetime
from fedsched.events import ApprovalDecided, ApprovalRequested, approval_outcome_id, make_event
from fedsched.policystore import StoredPolicy
from fedsched.tenancy import Governance
from services.scheduler.approvals import placement_milli
from services.scheduler.states import ACTIVE, ShardState
from tests.builders import GATE_NOW, ClusterSpec, SchedulerHarness, gate_entry, nodes, policy_text, tenancy_gate

A, B = "cn-north-1-c1", "cn-north-1-c2"
QUOTAS = "quotas: [{tenant: search, guaranteed_gpus: 4000}, {tenant: ads, guaranteed_gpus: 4000}]\n"


def _governed(h: SchedulerHarness) -> None:
    _governed_svc(h.svc)


def _governed_svc(svc) -> None:
    svc.policy_holder.set(StoredPolicy(Governance.parse(policy_text(QUOTAS)), 1))


def _recount(svc) -> dict:
    """The quota usage as the book was built before: a walk over every placed or running shard."""
    use: Counter = Counter()
    for job, shard in svc.active.values():
        if shard.state in ACTIVE and shard.placed is not None:
            use[(job.tenant, shard.placed.card_model, shard.region)] += placement_milli(shard.placed.bindings)
    return {k: v for k, v in use.items() if v}


async def test_quota_work_per_cycle_does_not_grow_with_running_shards():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=40)), ClusterSpec(B, node_list=nodes("b", count=40))),
                         reclaim_after_s=1e9)
    _governed(h)
    svc = h.svc
    quota_visits = []
    for batch in range(10):  # 10 x 50 one-GPU jobs start and keep running
        ids = [f"r{batch}-{k}" for k in range(50)]
        for k, job in enumerate(ids):
            h.submit(job, tenant=("search", "ads")[k % 2])
        await h.cycle()
        assert all(h.shard(j).state == ShardState.PLACED for j in ids)
        for job in ids:
            h.report(job, "job.started")
        h.submit(f"wait{batch}", gpus=8, workers=99)  # never fits: the next cycle still runs with quotas
        await h.cycle()
        quota_visits.append(svc.last_cycle_visit_counts.get("quota", 0))
    assert svc.counts[ShardState.RUNNING] == 500
    assert svc.view().quota is None  # (the view itself carries no book; the cycle adds it)
    # one per (tenant, card model, region) total: 2 tenants x 1 model x 1 region, never 500
    assert quota_visits[0] >= 1 and max(quota_visits) <= 2, quota_visits
    assert dict(svc._quota_use) == _recount(svc)
    book = svc.governor.quota_book_of_totals(svc._quota_use)
    used = sum(book.used.values())
    assert used == 500 * 1000  # every running GPU counted once (each rule covers its tenant's work)


async def test_quota_totals_equal_a_recount_through_starts_failures_reclaims_and_a_lost_cluster():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=2)), ClusterSpec(B, node_list=nodes("b", count=2))),
                         reclaim_after_s=20.0, stale_after_s=3.0)
    _governed(h)
    svc = h.svc

    def check() -> None:
        assert dict(svc._quota_use) == _recount(svc)

    for i in range(24):
        h.submit(f"j{i}", tenant=("search", "ads")[i % 2], gpus=1 + i % 3, retry_limit=3)
    for i in range(4):  # CPU-only jobs hold no GPU quota (two of one tenant and region: one key)
        h.submit(f"cpu{i}", tenant="search", gpus=0, gpu_milli=0)
    await h.cycle()
    check()
    assert svc._quota_use  # something is counted
    assert all(h.shard(f"cpu{i}").state == ShardState.PLACED for i in range(4))
    for i in range(4):  # they end one after another (the KeyError the replay found)
        h.report(f"cpu{i}", "job.started")
        h.report(f"cpu{i}", "job.finished")
    check()
    for i in range(0, 24, 2):
        if h.shard(f"j{i}").state == ShardState.PLACED:
            h.report(f"j{i}", "job.started")
    await h.cycle()
    check()
    for i in range(0, 12, 4):
        if h.shard(f"j{i}").state == ShardState.RUNNING:
            h.report(f"j{i}", "job.failed", reason="exit 1")
    for i in range(2, 12, 4):
        if h.shard(f"j{i}").state == ShardState.RUNNING:
            h.report(f"j{i}", "job.finished")
    await h.cycle()
    check()
    h.advance(25.0)  # unstarted placements are reclaimed and placed again
    await h.cycle()
    check()
    h.silence(B)
    h.advance(5.0)  # B is lost
    await h.cycle()
    check()
    h.cancel("j1")
    await h.cycle()
    check()
    expected = dict(svc._quota_use)
    data = svc.snapshot_bytes()
    h.restart(_governed_svc)  # a rebuilt scheduler (the whole stream read again) reaches the same totals
    assert dict(h.svc._quota_use) == expected == _recount(h.svc)
    twin = h._service()  # and so does one loaded from a checkpoint
    twin.restore(data)
    assert dict(twin._quota_use) == expected


def _request(job_id: str, n: int, expires_at: float):
    approval_id = f"ap-{job_id}-{n}"
    return make_event("approval.requested", ApprovalRequested(
        approval_id=approval_id, home_region="cn-north-1", proposed_region="cn-east-1",
        proposed_cluster="cn-east-1-c1", expires_at=to_datetime(expires_at)),
        producer="scheduler", occurred_at=GATE_NOW, tenant="ads", project="train", job_id=job_id, actor="scheduler")


def test_approval_expiries_look_only_at_the_due_requests():
    gov = tenancy_gate("approvals: {timeout_s: 60}\n")
    jobs = {f"j{i}": gate_entry(f"j{i}") for i in range(2000)}
    for i in range(2000):  # deadlines spread over 2000 s, one a second
        assert gov.apply(_request(f"j{i}", 0, GATE_NOW + 60 + i))
    assert gov.expiries(jobs, GATE_NOW + 59) == []
    assert gov.last_expiry_visits == 0  # nothing due: nothing looked at, 2000 open
    due = gov.expiries(jobs, GATE_NOW + 69.5)  # j0..j9 are due
    assert sorted(e.job_id for _, e, _ in due) == sorted(f"j{i}" for i in range(10))
    assert gov.last_expiry_visits == 10
    # decided meanwhile: j10 approved, j11's job ended and left; neither is expired
    approved = make_event("approval.approved", ApprovalDecided(approval_id="ap-j10-0", proposed_region="cn-east-1"),
                          producer="admission", occurred_at=GATE_NOW + 65, event_id=approval_outcome_id("ap-j10-0"),
                          tenant="ads", project="train", job_id="j10", actor="bob")
    assert gov.apply(approved)
    del jobs["j11"]
    due = gov.expiries(jobs, GATE_NOW + 72.5)  # j10..j12 come up; only j12 is expired
    assert [e.job_id for _, e, _ in due] == ["j12"]
    assert gov.last_expiry_visits == 3
    # j0..j9 were not read back: they are sent again RESEND_EXPIRY_S (5 s) after; j13, j14 fall due
    again = gov.expiries(jobs, GATE_NOW + 74.5)
    assert sorted(e.job_id for _, e, _ in again) == sorted([f"j{i}" for i in range(10)] + ["j13", "j14"])
    assert gov.last_expiry_visits == 12
    for _, e, _ in again + due:  # now read back: their requests are decided
        gov.apply(e)
    assert gov.expiries(jobs, GATE_NOW + 74.9) == [] and gov.last_expiry_visits == 0


def test_the_deadline_heap_is_rebuilt_from_a_checkpointed_state():
    gov = tenancy_gate("approvals: {timeout_s: 60}\n")
    jobs = {f"j{i}": gate_entry(f"j{i}") for i in range(5)}
    for i in range(5):
        gov.apply(_request(f"j{i}", 0, GATE_NOW + 60 + i))
    twin = tenancy_gate("approvals: {timeout_s: 60}\n")
    twin.state = gov.state  # as restore_scheduler loads it
    twin.index_pending()
    assert sorted(e.job_id for _, e, _ in twin.expiries(jobs, GATE_NOW + 62.5)) == ["j0", "j1", "j2"]
