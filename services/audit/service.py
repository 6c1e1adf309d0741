"""The audit service: every bus event into the append-only ``events`` table.

Three durable consumers (one per stream: events, inventory, dead letters) hand batches to
:meth:`AuditService.write`, which inserts the batch and its projections --
``decisions`` (placements and pending reasons) and ``inventory`` (capacity per cluster x card
model) -- and returns only once ClickHouse committed them; the consumer acknowledges after that.
Rows are keyed on the event id (``events``: with the subject, so an agent cannot pre-empt another
cluster's event by reusing its id on its own subject) and inserted with
:meth:`~fedsched.store.Store.insert_new`, so a redelivered or replayed event never becomes a
second row. When ClickHouse is unavailable the
consumer backs off and the backlog stays in JetStream.

Events of a type this build does not know (a newer producer) are stored like any other: the
log keeps what was said even when no reader here understands it yet. An event of a known type
whose payload does not validate against its model (:func:`~fedsched.events.payload_error`, one
rule for every type) is not stored as that event: it is dead-lettered with the reason on
``<p>.deadletter.audit-<stream>`` (stored from there as a ``bus.dead_letter`` of audit), as
admission and billing dead-letter it -- a ``usage.recorded`` with an empty payload never
becomes a usage row on its job (:meth:`AuditService.drop_malformed`). What an agent says for
another cluster, and anything on a dead-letter subject, is recorded as what it is, attributed to
the subject's sender (:func:`screened`).

Audit applies the consumers' trust checks itself (:mod:`fedsched.trust`), from what it has: the
subject against the envelope and the agent event types (:func:`screened`), and an agent's
status against the placements in the log (:meth:`AuditService.screen_statuses`). A message
they refuse is stored only as a ``security.rejected_message`` naming the claimed type, job and
attempt in its payload -- never as the event it claims to be, so nothing that counts a job's
events (``fedsched report``, the console's job page, ad-hoc SQL on ``events``) sees it. Audit
needs no word from the other consumers, so the order in which it reads their refusals, and
restarts, do not matter; their security records of a message are keyed like audit's own
(:func:`security_record`), so one forged message is one ``security.rejected_message`` row however
many consumers refuse it (their ``bus.dead_letter`` rows stay one per consumer). A scheduler
order with a stale fencing token (a former active scheduler's, refused by everyone:
:meth:`AuditService.fence_orders`) is stored only as a ``bus.dead_letter`` of ``audit`` holding
it, so no job shows a placement nobody carried out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import replace
from datetime import UTC, datetime
from operator import attrgetter
from typing import Awaitable, Callable

import nats.errors
import orjson

from fedsched import telemetry
from fedsched.bounded import RecentDict
from fedsched.bus import Bus, Delivery, DurableConsumer
from fedsched.clock import as_utc
from fedsched.dispatch import EventTable
from fedsched.errors import DecodeError, UnavailableError, ValidationError
from fedsched.gctune import YOUNG_THRESHOLD, tune_for_service
from fedsched.events import (PAYLOADS, DeadLetter, Envelope, EventType, InventorySnapshot, JobPending, JobPlaced,
                             JobStatus, JobStop, SecurityRejected, business_event_id, make_event, payload_error)
from fedsched.lease import StreamFencing, Tenure, read_tenure
from fedsched.trust import REFUSING_CONSUMERS, agent_subject, check_subject, security_event_id, sender_of
from fedsched.metrics import WriterMetrics
from fedsched.store import AsyncStore

log = logging.getLogger(__name__)

EVENT_COLUMNS = ("event_id", "type", "schema_version", "occurred_at", "producer", "actor", "region", "zone", "cluster",
                 "tenant", "project", "job_id", "attempt", "policy_version", "trace_id", "subject", "payload")
DECISION_COLUMNS = ("event_id", "decided_at", "job_id", "attempt", "tenant", "project", "outcome", "region", "cluster",
                    "reason", "fits_empty", "cross_region", "score", "policy_version", "detail")
INVENTORY_COLUMNS = ("event_id", "at", "region", "zone", "cluster", "card_model", "nodes", "healthy_nodes", "gpus",
                     "gpu_milli_free", "whole_gpus_free", "cpu_milli_free", "memory_mib_free")


def _naive_utc(dt: datetime) -> datetime:
    """The instant ``dt`` as aware UTC (an offset is converted, never dropped; see
    :func:`~fedsched.clock.as_utc`), as the ``DateTime64(3, 'UTC')`` columns take it."""
    return as_utc(dt)


def to_json(value: object) -> str:
    """``value`` as compact JSON text (orjson: ~10x ``json.dumps``, issue 15).

    The payload dicts are what the envelope's JSON decoded to, so they are JSON values; anything
    else (a datetime or Decimal in a stand-in built here) is written as ``str(value)``, as
    ``json.dumps(..., default=str)`` wrote it. Non-ASCII text is written as UTF-8, not as ``\\u``
    escapes (the same JSON value: ``JSONExtract*`` reads both). What orjson cannot write (an
    integer beyond 64 bits, a lone surrogate) is written by ``json.dumps`` as before.

    Raises:
        ValueError: ``value`` holds a float NaN or infinity (only a value built in this process
            can: the wire refuses them, see :meth:`~fedsched.events.Envelope.from_bytes`). It
            has no standard JSON form; orjson would write ``null``, silently changing the record.
    """
    return _to_json(value, None)


def _to_json(value: object, wire: bytes | None) -> str:
    """:func:`to_json`; ``wire``: the bytes of the message ``value`` was decoded from (None: none).

    orjson writes a NaN or infinity as ``null``, so JSON with a ``null`` is looked through for
    non-finite floats (:func:`_non_finite`) -- unless it is, character for character, part of
    ``wire``: then the text is what the message itself says, and the message was standard JSON
    (the bus refuses NaN and infinity on the wire). A payload object's text cannot occur inside
    a JSON string of the message (its quotes would be escaped there), so the text found is the
    message's payload. That spares the look on nearly every event (a ``null`` is in most
    payloads: ~4 us of the ~6 us of an event's row, issue 15).
    """
    try:
        out = orjson.dumps(value, default=str, option=_ORJSON_OPTIONS)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value, separators=(",", ":"), default=str, allow_nan=False)
    if b"null" in out and (wire is None or out not in wire) and _non_finite(value):
        raise ValueError("not standard JSON: a float NaN or infinity cannot be stored exactly")
    return out.decode()


def _non_finite(value: object) -> bool:
    """Whether ``value`` (JSON-like: dicts, lists, tuples) holds a float NaN or infinity."""
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        v = pop()
        kind = type(v)
        if kind is str or kind is int or kind is bool or v is None:
            continue
        if kind is dict:
            push(v.values())
        elif kind is list or kind is tuple:
            push(v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                return True
        elif isinstance(v, dict):
            push(v.values())
        elif isinstance(v, (list, tuple)):
            push(v)
    return False


_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_NON_STR_KEYS

#: the envelope's fields of an ``events`` row, in :data:`EVENT_COLUMNS` order (one C call per row)
_ROW_FIELDS = attrgetter("event_id", "type", "schema_version", "occurred_at", "producer", "actor", "region", "zone",
                         "cluster", "tenant", "project", "job_id", "attempt", "policy_version")


def _wire(d: Delivery) -> bytes | None:
    """The bytes of the stream message ``d`` was decoded from (None: not a stream message)."""
    msg = d.msg
    data = getattr(msg, "data", None) if msg is not None else None
    return data if type(data) is bytes else None


def event_row(d: Delivery) -> tuple:
    """The ``events`` row of a delivery (columns :data:`EVENT_COLUMNS`): the envelope's fields,
    ``occurred_at`` aware UTC, the trace id, the subject and the payload as JSON (:func:`to_json`).

    Raises:
        ValueError: the payload holds a float NaN or infinity the message does not say
            (:func:`to_json`).
    """
    e = d.envelope
    row = _ROW_FIELDS(e)
    at = row[3]
    if at.tzinfo is not UTC:
        row = (*row[:3], _naive_utc(at), *row[4:])
    return (*row, telemetry.trace_id_of(d.headers), d.subject, _to_json(e.payload, _wire(d)))


def decision_row(e: Envelope, wire: bytes | None = None) -> tuple | None:
    """The ``decisions`` row (columns :data:`DECISION_COLUMNS`) of a ``job.placed`` /
    ``job.pending`` event, else None. ``wire``: the bytes of the message ``e`` was decoded from,
    if any (the evaluations' JSON is then not looked through again when the message says it, see
    :func:`_to_json`).

    Raises:
        DecodeError: the payload does not validate.
        ValueError: the evaluations hold a float NaN or infinity the message does not say.
    """
    row = DECISION_ROWS.route(e.type)
    return row(e, wire) if row is not None else None


def _placed_row(e: Envelope, wire: bytes | None) -> tuple:
    p = e.payload_as(JobPlaced)
    return (e.event_id, _naive_utc(e.occurred_at), e.job_id, e.attempt, e.tenant, e.project, "placed", e.region,
            e.cluster, p.explanation, 1, int(p.cross_region), p.score, e.policy_version,
            _to_json(p.evaluations, wire))


def _pending_row(e: Envelope, wire: bytes | None) -> tuple:
    p = e.payload_as(JobPending)
    return (e.event_id, _naive_utc(e.occurred_at), e.job_id, e.attempt, e.tenant, e.project, "pending", "", "",
            p.reason, int(p.fits_empty), 0, 0.0, e.policy_version, _to_json(p.evaluations, wire))


#: Which events have a ``decisions`` row (every event, of a known type or not, has an ``events`` row).
DECISION_ROWS: EventTable = EventTable({EventType.JOB_PLACED: _placed_row, EventType.JOB_PENDING: _pending_row})


def inventory_rows(e: Envelope) -> list[list]:
    """The ``inventory`` rows (one per card model) of an ``inventory.snapshot`` event."""
    if e.type != EventType.INVENTORY_SNAPSHOT:
        return []
    snap = e.payload_as(InventorySnapshot)
    by_model: dict[str, list[int]] = {}
    for n in snap.nodes:
        acc = by_model.setdefault(n.card_model, [0] * 7)
        acc[0] += 1
        acc[1] += int(n.healthy)
        acc[2] += n.gpus
        acc[3] += sum(n.gpu_free_milli)
        acc[4] += sum(1 for g in n.gpu_free_milli if g >= 1000)
        acc[5] += n.cpu_free_milli
        acc[6] += n.memory_free_mib
    return [[e.event_id, _naive_utc(e.occurred_at), e.region, e.zone, e.cluster, model, *acc]
            for model, acc in sorted(by_model.items())]


#: Payload types the store process reads again after audit checked them (audit's own screening,
#: projections and fencing; billing): :func:`payload_fault` keeps their parse with the envelope.
READ_AGAIN = frozenset({EventType.JOB_PLACED, EventType.JOB_STOP, EventType.JOB_PENDING, EventType.JOB_STARTED,
                        EventType.JOB_FINISHED, EventType.JOB_FAILED, EventType.JOB_REJECTED, EventType.JOB_STOPPED,
                        EventType.INVENTORY_SNAPSHOT, EventType.SECURITY_REJECTED_MESSAGE})


def payload_fault(env: Envelope) -> str | None:
    """Why ``env``'s payload does not validate against its type's model, or None when it does (or
    the type is unknown): exactly :func:`~fedsched.events.payload_error`, the one rule for every
    type, in its words.

    A payload of a type in :data:`READ_AGAIN` is parsed by ``payload_error`` itself, which keeps
    the parsed model with the envelope for the readers to come. Any other (``job.submitted``,
    heartbeats, usage records...) nobody here reads again, so its model is validated and dropped
    at once: a model kept with each envelope (held by the bus's shared decode cache, and by the
    batch) is a dozen more objects for every collection to walk (issue 15). Only an invalid one
    is given to ``payload_error``, for the reason.
    """
    event_type = env.known_type
    if event_type is None or event_type in READ_AGAIN:
        return payload_error(env)
    try:
        PAYLOADS[event_type].model_validate(env.payload)
    except Exception:  # noqa: BLE001 - whatever it is, payload_error says it (or raises it) as everywhere
        return payload_error(env)
    return None


#: What may arrive on a dead-letter subject: a dead letter, or (from a service) a security record.
DLQ_TYPES = frozenset({EventType.BUS_DEAD_LETTER, EventType.SECURITY_REJECTED_MESSAGE})


def screened(d: Delivery, prefix: str) -> Delivery:
    """The delivery audit records for ``d``: ``d`` itself, or a stand-in when its envelope may not
    be taken at its word (issue 14; :mod:`fedsched.trust`).

    * On a dead-letter subject ``<p>.deadletter.<consumer>`` the row is always attributed to the
      subject's sender (producer = ``<consumer>``, no routing names) under an id derived from
      the subject and the stream sequence (a dead letter can never take a real event's id). Anything
      but a ``bus.dead_letter`` -- and, from an agent's subject, anything but a dead letter at all
      -- is recorded as a ``bus.dead_letter`` holding the body, never as the event it claims to be.
      A refusing service's ``security.rejected_message`` (arrived on the dead-letter subject of one
      of :data:`~fedsched.trust.REFUSING_CONSUMERS`) is recorded as the security event of the
      message it names (:func:`security_record`: one row per refused message, whoever refused
      it); from anyone else (``ops``, the replay driver, an agent) it is a ``bus.dead_letter`` of
      its sender (issue 14, item 2: otherwise a forged record, blamed on any agent, would take the
      id of that agent's real refusal).
    * On an agent's subject an envelope that names another region/cluster, or a type agents may
      not send there, is recorded as a ``security.rejected_message`` attributed to the agent
      (the original body in the payload's ``data``), not as the event it claims to be.
    """
    env = d.envelope
    tokens = d.subject.split(".")
    if len(tokens) == 3 and tokens[:2] == [prefix, "deadletter"]:
        sender = sender_of(prefix, d.subject)
        agent = sender.startswith("agent-")
        allowed = {EventType.BUS_DEAD_LETTER} if agent else DLQ_TYPES
        # A service's dead letters and security records have ids deterministic per refused message
        # (fedsched.trust.rejection_events, Bus.dead_letter): keyed on that id, the same refusal
        # published again -- a consumer re-reading the stream after a restart, past JetStream's
        # duplicate window -- is the same row. An agent's ids are not trusted: keyed on the
        # dead-letter stream's own sequence.
        event_id = business_event_id("dlq", d.subject, (d.stream_sequence or env.event_id) if agent else env.event_id)
        refuser = sender in REFUSING_CONSUMERS  # only a refusing service's records name a refused message
        record = (security_record(d, prefix, sender)
                  if env.known_type == EventType.SECURITY_REJECTED_MESSAGE and refuser else None)
        if record is not None:
            return record
        if env.known_type in allowed - {EventType.SECURITY_REJECTED_MESSAGE}:
            stand_in = env.model_copy(update=dict(event_id=event_id, producer=sender, actor=sender, region="", zone="",
                                                  cluster="", tenant="", project="", job_id="", attempt=0))
        else:
            what = ("a valid security record" if env.known_type in allowed and refuser else
                    f"a dead letter ({sender!r} refuses no messages)" if env.known_type in allowed else "a dead letter")
            payload = DeadLetter(consumer=sender, subject=d.subject, stream_sequence=d.stream_sequence,
                                 reason=f"not {what}: a {env.type} envelope (claimed producer "
                                        f"{env.producer!r}) on a dead-letter subject",
                                 data=env.model_dump_json()[:65536])
            stand_in = make_event(EventType.BUS_DEAD_LETTER, payload, producer=sender,
                                  occurred_at=env.occurred_at.timestamp(), event_id=event_id, actor=sender)
        return replace(d, envelope=stand_in)
    reason = _subject_verdict(prefix, d.subject, env)
    if reason is None:
        return d
    return refused(d, prefix, reason)


#: (prefix, subject, type, region, cluster) -> :func:`~fedsched.trust.check_subject`'s verdict
#: (a pure function of these: the subjects and types of a federation are few, its events many)
_VERDICTS: dict[tuple[str, str, str, str, str], str | None] = {}
_VERDICTS_MAX = 4096


def _subject_verdict(prefix: str, subject: str, env: Envelope) -> str | None:
    """:func:`~fedsched.trust.check_subject` of ``env`` on ``subject``, remembered per subject,
    type, region and cluster (the only parts of the envelope it reads), at most
    :data:`_VERDICTS_MAX` of them (all forgotten when full)."""
    key = (prefix, subject, env.type, env.region, env.cluster)
    try:
        return _VERDICTS[key]
    except KeyError:
        pass
    verdict = check_subject(prefix, subject, env)
    if len(_VERDICTS) >= _VERDICTS_MAX:
        _VERDICTS.clear()
    _VERDICTS[key] = verdict
    return verdict


def security_record(d: Delivery, prefix: str, consumer: str) -> Delivery | None:
    """The audit record of a service's ``security.rejected_message`` ``d`` (arrived on
    ``<p>.deadletter.<consumer>``): the security event of the refused message it names, the
    same row whichever consumer -- audit itself included (:func:`refused`) -- refused that
    message, so one forged message is one security event in the log. None when its payload is
    not a valid :class:`~fedsched.events.SecurityRejected` (the caller records it as a dead letter).

    The row is keyed as :func:`refused` keys audit's own: id
    :func:`~fedsched.trust.security_event_id` of the refused message (recomputed from the
    payload, never the envelope's id), subject = the refused message's subject; attributed to the
    sender that subject names (``agent/<region>/<cluster>``, with that region and cluster; else
    the refusing consumer), actor = the refusing consumer, no tenant, project or job in the envelope.
    """
    env = d.envelope
    try:
        p = env.payload_as(SecurityRejected)
    except DecodeError:
        return None
    found = agent_subject(prefix, p.subject)
    region, cluster = (found[1], found[2]) if found else ("", "")
    producer = sender_of(prefix, p.subject) or consumer
    stand_in = env.model_copy(update=dict(
        event_id=security_event_id(p.subject, p.stream_sequence, p.event_id), producer=producer, actor=consumer,
        region=region, zone="", cluster=cluster, tenant="", project="", job_id="", attempt=0))
    return replace(d, envelope=stand_in, subject=p.subject)


def refused(d: Delivery, prefix: str, reason: str) -> Delivery:
    """The stand-in audit records for ``d``, a message it refuses for ``reason``: a
    ``security.rejected_message`` attributed to the agent of ``d``'s subject (region and cluster
    of the subject; for a service's subject -- a type that does not belong on it,
    :data:`fedsched.trust.SERVICE_TYPES` -- no sender, region or cluster: actor ``audit``: the refusing consumer; no tenant, project or job in the
    envelope -- nothing that counts a job's events sees it), the claimed type, job, attempt and
    the original body in its payload, under an id derived from the subject and the refused
    message (its stream sequence, else its event id: :func:`~fedsched.trust.security_event_id`),
    the id every other consumer's security record of that message has (:func:`security_record`):
    the message refused again, or by several consumers, is one row.
    """
    env = d.envelope
    sender = sender_of(prefix, d.subject)
    found = agent_subject(prefix, d.subject)  # None: a service's subject (a type that does not belong there)
    region, cluster = (found[1], found[2]) if found else ("", "")
    payload = SecurityRejected(consumer="audit", subject=d.subject, sender=sender, claimed_producer=env.producer,
                               claimed_region=env.region, claimed_cluster=env.cluster, event_type=env.type,
                               event_id=env.event_id, job_id=env.job_id, attempt=env.attempt,
                               stream_sequence=d.stream_sequence, reason=reason)
    stand_in = make_event(EventType.SECURITY_REJECTED_MESSAGE, payload, producer=sender or "unknown",
                          occurred_at=env.occurred_at.timestamp(),
                          event_id=security_event_id(d.subject, d.stream_sequence, env.event_id),
                          region=region, cluster=cluster, actor="audit")
    stand_in = stand_in.model_copy(update=dict(payload={**stand_in.payload, "data": env.model_dump_json()[:65536]}))
    return replace(d, envelope=stand_in)


#: An agent's report about one attempt of one shard: stored as itself only when the federation
#: placed that attempt of that shard on the reporting cluster (:meth:`AuditService.screen_statuses`).
SHARD_STATUSES = frozenset({EventType.JOB_STARTED, EventType.JOB_FINISHED, EventType.JOB_FAILED,
                            EventType.JOB_REJECTED, EventType.JOB_STOPPED})

#: The placements of some jobs, from the log itself (``job.placed`` on a placements subject).
#: ``events`` is ordered by type first and has a bloom filter on ``job_id``: the read touches
#: the granules of these jobs' placements, not the history.
_PLACED_SQL = """
    SELECT job_id, attempt, JSONExtractInt(payload, 'shard') AS shard, region, cluster FROM {db}.events
    WHERE type = 'job.placed' AND job_id IN {jobs:Array(String)} AND startsWith(subject, {placements:String})"""


#: the statuses that end an attempt (at most one is stored as itself per attempt and shard)
_ENDS = frozenset({EventType.JOB_FINISHED, EventType.JOB_FAILED, EventType.JOB_STOPPED})


def placement_reason(env: Envelope, shard: int, placed: dict[tuple[str, int, int], tuple[str, str]]) -> str | None:
    """Why the status ``env`` (about ``shard``) contradicts the placements, or None when the
    federation placed that attempt of that shard on ``env``'s region and cluster.

    Args:
        env: an agent's status (job_id, attempt, region, cluster are checked).
        shard: its shard (from the payload).
        placed: (job_id, attempt, shard) -> (region, cluster) of every known placement of the job.
    """
    where = placed.get((env.job_id, env.attempt, shard))
    if where is None:
        return f"attempt {env.attempt} (shard {shard}) of {env.job_id} was never placed"
    if where != (env.region, env.cluster):
        return (f"attempt {env.attempt} of {env.job_id} was placed on {where[0]}/{where[1]}, "
                f"not on {env.region}/{env.cluster}")
    return None


def stale_stand_in(d: Delivery, reason: str) -> Delivery:
    """The stand-in audit records for ``d``, a scheduler's order with a stale fencing token (a
    former active scheduler's, refused by agents, billing and admission alike): a
    ``bus.dead_letter`` of consumer ``audit`` with the reason and the original body, no tenant,
    project or job in its envelope, under an id derived from the subject and the order's id."""
    env = d.envelope
    payload = DeadLetter(consumer="audit", subject=d.subject, stream_sequence=d.stream_sequence,
                         reason=reason[:2000], data=env.model_dump_json()[:65536])
    stand_in = make_event(EventType.BUS_DEAD_LETTER, payload, producer=env.producer,
                          occurred_at=env.occurred_at.timestamp(),
                          event_id=business_event_id("stale", "audit", d.subject, env.event_id), actor="audit")
    return replace(d, envelope=stand_in)


#: The active scheduler's orders (fenced by its lease's token) and their payloads.
ORDERS = {EventType.JOB_PLACED: JobPlaced, EventType.JOB_STOP: JobStop}


class AuditService:
    """Writes every event of the federation to ClickHouse.

    Args:
        bus: NATS connection.
        store: the ClickHouse store (async wrapper).
        batch: maximum events per insert.
        max_wait_s: how long an idle fetch waits.
        linger_s: time bound of a batch (collect up to ``batch`` events for this long). Every
            insert costs the embedded engine ~5-10 ms CPU whatever its size (a new part, and
            the merges it causes), so a batch gathers ~0.75 s of events, one insert per table:
            rows reach ClickHouse within about ``linger_s`` (issue 15). Kept below
            ``ack_wait_s / 4``, when a batch still in hand starts reporting progress on each of
            its messages.
        ack_wait_s: JetStream redelivers a batch not acknowledged within this long after the
            writer's last progress report (a writer that died mid-batch: its successor, or
            another replica, writes the batch within this long; a slow insert keeps its batch
            by reporting progress: :class:`~fedsched.bus.DurableConsumer`). Writes are keyed
            (event id and subject), so a redelivered batch adds no row.
        metrics: where insert latency per table is timed (default: a registry of its own).
        tenure: reads the scheduler lease's current tenure (default
            :func:`~fedsched.lease.read_tenure` on ``bus``).
        retain_placements: placements kept in memory to judge statuses (the newest; the others
            are read from ``events`` when needed).
        gc_young_threshold: :meth:`run` freezes the start-up heap and raises the collector's
            young threshold to this (:func:`~fedsched.gctune.tune_for_service`, process-wide;
            0 = leave the collector alone).
    """

    def __init__(self, bus: Bus, store: AsyncStore, *, batch: int = 2000, max_wait_s: float = 0.5,
                 linger_s: float = 0.75, ack_wait_s: float = 5.0, metrics: WriterMetrics | None = None,
                 tenure: Callable[[], Awaitable[Tenure | None]] | None = None,
                 retain_placements: int = 100_000, gc_young_threshold: int = YOUNG_THRESHOLD) -> None:
        self.bus = bus
        self.store = store
        self.metrics = metrics if metrics is not None else WriterMetrics("audit")
        self.consumers = [
            DurableConsumer(bus, suffix, f"audit-{suffix.lower()}", [bus.subjects.all()], self.write,
                            batch=batch, max_wait_s=max_wait_s, linger_s=linger_s, ack_wait_s=ack_wait_s)
            for suffix in ("EVENTS", "INVENTORY", "DLQ")
        ]
        self.written = 0
        self.malformed = 0  #: events dead-lettered for a payload that does not validate
        self.unstorable = 0  #: events dead-lettered because ClickHouse refused their row (the rest of the batch stored)
        #: scheduler-lease fencing tokens on the orders written, judged in stream order
        self.fencing = StreamFencing()
        #: (job, attempt, shard) -> (region, cluster) of the newest placements read (bounded: older
        #: ones are read back from ``events`` when a status needs them)
        self._placed: RecentDict[tuple[str, int, int], tuple[str, str]] = RecentDict(retain_placements)
        #: (job_id, attempt, shard) -> (event id, time) of the first end stored of recent attempts
        self._ended: RecentDict[tuple[str, int, int], tuple[str, datetime]] = RecentDict(retain_placements)
        self.placement_queries = 0  #: batches whose statuses needed the log's placements
        self._read_tenure = tenure if tenure is not None else (lambda: read_tenure(bus))
        self.gc_young_threshold = gc_young_threshold

    async def write(self, deliveries: list[Delivery]) -> None:
        """Insert the batch and its projections; return only after ClickHouse committed them.

        A batch the engine refuses (a value a typed column cannot hold, which validation should
        have refused first) is bisected (:meth:`_isolate`): every other event is stored once and
        each one the engine refuses alone is dead-lettered with the engine's reason (counted in
        :attr:`unstorable`). Before, the whole batch failed until the consumer dead-lettered every
        event of it, valid ones included (tryout: ``attempt`` 2^32 in a UInt32 column).

        Raises:
            UnavailableError: ClickHouse or NATS cannot be reached (the consumer backs off and
                retries the batch).
        """
        deliveries = [screened(d, self.bus.prefix) for d in deliveries]
        deliveries = await self.drop_malformed(deliveries)
        deliveries = await self.fence_orders(deliveries)
        deliveries = await self.screen_statuses(deliveries)
        try:
            await self._insert(deliveries)
        except ValidationError as e:  # the engine refused the batch: find the rows it cannot store
            if len(deliveries) == 1:
                raise
            stored, unstorable = await self._isolate(deliveries, e)
            if not stored:  # nothing goes in: not a row's fault (retried, then the consumer's rule)
                raise
            for d, reason in unstorable:
                await self.bus.dead_letter(self._durable_of(d), d.msg, f"audit cannot store it: {reason}",
                                           subject=d.subject, data=d.envelope.to_bytes(), headers=d.headers)
                self.unstorable += 1

    async def _isolate(self, deliveries: list[Delivery],
                       error: ValidationError) -> tuple[int, list[tuple[Delivery, str]]]:
        """Store what the engine takes of a batch it refused (``error``), by bisection: each half
        is inserted again (keyed writes: rows already in stay once), a refused half split again,
        down to single events. ``O(k log n)`` inserts for ``k`` unstorable rows of ``n``.

        Returns:
            (how many deliveries were stored, [(each delivery the engine refuses alone, why)]).

        Raises:
            UnavailableError: the engine became unreachable meanwhile (the batch is retried).
        """
        if len(deliveries) == 1:
            return 0, [(deliveries[0], error.reason)]
        mid = len(deliveries) // 2
        stored, unstorable = 0, []
        for half in (deliveries[:mid], deliveries[mid:]):
            try:
                await self._insert(half)
                stored += len(half)
            except ValidationError as e:
                n, bad = await self._isolate(half, e)
                stored += n
                unstorable += bad
        return stored, unstorable

    async def _insert(self, deliveries: list[Delivery]) -> None:
        """Insert ``deliveries``' rows: projections, then the events (keyed: nothing twice).

        Raises:
            ValidationError: the engine refused a row (a value its column cannot hold).
            UnavailableError: ClickHouse cannot be reached.
        """
        events = [event_row(d) for d in deliveries]
        decisions = [r for d in deliveries if (r := decision_row(d.envelope, _wire(d))) is not None]
        inventory = [r for d in deliveries for r in inventory_rows(d.envelope)]
        # Projections first: if we crash between inserts, the redelivered batch fills what is missing.
        if decisions:
            with self.metrics.time_insert("decisions"):
                await self.store.insert_new("decisions", decisions, DECISION_COLUMNS, "event_id")
        if inventory:
            with self.metrics.time_insert("inventory"):
                await self.store.insert_new("inventory", inventory, INVENTORY_COLUMNS, ("event_id", "card_model"))
        # keyed on (event id, subject): what one agent publishes on its own subject under another
        # cluster's event id never takes the place of that cluster's event in the log
        with self.metrics.time_insert("events"):
            self.written += await self.store.insert_new("events", events, EVENT_COLUMNS, ("event_id", "subject"))

    async def drop_malformed(self, deliveries: list[Delivery]) -> list[Delivery]:
        """``deliveries`` without those whose payload does not validate against its type's model
        (:func:`~fedsched.events.payload_error`; every known type, the same rule), each
        dead-lettered first with the reason on ``<p>.deadletter.<the consumer's durable>`` (its
        id is derived from the stream message: a batch retried after an outage publishes the same
        dead letter, stored once). Audit's own stand-ins (:func:`screened`) are built valid.

        Raises:
            UnavailableError: the dead letter could not be published (the batch is retried).
        """
        out = []
        for d in deliveries:
            reason = payload_fault(d.envelope)
            if reason is None:
                out.append(d)
                continue
            await self.bus.dead_letter(self._durable_of(d), d.msg, reason, subject=d.subject,
                                       data=d.envelope.to_bytes(), headers=d.headers)
            self.malformed += 1
        return out

    def _durable_of(self, d: Delivery) -> str:
        """The name of the durable ``d`` came through (``audit`` when it is not a stream message)."""
        try:
            stream = d.msg.metadata.stream
        except Exception:  # noqa: BLE001 - no JetStream metadata (a fake delivery)
            return "audit"
        return next((c.durable for c in self.consumers if c.stream == stream), "audit")

    async def fence_orders(self, deliveries: list[Delivery]) -> list[Delivery]:
        """``deliveries`` with every scheduler order whose fencing token is stale
        (:func:`~fedsched.lease.stale_order`: a higher token precedes it in the stream, or below the lease's
        current tenure, read once per batch of orders, and stored after it began) replaced by
        its :func:`stale_stand_in`: the rule agents, billing and admission apply, so the log
        never shows a placement nobody carried out.

        Raises:
            UnavailableError: the lease could not be read (the batch is retried).
        """
        placements = self.bus.subjects.all("placements")[:-1]
        orders = [i for i, d in enumerate(deliveries)
                  if d.envelope.known_type in ORDERS and d.subject.startswith(placements)]
        if not orders:
            return deliveries
        tenure = await self._read_tenure()
        out = list(deliveries)
        for i in orders:
            d = deliveries[i]
            token = d.envelope.payload_as(ORDERS[d.envelope.known_type]).fencing_token
            reason = self.fencing.judge(token, d, tenure)
            if reason is None:
                continue
            log.warning("audit: %s of %s is not stored as such: %s", d.envelope.type, d.envelope.job_id, reason)
            out[i] = stale_stand_in(d, reason)
        return out

    async def screen_statuses(self, deliveries: list[Delivery]) -> list[Delivery]:
        """``deliveries`` with every agent status about an attempt the federation did not place
        on the reporting cluster replaced by its :func:`refused` stand-in (issue 14: the log
        never holds a refused message as the event it claims to be).

        The placements are those of this batch, the newest ones read (in memory, bounded) and
        those already in ``events`` (asked only for statuses the memory cannot judge): the stream
        holds a placement before its statuses and audit's events consumer reads the whole
        stream, so when every message before a status has been written (its acknowledgement
        floor, or this batch), a placement not found was never made. A status whose earlier
        messages are still outstanding (handed back after an outage) waits.

        Raises:
            UnavailableError: ClickHouse unreachable, or a status's placement may still be on
                its way (the consumer hands the batch back and retries).
        """
        prefix = self.bus.prefix
        checked = [i for i, d in enumerate(deliveries)
                   if d.envelope.known_type in SHARD_STATUSES and d.envelope.job_id
                   and (found := agent_subject(prefix, d.subject)) is not None and found[0] == "status"]
        if not checked:
            return deliveries
        placements = self.bus.subjects.all("placements")[:-1]  # "<p>.placements."
        placed = self._placed
        for d in deliveries:  # placements of this batch (written with it)
            e = d.envelope
            if e.known_type == EventType.JOB_PLACED and d.subject.startswith(placements):
                placed[(e.job_id, e.attempt, e.payload_as(JobPlaced).shard)] = (e.region, e.cluster)
        # the log is asked only about statuses whose placement left (or never was in) memory
        missing = sorted({deliveries[i].envelope.job_id for i in checked
                          if (deliveries[i].envelope.job_id, deliveries[i].envelope.attempt,
                              deliveries[i].envelope.payload_as(JobStatus).shard) not in placed})
        if missing:
            sql = _PLACED_SQL.replace("{db}", self.store.store.database)
            self.placement_queries += 1
            for job_id, attempt, shard, region, cluster in (
                    await self.store.query(sql, {"jobs": missing, "placements": placements})).rows:
                placed[(str(job_id), int(attempt), int(shard))] = (str(region), str(cluster))
        out = list(deliveries)
        floor: int | None = None
        in_batch = {d.stream_sequence for d in deliveries}
        for i in checked:
            d = deliveries[i]
            env = d.envelope
            shard = env.payload_as(JobStatus).shard
            reason = placement_reason(env, shard, placed)
            if reason is None and env.known_type in _ENDS:  # one end per attempt (a second: refused)
                first = self._ended.get((env.job_id, env.attempt, shard))
                if first is None or first[0] == env.event_id:
                    self._ended[(env.job_id, env.attempt, shard)] = (env.event_id, env.occurred_at)
                else:
                    reason = f"attempt already ended at {first[1].isoformat()} ({first[0]})"
            if reason is None:
                continue
            if reason.endswith("never placed") and d.stream_sequence:
                if floor is None:
                    floor = await self._events_ack_floor()
                if any(q not in in_batch for q in range(floor + 1, d.stream_sequence)):
                    raise UnavailableError(f"waiting for the messages before {d.envelope.type} of "
                                           f"{d.envelope.job_id} (stream sequence {d.stream_sequence})")
            log.warning("audit: refused %s of %s on %s: %s", d.envelope.type, d.envelope.job_id, d.subject, reason)
            out[i] = refused(d, prefix, reason)
        return out

    async def _events_ack_floor(self) -> int:
        """The events consumer's acknowledgement floor (every message up to it is written).

        Raises:
            UnavailableError: NATS unreachable.
        """
        c = self.consumers[0]
        try:
            info = await self.bus.js.consumer_info(c.stream, c.durable)
        except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            raise UnavailableError(f"cannot read the events consumer's progress: {e!r}") from e
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0

    async def lag(self) -> int:
        """Events not yet written (all three consumers)."""
        return sum([await c.lag() for c in self.consumers])

    async def run(self) -> None:
        """Consume until cancelled/stopped; first, unless ``gc_young_threshold`` is 0, tune
        the process's garbage collector (:func:`~fedsched.gctune.tune_for_service`)."""
        if self.gc_young_threshold:
            tune_for_service(self.gc_young_threshold)
        await asyncio.gather(*(c.run() for c in self.consumers))

    def stop(self) -> None:
        """Stop all consumers after their current batch."""
        for c in self.consumers:
            c.stop()
