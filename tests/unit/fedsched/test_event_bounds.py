"""Every number and time an event carries lies in what its column holds and what the system can
compute with: at the bound accepted, one past it refused with the field named (tryout findings:
attempt 2^32, cost "NaN"/"1e400"/"-Infinity", gpu_seconds 1e308/-1, occurred_at 9999-12-31)."""

from datetime import UTC, datetime

import orjson
import pydantic
import pytest

from fedsched.errors import DecodeError
from fedsched.events import Envelope, EventType, PAYLOADS, payload_error
from fedsched.jobs import JobSpec

_ENV = dict(event_id="0" * 32, type="job.finished", occurred_at="2023-01-01T00:00:00Z", producer="agent/c1")


def _env(**over) -> Envelope:
    return Envelope.model_validate({**_ENV, **over})


def _decode(**over) -> Envelope:
    """Decode the wire form of an envelope with ``over`` (as a producer could send it)."""
    return Envelope.from_bytes(orjson.dumps({**_ENV, **over}))



@pytest.mark.parametrize(("field", "ok", "bad"), [
    ("attempt", 2 ** 32 - 1, 2 ** 32),
    ("attempt", 0, -1),
    ("schema_version", 0, -1),
    ("occurred_at", "2199-12-31T23:59:59.999Z", "2200-01-01T00:00:00Z"),
    ("occurred_at", "1970-01-01T00:00:00Z", "1969-12-31T23:59:59Z"),
])
def test_envelope_fields_at_their_bound_decode_and_past_it_are_refused_naming_the_field(field, ok, bad):
    assert getattr(_decode(**{field: ok}), field) is not None
    with pytest.raises(DecodeError, match=f"not a valid envelope: {field}: "):
        _decode(**{field: bad})


def test_a_job_finished_in_the_year_9999_is_refused_at_decode():
    """Tryout: it reached billing, which failed with ``year 10000 is out of range``."""
    with pytest.raises(DecodeError, match="occurred_at: .*outside the supported time range"):
        _decode(occurred_at="9999-12-31T23:59:59Z")


def _payload_error(type_: EventType, payload: dict) -> str | None:
    return payload_error(_env(type=type_.value, payload=payload))


_USAGE = {"gpu_seconds": 60.0, "cost": "1"}
_STATUS: dict = {}
_NODE = {"name": "n1"}

# (event type, base payload, field path to set, value at the bound, value past it)
CASES = [
    (EventType.USAGE_RECORDED, _USAGE, "cost", "999999999999.999999", "1000000000000"),
    (EventType.USAGE_RECORDED, _USAGE, "cost", "0", "-0.000001"),
    (EventType.USAGE_RECORDED, _USAGE, "cost", "0.000001", "0.0000001"),
    (EventType.USAGE_RECORDED, _USAGE, "cost", "1", "NaN"),
    (EventType.USAGE_RECORDED, _USAGE, "cost", "1", "1e400"),
    (EventType.USAGE_RECORDED, _USAGE, "cost", "1", "-Infinity"),
    (EventType.USAGE_RECORDED, _USAGE, "gpu_seconds", 2e15, 1e308),
    (EventType.USAGE_RECORDED, _USAGE, "gpu_seconds", 0.0, -1.0),
    (EventType.USAGE_RECORDED, _USAGE, "gpu_seconds", 1.0, float("nan")),
    (EventType.JOB_FINISHED, _STATUS, "shard", 2 ** 32 - 1, 2 ** 32),
    (EventType.JOB_FINISHED, _STATUS, "exit_code", -(2 ** 31), -(2 ** 31) - 1),
    (EventType.JOB_FINISHED, _STATUS, "exit_code", 2 ** 31 - 1, 2 ** 31),
    (EventType.JOB_FINISHED, _STATUS, "gpu_milli", 2 ** 32 - 1, 2 ** 32),
    (EventType.JOB_FINISHED, _STATUS, "cpu_milli", 0, -1),
    (EventType.JOB_FINISHED, _STATUS, "progress_s", 7.3e9, float("inf")),
    (EventType.JOB_FINISHED, _STATUS, "progress_s", 0.0, -1.0),
    (EventType.JOB_FINISHED, _STATUS, "started_at", "2199-12-31T00:00:00Z", "9999-12-31T23:59:59Z"),
    (EventType.JOB_STOP, {"reason": "preempted"}, "checkpoint_interval_s", 1.0, float("inf")),
    (EventType.JOB_STOP, {"reason": "preempted"}, "fencing_token", 2 ** 63 - 1, -1),
    (EventType.JOB_PENDING, {"reason": "r"}, "shard", 0, -1),
    (EventType.JOB_PENDING, {"reason": "r"}, "reserved_from", "1970-01-01T00:00:00Z", "1969-01-01T00:00:00Z"),
    (EventType.INVENTORY_HEARTBEAT, {}, "running_jobs", 2 ** 32 - 1, 2 ** 32),
    (EventType.INVENTORY_HEARTBEAT, {}, "gpu_milli_free", 2 ** 63 - 1, -5),
    (EventType.INVENTORY_SNAPSHOT, {"nodes": [_NODE]}, "sequence", 2 ** 63 - 1, -1),
    (EventType.AGENT_RECONCILED, {"reason": "lost"}, "shard", 2 ** 32 - 1, 2 ** 32),
    (EventType.SECURITY_REJECTED_MESSAGE, {"consumer": "c", "subject": "s", "reason": "r"}, "attempt",
     2 ** 32 - 1, 2 ** 32),
    (EventType.BUS_DEAD_LETTER, {"consumer": "c", "subject": "s", "reason": "r"}, "deliveries", 0, -1),
    (EventType.APPROVAL_REQUESTED, {"approval_id": "ap-1", "home_region": "r", "proposed_region": "r2",
                                    "proposed_cluster": "c", "expires_at": "2023-01-01T00:00:00Z"},
     "cost", "", "NaN"),
    (EventType.APPROVAL_REQUESTED, {"approval_id": "ap-1", "home_region": "r", "proposed_region": "r2",
                                    "proposed_cluster": "c", "expires_at": "2023-01-01T00:00:00Z"},
     "estimated_wait_s", 0.0, float("-inf")),
    (EventType.APPROVAL_REQUESTED, {"approval_id": "ap-1", "home_region": "r", "proposed_region": "r2",
                                    "proposed_cluster": "c", "expires_at": "2023-01-01T00:00:00Z"},
     "expires_at", "2199-01-01T00:00:00Z", "2200-01-01T00:00:00Z"),
]


@pytest.mark.parametrize(("type_", "base", "field", "ok", "bad"), CASES,
                         ids=[f"{t.value}.{f}={b!r}" for t, _, f, _, b in CASES])
def test_payload_fields_at_their_bound_are_accepted_and_past_it_refused_naming_the_field(type_, base, field, ok,
                                                                                         bad):
    assert _payload_error(type_, {**base, field: ok}) is None
    reason = _payload_error(type_, {**base, field: bad})
    assert reason is not None and reason.startswith(f"{type_.value} payload invalid: {field}: "), reason


def _placed(**binding) -> dict:
    spec = JobSpec(tenant="nlp", project="train", home_region="cn-north-1").model_dump(mode="json")
    return {"spec": spec, "bindings": [{"worker": 0, "node": "n", **binding}]}


@pytest.mark.parametrize(("field", "ok", "bad"), [("score", -1e300, float("nan")), ("transfer_s", 0.0, -0.5),
                                                  ("est_cost", 0.0, float("inf")), ("shard", 0, 2 ** 32),
                                                  ("transfer_bytes", 2 ** 63 - 1, -1),
                                                  ("price_per_gpu_hour", 1e12, 1e13)])
def test_placement_numbers_are_bounded(field, ok, bad):
    assert payload_error(_env(type="job.placed", payload={**_placed(), field: ok})) is None
    reason = payload_error(_env(type="job.placed", payload={**_placed(), field: bad}))
    assert reason is not None and reason.startswith(f"job.placed payload invalid: {field}: "), reason
    reason = payload_error(_env(type="job.placed", payload=_placed(gpu_milli=2 ** 32)))
    assert reason is not None and reason.startswith("job.placed payload invalid: bindings.0.gpu_milli: "), reason
    # the tryout's placement with a GPU index 1e30, and its snapshot with gpus = inf
    assert payload_error(_env(type="job.placed", payload=_placed(gpu_indices=[2 ** 32 - 1]))) is None
    reason = payload_error(_env(type="job.placed", payload=_placed(gpu_indices=[1e30])))
    assert reason is not None and reason.startswith("job.placed payload invalid: bindings.0.gpu_indices.0: "), reason
    reason = payload_error(_env(type="inventory.snapshot", payload={"nodes": [{"name": "n1", "gpus": float("inf")}]}))
    assert reason is not None and reason.startswith("inventory.snapshot payload invalid: nodes.0.gpus: "), reason


def test_a_job_spec_deadline_past_the_range_and_non_finite_floats_are_refused():
    base = dict(tenant="nlp", project="train", home_region="cn-north-1")
    assert JobSpec(**base, start_deadline=datetime(2199, 12, 31, tzinfo=UTC)).start_deadline.year == 2199
    for field, bad in (("start_deadline", "9999-12-31T00:00:00Z"), ("max_price_per_gpu_hour", float("nan")),
                       ("estimated_duration_s", float("nan"))):
        with pytest.raises(pydantic.ValidationError, match=field):
            JobSpec.model_validate({**base, field: bad})


def test_every_payload_model_is_registered():
    """The bounds above are on the registry's models (a new payload type gets its own cases)."""
    assert set(PAYLOADS) == set(EventType)
