"""Which orders are stale (fedsched.lease.stale_order): the highest token seen on the stream,
and the lease's current tenure read from the KV (issue 14: a receiver that has seen no order of
the new holder yet)."""

from __future__ import annotations

import pytest

from fedsched.lease import LeaseRecord, Tenure, stale_order

B = Tenure(token=9, since=100.0, holder="sched-b")

CASES = [
    # (token, stored_at, highest seen, tenure, stale?)
    pytest.param(9, 150.0, 0, B, False, id="the-holders-own-order"),
    pytest.param(12, 150.0, 9, B, False, id="a-newer-token-than-known"),
    pytest.param(5, 150.0, 0, B, True, id="former-holder-after-the-takeover-nothing-seen"),
    pytest.param(5, 100.0, 0, B, True, id="stored-the-instant-the-tenure-began"),
    pytest.param(5, 50.0, 0, B, False, id="former-holder-before-the-takeover-read-late"),
    pytest.param(5, 50.0, 7, B, True, id="below-the-highest-seen-whenever-stored"),
    pytest.param(5, None, 0, B, True, id="unknown-store-time-counts-as-now"),
    pytest.param(5, 150.0, 0, None, False, id="no-lease-only-the-highest-seen"),
    pytest.param(5, 150.0, 6, None, True, id="no-lease-below-the-highest-seen"),
    pytest.param(5, 150.0, 0, Tenure(11, 120.0, ""), True, id="released-after-the-order-holder"),
]


@pytest.mark.parametrize("token,stored_at,highest,tenure,stale", CASES)
def test_stale_order(token, stored_at, highest, tenure, stale) -> None:
    assert (stale_order(token, stored_at, highest, tenure) is not None) == stale


def test_the_reason_names_both_tokens_and_the_holder() -> None:
    assert stale_order(5, 150.0, 0, B) == ("stale fencing token: 5 is below 9, the scheduler lease's current tenure "
                                          "(held by sched-b), which began before the order was stored")


def test_a_renewal_carries_its_tenure_and_an_acquisition_does_not() -> None:
    renewal = LeaseRecord("a", 1.5, 0, token=7, since=123.5)
    assert LeaseRecord.from_bytes(renewal.to_bytes(), 9) == LeaseRecord("a", 1.5, 9, 7, 123.5)
    acquisition = LeaseRecord("a", 1.5)
    assert b"token" not in acquisition.to_bytes()
    assert LeaseRecord.from_bytes(acquisition.to_bytes(), 7) == LeaseRecord("a", 1.5, 7)
