"""An envelope made by :func:`fedsched.events.make_event` carries the payload model it was made
from: a reader in the same process takes it without validating the payload dict again, and it
equals what validating that dict gives (issue 15)."""

from __future__ import annotations

from fedsched.events import Envelope, JobPlaced, JobStatus, JobSubmitted
from tests.builders import placement, status_event, submitted
from tests.builders import spec as make_spec


def _events():
    job = make_spec()
    sub = submitted("j-1", job, 1000.0)
    placed = placement("j-1", job, "cn-north-1-c1", "cn-north-1", [("n1", (0, 1))], at=1001.0, fencing_token=3)
    started = status_event("job.started", placed, 1002.0, started_at=1002.0)
    return [(sub, JobSubmitted), (placed, JobPlaced), (started, JobStatus)]


def test_a_made_envelope_hands_back_its_own_payload_model_equal_to_a_fresh_parse():
    for env, model in _events():
        cached = env.payload_as(model)
        assert cached is env.payload_as(model)
        assert cached == model.model_validate(env.payload)  # what a reader of the bytes would get
        assert Envelope.from_bytes(env.to_bytes()).payload_as(model) == cached


def test_a_copy_with_another_payload_parses_its_own():
    env, model = _events()[1]
    other = env.model_copy(update={"payload": {**env.payload, "fencing_token": 9}})
    assert other.payload_as(model).fencing_token == 9 and env.payload_as(model).fencing_token == 3
