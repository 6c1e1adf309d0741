"""The event envelope: strict decoding, deterministic ids, subjects from validated names."""

import time

import pytest

from fedsched.errors import DecodeError, InvalidName
from fedsched.events import Envelope, JobStatus, Subjects, business_event_id, make_event


def test_round_trip_and_deterministic_ids():
    e = make_event("job.started", JobStatus(gpu_milli=500), producer="agent/x", occurred_at=1_700_000_000.5,
                   event_id=business_event_id("j-1", 1, 0, "started"), job_id="j-1", attempt=1)
    back = Envelope.from_bytes(e.to_bytes())
    assert back == e
    assert back.occurred_at.tzinfo is not None and back.occurred_at.timestamp() == 1_700_000_000.5
    assert business_event_id("j-1", 1, 0, "started") == e.event_id != business_event_id("j-1", 2, 0, "started")


@pytest.mark.parametrize("raw,why", [
    (b"not json", "not a valid envelope"),
    (b'{"event_id": "abc"}', "not a valid envelope"),
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.teleported", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x"}', "unknown event type"),
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x", "schema_version": 2}', "newer than this reader"),
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x", "surprise": 1}', "not a valid envelope"),
])
def test_bad_messages_raise_decode_error_with_reason(raw, why):
    with pytest.raises(DecodeError, match=why):
        Envelope.from_bytes(raw)


def test_bad_payload_is_a_decode_error_not_a_crash():
    e = make_event("job.submitted", JobStatus(), producer="x", occurred_at=time.time())
    from fedsched.events import JobSubmitted
    with pytest.raises(DecodeError, match="payload invalid"):
        e.payload_as(JobSubmitted)
    tampered = e.model_copy(update={"payload": {"spec": {"tenant": "BAD!", "project": "p", "home_region": "cn-a-1"}}})
    with pytest.raises(DecodeError):
        tampered.payload_as(JobSubmitted)


def test_subjects_carry_routing_names_and_refuse_bad_tokens():
    s = Subjects("fed")
    assert s.inventory("cn-north-1", "cn-north-1-c1") == "fed.inventory.cn-north-1.cn-north-1-c1"
    assert s.placements("cn-east-1", "c2") == "fed.placements.cn-east-1.c2"
    assert s.job("submitted", "search", "train") == "fed.jobs.submitted.search.train"
    with pytest.raises(InvalidName):
        s.placements("cn-east-1", "c2.>")
    with pytest.raises(InvalidName):
        s.job("submitted", "se*", "train")
