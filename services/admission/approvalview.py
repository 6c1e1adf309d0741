"""Admission's read model of cross-region approval requests, folded from the event stream.

``approval.requested`` (from the scheduler) opens a request; the first of
``approval.approved`` / ``approval.rejected`` (from an approver through ApprovalService) or
``approval.expired`` (from the scheduler) closes it -- the three share one event id per
approval, so the stream holds at most one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsched.dispatch import EventTable
from fedsched.events import APPROVAL_OUTCOMES, ApprovalDecided, ApprovalRequested, Envelope, EventType

STATES = ("pending", "approved", "rejected", "expired")


@dataclass
class ApprovalRecord:
    """One approval request and its outcome (times in business seconds)."""

    approval_id: str
    job_id: str
    tenant: str
    project: str
    home_region: str
    proposed_region: str
    proposed_cluster: str
    card_model: str
    reason: str
    cost: str
    home_cost: str
    currency: str
    transfer_s: float
    requested_at: float
    expires_at: float
    policy_version: str
    state: str = "pending"
    decided_at: float | None = None
    decided_by: str = ""
    comment: str = ""
    decision_policy_version: str = ""


class ApprovalView:
    """Approval requests by id."""

    def __init__(self) -> None:
        self.by_id: dict[str, ApprovalRecord] = {}

    def apply(self, env: Envelope) -> None:
        """Fold one event (idempotent; first outcome wins); other types change nothing."""
        fold = APPROVAL_VIEW_EVENTS.route(env.type)
        if fold is not None:
            fold(self, env)

    def _on_requested(self, env: Envelope) -> None:
        req = env.payload_as(ApprovalRequested)
        if req.approval_id in self.by_id:
            return
        self.by_id[req.approval_id] = ApprovalRecord(
            req.approval_id, env.job_id, env.tenant, env.project, req.home_region, req.proposed_region,
            req.proposed_cluster, req.card_model, req.reason, req.cost, req.home_cost, req.currency,
            req.transfer_s, env.occurred_at.timestamp(), req.expires_at.timestamp(), env.policy_version)

    def _on_outcome(self, env: Envelope) -> None:
        out = env.payload_as(ApprovalDecided)
        rec = self.by_id.get(out.approval_id)
        if rec is None or rec.state != "pending":
            return
        rec.state = env.type.removeprefix("approval.")
        rec.decided_at = env.occurred_at.timestamp()
        rec.decided_by = env.actor
        rec.comment = out.comment
        rec.decision_policy_version = env.policy_version


#: The approval view's dispatch table (the admission follower routes approval events here;
#: unknown types are counted by the job view, which sees every event of that follower).
APPROVAL_VIEW_EVENTS: EventTable = EventTable({
    EventType.APPROVAL_REQUESTED: ApprovalView._on_requested,
    **{t: ApprovalView._on_outcome for t in APPROVAL_OUTCOMES},
})
