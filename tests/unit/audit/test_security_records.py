"""One forged message is one security event in the log (issue 14): every consumer that refuses
it -- the services, each publishing on its own dead-letter subject, and audit itself -- gives
audit a record under the same key (event id, subject), derived from the refused message only.
Pure functions of audit and :mod:`fedsched.trust`; no bus."""

from __future__ import annotations

import pytest

from fedsched.events import Envelope, EventType, JobStatus, SecurityRejected, Subjects, make_event
from fedsched.trust import Rejection, rejection_events, security_event_id
from services.audit.service import event_row, refused, screened
from tests.builders import delivery

SUBJECTS = Subjects("t")
R, C1, C9 = "cn-east-1", "cn-east-1-c1", "cn-east-1-c9"
CONSUMERS = ("scheduler-events", "admission-jobs", "billing")


def _forged(seq: int):
    """c1's agent, on its own status subject, reports a job of c9 finished."""
    env = make_event("job.finished", JobStatus(), producer="agent/x", occurred_at=1.7e9, region=R, cluster=C9,
                     tenant="nlp", project="train", job_id="j-1", attempt=1)
    return delivery(env, SUBJECTS.status(R, C1), seq, 1.7e9)


def _records_of(d, consumer: str, reason: str = "forged"):
    """What audit stores of the events ``consumer`` publishes when it refuses ``d``."""
    r = Rejection(consumer, d.subject, d.envelope, reason, d.stream_sequence)
    return [screened(delivery(e, s, 100 + i, 1.7e9), "t") for i, (s, e) in enumerate(rejection_events(SUBJECTS, r, 1.7e9))]


def _key(d) -> tuple[str, str]:
    row = event_row(d)
    return row[0], row[15]  # the events table's key: (event_id, subject)


@pytest.mark.parametrize("seq", [pytest.param(7, id="stream-sequence"), pytest.param(0, id="event-id-only")])
def test_every_consumers_security_record_of_a_message_is_one_row(seq) -> None:
    forged = _forged(seq)
    by_audit = refused(forged, "t", "envelope claims another cluster")
    records = {c: _records_of(forged, c) for c in CONSUMERS}
    security = [d for rs in records.values() for d in rs if d.envelope.type == EventType.SECURITY_REJECTED_MESSAGE]
    assert len(security) == len(CONSUMERS)
    assert {_key(d) for d in security} == {_key(by_audit)}
    assert _key(by_audit) == (security_event_id(forged.subject, seq, forged.envelope.event_id), forged.subject)
    # attributed to the sender the refused message's subject names; the refusing consumer is the actor
    assert {(d.envelope.producer, d.envelope.cluster, d.envelope.job_id) for d in security} == {
        (f"agent/{R}/{C1}", C1, "")}
    assert {d.envelope.actor for d in security} == set(CONSUMERS)
    # dead letters stay each consumer's own record
    dead = [d for rs in records.values() for d in rs if d.envelope.type == EventType.BUS_DEAD_LETTER]
    assert len({_key(d) for d in dead}) == len(CONSUMERS)


def test_another_message_is_another_security_event() -> None:
    a, b = _forged(7), _forged(8)
    assert _key(refused(a, "t", "x")) != _key(refused(b, "t", "x"))
    (sa,) = [d for d in _records_of(a, "billing") if d.envelope.type == EventType.SECURITY_REJECTED_MESSAGE]
    (sb,) = [d for d in _records_of(b, "billing") if d.envelope.type == EventType.SECURITY_REJECTED_MESSAGE]
    assert _key(sa) != _key(sb)


def test_a_security_record_whose_payload_is_invalid_is_stored_as_a_dead_letter_of_its_sender() -> None:
    valid = make_event("security.rejected_message", SecurityRejected(consumer="billing", subject="t.x", reason="r"),
                       producer="billing", occurred_at=1.7e9, event_id="e" * 32)
    bogus = Envelope.model_validate({**valid.model_dump(), "payload": {"consumer": "billing"}})  # no subject, reason
    out = screened(delivery(bogus, SUBJECTS.deadletter("billing"), 5, 1.7e9), "t")
    assert out.envelope.type == EventType.BUS_DEAD_LETTER and out.envelope.producer == "billing"
    assert out.subject == SUBJECTS.deadletter("billing")


@pytest.mark.parametrize("sender", ["ops", "replay-driver", f"agent-{C1}"])
def test_a_security_record_from_a_non_refusing_sender_is_its_dead_letter_not_an_agents_security_event(sender) -> None:
    """Issue 14 item 2: ``ops`` (or anyone but a refusing service) names an agent's subject and
    stream sequence 4242: stored as a ``bus.dead_letter`` of the sender, never under the id a
    real refusal of that message gets."""
    forged = _forged(4242)
    payload = SecurityRejected(consumer="scheduler-events", subject=forged.subject, sender=f"agent/{R}/{C1}",
                               event_type="job.finished", stream_sequence=4242, reason="made up")
    env = make_event("security.rejected_message", payload, producer="scheduler", occurred_at=1.7e9,
                     event_id=security_event_id(forged.subject, 4242, forged.envelope.event_id), region=R, cluster=C1)
    out = screened(delivery(env, SUBJECTS.deadletter(sender), 3, 1.7e9), "t")
    assert out.envelope.type == EventType.BUS_DEAD_LETTER
    assert (out.envelope.producer, out.envelope.cluster, out.subject) == (sender, "", SUBJECTS.deadletter(sender))
    assert _key(out) != _key(refused(forged, "t", "x"))
    # the same record from a refusing service is that message's security event
    real = screened(delivery(env, SUBJECTS.deadletter("scheduler-events"), 4, 1.7e9), "t")
    assert real.envelope.type == EventType.SECURITY_REJECTED_MESSAGE and _key(real) == _key(refused(forged, "t", "x"))


@pytest.mark.parametrize(("subject", "etype"), [
    (SUBJECTS.decisions("nlp", "train"), "job.cancel_requested"),
    (SUBJECTS.deadletter("ops"), "job.cancel_requested"),
    (SUBJECTS.usage("nlp"), "job.submitted"),
    (SUBJECTS.job("cancel", "nlp", "train"), "job.submitted"),
    (SUBJECTS.placements(R, C1), "job.cancelled"),
])
def test_a_type_that_does_not_belong_on_a_services_subject_is_refused(subject, etype) -> None:
    """Issue 14 item 1b: a service's credentials cover a subject family, not a type."""
    from fedsched.trust import check_subject

    env = make_event("job.finished", JobStatus(), producer="admission", occurred_at=1.7e9, tenant="nlp",
                     project="train", job_id="j-1").model_copy(update={"type": etype})  # (the check reads the type)
    assert check_subject("t", subject, env) is not None
    right = {"job.cancel_requested": SUBJECTS.job("cancel", "nlp", "train"),
             "job.submitted": SUBJECTS.job("submitted", "nlp", "train"),
             "job.cancelled": SUBJECTS.decisions("nlp", "train")}[etype]
    assert check_subject("t", right, env) is None
    if "deadletter" not in subject:  # audit stores it as a refusal, not as the event it claims to be
        assert screened(delivery(env, subject, 9, 1.7e9), "t").envelope.type == EventType.SECURITY_REJECTED_MESSAGE
