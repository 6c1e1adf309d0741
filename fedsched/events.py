"""The event envelope, the event types, their payloads and their subjects.

Every bus message is one :class:`Envelope` (JSON, UTF-8). The envelope carries the routing
names (region, zone, cluster, tenant, project, job) so consumers and the audit log never have to
open the payload to route or index; the payload is one typed model per event type
(:data:`PAYLOADS`, keyed by :class:`EventType`). Trace context is not in the envelope: it travels in the NATS headers
(W3C ``traceparent``) and the audit log records its trace id.

Subjects carry the routing names as tokens (see :class:`Subjects`), e.g.
``fed.inventory.cn-north-1.cn-north-1-c1``, so NATS permissions can confine an agent to its own
region and cluster. Names are validated by :mod:`fedsched.naming` before they become tokens.

Event ids are deterministic where a business id exists (``job.started`` of job J attempt 2 is
always the same id), so a republished event deduplicates on the bus (``Nats-Msg-Id``) and in the
audit log; see :func:`business_event_id`.

Schema evolution: ``schema_version`` is 1; readers accept unknown payload fields of a newer
minor change only where a payload model says so (``extra="ignore"``), and reject a higher
major version with a :class:`~fedsched.errors.DecodeError` (the message goes to dead letter).

Event types a reader does not know (a newer producer during a rolling upgrade) still decode when
their name is well formed (:data:`TYPE_PATTERN`): the audit log keeps them and consumers skip them
and count them (:mod:`fedsched.dispatch`), instead of dead-lettering them. A malformed type name is
a :class:`~fedsched.errors.DecodeError` like any other invalid envelope.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError as PydanticValidationError

from fedsched import naming
from fedsched.clock import UtcDatetime, to_datetime
from fedsched.errors import DecodeError, EventTypeError, ValidationError
from fedsched.jobs import JobSpec, PriorityClass

SCHEMA_VERSION = 1

_EVENT_NS = uuid.UUID("6f1b1f5e-3c1e-4f43-9a53-0f2b6b0f5e11")
_EVENT_NS_BYTES = _EVENT_NS.bytes


#: What an event type name looks like: dotted lower-case words (``job.started``). A type this
#: build does not know but of this form is kept and skipped; anything else is undecodable.
TYPE_PATTERN = r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$"


class EventType(StrEnum):
    """Every event type of the federation; the value is the wire form of ``Envelope.type``.

    A ``StrEnum``: members compare and hash like their strings, so ``env.type == EventType.JOB_STARTED``
    and ``table.get(env.type)`` work on a decoded envelope (whose ``type`` is a plain ``str``), and
    the wire format is unchanged. Each member has one payload model in :data:`PAYLOADS`.
    """

    BUS_DEAD_LETTER = "bus.dead_letter"
    JOB_SUBMITTED = "job.submitted"
    JOB_CANCEL_REQUESTED = "job.cancel_requested"
    SUBMISSION_REJECTED = "submission.rejected"
    JOB_PLACED = "job.placed"
    JOB_STOP = "job.stop"
    JOB_PENDING = "job.pending"
    JOB_STARTED = "job.started"
    JOB_FINISHED = "job.finished"
    JOB_FAILED = "job.failed"
    JOB_REJECTED = "job.rejected"
    JOB_STOPPED = "job.stopped"
    JOB_CANCELLED = "job.cancelled"
    INVENTORY_SNAPSHOT = "inventory.snapshot"
    INVENTORY_HEARTBEAT = "inventory.heartbeat"
    USAGE_RECORDED = "usage.recorded"
    POLICY_APPLIED = "policy.applied"
    TENANT_UPDATED = "tenant.updated"
    QUOTA_UPDATED = "quota.updated"
    PRINCIPAL_UPDATED = "principal.updated"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_APPROVED = "approval.approved"
    APPROVAL_REJECTED = "approval.rejected"
    APPROVAL_EXPIRED = "approval.expired"
    AGENT_RECONCILED = "agent.reconciled"
    JOB_HELD = "job.held"
    JOB_RELEASED = "job.released"
    JOB_PRIORITY_CHANGED = "job.priority_changed"
    SECURITY_REJECTED_MESSAGE = "security.rejected_message"


def known_type(type_: str) -> EventType | None:
    """The :class:`EventType` named ``type_``, or None when this build does not know it (a dict
    lookup: called several times per event by every reader, ``EventType(...)`` was ~5% of
    admission's CPU)."""
    return _BY_NAME.get(type_)


_BY_NAME: dict[str, EventType] = {t.value: t for t in EventType}


def business_event_id(*parts: object) -> str:
    """Deterministic event id (32 hex chars) from a business key, e.g. (job, attempt, 'started'):
    the RFC 4122 version-5 UUID of the parts joined by ``/`` in :data:`_EVENT_NS`
    (``uuid.uuid5(_EVENT_NS, name).hex``), computed without building ``uuid.UUID`` objects
    (issue 15: ~3x faster; one per status, placement and submission)."""
    digest = bytearray(hashlib.sha1(_EVENT_NS_BYTES + "/".join(str(p) for p in parts).encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    return digest.hex()


def random_event_id() -> str:
    """Random event id (32 hex chars) for events without a business key (heartbeats)."""
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- bounds
# Every number an event carries lies in what the column it lands in holds
# (fedsched/schema/migrations: attempt and shard are UInt32, counts UInt32/UInt64, usage.cost
# Decimal(18, 6), seconds and scores Float64) and is finite, so a valid event is always storable
# and computable (tryout: attempt 2^32, cost "NaN"/"1e400", gpu_seconds 1e308 were accepted).

#: ``UInt32`` columns: attempt, shard, counts of nodes/GPUs.
UInt32 = Annotated[int, Field(ge=0, le=2 ** 32 - 1)]
#: ``UInt64`` columns and sequences/tokens (kept within Int64, what JSON readers and
#: ``JSONExtractInt`` take whole): milli-cores, MiB, bytes, stream sequences, fencing tokens.
UInt64 = Annotated[int, Field(ge=0, le=2 ** 63 - 1)]
#: A process exit code (a signed 32-bit ``int`` on every backend: POSIX, Kubernetes, Slurm).
ExitCode = Annotated[int, Field(ge=-(2 ** 31), le=2 ** 31 - 1)]
#: A duration in seconds: finite, >= 0, at most the span of the supported time range
#: (:data:`fedsched.clock.MIN_TIME` .. :data:`fedsched.clock.MAX_TIME`, ~230 years).
Seconds = Annotated[float, Field(ge=0, le=7.3e9, allow_inf_nan=False)]
#: GPU-seconds of one attempt: finite, >= 0, at most every GPU one job may hold (4096 workers x
#: 64 GPUs, :class:`~fedsched.jobs.JobSpec`) over the whole supported time range.
GpuSeconds = Annotated[float, Field(ge=0, le=2e15, allow_inf_nan=False)]
#: A finite float that may be negative (a score: Float64 column).
Finite = Annotated[float, Field(allow_inf_nan=False)]
#: A non-negative finite amount as a float (estimated costs, prices per GPU-hour).
Amount = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]

#: The largest magnitude of a ``Decimal(18, 6)`` column (usage.cost, usage.unit_price), exclusive.
MONEY_LIMIT = Decimal(10) ** 12


def check_money(text: str) -> str:
    """``text`` if it is a money amount the store's ``Decimal(18, 6)`` holds exactly: a finite
    decimal number, >= 0, below 10^12, with at most 6 decimal places (what
    :func:`fedsched.pricing.money` rounds to). Returned unchanged (the wire form is kept).

    Raises:
        ValueError: not such a number (pydantic reports it with the field's name).
    """
    try:
        value = Decimal(text)
    except (InvalidOperation, ValueError, TypeError):
        raise ValueError(f"{text[:40]!r} is not a decimal number") from None
    if not value.is_finite():
        raise ValueError(f"{text[:40]!r} is not a finite amount")
    if value < 0 or value >= MONEY_LIMIT:
        raise ValueError(f"{text[:40]!r} is outside [0, 10^12) (Decimal(18, 6))")
    if value.as_tuple().exponent < -6:
        raise ValueError(f"{text[:40]!r} has more than 6 decimal places (Decimal(18, 6))")
    return text


def _check_optional_money(text: str) -> str:
    return text if text == "" else check_money(text)


#: A money amount as a decimal string (see :func:`check_money`).
MoneyText = Annotated[str, Field(max_length=40), AfterValidator(check_money)]
#: A money amount, or "" for unknown.
OptionalMoneyText = Annotated[str, Field(max_length=40), AfterValidator(_check_optional_money)]


class Envelope(BaseModel):
    """One bus event.

    Attributes:
        event_id: 32 hex characters; deterministic for business events.
        type: event type: an :class:`EventType` value, or (from a newer producer) an unknown name
            of the form :data:`TYPE_PATTERN` (see :attr:`known_type`).
        schema_version: envelope/payload major version (:data:`SCHEMA_VERSION`).
        occurred_at: business time of the event (UTC; the replay's compressed clock in replays).
        producer: the emitting service instance, e.g. ``scheduler`` or ``agent/cn-north-1-c1``.
        actor: who caused it (a principal name, or the service itself).
        region, zone, cluster, tenant, project, job_id: routing names ("" when not applicable).
        attempt: job attempt number (0 before the first placement; a UInt32 column: at most 2^32-1).
        policy_version: version of the policy/rules in force when it was decided ("" if none).
        payload: the type's payload as a dict (see :meth:`payload_as`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    type: str = Field(min_length=1, max_length=64, pattern=TYPE_PATTERN)
    schema_version: int = Field(default=SCHEMA_VERSION, ge=0, le=2 ** 16 - 1)
    occurred_at: UtcDatetime
    producer: str = Field(min_length=1, max_length=128)
    actor: str = Field(default="", max_length=128)
    region: str = ""
    zone: str = ""
    cluster: str = ""
    tenant: str = ""
    project: str = ""
    job_id: str = ""
    attempt: UInt32 = 0
    policy_version: str = Field(default="", max_length=64)
    payload: dict[str, Any] = Field(default_factory=dict)

    @property
    def known_type(self) -> EventType | None:
        """This event's :class:`EventType`, or None for a type this build does not know."""
        return known_type(self.type)

    def payload_as(self, model: type["PayloadT"]) -> "PayloadT":
        """Parse the payload as ``model``.

        The parsed model is kept with the envelope (both are immutable): every reader of one
        decoded envelope in a process -- audit and billing in the store; every service when
        embedded, through the bus's shared decode -- validates a payload once, not once each
        (issue 15: payload validation was ~10-25% of a service's CPU). A copy of the envelope
        with another payload (``model_copy(update=...)``) parses its own.

        Raises:
            DecodeError: the payload does not validate (not kept: raised again on every call).
        """
        payload = self.payload
        cache = self.__dict__.get("_payload_cache")
        if cache is not None and cache[0] is payload:
            hit = cache[1].get(model)
            if hit is not None:
                return hit
        try:
            parsed = model.model_validate(payload)
        except PydanticValidationError as e:
            raise DecodeError(f"{self.type} payload invalid: {_first_error(e)}") from e
        except ValidationError as e:  # a name rule broken inside the payload
            raise DecodeError(f"{self.type} payload invalid: {e.message}") from e
        if cache is None or cache[0] is not payload:
            cache = (payload, {})
            # outside the model's fields (so not compared, dumped or validated): frozen models
            # forbid setting fields, not other attributes of the instance
            object.__setattr__(self, "_payload_cache", cache)
        cache[1][model] = parsed
        return parsed

    def to_bytes(self) -> bytes:
        """Wire form (compact JSON)."""
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Envelope":
        """Parse and validate a wire message.

        An unknown but well-formed type decodes (see the module docstring); the consumer decides.

        Parsing (issue 15): the bytes are parsed with orjson and the resulting object validated
        (``model_validate``), ~40% less CPU than pydantic's own JSON parser
        (``model_validate_json``) on a ``job.placed`` (~2 KB: 19 vs 31 us); every field is
        validated by the same rules. Only standard JSON (RFC 8259, as orjson reads it) is taken:
        ``NaN``, ``Infinity``, a lone surrogate escape and an integer literal beyond 64 bits
        (below -2**63 or above 2**64-1; orjson would read it as a rounded float) are refused,
        never stored as ``null`` or rounded downstream. Bytes orjson refuses are also given to
        ``model_validate_json`` only to tell the reason: its own when it refuses them too.

        Raises:
            DecodeError: not JSON, not standard JSON (reason ``not standard JSON: ...``), not an
                envelope (including a malformed type name), or a newer major schema.
        """
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            try:
                cls.model_validate_json(data)
            except PydanticValidationError as pe:
                raise DecodeError(f"not a valid envelope: {_first_error(pe)}") from pe
            raise DecodeError(f"not standard JSON: {e}") from e
        big = _integer_beyond_64_bits(data)
        if big is not None:
            raise DecodeError(f"not standard JSON: the integer {big[:40]} is beyond 64 bits")
        try:
            env = cls.model_validate(raw)
        except PydanticValidationError as e:
            raise DecodeError(f"not a valid envelope: {_first_error(e)}") from e
        if env.schema_version > SCHEMA_VERSION:
            raise DecodeError(f"schema_version {env.schema_version} is newer than this reader ({SCHEMA_VERSION})")
        return env


#: bytes -> digits as ``0``, anything else as a space: a run of 19 digits (what every integer
#: literal beyond 64 bits holds; 2**63 has 19) is then found by a substring search (a regex
#: ``[0-9]{19}`` takes ~20 us on 2 KB, more than the parse)
_DIGITS_AS_ZERO = bytes(ord("0") if chr(b).isdigit() and b < 128 else ord(" ") for b in range(256))
_LONG_DIGITS = b"0" * 19
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 64 - 1  # what orjson reads as an integer


class _BeyondInt64(Exception):
    pass


def _integer_beyond_64_bits(data: bytes | bytearray | memoryview | str) -> str | None:
    """The first integer literal of the JSON ``data`` outside [-2**63, 2**64-1], else None.

    ``data`` is scanned for a run of 19 digits first (~1 us on 2 KB); only when there is one
    (a long number, or digits inside a string) is it parsed again by :mod:`json` to look at its
    integer literals."""
    buf = data.encode() if isinstance(data, str) else bytes(data)
    if _LONG_DIGITS not in buf.translate(_DIGITS_AS_ZERO):
        return None

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # beyond the interpreter's limit on digits
            raise _BeyondInt64(text) from None
        if not _INT_MIN <= value <= _INT_MAX:
            raise _BeyondInt64(text)
        return value

    try:
        json.loads(buf, parse_int=check)
    except _BeyondInt64 as e:
        return str(e.args[0])
    except ValueError:  # orjson read it: cannot happen; nothing more to say
        return None
    return None


def _first_error(e: PydanticValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return f"{loc}: {err.get('msg', 'invalid')}"


# --------------------------------------------------------------------------- payloads


class _Payload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class JobSubmitted(_Payload):
    """``job.submitted``: admission accepted a job (routing names in the envelope)."""

    spec: JobSpec
    request_id: str = ""
    submitted_by: str = ""


class JobCancelRequested(_Payload):
    """``job.cancel_requested``: a caller asked to cancel."""

    reason: str = ""


class JobHeld(_Payload):
    """``job.held`` / ``job.released``: a caller (envelope ``actor``) held a queued job -- the
    scheduler does not consider it until it is released -- or released it (it waits again with
    its original submit time, so aging counts the time held). A hold that reaches the scheduler
    after the job was placed has no effect (admission's job view and the scheduler both ignore
    it in stream order).

    Attributes:
        reason: why (at most 500 characters, audited).
    """

    reason: str = Field(default="", max_length=500)


class JobPriorityChanged(_Payload):
    """``job.priority_changed``: a caller (envelope ``actor``) changed the priority class of a
    job not yet placed (queued or held); the scheduler orders its queue by the new class from
    its next cycle. Ignored by the scheduler and the job view when it arrives after a placement.

    Attributes:
        previous / priority: the class before and after (:class:`~fedsched.jobs.PriorityClass` values).
        reason: why (at most 500 characters, audited).
    """

    previous: PriorityClass
    priority: PriorityClass
    reason: str = Field(default="", max_length=500)


class SubmissionRejected(_Payload):
    """``submission.rejected``: admission refused a request (the audit trail of refusals)."""

    code: str
    field: str = ""
    message: str = ""
    request_id: str = ""


class WorkerBinding(_Payload):
    """Where one worker of a placement runs.

    Attributes:
        worker: worker index (0..workers-1).
        node: node name in the cluster.
        gpu_indices: the node's GPU devices it uses.
        gpu_milli: milli-GPUs it takes on each of those devices.
    """

    worker: UInt32
    node: str
    gpu_indices: tuple[UInt32, ...] = ()
    gpu_milli: UInt32 = 0
    cpu_milli: UInt64 = 0
    memory_mib: UInt64 = 0


class JobPlaced(_Payload):
    """``job.placed``: the scheduler bound a job attempt to a cluster (subject: its agent's).

    Attributes:
        spec: the job (the agent needs resources and annotations).
        card_model: canonical card model of the chosen nodes ("" for CPU-only).
        bindings: one per worker.
        score: total score of the chosen cluster (higher is better).
        explanation: one line: why here.
        cross_region: placed outside the job's home region.
        transfer_s: estimated data transfer time before start (s).
        shard: shard index for split batch jobs (0 otherwise).
        evaluations: every cluster considered: verdict, reason, score terms (explanations).
        resume_from_s: work already done by earlier attempts and checkpointed (s); the agent
            runs only the rest.
        queue: the scheduler queue it came from (fast, inference, training, batch).
        est_cost: the scheduler's cost estimate (compute over the estimated runtime + egress).
        counterfactual: what would have changed the decision, where one exists.
        fencing_token: the scheduler lease's fencing token of the replica that placed it
            (:mod:`fedsched.lease`; 0 = an event from before leases). Receivers refuse a token
            lower than the highest they have seen.
    """

    spec: JobSpec
    card_model: str = ""
    bindings: tuple[WorkerBinding, ...]
    score: Finite = 0.0
    explanation: str = ""
    cross_region: bool = False
    transfer_s: Seconds = 0.0
    transfer_bytes: UInt64 = 0
    price_per_gpu_hour: Amount = 0.0
    shard: UInt32 = 0
    evaluations: tuple[dict[str, Any], ...] = ()
    resume_from_s: Seconds = 0.0
    queue: str = ""
    est_cost: Amount = 0.0
    counterfactual: str = ""
    fencing_token: UInt64 = 0


class JobStop(_Payload):
    """``job.stop``: scheduler tells an agent to stop a job attempt.

    Attributes:
        reason: cancelled, preempted (for a higher-priority job, ``for_job``), reclaimed
            (placed but never started in time) or cluster_lost (its cluster went silent for
            longer than the freshness limit; the scheduler also ends the attempt with a
            ``job.stopped`` of the same reason).
        detail: the circumstances in words (e.g. ``not started within 30 s``); "" if none.
        checkpoint_interval_s: for checkpointable work, how often it checkpoints (s): the agent
            reports the checkpointed progress so the next attempt resumes from it.
        fencing_token: as in :class:`JobPlaced`.
    """

    reason: Literal["cancelled", "preempted", "reclaimed", "cluster_lost"]
    shard: UInt32 = 0
    for_job: str = ""
    checkpoint_interval_s: Seconds = 0.0
    detail: str = ""
    fencing_token: UInt64 = 0


class JobPending(_Payload):
    """``job.pending``: the scheduler could not place the job this cycle.

    Attributes:
        reason: the summary (the most common per-cluster reason).
        reasons: cluster -> reason (the filter that excluded it).
        fits_empty: whether some cluster could hold it if it were empty; False means the job
            is unplaceable on today's federation (it stays queued in case capacity joins).
    """

    reason: str
    reasons: dict[str, str] = Field(default_factory=dict)
    fits_empty: bool = True
    evaluations: tuple[dict[str, Any], ...] = ()
    shard: UInt32 = 0
    queue: str = ""
    reserved_cluster: str = ""
    reserved_from: UtcDatetime | None = None
    counterfactual: str = ""


class JobStatus(_Payload):
    """``job.started`` / ``job.finished`` / ``job.failed`` / ``job.rejected`` / ``job.stopped`` (from
    agents) and ``job.cancelled`` (from the scheduler, for a job cancelled before it was placed).

    Attributes:
        card_model: canonical card model it ran on.
        gpu_milli: milli-GPUs the attempt holds (all workers).
        cpu_milli, memory_mib: CPU and memory held (all workers).
        started_at: business time it started (set on every status after start).
        reason: why it failed / was rejected / stopped.
        exit_code: process exit code where the backend knows one.
        shard: shard index for split batch jobs.
        data_version: version of the inputs this attempt read (for failure forensics).
        kind: the job's kind (for usage reports).
        cross_region: the attempt runs outside the job's home region.
        progress_s: work done and checkpointed when it stopped (s); the next attempt resumes here.
    """

    card_model: str = ""
    gpu_milli: UInt32 = 0
    cpu_milli: UInt64 = 0
    memory_mib: UInt64 = 0
    started_at: UtcDatetime | None = None
    reason: str = ""
    exit_code: ExitCode | None = None
    shard: UInt32 = 0
    data_version: str = ""
    kind: str = ""
    cross_region: bool = False
    progress_s: Seconds = 0.0


class NodeInventory(_Payload):
    """One node as an agent reports it (units: milli-GPU, milli-core, MiB, GiB)."""

    name: str
    card_model: str = ""
    gpus: UInt32 = 0
    gpu_memory_gib: UInt32 | None = None
    gpu_free_milli: tuple[UInt32, ...] = ()
    cpu_milli: UInt64 = 0
    cpu_free_milli: UInt64 = 0
    memory_mib: UInt64 = 0
    memory_free_mib: UInt64 = 0
    healthy: bool = True
    rdma: bool = False
    #: cordoned / drained: runs what it runs, takes no new work
    unschedulable: bool = False
    #: taints as ``key=value:Effect`` (Kubernetes form; Slurm features/reasons mapped onto it)
    taints: tuple[str, ...] = ()
    #: the node's zone as its cluster labels it (Kubernetes ``topology.kubernetes.io/zone``); "" = the cluster's
    zone: str = ""


class InventorySnapshot(_Payload):
    """``inventory.snapshot``: a cluster's full inventory.

    Attributes:
        nodes: every node.
        running_jobs: how many job attempts (shards) run there.
        running: ids of job attempts running there (``job_id/attempt/shard``) as older agents
            listed them; agents leave it empty now (issue 15: the list grew with the running
            jobs -- 17,000 ids per snapshot per cluster at 100,000 running, decoded by every
            reader every 10 s, and its digits sent each reader down the slow check for integers
            beyond 64 bits -- while readers only counted it; the job events say what runs where).
        storage_tier, interconnect: cluster properties.
        residency_tags: compliance tags the cluster satisfies.
        maintenance: drained for maintenance (no new placements).
        sequence: increases with every snapshot from this agent.
        backend: how the agent runs work there (``trace``, ``kubernetes``, ``slurm``; "" from
            older agents).
    """

    nodes: tuple[NodeInventory, ...]
    running_jobs: UInt32 = 0
    running: tuple[str, ...] = ()
    storage_tier: str = "standard"
    interconnect: str = "ethernet"
    residency_tags: tuple[str, ...] = ()
    maintenance: bool = False
    sequence: UInt64 = 0
    backend: str = ""


class Heartbeat(_Payload):
    """``inventory.heartbeat``: the agent is alive; totals for dashboards.

    Attributes:
        orders_backlog: placements and stop orders on the cluster's subject the agent had not
            yet handled when it sent the heartbeat (its durable consumer's pending count, from
            the newest delivery's metadata; 0 = read up to the heartbeat). The scheduler does
            not reclaim a placement "never started" from an agent that is alive but still
            behind on reading its orders (:meth:`services.scheduler.service.SchedulerService._reclaim`).
            Older agents send none (0): reclaim by time alone.
    """

    sequence: UInt64 = 0
    gpus_total: UInt32 = 0
    gpu_milli_free: UInt64 = 0
    running_jobs: UInt32 = 0
    orders_backlog: UInt64 = 0


class UsageRecorded(_Payload):
    """``usage.recorded``: billing priced one attempt interval.

    Attributes:
        gpu_seconds: GPU-seconds of the interval (finite, >= 0; see :data:`GpuSeconds`).
        cost: its price, a decimal string the store's ``Decimal(18, 6)`` holds (finite, >= 0,
            below 10^12, at most 6 places; :func:`check_money`).
        currency: ISO 4217 code.
    """

    gpu_seconds: GpuSeconds
    cost: MoneyText
    currency: str = Field(default="CNY", max_length=8)


class AgentReconciled(_Payload):
    """What a region agent did to one attempt when it reconciled its cluster with its ledger on
    start (``services/inventory/agent.py`` ``ClusterAgent.reconcile``); published on the
    cluster's status subject with the attempt's routing names.

    Attributes:
        reason: ``adopted`` (running on the cluster and live in the ledger: kept), ``relaunched``
            (live in the ledger, gone from a backend that does not outlive the agent: started
            again), ``lost`` (live in the ledger, gone from a durable backend: reported failed),
            ``orphaned`` (on the cluster, no live attempt owns it: stopped) or ``superseded``
            (an attempt older than the job's newest: stopped).
        shard: the attempt's shard.
        detail: the circumstances in words ("" if none).
    """

    reason: Literal["adopted", "relaunched", "lost", "orphaned", "superseded"]
    shard: UInt32 = 0
    detail: str = ""


class DeadLetter(_Payload):
    """``bus.dead_letter``: a message a consumer could not decode or handle.

    Attributes:
        consumer: the durable consumer (or follower) that gave up on it.
        subject: the original subject.
        stream_sequence: its sequence in the original stream (0 if unknown).
        deliveries: how often it had been delivered.
        reason: why it was dead-lettered.
        data: the original body, UTF-8 with replacement, at most 64 KiB.
        headers: the original headers.
    """

    consumer: str
    subject: str
    stream_sequence: UInt64 = 0
    deliveries: UInt64 = 0
    reason: str
    data: str = ""
    headers: dict[str, str] = Field(default_factory=dict)


class SecurityRejected(_Payload):
    """``security.rejected_message``: a consumer refused a message whose envelope does not match
    the subject it arrived on, or the federation's own placement records (issue 14: agents
    speak only for themselves; :mod:`fedsched.trust`). Published on the refusing consumer's
    dead-letter subject beside the ``bus.dead_letter`` of the same message.

    Attributes:
        consumer: the consumer (or follower) that refused it.
        subject: the subject it arrived on.
        sender: who the subject says sent it (``agent/<region>/<cluster>`` for an agent's
            subject; NATS permissions let only that agent publish there), "" if the subject
            names no sender.
        claimed_producer, claimed_region, claimed_cluster: what the envelope claims.
        event_type, event_id, job_id, attempt: the refused event's identity as claimed.
        stream_sequence: its sequence in its stream (0 if unknown).
        reason: why it was refused, in words.
    """

    consumer: str
    subject: str
    sender: str = ""
    claimed_producer: str = ""
    claimed_region: str = ""
    claimed_cluster: str = ""
    event_type: str = ""
    event_id: str = ""
    job_id: str = ""
    attempt: UInt32 = 0
    stream_sequence: UInt64 = 0
    reason: str


class PolicyApplied(_Payload):
    """``policy.applied``: a governance policy version came into force (envelope
    ``policy_version`` = the new version, ``actor`` = who applied it).

    Attributes:
        version: the new version.
        previous_version: the version it replaced ("" at bootstrap).
        changes: what changed, one line each (token hashes never shown).
        source: ``bootstrap``, ``apply`` or the RPC that made it.
    """

    version: str
    previous_version: str = ""
    changes: tuple[str, ...] = ()
    source: str = ""


class GovernanceChanged(_Payload):
    """``tenant.updated`` / ``quota.updated`` / ``principal.updated``: an admin changed one entry
    of the policy (envelope: ``actor``, ``policy_version`` = the version it created).

    Attributes:
        kind: ``tenant``, ``quota`` or ``principal``.
        key: its identity (tenant name, ``tenant/card/region``, principal name).
        old / new: the entry before and after (None = absent); never a token or its hash.
        previous_version: the policy version before the change.
        token_issued: a new token was issued to the principal.
    """

    kind: Literal["tenant", "quota", "principal"]
    key: str
    old: dict[str, Any] | None = None
    new: dict[str, Any] | None = None
    previous_version: str = ""
    token_issued: bool = False


class ApprovalRequested(_Payload):
    """``approval.requested``: the scheduler's best placement is outside the job's home region
    and its mode is ``approval``; the job waits for an approver (envelope: ``actor`` =
    scheduler, ``policy_version`` = the governance version in force, region/cluster = the
    proposal).

    Attributes:
        approval_id: ``ap-`` + 20 hex.
        home_region: the job's home region.
        proposed_region, proposed_cluster, card_model: the proposed placement.
        reason: why (home region state, estimated wait, where it could run now, transfer).
        estimated_wait_s: estimated wait at home (None = unknown).
        transfer_s: data transfer before start if placed as proposed (s).
        cost / currency: estimated cost of the proposed run (GPU-hours x price + egress), and
            ``home_cost`` of the same run at home list prices ("" = unknown).
        expires_at: business time after which the job falls back to its home queue.
        evaluations: every cluster the scheduler considered for the proposal (as in
            :class:`JobPlaced`: verdict, reason, score terms), so ``explain`` shows why it was
            proposed; () from schedulers older than this field.
        queue: the queue the proposal was made in ("" from older schedulers).
    """

    approval_id: str
    home_region: str
    proposed_region: str
    proposed_cluster: str
    card_model: str = ""
    reason: str = ""
    estimated_wait_s: Seconds | None = None
    transfer_s: Seconds = 0.0
    cost: OptionalMoneyText = ""
    home_cost: OptionalMoneyText = ""
    currency: str = "CNY"
    expires_at: UtcDatetime
    evaluations: tuple[dict[str, Any], ...] = ()
    queue: str = ""


class ApprovalDecided(_Payload):
    """``approval.approved`` / ``approval.rejected`` (actor = the approver) and
    ``approval.expired`` (actor = scheduler). At most one per approval: all three share one
    event id, so the first one published wins.

    Attributes:
        approval_id: which request.
        comment: the approver's note, or why it expired.
        proposed_region: the region the request was for.
    """

    approval_id: str
    comment: str = ""
    proposed_region: str = ""


#: The payload model of every event type (the registry :func:`make_event` checks against).
PAYLOADS: dict[EventType, type[_Payload]] = {
    EventType.BUS_DEAD_LETTER: DeadLetter,
    EventType.JOB_SUBMITTED: JobSubmitted,
    EventType.JOB_CANCEL_REQUESTED: JobCancelRequested,
    EventType.SUBMISSION_REJECTED: SubmissionRejected,
    EventType.JOB_PLACED: JobPlaced,
    EventType.JOB_STOP: JobStop,
    EventType.JOB_PENDING: JobPending,
    EventType.JOB_STARTED: JobStatus,
    EventType.JOB_FINISHED: JobStatus,
    EventType.JOB_FAILED: JobStatus,
    EventType.JOB_REJECTED: JobStatus,
    EventType.JOB_STOPPED: JobStatus,
    EventType.JOB_CANCELLED: JobStatus,
    EventType.INVENTORY_SNAPSHOT: InventorySnapshot,
    EventType.INVENTORY_HEARTBEAT: Heartbeat,
    EventType.USAGE_RECORDED: UsageRecorded,
    EventType.POLICY_APPLIED: PolicyApplied,
    EventType.TENANT_UPDATED: GovernanceChanged,
    EventType.QUOTA_UPDATED: GovernanceChanged,
    EventType.PRINCIPAL_UPDATED: GovernanceChanged,
    EventType.APPROVAL_REQUESTED: ApprovalRequested,
    EventType.APPROVAL_APPROVED: ApprovalDecided,
    EventType.APPROVAL_REJECTED: ApprovalDecided,
    EventType.APPROVAL_EXPIRED: ApprovalDecided,
    EventType.AGENT_RECONCILED: AgentReconciled,
    EventType.JOB_HELD: JobHeld,
    EventType.JOB_RELEASED: JobHeld,
    EventType.JOB_PRIORITY_CHANGED: JobPriorityChanged,
    EventType.SECURITY_REJECTED_MESSAGE: SecurityRejected,
}

#: Job status events (payload :class:`JobStatus`): ``job.started`` and the terminal statuses.
#: A terminal status ends a job attempt (finished, failed, rejected by the agent, stopped) or, for
#: ``job.cancelled``, a job cancelled before it was placed. Every consumer that follows attempts
#: (job view, agent, billing, scheduler, replay) must handle or knowingly ignore each of them;
#: ``tests/unit/fedsched/test_event_dispatch.py`` checks their tables.
TERMINAL_STATUSES: frozenset[EventType] = frozenset({
    EventType.JOB_FINISHED, EventType.JOB_FAILED, EventType.JOB_REJECTED, EventType.JOB_STOPPED,
    EventType.JOB_CANCELLED,
})
JOB_STATUSES: frozenset[EventType] = frozenset({EventType.JOB_STARTED, *TERMINAL_STATUSES})

#: Approval outcomes (one per approval; see :class:`ApprovalDecided`).
APPROVAL_OUTCOMES = (EventType.APPROVAL_APPROVED, EventType.APPROVAL_REJECTED, EventType.APPROVAL_EXPIRED)


def approval_outcome_id(approval_id: str) -> str:
    """The one event id every outcome of ``approval_id`` uses, so JetStream keeps only the first
    (an approval racing its timeout, or two approvers, can never both win)."""
    return business_event_id(approval_id, "outcome")

def payload_error(env: Envelope) -> str | None:
    """Why ``env``'s payload does not validate against its type's model in :data:`PAYLOADS`, or
    None when it does -- or when this build does not know the type (kept as said; see the module
    docstring). The one rule for every type: what :meth:`Envelope.payload_as` with the registry's
    model would raise (e.g. ``"usage.recorded payload invalid: gpu_seconds: Field required"``
    for a ``{}`` payload), so a reader that checks every event up front (audit) refuses exactly
    what a reader of that one type (admission, billing) dead-letters when it parses it."""
    event_type = env.known_type
    if event_type is None:
        return None
    try:
        env.payload_as(PAYLOADS[event_type])
    except DecodeError as e:
        return e.reason
    return None


PayloadT = Any  # typing alias for payload_as (a _Payload subclass)


def make_event(
    type: EventType | str,
    payload: _Payload,
    *,
    producer: str,
    occurred_at: float,
    event_id: str | None = None,
    **routing: Any,
) -> Envelope:
    """Build an envelope around ``payload``.

    Args:
        type: event type (an :class:`EventType`, or its string value).
        payload: the payload model: an instance of ``PAYLOADS[type]``.
        producer: emitting service instance.
        occurred_at: business time, seconds since the Unix epoch.
        event_id: deterministic id; random when None.
        **routing: envelope fields (region, cluster, tenant, project, job_id, attempt, actor,
            policy_version, zone).

    Raises:
        EventTypeError: unknown event type, or a payload that is not the type's model (both
            programming errors in the producer).
    """
    event_type = known_type(type)
    if event_type is None:
        raise EventTypeError(str(type), "unknown event type")
    expected = PAYLOADS[event_type]
    if not isinstance(payload, expected):
        raise EventTypeError(event_type.value, f"payload must be {expected.__name__}, not "
                                               f"{payload.__class__.__name__}", expected=expected.__name__,
                             got=payload.__class__.__name__)
    env = Envelope(
        event_id=event_id or random_event_id(),
        type=event_type.value,
        occurred_at=to_datetime(occurred_at),
        producer=producer,
        payload=payload.model_dump(mode="json"),
        **routing,
    )
    # the payload model it was built from is what payload_as(expected) would parse from that
    # dict (a validated model dumped and read back is equal to itself): a reader in this process
    # (the scheduler reading back its placements, admission its submissions; every service when
    # embedded) takes it without validating the payload again
    object.__setattr__(env, "_payload_cache", (env.payload, {expected: payload}))
    return env


# --------------------------------------------------------------------------- subjects


class Subjects:
    """Subject names for one federation (``prefix`` is its first token).

    Layout (``<p>`` = prefix)::

        <p>.jobs.<verb>.<tenant>.<project>     admission -> scheduler (submitted, cancel, hold,
                                               release, priority)
        <p>.admission.rejected                 refused submissions (audit)
        <p>.placements.<region>.<cluster>      scheduler -> one agent (placed, stop)
        <p>.decisions.<tenant>.<project>       scheduler's pending reasons
        <p>.status.<region>.<cluster>          agent -> everyone (started, finished, ...)
        <p>.inventory.<region>.<cluster>       agent snapshots
        <p>.heartbeat.<region>.<cluster>       agent heartbeats
        <p>.billing.usage.<tenant>             billing -> budgets
        <p>.governance.policy                  policy versions, principals (admission)
        <p>.governance.tenant.<tenant>         tenant and quota changes (admission)
        <p>.governance.approval.<t>.<p>        approval requests (scheduler), decisions
        <p>.deadletter.<consumer>              undecodable messages with the reason
        <p>.logs.<region>.<cluster>            admission -> one agent: log requests (request/reply)

    Args:
        prefix: first token, validated by :class:`~fedsched.settings.Settings`.
    """

    def __init__(self, prefix: str = "fed") -> None:
        self.prefix = prefix

    def _s(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    def job(self, verb: Literal["submitted", "cancel", "hold", "release", "priority"], tenant: str,
            project: str) -> str:
        """Subject of a job request from admission."""
        return self._s("jobs", verb, naming.check_name("tenant", tenant), naming.check_name("project", project))

    def admission_rejected(self) -> str:
        """Subject of refused submissions."""
        return self._s("admission", "rejected")

    def placements(self, region: str, cluster: str) -> str:
        """Subject of one cluster's placements and stop orders."""
        return self._s("placements", naming.check_name("region", region), naming.check_name("cluster", cluster))

    def decisions(self, tenant: str, project: str) -> str:
        """Subject of scheduler decisions about a tenant's jobs."""
        return self._s("decisions", naming.check_name("tenant", tenant), naming.check_name("project", project))

    def status(self, region: str, cluster: str) -> str:
        """Subject of job status from one cluster's agent."""
        return self._s("status", naming.check_name("region", region), naming.check_name("cluster", cluster))

    def logs(self, region: str, cluster: str) -> str:
        """Log requests for one cluster's agent (request/reply, no stream; :mod:`fedsched.logs`)."""
        return self._s("logs", region, cluster)

    def inventory(self, region: str, cluster: str) -> str:
        """Subject of one cluster's inventory snapshots."""
        return self._s("inventory", naming.check_name("region", region), naming.check_name("cluster", cluster))

    def heartbeat(self, region: str, cluster: str) -> str:
        """Subject of one cluster's heartbeats."""
        return self._s("heartbeat", naming.check_name("region", region), naming.check_name("cluster", cluster))

    def usage(self, tenant: str) -> str:
        """Subject of billing's priced usage for a tenant."""
        return self._s("billing", "usage", naming.check_name("tenant", tenant))

    def governance_policy(self) -> str:
        """Subject of policy versions and principal changes."""
        return self._s("governance", "policy")

    def governance_tenant(self, tenant: str) -> str:
        """Subject of a tenant's settings and quota changes."""
        return self._s("governance", "tenant", naming.check_name("tenant", tenant))

    def approval(self, tenant: str, project: str) -> str:
        """Subject of cross-region approval requests and decisions for a tenant's project."""
        return self._s("governance", "approval", naming.check_name("tenant", tenant),
                       naming.check_name("project", project))

    def deadletter(self, consumer: str) -> str:
        """Subject where ``consumer`` puts messages it cannot decode."""
        return self._s("deadletter", consumer.replace(".", "_"))

    def all(self, *tokens: str) -> str:
        """Wildcard subject ``<p>.<tokens>.>`` (or ``<p>.>`` with no tokens)."""
        return self._s(*tokens, ">")
