"""Admission's size limits (issue 14 item 6): every repeated field and the whole spec, each at
its limit accepted and one over refused with INVALID_ARGUMENT naming the field and the count."""

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import PayloadTooLargeError, ValidationError
from services.admission.convert import MAX_NAME_CHARS, Limits, spec_from_pb

LIMITS = Limits()


def _spec(**kw) -> pb.JobSpec:
    msg = pb.JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1, cpu_milli=1000,
                     estimated_duration_seconds=60.0)
    for k, v in kw.items():
        if isinstance(v, dict):
            getattr(msg, k).update(v)
        elif isinstance(v, list):
            getattr(msg, k).extend(v)
        else:
            setattr(msg, k, v)
    return msg


def regions(n: int) -> list[str]:
    return [f"cn-r{i}" for i in range(n)]


#: (id, field, spec builder taking a count, the limit)
COUNTED = [
    ("card models", "spec.card_models", lambda n: _spec(card_models=["A100"] * n), LIMITS.max_card_models),
    ("allowed regions", "spec.allowed_regions", lambda n: _spec(allowed_regions=regions(n)), LIMITS.max_regions),
    ("forbidden regions", "spec.forbidden_regions", lambda n: _spec(forbidden_regions=regions(n)),
     LIMITS.max_regions),
    ("residency tags", "spec.residency_tags", lambda n: _spec(residency_tags=[f"tag-{i}" for i in range(n)]),
     LIMITS.max_residency_tags),
    ("datasets", "spec.datasets",
     lambda n: _spec(datasets=[pb.Dataset(name=f"d{i}", home_region="cn-north-1") for i in range(n)]),
     LIMITS.max_datasets),
    ("annotations", "spec.annotations", lambda n: _spec(annotations={f"k{i}": "v" for i in range(n)}),
     LIMITS.max_annotations),
    ("annotation key characters", "spec.annotations", lambda n: _spec(annotations={"k" * n: "v"}),
     LIMITS.max_annotation_key),
    ("annotation value characters", "spec.annotations[k]", lambda n: _spec(annotations={"k": "v" * n}),
     LIMITS.max_annotation_value),
    ("name characters", "spec.name", lambda n: _spec(name="n" * n), MAX_NAME_CHARS),
]


@pytest.mark.parametrize("name,field,build,limit", COUNTED, ids=[c[0] for c in COUNTED])
def test_at_the_limit_is_accepted_and_one_over_is_refused_naming_the_field(name, field, build, limit):
    spec_from_pb(build(limit), limits=LIMITS, default_home=None)
    with pytest.raises(ValidationError) as e:
        spec_from_pb(build(limit + 1), limits=LIMITS, default_home=None)
    assert e.value.field == field
    assert str(limit + 1) in e.value.reason and str(limit) in e.value.reason


def test_the_issues_250000_allowed_regions_are_refused_before_any_is_looked_at():
    msg = _spec(allowed_regions=["not a region"] * 250_000)
    with pytest.raises(ValidationError) as e:
        spec_from_pb(msg, limits=LIMITS, default_home=None)
    assert str(e.value) == "spec.allowed_regions: at most 64 entries (got 250000)"


def _padded(total: int) -> pb.JobSpec:
    """A valid spec of about ``total`` protobuf bytes (padding in annotation values)."""
    msg = _spec(annotations={f"k{i}": "" for i in range(40)})
    while (left := total - msg.ByteSize()) > 0:
        key = next(k for k in sorted(msg.annotations) if len(msg.annotations[k]) < LIMITS.max_annotation_value)
        msg.annotations[key] += "v" * min(left, LIMITS.max_annotation_value - len(msg.annotations[key]))
    return msg


def test_the_whole_encoded_spec_at_the_limit_is_accepted_and_one_byte_over_is_refused():
    msg = _padded(28 * 1024)
    wire = msg.ByteSize()
    json_size = len(spec_from_pb(msg, limits=LIMITS, default_home=None).model_dump_json().encode())
    at = max(wire, json_size)  # the spec is checked as received and as the bus carries it
    spec_from_pb(msg, limits=Limits(max_spec_bytes=at), default_home=None)
    with pytest.raises(ValidationError) as e:
        spec_from_pb(msg, limits=Limits(max_spec_bytes=at - 1), default_home=None)
    assert e.value.field == "spec" and f"(got {at})" in e.value.reason
    with pytest.raises(ValidationError) as e:  # the wire size is checked before anything is converted
        spec_from_pb(msg, limits=Limits(max_spec_bytes=wire - 1), default_home=None)
    assert e.value.field == "spec" and e.value.reason == f"at most {wire - 1} bytes encoded (got {wire})"


def test_a_spec_small_on_the_wire_but_large_as_the_bus_carries_it_is_refused():
    """Control characters take 1 byte in protobuf and 6 in JSON (``\\u0001``)."""
    msg = _spec(annotations={f"k{i}": "\x01" * LIMITS.max_annotation_value for i in range(LIMITS.max_annotations)})
    assert msg.ByteSize() < LIMITS.max_spec_bytes
    with pytest.raises(ValidationError) as e:
        spec_from_pb(msg, limits=LIMITS, default_home=None)
    assert e.value.field == "spec" and "as the bus carries it" in e.value.reason


def test_the_largest_spec_the_limits_allow_keeps_far_below_natss_default_max_payload():
    """Every repeated field at its limit except where the whole-spec cap stops first: the
    spec's JSON stays <= 128 KiB, an eighth of NATS's default max_payload (1 MB)."""
    msg = _spec(name="n" * MAX_NAME_CHARS, card_models=["A100"] * LIMITS.max_card_models,
                allowed_regions=regions(LIMITS.max_regions),
                residency_tags=[f"t{i:031d}" for i in range(LIMITS.max_residency_tags)],
                datasets=[pb.Dataset(name=f"d{i:0250d}", home_region="cn-north-1") for i in range(LIMITS.max_datasets)],
                annotations={f"{i:0128d}": "v" * 900 for i in range(LIMITS.max_annotations)})
    spec = spec_from_pb(msg, limits=LIMITS, default_home=None)
    assert len(spec.model_dump_json()) <= LIMITS.max_spec_bytes <= 1_000_000 // 7


def test_an_event_the_bus_cannot_carry_is_invalid_argument_never_internal():
    import grpc

    from services.admission.service import status_for

    error = PayloadTooLargeError("t.governance.policy", "e1", "policy.applied", 2_000_000, 1_048_576)
    assert status_for(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert "2000000 bytes" in error.message and "1048576" in error.message
