"""``fedsched explain`` of a job awaiting a cross-region approval says what the scheduler does
with it: the region it needs approval for, who may answer (an approver of its tenant, or an
admin), by when, and -- for a job no home cluster can ever hold -- that without an approval it
cannot run at all (it is kept home, unplaceable, and ended by the unschedulable timeout), not
that it "goes back to its home queue" as if it would run there.

The request is the real tenancy gate's; admission's job view folds it into ExplainJob's answer;
the CLI prints that; then the gate's own expiry and ``decide`` show the claim holds."""

from __future__ import annotations

import io

import pytest

from fedapp.cli import jobs as cli_jobs
from fedapp.cli.text import CliConsole
from fedapp.explain import approval_wait, never_at_home
from fedsched.events import JobSubmitted, make_event
from fedsched.jobs import Locality
from services.admission.jobview import JobView
from services.admission.service import explain_to_pb
from services.scheduler.core import ClusterState, NodeState, View, build_policy, decide
from tests.builders import gate_entry, queued_of, tenancy_gate

T4, A100 = "nvidia-t4-16gb", "nvidia-a100-80gb"
NOW = 1.7e9
BASE = build_policy("federated")


def _view(home_model: str, home_free: int) -> View:
    """Home cn-north-1: one node of 8 ``home_model`` cards, ``home_free`` of them free; cn-east-1:
    8 free T4s."""
    def node(name, model, free):
        return NodeState(name, model, 16, (1000,) * free + (0,) * (8 - free), 64000, 262144, 64000, 262144)

    home = ClusterState("cn-north-1-c1", "cn-north-1", "cn-north-1a", (node("h1", home_model, home_free),),
                        prices={home_model: 6.0})
    away = ClusterState("cn-east-1-c1", "cn-east-1", "cn-east-1a", (node("e1", T4, 8),), prices={T4: 5.4})
    return View((home, away), NOW)


def _explained(gov, entry, view):
    """The approval request the gate makes for ``entry``, as ``fedsched explain`` prints it."""
    decisions = decide(view, gov.narrow([queued_of(entry)], view), gov.effective_policy(BASE))
    kept, items = gov.gate(decisions, {entry.job_id: entry}, view, NOW)
    assert not kept.placements and [e.type for _, e, _ in items] == ["approval.requested"]
    gov.confirm(items, [True])
    jobs = JobView()
    jobs.apply(make_event("job.submitted", JobSubmitted(spec=entry.spec, submitted_by="alice"), producer="admission",
                          occurred_at=NOW - 1, tenant=entry.tenant, project="train", job_id=entry.job_id))
    jobs.apply(items[0][1])
    resp = explain_to_pb(jobs.jobs[entry.job_id])
    out = io.StringIO()
    console = cli_jobs.console
    cli_jobs.console = CliConsole(file=out, width=400)
    try:
        cli_jobs._print_explain(resp, spec=cli_jobs.pb.JobSpec(tenant=entry.tenant, home_region="cn-north-1"))
    finally:
        cli_jobs.console = console
    return resp.decisions[0], " ".join(out.getvalue().split()), items[0][1].payload["approval_id"]  # unwrapped


def test_a_job_only_another_region_can_hold_needs_the_approval_to_run_at_all():
    gov = tenancy_gate("approvals: {timeout_s: 60}\n")
    entry = gate_entry("j-t4")  # asks for a T4: home has only A100s, all free
    view = _view(A100, home_free=8)
    d, text, approval_id = _explained(gov, entry, view)
    assert never_at_home(d, "cn-north-1")
    assert (f"needs a cross-region approval to run in cn-east-1 (cn-east-1-c1): request {approval_id}, to be "
            f"approved or rejected by an approver of tenant ads (role approver) or an admin by ") in text
    assert "No cluster of its home region cn-north-1 can ever hold it, so it runs only if approved" in text
    assert "unschedulable_timeout_s" in text
    assert "goes back to its home region's queue" not in text

    (expired,) = gov.expiries({entry.job_id: entry}, NOW + 61)  # what the scheduler then does
    gov.apply(expired[1])
    (home_only,) = gov.narrow([queued_of(entry)], view)
    assert home_only.spec.locality == Locality.MUST_LOCAL  # never proposed abroad again
    after = decide(view, [home_only], gov.effective_policy(BASE))
    assert not after.placements and after.pending[0].fits_empty is False  # unplaceable: the timeout ends it


def test_a_job_its_home_can_hold_later_waits_for_home_without_an_approval():
    gov = tenancy_gate("approvals: {timeout_s: 60}\n")
    entry = gate_entry("j-small")
    view = _view(T4, home_free=0)  # home is only busy
    d, text, _ = _explained(gov, entry, view)
    assert not never_at_home(d, "cn-north-1")
    assert "Rejected or unanswered, it waits for room in cn-north-1 and is not proposed abroad again" in text
    assert "can ever hold it" not in text

    (expired,) = gov.expiries({entry.job_id: entry}, NOW + 61)
    gov.apply(expired[1])
    (home_only,) = gov.narrow([queued_of(entry)], view)
    after = decide(view, [home_only], gov.effective_policy(BASE))
    assert home_only.spec.locality == Locality.MUST_LOCAL and after.pending[0].fits_empty is True


@pytest.mark.parametrize("tenant, home, deadline, want", [
    ("", "", "", "an approver of the job's tenant (role approver) or an admin. Rejected or unanswered, it waits "
                 "for room in its home region"),
    ("ads", "cn-north-1", "2026-12-01 03:00:00 UTC", "an approver of tenant ads (role approver) or an admin by "
                                                     "2026-12-01 03:00:00 UTC."),
], ids=["unknown-job", "known-job"])
def test_the_words_without_the_job_say_only_what_is_known(tenant, home, deadline, want):
    from fedsched.api.v1 import jobs_pb2 as pb

    d = pb.ShardDecision(outcome="awaiting_approval", region="cn-east-1", cluster="east-c1", approval_id="ap-1")
    d.clusters.add(cluster="north-c1", region="cn-north-1", passed=False, reason="insufficient_free_resources")
    assert want in approval_wait(d, tenant=tenant, home_region=home, deadline=deadline)
