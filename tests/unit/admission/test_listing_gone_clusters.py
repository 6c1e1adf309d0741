"""ListJobs' ``--cluster`` / ``--region`` filters accept a cluster or region that no longer exists
while jobs of it are still in the view (a decommissioned cluster's ended jobs), kept by the job
view as jobs change; a name nothing ever ran on is still refused (services/admission/service.py
``filter_names``)."""

from __future__ import annotations

import pytest

from fedsched import auth
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.errors import ValidationError
from fedsched.events import JobPlaced, JobStatus, JobSubmitted, Subjects, WorkerBinding, make_event
from fedsched.jobs import JobSpec
from fedsched.policystore import PolicyHolder, StoredPolicy
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance
from fedsched.topology import KnownNames
from services.admission.budgets import SpendBook
from services.admission.jobview import JobView
from services.admission.service import JobServicer
from tests.builders import FakeClock, FakePublisher, policy_doc

T0 = 1_700_000_000.0
ROOT = Principal("root", (Grant(role="admin"),))
GONE = "cn-west-9-old"  # decommissioned: in no topology, no agent reports it


def _ev(type_, payload, job_id, at, **kw):
    return make_event(type_, payload, producer="test", occurred_at=at, tenant="search", project="train",
                      job_id=job_id, **kw)


def _servicer(view: JobView) -> JobServicer:
    holder = PolicyHolder()
    holder.set(StoredPolicy(Governance.of(policy_doc()), 1))
    names = KnownNames(regions=["cn-north-1", "cn-east-1"], clusters=["cn-north-1-c1"])
    auth.CURRENT.set(ROOT)
    return JobServicer(FakePublisher(), FakeClock(), holder, view, None, set(), set(), SpendBook(),
                       load_price_catalog(), subjects=Subjects("t"), names=names)


def _ran_on(view: JobView, job_id: str, region: str, cluster: str, at: float) -> None:
    spec = JobSpec(tenant="search", project="train", home_region="cn-north-1", gpus_per_worker=1)
    view.apply(_ev("job.submitted", JobSubmitted(spec=spec, submitted_by="alice"), job_id, at, actor="alice"))
    view.apply(_ev("job.placed", JobPlaced(spec=spec, bindings=(WorkerBinding(worker=0, node="n0"),)), job_id,
                   at + 1, attempt=1, region=region, cluster=cluster))
    view.apply(_ev("job.finished", JobStatus(), job_id, at + 2, attempt=1, region=region, cluster=cluster))


async def test_a_decommissioned_clusters_ended_jobs_are_listed_by_its_name_until_they_leave_the_view():
    view = JobView(retain_ended=2)
    servicer = _servicer(view)
    _ran_on(view, "j-old", "cn-west-9", GONE, T0)
    resp = await servicer.ListJobs(pb.ListJobsRequest(clusters=[GONE]), None)
    assert [j.job_id for j in resp.jobs] == ["j-old"] and resp.total == 1
    resp = await servicer.ListJobs(pb.ListJobsRequest(regions=["cn-west-9"]), None)
    assert [j.job_id for j in resp.jobs] == ["j-old"]
    with pytest.raises(ValidationError) as e:  # nothing ever ran there: still a typo
        await servicer.ListJobs(pb.ListJobsRequest(clusters=["cn-west-9-olf"]), None)
    assert e.value.field == "clusters[0]"
    for i in range(2):  # two newer ended jobs push j-old out of the view
        _ran_on(view, f"j-{i}", "cn-north-1", "cn-north-1-c1", T0 + 10 + i * 10)
    assert "j-old" not in view.jobs and GONE not in view.attempt_clusters
    with pytest.raises(ValidationError):
        await servicer.ListJobs(pb.ListJobsRequest(clusters=[GONE]), None)
