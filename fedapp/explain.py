"""The words for a decision that waits on a cross-region approval, shared by ``fedsched
explain`` and the console's job page, so both say what the scheduler does with the job.

What the scheduler does (``services/scheduler/approvals.py``, ``TenancyGate``): a placement in
another region under the tenant's ``approval`` mode becomes a request and the job is held back
until it is answered. Approved: the job may run in that region. Rejected, or no answer by the
deadline (``approval.expired``): the job is kept to its home region for good (``home_only``,
narrowed to ``must_local``) -- it is never proposed abroad again. A job that no cluster of its
home region can ever hold (every one refuses it for a reason waiting does not change,
``fedsched.reasons.STATIC_REASONS``) then cannot be placed at all, and the scheduler ends it once
it has been unplaceable for ``unschedulable_timeout_s`` (``job.cancelled``, reason
``unschedulable_timeout``). Who answers: a principal with the role ``approver`` on the job's
tenant, or an admin (``ApprovalService``).
"""

from __future__ import annotations

from fedsched.reasons import STATIC_REASONS

#: Verdict reasons (their wire values) that waiting never changes.
_STATIC = frozenset(r.value for r in STATIC_REASONS)


def never_at_home(decision, home_region: str) -> bool:
    """True when no cluster of ``home_region`` could ever hold the job by the decision's verdicts
    (each one there failed for a static reason, or the region had none); False when some home
    cluster fits or fails only for now (busy, quota, stale, ...), or the home region is unknown.

    Args:
        decision: a ``ShardDecision`` (wire form: ``clusters`` with ``region``, ``passed``,
            ``reason``).
        home_region: the job's home region ("" = unknown).
    """
    if not home_region:
        return False
    at_home = [c for c in decision.clusters if c.region == home_region]
    return all(not c.passed and c.reason in _STATIC for c in at_home)


def approval_wait(decision, *, tenant: str = "", home_region: str = "", deadline: str = "") -> str:
    """One paragraph for an ``awaiting_approval`` decision: the region it needs approval for, who
    may answer, by when, and what happens without an approval (see the module docstring).

    Args:
        decision: the ``ShardDecision`` (``region``, ``cluster``, ``approval_id``, ``clusters``).
        tenant: the job's tenant ("" = unknown: "the job's tenant").
        home_region: the job's home region ("" = unknown).
        deadline: the request's deadline as shown to people (e.g. ``2026-11-30 22:55:00 UTC``).
    """
    whose = f"tenant {tenant}" if tenant else "the job's tenant"
    where = f"{decision.region} ({decision.cluster})" if decision.cluster else decision.region
    home = home_region or "its home region"
    request = f"request {decision.approval_id}" if decision.approval_id else "a request"
    text = (f"needs a cross-region approval to run in {where}: {request}, to be approved "
            f"or rejected by an approver of {whose} (role approver) or an admin"
            + (f" by {deadline}" if deadline else "") + ". ")
    if never_at_home(decision, home_region):
        return text + (f"No cluster of its home region {home} can ever hold it, so it runs only if approved: "
                       f"rejected or unanswered, it stays in the home queue unplaceable and the scheduler ends it "
                       f"once it has been unplaceable for unschedulable_timeout_s (default 24 h)")
    return text + (f"Rejected or unanswered, it waits for room in {home} and is not proposed abroad again")
