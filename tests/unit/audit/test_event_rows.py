"""The ``events`` row's payload column is the payload as JSON (orjson on the hot path, issue 15),
the same JSON value ``json.dumps`` wrote before, whatever the payload holds."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from fedsched.events import Subjects, make_event
from fedsched.events import JobStatus
from services.audit.service import EVENT_COLUMNS, event_row, to_json
from tests.builders import delivery


@pytest.mark.parametrize("value", [
    {"a": 1, "b": [1.5, "x"], "c": None, "d": True},
    {"text": "中文 and ascii", "nested": {"k": [{"x": -3}]}},
    {"big": 2 ** 70},                      # beyond 64 bits: written by json.dumps
    {"lone": "\ud800"},                    # a lone surrogate: written by json.dumps
    ({"cluster": "c", "scores": {"home": 1.0}},),
], ids=["plain", "unicode", "big-int", "surrogate", "tuple"])
def test_to_json_is_the_json_value_json_dumps_wrote(value) -> None:
    assert json.loads(to_json(value)) == json.loads(json.dumps(value, default=str))


def test_to_json_writes_other_values_as_their_str() -> None:
    when = datetime(2026, 12, 1, 3, 4, 5, tzinfo=UTC)
    assert json.loads(to_json({"at": when, "cost": Decimal("1.20")})) == {"at": str(when), "cost": "1.20"}


def test_the_event_row_holds_the_payload_and_the_routing_names() -> None:
    subjects = Subjects("t")
    env = make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000), producer="agent/c1",
                     occurred_at=1.7e9, region="cn-north-1", cluster="c1", tenant="nlp", project="p", job_id="j1",
                     attempt=2)
    row = dict(zip(EVENT_COLUMNS, event_row(delivery(env, subjects.status("cn-north-1", "c1"), 7, 1.7e9))))
    assert json.loads(row["payload"]) == env.payload
    assert (row["event_id"], row["type"], row["job_id"], row["attempt"], row["subject"]) == (
        env.event_id, "job.started", "j1", 2, "t.status.cn-north-1.c1")
    assert row["occurred_at"] == datetime.fromtimestamp(1.7e9, UTC) and row["occurred_at"].tzinfo is UTC


@pytest.mark.parametrize("value", [
    {"score": float("nan")},
    {"nested": [1, {"x": float("inf")}]},
    ({"s": -float("inf")},),
    {"big": 2 ** 70, "score": float("nan")},     # the json.dumps path refuses it too
    {"lone": "\ud800", "score": float("nan")},
], ids=["nan", "nested-inf", "tuple-minus-inf", "big-int-path", "surrogate-path"])
def test_a_non_finite_float_is_refused_never_stored_as_null(value) -> None:
    with pytest.raises(ValueError):
        to_json(value)


def test_a_payload_with_nulls_and_finite_floats_is_written_exactly() -> None:
    value = {"a": None, "b": [None, 1.5, -0.0, 1e308], "c": {"d": None}}
    assert json.loads(to_json(value)) == value


class _Msg:
    """A stream message's bytes (what :class:`~fedsched.bus.Delivery` keeps as ``msg``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _started(payload: dict):
    from fedsched.events import Envelope

    env = make_event("job.started", JobStatus(card_model="nvidia-t4-16gb", gpu_milli=1000), producer="agent/c1",
                     occurred_at=1.7e9, region="cn-north-1", cluster="c1", job_id="j1", attempt=1)
    return Envelope.model_construct(**{**env.model_dump(), "payload": payload})


def test_a_payload_the_message_says_verbatim_is_stored_as_it_says() -> None:
    """The payload's JSON found in the message's own bytes is what the message says (standard
    JSON: no look for non-finite floats needed); the same payload without its message is looked
    through, and a NaN in it refused."""
    from fedsched.bus import Delivery

    subject = Subjects("t").status("cn-north-1", "c1")
    clean = _started({"a": None, "b": [1.5, 2]})
    wire = clean.to_bytes()
    row = dict(zip(EVENT_COLUMNS, event_row(Delivery(clean, subject, {}, 1, 1, _Msg(wire)))))
    assert json.loads(row["payload"]) == {"a": None, "b": [1.5, 2]}
    # a value built in this process with a NaN, whose message says null there: stored as the message says
    built = _started({"a": None, "b": [float("nan"), 2]})
    said = _started({"a": None, "b": [None, 2]}).to_bytes()
    row = dict(zip(EVENT_COLUMNS, event_row(Delivery(built, subject, {}, 1, 1, _Msg(said)))))
    assert json.loads(row["payload"]) == {"a": None, "b": [None, 2]}
    # without its message (or with a message that does not say it) the NaN is refused, never written as null
    with pytest.raises(ValueError):
        event_row(Delivery(built, subject, {}, 1, 1))
    with pytest.raises(ValueError):
        event_row(Delivery(built, subject, {}, 1, 1, _Msg(wire)))
