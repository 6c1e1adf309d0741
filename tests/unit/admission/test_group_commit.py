"""Group commit of single submits (issue 15): concurrent SubmitJob calls share one ended-jobs
lookup and one pipelined publish, each answered from its own item; a request id repeated
inside a group is one job; a budgeted tenant keeps its compare-and-set publish; a lone call
is published without waiting for company."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fedsched import auth, telemetry
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.bus import EXPECT_SEQUENCE
from fedsched.errors import AlreadyExistsError, UnavailableError
from fedsched.events import Subjects
from fedsched.policystore import PolicyHolder, StoredPolicy
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance
from services.admission.budgets import SpendBook
from services.admission.ended import EndedJobs
from services.admission.jobview import JobView
from services.admission.service import JobServicer, request_job_id
from tests.builders import T4, TENANTS, FakeClock, policy_doc

ROOT = Principal("root", (Grant(role="admin"),))
BUDGETED = TENANTS.replace("{name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}",
                           "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch], "
                           "budget: {monthly: \"1000000\", currency: CNY}}")


class _Stream:
    """A JetStream-shaped publisher: ``publish_acks`` (the pipelined batch) records each call's
    items and acknowledges each with its sequence (``duplicate`` for an event id already
    stored); ``publish`` (one message, with the headers it got) likewise. ``fail``: job ids
    whose publish is not acknowledged. ``gate``: publishes wait for it (a slow bus)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []
        self.singles: list[tuple] = []
        self.stored: list = []
        self.fail: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()

    def _store(self, event):
        if event.job_id in self.fail:
            return UnavailableError("fake: no ack")
        for seq, e in enumerate(self.stored, 1):
            if e.event_id == event.event_id:
                return SimpleNamespace(duplicate=True, seq=seq)
        self.stored.append(event)
        return SimpleNamespace(duplicate=False, seq=len(self.stored))

    async def publish(self, subject, event, *, headers=None):
        self.singles.append((subject, event, headers))
        await self.gate.wait()
        ack = self._store(event)
        if isinstance(ack, BaseException):
            raise ack
        return ack

    async def publish_acks(self, items):
        self.batches.append(list(items))
        await self.gate.wait()
        return [self._store(event) for _, event, _ in items]

    async def publish_many(self, items):
        return [True for _ in items]


class _CountingEnded(EndedJobs):
    """The ended-jobs store with nothing archived, counting the lookups made of it."""

    def __init__(self) -> None:
        super().__init__(None)
        self.many: list[list[str]] = []
        self.single: list[str] = []

    async def get_many(self, job_ids, timeout_s: float = 2.0):
        self.many.append(list(job_ids))
        return {}

    async def get(self, job_id, timeout_s: float = 2.0):
        self.single.append(job_id)
        return None


def _servicer(stream: _Stream, tenants: str = TENANTS) -> JobServicer:
    holder = PolicyHolder()
    holder.set(StoredPolicy(Governance.of(policy_doc(tenants=tenants)), 1))
    servicer = JobServicer(stream, FakeClock(), holder, JobView(), None, {T4}, {"cn-north-1", "cn-east-1"}, SpendBook(),
                           load_price_catalog(), subjects=Subjects("t"))
    servicer.ended = _CountingEnded()
    auth.CURRENT.set(ROOT)
    return servicer


def _request(rid: str, *, tenant: str = "search", cpu_milli: int = 1000) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant=tenant, project="train", gpus_per_worker=1, cpu_milli=cpu_milli,
                                               card_models=["T4"], estimated_duration_seconds=600), request_id=rid)


class _Context:
    """The gRPC context as SubmitJob uses it (trailing metadata)."""

    def __init__(self) -> None:
        self.trailing: tuple = ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


async def _submit_together(servicer: JobServicer, requests: list[pb.SubmitJobRequest]) -> list:
    """The requests as concurrent SubmitJob calls, each in its own trace; per call its response
    or exception and its context."""
    contexts = [_Context() for _ in requests]

    async def one(request, context):
        with telemetry.root_span("caller"):
            return await servicer.SubmitJob(request, context)

    results = await asyncio.gather(*(one(r, c) for r, c in zip(requests, contexts)), return_exceptions=True)
    return list(zip(results, contexts))


async def test_concurrent_submits_make_one_ended_lookup_and_one_publish_each_answered_from_its_item():
    stream = _Stream()
    servicer = _servicer(stream)
    stream.fail = {request_job_id("root", "search", "train", "r7")}
    out = await _submit_together(servicer, [_request(f"r{i}") for i in range(20)])
    assert len(servicer.ended.many) == 1 and len(servicer.ended.many[0]) == 20 and not servicer.ended.single
    assert [len(b) for b in stream.batches] == [20] and not stream.singles
    assert (servicer.groups_flushed, servicer.grouped_submits) == (1, 20)
    for i, (resp, context) in enumerate(out):
        job_id = request_job_id("root", "search", "train", f"r{i}")
        if i == 7:  # its own failure only
            assert isinstance(resp, UnavailableError) and "retry with the same request_id 'r7'" in resp.message
            continue
        assert resp.job_id == job_id and not resp.duplicate and job_id in servicer.view.jobs
        assert dict(context.trailing)["x-trace-id"] == resp.trace_id
        # the event carries its own call's trace, not the group's first caller's
        headers = next(h for _, e, h in stream.batches[0] if e.job_id == job_id)
        assert headers["traceparent"].split("-")[1] == resp.trace_id
    assert len({resp.trace_id for resp, _ in out if not isinstance(resp, Exception)}) == 19


async def test_a_request_id_repeated_within_one_group_is_one_job():
    stream = _Stream()
    servicer = _servicer(stream)
    out = await _submit_together(servicer, [_request("same"), _request("other"), _request("same")])
    (first, _), (other, _), (again, _) = out
    assert len(stream.batches) == 1 and len(stream.batches[0]) == 2  # "same" published once
    assert [e.job_id for e in stream.stored].count(first.job_id) == 1
    assert again.job_id == first.job_id and (first.duplicate, again.duplicate) == (False, True)
    assert other.job_id != first.job_id
    assert len(servicer.view.jobs) == 2


async def test_the_same_request_id_with_another_spec_in_one_group_is_already_exists_for_that_call_only():
    stream = _Stream()
    servicer = _servicer(stream)
    out = await _submit_together(servicer, [_request("k"), _request("k", cpu_milli=2000)])
    (first, _), (clash, _) = out
    assert not isinstance(first, Exception) and first.job_id in servicer.view.jobs
    assert isinstance(clash, AlreadyExistsError) and first.job_id in clash.message
    assert len(stream.stored) == 1 and len(stream.batches) == 1


async def test_submits_arriving_while_a_group_is_published_make_the_next_group():
    stream = _Stream()
    servicer = _servicer(stream)
    servicer.group_stall_s = 60.0
    stream.gate.clear()  # a slow bus: the first group's acks are outstanding
    first = asyncio.ensure_future(servicer.SubmitJob(_request("a"), _Context()))
    await until(lambda: len(stream.batches) == 1)  # a lone submit is published without company
    later = [asyncio.ensure_future(servicer.SubmitJob(_request(f"b{i}"), _Context())) for i in range(5)]
    await until(lambda: len(servicer._group) == 5)
    assert len(stream.batches) == 1  # they wait for the group in flight
    stream.gate.set()
    answers = await asyncio.gather(first, *later)
    assert [len(b) for b in stream.batches] == [1, 5]
    assert len({a.job_id for a in answers}) == 6 and all(a.job_id in servicer.view.jobs for a in answers)


async def test_a_group_publishing_longer_than_the_stall_bound_does_not_hold_back_the_next():
    stream = _Stream()
    servicer = _servicer(stream)
    servicer.group_stall_s = 0.01
    stream.gate.clear()  # the first group never gets its acks until the gate opens
    first = asyncio.ensure_future(servicer.SubmitJob(_request("a"), _Context()))
    await until(lambda: len(stream.batches) == 1)
    later = [asyncio.ensure_future(servicer.SubmitJob(_request(f"b{i}"), _Context())) for i in range(3)]
    await until(lambda: len(stream.batches) == 2)  # started while the first is still waiting
    assert [len(b) for b in stream.batches] == [1, 3] and not first.done()
    stream.gate.set()
    answers = await asyncio.gather(first, *later)
    assert len({a.job_id for a in answers}) == 4
    await until(lambda: servicer._group_flushing == 0 and not servicer._group_detached)


async def test_a_budgeted_tenant_keeps_its_compare_and_set_publish():
    stream = _Stream()
    servicer = _servicer(stream, tenants=BUDGETED)
    out = await _submit_together(servicer, [_request("n1", tenant="nlp"), _request("s1")])
    assert all(not isinstance(r, Exception) for r, _ in out), out
    assert [e.job_id for _, e, _ in stream.batches[0]] == [out[1][0].job_id]  # search: grouped
    (_, event, headers), = stream.singles  # nlp: alone, with the compare-and-set condition
    assert event.job_id == out[0][0].job_id and EXPECT_SEQUENCE in headers


async def test_without_group_commit_a_submit_publishes_alone():
    stream = _Stream()
    servicer = _servicer(stream)
    servicer.group_commit = False
    out = await _submit_together(servicer, [_request("r0"), _request("r1")])
    assert all(not isinstance(r, Exception) for r, _ in out)
    assert not stream.batches and len(stream.singles) == 2
    assert servicer.ended.single and not servicer.ended.many


async def until(cond, timeout_s: float = 5.0) -> None:
    """Await ``cond()`` (event-loop turns and short sleeps) for at most ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.001)


@pytest.fixture(autouse=True)
def _no_principal_leak():
    token = auth.CURRENT.set(ROOT)
    yield
    auth.CURRENT.reset(token)


async def test_a_repeat_in_a_group_is_answered_from_the_stored_job_even_when_the_groups_first_item_was_refused():
    """The job of the key was stored (by another replica) with spec A; the next group holds the
    key with spec B first, then with spec A: B is ALREADY_EXISTS, A is a duplicate of the job."""
    stream = _Stream()
    stored = await _servicer(stream).SubmitJob(_request("k"), _Context())
    servicer = _servicer(stream)  # another replica, whose follower has not folded that job yet
    servicer.stored_event = lambda seq: _read(stream, seq)
    out = await _submit_together(servicer, [_request("k", cpu_milli=2000), _request("k")])
    (clash, _), (same, _) = out
    assert isinstance(clash, AlreadyExistsError), clash
    assert not isinstance(same, Exception) and (same.job_id, same.duplicate) == (stored.job_id, True)
    assert len(stream.stored) == 1


async def _read(stream: _Stream, seq: int):
    return stream.stored[seq - 1] if 0 < seq <= len(stream.stored) else None
