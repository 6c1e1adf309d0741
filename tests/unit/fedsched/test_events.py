"""The event envelope: strict decoding, deterministic ids, subjects from validated names."""

import time

import pytest

from fedsched.errors import DecodeError, EventTypeError, InvalidName
from fedsched.events import (JOB_STATUSES, PAYLOADS, TERMINAL_STATUSES, Envelope, EventType, JobStatus, JobStop,
                             Subjects, business_event_id, make_event)


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
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "Job Teleported!", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x"}', "not a valid envelope"),
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x", "schema_version": 2}', "newer than this reader"),
    (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
     b'"producer": "x", "surprise": 1}', "not a valid envelope"),
])
def test_bad_messages_raise_decode_error_with_reason(raw, why):
    with pytest.raises(DecodeError, match=why):
        Envelope.from_bytes(raw)


def test_an_unknown_but_well_formed_type_decodes_and_is_marked_unknown():
    raw = (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.teleported", "occurred_at": "2023-01-01T00:00:00Z", '
           b'"producer": "x", "payload": {"to": "mars"}}')
    e = Envelope.from_bytes(raw)
    assert e.type == "job.teleported" and e.known_type is None and e.payload == {"to": "mars"}
    assert Envelope.from_bytes(_event().to_bytes()).known_type is EventType.JOB_STARTED


def _event():
    return make_event(EventType.JOB_STARTED, JobStatus(gpu_milli=500), producer="agent/x", occurred_at=1_700_000_000.5,
                      event_id=business_event_id("j-1", 1, 0, "started"), job_id="j-1", attempt=1)


def test_the_wire_form_of_an_enum_type_is_its_string():
    by_enum, by_string = _event(), make_event("job.started", JobStatus(gpu_milli=500), producer="agent/x",
                                              occurred_at=1_700_000_000.5, event_id=_event().event_id, job_id="j-1",
                                              attempt=1)
    assert by_enum.to_bytes() == by_string.to_bytes()
    assert b'"type":"job.started"' in by_enum.to_bytes() and type(by_enum.type) is str


@pytest.mark.parametrize("type_,payload,why", [
    ("job.submitted", JobStatus(), "payload must be JobSubmitted, not JobStatus"),
    (EventType.JOB_PLACED, JobStop(reason="cancelled"), "payload must be JobPlaced, not JobStop"),
    ("job.teleported", JobStatus(), "unknown event type"),
], ids=["string-type-wrong-payload", "enum-type-wrong-payload", "unknown-type"])
def test_make_event_refuses_a_payload_that_is_not_the_types_model(type_, payload, why):
    with pytest.raises(EventTypeError, match=why) as err:
        make_event(type_, payload, producer="x", occurred_at=time.time())
    assert err.value.event_type == str(type_)


def test_every_event_type_has_a_payload_model_and_every_status_is_classified():
    assert set(PAYLOADS) == set(EventType)
    # a new job status (JobStatus payload) must be declared started or terminal: consumers'
    # coverage checks (tests/unit/fedsched/test_event_dispatch.py) are built on TERMINAL_STATUSES
    statuses = {t for t, model in PAYLOADS.items() if model is JobStatus}
    assert statuses == JOB_STATUSES == TERMINAL_STATUSES | {EventType.JOB_STARTED}


def test_bad_payload_is_a_decode_error_not_a_crash():
    e = make_event("job.started", JobStatus(), producer="x", occurred_at=time.time())
    e = e.model_copy(update={"type": "job.submitted"})  # a producer that broke the contract
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


def test_keyed_message_ids_are_deterministic_and_unguessable_without_the_key():
    """Issue 14: an agent's Nats-Msg-Id is HMAC(key, subject + event id), so another agent cannot
    pre-empt it in JetStream's duplicate window; unkeyed connections keep the event id."""
    from fedsched.bus import Bus
    from fedsched.events import Heartbeat, make_event

    class _NC:
        def jetstream(self, **kw):
            return None

    bus = Bus(_NC(), "fed")
    e = make_event("inventory.heartbeat", Heartbeat(), producer="agent/x", occurred_at=1.7e9)
    assert bus.msg_id("fed.status.r.c", e) == e.event_id
    bus.msg_id_key = b"k1"
    keyed = bus.msg_id("fed.status.r.c", e)
    assert keyed == bus.msg_id("fed.status.r.c", e) and keyed != e.event_id and len(keyed) == 32
    assert keyed != bus.msg_id("fed.status.r.c2", e)
    bus.msg_id_key = b"k2"
    assert bus.msg_id("fed.status.r.c", e) != keyed


@pytest.mark.parametrize("type_,payload,error", [
    pytest.param("usage.recorded", {}, "usage.recorded payload invalid: gpu_seconds: Field required", id="usage-empty"),
    pytest.param("usage.recorded", {"gpu_seconds": 1.5, "cost": "0.2"}, None, id="usage-valid"),
    pytest.param("job.placed", {"shard": 0}, "job.placed payload invalid: spec: Field required", id="placed-no-spec"),
    pytest.param("inventory.heartbeat", {"sequence": "x"}, "inventory.heartbeat payload invalid: sequence: Input "
                 "should be a valid integer, unable to parse string as an integer", id="heartbeat-bad-field"),
    pytest.param("inventory.heartbeat", {}, None, id="heartbeat-defaults"),
    pytest.param("job.future_thing", {"anything": 1}, None, id="unknown-type-kept"),
])
def test_payload_error_is_one_rule_for_every_known_type(type_, payload, error):
    from datetime import UTC, datetime

    from fedsched.events import Envelope, payload_error
    env = Envelope(event_id="e" * 32, type=type_, occurred_at=datetime(2023, 3, 1, tzinfo=UTC), producer="x",
                   payload=payload)
    assert payload_error(env) == error


def test_a_payload_is_validated_once_per_envelope_and_a_copy_with_another_payload_parses_its_own(monkeypatch):
    """Issue 15: every reader of one decoded envelope in a process (audit and billing in the
    store, every service when embedded) gets the payload parsed once; the envelope is unchanged
    for comparison and on the wire; a copy with another payload is parsed afresh."""
    e = Envelope.from_bytes(make_event("job.started", JobStatus(gpu_milli=500, reason="r"), producer="x",
                                       occurred_at=1_700_000_000.0, job_id="j-1").to_bytes())
    wire = e.to_bytes()
    calls = []
    real = JobStatus.model_validate.__func__

    def counting(cls, obj, *a, **kw):
        calls.append(cls)
        return real(cls, obj, *a, **kw)

    monkeypatch.setattr(JobStatus, "model_validate", classmethod(counting))
    first = e.payload_as(JobStatus)
    assert e.payload_as(JobStatus) is first and len(calls) == 1
    assert e.to_bytes() == wire and e == Envelope.from_bytes(wire)
    other = e.model_copy(update={"payload": {**e.payload, "gpu_milli": 250}})
    assert other.payload_as(JobStatus).gpu_milli == 250 and e.payload_as(JobStatus).gpu_milli == 500
    assert len(calls) == 2
    from fedsched.events import JobSubmitted
    with pytest.raises(DecodeError):  # a failure is not kept: raised on every call
        e.payload_as(JobSubmitted)
    with pytest.raises(DecodeError):
        e.payload_as(JobSubmitted)


_GOOD = (b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00.25+02:00", '
         b'"producer": "agent/c\\u00e9", "attempt": %s, "payload": {"gpu_milli": 1.0e3, "reason": "caf\\u00e9 \\ud83d\\ude00",'
         b' "nested": [1, 2.5, null, true, {"k": "v"}]}}')


@pytest.mark.parametrize("raw", [
    _GOOD % b"2",
    _GOOD % b"2.0",  # a whole float for an int field: both parsers take it
    b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": 1700000000.5, "producer": "x"}',
], ids=["plain", "whole-float", "epoch-time"])
def test_decoding_with_orjson_gives_what_the_pydantic_json_parser_gives(raw):
    assert Envelope.from_bytes(raw) == Envelope.model_validate_json(raw)


@pytest.mark.parametrize("raw", [
    b"[1, 2]",
    b'"just a string"',
    b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "yesterday", "producer": "x"}',
    b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
    b'"producer": "x", "attempt": -1}',
    b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", '
    b'"producer": "x", "payload": [1]}',
    b'{"event_id": "' + b"0" * 32 + b'", "type": "job.started", "occurred_at": "2023-01-01T00:00:00Z", "producer": "x"',
    b"\xff\xfe",
], ids=["array", "string", "bad-time", "negative-attempt", "payload-not-object", "truncated", "not-utf8"])
def test_what_the_pydantic_json_parser_refuses_is_refused(raw):
    from pydantic import ValidationError as PydanticValidationError

    with pytest.raises(PydanticValidationError):
        Envelope.model_validate_json(raw)
    with pytest.raises(DecodeError, match="not a valid envelope"):
        Envelope.from_bytes(raw)


@pytest.mark.parametrize("raw, what", [
    (_GOOD.replace(b"1.0e3", b"NaN") % b"2", "unexpected character"),
    (_GOOD.replace(b"1.0e3", b"Infinity") % b"2", "unexpected character"),
    (_GOOD.replace(b"1.0e3", b"-Infinity") % b"2", "no digit after sign"),
    (_GOOD.replace(b"1.0e3", b"1e400") % b"2", "infinity"),
], ids=["nan", "infinity", "minus-infinity", "overflow"])
def test_what_is_not_standard_json_is_refused_though_the_pydantic_parser_takes_it(raw, what):
    """Audit stored such a payload value as null (orjson writes NaN so): refused at the door."""
    Envelope.model_validate_json(raw)  # pydantic's parser would take it
    with pytest.raises(DecodeError, match=f"not standard JSON: .*{what}"):
        Envelope.from_bytes(raw)


@pytest.mark.parametrize("escape", [b"\\ud83d", b"\\ude00"], ids=["high", "low"])
def test_a_lone_surrogate_is_refused_with_the_pydantic_parser_reason(escape):
    raw = _GOOD.replace(b"\\ud83d\\ude00", escape) % b"2"
    with pytest.raises(DecodeError, match="not a valid envelope: .*(surrogate|hex escape)"):
        Envelope.from_bytes(raw)


@pytest.mark.parametrize("literal", [str(2 ** 70), str(2 ** 64), str(-(2 ** 63) - 1), "1" * 30])
def test_an_integer_beyond_64_bits_is_refused_never_rounded(literal):
    """orjson would read such a literal as a rounded float: refused, in an int field or in an
    untyped payload value; no producer of ours writes one (every int is a count, a sequence or a size)."""
    with pytest.raises(DecodeError, match="not standard JSON: the integer .* is beyond 64 bits"):
        Envelope.from_bytes(_GOOD % literal.encode())
    with pytest.raises(DecodeError, match="not standard JSON: the integer .* is beyond 64 bits"):
        Envelope.from_bytes(_GOOD.replace(b"1.0e3", literal.encode()) % b"2")


def test_integers_within_64_bits_and_long_digit_strings_decode():
    # within 64 bits, the envelope's own bound applies (the events table's UInt32)
    assert Envelope.from_bytes(_GOOD % str(2 ** 32 - 1).encode()).attempt == 2 ** 32 - 1
    with pytest.raises(DecodeError, match="attempt"):
        Envelope.from_bytes(_GOOD % str(2 ** 63).encode())
    e = Envelope.from_bytes(_GOOD.replace(b"1.0e3", str(-(2 ** 63)).encode()).replace(b'"v"', b'"' + b"9" * 40 + b'"')
                            % b"2")
    assert e.payload["gpu_milli"] == -(2 ** 63) and e.payload["nested"][4]["k"] == "9" * 40


@pytest.mark.parametrize("parts", [("j-1", 1, 0, "started"), ("dead_letter", "agent-c1", "fed.status.r.c", 42),
                                   ("ünïcode", "名前", 0.5, None), ()])
def test_business_event_ids_are_the_version_5_uuids_of_the_key(parts):
    import uuid

    from fedsched.events import _EVENT_NS

    assert business_event_id(*parts) == uuid.uuid5(_EVENT_NS, "/".join(str(p) for p in parts)).hex
