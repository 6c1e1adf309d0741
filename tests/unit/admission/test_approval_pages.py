"""ListApprovals pages: newest decision first for the console's "decided" list, oldest request
first as before, opaque tokens bound to the filters and order, every request exactly once."""

from __future__ import annotations

import pytest

from fedsched import auth
from fedsched.api.v1 import governance_pb2 as gpb
from fedsched.auth import Grant, Principal
from fedsched.errors import ValidationError
from services.admission.admin_servicers import ApprovalServicer
from services.admission.approvalview import ApprovalRecord, ApprovalView

DECIDED = [gpb.APPROVAL_STATE_APPROVED, gpb.APPROVAL_STATE_REJECTED, gpb.APPROVAL_STATE_EXPIRED]


def _record(i: int, *, tenant: str = "ads", decided_at: float | None, state: str = "approved") -> ApprovalRecord:
    return ApprovalRecord(f"ap-{i:020x}", f"j-{i}", tenant, "train", "cn-north-1", "cn-east-1", "cn-east-1-a",
                          "nvidia-t4-16gb", "home full", "1.00", "2.00", "CNY", 0.0, requested_at=1000.0 + i,
                          expires_at=9e9, policy_version="v1", state=state if decided_at else "pending",
                          decided_at=decided_at)


@pytest.fixture
def servicer():
    view = ApprovalView()
    # request order 0..1199; decisions in another order (request i decided at 5000 - 3i for even i,
    # 9000 + i for odd i), 40 still pending, and 10 of a tenant the caller does not approve for
    for i in range(1200):
        decided_at = None if i % 30 == 0 else (5000.0 - 3 * i if i % 2 == 0 else 9000.0 + i)
        view.by_id[_record(i, decided_at=decided_at).approval_id] = _record(i, decided_at=decided_at)
    for i in range(2000, 2010):
        view.by_id[_record(i, tenant="search", decided_at=9e6).approval_id] = _record(i, tenant="search",
                                                                                       decided_at=9e6)
    token = auth.CURRENT.set(Principal("ann", (Grant("approver", frozenset({"ads"})),)))
    yield ApprovalServicer(None, None, None, None, view, None), view
    auth.CURRENT.reset(token)


async def _all_pages(svc, request: gpb.ListApprovalsRequest) -> tuple[list[gpb.Approval], int, int]:
    out, pages = [], 0
    while True:
        resp = await svc.ListApprovals(request, None)
        out += resp.approvals
        pages += 1
        if not resp.next_page_token:
            return out, resp.total, pages
        request = gpb.ListApprovalsRequest(**{**{f.name: v for f, v in request.ListFields()},
                                              "page_token": resp.next_page_token})


async def test_decided_newest_first_pages_through_every_decision_once(servicer):
    svc, view = servicer
    want = sorted((r for r in view.by_id.values() if r.decided_at and r.tenant == "ads"),
                  key=lambda r: (-r.decided_at, r.approval_id))
    assert len(want) == 1160  # more than the 1000 the console used to ask for
    first = await svc.ListApprovals(gpb.ListApprovalsRequest(states=DECIDED, page_size=50,
                                                             order=gpb.APPROVAL_ORDER_NEWEST_FIRST), None)
    assert [a.approval_id for a in first.approvals] == [r.approval_id for r in want[:50]]
    assert first.total == 1160 and first.next_page_token
    listed, total, pages = await _all_pages(svc, gpb.ListApprovalsRequest(
        states=DECIDED, page_size=50, order=gpb.APPROVAL_ORDER_NEWEST_FIRST))
    assert [a.approval_id for a in listed] == [r.approval_id for r in want] and total == 1160 and pages == 24
    decided_at = [a.decided_at.ToDatetime().timestamp() for a in listed]
    assert decided_at == sorted(decided_at, reverse=True)


async def test_the_default_order_is_still_oldest_request_first(servicer):
    svc, view = servicer
    listed, total, _ = await _all_pages(svc, gpb.ListApprovalsRequest(page_size=333))
    want = sorted((r for r in view.by_id.values() if r.tenant == "ads"), key=lambda r: r.requested_at)
    assert [a.approval_id for a in listed] == [r.approval_id for r in want] and total == 1200


@pytest.mark.parametrize("token, other", [
    ("nonsense", {}),
    (None, {"states": [gpb.APPROVAL_STATE_PENDING]}),
    (None, {"order": gpb.APPROVAL_ORDER_OLDEST_FIRST}),
], ids=["not-a-token", "other-states", "other-order"])
async def test_a_token_for_other_filters_or_order_is_refused(servicer, token, other):
    svc, _ = servicer
    base = dict(states=DECIDED, page_size=10, order=gpb.APPROVAL_ORDER_NEWEST_FIRST)
    if token is None:
        token = (await svc.ListApprovals(gpb.ListApprovalsRequest(**base), None)).next_page_token
    with pytest.raises(ValidationError, match="page_token"):
        await svc.ListApprovals(gpb.ListApprovalsRequest(**{**base, **other, "page_token": token}), None)
