"""What the tenant, approval and policy servicers use of the admission service.

:class:`~services.admission.service.AdmissionService` satisfies :class:`AdmissionContext`; the
servicers (:mod:`services.admission.admin_servicers`) are typed against this protocol instead of
the service class, so the service module can import the servicers without an import cycle.
"""

from __future__ import annotations

from typing import Protocol

from fedsched.bus import Bus
from fedsched.clock import Clock
from fedsched.tenancy import Governance
from fedsched.policystore import PolicyHolder
from services.admission.approvalview import ApprovalView
from services.admission.budgets import SpendBook
from services.admission.jobview import JobView


class PolicySource(Protocol):
    """Gives the governance policy in force."""

    def gov(self) -> Governance:
        """The policy in force.

        Raises:
            UnavailableError: no policy has been applied yet.
        """
        ...


class AdmissionContext(Protocol):
    """The admission service's state the servicers read and update.

    Attributes:
        bus: the NATS connection (publishing events, the policy KV bucket).
        clock: the business clock (seconds since the epoch, UTC).
        policy: the newest stored policy (followed from NATS KV).
        view: the job read model.
        approvals: the approval read model.
        spend: the billed spend per tenant x month (budgets).
        servicer: the job servicer, for the policy in force.
    """

    bus: Bus
    clock: Clock
    policy: PolicyHolder
    view: JobView
    approvals: ApprovalView
    spend: SpendBook
    servicer: PolicySource
