"""Ended jobs leave admission's job view and are served from the ended-jobs read model
(issue 15 item 2, issue 14 item 8): with 10,000 jobs finished, the :class:`JobRecord` objects
alive stay bounded by the open jobs plus ``retain_ended``; a job that left is still found with
its state and attempts (from the archive's pending records, and through a real NATS KV bucket);
a late status of it is ignored, a status of an attempt it never had refused."""

from __future__ import annotations

import gc
import itertools

import pytest

from fedsched.errors import DecodeError
from fedsched.events import Envelope, JobPlaced, JobStatus, JobSubmitted, WorkerBinding, make_event
from fedsched.jobs import AttemptState, JobSpec, JobState
from services.admission.ended import EndedJobs, decode_record, encode_record
from services.admission.jobview import JobRecord, JobView, PlacedFields, ShardRecord
from tests.builders import delivery, placement, submitted
from tests.builders import spec as make_spec

T0 = 1_700_000_000.0
SPEC = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)
RETAIN = 200
JOBS = 10_000
OPEN = 50


def _ev(type_, payload, job_id, at, **kw):
    return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train",
                      job_id=job_id, region="cn-north-1", **kw)


def _submit(view: JobView, job_id: str, at: float) -> None:
    view.apply(_ev("job.submitted", JobSubmitted(spec=SPEC, submitted_by="alice", request_id=f"r-{job_id}"),
                   job_id, at, actor="alice"))


def _run(view: JobView, job_id: str, at: float, *, finish: bool = True) -> None:
    view.apply(_ev("job.placed", JobPlaced(spec=SPEC, bindings=(WorkerBinding(worker=0, node="n0"),)), job_id, at,
                   attempt=1, cluster="c1"))
    view.apply(_ev("job.started", JobStatus(), job_id, at + 1, attempt=1, cluster="c1"))
    if finish:
        view.apply(_ev("job.finished", JobStatus(), job_id, at + 60, attempt=1, cluster="c1"))


def _alive(cls) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)


def test_job_records_stay_bounded_while_10000_jobs_finish():
    archive = EndedJobs(None)
    view = JobView(retain_ended=RETAIN, archive=archive.put)
    base = _alive(JobRecord)
    for i in range(OPEN):
        _submit(view, f"open{i}", T0)
        _run(view, f"open{i}", T0, finish=False)
    peak = 0
    for i in range(JOBS):
        _submit(view, f"j{i}", T0 + i)
        _run(view, f"j{i}", T0 + i)
        if i % 2500 == 2499:
            peak = max(peak, _alive(JobRecord) - base)
    assert peak <= OPEN + RETAIN + 1
    assert len(view.jobs) == OPEN + RETAIN
    assert len(view.by_submitted) == OPEN + RETAIN and len(view.by_request) == OPEN + RETAIN
    assert sum(len(ids) for ids in view.open_by_tenant.values()) == OPEN
    assert view.by_state[JobState.SUCCEEDED] == JOBS  # counted as ever seen
    assert len(archive.pending) == JOBS - RETAIN  # handed over (no bus here: pending)
    assert len(view.tombstones) == JOBS - RETAIN


async def test_an_ended_job_that_left_the_view_is_found_with_its_state_and_attempts():
    archive = EndedJobs(None)
    view = JobView(retain_ended=1, archive=archive.put)
    _submit(view, "old", T0)
    _run(view, "old", T0)
    _submit(view, "new", T0 + 100)
    _run(view, "new", T0 + 100)
    assert "old" not in view.jobs and "new" in view.jobs
    rec = await archive.get("old")
    assert rec is not None and rec.state == JobState.SUCCEEDED and rec.ended_at == T0 + 60
    (att,) = rec.attempts
    assert (att.attempt, att.cluster, att.outcome, att.started_at) == (1, "c1", AttemptState.SUCCEEDED, T0 + 1)
    assert await archive.get("never") is None


def test_a_late_status_of_a_job_that_left_is_ignored_and_one_never_placed_is_refused():
    view = JobView(retain_ended=1)
    for job_id in ("old", "new"):
        _submit(view, job_id, T0)
        _run(view, job_id, T0)
    late = _ev("job.finished", JobStatus(), "old", T0 + 60, attempt=1, cluster="c1")
    view.apply_delivery(delivery(late, "t.status.cn-north-1.c1", 100, T0))
    assert not view.rejections
    forged = _ev("job.finished", JobStatus(), "old", T0 + 60, attempt=5, cluster="c1")
    view.apply_delivery(delivery(forged, "t.status.cn-north-1.c1", 101, T0))
    assert len(view.rejections) == 1 and "never placed" in view.rejections[0].reason
    _submit(view, "old", T0)  # a redelivered submit does not bring it back
    assert "old" not in view.jobs


def test_a_corrupt_or_newer_record_is_refused():
    view = JobView()
    _submit(view, "x", T0)
    data = encode_record(view.jobs["x"])
    assert decode_record(data).spec == SPEC
    for bad in (b"junk", data[:-3]):
        try:
            decode_record(bad)
        except ValueError:
            continue
        raise AssertionError("decoded a corrupt record")


async def test_ended_jobs_round_trip_through_the_kv_bucket(bus):
    archive = EndedJobs(bus)
    view = JobView(retain_ended=1, archive=archive.put)
    for job_id in ("j-aaaaaaaaaaaaaaaaaaaa", "j-bbbbbbbbbbbbbbbbbbbb"):
        _submit(view, job_id, T0)
        _run(view, job_id, T0)
    assert await archive.flush() == 0 and archive.written == 1
    fresh = EndedJobs(bus)  # another admission (or this one after a restart)
    rec = await fresh.get("j-aaaaaaaaaaaaaaaaaaaa")
    assert rec is not None and rec.state == JobState.SUCCEEDED and rec.attempts[0].cluster == "c1"
    assert await fresh.get("j-cccccccccccccccccccc") is None
    assert await fresh.get("not a key!") is None


def test_a_one_shard_jobs_state_follows_the_same_rules_as_a_job_of_several_shards():
    """JobRecord.state has a fast path for one shard (issue 15: it is read several times per
    event); it must say what the general rule says of a job whose shards all have that state."""
    job = make_spec()
    for state, held, cancel_requested, cancelled in itertools.product(JobState, *[(False, True)] * 3):
        flags = dict(held=held, cancel_requested=cancel_requested, cancelled=cancelled)
        one = JobRecord("j-1", job, 0.0, "u", "", shards=[ShardRecord(0, state)], **flags)
        two = JobRecord("j-2", job, 0.0, "u", "", shards=[ShardRecord(0, state), ShardRecord(1, state)], **flags)
        assert one.state == two.state, (state, flags)


def test_a_placement_with_a_null_spec_or_bindings_not_a_list_does_not_mark_the_job_placed():
    """Stop-12 review: ``{"spec": null, "bindings": 5}`` passed the view's check while every
    other reader refuses it; it is a decode error (dead-lettered by the bus) and the job stays
    queued."""
    job = make_spec()
    view = JobView()
    view.apply(submitted("j-1", job, 1000.0))
    wire = Envelope.from_bytes(placement("j-1", job, "cn-north-1-c1", "cn-north-1", [("n1", (0,))], at=1001.0,
                                         fencing_token=3).to_bytes())
    with pytest.raises(DecodeError):
        view.apply(wire.model_copy(update={"payload": {**wire.payload, "spec": None, "bindings": 5}}))
    assert view.jobs["j-1"].state == JobState.QUEUED


def test_the_view_folds_a_placement_reading_only_its_own_fields_and_still_refuses_a_malformed_one():
    """Issue 15: a ``job.placed`` read from the stream is folded with the few fields the view
    keeps (:class:`PlacedFields`), not the full ``JobPlaced`` with its spec and bindings; a
    payload without bindings, with a negative fencing token or an evaluation that is not an
    object, is still not one."""
    job = make_spec()
    view = JobView()
    view.apply(submitted("j-1", job, 1000.0))
    wire = Envelope.from_bytes(placement("j-1", job, "cn-north-1-c1", "cn-north-1", [("n1", (0,))], at=1001.0,
                                         fencing_token=3).to_bytes())
    view.apply(wire)
    assert view.jobs["j-1"].state == JobState.PLACED and view.highest_token == 3
    parsed = wire.__dict__["_payload_cache"][1]
    assert PlacedFields in parsed and JobPlaced not in parsed  # the spec was not validated again
    for broken in ({k: v for k, v in wire.payload.items() if k != "bindings"}, {**wire.payload, "fencing_token": -1},
                   {**wire.payload, "evaluations": [{"cluster": "c1"}, "not an object"]},
                   {**wire.payload, "spec": None}, {**wire.payload, "spec": "a spec"}, {**wire.payload, "bindings": 5},
                   {**wire.payload, "bindings": []}, {**wire.payload, "bindings": [{"worker": 0}, "n1"]}):
        with pytest.raises(DecodeError):
            wire.model_copy(update={"payload": broken}).payload_as(PlacedFields)
