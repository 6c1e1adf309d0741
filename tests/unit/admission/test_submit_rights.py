"""Submit checks the caller's rights on the tenant before it validates the project: a caller
without rights on a tenant learns nothing of its projects (no "did you mean", no project list),
whether the project it named exists or not (services/admission/service.py ``_admit``)."""

from __future__ import annotations

import pytest

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.auth import Grant, Principal
from fedsched.errors import PermissionDeniedError, ValidationError
from fedsched.events import Subjects
from fedsched.policystore import PolicyHolder, StoredPolicy
from fedsched.pricing import load_price_catalog
from fedsched.tenancy import Governance
from services.admission.budgets import SpendBook
from services.admission.jobview import JobView
from services.admission.service import JobServicer
from tests.builders import FakeClock, FakePublisher, policy_doc

OUTSIDER = Principal("eve", (Grant(role="submitter", tenants=("search",)),))  # no rights on ads
MEMBER = Principal("ann", (Grant(role="submitter", tenants=("ads",)),))


def _servicer() -> JobServicer:
    holder = PolicyHolder()
    holder.set(StoredPolicy(Governance.of(policy_doc()), 1))
    return JobServicer(FakePublisher(), FakeClock(), holder, JobView(), None, set(), set(), SpendBook(),
                       load_price_catalog(), subjects=Subjects("t"))


def _request(tenant: str, project: str) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(spec=pb.JobSpec(tenant=tenant, project=project, gpus_per_worker=1, cpu_milli=1000))


@pytest.mark.parametrize("project", ["Trian", "trian", "nope", "train"])
def test_a_caller_without_rights_on_the_tenant_learns_none_of_its_projects(project):
    with pytest.raises(PermissionDeniedError) as e:
        _servicer()._admit(_request("ads", project), OUTSIDER)
    message = str(e.value)
    assert message == f"eve may not submit jobs for ads/{project}"  # the same answer, project known or not
    for leaked in ("did you mean", "(has", "serve", "batch"):
        assert leaked not in message


def test_a_member_of_the_tenant_still_gets_the_suggestion():
    with pytest.raises(ValidationError) as e:
        _servicer()._admit(_request("ads", "trian"), MEMBER)
    assert e.value.field == "spec.project" and "train" in str(e.value)
