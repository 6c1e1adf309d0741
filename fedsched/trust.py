"""Agents speak only for themselves: checking an agent's message against its subject and against
the federation's own placement records (issue 14, item 1).

NATS permissions (``deploy/nats/accounts.conf``, :mod:`fedapp.natsauth`) let the agent of
cluster ``<c>`` in region ``<r>`` publish only on ``<p>.status.<r>.<c>``,
``<p>.inventory.<r>.<c>``, ``<p>.heartbeat.<r>.<c>`` and its own dead-letter subjects. The
subject is therefore the sender's identity; the envelope is only a claim. Every consumer of
those subjects checks, in this order:

1. **subject** (:func:`check_subject`): the envelope's region and cluster are the subject's, and
   its type is one an agent may send on that family (:data:`AGENT_TYPES`; a type this build does
   not know is let through to the consumer's dispatch table, which skips and counts it);
2. **placement** (:func:`check_placement`, for a job status): the job exists, that shard's
   attempt was placed on exactly this region and cluster, and the attempt is the current one or
   a known earlier one (a late event). What counts as "the placement records" is each
   consumer's own: the scheduler's shards, admission's job view, billing's placement book.

A message failing a check is refused: it changes nothing, is dead-lettered with the reason
(``bus.dead_letter``) and recorded as a ``security.rejected_message`` (:func:`rejection_events`,
both on the refusing consumer's dead-letter subject). Ids are deterministic, so a re-read after a
restart records a refusal once: the dead letter's per consumer and stream message (each
consumer's own record), the security record's per refused message only
(:func:`security_event_id`), so audit stores one security event per forged message however many
consumers refuse it.

Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsched.events import (DeadLetter, Envelope, EventType, SecurityRejected, Subjects, business_event_id,
                             make_event)

#: Subject family -> the event types an agent may publish there. ``job.stopped`` on a status
#: subject may also come from the scheduler (an attempt of a lost cluster), with that cluster's
#: routing names; ``job.cancelled`` never comes from an agent (the scheduler sends it on the
#: decisions subject).
AGENT_TYPES: dict[str, frozenset[EventType]] = {
    "status": frozenset({EventType.JOB_STARTED, EventType.JOB_FINISHED, EventType.JOB_FAILED,
                         EventType.JOB_REJECTED, EventType.JOB_STOPPED, EventType.AGENT_RECONCILED}),
    "inventory": frozenset({EventType.INVENTORY_SNAPSHOT}),
    "heartbeat": frozenset({EventType.INVENTORY_HEARTBEAT}),
}

#: Job status types an agent reports about one attempt (checked against the placement records).
ATTEMPT_STATUSES: frozenset[EventType] = frozenset({
    EventType.JOB_STARTED, EventType.JOB_FINISHED, EventType.JOB_FAILED, EventType.JOB_REJECTED,
    EventType.JOB_STOPPED, EventType.AGENT_RECONCILED})


#: The consumers that refuse messages and publish their security records
#: (:func:`rejection_events`) -- and the other dead-letter names of the same services, which NATS
#: lets only those services publish on (fedapp/natsauth.py): a ``security.rejected_message`` is
#: taken for one only from ``<p>.deadletter.<one of these>`` (issue 14, item 2). From anyone else
#: (``ops``, the replay driver, an agent) it is a plain dead letter of its sender.
REFUSING_CONSUMERS: frozenset[str] = frozenset({
    "scheduler", "scheduler-events", "scheduler-inventory",
    "admission", "admission-jobs", "admission-inventory", "admission-policy",
    "billing", "billing-transfer",
    "audit", "audit-events", "audit-inventory", "audit-dlq"})


def agent_subject(prefix: str, subject: str) -> tuple[str, str, str] | None:
    """``(family, region, cluster)`` when ``subject`` is an agent's (``<p>.<family>.<r>.<c>`` with
    family in :data:`AGENT_TYPES`), else None."""
    tokens = subject.split(".")
    if len(tokens) != 4 or tokens[0] != prefix or tokens[1] not in AGENT_TYPES:
        return None
    return tokens[1], tokens[2], tokens[3]


def sender_of(prefix: str, subject: str) -> str:
    """Who may publish on ``subject`` as far as the subject says: ``agent/<region>/<cluster>`` for
    an agent's subject, the consumer name for ``<p>.deadletter.<consumer>``, else ""."""
    found = agent_subject(prefix, subject)
    if found is not None:
        return f"agent/{found[1]}/{found[2]}"
    tokens = subject.split(".")
    if len(tokens) == 3 and tokens[0] == prefix and tokens[1] == "deadletter":
        return tokens[2]
    return ""


#: The other subject families (``<p>.<family>`` or ``<p>.<family>.<kind>``, the key) -> the
#: event types their designed publishers send there (fedsched/events.py ``Subjects``; the
#: publishers: deploy/nats/accounts.conf). A service's credentials may publish on a whole family
#: (the scheduler on ``status.>``, admission on ``jobs.>``): a reader acts on an envelope only when
#: its type belongs on the subject it arrived on (issue 14, item 1b: a ``job.cancel_requested`` on
#: a dead-letter or decisions subject is refused, never acted on).
SERVICE_TYPES: dict[str, frozenset[EventType]] = {
    "jobs.submitted": frozenset({EventType.JOB_SUBMITTED}),
    "jobs.cancel": frozenset({EventType.JOB_CANCEL_REQUESTED}),
    "jobs.hold": frozenset({EventType.JOB_HELD}),
    "jobs.release": frozenset({EventType.JOB_RELEASED}),
    "jobs.priority": frozenset({EventType.JOB_PRIORITY_CHANGED}),
    "admission.rejected": frozenset({EventType.SUBMISSION_REJECTED}),
    "placements": frozenset({EventType.JOB_PLACED, EventType.JOB_STOP}),
    "decisions": frozenset({EventType.JOB_PENDING, EventType.JOB_CANCELLED}),
    "billing.usage": frozenset({EventType.USAGE_RECORDED}),
    "governance.policy": frozenset({EventType.POLICY_APPLIED, EventType.TENANT_UPDATED, EventType.QUOTA_UPDATED,
                                    EventType.PRINCIPAL_UPDATED}),
    "governance.tenant": frozenset({EventType.POLICY_APPLIED, EventType.TENANT_UPDATED, EventType.QUOTA_UPDATED,
                                    EventType.PRINCIPAL_UPDATED}),
    "governance.approval": frozenset({EventType.APPROVAL_REQUESTED, EventType.APPROVAL_APPROVED,
                                      EventType.APPROVAL_REJECTED, EventType.APPROVAL_EXPIRED}),
    "deadletter": frozenset({EventType.BUS_DEAD_LETTER, EventType.SECURITY_REJECTED_MESSAGE}),
}


def subject_family(prefix: str, subject: str) -> str | None:
    """The key of :data:`SERVICE_TYPES` (or :data:`AGENT_TYPES`) ``subject`` belongs to, None
    for a subject of no known family (another prefix, request/reply subjects)."""
    tokens = subject.split(".")
    if len(tokens) < 2 or tokens[0] != prefix:
        return None
    if len(tokens) >= 3 and f"{tokens[1]}.{tokens[2]}" in SERVICE_TYPES:
        return f"{tokens[1]}.{tokens[2]}"
    if tokens[1] in SERVICE_TYPES or tokens[1] in AGENT_TYPES:
        return tokens[1]
    return None


def check_subject(prefix: str, subject: str, env: Envelope) -> str | None:
    """Step 1: the reason ``env`` may not arrive on ``subject``, or None when it may.

    On an agent's subject: the envelope's region and cluster must be the subject's and its type
    one of :data:`AGENT_TYPES`; on a service's subject family its type must be one of
    :data:`SERVICE_TYPES` (a service's credentials cover a whole family, not one type). Types
    this build does not know, and subjects of no known family, are not judged (None).
    """
    found = agent_subject(prefix, subject)
    if found is None:
        family = subject_family(prefix, subject)
        known = env.known_type
        if family in SERVICE_TYPES and known is not None and known not in SERVICE_TYPES[family]:
            return f"event type {env.type} may not be sent on a {family} subject"
        return None
    family, region, cluster = found
    if env.region != region or env.cluster != cluster:
        return (f"envelope claims {env.region or '-'}/{env.cluster or '-'} but arrived on {family} subject of "
                f"{region}/{cluster}")
    known = env.known_type
    if known is not None and known not in AGENT_TYPES[family]:
        return f"event type {env.type} may not be sent on a {family} subject"
    return None


@dataclass(frozen=True, slots=True)
class PlacedAttempt:
    """Where the federation placed one attempt of one shard (from its own ``job.placed``)."""

    attempt: int
    region: str
    cluster: str


def check_placement(env: Envelope, job_known: bool, placed: PlacedAttempt | None, current_attempt: int) -> str | None:
    """Step 2: the reason a status ``env`` about one attempt contradicts the placement records,
    or None when it agrees.

    Args:
        env: the status (its job_id, attempt, region, cluster are checked).
        job_known: the job exists in the consumer's records.
        placed: the placement of ``env``'s shard and attempt, None if the records hold none
            (an attempt never placed, or an earlier one the consumer no longer keeps).
        current_attempt: the shard's newest attempt number (0 = never placed).

    Raises:
        ValueError: ``placed`` is about another attempt than ``env`` (a programming error).
    """
    if not job_known:
        return f"job {env.job_id!r} does not exist"
    if env.attempt > current_attempt:
        return f"attempt {env.attempt} of {env.job_id} was never placed (newest is {current_attempt})"
    if placed is None:
        if env.attempt == current_attempt:
            return f"attempt {env.attempt} of {env.job_id} has no placement"
        return None  # an earlier attempt whose placement this consumer no longer keeps: a late event
    if placed.attempt != env.attempt:
        raise ValueError(f"placed is attempt {placed.attempt}, the status is about {env.attempt}")
    if (placed.region, placed.cluster) != (env.region, env.cluster):
        return (f"attempt {env.attempt} of {env.job_id} was placed on {placed.region}/{placed.cluster}, "
                f"not on {env.region}/{env.cluster}")
    return None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused message, as the consumer saw it (input of :func:`rejection_events`).

    Attributes:
        consumer: the refusing consumer.
        subject: the subject it arrived on.
        envelope: the decoded envelope.
        reason: why it was refused.
        stream_sequence: its stream sequence (0 if unknown: the event ids then derive from its
            event id instead).
        data: its raw body ("" = the envelope's JSON).
        headers: its headers.
    """

    consumer: str
    subject: str
    envelope: Envelope
    reason: str
    stream_sequence: int = 0
    data: str = ""
    headers: tuple[tuple[str, str], ...] = ()


#: most characters of the refused message a dead letter embeds (also capped by the server's
#: ``max_payload``: :func:`dead_letter_room`, the rule of :meth:`fedsched.bus.Bus.dead_letter`)
MAX_DEAD_LETTER_DATA = 65536


def dead_letter_room(max_payload: int | None) -> int:
    """Characters of a refused message a dead letter may embed: ``max_payload // 8`` bytes of
    the server (JSON may escape the body several-fold and the dead letter must fit), at most
    :data:`MAX_DEAD_LETTER_DATA`; None (unknown, e.g. a fake publisher) gives that maximum."""
    if not max_payload:
        return MAX_DEAD_LETTER_DATA
    return max(0, min(MAX_DEAD_LETTER_DATA, int(max_payload) // 8))


def security_event_id(subject: str, stream_sequence: int, event_id: str) -> str:
    """The id of the ``security.rejected_message`` of a refused message, the same whichever
    consumer refuses it (audit included, :func:`services.audit.service.refused`): derived from
    the subject it arrived on and its stream sequence, else (0: unknown) from its claimed event id.

    Args:
        subject: the refused message's subject.
        stream_sequence: its sequence in its stream (0 = unknown).
        event_id: its envelope's event id (used only without a stream sequence).
    """
    key = stream_sequence if stream_sequence else f"msg:{event_id}"
    return business_event_id("security", subject, key)


def rejection_events(subjects: Subjects, r: Rejection, occurred_at: float, *,
                     max_data: int = MAX_DEAD_LETTER_DATA) -> list[tuple[str, Envelope]]:
    """The ``bus.dead_letter`` and ``security.rejected_message`` events of a refusal, both on
    ``<p>.deadletter.<consumer>``, as ``(subject, event)``. The dead letter's id is per consumer
    and message; the security event's is per message only (:func:`security_event_id`).

    Args:
        subjects: the federation's subjects.
        r: the refusal.
        occurred_at: business seconds of the refusal.
        max_data: most characters of the refused message the dead letter embeds (pass
            :func:`dead_letter_room` of the bus's ``max_payload``).
    """
    env = r.envelope
    seq = r.stream_sequence
    subject = subjects.deadletter(r.consumer)
    reason = f"rejected: {r.reason}"[:2000]
    dead = DeadLetter(consumer=r.consumer, subject=r.subject, stream_sequence=seq, deliveries=1, reason=reason,
                      data=(r.data or env.model_dump_json())[:max_data], headers=dict(r.headers))
    security = SecurityRejected(
        consumer=r.consumer, subject=r.subject, sender=sender_of(subjects.prefix, r.subject),
        claimed_producer=env.producer, claimed_region=env.region, claimed_cluster=env.cluster, event_type=env.type,
        event_id=env.event_id, job_id=env.job_id, attempt=env.attempt, stream_sequence=seq, reason=r.reason[:2000])
    # the id the bus gives a dead letter of this stream message (fedsched.bus.Bus.dead_letter);
    # without a stream sequence, the refused message's own id: deterministic either way, so a
    # consumer refusing the same message again (redelivery, a re-read after a restart) publishes
    # the same events, which JetStream and audit store once. The dead letter is this consumer's
    # record (one per consumer); the security event is the message's (one whoever refuses it)
    key = seq if seq else f"msg:{env.event_id}"
    dead_id = business_event_id("dead_letter", r.consumer, r.subject, key)
    security_id = security_event_id(r.subject, seq, env.event_id)
    found = agent_subject(subjects.prefix, r.subject)  # indexed under the sender, not the claim
    routing = dict(region=found[1], cluster=found[2], actor=r.consumer) if found else dict(actor=r.consumer)
    return [
        (subject, make_event(EventType.BUS_DEAD_LETTER, dead, producer=r.consumer, occurred_at=occurred_at,
                             event_id=dead_id, **routing)),
        (subject, make_event(EventType.SECURITY_REJECTED_MESSAGE, security, producer=r.consumer,
                             occurred_at=occurred_at, event_id=security_id, **routing)),
    ]
