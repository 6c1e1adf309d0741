"""Governance end to end: the whole embedded system (real NATS, real chDB, trace agents for the
openb cluster split) under one test policy, checked through the gRPC API and the audit table.

* quota: search may hold 2 GPUs; 4 one-GPU jobs -> 2 wait (quota_exceeded) and start when the
  first ones finish; never more than 2 GPUs at once;
* budget: vision has 0.1 CNY a month; a job whose two failed attempts (retry budget) are billed
  exhausts it, and new submissions are refused naming the budget;
* approvals: ads needs approval to leave cn-north-1, and asks for A10 cards, which only other
  regions have: approve -> placed cross-region; reject -> stays home; timeout -> falls back
  home; every request and decision audited with actor and policy version.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.clock import ClockState, ReplayClock
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from tests.builders import DATA, TENANTS, Stubs, channel, policy_text, unique

pytestmark = pytest.mark.e2e

SPEED = 120.0  # business seconds per wall second
TIMEOUT_S = 360.0  # approval timeout (business seconds): 3 s wall
POLICY = policy_text(
    "quotas: [{tenant: search, card: \"*\", region: \"*\", guaranteed_gpus: 2}]\n"
    f"approvals: {{timeout_s: {TIMEOUT_S}}}\n",
    tenants=TENANTS.replace("{name: vision, home_region: cn-south-1, projects: [train, serve, batch]}",
                            "{name: vision, home_region: cn-south-1, projects: [train, serve, batch], "
                            "budget: {monthly: \"0.1\"}}"))


@pytest.fixture(scope="module")
async def system(nats_server, chdb_path, tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("gov"), nats_url=nats_server.url, subject_prefix=unique("g"),
                        clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.2)
    clock = ReplayClock(ClockState(time.time(), time.time(), SPEED, 1))
    system = System(SystemOptions(settings=settings, clock=clock, nodes_csv=DATA / "openb_node_list_gpu_node.csv",
                                  policy_text=POLICY))
    await system.start()
    for _ in range(200):
        if len(system.scheduler.clusters) == 6 and system.admission.known_models:
            break
        await asyncio.sleep(0.05)
    yield system
    await system.stop()


def _spec(tenant: str, project: str, runtime_s: float, **kw) -> pb.JobSpec:
    annotations = {"trace.runtime_s": str(runtime_s), **kw.pop("annotations", {})}
    return pb.JobSpec(tenant=tenant, project=project, gpus_per_worker=1, cpu_milli=1000, annotations=annotations, **kw)


async def _wait_job(stub, job_id: str, pred, timeout=30.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if pred(job):
            return job
        assert time.monotonic() < deadline, f"{job_id} stuck: {pb.JobState.Name(job.state)} {job.reason}"
        await asyncio.sleep(0.05)


async def _events(system: System, where: str, params: dict | None = None) -> list[tuple]:
    await system.drain_writers(timeout_s=30)
    db = system.settings.clickhouse_database
    return system.sync_store.query(f"SELECT type, actor, policy_version, region, job_id, payload, occurred_at "
                                   f"FROM {db}.events WHERE {where} ORDER BY occurred_at, type", params or {}).rows


async def test_jobs_beyond_quota_wait_and_start_when_earlier_ones_finish(system):
    async with channel(system.grpc_target, "alice") as ch:
        s = Stubs(ch)
        ids = [(await s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec("search", "train", 120)))).job_id
               for _ in range(4)]
        done = [await _wait_job(s.jobs, j, lambda j: j.state == pb.JOB_STATE_SUCCEEDED) for j in ids]
        quotas = await s.tenants.ListQuotas(gpb.ListQuotasRequest(tenant="search"))
    assert all(len(j.attempts) == 1 for j in done)
    assert [q.guaranteed_gpus for q in quotas.quotas] == [2.0]
    rows = await _events(system, "job_id IN {ids:Array(String)} AND type IN ('job.started', 'job.finished')",
                         {"ids": ids})
    spans: dict[str, dict] = {}
    for type_, _, _, _, job_id, _, at in rows:
        spans.setdefault(job_id, {})[type_] = at
    pend = system.sync_store.query(
        f"SELECT job_id, reason, detail FROM {system.settings.clickhouse_database}.decisions "
        f"WHERE outcome = 'pending' AND job_id IN {{ids:Array(String)}}", {"ids": ids}).rows
    held = {j for j, reason, _ in pend if "quota_exceeded" in reason}
    assert len(held) >= 2, pend  # at least the two beyond the quota waited for it
    assert all("quota search/*/*: 2 GPU in use" in detail for _, _, detail in pend)  # naming the quota
    moments = sorted([(s["job.started"], 1) for s in spans.values()] + [(s["job.finished"], -1) for s in spans.values()],
                     key=lambda m: (m[0], m[1]))
    running = peak = 0
    for _, delta in moments:
        running += delta
        peak = max(peak, running)
    assert peak == 2  # never more than the 2 GPUs of the quota, and the quota was used
    first_end = min(s["job.finished"] for s in spans.values())
    assert sum(1 for s in spans.values() if s["job.started"] >= first_end) == 2


async def test_a_budget_spent_by_billed_retries_refuses_new_submissions(system):
    async with channel(system.grpc_target, "carol") as ch:
        s = Stubs(ch)
        # estimated at 1 s (a worst case well inside the 0.1 CNY budget), it runs 120 s and fails twice
        spec = _spec("vision", "batch", 120, retry_limit=1, card_models=["T4"], locality=pb.LOCALITY_MUST_LOCAL,
                     annotations={"trace.outcome": "failed"}, estimated_duration_seconds=1)
        first = await s.jobs.SubmitJob(pb.SubmitJobRequest(spec=spec))
        failed = await _wait_job(s.jobs, first.job_id, lambda j: j.state == pb.JOB_STATE_FAILED)
        assert [a.outcome for a in failed.attempts] == ["failed", "failed"]  # the retry ran too
        deadline = time.monotonic() + 20
        while True:
            try:
                await s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec("vision", "batch", 60,
                                                                      estimated_duration_seconds=1)))
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details().startswith("budget.vision:")
                break
            assert time.monotonic() < deadline, "the budget was never exhausted"
            await asyncio.sleep(0.1)
        tenants = await s.tenants.ListTenants(gpb.ListTenantsRequest())
    vision = next(t for t in tenants.tenants if t.name == "vision")
    assert float(vision.month_spend) >= 0.1 and vision.budget.monthly == "0.1"
    db = system.settings.clickhouse_database
    await system.drain_writers()
    costs = system.sync_store.query(f"SELECT attempt, outcome, cost FROM {db}.usage WHERE job_id = {{j:String}} "
                                    f"ORDER BY attempt", {"j": first.job_id}).rows
    assert [(a, o) for a, o, _ in costs] == [(1, "failed"), (2, "failed")]
    assert float(sum(c for _, _, c in costs)) >= 0.1  # both attempts' cost counted against the budget
    refused = await _events(system, "type = 'submission.rejected' AND tenant = 'vision'")
    assert refused and json.loads(refused[-1][5])["field"] == "budget.vision" and refused[-1][1] == "carol"


async def _awaiting(s: Stubs, job_id: str) -> gpb.Approval:
    await _wait_job(s.jobs, job_id, lambda j: j.state == pb.JOB_STATE_AWAITING_APPROVAL)
    listed = await s.approvals.ListApprovals(gpb.ListApprovalsRequest(tenant="ads"))
    return next(a for a in listed.approvals if a.job_id == job_id and a.state == gpb.APPROVAL_STATE_PENDING)


async def test_cross_region_approval_approve_reject_and_timeout(system):
    gov_version = system.admission.policy.version
    async with channel(system.grpc_target, "carol") as submitter, channel(system.grpc_target, "bob") as approver:
        sub, appr = Stubs(submitter), Stubs(approver)
        # A10 cards exist only in cn-east-1 and cn-south-1; ads lives in cn-north-1 and needs approval
        jobs = {}
        for case in ("approve", "reject", "timeout"):
            spec = _spec("ads", "train", 6000, card_models=["A10"], estimated_duration_seconds=3600)
            jobs[case] = (await sub.jobs.SubmitJob(pb.SubmitJobRequest(spec=spec))).job_id
        requests = {case: await _awaiting(appr, job_id) for case, job_id in jobs.items()}
        for a in requests.values():
            assert a.home_region == "cn-north-1" and a.proposed_region in ("cn-east-1", "cn-south-1")
            assert "home region cn-north-1" in a.reason and "requires approval" in a.reason
            assert a.cost and a.currency == "CNY" and a.policy_version == gov_version
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a submitter cannot approve
            await sub.approvals.Approve(gpb.DecideApprovalRequest(approval_id=requests["approve"].approval_id))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        approved = await appr.approvals.Approve(gpb.DecideApprovalRequest(
            approval_id=requests["approve"].approval_id, comment="east is idle"))
        rejected = await appr.approvals.Reject(gpb.DecideApprovalRequest(
            approval_id=requests["reject"].approval_id, comment="data must stay"))
        assert approved.state == gpb.APPROVAL_STATE_APPROVED and approved.decided_by == "bob"
        assert rejected.state == gpb.APPROVAL_STATE_REJECTED
        with pytest.raises(grpc.aio.AioRpcError) as e:  # decided once only
            await appr.approvals.Reject(gpb.DecideApprovalRequest(approval_id=requests["approve"].approval_id))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        running = await _wait_job(sub.jobs, jobs["approve"], lambda j: j.state == pb.JOB_STATE_RUNNING)
        assert running.region == requests["approve"].proposed_region and running.attempts[0].cross_region
        stays = await _wait_job(sub.jobs, jobs["reject"], lambda j: "outside_home_region" in j.reason)
        assert stays.state == pb.JOB_STATE_QUEUED and not stays.attempts
        fell_back = await _wait_job(sub.jobs, jobs["timeout"], lambda j: "outside_home_region" in j.reason,
                                    timeout=TIMEOUT_S / SPEED + 20)
        assert fell_back.state == pb.JOB_STATE_QUEUED and not fell_back.attempts
        expired = await appr.approvals.ListApprovals(gpb.ListApprovalsRequest(
            tenant="ads", states=[gpb.APPROVAL_STATE_EXPIRED]))
        assert [a.job_id for a in expired.approvals] == [jobs["timeout"]]
        for job_id in (jobs["reject"], jobs["timeout"]):
            await sub.jobs.CancelJob(pb.CancelJobRequest(job_id=job_id))

    rows = await _events(system, "job_id IN {ids:Array(String)} AND (type LIKE 'approval.%' OR type = 'job.placed')",
                         {"ids": list(jobs.values())})
    by_job = {case: [(t, actor, v, region) for t, actor, v, region, job_id, _, _ in rows if job_id == jobs[case]]
              for case in jobs}
    audit = {case: [(t, a, v) for t, a, v, _ in evs] for case, evs in by_job.items()}
    assert audit["approve"][:2] == [("approval.requested", "scheduler", gov_version),
                                    ("approval.approved", "bob", gov_version)]
    placed = [e for e in by_job["approve"] if e[0] == "job.placed"]
    assert len(placed) == 1 and placed[0][3] == requests["approve"].proposed_region
    assert placed[0][2].endswith("/" + gov_version)  # the decision records scheduler rules + governance version
    assert audit["reject"] == [("approval.requested", "scheduler", gov_version),
                               ("approval.rejected", "bob", gov_version)]
    assert audit["timeout"] == [("approval.requested", "scheduler", gov_version),
                                ("approval.expired", "scheduler", gov_version)]
