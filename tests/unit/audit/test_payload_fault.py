"""Audit's payload check (:func:`services.audit.service.payload_fault`) is
:func:`fedsched.events.payload_error` -- the same verdict and words for every type -- but keeps
the parsed model with the envelope only for the types read again in the store process."""

from __future__ import annotations

import pytest

from fedsched.events import PAYLOADS, Envelope, EventType, payload_error
from services.audit.service import READ_AGAIN, payload_fault

PAYLOADS_TRIED = [
    {},
    {"spec": {"tenant": "nlp", "project": "train", "home_region": "cn-north-1", "kind": "training"},
     "request_id": "r-1", "submitted_by": "me"},
    {"spec": {"tenant": "nlp", "project": "train"}, "request_id": 5},
    {"gpu_seconds": 60.0, "cost": "0.1"},
    {"gpu_seconds": "many", "cost": "0.1"},
    {"card_model": "nvidia-t4-16gb", "gpu_milli": 1000},
    {"gpu_milli": -1},
    {"consumer": "x", "subject": "t.a", "reason": "r"},
]


def _env(event_type: str, payload: dict) -> Envelope:
    return Envelope(event_id="a" * 32, type=event_type, occurred_at=1.7e9, producer="p", payload=payload)


@pytest.mark.parametrize("event_type", sorted(t.value for t in PAYLOADS) + ["job.future_thing"])
@pytest.mark.parametrize("payload", PAYLOADS_TRIED, ids=range(len(PAYLOADS_TRIED)))
def test_the_verdict_is_payload_errors(event_type, payload) -> None:
    assert payload_fault(_env(event_type, payload)) == payload_error(_env(event_type, payload))


def test_only_the_types_read_again_keep_their_parse() -> None:
    submitted = _env("job.submitted", PAYLOADS_TRIED[1])
    assert payload_fault(submitted) is None
    assert "_payload_cache" not in submitted.__dict__  # validated, then dropped
    started = _env("job.started", PAYLOADS_TRIED[5])
    assert EventType.JOB_STARTED in READ_AGAIN and payload_fault(started) is None
    assert "_payload_cache" in started.__dict__  # kept for the status screening and billing
