"""WatchJob leaves nothing behind (review item 5): a watch that ends (the job reached a final
state, or was already in one) or is abandoned leaves no change event in the job view; the
view's ``_changed`` table is back to its size before after 1,000 watched jobs end."""

from __future__ import annotations

import asyncio

from fedsched import auth
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.events import Subjects
from fedsched.policystore import PolicyHolder, StoredPolicy
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance
from services.admission.budgets import SpendBook
from services.admission.jobview import JobView
from services.admission.service import JobServicer
from fedsched.events import JobStatus, make_event
from tests.builders import FakeClock, FakePublisher, policy_doc, spec, submitted, until

T0 = 1_700_000_000.0
JOBS = 1000


def _servicer(view: JobView) -> JobServicer:
    holder = PolicyHolder()
    holder.set(StoredPolicy(Governance.of(policy_doc()), 1))
    return JobServicer(FakePublisher(), FakeClock(), holder, view, None, set(), set(), SpendBook(),
                       load_price_catalog(), subjects=Subjects("t"))


def _end(view: JobView, job_id: str) -> None:
    """The scheduler cancels the queued job (its final state)."""
    job = view.jobs[job_id].spec
    view.apply(make_event("job.cancelled", JobStatus(reason="cancelled"), producer="scheduler", occurred_at=T0 + 1,
                          tenant=job.tenant, project=job.project, job_id=job_id, actor="scheduler"))


async def test_watches_of_jobs_that_end_leave_no_change_event():
    auth.CURRENT.set(Principal("root", (Grant(role="admin"),)))
    view = JobView(retain_ended=JOBS // 2)  # half of them also leave the view
    servicer = _servicer(view)
    job = spec()
    for i in range(JOBS):
        view.apply(submitted(f"j-{i:05d}", job, T0))
    before = len(view._changed)
    watches = [servicer.WatchJob(pb.WatchJobRequest(job_id=f"j-{i:05d}"), None) for i in range(JOBS)]
    for w in watches:
        assert (await w.__anext__()).state == pb.JOB_STATE_QUEUED
    finals = [asyncio.ensure_future(w.__anext__()) for w in watches]
    assert await until(lambda: len(view._changed) == JOBS, timeout=10)  # every watch waits
    for i in range(JOBS):
        _end(view, f"j-{i:05d}")
    states = await asyncio.gather(*finals)
    assert {s.state for s in states} == {pb.JOB_STATE_CANCELLED}, {s.state for s in states}
    assert len(view._changed) == before


async def test_a_watch_of_an_ended_job_still_in_the_view_makes_no_change_event():
    auth.CURRENT.set(Principal("root", (Grant(role="admin"),)))
    view = JobView()
    servicer = _servicer(view)
    for i in range(JOBS):
        view.apply(submitted(f"j-{i:05d}", spec(), T0))
        _end(view, f"j-{i:05d}")
    before = len(view._changed)
    for i in range(JOBS):
        states = [j.state async for j in servicer.WatchJob(pb.WatchJobRequest(job_id=f"j-{i:05d}"), None)]
        assert states == [pb.JOB_STATE_CANCELLED]
    assert len(view._changed) == before


async def test_an_abandoned_watch_leaves_nothing_once_its_job_leaves_the_view():
    """A client that goes away while waiting: its event is gone once the job ended and left the view."""
    auth.CURRENT.set(Principal("root", (Grant(role="admin"),)))
    view = JobView(retain_ended=1)
    servicer = _servicer(view)
    view.apply(submitted("j-a", spec(), T0))
    w = servicer.WatchJob(pb.WatchJobRequest(job_id="j-a"), None)
    await w.__anext__()
    waiting = asyncio.ensure_future(w.__anext__())
    assert await until(lambda: "j-a" in view._changed, timeout=5)
    waiting.cancel()
    view._changed["j-a"]  # still there: the job has not changed
    _end(view, "j-a")
    view.apply(submitted("j-b", spec(), T0))
    _end(view, "j-b")  # j-a leaves the view
    assert "j-a" not in view.jobs and not view._changed
