"""The admission service: the governed gRPC front door.

It serves ``fedsched.api.v1.JobService`` and the governance services (``TenantService``,
``ApprovalService``, ``PolicyService``: :mod:`services.admission.admin_servicers`) on one port.

Every call of those services is authenticated by :class:`GatewayInterceptor`: the bearer token
in the ``authorization`` metadata is hashed and looked up in the governance policy in force
(:mod:`fedsched.tenancy`); a missing or unknown token is UNAUTHENTICATED, and each handler
checks the caller's roles (:mod:`fedsched.auth`), refusing with PERMISSION_DENIED. Tokens are
never logged. Health and reflection stay open (no token). Optional TLS, with client
certificates required when a client CA is given (mTLS).

A submission is validated (known tenant and project, sane resources, canonical card models,
names by the naming rules, limits of the policy), checked against the tenant's cross-region
policy (a job may narrow it, never widen it), its quota (a job that could never fit is
refused) and its budget (:mod:`services.admission.rules`; the check and the hold of the job's
worst-case cost are one step, so concurrent submissions never hold more than the budget:
:meth:`JobServicer._check_and_hold`), then gets its job id and is published as
``job.submitted`` stamped with the policy version. Bad input gets INVALID_ARGUMENT
whose message starts with the offending field (also in trailing metadata ``fedsched-field``);
quota and budget refusals get RESOURCE_EXHAUSTED naming the limit (``fedsched-limit``); a GPU
job that no cluster of the agents' latest inventory could ever hold in the regions it may use
(card model absent, gang larger than any cluster) gets FAILED_PRECONDITION with the reason.
A queued job the scheduler finds unplaceable holds no budget while it stays so.
Refusals are published as ``submission.rejected`` so the audit log has the submission success
rate.

``SubmitJobs`` takes up to :data:`MAX_BATCH` submissions and puts each through the same path
(:meth:`JobServicer._admit`: validation, governance, idempotency, quota, budget hold), answering
per item (code and message naming the field); the accepted items' events are published
together. A ``dry_run`` submission goes through that path without a budget hold and publishes
nothing: its ``verdict`` says what a submit would do, and ``what_if`` is the scheduler's
decision for it on its current view (:mod:`fedsched.whatif`; unset when no scheduler answers).
Every submit answers with its trace id, in ``trace_id`` and the trailing metadata ``x-trace-id``
(the caller's ``traceparent`` trace, else a new one the published events carry too).

Group commit (issue 15): single ``SubmitJob`` calls of tenants without a budget are published
together -- those arriving while a group is being published, or in the same turn of the event
loop, form the next group (at most :data:`GROUP_MAX`; a lone call is not held back), which makes
one ended-jobs lookup and one pipelined publish (:meth:`JobServicer._publish_batch`, the code of
``SubmitJobs``); each call is answered from its own item (:meth:`JobServicer._grouped`).

Idempotency: with a ``request_id``, the job id and the event id are derived from the caller's
key (principal, tenant, project, request_id: :func:`request_job_id`), so concurrent retries
publish the same message id (JetStream keeps one) and later retries find the job in the view's
request index (before quota and budget, so a retry returns the same job even if the budget ran
out meanwhile). Another caller or project using the same request id gets a job of its own; the
same key with a different spec is ALREADY_EXISTS (naming the job only to a caller who may read it).
"""

from __future__ import annotations

import asyncio
import nats.js.errors
import contextlib
import contextvars
import fnmatch
import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context

from fedsched import auth, snapshots, telemetry
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import governance_pb2_grpc as gpb_grpc
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.auth import Principal
from fedsched.bus import EXPECT_SEQUENCE, EXPECT_SUBJECT, Bus, Delivery, StreamFollower
from fedsched.snapshots import SnapshotStore
from fedsched.lease import read_tenure
from fedsched.trust import Rejection, check_subject, dead_letter_room, rejection_events
from fedsched.clock import Clock, SystemClock
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.errors import (AlreadyExistsError, AuthError, ConflictError, FedError, NotFoundError,
                             PayloadTooLargeError, PermissionDeniedError, QuotaExceededError, SequenceConflictError,
                             UnavailableError, ValidationError)
from fedsched.gctune import YOUNG_THRESHOLD, tune_for_service
from fedsched.events import InventorySnapshot, JobCancelRequested, JobHeld, JobPriorityChanged, JobSubmitted, \
    SubmissionRejected, Subjects, business_event_id, make_event
from fedsched.events import APPROVAL_OUTCOMES, Envelope, EventType, random_event_id
from fedsched.tenancy import Governance
from fedsched.topology import KnownNames
from fedsched.whatif import WhatIfReply, WhatIfRequest, request_what_if
from fedsched.jobs import TERMINAL_STATES, JobSpec, JobState
from fedsched.logs import LogRequest, request_logs
from fedsched.metrics import AdmissionMetrics, WrappingInterceptor
from fedsched.naming import check_name, is_name
from fedsched.policystore import PolicyFollower, PolicyHolder
from fedsched.ports import Publisher, retryable
from fedsched.pricing import PriceCatalog, load_price_catalog
from services.admission.admin_servicers import ApprovalServicer, PolicyServicer, TenantServicer
from services.admission.approvalview import ApprovalView
from services.admission.budgets import BudgetHolds, SpendBook, SpendWatcher
from services.admission.convert import (PRIORITY_FROM_PB, STATE_FROM_PB, STATE_TO_PB, Limits, _ts,
                                        refuse_unknown_fields, spec_from_pb, spec_to_pb)
from services.admission.clusterview import ClusterView
from services.admission.ended import EndedJobs
from services.admission.snapshot import STATE_VERSION as ADMISSION_STATE_VERSION
from services.admission.snapshot import admission_state, restore_admission
from services.admission.jobview import Decision, JobRecord, JobView
from services.admission.listing import FilterNames, list_page
from services.admission.ops_servicers import ClusterServicer, SystemServicer
from services.admission.rules import (ClusterCapacity, check_budget, check_can_ever_run, check_quota_can_fit,
                                      worst_case_cost)

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.admission")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JobService"].full_name
GOVERNANCE_SERVICES = tuple(gpb.DESCRIPTOR.services_by_name[n].full_name
                            for n in ("TenantService", "ApprovalService", "PolicyService"))
#: read-only operator services (:mod:`services.admission.ops_servicers`): any authenticated principal
OPS_SERVICES = tuple(pb.DESCRIPTOR.services_by_name[n].full_name for n in ("ClusterService", "SystemService"))
GUARDED = (SERVICE_NAME, *GOVERNANCE_SERVICES, *OPS_SERVICES)  #: services whose every call needs a token
_GUARDED_PREFIXES = tuple(f"/{s}/" for s in GUARDED)

#: Methods of the guarded services that change state. Their requests are refused
#: (INVALID_ARGUMENT naming the field number) when they carry a field this server does not know
#: or one with the wrong wire type (:func:`~services.admission.convert.refuse_unknown_fields`);
#: the other methods are read-only (:data:`READ_ONLY`) and ignore unknown fields, so a newer
#: client can still read from an older server. Every method is in exactly one of the two sets
#: (a unit test checks the service descriptors).
MUTATING = frozenset({"JobService/SubmitJob", "JobService/CancelJob", "JobService/SubmitJobs",
                      "JobService/CancelJobs", "JobService/HoldJobs", "JobService/ReleaseJobs",
                      "JobService/SetJobPriority", "TenantService/PutTenant",
                      "TenantService/SetQuota", "TenantService/DeleteQuota", "TenantService/PutPrincipal",
                      "ApprovalService/Approve", "ApprovalService/Reject", "PolicyService/ApplyPolicy"})
READ_ONLY = frozenset({"JobService/GetJob", "JobService/ListJobs", "JobService/WatchJob", "JobService/ExplainJob",
                       "JobService/GetJobLogs",
                       "TenantService/ListTenants", "TenantService/ListQuotas", "ApprovalService/ListApprovals",
                       "PolicyService/GetPolicy", "PolicyService/DiffPolicy", "PolicyService/ListPolicyVersions",
                       "ClusterService/ListClusters", "SystemService/GetStatus"})

_CODES: list[tuple[type[FedError], grpc.StatusCode]] = [
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),  # a request whose event the bus cannot carry
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (QuotaExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(error: FedError) -> grpc.StatusCode:
    """The gRPC status code of a project error (see :mod:`fedsched.errors`)."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


class _Undecodable:
    """Stands in for a request body that is not a valid message of its type."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf DecodeError and friends
            return _Undecodable(e)

    return parse


def authenticator(holder: PolicyHolder):
    """``authenticate(metadata) -> Principal`` against the policy in ``holder``."""

    def authenticate(metadata) -> Principal:
        gov = holder.current
        if gov is None:
            raise UnavailableError("no governance policy applied yet; nothing can be authenticated")
        principal = gov.authenticate(auth.bearer_token(metadata))
        if principal is None:
            raise AuthError("unknown or revoked token")
        return principal

    return authenticate


class GatewayInterceptor(WrappingInterceptor):
    """Authenticates every call of the guarded services, continues the caller's trace
    (``traceparent`` metadata) in a server span, and maps :class:`~fedsched.errors.FedError` to
    status codes (the field in trailing metadata ``fedsched-field``, a quota or budget in
    ``fedsched-limit``). A request body that does not parse, or a request of a mutating method
    (:data:`MUTATING`) carrying an unknown field or a field with the wrong wire type, is
    INVALID_ARGUMENT; anything else
    unexpected is logged and reported as INTERNAL without internals.

    Args:
        authenticate: ``metadata -> Principal``; raises AuthError / UnavailableError.
    """

    def __init__(self, authenticate) -> None:
        super().__init__()
        self.authenticate = authenticate

    def takes(self, method: str, handler) -> bool:
        return method.startswith(_GUARDED_PREFIXES)

    def wrap(self, full_method: str, handler):
        """``handler`` of ``full_method`` (``/pkg.Service/Method``) behind the gateway; the
        call's metadata (token, ``traceparent``) is read from its context."""
        service, method = full_method.lstrip("/").rsplit("/", 1)
        span_name = f"{service.rsplit('.', 1)[-1]}/{method}"
        authenticate = self.authenticate

        async def _fail(context, e: Exception) -> None:
            if isinstance(e, FedError):
                trailing = []
                if getattr(e, "field", ""):
                    trailing.append(("fedsched-field", e.field))
                if getattr(e, "limit", ""):
                    trailing.append(("fedsched-limit", e.limit))
                if trailing:  # after what the handler set (the submit's x-trace-id)
                    context.set_trailing_metadata(tuple(context.trailing_metadata() or ()) + tuple(trailing))
                await context.abort(status_for(e), e.message)
            log.exception("admission %s failed", span_name)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the admission log")

        mutating = f"{service.rsplit('.', 1)[-1]}/{method}" not in READ_ONLY  # unlisted: treated as mutating

        def _enter(request, metadata) -> object:
            principal = authenticate(metadata)
            if isinstance(request, _Undecodable):
                raise ValidationError("request", f"not a valid {method} request message")
            if mutating:
                refuse_unknown_fields(request)
            return auth.CURRENT.set(principal)

        def _metadata(context) -> tuple[tuple[str, Any], ...]:
            return tuple((m[0], m[1]) for m in (context.invocation_metadata() or ()))

        def _carrier(metadata) -> dict[str, str]:
            return {k: v for k, v in metadata if isinstance(v, str) and k != auth.METADATA_KEY}

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                metadata = _metadata(context)
                token = otel_context.attach(telemetry.context_from(_carrier(metadata)))
                caller = None
                try:
                    with tracer.start_as_current_span(span_name):
                        try:
                            caller = _enter(request, metadata)
                            return await inner(request, context)
                        except (FedError, Exception) as e:  # noqa: BLE001
                            if isinstance(e, asyncio.CancelledError) or _is_abort(e):
                                raise
                            await _fail(context, e)
                finally:
                    if caller is not None:
                        auth.CURRENT.reset(caller)
                    otel_context.detach(token)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=_safe(handler.request_deserializer),
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                metadata = _metadata(context)
                token = otel_context.attach(telemetry.context_from(_carrier(metadata)))
                try:
                    _enter(request, metadata)
                    async for item in inner_stream(request, context):
                        yield item
                except (FedError, Exception) as e:  # noqa: BLE001
                    if isinstance(e, asyncio.CancelledError) or _is_abort(e):
                        raise
                    await _fail(context, e)
                finally:
                    otel_context.detach(token)

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_safe(handler.request_deserializer),
                                                        response_serializer=handler.response_serializer)
        return handler


#: The old name (the interceptor used to only map errors).
ErrorInterceptor = GatewayInterceptor


def _is_abort(e: BaseException) -> bool:
    # grpc.aio's context.abort raises an internal exception type; let it through untouched.
    return type(e).__name__ in ("AbortError", "_AbortError") or isinstance(e, grpc.aio.AbortError)


def check_start_deadline(spec: JobSpec, now: float) -> None:
    """Refuse a job whose ``start_deadline`` is not after ``now`` (business POSIX seconds): it
    could never start in time, and accepting it would only queue a job that scores 0 and is then
    dropped. Rule as Slurm's ``sbatch --deadline`` (a deadline in the past is refused at submit);
    Kueue has no start deadline. A retry of an earlier request is answered before this check.

    Raises:
        ValidationError: ``spec.start_deadline`` at or before ``now``, naming both in UTC.
    """
    if spec.start_deadline is None or spec.start_deadline.timestamp() > now:
        return
    at = datetime.fromtimestamp(now, UTC)
    raise ValidationError("spec.start_deadline",
                          f"{spec.start_deadline:%Y-%m-%dT%H:%M:%SZ} is not after now ({at:%Y-%m-%dT%H:%M:%SZ}): "
                          "the job could never start by then; give a later deadline or none")


def explain_to_pb(rec: JobRecord) -> pb.ExplainJobResponse:
    """The wire form of a job's latest decisions."""
    out = pb.ExplainJobResponse(job_id=rec.job_id, state=STATE_TO_PB[rec.state])
    for shard in rec.shards:
        if shard.decision is None:
            out.decisions.append(pb.ShardDecision(shard=shard.index, outcome="none",
                                                  summary="the scheduler has not decided about it yet"))
        else:
            out.decisions.append(decision_to_pb(shard.index, shard.decision))
    return out


def decision_to_pb(shard: int, d: Decision) -> pb.ShardDecision:
    """The wire form of the scheduler's decision ``d`` about shard ``shard`` (ExplainJob's
    shape: every cluster's verdict and score terms)."""
    msg = pb.ShardDecision(shard=shard, outcome=d.outcome, summary=d.reason, cluster=d.cluster,
                           region=d.region, queue=d.queue, counterfactual=d.counterfactual,
                           policy_version=d.policy_version, fits_empty=d.fits_empty,
                           reserved_cluster=d.reserved_cluster, approval_id=d.approval_id)
    msg.decided_at.CopyFrom(_ts(d.at))
    if d.approval_expires_at is not None:
        msg.approval_expires_at.CopyFrom(_ts(d.approval_expires_at))
    for e in d.evaluations:
        v = pb.ClusterVerdict(cluster=str(e.get("cluster", "")), region=str(e.get("region", "")),
                              passed=bool(e.get("passed")), reason=str(e.get("reason", "")),
                              detail=str(e.get("detail", "")),
                              scores={k: float(x) for k, x in (e.get("scores") or {}).items()})
        if e.get("total") is not None:
            v.total = float(e["total"])
        msg.clusters.append(v)
    return msg


def what_if_to_pb(reply: WhatIfReply, state: int) -> pb.ExplainJobResponse:
    """The scheduler's what-if (:mod:`fedsched.whatif`) in ExplainJob's shape (no job id: nothing
    was queued); ``state`` is the state a real submit would give the job."""
    out = pb.ExplainJobResponse(state=state)
    for d in reply.decisions:
        out.decisions.append(decision_to_pb(d.shard, Decision(
            d.outcome, d.decided_at, d.summary, d.evaluations, d.policy_version, d.counterfactual, d.cluster,
            d.region, d.queue, d.fits_empty, d.reserved_cluster)))
    return out


#: Most items one SubmitJobs call may carry (``SubmitJobsRequest`` in the proto).
MAX_BATCH = 1000

#: Most dry-run items of one SubmitJobs call that get the scheduler's what-if (each is a full
#: decision on the scheduler's loop); later dry-run items get their verdict only (``what_if``
#: unset), so one call's work on the scheduler is bounded
MAX_WHAT_IF_PER_CALL = 20

#: SetJobPriority whose publish was acknowledged as a duplicate (the stream already holds that
#: event) waits at most this many seconds for the job follower to fold it before answering
PRIORITY_FOLD_WAIT_S = 5.0

#: The refusals of a submission (recorded as ``submission.rejected``; a batch item's result).
REFUSALS = (ValidationError, QuotaExceededError, PermissionDeniedError, ConflictError, AlreadyExistsError)

#: Metadata key of the trace id of a submit (trailing metadata; also in the response's ``trace_id``).
TRACE_ID_METADATA = "x-trace-id"


@dataclass(frozen=True)
class _Admitted:
    """A submission that passed :meth:`JobServicer._admit`, not yet published."""

    gov: Governance
    spec: JobSpec
    rid: str
    principal: Principal
    job_id: str
    held: bool  #: a budget hold was placed (release it after publishing)
    regions: frozenset[str] = frozenset()  #: the regions the job may run in (its budget's worst case)


@contextlib.contextmanager
def _call_trace() -> Iterator[str]:
    """The 32-hex trace id of this call: the caller's (``traceparent`` metadata, continued by the
    interceptor's span), else a new root trace made current for the call, so the events it
    publishes carry the id the caller is given."""
    trace_id = telemetry.current_trace_id()
    if trace_id:
        yield trace_id
        return
    with telemetry.root_span("admission.submit"):
        yield telemetry.current_trace_id()


def _send_trace_id(context, trace_id: str) -> None:
    """Answer with ``x-trace-id`` in the trailing metadata, which gRPC sends in the same write
    as the response and the status (also with an error: :class:`GatewayInterceptor` adds its
    ``fedsched-field``/``fedsched-limit`` to it). Issue 15: sending it as initial metadata
    (``send_initial_metadata``) was a write of its own per call, ~10% of admission's CPU per
    single submit; grpc.aio has no way to attach initial metadata to the response's write.
    Clients read the trailing metadata, and the initial metadata of older servers
    (``fedsched submit``); the response's ``trace_id`` carries the same id."""
    if context is not None and trace_id:
        context.set_trailing_metadata(((TRACE_ID_METADATA, trace_id),))


#: SubmitJob group commit (:meth:`JobServicer._grouped`): the most submissions of one group
GROUP_MAX = 256
#: ... and the groups published at once
GROUP_FLUSHES = 1
#: ... and how long a group may hold back the next one (seconds; :attr:`JobServicer.group_stall_s`)
GROUP_STALL_S = 0.05


def _settle(fut: asyncio.Future, answer: Any) -> None:
    """Answer a grouped call's future with a response or an exception (unless it is done: the
    caller gave up, or it was answered already)."""
    if fut.done():
        return
    if isinstance(answer, BaseException):
        fut.set_exception(answer)
    else:
        fut.set_result(answer)


def _failed_item(e: FedError) -> pb.SubmitJobsResult:
    return pb.SubmitJobsResult(code=status_for(e).value[0], message=e.message)


def _state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


async def last_sequence(bus: Bus, subjects: str, timeout_s: float = 2.0) -> int:
    """Stream sequence of the newest message of the events stream on ``subjects`` (a filter,
    wildcards allowed: JetStream's last-by-subject get), 0 when it has none.

    Raises:
        nats.errors.Error / TimeoutError: JetStream did not answer.
    """
    try:
        msg = await asyncio.wait_for(bus.js.get_last_msg(bus.stream_name("EVENTS"), subjects), timeout_s)
    except nats.js.errors.NotFoundError:
        return 0
    return int(msg.seq)


async def stored_event(bus: Bus, seq: int, timeout_s: float = 2.0) -> Envelope | None:
    """The event stored at stream sequence ``seq`` of the events stream (JetStream's message get
    by sequence, ``$JS.API.STREAM.MSG.GET.<P>_EVENTS``: admission's NATS user is granted that
    one, :func:`fedapp.natsauth.federation_users`), None when the stream no longer holds it
    (retention).

    Raises:
        nats.errors.Error / TimeoutError: JetStream did not answer.
        pydantic.ValidationError: what is stored there is not an envelope.
    """
    try:
        msg = await asyncio.wait_for(bus.js.get_msg(bus.stream_name("EVENTS"), seq=seq), timeout_s)
    except nats.js.errors.NotFoundError:
        return None
    return Envelope.from_bytes(msg.data)


#: a string as JSON text, ASCII only (what ``json.dumps`` uses for a string with ``ensure_ascii``)
_json_str = json.encoder.encode_basestring_ascii


def request_job_id(principal: str, tenant: str, project: str, request_id: str) -> str:
    """The job id of a submission with a ``request_id``: ``j-`` and 20 hex of SHA-256 over the
    idempotency key (principal, tenant, project, request id), JSON-encoded so no two keys
    share a text. Two callers, or two projects, using the same request id get two jobs.

    The key is the text ``json.dumps([principal, tenant, project, request_id])`` gives (ASCII,
    ``", "`` between items), built from the same string encoder without the encoder's set-up
    (~3.4 -> ~1.0 us a submission)."""
    key = "[" + ", ".join((_json_str(principal), _json_str(tenant), _json_str(project), _json_str(request_id))) + "]"
    return "j-" + hashlib.sha256(key.encode()).hexdigest()[:20]


def check_job_access(principal: Principal, rec: JobRecord, *, write: bool = False) -> None:
    """Raise unless ``principal`` may read (or, with ``write``, cancel) the job ``rec``.

    Readers: admins, the tenant's approvers, its submitters (of the job's project), and the
    agent of the cluster the job's current attempt runs on. Cancellers: admins and submitters.
    Other services that show a job (e.g. an explain RPC) should call this too.

    A caller who may not *see* the job is told it does not exist: the same
    :class:`~fedsched.errors.NotFoundError` (code and message) as for an id nobody made, so a
    per-job RPC never reveals that another tenant's job id exists (issue 14; the rule of
    Kubernetes' and GitHub's APIs for objects outside the caller's scope). PERMISSION_DENIED is
    kept for a caller who may see the job but not act on it.

    Raises:
        NotFoundError: the caller may not read the job (``NotFoundError("job", job_id)``).
        PermissionDeniedError: ``write`` and the caller may read but not cancel it.
    """
    spec = rec.spec
    visible = principal.can_read(spec.tenant, spec.project) or (
        rec.current is not None and principal.agent_of(rec.current.cluster))
    if not visible and not (write and principal.can_cancel(spec.tenant, spec.project)):
        raise NotFoundError("job", rec.job_id)
    if write and not principal.can_cancel(spec.tenant, spec.project):
        raise PermissionDeniedError(f"{principal.name} may not cancel jobs of {spec.tenant}/{spec.project}")


def job_to_pb(rec: JobRecord) -> pb.Job:
    """The wire form of a job record."""
    att = rec.current
    msg = pb.Job(job_id=rec.job_id, spec=spec_to_pb(rec.spec), state=STATE_TO_PB[rec.state], reason=rec.reason,
                 region=att.region if att else "", cluster=att.cluster if att else "", submitted_by=rec.submitted_by,
                 policy_version=rec.policy_version, unplaceable=rec.unplaceable)
    for name, value in (("submitted_at", rec.submitted_at), ("started_at", rec.started_at), ("ended_at", rec.ended_at)):
        ts = _ts(value)
        if ts is not None:
            getattr(msg, name).CopyFrom(ts)
    for a in rec.attempts:
        pa = pb.Attempt(attempt=a.attempt, region=a.region, cluster=a.cluster, card_model=a.card_model,
                        outcome=a.outcome, reason=a.reason, cross_region=a.cross_region, shard=a.shard)
        for name, value in (("placed_at", a.placed_at), ("started_at", a.started_at), ("ended_at", a.ended_at)):
            ts = _ts(value)
            if ts is not None:
                getattr(pa, name).CopyFrom(ts)
        msg.attempts.append(pa)
    return msg


def _holds_budget(rec: JobRecord) -> bool:
    """Whether an open job holds its worst-case cost against its tenant's budget: not while it
    cannot run -- queued (no shard placed, running or awaiting approval) and every waiting shard
    found unplaceable by the scheduler (no cluster could hold it even empty). Such a job holds
    again as soon as a shard becomes placeable; it ends after the scheduler's
    ``unschedulable_timeout_s``."""
    if rec.state != JobState.QUEUED:
        return True
    return not all(s.unplaceable for s in rec.shards if s.state == JobState.QUEUED)


class JobServicer(pb_grpc.JobServiceServicer):
    """The JobService implementation.

    Args:
        publisher: where submissions, cancellations and refusals go (the bus live).
        clock: business clock (submission times, budget months).
        policy: the governance policy in force.
        view: the job read model (kept current by :class:`AdmissionService`).
        limits: admission limits overriding the policy's (None = the policy's).
        known_models / known_regions: card models and regions agents reported (kept current).
        spend: month-to-date spend per tenant (budgets).
        prices: the price catalog (worst-case job cost for budgets).
        subjects: subject names (default: ``publisher.subjects``, the bus's).
        clusters: cluster name -> what it could ever hold, from the agents' latest inventory
            (kept current); a GPU job none of them could hold is refused (FAILED_PRECONDITION).
        names: the topology's region/zone/cluster names (:class:`fedsched.topology.KnownNames`):
            home, allowed and forbidden regions must be among its regions. None (no topology
            given): the regions agents reported plus the tenants' home regions.
    """

    def __init__(self, publisher: Publisher, clock: Clock, policy: PolicyHolder, view: JobView, limits: Limits | None,
                 known_models: set[str], known_regions: set[str], spend: SpendBook, prices: PriceCatalog, *,
                 subjects: Subjects | None = None, clusters: dict[str, ClusterCapacity] | None = None,
                 names: KnownNames | None = None) -> None:
        self.publisher = publisher
        self.names = names
        self.subjects: Subjects = subjects if subjects is not None else publisher.subjects
        self.clock = clock
        self.policy = policy
        self.view = view
        #: ended jobs that left the view (GetJob / WatchJob / ExplainJob read them there)
        self.ended: EndedJobs = EndedJobs(None)
        self.limits_override = limits
        self.known_models = known_models
        self.known_regions = known_regions
        self.spend = spend
        self.prices = prices
        self.clusters = clusters if clusters is not None else {}
        self._limits: tuple[str, Limits] | None = None
        #: the worst case each tenant's open jobs in the view hold, as running totals (kept by
        #: :meth:`_job_changed` on every change the view makes)
        self.budget_holds = BudgetHolds()
        # tenant -> job id -> worst-case cost held while its job.submitted is being published (not in the view yet)
        self._holds: dict[str, dict[str, Decimal]] = {}
        view.listeners.append(self._job_changed)
        self.rederive_budget_holds()
        self._tenant_locks: dict[str, asyncio.Lock] = {}  # budgeted submissions of a tenant, one at a time
        self.budget_conflicts = 0  # compare-and-set rounds lost to another replica (_submit_budgeted)
        #: asks an agent for logs: ``(subject, LogRequest) -> async iterator of LogReply``
        #: (:func:`fedsched.logs.request_logs` on the bus; None: GetJobLogs is UNAVAILABLE)
        self.request_logs = None
        #: reads the stream sequence of the newest message on a subject filter of the events
        #: stream (0: none): ``async (filter) -> int`` (:func:`last_sequence` on the bus; None:
        #: a lost budget compare-and-set only waits for the view, see :meth:`_resync_last_submitted`)
        self.last_submitted_seq = None
        #: reads the event stored at a stream sequence: ``async (seq) -> Envelope | None``
        #: (:func:`stored_event` on the bus; None: a publish acknowledged as a duplicate waits
        #: for the view instead, see :meth:`_duplicate_ack`)
        self.stored_event = None
        #: how long a submission acknowledged as a duplicate waits for the view to show the
        #: stored job when it cannot read it from the stream (seconds)
        self.duplicate_wait_s = 10.0
        #: asks the scheduler for a dry run's what-if: ``WhatIfRequest -> awaitable WhatIfReply | None``
        #: (:func:`fedsched.whatif.request_what_if` on the bus; None: dry runs have no what-if)
        self.what_if = None
        #: group commit of single submits (:meth:`_grouped`): on (True) or every SubmitJob publishes alone
        self.group_commit = True
        #: a group's most submissions (more wait for the next group)
        self.group_max = GROUP_MAX
        #: groups being published at once (a submit arriving meanwhile joins the next group)
        self.group_flushes = GROUP_FLUSHES
        #: how long the first submit of a group waits for others (seconds; 0: the next turn of
        #: the event loop only, so a lone submit is not delayed)
        self.group_window_s = 0.0
        #: a group still publishing after this long no longer holds back the next one (seconds):
        #: one slow item (a duplicate acknowledgement waiting for the view, publish retries)
        #: must not stall every single submit behind it
        self.group_stall_s = GROUP_STALL_S
        self._group_detached: set[asyncio.Task] = set()
        self._group: list[tuple[_Admitted, dict[str, str], asyncio.Future]] = []
        self._group_scheduled = False
        self._group_flushing = 0
        self._group_tasks: set[asyncio.Task] = set()
        #: groups published and submissions they held (for tests and the bench)
        self.groups_flushed = 0
        self.grouped_submits = 0

    def gov(self) -> Governance:
        """The policy in force (the interceptor guarantees one exists; else UnavailableError)."""
        return self.policy.in_force()

    def limits(self, gov: Governance) -> Limits:
        """Admission limits: the override, else the policy's."""
        if self.limits_override is not None:
            return self.limits_override
        if self._limits is None or self._limits[0] != gov.version:
            self._limits = (gov.version, Limits(**gov.doc.limits.model_dump()))
        return self._limits[1]

    # ------------------------------------------------------------------ submit

    def _job_changed(self, rec: JobRecord) -> None:
        """The view changed ``rec``: hold or release its worst case in :attr:`budget_holds`
        (O(1)); a submission being published that the view now has holds from the view."""
        tenant = rec.spec.tenant
        is_open = rec.state not in TERMINAL_STATES
        self.budget_holds.update(tenant, rec.job_id, holds=is_open and _holds_budget(rec), open_=is_open)
        inflight = self._holds.get(tenant)
        if inflight is not None and rec.job_id in inflight:
            del inflight[rec.job_id]  # counted once: from the view from now on
            if not inflight:
                del self._holds[tenant]

    def rederive_budget_holds(self) -> None:
        """Rebuild :attr:`budget_holds` from every open job in the view: after the view was
        filled without its listeners (a checkpoint restore writes ``view.jobs`` directly) or
        emptied (a malformed checkpoint). O(open jobs); costs are computed lazily as usual."""
        self.budget_holds = BudgetHolds()
        for ids in self.view.open_by_tenant.values():
            for job_id in ids:
                rec = self.view.jobs.get(job_id)
                if rec is not None:
                    self._job_changed(rec)

    def _worst_case(self, job_id: str, regions: set[str]) -> Decimal:
        """An open job's worst-case cost (what it holds of its tenant's budget), over the
        ``regions`` known when it is first costed; 0 for a job without an estimate (accepted
        before its tenant had a budget)."""
        worst = worst_case_cost(self.view.jobs[job_id].spec, self.prices, self.known_models, regions)
        return worst[0] if worst else Decimal(0)

    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.SubmitJobResponse:
        """One submission (module docstring), or with ``dry_run`` its verdict and the scheduler's
        what-if. The response and its trailing metadata (``x-trace-id``) carry the call's trace id.

        An admitted submission of a tenant without a budget is published by group commit
        (:meth:`_grouped`: with the other single submits arriving meanwhile, as one
        :meth:`_publish_batch`); a budgeted tenant's goes through its compare-and-set rounds
        alone (:meth:`_submit_budgeted`).

        Raises:
            ValidationError, QuotaExceededError, PermissionDeniedError, ConflictError,
            AlreadyExistsError: the submission is refused (recorded as ``submission.rejected``;
            a dry run instead answers with the refusal as its verdict).
            UnavailableError: the bus did not acknowledge (retry with the same request_id).
        """
        principal = auth.current()
        with _call_trace() as trace_id:
            _send_trace_id(context, trace_id)
            if request.dry_run:
                resp = await self._dry_run(request, principal)
            else:
                try:
                    admitted = self._admit(request, principal)
                    if isinstance(admitted, pb.SubmitJobResponse):  # a retry of an earlier call
                        resp = admitted
                    elif self.group_commit and admitted.gov.budget(admitted.spec.tenant) is None:
                        resp = await self._grouped(admitted, telemetry.inject_headers())
                    else:  # a budgeted tenant: its own compare-and-set rounds
                        resp = await self._publish_one(admitted)
                except REFUSALS as e:
                    await self._record_rejections([(request, e)], principal)
                    raise
        resp.trace_id = trace_id
        return resp

    async def SubmitJobs(self, request: pb.SubmitJobsRequest, context) -> pb.SubmitJobsResponse:
        """A batch of submissions: each item validated, governed and made idempotent exactly as
        :meth:`SubmitJob` (the same :meth:`_admit`), in request order, so earlier items' budget
        holds count against later ones; one bad item never fails the others. The accepted
        items' ``job.submitted`` events are published together (all sent, then the acks awaited
        together), refusals are recorded as ``submission.rejected`` in one batch. Dry-run items
        are answered as :meth:`SubmitJob` answers them, except that only the first
        :data:`MAX_WHAT_IF_PER_CALL` of them get the scheduler's what-if (the rest: the verdict).

        Returns:
            One :class:`SubmitJobsResult` per item, in request order: ``code`` 0 with the
            response, or the item's gRPC status code with the message (starting with the field).

        Raises:
            ValidationError: ``items`` is empty or has more than :data:`MAX_BATCH` items.
        """
        principal = auth.current()
        if not request.items:
            raise ValidationError("items", "at least one item")
        if len(request.items) > MAX_BATCH:
            raise ValidationError("items", f"at most {MAX_BATCH} items per call (got {len(request.items)}); "
                                           f"split the batch")
        results: list[pb.SubmitJobsResult | None] = [None] * len(request.items)
        refused: list[tuple[pb.SubmitJobRequest, FedError]] = []
        accepted: list[tuple[int, _Admitted]] = []
        first_of: dict[str, int] = {}  # job id -> the batch item publishing it (a request_id given twice)
        repeats: list[tuple[int, _Admitted]] = []
        ask = [True]  # once the scheduler leaves a what-if unanswered, the batch's other dry runs do not wait
        dry_runs = 0
        with _call_trace() as trace_id:
            _send_trace_id(context, trace_id)
            for i, item in enumerate(request.items):
                try:
                    if item.dry_run:
                        if dry_runs >= MAX_WHAT_IF_PER_CALL:
                            ask[0] = False  # bounded work on the scheduler: the verdict only from here
                        dry_runs += 1
                        results[i] = pb.SubmitJobsResult(response=await self._dry_run(item, principal, ask=ask))
                        continue
                    admitted = self._admit(item, principal)
                except REFUSALS as e:
                    refused.append((item, e))
                    results[i] = _failed_item(e)
                    continue
                if isinstance(admitted, pb.SubmitJobResponse):  # a retry of an earlier call
                    results[i] = pb.SubmitJobsResult(response=admitted)
                elif admitted.job_id in first_of:
                    repeats.append((i, admitted))
                else:
                    first_of[admitted.job_id] = i
                    accepted.append((i, admitted))
            try:
                answers = await self._publish_batch([a for _, a in accepted])
                for (i, _), answer in zip(accepted, answers):
                    if isinstance(answer, FedError):
                        results[i] = _failed_item(answer)
                    elif isinstance(answer, BaseException):
                        raise answer
                    else:
                        results[i] = pb.SubmitJobsResult(response=answer)
                for i, a in repeats:  # the same key twice in one batch: the first item made the job
                    try:
                        existing = self.view.jobs.get(a.job_id)
                        if existing is None:  # the first item's publish failed: so does this one
                            first = results[first_of[a.job_id]]
                            results[i] = pb.SubmitJobsResult(code=first.code, message=first.message)
                            continue
                        results[i] = pb.SubmitJobsResult(response=self._retried(existing, a.spec, a.rid, principal))
                    except REFUSALS as e:
                        refused.append((request.items[i], e))
                        results[i] = _failed_item(e)
            finally:
                for _, a in accepted + repeats:
                    self._release(a.spec.tenant, a.job_id, a.held)
            await self._record_rejections(refused, principal)
        for r in results:
            if r.HasField("response"):
                r.response.trace_id = trace_id
        return pb.SubmitJobsResponse(results=results)

    def _admit(self, request: pb.SubmitJobRequest, principal: Principal, *,
               hold: bool = True) -> "pb.SubmitJobResponse | _Admitted":
        """Everything a submission goes through before it is published, shared by SubmitJob,
        SubmitJobs and dry runs: validation, governance (tenant, the caller's rights on it before its
        projects are looked at, project, rights on the project, regions,
        the policy's narrowing), idempotency (a retry gets its job back before quota and budget
        are checked again), the quota it must ever fit, whether any cluster could ever hold it,
        and the budget check with (``hold``) the hold of its worst-case cost.

        Returns:
            The response for a retry of an earlier request (``duplicate``), else the admitted
            submission; when ``held`` the caller must :meth:`_release` its hold once the
            event is published (or not).

        Raises:
            ValidationError, PermissionDeniedError, QuotaExceededError, ConflictError,
            AlreadyExistsError: see the module docstring.
        """
        gov = self.gov()
        limits = self.limits(gov)
        if not request.HasField("spec"):
            raise ValidationError("spec", "required")
        rid = request.request_id
        if len(rid) > limits.max_request_id or (rid and not rid.isprintable()):
            raise ValidationError("request_id", f"at most {limits.max_request_id} printable characters")
        raw = request.spec
        tenant = gov.tenant(raw.tenant)
        if tenant is None:
            # suggest only a tenant that exists and that the caller may see
            check_name("tenant", raw.tenant, "spec.tenant", known=[t for t in gov.tenants if principal.can_read(t)])
            raise ValidationError("spec.tenant", f"unknown tenant {raw.tenant!r}")
        if not principal.can_read(tenant.name):  # before the project is looked at: its names are not theirs to see
            raise PermissionDeniedError(f"{principal.name} may not submit jobs for {tenant.name}/{raw.project or '?'}")
        if raw.project and raw.project not in tenant.projects:
            check_name("project", raw.project, "spec.project", known=tenant.projects)
            raise ValidationError("spec.project", f"tenant {tenant.name} has no project {raw.project!r} "
                                                  f"(has {', '.join(sorted(tenant.projects))})")
        if not principal.can_submit(tenant.name, raw.project):
            raise PermissionDeniedError(f"{principal.name} may not submit jobs for {tenant.name}/{raw.project or '?'}")
        spec = spec_from_pb(raw, limits=limits, default_home=tenant.home_region,
                            known_models=frozenset(self.known_models))
        regions = self.region_names(gov)
        for field, values in (("spec.home_region", [spec.home_region]), ("spec.allowed_regions", spec.allowed_regions),
                              ("spec.forbidden_regions", spec.forbidden_regions)):
            for r in values:
                if r not in regions:
                    raise ValidationError(field, f"unknown region {r!r} (known: {', '.join(sorted(regions))})")
        spec = gov.admit_spec(spec, locality_given=raw.locality != pb.LOCALITY_UNSPECIFIED)
        if rid:  # a retry gets its job back before quota and budget are checked again
            existing = self.view.find_request(principal.name, spec.tenant, spec.project, rid)
            if existing is not None:
                return self._retried(existing, spec, rid, principal)
        check_start_deadline(spec, self.clock.time())
        check_quota_can_fit(gov, spec, self.known_models, regions)
        job_id = request_job_id(principal.name, spec.tenant, spec.project, rid) if rid else "j-" + uuid.uuid4().hex[:20]
        check_can_ever_run(spec, self.clusters, regions)
        held = self._check_and_hold(gov, spec, job_id, regions, hold=hold)
        return _Admitted(gov, spec, rid, principal, job_id, held, frozenset(regions))

    def region_names(self, gov: Governance | None = None) -> set[str]:
        """The regions that exist: the topology's (:attr:`names`), or without one the regions
        agents reported plus the tenants' home regions of ``gov`` (default: the policy in force)."""
        if self.names is not None:
            return set(self.names.regions)
        gov = gov if gov is not None else self.policy.current
        return self.known_regions | ({t.home_region for t in gov.tenants.values()} if gov is not None else set())

    def cluster_names(self) -> set[str]:
        """The clusters that exist: the topology's plus those agents report (latest inventory)."""
        return set(self.names.clusters if self.names is not None else ()) | set(self.clusters)

    def filter_names(self) -> FilterNames:
        """What ListJobs' tenant, project, region and cluster filters may name (:class:`FilterNames`):
        regions and clusters that exist now, and those where a job still in the view last ran
        (a decommissioned cluster's ended jobs stay listable by it; the view keeps these names
        as jobs change, :attr:`JobView.attempt_clusters`, so no job is walked here)."""
        gov = self.policy.current
        return FilterNames(tenants=frozenset(gov.tenants) if gov is not None else None,
                           projects=({t.name: frozenset(t.projects) for t in gov.tenants.values()}
                                     if gov is not None else None),
                           regions=frozenset(self.region_names(gov) | self.view.attempt_regions.keys()),
                           clusters=frozenset(self.cluster_names() | self.view.attempt_clusters.keys()))

    async def _grouped(self, a: "_Admitted", trace: dict[str, str]) -> pb.SubmitJobResponse:
        """Publish an admitted single submission by group commit (issue 15): the submits that
        arrive while a group is being published, or in the same turn of the event loop, are
        published together as the next group -- one ended-jobs lookup and one pipelined publish
        (:meth:`_publish_batch`, the code of SubmitJobs) -- and each call is answered from its
        own item. A lone submit is published at the next turn of the loop (no wait unless
        :attr:`group_window_s` is set); at most :attr:`group_flushes` groups are in flight, each
        of at most :attr:`group_max` submissions, and a group still publishing after
        :attr:`group_stall_s` no longer holds back the next. ``trace``: the call's trace context
        (``traceparent``), which its event carries.

        Idempotency: the same key twice in one group is one job (the first item publishes it,
        the others are answered as retries of it: :meth:`_retried`); across groups JetStream's
        deduplication answers as before (:meth:`_duplicate_ack`).

        Raises:
            what :meth:`_publish_one` raises for this submission alone (ValidationError for an
            event too large for the bus, UnavailableError, AlreadyExistsError ...).
        """
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._group.append((a, trace, fut))
        self._schedule_group()
        return await fut

    def _schedule_group(self) -> None:
        """Start the next group soon if submits wait and fewer than :attr:`group_flushes` are in flight."""
        if not self._group or self._group_scheduled or self._group_flushing >= self.group_flushes:
            return
        self._group_scheduled = True
        loop = asyncio.get_running_loop()
        empty = contextvars.Context()  # not the first caller's span or principal
        if self.group_window_s > 0 and len(self._group) < self.group_max:
            loop.call_later(self.group_window_s, self._start_group, context=empty)
        else:
            loop.call_soon(self._start_group, context=empty)

    def _start_group(self) -> None:
        self._group_scheduled = False
        if not self._group or self._group_flushing >= self.group_flushes:
            return
        items, self._group = self._group[:self.group_max], self._group[self.group_max:]
        self._group_flushing += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._flush_group(items))
        self._group_tasks.add(task)
        stalled = loop.call_later(self.group_stall_s, self._group_stalled, task)
        task.add_done_callback(lambda t: (self._group_tasks.discard(t), stalled.cancel()))

    def _group_stalled(self, task: asyncio.Task) -> None:
        """A group is still publishing after :attr:`group_stall_s`: stop counting it against
        :attr:`group_flushes`, so the next group starts."""
        if task.done() or task in self._group_detached:
            return
        self._group_detached.add(task)
        self._group_flushing -= 1
        self._schedule_group()

    async def _flush_group(self, items: list[tuple["_Admitted", dict[str, str], asyncio.Future]]) -> None:
        """Publish one group (:meth:`_grouped`) and answer each item's future."""
        self.groups_flushed += 1
        self.grouped_submits += len(items)
        first_of: dict[str, int] = {}  # job id -> the item publishing it
        accepted: list[int] = []
        repeats: list[int] = []
        for i, (a, _, _) in enumerate(items):
            if a.job_id in first_of:
                repeats.append(i)
            else:
                first_of[a.job_id] = i
                accepted.append(i)
        try:
            try:
                answers: list[Any] = await self._publish_batch([items[i][0] for i in accepted],
                                                               headers=[items[i][1] for i in accepted])
            except Exception as e:  # noqa: BLE001 - every item's answer
                answers = [e] * len(accepted)
            outcome: dict[str, Any] = {}
            for i, answer in zip(accepted, answers):
                outcome[items[i][0].job_id] = answer
                _settle(items[i][2], answer)
            for i in repeats:  # the same key twice in one group: answered as a retry of the job stored
                a, _, fut = items[i]
                first = outcome[a.job_id]
                rec = self.view.jobs.get(a.job_id)
                if rec is None and isinstance(first, BaseException):  # not stored: the same failure
                    _settle(fut, first)
                    continue
                try:  # (the first item may have been refused for its spec: the stored job is another call's)
                    if rec is None:
                        rec = await self._archived(a.job_id)
                    if rec is None:
                        raise UnavailableError(f"job {a.job_id} of request_id {a.rid!r} cannot be read now; retry")
                    _settle(fut, self._retried(rec, a.spec, a.rid, a.principal))
                except Exception as e:  # noqa: BLE001 - that call's answer
                    _settle(fut, e)
        finally:
            for a, _, fut in items:
                self._release(a.spec.tenant, a.job_id, a.held)
                _settle(fut, UnavailableError(f"job {a.job_id} was not confirmed: admission stopped while "
                                              f"publishing it; retry with the same request_id"))
            me = asyncio.current_task()
            if me in self._group_detached:  # no longer counted (:meth:`_group_stalled`)
                self._group_detached.discard(me)
            else:
                self._group_flushing -= 1
            self._schedule_group()

    async def _publish_one(self, a: "_Admitted") -> pb.SubmitJobResponse:
        """Publish an admitted submission and release its hold (the view holds the job then)."""
        try:
            if a.rid:  # a retry after its job ended and left memory (and JetStream's dedup window)
                archived = await self._archived(a.job_id)
                if archived is not None:
                    return self._retried(archived, a.spec, a.rid, a.principal)
            if a.gov.budget(a.spec.tenant) is not None:  # across admission replicas: compare-and-set
                return await self._submit_budgeted(a.gov, a.spec, a.rid, a.principal, a.job_id, set(a.regions))
            return await self._publish_submission(a.gov, a.spec, a.rid, a.principal, a.job_id)
        finally:
            self._release(a.spec.tenant, a.job_id, a.held)

    async def _dry_run(self, request: pb.SubmitJobRequest, principal: Principal, *,
                       ask: list[bool] | None = None) -> pb.SubmitJobResponse:
        """What a submit of ``request`` would do, doing none of it: :meth:`_admit` without a
        budget hold, nothing published. ``verdict``: ``accepted`` (it would be queued),
        ``awaiting_approval`` (the scheduler would place it abroad, which its tenant's policy
        lets only an approver allow), ``duplicate of <job>`` (a retry of an earlier request), or ``<CODE>: <message>`` (the
        refusal a submit would get). ``what_if``: the scheduler's decision for the admitted spec
        on its current view (:mod:`fedsched.whatif`), unset when no scheduler answered within
        the timeout or the spec was refused. ``ask`` (a batch's shared flag): ``[False]`` skips
        the question, and an unanswered one sets it so."""
        try:
            admitted = self._admit(request, principal, hold=False)
        except REFUSALS as e:
            return pb.SubmitJobResponse(verdict=f"{status_for(e).name}: {e.message}")
        if isinstance(admitted, pb.SubmitJobResponse):
            admitted.verdict = f"duplicate of {admitted.job_id} ({_state_name(admitted.state)})"
            return admitted
        resp = pb.SubmitJobResponse(state=pb.JOB_STATE_QUEUED, verdict="accepted")
        if self.what_if is not None and (ask is None or ask[0]):
            reply = await self.what_if(WhatIfRequest(spec=admitted.spec, submitted_at=self.clock.time()))
            if reply is None and ask is not None:
                ask[0] = False
            if reply is not None and not reply.error:
                if any(d.needs_approval for d in reply.decisions):  # the scheduler would ask an approver first
                    resp.state, resp.verdict = pb.JOB_STATE_AWAITING_APPROVAL, "awaiting_approval"
                resp.what_if.CopyFrom(what_if_to_pb(reply, resp.state))
            elif reply is not None:
                log.warning("what-if refused by the scheduler: %s", reply.error)
        return resp

    #: compare-and-set rounds of one budgeted submission before it gives up (UNAVAILABLE, retry)
    BUDGET_CAS_ROUNDS = 50

    async def _submit_budgeted(self, gov: Governance, spec: JobSpec, rid: str, principal: Principal, job_id: str,
                               regions: set[str]) -> pb.SubmitJobResponse:
        """Submit for a tenant with a budget: check and hold, then publish only if no other
        submission of the tenant was stored since the newest one this replica has folded.

        Across admission replicas (issue 14 item 9) each replica's holds are its own, so the
        check and the hold alone could pass two replicas on the same money. The publish is a
        compare-and-set on the tenant's submissions: ``Nats-Expected-Last-Subject-Sequence`` =
        :attr:`JobView.last_submitted` of the tenant over ``<p>.jobs.submitted.<tenant>.*``
        (:meth:`fedsched.bus.Bus.publish`). If another replica got there first, this one waits
        until its view has folded that submission (its worst case is then held from the view),
        checks the budget again and retries. Within a replica, submissions of one budgeted tenant
        go one at a time (a lock per tenant), so they never conflict with each other.

        Raises:
            QuotaExceededError: the budget has no room (as in :meth:`_check_and_hold`).
            UnavailableError: no round won within :attr:`BUDGET_CAS_ROUNDS` (the caller retries).
        """
        lock = self._tenant_locks.setdefault(spec.tenant, asyncio.Lock())
        subjects = self.subjects.job("submitted", spec.tenant, spec.project).rsplit(".", 1)[0] + ".*"
        async with lock:
            if spec.tenant not in self.view.last_submitted:  # unknown here (e.g. restored from a checkpoint)
                await self._resync_last_submitted(spec.tenant, subjects)
            for _ in range(self.BUDGET_CAS_ROUNDS):
                if rid:  # another replica may have stored this very request meanwhile
                    existing = self.view.find_request(principal.name, spec.tenant, spec.project, rid)
                    if existing is not None:
                        return self._retried(existing, spec, rid, principal)
                expected = self.view.last_submitted.get(spec.tenant, 0)
                hold = self._check_and_hold(gov, spec, job_id, regions)
                try:
                    return await self._publish_submission(
                        gov, spec, rid, principal, job_id,
                        expect={EXPECT_SEQUENCE: str(expected), EXPECT_SUBJECT: subjects})
                except SequenceConflictError:
                    self.budget_conflicts += 1
                finally:
                    self._release(spec.tenant, job_id, hold)
                if await self._resync_last_submitted(spec.tenant, subjects):
                    continue  # the real last sequence is folded: check the budget again and retry
                if not await self._await_submitted_after(spec.tenant, expected):
                    # nothing newer arrives: the tenant's older submissions left the stream
                    # (retention); the subject filter is then empty
                    self.view.last_submitted[spec.tenant] = 0
        raise UnavailableError(f"budget of {spec.tenant}: other admission replicas kept submitting first; retry")

    async def _resync_last_submitted(self, tenant: str, subjects: str, timeout_s: float = 2.0) -> bool:
        """After a lost compare-and-set, or before the first round when the tenant's point is
        unknown here (a view restored from a checkpoint): read the stream sequence of ``tenant``'s newest
        ``job.submitted`` from JetStream (:attr:`last_submitted_seq` over ``subjects``), wait
        (at most ``timeout_s``) until the view has folded the stream that far, and make it the
        tenant's compare-and-set point. This is what a view restored from a checkpoint (which
        does not keep :attr:`JobView.last_submitted`) or whose tenant's submissions left the
        stream needs; a submission of another replica is folded first, so its worst case is held.

        Returns:
            True when the point is now the stream's (retry at once); False when JetStream could
            not tell (no reader, an error: logged) or the view did not get that far in time.
        """
        if self.last_submitted_seq is None:
            return False
        try:
            last = await self.last_submitted_seq(subjects)
        except Exception as e:  # noqa: BLE001 - an outage: the older wait-and-retry path
            log.warning("budget of %s: cannot read the last submission's sequence: %r", tenant, e)
            return False
        if tenant in self.view.last_submitted and last == self.view.last_submitted[tenant]:
            return False  # the point was right: another submission is in flight (wait for it)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.view.applied_seq < last:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.002)
        self.view.last_submitted[tenant] = last
        return True

    async def _await_submitted_after(self, tenant: str, sequence: int, timeout_s: float = 2.0) -> bool:
        """Wait until the view has folded a submission of ``tenant`` newer than ``sequence``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.view.last_submitted.get(tenant, 0) <= sequence:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True

    def _check_and_hold(self, gov: Governance, spec: JobSpec, job_id: str, regions: set[str], *,
                        hold: bool = True) -> bool:
        """Check the tenant's budget and hold this job's worst-case cost against it, as one step
        (without ``hold``: only check, as a dry run does).

        Nothing is awaited between the check and the hold, so on the event loop no other
        submission can pass the check on the same money (200 at once against a budget of
        100 CNY with 4.5 CNY jobs accept exactly 22). What is held: the running total of the
        tenant's open jobs in the view (:class:`~services.admission.budgets.BudgetHolds`, kept
        on every change of the view: O(1) per submit, however many jobs are open), plus those
        of submissions still being published (:attr:`_holds`, bounded by the calls in flight;
        a job the view already has is counted once, from the view).

        Returns:
            True if a hold was placed (the tenant has a budget); release it with :meth:`_release`.

        Raises:
            QuotaExceededError / ValidationError: see :func:`~services.admission.rules.check_budget`
                (the message names the amount held).
        """
        def held() -> Decimal:
            inflight = self._holds.get(spec.tenant, {})
            return (self.budget_holds.held(spec.tenant, lambda j: self._worst_case(j, regions))
                    + sum((cost for j, cost in inflight.items() if j != job_id and j not in self.view.jobs),
                          Decimal(0)))

        check_budget(gov, self.spend, spec, self.clock.time(), self.prices, self.known_models, regions,
                     open_costs=(held() for _ in (1,)))  # lazy: read only for a tenant with a budget
        if not hold or gov.budget(spec.tenant) is None:
            return False
        worst = worst_case_cost(spec, self.prices, self.known_models, regions)
        self._holds.setdefault(spec.tenant, {})[job_id] = worst[0] if worst else Decimal(0)
        return True

    def _release(self, tenant: str, job_id: str, held: bool) -> None:
        """Drop a submission's hold: published (the view holds the job now) or failed."""
        if not held:
            return
        holds = self._holds.get(tenant)
        if holds is not None:
            holds.pop(job_id, None)
            if not holds:
                del self._holds[tenant]

    async def _publish_submission(self, gov: Governance, spec: JobSpec, rid: str, principal: Principal,
                                  job_id: str, expect: dict[str, str] | None = None) -> pb.SubmitJobResponse:
        """Publish ``job.submitted`` and apply it to the view (the job then holds its budget there).

        ``expect``: compare-and-set headers (:meth:`_submit_budgeted`).

        Raises:
            ValidationError: ``spec``: the event is larger than the bus server carries (its
                ``max_payload``, e.g. a server configured below the default 1 MB).
            SequenceConflictError: the compare-and-set condition failed.
            UnavailableError: the bus did not acknowledge (the message names the job and says
                whether a retry is safe); see also :meth:`_duplicate_ack`.
        """
        event, sub = self._submission_event(gov, spec, rid, principal, job_id)
        try:
            ack = await self.publisher.publish(self.subjects.job("submitted", spec.tenant, spec.project), event,
                                               headers=expect)
        except (PayloadTooLargeError, UnavailableError) as e:
            raise self._not_published(e, spec, rid, job_id) from e
        return await self._acknowledged(event, sub, ack, spec, rid, principal)

    def _submission_event(self, gov: Governance, spec: JobSpec, rid: str, principal: Principal,
                          job_id: str) -> tuple[Envelope, JobSubmitted]:
        """The ``job.submitted`` event of an admitted submission (its id derived from the job id,
        so JetStream dedupes a retried publish) and its payload model."""
        sub = JobSubmitted(spec=spec, request_id=rid, submitted_by=principal.name)
        return make_event(EventType.JOB_SUBMITTED, sub, producer="admission", occurred_at=self.clock.time(),
                          event_id=business_event_id(job_id, "submitted"), tenant=spec.tenant, project=spec.project,
                          job_id=job_id, actor=principal.name, policy_version=gov.version), sub

    @staticmethod
    def _not_published(e: Exception, spec: JobSpec, rid: str, job_id: str) -> Exception:
        """What a submitter is told when the publish of its ``job.submitted`` failed with ``e``:
        a :class:`ValidationError` of ``spec`` for an event larger than the bus carries, an
        :class:`UnavailableError` naming the job and whether a retry is safe for an
        unacknowledged one, else ``e`` itself."""
        if isinstance(e, PayloadTooLargeError):
            return ValidationError("spec", f"the job is too large for this federation's bus: its submission is "
                                           f"{e.size} bytes, the bus carries at most {e.max_payload}")
        if isinstance(e, UnavailableError):  # not acknowledged: say what is known, and how to retry safely
            retry = (f"retry with the same request_id {rid!r}: it answers with job {job_id} if it was stored and "
                     f"never makes a second one" if rid else
                     "it may still have been stored; a retry without a request_id may make a second job")
            return UnavailableError(f"job {job_id} was not confirmed: the bus did not acknowledge its submission "
                                    f"({e.message}); {retry}")
        return e

    async def _acknowledged(self, event: Envelope, sub: JobSubmitted, ack: Any, spec: JobSpec, rid: str,
                            principal: Principal) -> pb.SubmitJobResponse:
        """The answer to a ``job.submitted`` JetStream acknowledged (``sub``: its payload
        model): the job applied to the view (a duplicate acknowledgement: :meth:`_duplicate_ack`;
        a job the view refuses because it ended and left memory: its archived record).

        Raises:
            UnavailableError / AlreadyExistsError: see :meth:`_duplicate_ack` and :meth:`_archived`.
        """
        job_id = event.job_id
        if getattr(ack, "seq", None):
            self.view.note_submitted(spec.tenant, int(ack.seq))
        if getattr(ack, "duplicate", False):  # the stream already held this submission's event id
            return await self._duplicate_ack(event, ack, spec, rid, principal)
        self.view.apply_own_submission(event, sub)
        rec = self.view.jobs.get(job_id)
        if rec is None:  # the view refused it: the job ended and left memory (a tombstone)
            archived = await self._archived(job_id)
            if archived is None:
                raise UnavailableError(f"job {job_id} of request_id {rid!r} ended and its record cannot be read "
                                       f"now; retry")
            return self._retried(archived, spec, rid, principal)
        return pb.SubmitJobResponse(job_id=job_id, state=STATE_TO_PB[rec.state], duplicate=False)

    async def _publish_batch(self, accepted: list["_Admitted"], headers: list[dict[str, str] | None] | None = None
                             ) -> list["pb.SubmitJobResponse | BaseException"]:
        """Publish a batch's admitted submissions (distinct job ids); per item, in order, its
        answer or the exception :meth:`_publish_one` would raise for it. Holds are released by
        the caller. ``headers``: per item, the trace context its event carries (a group of
        single submits: each its own call's); None: the current one (a SubmitJobs call's, read
        once for the batch).

        1. Idempotency: the keys' jobs that ended and left memory are looked up in the ended-jobs
           store in one request (:meth:`EndedJobs.get_many`); such a retry is answered from its
           record and publishes nothing.
        2. Submissions of tenants without a budget are published pipelined
           (:meth:`fedsched.bus.Bus.publish_acks`: all sent, the client writes them out
           together, then the acks awaited together; a publisher without it -- a test's fake --
           publishes them concurrently one by one); each acknowledgement is then handled as
           :meth:`_publish_submission` handles its own.
        3. Those of budgeted tenants go through the compare-and-set rounds of
           :meth:`_submit_budgeted`, concurrently.
        """
        answers: list[pb.SubmitJobResponse | BaseException | None] = [None] * len(accepted)
        looked_up = await self.ended.get_many(a.job_id for a in accepted if a.rid and a.job_id not in self.view.jobs)
        plain: list[int] = []
        budgeted: list[int] = []
        for k, a in enumerate(accepted):
            try:
                if a.rid and a.job_id not in self.view.jobs:
                    archived = self._archive_answer(a.job_id, looked_up.get(a.job_id))
                    if archived is not None:
                        answers[k] = self._retried(archived, a.spec, a.rid, a.principal)
                        continue
            except FedError as e:
                answers[k] = e
                continue
            (budgeted if a.gov.budget(a.spec.tenant) is not None else plain).append(k)
        events = [self._submission_event(a.gov, a.spec, a.rid, a.principal, a.job_id)
                  for a in (accepted[k] for k in plain)]
        # a SubmitJobs call's events all carry the call's trace context: read once, not per event
        call_trace = telemetry.inject_headers() if headers is None and plain else None
        if call_trace is not None and not telemetry.trace_id_of(call_trace):
            call_trace = None  # no active trace: each event gets its own root (the bus's rule)
        items = [(self.subjects.job("submitted", e.tenant, e.project), e, headers[k] if headers else call_trace)
                 for k, (e, _) in zip(plain, events)]
        budget_answers = asyncio.gather(*(self._submit_budgeted(a.gov, a.spec, a.rid, a.principal, a.job_id,
                                                                set(a.regions))
                                          for a in (accepted[k] for k in budgeted)), return_exceptions=True)
        publish_acks = getattr(self.publisher, "publish_acks", None)
        if publish_acks is not None:
            acks = await publish_acks(items) if items else []
        else:
            acks = await asyncio.gather(*(self.publisher.publish(s, e, headers=h) for s, e, h in items),
                                        return_exceptions=True)
        for k, (event, sub), ack in zip(plain, events, acks):
            a = accepted[k]
            if isinstance(ack, BaseException):
                answers[k] = self._not_published(ack, a.spec, a.rid, a.job_id)
                continue
            try:
                answers[k] = await self._acknowledged(event, sub, ack, a.spec, a.rid, a.principal)
            except Exception as e:  # noqa: BLE001 - that item's answer (the caller raises what is not a FedError)
                answers[k] = e
        for k, answer in zip(budgeted, await budget_answers):
            answers[k] = answer
        return answers

    async def _duplicate_ack(self, event: Envelope, ack: Any, spec: JobSpec, rid: str,
                             principal: Principal) -> pb.SubmitJobResponse:
        """The answer to a ``job.submitted`` publish that JetStream acknowledged as a duplicate:
        the stream already holds an event with its id (the idempotency key's), stored either by
        this very call (a slow acknowledgement: the bus retried the publish with the same
        message id after a timeout, and the first try had been stored) or by another call with
        the same key.

        1. Read the stored event at the acknowledgement's sequence (:attr:`stored_event`;
           JetStream's duplicate acknowledgement carries the first copy's sequence) and fold it
           into the view if the follower has not yet -- folding is idempotent, so the follower's
           later copy changes nothing.
        2. The stored event equal to this call's own (same spec, time, actor, policy version)
           is this call's submission: answered as accepted (``duplicate`` false). Anything
           else is another call's: answered as a retry of it (:meth:`_retried`: the job, or
           ALREADY_EXISTS for another spec).
        3. Without a reader, or when it fails, wait for the view (:meth:`_await_job`).

        Before issue 15's follow-up this always waited for the view and, when the follower was
        slow, answered UNAVAILABLE "submitted by a concurrent call but is not visible yet" to a
        call whose own job was stored; the client's retry was then told "duplicate" of a job it
        had never seen accepted.

        Raises:
            AlreadyExistsError: the stored submission has another spec.
            UnavailableError: the stored event can be neither read nor seen in the view in time.
        """
        job_id = event.job_id
        stored = None
        seq = int(getattr(ack, "seq", 0) or 0)
        if self.stored_event is not None and seq:
            try:
                stored = await self.stored_event(seq)
            except Exception as e:  # noqa: BLE001 - an outage or a foreign message: wait for the view instead
                log.warning("submission %s: cannot read the stored event at sequence %d: %r", job_id, seq, e)
        if stored is not None and stored.event_id == event.event_id and stored.type == event.type:
            self.view.apply(stored)
            rec = self.view.jobs.get(job_id)
            if rec is None:  # the job already ended and left memory
                rec = await self._archived(job_id)
            if rec is not None:
                if stored == event:  # this call's own submission, stored before its ack was lost
                    return pb.SubmitJobResponse(job_id=job_id, state=STATE_TO_PB[rec.state], duplicate=False)
                return self._retried(rec, spec, rid, principal)
        existing = await self._await_job(job_id, self.duplicate_wait_s)
        return self._retried(existing, spec, rid, principal)

    async def _archived(self, job_id: str) -> JobRecord | None:
        """The record of ``job_id`` if it ended and left the view (the ended-jobs store:
        :mod:`services.admission.ended`, pending records first, then the ``fed_jobs_ended``
        bucket); None if it is in the view or was never archived.

        Raises:
            UnavailableError: the view holds its tombstone but the store cannot give the
                record now (a bus outage): answering "new job" would run it a second time.
        """
        if job_id in self.view.jobs:
            return None
        return self._archive_answer(job_id, await self.ended.get(job_id))

    def _archive_answer(self, job_id: str, rec: JobRecord | None) -> JobRecord | None:
        """``rec``, the ended-jobs store's answer for ``job_id`` (a job not in the view).

        Raises:
            UnavailableError: no record, but the view holds the job's tombstone (it did end)."""
        if rec is None and job_id in self.view.tombstones:
            raise UnavailableError(f"job {job_id} ended and its record cannot be read now; retry")
        return rec

    def _retried(self, existing: JobRecord, spec: JobSpec, rid: str, principal: Principal) -> pb.SubmitJobResponse:
        """The answer to a submission whose idempotency key (principal, tenant, project,
        request id) already made ``existing``: that job when the spec is the same.

        Raises:
            AlreadyExistsError: the spec differs; the message names the existing job only when
                the caller may read it.
        """
        # a job whose priority was changed since (SetJobPriority rewrites its spec) is still the
        # one this request made: its priority is left out of the comparison then
        ignore = {"priority"} if existing.priority_changes else set()
        if existing.spec.model_dump(mode="json", exclude=ignore) == spec.model_dump(mode="json", exclude=ignore):
            return pb.SubmitJobResponse(job_id=existing.job_id, state=STATE_TO_PB[existing.state], duplicate=True)
        try:
            check_job_access(principal, existing)
            which = f"job {existing.job_id}"
        except (NotFoundError, PermissionDeniedError):
            which = "another job"
        raise AlreadyExistsError(f"request_id {rid!r} of {principal.name} in {spec.tenant}/{spec.project} already "
                                 f"made {which} with a different spec; use a new request_id for a new job")

    async def _await_job(self, job_id: str, timeout_s: float = 10.0) -> JobRecord:
        """The view's record of ``job_id`` once it has one (another call published it first).

        Raises:
            UnavailableError: not there within ``timeout_s`` (the caller may retry).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while job_id not in self.view.jobs:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise UnavailableError(f"job {job_id} is stored in the event stream but admission cannot read it "
                                       f"back yet; retry with the same request_id: it answers with this job and "
                                       f"never makes a second one")
            try:
                await asyncio.wait_for(self.view.changed(job_id).wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self.view.jobs[job_id]

    async def _record_rejections(self, refused: list[tuple[pb.SubmitJobRequest, FedError]],
                                 principal: Principal) -> None:
        """Publish ``submission.rejected`` for each refused request (together; a bus outage is
        logged, never raised: the caller already has its answer)."""
        if not refused:
            return
        gov = self.policy.current
        items = []
        for request, e in refused:
            tenant = request.spec.tenant if request.HasField("spec") else ""
            known = gov is not None and is_name("tenant", tenant) and gov.tenant(tenant) is not None
            payload = SubmissionRejected(code=status_for(e).name,
                                         field=getattr(e, "field", "") or getattr(e, "limit", ""),
                                         message=e.message[:500], request_id=request.request_id[:128])
            event = make_event(EventType.SUBMISSION_REJECTED, payload, producer="admission",
                               occurred_at=self.clock.time(), tenant=tenant if known else "", actor=principal.name,
                               policy_version=gov.version if gov else "")
            items.append((self.subjects.admission_rejected(), event, None))
        try:
            ok = await self.publisher.publish_many(items)
        except UnavailableError:
            ok = [False]
        if not all(ok):
            log.warning("could not record %d rejected submission(s): bus unavailable", ok.count(False) or len(items))

    # ------------------------------------------------------------------ read

    def _get(self, job_id: str, *, write: bool = False) -> JobRecord:
        if not job_id:
            raise ValidationError("job_id", "required")
        if len(job_id) > 64 or not job_id.isprintable():
            raise ValidationError("job_id", "not a job id (j- and 20 hex characters)")
        rec = self.view.jobs.get(job_id)
        if rec is None:
            raise NotFoundError("job", job_id)
        check_job_access(auth.current(), rec, write=write)
        return rec

    async def _read(self, job_id: str) -> JobRecord:
        """The record of ``job_id`` for a read: from the view, else (an ended job that left it)
        from the ended-jobs read model (:mod:`services.admission.ended`).

        Raises:
            ValidationError: not a job id. NotFoundError: no such job, or one the caller may not
                read (the same error: :func:`check_job_access`).
        """
        try:
            return self._get(job_id)
        except NotFoundError:
            rec = await self.ended.get(job_id)
            if rec is None:
                raise
        check_job_access(auth.current(), rec, write=False)
        return rec

    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        return job_to_pb(await self._read(request.job_id))

    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        """A page of the jobs the caller may read that match the filters, newest first unless
        asked otherwise (:func:`services.admission.listing.list_page`: opaque tokens bound to
        the filters, ``(submitted_at, job_id)`` cursors, pages of at most ~1 MiB)."""
        return list_page(self.view, request, auth.current(), job_to_pb, names=self.filter_names())

    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.CancelJobResponse:
        principal = auth.current()
        try:
            rec = self._get(request.job_id, write=True)
        except NotFoundError:
            ended = await self.ended.get(request.job_id)  # ended long ago: a conflict, not unknown
            if ended is None:
                raise
            check_job_access(principal, ended, write=True)
            raise ConflictError(f"job {ended.job_id} is already {ended.state.value}") from None
        if len(request.reason) > 500:
            raise ValidationError("reason", "at most 500 characters")
        if rec.state in TERMINAL_STATES:
            raise ConflictError(f"job {rec.job_id} is already {rec.state.value}")
        gov = self.policy.current
        event = make_event(EventType.JOB_CANCEL_REQUESTED, JobCancelRequested(reason=request.reason), producer="admission",
                           occurred_at=self.clock.time(), event_id=business_event_id(rec.job_id, "cancel"),
                           tenant=rec.spec.tenant, project=rec.spec.project, job_id=rec.job_id, actor=principal.name,
                           policy_version=gov.version if gov else "")
        await self.publisher.publish(self.subjects.job("cancel", rec.spec.tenant, rec.spec.project), event)
        self.view.apply(event)
        return pb.CancelJobResponse(job=job_to_pb(rec))

    # ------------------------------------------------------------------ bulk actions

    #: at most this many ids in one selector (a selector by filters walks the open jobs only)
    MAX_BULK_IDS = 1000

    def _select(self, principal: Principal, sel: pb.JobSelector) -> list[tuple[str, JobRecord | None, FedError | None]]:
        """The jobs a bulk request names: ``(job_id, record or None, refusal or None)`` each.

        By ids: every id, in request order (duplicates once); an id that does not exist or that
        the caller may not read is NOT_FOUND alike (no leak), one the caller may read but not
        write is PERMISSION_DENIED. By filters (AND across fields, OR within one; an empty
        selector matches nothing): the open jobs (never the history) the caller may write,
        oldest first.

        Raises:
            ValidationError: ids together with filters, too many ids, a malformed name, state or
                pattern.
        """
        filters = bool(sel.tenants or sel.projects or sel.states or sel.name_pattern)
        if sel.job_ids:
            if filters:
                raise ValidationError("selector", "give job ids or filters, not both")
            if len(sel.job_ids) > self.MAX_BULK_IDS:
                raise ValidationError("selector.job_ids", f"at most {self.MAX_BULK_IDS} ids per call")
            out, seen = [], set()
            for job_id in sel.job_ids:
                if job_id in seen:
                    continue
                seen.add(job_id)
                rec = self.view.jobs.get(job_id) if job_id and len(job_id) <= 64 else None
                if rec is None or not (principal.can_read(rec.spec.tenant, rec.spec.project)
                                       or principal.can_cancel(rec.spec.tenant, rec.spec.project)):
                    out.append((job_id, None, NotFoundError("job", job_id)))
                elif not principal.can_cancel(rec.spec.tenant, rec.spec.project):
                    out.append((job_id, rec, PermissionDeniedError(
                        f"{principal.name} may not act on jobs of {rec.spec.tenant}/{rec.spec.project}")))
                else:
                    out.append((job_id, rec, None))
            return out
        if not filters:
            return []
        tenants = {check_name("tenant", t, f"selector.tenants[{i}]") for i, t in enumerate(sel.tenants)}
        projects = {check_name("project", p, f"selector.projects[{i}]") for i, p in enumerate(sel.projects)}
        states = set()
        for i, st in enumerate(sel.states):
            if st not in STATE_FROM_PB:
                raise ValidationError(f"selector.states[{i}]", f"unknown state {st}")
            states.add(STATE_FROM_PB[st])
        pattern = sel.name_pattern
        if len(pattern) > 256 or not pattern.isprintable():
            raise ValidationError("selector.name_pattern", "at most 256 printable characters (a shell-style glob)")
        matched = []
        for tenant, ids in self.view.open_by_tenant.items():
            if tenants and tenant not in tenants:
                continue
            for job_id in ids:
                rec = self.view.jobs.get(job_id)
                if rec is None or (projects and rec.spec.project not in projects):
                    continue
                if (states and rec.state not in states) or (pattern and not fnmatch.fnmatchcase(rec.spec.name, pattern)):
                    continue
                if principal.can_cancel(rec.spec.tenant, rec.spec.project):
                    matched.append(rec)
        matched.sort(key=lambda r: (r.submitted_at, r.job_id))
        return [(r.job_id, r, None) for r in matched]

    async def _bulk(self, request: pb.BulkJobsRequest, action: str) -> pb.BulkJobsResponse:
        """One bulk action (``cancel``, ``hold``, ``release``) over the selected jobs: per job a
        precondition check, then one pipelined publish of every event; each job gets its result
        (code 0, or the gRPC code of its refusal) and its state afterwards."""
        principal = auth.current()
        if len(request.reason) > 500:
            raise ValidationError("reason", "at most 500 characters")
        if not request.HasField("selector"):
            raise ValidationError("selector", "required (job ids or filters)")
        gov = self.policy.current
        out = pb.BulkJobsResponse()
        results: list[pb.BulkJobResult] = []  # filled in place, copied into the response at the end
        todo: list[tuple[pb.BulkJobResult, JobRecord, Envelope]] = []
        for job_id, rec, refusal in self._select(principal, request.selector):
            result = pb.BulkJobResult(job_id=job_id)
            if refusal is None:
                out.matched += 1  # the caller may act on it (whether its state allows it or not)
                try:
                    event = self._action_event(action, rec, principal, request.reason, gov)
                except ConflictError as e:
                    refusal = e
            if refusal is not None:
                result.code, result.message = status_for(refusal).value[0], refusal.message
                if rec is not None and not isinstance(refusal, NotFoundError):
                    result.state = STATE_TO_PB[rec.state]
                results.append(result)
                continue
            if event is None:  # nothing to do (already held)
                result.message, result.state = f"already {rec.state.value}", STATE_TO_PB[rec.state]
                out.succeeded += 1
                results.append(result)
                continue
            if request.dry_run:
                result.message, result.state = f"would {action}", STATE_TO_PB[rec.state]
                out.succeeded += 1
            else:
                todo.append((result, rec, event))
            results.append(result)
        if todo:
            items = [(self.subjects.job(_VERBS[action], rec.spec.tenant, rec.spec.project), event, None)
                     for _, rec, event in todo]
            acks = await self.publisher.publish_many(items)
            for (result, rec, event), ok in zip(todo, acks):
                if ok:
                    self.view.apply(event)
                    result.message = _DONE[action]
                    out.succeeded += 1
                else:
                    result.code, result.message = grpc.StatusCode.UNAVAILABLE.value[0], "the bus did not take it; retry"
                result.state = STATE_TO_PB[rec.state]
        out.results.extend(results)
        return out

    def _action_event(self, action: str, rec: JobRecord, principal: Principal, reason: str,
                      gov: Governance | None) -> Envelope | None:
        """The event of ``action`` on ``rec`` (None: nothing to do).

        Raises:
            ConflictError: the job is in no state for it (ended, placed or running for a hold,
                awaiting approval, not held for a release).
        """
        state = rec.state
        if state in TERMINAL_STATES:
            raise ConflictError(f"job {rec.job_id} is already {state.value}")
        if action == "cancel":
            etype, payload, key = EventType.JOB_CANCEL_REQUESTED, JobCancelRequested(reason=reason), ("cancel",)
        elif action == "hold":
            if state == JobState.HELD:
                return None
            if rec.cancel_requested:
                raise ConflictError(f"job {rec.job_id} is being cancelled")
            if state != JobState.QUEUED:
                raise ConflictError(f"job {rec.job_id} is {state.value}; only a queued job can be held"
                                    + (" (an approver decides it first)" if state == JobState.AWAITING_APPROVAL else ""))
            etype, payload, key = EventType.JOB_HELD, JobHeld(reason=reason), ("job.held", rec.holds + 1)
        else:
            if state != JobState.HELD:
                raise ConflictError(f"job {rec.job_id} is {state.value}, not held")
            etype, payload, key = EventType.JOB_RELEASED, JobHeld(reason=reason), ("job.released", rec.holds)
        return make_event(etype, payload, producer="admission", occurred_at=self.clock.time(),
                          event_id=business_event_id(rec.job_id, *key), tenant=rec.spec.tenant,
                          project=rec.spec.project, job_id=rec.job_id, actor=principal.name,
                          policy_version=gov.version if gov else "")

    async def CancelJobs(self, request: pb.BulkJobsRequest, context) -> pb.BulkJobsResponse:
        """Cancel the selected jobs (queued and held ones end at once, running ones are stopped)."""
        return await self._bulk(request, "cancel")

    async def HoldJobs(self, request: pb.BulkJobsRequest, context) -> pb.BulkJobsResponse:
        """Hold the selected queued jobs (state HELD: the scheduler ignores them until released).
        A placed, running or awaiting-approval job gets FAILED_PRECONDITION; a held one stays so."""
        return await self._bulk(request, "hold")

    async def ReleaseJobs(self, request: pb.BulkJobsRequest, context) -> pb.BulkJobsResponse:
        """Release the selected held jobs (they wait again with their original submit time)."""
        return await self._bulk(request, "release")

    async def SetJobPriority(self, request: pb.SetJobPriorityRequest, context) -> pb.Job:
        """Change the priority class of a queued or held job (``job.priority_changed``, audited
        with who and why). Same class: no event.

        Raises:
            ValidationError: reason over 500 characters, unknown or unspecified priority.
            NotFoundError / PermissionDeniedError: as CancelJob.
            ConflictError: the job is placed, running, awaiting approval or ended.
        """
        principal = auth.current()
        rec = self._get(request.job_id, write=True)
        if len(request.reason) > 500:
            raise ValidationError("reason", "at most 500 characters")
        if request.priority == pb.PRIORITY_CLASS_UNSPECIFIED or request.priority not in PRIORITY_FROM_PB:
            raise ValidationError("priority", "one of critical, high, normal, low, best_effort")
        new = PRIORITY_FROM_PB[request.priority]
        if rec.state not in (JobState.QUEUED, JobState.HELD) or rec.cancel_requested:
            raise ConflictError(f"job {rec.job_id} is {rec.state.value}; only a queued or held job changes priority")
        if new == rec.spec.priority:
            return job_to_pb(rec)
        gov = self.policy.current
        # one id per request: a count read before the publish's await would give two concurrent
        # calls the same id, and JetStream would drop the second as a duplicate
        event = make_event(EventType.JOB_PRIORITY_CHANGED,
                           JobPriorityChanged(previous=rec.spec.priority, priority=new, reason=request.reason),
                           producer="admission", occurred_at=self.clock.time(), event_id=random_event_id(),
                           tenant=rec.spec.tenant, project=rec.spec.project, job_id=rec.job_id, actor=principal.name,
                           policy_version=gov.version if gov else "")
        changes = rec.priority_changes
        ack = await self.publisher.publish(self.subjects.job("priority", rec.spec.tenant, rec.spec.project), event)
        if getattr(ack, "duplicate", False):
            # the stream already holds an event with this id (a retried publish): what it says is
            # folded by the follower, never this call's copy applied locally
            await self._await_change(rec, lambda: rec.priority_changes > changes, PRIORITY_FOLD_WAIT_S)
        else:
            self.view.apply(event)
        return job_to_pb(rec)

    async def _await_change(self, rec: JobRecord, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` seconds) until ``done()`` holds for ``rec`` after one of
        its changes in the view; True when it does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            left = deadline - loop.time()
            if left <= 0 or rec.state in TERMINAL_STATES:
                return done()
            try:
                await asyncio.wait_for(self.view.changed(rec.job_id).wait(), left)
            except asyncio.TimeoutError:
                return done()
        return True

    async def ExplainJob(self, request: pb.ExplainJobRequest, context) -> pb.ExplainJobResponse:
        return explain_to_pb(await self._read(request.job_id))

    async def GetJobLogs(self, request: pb.GetJobLogsRequest, context) -> AsyncIterator[pb.LogChunk]:
        """The output of one attempt, proxied from the agent of its cluster (authorised like
        GetJob). Raises NotFoundError (unknown job, shard, attempt or worker), ConflictError
        (FAILED_PRECONDITION: the attempt's backend keeps no logs, e.g. the trace backend) and
        UnavailableError (no agent answer within the timeout, or its backend failed)."""
        rec = self._get(request.job_id)
        if request.shard >= len(rec.shards):
            raise NotFoundError("shard", str(request.shard))
        shard = rec.shards[request.shard]
        att = shard.attempt(request.attempt) if request.HasField("attempt") else shard.current
        if att is None:
            raise NotFoundError("attempt", f"{request.job_id}/{request.attempt if request.HasField('attempt') else 1}")
        worker = request.worker if request.HasField("worker") else None
        if worker is not None and worker >= rec.spec.workers:
            raise NotFoundError("worker", f"{worker} (job {rec.job_id} has workers 0..{rec.spec.workers - 1})")
        if not att.cluster or self.request_logs is None:
            raise UnavailableError(f"attempt {att.attempt} of job {rec.job_id} has no cluster to ask for logs")
        ask = LogRequest(job_id=rec.job_id, attempt=att.attempt, shard=request.shard, worker=worker,
                         follow=request.follow)
        async for reply in self.request_logs(self.subjects.logs(att.region, att.cluster), ask):
            if reply.code == "not_found":
                missing = NotFoundError("attempt", f"{rec.job_id}/{att.attempt}")
                missing.args = (reply.error or missing.args[0],)  # the agent's words say what is missing
                raise missing
            if reply.code == "no_logs":  # the attempt exists; its cluster's backend keeps no logs
                raise ConflictError(reply.error or f"the backend of {att.cluster} keeps no logs")
            if reply.code:
                raise UnavailableError(reply.error or f"the agent of {att.cluster} could not read the logs")
            if reply.data:
                yield pb.LogChunk(attempt=att.attempt, cluster=att.cluster, data=reply.data)

    async def WatchJob(self, request: pb.WatchJobRequest, context) -> AsyncIterator[pb.Job]:
        rec = await self._read(request.job_id)
        if request.job_id not in self.view.jobs:  # ended and left the view: its last state
            yield job_to_pb(rec)
            return
        seen = -1
        while True:
            if rec.version != seen:
                seen = rec.version
                yield job_to_pb(rec)
                if rec.state in TERMINAL_STATES:
                    return  # no change event made for a watch that ends here (it would stay behind)
                continue  # the job may have changed while the client took the state: look again
            # no await between the version check and this: a change cannot slip between them
            await self.view.changed(rec.job_id).wait()


#: bulk action -> the verb of its subject, and the word for a job it was done to
_VERBS = {"cancel": "cancel", "hold": "hold", "release": "release"}
_DONE = {"cancel": "cancel requested", "hold": "held", "release": "released"}


@dataclass(frozen=True)
class TlsFiles:
    """TLS for the gRPC port: server certificate and key (PEM files); with ``client_ca``,
    clients must present a certificate signed by it (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """The server credentials (reads the files)."""
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


class AdmissionService:
    """Runs the gRPC server and keeps its read models current: jobs, approvals, spend, the
    policy in force, the card models and regions agents report.

    Args:
        bus: NATS connection.
        clock: business clock.
        address: ``host:port`` to listen on (port 0 = any free port; see :attr:`port`).
        limits: admission limits overriding the policy's (None = the policy's).
        max_message_bytes: largest request accepted (bigger: RESOURCE_EXHAUSTED from gRPC).
        prices: price catalog (budgets' worst-case cost); default the bundled one.
        tls: serve TLS / mTLS instead of plaintext.
        names: the topology's region/zone/cluster names (passed in by the composition layer):
            job regions, tenants, quotas and policies are checked against them. None = no
            topology given: job regions are checked against what agents report.
        spend_poll_s: how often to look for billing's spend KV bucket until it exists.
        logs_timeout_s: how long GetJobLogs waits for the agent (then UNAVAILABLE).
        stale_after_s: wall seconds after which a silent cluster shows unhealthy in
            ListClusters (the scheduler's freshness limit).
        cluster_gone_after_s: wall seconds of silence after which a cluster is taken as
            decommissioned: no longer listed by ListClusters nor reported down by GetStatus
            (:class:`~services.admission.clusterview.ClusterView`); settings
            ``cluster_gone_after_s``.
        wall: wall clock comparable with JetStream storage times (heartbeat ages; default the
            system clock).
        what_if_timeout_s: how long a dry run waits for the scheduler's what-if (then none).
        metrics: where gRPC calls (by method and code) and jobs by state are counted (default: a
            registry of its own, served by nobody).
        retain_ended: ended jobs kept in memory; older ones are served from the ended-jobs KV
            read model (:mod:`services.admission.ended`).
        snapshot_every_s: write a restart checkpoint (:mod:`services.admission.snapshot`, object
            store ``snapshot_admission``) this many wall seconds after the last one or after
            ``snapshot_every_events`` events, and start from the newest one plus the stream after
            it; 0 = never (a start reads the whole stream).
        snapshot_every_events: see ``snapshot_every_s``.
        gc_young_threshold: once the read models are rebuilt, :func:`fedsched.gctune.tune_for_service` with this young
            generation threshold (a process-wide setting; 0 = leave the collector alone).
    """

    def __init__(self, bus: Bus, clock: Clock, *, address: str = "127.0.0.1:50051", limits: Limits | None = None,
                 max_message_bytes: int = 4 * 1024 * 1024, prices: PriceCatalog | None = None,
                 tls: TlsFiles | None = None, spend_poll_s: float = 5.0, names: KnownNames | None = None,
                 logs_timeout_s: float = 5.0, stale_after_s: float = 10.0, wall: Clock | None = None,
                 what_if_timeout_s: float = 2.0, metrics: AdmissionMetrics | None = None,
                 retain_ended: int = 10_000, snapshot_every_s: float = 0.0,
                 snapshot_every_events: int = 200_000, cluster_gone_after_s: float = 3600.0,
                 gc_young_threshold: int = YOUNG_THRESHOLD) -> None:
        self.bus = bus
        self.gc_young_threshold = gc_young_threshold
        self.wall: Clock = wall if wall is not None else SystemClock()
        self.cluster_view = ClusterView(stale_after_s=stale_after_s, gone_after_s=cluster_gone_after_s)
        self.address = address
        self.tls = tls
        self.policy = PolicyHolder()
        self.ended = EndedJobs(bus)
        self.view = JobView(retain_ended=retain_ended, archive=self.ended.put)
        self.approvals = ApprovalView()
        self.spend = SpendBook()
        self.known_models: set[str] = set()
        self.known_regions: set[str] = set()
        self.clusters: dict[str, ClusterCapacity] = {}  #: cluster -> what it could ever hold (latest inventory)
        prices = prices or load_price_catalog()
        self.servicer = JobServicer(bus, clock, self.policy, self.view, limits, self.known_models,
                                    self.known_regions, self.spend, prices, clusters=self.clusters, names=names)
        self.servicer.ended = self.ended
        self.servicer.request_logs = functools.partial(request_logs, bus.nc, timeout_s=logs_timeout_s)
        self.servicer.what_if = functools.partial(request_what_if, bus.nc, bus.prefix, timeout_s=what_if_timeout_s)
        self.servicer.last_submitted_seq = functools.partial(last_sequence, bus)
        self.servicer.stored_event = functools.partial(stored_event, bus)
        self.tenants = TenantServicer(bus, clock, self.policy, self.spend, self.view, names=names)
        self.approval_servicer = ApprovalServicer(bus, bus.subjects, clock, self.policy, self.approvals, self.view)
        self.policy_servicer = PolicyServicer(bus, clock, self.policy, names)
        self.clock = clock
        self.metrics = metrics if metrics is not None else AdmissionMetrics()
        self.metrics.watch_jobs(lambda: self.view.by_state)
        # the metrics interceptor first: it sees the status the gateway set
        self.server = grpc.aio.server(interceptors=[self.metrics.interceptor(),
                                                    GatewayInterceptor(authenticator(self.policy))], options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ])
        pb_grpc.add_JobServiceServicer_to_server(self.servicer, self.server)
        gpb_grpc.add_TenantServiceServicer_to_server(self.tenants, self.server)
        gpb_grpc.add_ApprovalServiceServicer_to_server(self.approval_servicer, self.server)
        gpb_grpc.add_PolicyServiceServicer_to_server(self.policy_servicer, self.server)
        self.cluster_servicer = ClusterServicer(self.cluster_view, self.view, clock, self.wall,
                                                known_regions=self.servicer.region_names)
        pb_grpc.add_ClusterServiceServicer_to_server(self.cluster_servicer, self.server)
        self.system_servicer = SystemServicer(bus, self.cluster_view, self.wall, self._own_status)
        pb_grpc.add_SystemServiceServicer_to_server(self.system_servicer, self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*GUARDED, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME), self.server)
        self.port = 0
        s = bus.subjects
        self._events = StreamFollower(bus, "EVENTS", self._on_event, name="admission-jobs",
                                      filter_subjects=[s.all("jobs"), s.all("placements"), s.all("decisions"),
                                                       s.all("status"), s.all("governance"),
                                                       s.all("billing", "usage")])
        self._inventory = StreamFollower(bus, "INVENTORY", self._on_inventory, name="admission-inventory",
                                         filter_subjects=[s.all("inventory"), s.all("heartbeat")],
                                         last_per_subject=True)
        self._policy_follower = PolicyFollower(bus, self.policy, name="admission-policy")
        self._spend_watcher = SpendWatcher(bus, self.spend, poll_s=spend_poll_s)
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.snapshot_every_s = snapshot_every_s
        self.snapshot_every_events = max(1, snapshot_every_events)
        self.snapshot_seq = 0  #: stream sequence of the last checkpoint written or loaded (0 = none)
        self._snapshot_wall = 0.0
        self._snapshot_retry_at = 0.0  # after a failed checkpoint: the next try not before this
        self._snapshots = SnapshotStore(bus, "admission") if snapshot_every_s > 0 else None
        self.skipped_inventory = SkippedTypes("admission-inventory")  #: unknown inventory event types skipped

    def lag_sources(self) -> list[tuple[str, Callable[[], Awaitable[int]]]]:
        """``(follower name, async lag())`` of the stream followers that feed this service (the
        ``consumer_lag_messages`` samples; none before they exist)."""
        followers = (getattr(self, "_events", None), getattr(self, "_inventory", None))
        return [(f.name, f.lag) for f in followers if f is not None]

    def skipped_types(self) -> dict[str, dict[str, int]]:
        """Follower -> event type -> events skipped because this build does not know the type."""
        return {c.consumer: c.as_dict() for c in (self.view.skipped, self.skipped_inventory) if c.counts}

    def _on_event(self, d: Delivery):
        """Follower callback of the jobs stream. An order whose fencing token is above the lease
        tenure last read is folded only after the lease is read again (the job view refuses a
        token above the tenure read after the order arrived: issued by no tenure,
        :func:`~fedsched.lease.unissued`)."""
        tenure = self.view.tenure
        if tenure is not None:
            token = JobView.order_token(d.envelope)
            if token is not None and token > tenure.token:
                return self._on_event_after_lease_read(d)
        return self._on_event_now(d)

    async def _on_event_after_lease_read(self, d: Delivery) -> None:
        await self._refresh_tenure()
        result = self._on_event_now(d)
        if result is not None:
            await result

    def _on_event_now(self, d: Delivery):
        route = ADMISSION_EVENTS.route(d.envelope.type)  # unknown types: counted by the job view
        if d.subject and check_subject(self.bus.prefix, d.subject, d.envelope) is not None:
            route = None  # a type that does not belong on its subject: the job view refuses it (issue 14)
            self.view.apply_delivery(d)
        elif route is None:
            self.view.apply_delivery(d, subject_checked=True)  # (checked once, just above)
        else:
            route(self, d)
        if self.view.rejections:  # refused by the trust checks: dead letter + security record
            return self._publish_rejections()
        return None

    async def _publish_rejections(self) -> None:
        """Publish the dead letters and security records of the messages the job view refused
        (:mod:`fedsched.trust`, the refused message embedded up to the bus's
        :func:`~fedsched.trust.dead_letter_room`); a failure for now (not acknowledged) leaves
        them queued for the next event, one the bus refuses for good (``PublishResult.REFUSED``,
        itself dead-lettered by the bus) is not tried again."""
        pending, self.view.rejections = self.view.rejections, []
        room = dead_letter_room(getattr(self.bus, "max_payload", None))
        items = [(subject, event, None) for r in pending
                 for subject, event in rejection_events(self.bus.subjects, r, self.clock.time(), max_data=room)]
        ok = await self.bus.publish_many(items)
        self.view.rejections = [r for i, r in enumerate(pending) if any(map(retryable, ok[2 * i:2 * i + 2]))] + \
            self.view.rejections

    def _to_approvals(self, d: Delivery) -> None:
        self.approvals.apply(d.envelope)
        self.view.apply_delivery(d)

    def _to_spend(self, d: Delivery) -> None:
        self.spend.apply_event(d.envelope)

    def _to_view(self, d: Delivery) -> None:
        self.view.apply_delivery(d)

    def _on_inventory(self, d):
        reason = check_subject(self.bus.prefix, d.subject, d.envelope) if d.subject else None
        if reason is not None:
            log.warning("admission-inventory: refused %s on %s: %s", d.envelope.type, d.subject, reason)
            self.view.rejections.append(Rejection("admission-inventory", d.subject, d.envelope, reason,
                                                  d.stream_sequence))
            return self._publish_rejections()
        fold = INVENTORY_EVENTS.route(d.envelope.type, self.skipped_inventory)
        if fold is not None:
            fold(self, d.envelope)
            self.cluster_view.apply(d, self.wall.time())

    def _on_snapshot(self, env: Envelope) -> None:
        snap = env.payload_as(InventorySnapshot)
        self.known_models.update(n.card_model for n in snap.nodes if n.card_model)
        self.known_regions.add(env.region)
        if env.cluster:
            self.clusters[env.cluster] = ClusterCapacity.from_snapshot(env.region, snap)

    async def _own_status(self) -> tuple[str, int]:
        """(detail, lag) of this admission for GetStatus: jobs known, policy, and the messages its
        job-view follower has not read yet (from its consumer's info; 0 when unknown)."""
        lag = 0
        try:
            info = await asyncio.wait_for(self._events.consumer_info(), 2.0)
            if info is not None:
                lag = int(info.num_pending or 0)
        except Exception as e:  # noqa: BLE001 - a consumer being recreated: lag unknown
            log.info("status: admission follower info: %r", e)
        open_jobs = sum(len(ids) for ids in self.view.open_by_tenant.values())
        return (f"{len(self.view.jobs)} jobs known ({open_jobs} open), policy {self.policy.version or '-'}, "
                f"{len(self.cluster_view.clusters)} clusters reporting"), lag

    def _on_heartbeat(self, env: Envelope) -> None:
        """A heartbeat: only the capacity view needs it (folded by :meth:`_on_inventory`)."""

    # ------------------------------------------------------------------ checkpoints

    def snapshot_bytes(self) -> bytes:
        """The read models as a checkpoint reflecting the stream up to the job view's
        ``applied_seq`` (:mod:`services.admission.snapshot`)."""
        return snapshots.encode("admission", ADMISSION_STATE_VERSION, self.view.applied_seq,
                                admission_state(self.view, self.approvals, self.spend))

    def restore(self, data: bytes) -> int:
        """Load a checkpoint into this new service's read models; the stream sequence to read
        from.

        Raises:
            fedsched.snapshots.SnapshotError: corrupt, incompatible or malformed (the read
                models are left empty).
        """
        snap = snapshots.decode(data, "admission", ADMISSION_STATE_VERSION)
        try:
            restore_admission(self.view, self.approvals, self.spend, snap.state, snap.applied_seq)
        except (KeyError, TypeError, ValueError) as e:
            self._forget_read_models()
            raise snapshots.SnapshotError(f"malformed admission snapshot: {e!r}") from e
        # the restore filled view.jobs without the view's listeners: the budget holds of the
        # restored open jobs are derived here (else a restart would let a tenant overspend)
        self.servicer.rederive_budget_holds()
        self.snapshot_seq = snap.applied_seq
        return snap.applied_seq + 1

    def _forget_read_models(self) -> None:
        """Empty the job and approval views and the event spend (a checkpoint failed halfway)."""
        by_state, listeners = self.view.by_state, self.view.listeners
        self.view.__init__(retain_ended=self.view.retain_ended, archive=self.view.archive,
                           retain_tombstones=self.view.tombstones.limit)
        self.view.by_state = by_state  # the metrics' scrape thread holds this dict: keep it, zeroed
        self.view.listeners = listeners  # budget holds follow the view's changes from now on too
        self.servicer.rederive_budget_holds()
        for state in by_state:
            by_state[state] = 0
        self.approvals.by_id.clear()
        getattr(self.spend, "from_events", {}).clear()

    async def _load_snapshot(self) -> None:
        """Restore the newest usable checkpoint and start the job follower after it (a corrupt
        or incompatible one is warned about: the whole stream is read)."""
        data = await self._snapshots.read()
        if data is None:
            return
        t0 = time.perf_counter()  # a log figure, not a rule
        try:
            start = self.restore(data)
        except snapshots.SnapshotError as e:
            log.warning("admission: snapshot not used (%s); reading the whole stream", e)
            return
        self._events.next_sequence = start
        log.info("admission: restored %d jobs at sequence %d from a snapshot (%d bytes) in %.2f s",
                 len(self.view.jobs), start - 1, len(data), time.perf_counter() - t0)

    async def maybe_snapshot(self, *, force: bool = False) -> bool:
        """Write a checkpoint when one is due; True when written. Written only once every job
        that left the view before it is in the ended-jobs bucket; a failure (or a deferral) is
        logged and retried a period later (:func:`fedsched.snapshots.checkpoint_due`)."""
        if self._snapshots is None or self.view.rejections:
            return False
        now = self.wall.time()
        if not snapshots.checkpoint_due(applied_seq=self.view.applied_seq, written_seq=self.snapshot_seq, now=now,
                                        written_at=self._snapshot_wall, every_s=self.snapshot_every_s,
                                        every_events=self.snapshot_every_events, retry_at=self._snapshot_retry_at,
                                        force=force):
            return False
        seq, capture = self.view.applied_seq, None
        try:
            await self.ended.flush()  # what left the view so far: stored before the capture, so it rarely waits
            seq = self.view.applied_seq
            # the read models as they are now, walked and encoded by a forked child (the loop's
            # own work does not grow with the jobs held: fedsched.snapshots.ForkedCapture)
            capture = snapshots.ForkedCapture(self.snapshot_bytes)
            left = set(self.ended.pending)  # left the view before this state: must be stored first
            await self.ended.flush()
            if left & self.ended.pending.keys():
                self._snapshot_retry_at = now + self.snapshot_every_s
                log.warning("admission: snapshot at sequence %d deferred: ended jobs not yet stored", seq)
                return False
            data = await capture.result()
            await self._snapshots.write(data)
        except Exception as e:  # noqa: BLE001 - a checkpoint is an optimisation; the stream is the truth
            self._snapshot_retry_at = now + self.snapshot_every_s
            log.warning("admission: snapshot at sequence %d not written: %s; next try in %g s", seq, e,
                        self.snapshot_every_s)
            return False
        finally:
            if capture is not None:
                await capture.discard()
        self.snapshot_seq, self._snapshot_wall = seq, now
        log.info("admission: snapshot at sequence %d (%d jobs, %d bytes)", seq, len(self.view.jobs), len(data))
        return True

    async def _snapshot_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            try:
                await self.maybe_snapshot()
            except Exception:  # noqa: BLE001 - never stop serving for a checkpoint
                log.exception("admission: snapshot failed")

    async def start(self) -> None:
        """Rebuild the read models (from the newest checkpoint and the stream after it, or the
        whole stream), wait for a policy, then start serving (sets :attr:`ready`)."""
        if self._snapshots is not None:
            await self._load_snapshot()
            self._snapshot_wall = self.wall.time()
        await self._refresh_tenure()  # before the stream: a late order of a former scheduler is not folded
        self._tasks = [asyncio.create_task(self._events.run(), name="admission-events"),
                       asyncio.create_task(self._tenure_loop(), name="admission-lease"),
                       asyncio.create_task(self._inventory.run(), name="admission-inventory"),
                       asyncio.create_task(self._policy_follower.run(), name="admission-policy"),
                       asyncio.create_task(self._spend_watcher.run(), name="admission-spend"),
                       asyncio.create_task(self.ended.run(self._stop), name="admission-ended-jobs")]
        if self._snapshots is not None:
            self._tasks.append(asyncio.create_task(self._snapshot_loop(), name="admission-snapshots"))
        await self._events.caught_up.wait()
        await self._inventory.caught_up.wait()
        if self.gc_young_threshold:
            tune_for_service(self.gc_young_threshold)  # the rebuilt read models: never walked by collections again
        if not self.policy.ready.is_set():
            await self._policy_follower.initial.wait()
            if not self.policy.ready.is_set():
                log.warning("admission: no governance policy stored yet; waiting for one "
                            "(the embedded system bootstraps it; see `fedsched policy apply`)")
            await self.policy.ready.wait()
        try:
            if self.tls is not None:
                self.port = self.server.add_secure_port(self.address, self.tls.credentials())
            else:
                self.port = self.server.add_insecure_port(self.address)
        except RuntimeError as e:  # grpc's "Failed to bind" / bad address
            raise UnavailableError(f"admission cannot listen on {self.address!r} ({e}); is the port taken "
                                   f"(another `fedsched up`?) or the address not host:port?{self._tls_hint()} "
                                   f"Pass --grpc-address") from e
        if self.port == 0:
            raise UnavailableError(f"admission cannot listen on {self.address}; is the port taken (another "
                                   f"`fedsched up`?){self._tls_hint()} Pass --grpc-address")
        await self.server.start()
        for name in (*GUARDED, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        log.info("admission: serving on port %d%s (%d jobs known, policy %s)", self.port,
                 " with TLS" + (" (client certificates required)" if self.tls.client_ca else "") if self.tls else "",
                 len(self.view.jobs), self.policy.version)

    async def _refresh_tenure(self) -> None:
        """Read the scheduler lease's current tenure into the job view (fencing of late orders,
        :func:`~fedsched.lease.stale_order`); an unreachable NATS keeps the last one read."""
        try:
            self.view.tenure = await read_tenure(self.bus)
        except UnavailableError as e:
            log.info("admission: scheduler lease not read (%s)", e)

    async def _tenure_loop(self, every_s: float = 0.5) -> None:
        """Follow the scheduler lease (a read every ``every_s`` seconds) until stopped."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=every_s)
            except asyncio.TimeoutError:
                await self._refresh_tenure()

    def _tls_hint(self) -> str:
        return (" Or are --tls-cert / --tls-key not a matching PEM certificate and key?" if self.tls is not None
                else "")

    async def run(self) -> None:
        """Serve until :meth:`stop`."""
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace=2)
            for follower in (self._events, self._inventory, self._policy_follower, self._spend_watcher):
                follower.stop()
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return (graceful)."""
        self._stop.set()


#: Where admission's ``admission-jobs`` follower sends an event besides (or instead of) the job
#: view, which takes every other type (its own table, :data:`~services.admission.jobview.JOB_VIEW_EVENTS`,
#: says which it folds and counts unknown ones).
ADMISSION_EVENTS: EventTable = EventTable({
    EventType.APPROVAL_REQUESTED: AdmissionService._to_approvals,
    **{t: AdmissionService._to_approvals for t in APPROVAL_OUTCOMES},
    EventType.USAGE_RECORDED: AdmissionService._to_spend,
})

#: ``admission-inventory``: the snapshots tell which card models and regions exist; snapshots and
#: heartbeats both feed the capacity view (:class:`~services.admission.clusterview.ClusterView`).
INVENTORY_EVENTS: EventTable = EventTable({EventType.INVENTORY_SNAPSHOT: AdmissionService._on_snapshot,
                                           EventType.INVENTORY_HEARTBEAT: AdmissionService._on_heartbeat})
