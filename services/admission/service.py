"""The admission service: the gRPC front door (``fedsched.api.v1.JobService``).

It validates a submission (known tenant and project, sane resources, canonical card models,
names by the naming rules), assigns the job id, and publishes ``job.submitted``; it serves job
state from its :class:`~services.admission.jobview.JobView`. Bad input gets INVALID_ARGUMENT
whose message starts with the offending field; refusals are published as
``submission.rejected`` so the audit log has the submission success rate.

Idempotency: with a ``request_id``, the job id and the event id are derived from
(tenant, request_id), so concurrent retries publish the same message id (JetStream keeps one)
and later retries find the job in the view's request index.

gRPC extras: server reflection, the standard health service, and one interceptor
(:class:`ErrorInterceptor`) that continues the caller's trace and maps errors to status codes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context

from fedsched import telemetry
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Bus, StreamFollower
from fedsched.clock import Clock
from fedsched.errors import (AuthError, ConflictError, FedError, NotFoundError, PermissionDeniedError,
                             QuotaExceededError, UnavailableError, ValidationError)
from fedsched.events import InventorySnapshot, JobCancelRequested, JobSubmitted, SubmissionRejected, business_event_id, \
    make_event
from fedsched.jobs import TERMINAL_STATES
from fedsched.naming import check_name, is_name
from fedsched.tenancy import TenantDirectory
from services.admission.convert import STATE_FROM_PB, STATE_TO_PB, Limits, _ts, spec_from_pb, spec_to_pb
from services.admission.jobview import JobRecord, JobView

log = logging.getLogger(__name__)
tracer = telemetry.tracer("fedsched.admission")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JobService"].full_name

_CODES: list[tuple[type[FedError], grpc.StatusCode]] = [
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
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


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace (``traceparent`` metadata) in a server span, and maps
    :class:`~fedsched.errors.FedError` to status codes (the field goes in trailing metadata
    ``fedsched-field``). Anything else is logged and reported as INTERNAL without internals.
    """

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        carrier = {m.key: m.value for m in (details.invocation_metadata or ()) if isinstance(m.value, str)}

        async def _fail(context, e: Exception) -> None:
            if isinstance(e, FedError):
                field = getattr(e, "field", "")
                if field:
                    context.set_trailing_metadata((("fedsched-field", field),))
                await context.abort(status_for(e), e.message)
            log.exception("admission %s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the admission log")

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                token = otel_context.attach(telemetry.context_from(carrier))
                try:
                    with tracer.start_as_current_span(f"JobService/{method}"):
                        try:
                            return await inner(request, context)
                        except (FedError, Exception) as e:  # noqa: BLE001
                            if isinstance(e, asyncio.CancelledError) or _is_abort(e):
                                raise
                            await _fail(context, e)
                finally:
                    otel_context.detach(token)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                token = otel_context.attach(telemetry.context_from(carrier))
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except (FedError, Exception) as e:  # noqa: BLE001
                    if isinstance(e, asyncio.CancelledError) or _is_abort(e):
                        raise
                    await _fail(context, e)
                finally:
                    otel_context.detach(token)

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return handler


def _is_abort(e: BaseException) -> bool:
    # grpc.aio's context.abort raises an internal exception type; let it through untouched.
    return type(e).__name__ in ("AbortError", "_AbortError") or isinstance(e, grpc.aio.AbortError)


def explain_to_pb(rec: JobRecord) -> pb.ExplainJobResponse:
    """The wire form of a job's latest decisions."""
    out = pb.ExplainJobResponse(job_id=rec.job_id, state=STATE_TO_PB[rec.state])
    for shard in rec.shards:
        d = shard.decision
        if d is None:
            out.decisions.append(pb.ShardDecision(shard=shard.index, outcome="none",
                                                  summary="the scheduler has not decided about it yet"))
            continue
        msg = pb.ShardDecision(shard=shard.index, outcome=d.outcome, summary=d.reason, cluster=d.cluster,
                               region=d.region, queue=d.queue, counterfactual=d.counterfactual,
                               policy_version=d.policy_version, fits_empty=d.fits_empty,
                               reserved_cluster=d.reserved_cluster)
        msg.decided_at.CopyFrom(_ts(d.at))
        for e in d.evaluations:
            v = pb.ClusterVerdict(cluster=str(e.get("cluster", "")), region=str(e.get("region", "")),
                                  passed=bool(e.get("passed")), reason=str(e.get("reason", "")),
                                  detail=str(e.get("detail", "")),
                                  scores={k: float(x) for k, x in (e.get("scores") or {}).items()})
            if e.get("total") is not None:
                v.total = float(e["total"])
            msg.clusters.append(v)
        out.decisions.append(msg)
    return out


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


class JobServicer(pb_grpc.JobServiceServicer):
    """The JobService implementation.

    Args:
        bus: NATS connection.
        clock: business clock (submission times).
        tenants: known tenants and projects.
        view: the job read model (kept current by :class:`AdmissionService`).
        limits: admission limits.
        known_models: card models reported by agents (kept current by :class:`AdmissionService`).
    """

    def __init__(self, bus: Bus, clock: Clock, tenants: TenantDirectory, view: JobView, limits: Limits,
                 known_models: set[str], known_regions: set[str]) -> None:
        self.bus = bus
        self.clock = clock
        self.tenants = tenants
        self.view = view
        self.limits = limits
        self.known_models = known_models
        self.known_regions = known_regions

    # ------------------------------------------------------------------ submit

    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.SubmitJobResponse:
        try:
            return await self._submit(request, principal="anonymous")
        except (ValidationError, QuotaExceededError) as e:
            await self._record_rejection(request, e)
            raise

    async def _submit(self, request: pb.SubmitJobRequest, principal: str) -> pb.SubmitJobResponse:
        if not request.HasField("spec"):
            raise ValidationError("spec", "required")
        rid = request.request_id
        if len(rid) > self.limits.max_request_id or (rid and not rid.isprintable()):
            raise ValidationError("request_id", f"at most {self.limits.max_request_id} printable characters")
        raw = request.spec
        tenant = self.tenants.get(raw.tenant)
        if tenant is None:
            check_name("tenant", raw.tenant, "spec.tenant")
            raise ValidationError("spec.tenant", f"unknown tenant {raw.tenant!r}")
        if raw.project and raw.project not in tenant.projects:
            check_name("project", raw.project, "spec.project")
            raise ValidationError("spec.project", f"tenant {tenant.name} has no project {raw.project!r} "
                                                  f"(has {', '.join(sorted(tenant.projects))})")
        spec = spec_from_pb(raw, limits=self.limits, default_home=tenant.home_region,
                            known_models=frozenset(self.known_models))
        regions = self.known_regions | {t.home_region for t in self.tenants}
        for field, values in (("spec.home_region", [spec.home_region]), ("spec.allowed_regions", spec.allowed_regions),
                              ("spec.forbidden_regions", spec.forbidden_regions)):
            for r in values:
                if r not in regions:
                    raise ValidationError(field, f"unknown region {r!r} (known: {', '.join(sorted(regions))})")
        if rid:
            existing = self.view.find_request(spec.tenant, rid)
            if existing is not None:
                return pb.SubmitJobResponse(job_id=existing.job_id, state=STATE_TO_PB[existing.state], duplicate=True)
            job_id = "j-" + hashlib.sha256(f"{spec.tenant}/{rid}".encode()).hexdigest()[:20]
        else:
            job_id = "j-" + uuid.uuid4().hex[:20]
        event = make_event("job.submitted", JobSubmitted(spec=spec, request_id=rid, submitted_by=principal),
                           producer="admission", occurred_at=self.clock.time(),
                           event_id=business_event_id(job_id, "submitted"), tenant=spec.tenant, project=spec.project,
                           job_id=job_id, actor=principal)
        ack = await self.bus.publish(self.bus.subjects.job("submitted", spec.tenant, spec.project), event)
        self.view.apply(event)
        return pb.SubmitJobResponse(job_id=job_id, state=STATE_TO_PB[self.view.jobs[job_id].state],
                                    duplicate=bool(ack.duplicate))

    async def _record_rejection(self, request: pb.SubmitJobRequest, e: FedError) -> None:
        tenant = request.spec.tenant if request.HasField("spec") else ""
        payload = SubmissionRejected(code=status_for(e).name, field=getattr(e, "field", ""), message=e.message[:500],
                                     request_id=request.request_id[:128])
        event = make_event("submission.rejected", payload, producer="admission", occurred_at=self.clock.time(),
                           tenant=tenant if is_name("tenant", tenant) and self.tenants.get(tenant) else "",
                           actor="anonymous")
        try:
            await self.bus.publish(self.bus.subjects.admission_rejected(), event)
        except UnavailableError:
            log.warning("could not record a rejected submission: bus unavailable")

    # ------------------------------------------------------------------ read

    def _get(self, job_id: str) -> JobRecord:
        if not job_id:
            raise ValidationError("job_id", "required")
        rec = self.view.jobs.get(job_id)
        if rec is None:
            raise NotFoundError("job", job_id)
        return rec

    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        return job_to_pb(self._get(request.job_id))

    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        size = request.page_size or 100
        if size > 1000:
            raise ValidationError("page_size", "must be <= 1000")
        try:
            offset = int(request.page_token or 0)
        except ValueError as e:
            raise ValidationError("page_token", "not a token returned by ListJobs") from e
        if offset < 0:
            raise ValidationError("page_token", "not a token returned by ListJobs")
        states = set()
        for i, s in enumerate(request.states):
            if s not in STATE_FROM_PB:
                raise ValidationError(f"states[{i}]", f"unknown state {s}")
            states.add(STATE_FROM_PB[s])
        jobs = [r for r in self.view.jobs.values()
                if (not request.tenant or r.spec.tenant == request.tenant)
                and (not request.project or r.spec.project == request.project)
                and (not states or r.state in states)]
        jobs.sort(key=lambda r: (r.submitted_at, r.job_id))
        page = jobs[offset:offset + size]
        nxt = str(offset + size) if offset + size < len(jobs) else ""
        return pb.ListJobsResponse(jobs=[job_to_pb(r) for r in page], next_page_token=nxt, total=len(jobs))

    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.CancelJobResponse:
        rec = self._get(request.job_id)
        if rec.state in TERMINAL_STATES:
            raise ConflictError(f"job {rec.job_id} is already {rec.state.value}")
        if len(request.reason) > 500:
            raise ValidationError("reason", "at most 500 characters")
        event = make_event("job.cancel_requested", JobCancelRequested(reason=request.reason), producer="admission",
                           occurred_at=self.clock.time(), event_id=business_event_id(rec.job_id, "cancel"),
                           tenant=rec.spec.tenant, project=rec.spec.project, job_id=rec.job_id, actor="anonymous")
        await self.bus.publish(self.bus.subjects.job("cancel", rec.spec.tenant, rec.spec.project), event)
        self.view.apply(event)
        return pb.CancelJobResponse(job=job_to_pb(rec))

    async def ExplainJob(self, request: pb.ExplainJobRequest, context) -> pb.ExplainJobResponse:
        return explain_to_pb(self._get(request.job_id))

    async def WatchJob(self, request: pb.WatchJobRequest, context) -> AsyncIterator[pb.Job]:
        rec = self._get(request.job_id)
        seen = -1
        while True:
            changed = self.view.changed(rec.job_id)
            if rec.version != seen:
                seen = rec.version
                yield job_to_pb(rec)
                if rec.state in TERMINAL_STATES:
                    return
            await changed.wait()


class AdmissionService:
    """Runs the gRPC server and keeps the job view and the known card models current.

    Args:
        bus: NATS connection.
        clock: business clock.
        tenants: known tenants.
        address: ``host:port`` to listen on (port 0 = any free port; see :attr:`port`).
        limits: admission limits.
    """

    def __init__(self, bus: Bus, clock: Clock, tenants: TenantDirectory, *, address: str = "127.0.0.1:50051",
                 limits: Limits | None = None, max_message_bytes: int = 4 * 1024 * 1024) -> None:
        self.bus = bus
        self.address = address
        self.view = JobView()
        self.known_models: set[str] = set()
        self.known_regions: set[str] = set()
        self.servicer = JobServicer(bus, clock, tenants, self.view, limits or Limits(), self.known_models,
                                    self.known_regions)
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ])
        pb_grpc.add_JobServiceServicer_to_server(self.servicer, self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME), self.server)
        self.port = 0
        self._events = StreamFollower(bus, "EVENTS", self.view.apply_delivery, name="admission-jobs",
                                      filter_subjects=[bus.subjects.all("jobs"), bus.subjects.all("placements"),
                                                       bus.subjects.all("decisions"), bus.subjects.all("status")])
        self._inventory = StreamFollower(bus, "INVENTORY", self._on_inventory, name="admission-inventory",
                                         filter_subjects=[bus.subjects.all("inventory")], last_per_subject=True)
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()

    def _on_inventory(self, d) -> None:
        env = d.envelope
        if env.type == "inventory.snapshot":
            snap = env.payload_as(InventorySnapshot)
            self.known_models.update(n.card_model for n in snap.nodes if n.card_model)
            self.known_regions.add(env.region)

    async def start(self) -> None:
        """Rebuild the view, then start serving (sets :attr:`ready`)."""
        self._tasks = [asyncio.create_task(self._events.run(), name="admission-events"),
                       asyncio.create_task(self._inventory.run(), name="admission-inventory")]
        await self._events.caught_up.wait()
        await self._inventory.caught_up.wait()
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise UnavailableError(f"admission cannot listen on {self.address}")
        await self.server.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        log.info("admission: serving JobService on port %d (%d jobs known)", self.port, len(self.view.jobs))

    async def run(self) -> None:
        """Serve until :meth:`stop`."""
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace=2)
            self._events.stop()
            self._inventory.stop()
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return (graceful)."""
        self._stop.set()
