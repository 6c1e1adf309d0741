"""The console as a client of admission's gRPC API, with the signed-in user's bearer token.

Every call carries that user's token, so what a page shows and what a button does is authorised
exactly as the API authorises it (``fedsched.auth`` roles): the console holds no rights of its
own. One channel serves every user; the token travels as per-call metadata
(:func:`fedapp.client.call_metadata`).

Errors: a failed call raises :class:`ApiError` carrying the gRPC status and the HTTP status the
console answers with (:data:`HTTP_STATUS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from fedapp.client import TlsClient, aio_channel, call_metadata
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.errors import AuthError

#: gRPC status -> the HTTP status the console answers with (others: 502).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ApiError(Exception):
    """A gRPC call failed.

    Attributes:
        code: the gRPC status code.
        message: the server's details (for people).
        field: the request field the server named (its ``fedsched-field`` trailer, e.g.
            ``page_token``; "" = none).
        http_status: what the console answers (:data:`HTTP_STATUS`, else 502).
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.http_status = HTTP_STATUS.get(code, 502)


@dataclass(frozen=True)
class ApiConfig:
    """Where admission serves: ``target`` (``host:port``), TLS if any, and the per-call deadline
    (seconds)."""

    target: str
    tls: TlsClient | None = None
    timeout_s: float = 10.0


class Api:
    """Typed calls to admission for one process; each method takes the user's ``token``.

    Raises (every method):
        ApiError: the call failed (carries the gRPC code); a token that cannot be sent (spaces,
            non-ASCII) is UNAUTHENTICATED.
    """

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.channel = aio_channel(config.target, None, tls=config.tls)
        self.jobs = pb_grpc.JobServiceStub(self.channel)
        self.clusters = pb_grpc.ClusterServiceStub(self.channel)
        self.tenants = gpb_grpc.TenantServiceStub(self.channel)
        self.approvals = gpb_grpc.ApprovalServiceStub(self.channel)
        self.policy = gpb_grpc.PolicyServiceStub(self.channel)

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()

    async def _call(self, method, request, token: str):
        try:
            metadata = call_metadata(token)
        except AuthError as e:
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, e.message) from None
        try:
            return await method(request, metadata=metadata, timeout=self.config.timeout_s)
        except grpc.aio.AioRpcError as e:
            field = next((str(v) for k, v in (e.trailing_metadata() or ()) if k == "fedsched-field"), "")
            raise ApiError(e.code(), e.details() or e.code().name, field) from None

    async def list_jobs(self, token: str, request: pb.ListJobsRequest) -> pb.ListJobsResponse:
        """``JobService.ListJobs``."""
        return await self._call(self.jobs.ListJobs, request, token)

    async def get_job(self, token: str, job_id: str) -> pb.Job:
        """``JobService.GetJob``."""
        return await self._call(self.jobs.GetJob, pb.GetJobRequest(job_id=job_id), token)

    async def explain(self, token: str, job_id: str) -> pb.ExplainJobResponse:
        """``JobService.ExplainJob``: every cluster's verdict for each shard."""
        return await self._call(self.jobs.ExplainJob, pb.ExplainJobRequest(job_id=job_id), token)

    async def list_clusters(self, token: str) -> pb.ListClustersResponse:
        """``ClusterService.ListClusters``: capacity per cluster and queue lengths."""
        return await self._call(self.clusters.ListClusters, pb.ListClustersRequest(), token)

    async def list_tenants(self, token: str) -> gpb.ListTenantsResponse:
        """``TenantService.ListTenants``: the tenants the user may read."""
        return await self._call(self.tenants.ListTenants, gpb.ListTenantsRequest(), token)

    async def list_approvals(self, token: str, states=(), page_size: int = 200, *, newest_first: bool = False,
                             page_token: str = "") -> gpb.ListApprovalsResponse:
        """``ApprovalService.ListApprovals`` for every tenant the user approves for: one page
        (oldest request first, or newest decision first), continued with ``page_token``."""
        order = gpb.APPROVAL_ORDER_NEWEST_FIRST if newest_first else gpb.APPROVAL_ORDER_OLDEST_FIRST
        return await self._call(self.approvals.ListApprovals,
                                gpb.ListApprovalsRequest(states=list(states), page_size=page_size, order=order,
                                                         page_token=page_token), token)

    async def decide(self, token: str, approval_id: str, approve: bool, comment: str = "") -> gpb.Approval:
        """``ApprovalService.Approve`` (``approve``) or ``Reject``."""
        method = self.approvals.Approve if approve else self.approvals.Reject
        return await self._call(method, gpb.DecideApprovalRequest(approval_id=approval_id, comment=comment), token)

    async def policy_versions(self, token: str, limit: int = 50) -> gpb.ListPolicyVersionsResponse:
        """``PolicyService.ListPolicyVersions`` (admins), newest first."""
        return await self._call(self.policy.ListPolicyVersions, gpb.ListPolicyVersionsRequest(limit=limit), token)
