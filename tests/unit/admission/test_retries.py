"""Idempotent retries and priority changes (review items 3, 4 and 7): a request_id retried after
its job ended and left memory answers "duplicate" with the archived job and publishes nothing;
a retry after the job's priority changed is still a duplicate; two concurrent SetJobPriority
calls publish two events and the view ends as the stream says; a publish acknowledged as a
duplicate is not applied locally but waited for."""

from __future__ import annotations

import asyncio
import hashlib
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsched import auth
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.errors import AlreadyExistsError, UnavailableError
from fedsched.events import EventType, JobStatus, JobSubmitted, Subjects, business_event_id, make_event
from fedsched.jobs import PriorityClass
from fedsched.policystore import PolicyHolder, StoredPolicy
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance
from services.admission.budgets import SpendBook
from services.admission.ended import EndedJobs
from services.admission.jobview import JobView
from services.admission.service import JobServicer, request_job_id
from tests.builders import FakeClock, FakePublisher, policy_doc, spec, submitted, until

T0 = 1_700_000_000.0
ROOT = Principal("root", (Grant(role="admin"),))


def _servicer(publisher, *, retain_ended: int = 10) -> JobServicer:
    holder = PolicyHolder()
    holder.set(StoredPolicy(Governance.of(policy_doc()), 1))
    ended = EndedJobs(None)
    view = JobView(retain_ended=retain_ended, archive=ended.put)
    servicer = JobServicer(publisher, FakeClock(), holder, view, None, set(), set(), SpendBook(),
                           load_price_catalog(), subjects=Subjects("t"))
    servicer.ended = ended
    auth.CURRENT.set(ROOT)
    return servicer


def _request(rid: str) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant="search", project="train", gpus_per_worker=1, cpu_milli=1000),
                               request_id=rid)


async def _submit(servicer: JobServicer, request: pb.SubmitJobRequest) -> pb.SubmitJobResponse:
    admitted = servicer._admit(request, ROOT)
    return admitted if isinstance(admitted, pb.SubmitJobResponse) else await servicer._publish_one(admitted)


def _cancel(view: JobView, job_id: str) -> None:
    job = view.jobs[job_id].spec
    view.apply(make_event("job.cancelled", JobStatus(reason="cancelled"), producer="scheduler", occurred_at=T0 + 1,
                          tenant=job.tenant, project=job.project, job_id=job_id, actor="scheduler"))


def _submitted_events(publisher: FakePublisher) -> int:
    return sum(1 for p in publisher.published if p.event.type == "job.submitted")


async def _end_and_evict(servicer: JobServicer, job_id: str) -> None:
    _cancel(servicer.view, job_id)
    other = submitted("j-other", spec(), T0 + 2)
    servicer.view.apply(other)
    _cancel(servicer.view, "j-other")
    assert job_id not in servicer.view.jobs and job_id in servicer.view.tombstones


# ---------------------------------------------------------------------------- item 3

async def test_a_retry_after_the_job_left_memory_is_a_duplicate_of_the_archived_job():
    publisher = FakePublisher()
    publisher.seen_ids = set()
    servicer = _servicer(publisher, retain_ended=1)
    first = await _submit(servicer, _request("r1"))
    await _end_and_evict(servicer, first.job_id)
    publisher.seen_ids.clear()  # past JetStream's duplicate window: the bus would store it again
    again = await _submit(servicer, _request("r1"))
    assert (again.job_id, again.duplicate, again.state) == (first.job_id, True, pb.JOB_STATE_CANCELLED)
    assert _submitted_events(publisher) == 1  # no second job.submitted: no re-run


async def test_a_retry_whose_archived_record_cannot_be_read_is_unavailable_not_a_new_job():
    publisher = FakePublisher()
    servicer = _servicer(publisher, retain_ended=1)
    first = await _submit(servicer, _request("r1"))
    await _end_and_evict(servicer, first.job_id)
    servicer.ended.pending.clear()  # the store cannot give it now (a bus outage)
    publisher.seen_ids.clear()
    with pytest.raises(UnavailableError):
        await _submit(servicer, _request("r1"))
    assert _submitted_events(publisher) == 1


async def test_a_publish_the_view_ignores_answers_from_the_archive_not_keyerror():
    """The guard after apply: the job left memory between admission and the publish's ack."""
    publisher = FakePublisher()
    servicer = _servicer(publisher, retain_ended=1)
    first = await _submit(servicer, _request("r1"))
    await _end_and_evict(servicer, first.job_id)
    admitted = servicer._admit(_request("r2"), ROOT)
    resp = await servicer._publish_submission(admitted.gov, admitted.spec, "r1", ROOT, first.job_id)
    assert (resp.job_id, resp.duplicate) == (first.job_id, True)


# ---------------------------------------------------------------------------- item 7

async def test_a_retry_after_a_priority_change_is_still_a_duplicate():
    servicer = _servicer(FakePublisher())
    first = await _submit(servicer, _request("r1"))
    await servicer.SetJobPriority(pb.SetJobPriorityRequest(job_id=first.job_id, priority=pb.PRIORITY_CLASS_HIGH,
                                                           reason="deadline"), None)
    assert servicer.view.jobs[first.job_id].spec.priority == PriorityClass.HIGH
    again = await _submit(servicer, _request("r1"))
    assert (again.job_id, again.duplicate) == (first.job_id, True)


# ---------------------------------------------------------------------------- item 4

class _JetStreamLike:
    """Acknowledges publishes after ``gate`` opens, dropping a repeated event id as JetStream's
    duplicate window does (``ack.duplicate``); ``stored`` is the stream."""

    def __init__(self, *, always_duplicate: bool = False) -> None:
        self.subjects = Subjects("t")
        self.gate = asyncio.Event()
        self.stored: list = []
        self.asked = 0
        self.always_duplicate = always_duplicate

    async def publish(self, subject, event, *, headers=None):
        self.asked += 1
        await self.gate.wait()
        duplicate = self.always_duplicate or any(e.event_id == event.event_id for e in self.stored)
        if not duplicate or self.always_duplicate and not self.stored:
            self.stored.append(event)
        return SimpleNamespace(duplicate=duplicate, seq=0)

    async def publish_many(self, items):
        return [True for _ in items]


async def test_two_concurrent_priority_changes_are_two_events_and_the_view_follows_the_stream():
    publisher = _JetStreamLike()
    servicer = _servicer(publisher)
    servicer.view.apply(submitted("j-1", spec(), T0))
    calls = [asyncio.ensure_future(servicer.SetJobPriority(
        pb.SetJobPriorityRequest(job_id="j-1", priority=p, reason="x"), None))
        for p in (pb.PRIORITY_CLASS_HIGH, pb.PRIORITY_CLASS_LOW)]
    assert await until(lambda: publisher.asked == 2, timeout=5)
    publisher.gate.set()
    await asyncio.gather(*calls)
    assert len({e.event_id for e in publisher.stored}) == 2
    fresh = JobView()  # what a follower folding the stream ends with
    fresh.apply(submitted("j-1", spec(), T0))
    for e in publisher.stored:
        fresh.apply(e)
    assert servicer.view.jobs["j-1"].spec.priority == fresh.jobs["j-1"].spec.priority


async def test_a_duplicate_ack_waits_for_the_stored_event_instead_of_applying_its_own():
    publisher = _JetStreamLike(always_duplicate=True)
    servicer = _servicer(publisher)
    servicer.view.apply(submitted("j-1", spec(), T0))
    publisher.gate.set()
    call = asyncio.ensure_future(servicer.SetJobPriority(
        pb.SetJobPriorityRequest(job_id="j-1", priority=pb.PRIORITY_CLASS_HIGH, reason="x"), None))
    assert await until(lambda: publisher.stored, timeout=5)
    await asyncio.sleep(0)  # let the call see its ack  # noqa: a yield, not a wait for time
    assert not call.done() and servicer.view.jobs["j-1"].spec.priority == PriorityClass.NORMAL
    servicer.view.apply(publisher.stored[0])  # the follower folds the stored event
    job = await asyncio.wait_for(call, 5)
    assert job.spec.priority == pb.PRIORITY_CLASS_HIGH


# ---------------------------------------------------------------------------- item 11

async def test_a_batch_asks_the_scheduler_for_at_most_max_what_if_per_call_dry_runs():
    """Review item 11: 50 dry-run items in one SubmitJobs: the first MAX_WHAT_IF_PER_CALL get the
    scheduler's what-if, the rest their verdict only; every item is answered."""
    from fedsched.whatif import ShardWhatIf, WhatIfReply
    from services.admission.service import MAX_WHAT_IF_PER_CALL

    servicer = _servicer(FakePublisher())
    asked = []

    async def what_if(request):
        asked.append(request)
        return WhatIfReply(decisions=(ShardWhatIf(shard=0, outcome="placed", cluster="c1"),))

    servicer.what_if = what_if
    items = [pb.SubmitJobRequest(spec=_request(f"r{i}").spec, dry_run=True) for i in range(50)]
    resp = await servicer.SubmitJobs(pb.SubmitJobsRequest(items=items), _Context())
    assert len(asked) == MAX_WHAT_IF_PER_CALL < 50
    assert [r.response.verdict for r in resp.results] == ["accepted"] * 50
    assert [r.response.HasField("what_if") for r in resp.results] == [True] * MAX_WHAT_IF_PER_CALL + \
        [False] * (50 - MAX_WHAT_IF_PER_CALL)


class _Context:
    """The gRPC context as SubmitJobs uses it (trailing metadata only)."""

    def __init__(self) -> None:
        self.trailing: tuple = ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


# ---------------------------------------------------------------------------- issue 15 follow-up: slow acks

class _SlowAckStream:
    """A publisher shaped like :meth:`fedsched.bus.Bus.publish` over a JetStream whose
    acknowledgements are slow: the first try of a publish is stored but its ack times out, so
    the bus tries again with the same message id and gets JetStream's duplicate ack, carrying
    the first copy's sequence. Publishes wait for ``gate`` (a slow bus). ``stored`` is the
    stream (sequence = index + 1); :meth:`read` is JetStream's get by sequence. Nobody folds
    the stream into admission's view: its follower is behind."""

    def __init__(self, *, lose_acks: bool = True) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.stored: list = []
        self.lose_acks = lose_acks
        self.asked = 0

    async def publish(self, subject, event, *, headers=None):
        self.asked += 1
        await self.gate.wait()
        for seq, e in enumerate(self.stored, 1):
            if e.event_id == event.event_id:
                return SimpleNamespace(duplicate=True, seq=seq)
        self.stored.append(event)
        return SimpleNamespace(duplicate=self.lose_acks, seq=len(self.stored))

    async def publish_many(self, items):
        return [True for _ in items]

    async def read(self, seq):
        return self.stored[seq - 1] if 0 < seq <= len(self.stored) else None


def _submitted_in(stream: _SlowAckStream) -> list:
    return [e for e in stream.stored if e.type == "job.submitted"]


async def test_a_submission_whose_ack_was_slow_is_accepted_at_once_and_its_retry_returns_the_same_job():
    """The first answer was UNAVAILABLE "submitted by a concurrent call but is not visible yet"
    (there was no other call: the bus's own retry got the duplicate ack), and the client's
    retry was then a "duplicate" of a job it had never seen accepted."""
    stream = _SlowAckStream()
    servicer = _servicer(stream)
    servicer.stored_event = stream.read
    servicer.duplicate_wait_s = 0.5
    first = await _submit(servicer, _request("r1"))
    assert (first.job_id, first.state, first.duplicate) == (
        request_job_id("root", "search", "train", "r1"), pb.JOB_STATE_QUEUED, False)
    assert first.job_id in servicer.view.jobs  # folded from the stored event, not waited for
    again = await _submit(servicer, _request("r1"))
    assert (again.job_id, again.duplicate) == (first.job_id, True)
    assert len(_submitted_in(stream)) == 1
    servicer.view.apply(stream.stored[0])  # the follower's copy, later: changes nothing
    assert len(servicer.view.by_submitted) == 1


async def test_a_client_that_gave_up_on_a_slow_publish_gets_its_job_from_the_retry():
    """The client's deadline passes while the publish waits (gRPC cancels the call); the bus
    stored it anyway. The retry with the same request_id returns that job, not a second one."""
    stream = _SlowAckStream(lose_acks=False)
    servicer = _servicer(stream)
    servicer.stored_event = stream.read
    stream.gate.clear()
    call = asyncio.ensure_future(_submit(servicer, _request("r1")))
    assert await until(lambda: stream.asked == 1, timeout=5)
    call.cancel()  # the client gave up; JetStream stores what was sent
    stream.gate.set()
    stream.stored.append(servicer_event := _event_of(servicer, "r1"))
    with pytest.raises(asyncio.CancelledError):
        await call
    retry = await _submit(servicer, _request("r1"))
    assert retry.job_id == servicer_event.job_id and retry.state == pb.JOB_STATE_QUEUED
    assert len(_submitted_in(stream)) == 1


def _event_of(servicer: JobServicer, rid: str):
    """The ``job.submitted`` a submit of :func:`_request` ``(rid)`` publishes (as admission makes it)."""
    admitted = servicer._admit(_request(rid), ROOT)
    servicer._release(admitted.spec.tenant, admitted.job_id, admitted.held)
    return make_event(EventType.JOB_SUBMITTED, JobSubmitted(spec=admitted.spec, request_id=rid, submitted_by="root"),
                      producer="admission", occurred_at=servicer.clock.time(),
                      event_id=business_event_id(admitted.job_id, "submitted"), tenant="search", project="train",
                      job_id=admitted.job_id, actor="root", policy_version=admitted.gov.version)


async def test_a_stored_submission_with_another_spec_under_the_key_is_already_exists_not_unavailable():
    stream = _SlowAckStream(lose_acks=False)
    servicer = _servicer(stream)
    servicer.stored_event = stream.read
    other = _event_of(servicer, "r1")
    payload = {**other.payload, "spec": {**other.payload["spec"], "cpu_milli": 2000}}
    stream.stored.append(other.model_copy(update={"payload": payload}))  # another call's spec under the same key
    with pytest.raises(AlreadyExistsError, match="different spec"):
        await _submit(servicer, _request("r1"))
    assert len(_submitted_in(stream)) == 1


async def test_without_a_stream_reader_a_slow_follower_gets_an_honest_unavailable_then_the_job():
    stream = _SlowAckStream()
    servicer = _servicer(stream)
    servicer.duplicate_wait_s = 0.1  # nobody folds the stream meanwhile
    with pytest.raises(UnavailableError) as e:
        await _submit(servicer, _request("r1"))
    assert "is stored in the event stream" in e.value.message and "same request_id" in e.value.message
    assert "concurrent call" not in e.value.message
    servicer.view.apply(stream.stored[0])  # the follower catches up
    retry = await _submit(servicer, _request("r1"))
    assert retry.job_id == stream.stored[0].job_id and len(_submitted_in(stream)) == 1


async def test_an_unacknowledged_submission_says_whether_a_retry_is_safe():
    servicer = _servicer(FakePublisher(refuse=lambda subject, event: True))
    with pytest.raises(UnavailableError) as e:
        await _submit(servicer, _request("r1"))
    job_id = request_job_id("root", "search", "train", "r1")
    assert f"job {job_id} was not confirmed" in e.value.message and "same request_id 'r1'" in e.value.message
    request = _request("")
    with pytest.raises(UnavailableError) as e:
        await _submit(servicer, request)
    assert "a retry without a request_id may make a second job" in e.value.message


# ---------------------------------------------------------------------------- issue 15: batch publish

class _PipelinedStream(_SlowAckStream):
    """:class:`_SlowAckStream` with :meth:`fedsched.bus.Bus.publish_acks`' shape: a batch is
    sent at once and each item gets its ack (or error); ``batches`` records each call's size."""

    def __init__(self, *, lose_acks: bool = False, fail: set[str] = frozenset()) -> None:
        super().__init__(lose_acks=lose_acks)
        self.batches: list[int] = []
        self.fail = fail  # job ids whose publish is not acknowledged

    async def publish_acks(self, items):
        self.batches.append(len(items))
        out = []
        for subject, event, headers in items:
            if event.job_id in self.fail:
                out.append(UnavailableError("fake: no ack"))
            else:
                out.append(await self.publish(subject, event, headers=headers))
        return out


async def test_a_batch_publishes_its_submissions_in_one_pipelined_call_and_answers_each_from_its_ack():
    """SubmitJobs hands all of its accepted submissions to the publisher at once (one
    ``publish_acks`` call, none one by one); each item is answered from its own ack: a new job
    is queued in the view, an unacknowledged one says a retry with its request_id is safe, and
    the others are unaffected."""
    stream = _PipelinedStream()
    servicer = _servicer(stream)
    stream.fail = {request_job_id("root", "search", "train", "r3")}
    items = [_request(f"r{i}") for i in range(40)]
    resp = await servicer.SubmitJobs(pb.SubmitJobsRequest(items=items), _Context())
    assert stream.batches == [40] and stream.asked == 39  # one batch; the failed item was never stored
    codes = [r.code for r in resp.results]
    assert codes[3] == 14 and "retry with the same request_id 'r3'" in resp.results[3].message  # UNAVAILABLE
    assert codes[:3] + codes[4:] == [0] * 39
    assert all(r.response.job_id in servicer.view.jobs for i, r in enumerate(resp.results) if i != 3)
    assert len(_submitted_in(stream)) == 39


async def test_a_batch_item_acknowledged_as_a_duplicate_is_answered_as_its_stored_submission():
    """A pipelined item whose ack says "duplicate" (the stream had its event id: another call
    stored it first) is answered from the stored event, as a single submit's is: the same spec
    is a duplicate of that job."""
    stream = _PipelinedStream()
    servicer = _servicer(stream)
    servicer.stored_event = stream.read
    first = servicer._admit(_request("r1"), ROOT)
    stored, _ = servicer._submission_event(first.gov, first.spec, first.rid, ROOT, first.job_id)
    stream.stored.append(stored.model_copy(update={"occurred_at": stored.occurred_at.replace(year=2020)}))
    resp = await servicer.SubmitJobs(pb.SubmitJobsRequest(items=[_request("r0"), _request("r1")]), _Context())
    assert stream.batches == [2]
    assert [r.code for r in resp.results] == [0, 0]
    assert (resp.results[1].response.job_id, resp.results[1].response.duplicate) == (first.job_id, True)
    assert not resp.results[0].response.duplicate


async def test_a_submission_is_folded_into_the_view_from_its_own_payload_model_not_parsed_back():
    """Convert and validate once (issue 15): the view's record of a submitted job holds the
    spec admission validated, and the published event's payload is never parsed back into a
    ``JobSubmitted`` (no second JobSpec validation) -- for a batch and for a single submit."""
    stream = _PipelinedStream()
    servicer = _servicer(stream)
    resp = await servicer.SubmitJobs(pb.SubmitJobsRequest(items=[_request("r0"), _request("r1")]), _Context())
    single = await servicer.SubmitJob(_request("r2"), _Context())
    for job_id in [r.response.job_id for r in resp.results] + [single.job_id]:
        event = next(e for e in stream.stored if e.job_id == job_id)
        # the event carries the payload model it was made from (fedsched.events.make_event): the
        # spec the view holds is that very object, not a second validation of the payload
        assert servicer.view.jobs[job_id].spec is event.payload_as(JobSubmitted).spec, "the payload was parsed again"


@given(st.lists(st.text(), min_size=4, max_size=4))
@settings(max_examples=300, deadline=None)
def test_a_request_job_id_is_the_hash_of_the_keys_json_text(key):
    """The job id of a request id stays what every earlier build derived (ids in the stream and
    the ended-jobs store are looked up by it): SHA-256 of ``json.dumps`` of the four names."""
    text = json.dumps(key, ensure_ascii=True)
    assert request_job_id(*key) == "j-" + hashlib.sha256(text.encode()).hexdigest()[:20]
