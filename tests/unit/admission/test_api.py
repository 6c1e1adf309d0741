"""The API's forward-compatibility rule: every RPC is classified as mutating or read-only, and
the unknown-field walk finds fields at any depth (wire types per protobuf's encoding spec)."""

import pytest

from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.errors import ValidationError
from services.admission.convert import has_unknown_fields, refuse_unknown_fields
from services.admission.service import MUTATING, READ_ONLY


def test_every_rpc_is_either_mutating_or_read_only():
    methods = {f"{s.name}/{m.name}" for f in (pb.DESCRIPTOR, gpb.DESCRIPTOR)
               for s in f.services_by_name.values() for m in s.methods}
    assert MUTATING | READ_ONLY == methods and not MUTATING & READ_ONLY


CASES = [
    # (id, message type, bytes, field named or None = accepted)
    ("clean request", pb.SubmitJobRequest, pb.SubmitJobRequest(spec=pb.JobSpec(tenant="t")).SerializeToString(), None),
    ("double sent as 32-bit", pb.JobSpec, b"\xad\x01\x00\x00\x00\x00", "21"),  # field 21 max_price_per_gpu_hour
    ("packed repeated enum is not a wrong wire type", gpb.JobClass, b"\x12\x02\x01\x02", None),
    ("unknown group", pb.JobSpec, b"\xfb\x01\xfc\x01", "31"),
    ("unknown field in a repeated message", gpb.Tenant,
     b"\x3a" + bytes([len(m := gpb.JobClass(name="c").SerializeToString() + b"\x28\x01")]) + m, "job_classes[0].5"),
]


@pytest.mark.parametrize("name,kind,data,field", CASES, ids=[c[0] for c in CASES])
def test_unknown_and_mistyped_fields_are_named_by_path_and_number(name, kind, data, field):
    msg = kind.FromString(data)
    if field is None:
        refuse_unknown_fields(msg)
        return
    with pytest.raises(ValidationError) as e:
        refuse_unknown_fields(msg)
    assert e.value.field == field


@pytest.mark.parametrize("name,kind,data,field", CASES, ids=[c[0] for c in CASES])
def test_the_quick_check_finds_exactly_the_messages_the_walk_refuses(name, kind, data, field):
    msg = kind.FromString(data)
    assert has_unknown_fields(msg) == (field is not None)
    assert msg.SerializeToString() == data  # the request itself keeps what it carried


def test_an_unknown_field_deep_in_a_batch_item_is_found_and_named():
    spec = pb.JobSpec(tenant="t").SerializeToString() + b"\xf8\x01\x01"  # field 31, varint
    item = b"\x0a" + bytes([len(spec)]) + spec  # SubmitJobRequest.spec
    clean = pb.SubmitJobRequest(spec=pb.JobSpec(tenant="t")).SerializeToString()
    batch = pb.SubmitJobsRequest.FromString(b"".join(b"\x0a" + bytes([len(i)]) + i for i in (clean, item)))
    assert has_unknown_fields(batch)
    with pytest.raises(ValidationError) as e:
        refuse_unknown_fields(batch)
    assert e.value.field == "items[1].spec.31"
