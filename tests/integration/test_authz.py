"""The authorization matrix: every role x every RPC of the four services, over real gRPC and NATS.

Targets are tenant ``search`` resources: a job of search/train placed on cn-north-1-c1 and a
pending cross-region approval request for it. "allowed" means the call passed authentication
and authorization (it may still fail for business reasons, e.g. FAILED_PRECONDITION, or
NOT_FOUND on an RPC that does not target the job); "denied" is PERMISSION_DENIED (the caller
may see the target but not do this); "hidden" is NOT_FOUND from a per-job RPC on the target
job, which exists: the caller may not see it and is answered as if it did not exist (issue 14);
"unauth" is UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.bus import Bus
from fedsched.clock import SystemClock, to_datetime
from fedsched.events import ApprovalRequested, JobPlaced, WorkerBinding, business_event_id, make_event
from fedapp.client import aio_channel
from fedsched.tenancy import to_yaml
from services.admission.service import AdmissionService
from tests.builders import Stubs, channel, policy_doc, store_policy, unique

ROLES = ("none", "bad-token", "alice", "carol", "bob", "agent1", "root")
#: who they are: no token; a token nobody holds; submitter of search; submitter of other tenants;
#: approver of search and ads; agent of cn-north-1-c1; admin
A, D, H, U = "allowed", "denied", "hidden", "unauth"

#: rpc -> expected outcome per role, in ROLES order
MATRIX: dict[str, tuple[str, ...]] = {
    "JobService.SubmitJob":          (U, U, A, D, D, D, A),
    "JobService.SubmitJobs":         (U, U, A, D, D, D, A),  # denied: the item's code (the call is OK)
    "JobService.GetJob":             (U, U, A, H, A, A, A),
    "JobService.ListJobs":           (U, U, A, D, A, D, A),
    "JobService.WatchJob":           (U, U, A, H, A, A, A),
    "JobService.ExplainJob":         (U, U, A, H, A, A, A),
    "JobService.GetJobLogs":         (U, U, A, H, A, A, A),  # like GetJob (then UNAVAILABLE: no agent here)
    "JobService.CancelJob":          (U, U, A, H, D, D, A),
    # bulk actions answer per job: PERMISSION_DENIED for a job the caller may see but not write,
    # NOT_FOUND for one it may not see (by ids, seeing is can_read: the agent too; see _select)
    "JobService.CancelJobs":         (U, U, A, H, D, H, A),
    "JobService.HoldJobs":           (U, U, A, H, D, H, A),
    "JobService.ReleaseJobs":        (U, U, A, H, D, H, A),
    "JobService.SetJobPriority":     (U, U, A, H, D, D, A),
    # capacity and service health: any authenticated principal
    "ClusterService.ListClusters":   (U, U, A, A, A, A, A),
    "SystemService.GetStatus":       (U, U, A, A, A, A, A),
    "TenantService.ListTenants":     (U, U, A, A, A, D, A),
    "TenantService.ListQuotas":      (U, U, A, D, A, D, A),
    "TenantService.PutTenant":       (U, U, D, D, D, D, A),
    "TenantService.SetQuota":        (U, U, D, D, D, D, A),
    "TenantService.DeleteQuota":     (U, U, D, D, D, D, A),
    "TenantService.PutPrincipal":    (U, U, D, D, D, D, A),
    "ApprovalService.ListApprovals": (U, U, D, D, A, D, A),
    "ApprovalService.Approve":       (U, U, D, D, A, D, A),
    "ApprovalService.Reject":        (U, U, D, D, A, D, A),
    "PolicyService.GetPolicy":       (U, U, D, D, D, D, A),
    "PolicyService.ListPolicyVersions": (U, U, D, D, D, D, A),
    "PolicyService.DiffPolicy":      (U, U, D, D, D, D, A),
    "PolicyService.ApplyPolicy":     (U, U, D, D, D, D, A),
}


class World:
    """The admission under test and the ids of its target job and approval."""

    svc: AdmissionService
    job_id: str
    approval_id: str
    yaml: str


@contextlib.asynccontextmanager
async def running_world(nats_url: str):
    """Admission on its own subject prefix with the targets in place."""
    bus = await Bus.connect(nats_url, unique("t"), name="test-authz")
    await bus.ensure_streams()
    await store_policy(bus, policy_doc("quotas: [{tenant: search, card: T4, region: cn-north-1, guaranteed_gpus: 4}]\n"))
    svc = AdmissionService(bus, SystemClock(), address="127.0.0.1:0")
    svc.known_models.add("nvidia-t4-16gb")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 20)
    w = World()
    w.svc = svc
    async with channel(svc.port, "alice") as ch:
        w.job_id = (await Stubs(ch).jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec()))).job_id
    spec = svc.view.jobs[w.job_id].spec
    placed = make_event("job.placed", JobPlaced(spec=spec, card_model="nvidia-t4-16gb",
                                                bindings=(WorkerBinding(worker=0, node="n1", gpu_indices=(0,),
                                                                        gpu_milli=1000),)),
                        producer="scheduler", occurred_at=time.time(), event_id=business_event_id(w.job_id, 1, "p"),
                        region="cn-north-1", cluster="cn-north-1-c1", tenant="search", project="train",
                        job_id=w.job_id, attempt=1)
    await bus.publish(bus.subjects.placements("cn-north-1", "cn-north-1-c1"), placed)
    w.approval_id = "ap-" + "1" * 20
    request = make_event("approval.requested", ApprovalRequested(
        approval_id=w.approval_id, home_region="cn-north-1", proposed_region="cn-east-1",
        proposed_cluster="cn-east-1-c1", expires_at=to_datetime(time.time() + 3600)),
        producer="scheduler", occurred_at=time.time(), tenant="search", project="train", job_id=w.job_id,
        actor="scheduler")
    await bus.publish(bus.subjects.approval("search", "train"), request)
    for _ in range(200):
        if w.approval_id in svc.approvals.by_id and svc.view.jobs[w.job_id].current is not None:
            break
        await asyncio.sleep(0.02)
    w.yaml = to_yaml(svc.policy.current.doc)
    try:
        yield w
    finally:
        svc.stop()
        await task
        await bus.close()


@pytest.fixture(scope="module")
async def world(nats_server):
    async with running_world(nats_server.url) as w:
        yield w


def _spec(**kw) -> pb.JobSpec:
    return pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000, card_models=["T4"], **kw)


def _call(s: Stubs, rpc: str, w: World):
    """The coroutine making ``rpc`` against the search targets."""
    calls = {
        "JobService.SubmitJob": lambda: s.jobs.SubmitJob(pb.SubmitJobRequest(spec=_spec())),
        "JobService.SubmitJobs": lambda: _batch(s),
        "JobService.GetJob": lambda: s.jobs.GetJob(pb.GetJobRequest(job_id=w.job_id)),
        "JobService.ListJobs": lambda: s.jobs.ListJobs(pb.ListJobsRequest(tenant="search")),
        "JobService.WatchJob": lambda: _first(s.jobs.WatchJob(pb.WatchJobRequest(job_id=w.job_id))),
        "JobService.ExplainJob": lambda: s.jobs.ExplainJob(pb.ExplainJobRequest(job_id=w.job_id)),
        "JobService.GetJobLogs": lambda: _first(s.jobs.GetJobLogs(pb.GetJobLogsRequest(job_id=w.job_id))),
        "JobService.CancelJob": lambda: s.jobs.CancelJob(pb.CancelJobRequest(job_id=w.job_id)),
        **{f"JobService.{m}": (lambda m=m: _bulk(getattr(s.jobs, m)(pb.BulkJobsRequest(
            selector=pb.JobSelector(job_ids=[w.job_id]), dry_run=True))))
           for m in ("CancelJobs", "HoldJobs", "ReleaseJobs")},
        "JobService.SetJobPriority": lambda: s.jobs.SetJobPriority(pb.SetJobPriorityRequest(
            job_id=w.job_id, priority=pb.PRIORITY_CLASS_HIGH)),
        "ClusterService.ListClusters": lambda: s.clusters.ListClusters(pb.ListClustersRequest()),
        "SystemService.GetStatus": lambda: s.system.GetStatus(pb.GetStatusRequest()),
        "TenantService.ListTenants": lambda: s.tenants.ListTenants(gpb.ListTenantsRequest()),
        "TenantService.ListQuotas": lambda: s.tenants.ListQuotas(gpb.ListQuotasRequest(tenant="search")),
        "TenantService.PutTenant": lambda: s.tenants.PutTenant(gpb.PutTenantRequest(tenant=gpb.Tenant(
            name="search", home_region="cn-north-1", projects=["train", "serve", "batch"]))),
        "TenantService.SetQuota": lambda: s.tenants.SetQuota(gpb.SetQuotaRequest(quota=gpb.Quota(
            tenant="search", card="T4", region="cn-north-1", guaranteed_gpus=4))),
        "TenantService.DeleteQuota": lambda: s.tenants.DeleteQuota(gpb.DeleteQuotaRequest(
            tenant="search", card="A100", region="cn-east-1")),
        "TenantService.PutPrincipal": lambda: s.tenants.PutPrincipal(gpb.PutPrincipalRequest(
            name="newbie", roles=[gpb.RoleGrant(role="submitter", tenants=["search"])])),
        "ApprovalService.ListApprovals": lambda: s.approvals.ListApprovals(gpb.ListApprovalsRequest(tenant="search")),
        "ApprovalService.Approve": lambda: s.approvals.Approve(gpb.DecideApprovalRequest(approval_id=w.approval_id)),
        "ApprovalService.Reject": lambda: s.approvals.Reject(gpb.DecideApprovalRequest(approval_id=w.approval_id)),
        "PolicyService.GetPolicy": lambda: s.policy.GetPolicy(gpb.GetPolicyRequest()),
        "PolicyService.ListPolicyVersions": lambda: s.policy.ListPolicyVersions(gpb.ListPolicyVersionsRequest()),
        "PolicyService.DiffPolicy": lambda: s.policy.DiffPolicy(gpb.ApplyPolicyRequest(yaml=w.yaml)),
        "PolicyService.ApplyPolicy": lambda: s.policy.ApplyPolicy(gpb.ApplyPolicyRequest(yaml=w.yaml)),
    }
    return calls[rpc]()


async def _bulk(call):
    """A bulk action's answer for one job, as an RPC outcome: its per-job PERMISSION_DENIED or
    NOT_FOUND (a job the caller may not see) is raised with that code."""
    resp = await call
    for code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND):
        if resp.results and resp.results[0].code == code.value[0]:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), resp.results[0].message)
    return resp


class _ItemDenied(Exception):
    """A SubmitJobs item refused with PERMISSION_DENIED (the call itself succeeds)."""


async def _batch(s: Stubs):
    resp = await s.jobs.SubmitJobs(pb.SubmitJobsRequest(items=[pb.SubmitJobRequest(spec=_spec())]))
    if resp.results[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0]:
        raise _ItemDenied(resp.results[0].message)
    assert resp.results[0].code == 0, resp.results[0].message
    return resp


async def _first(stream):
    try:
        return await stream.read()
    finally:
        stream.cancel()


def _channel(port: int, role: str) -> grpc.aio.Channel:
    if role == "bad-token":
        return aio_channel(f"127.0.0.1:{port}", "tok-nobody-has-this")
    return channel(port, None if role == "none" else role)


#: RPCs aimed at the target job (which exists): NOT_FOUND from them means "hidden"
PER_JOB = frozenset(rpc for rpc in MATRIX if rpc.startswith("JobService.") and rpc not in (
    "JobService.SubmitJob", "JobService.SubmitJobs", "JobService.ListJobs"))


async def outcome(w: World, rpc: str, role: str) -> tuple[str, str]:
    """(allowed / denied / hidden / unauth, the status code name)."""
    async with _channel(w.svc.port, role) as ch:
        try:
            await _call(Stubs(ch), rpc, w)
            return A, "OK"
        except _ItemDenied:
            return D, "PERMISSION_DENIED (item)"
        except grpc.aio.AioRpcError as e:
            code = e.code()
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (rpc, role, code)
    if code == grpc.StatusCode.NOT_FOUND and rpc in PER_JOB:
        return H, code.name
    return {grpc.StatusCode.PERMISSION_DENIED: D, grpc.StatusCode.UNAUTHENTICATED: U}.get(code, A), code.name


CASES = [(rpc, role, MATRIX[rpc][i]) for rpc in MATRIX for i, role in enumerate(ROLES)]


@pytest.mark.parametrize("rpc,role,expected", CASES, ids=[f"{r}-{who}" for r, who, _ in CASES])
async def test_role_x_rpc(world, rpc, role, expected):
    got, code = await outcome(world, rpc, role)
    assert got == expected, f"{role} calling {rpc}: {code}"


def test_the_matrix_covers_every_rpc_of_every_service():
    from fedsched.api.v1 import governance_pb2, jobs_pb2
    rpcs = {f"{s.name}.{m.name}" for d in (jobs_pb2.DESCRIPTOR, governance_pb2.DESCRIPTOR)
            for s in d.services_by_name.values() for m in s.methods}
    assert rpcs == set(MATRIX)


async def _answer(w: World, rpc: str, job_id: str) -> tuple[grpc.StatusCode, str, tuple]:
    """carol's (another tenant's submitter) answer to ``rpc`` on ``job_id``: code, details,
    trailing metadata."""
    target = World()
    target.svc, target.job_id, target.approval_id, target.yaml = w.svc, job_id, w.approval_id, w.yaml
    async with _channel(w.svc.port, "carol") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(Stubs(ch), rpc, target)
    e = info.value
    return e.code(), e.details(), tuple(e.trailing_metadata() or ())


@pytest.mark.parametrize("rpc", sorted(PER_JOB - {"JobService.CancelJobs", "JobService.HoldJobs",
                                                 "JobService.ReleaseJobs"}))
async def test_another_tenants_job_is_answered_exactly_like_a_job_that_does_not_exist(world, rpc):
    """No existence leak: the same code, details (but for the id asked) and trailing metadata."""
    missing = "j-" + "0" * 20
    assert missing not in world.svc.view.jobs
    code, details, trailers = await _answer(world, rpc, world.job_id)
    code_missing, details_missing, trailers_missing = await _answer(world, rpc, missing)
    assert code == code_missing == grpc.StatusCode.NOT_FOUND
    assert details.encode() == details_missing.replace(missing, world.job_id).encode()
    assert trailers == trailers_missing
