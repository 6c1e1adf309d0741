"""Issue 15: the gateway and the metrics interceptor wrap a method's handler once, not per call,
and the wrapper still authenticates each call by its own metadata."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from fedsched import auth
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.errors import AuthError
from fedsched.metrics import AdmissionMetrics, GrpcMetricsInterceptor
from services.admission.service import GatewayInterceptor

METHOD = "/fedsched.api.v1.JobService/GetJob"


def _handler():
    async def get_job(request, context):
        return pb.Job(job_id=auth.current().name)

    return grpc.unary_unary_rpc_method_handler(get_job, request_deserializer=pb.GetJobRequest.FromString,
                                               response_serializer=pb.Job.SerializeToString)


class _Context:
    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.aborted = None

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def trailing_metadata(self):
        return ()

    def code(self):
        return None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def _authenticate(metadata) -> Principal:
    token = auth.bearer_token(metadata)
    if token not in ("alice-token", "bob-token"):
        raise AuthError("unknown or revoked token")
    return Principal(token.removesuffix("-token"), (Grant(role="admin"),))


async def test_the_gateway_wraps_a_method_once_and_authenticates_each_call_by_its_metadata():
    gateway = GatewayInterceptor(_authenticate)
    handler = _handler()

    async def continuation(details):
        return handler

    details = SimpleNamespace(method=METHOD, invocation_metadata=())
    first = await gateway.intercept_service(continuation, details)
    assert await gateway.intercept_service(continuation, details) is first
    answers = [await first.unary_unary(pb.GetJobRequest(job_id="x"), _Context(t)) for t in ("alice-token", "bob-token")]
    assert [a.job_id for a in answers] == ["alice", "bob"]
    refused = _Context("mallory-token")
    with pytest.raises(grpc.aio.AbortError):
        await first.unary_unary(pb.GetJobRequest(job_id="x"), refused)
    assert refused.aborted[0] == grpc.StatusCode.UNAUTHENTICATED
    handler = _handler()  # another handler for the method (e.g. a server re-registered it): wrapped anew
    assert await gateway.intercept_service(continuation, details) is not first


async def test_the_metrics_interceptor_wraps_a_method_once_and_counts_every_call():
    metrics = AdmissionMetrics()
    interceptor = GrpcMetricsInterceptor(metrics)
    handler = _handler()
    calls = []
    metrics.observe_call = lambda label, code, seconds: calls.append((label, code))

    async def continuation(details):
        return handler

    details = SimpleNamespace(method=METHOD, invocation_metadata=())
    first = await interceptor.intercept_service(continuation, details)
    assert await interceptor.intercept_service(continuation, details) is first
    token = auth.CURRENT.set(Principal("carol", ()))
    try:
        for _ in range(3):
            await first.unary_unary(pb.GetJobRequest(job_id="x"), _Context(""))
    finally:
        auth.CURRENT.reset(token)
    assert calls == [("JobService/GetJob", "OK")] * 3
