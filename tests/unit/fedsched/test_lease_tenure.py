"""Which orders are stale (fedsched.lease.stale_order): the highest token seen on the stream,
and the lease's current tenure read from the KV (issue 14: a receiver that has seen no order of
the new holder yet) with the earlier tenures the record remembers (an order stored between two
takeovers, judged after the second)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fedsched.lease import TENURE_HISTORY, Lease, LeaseRecord, Tenure, stale_order, tenure_of
from tests.builders import FakeClock, FakeLeaseStore

TTL = 3.0

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


# --------------------------------------------------------------------------- the tenure history
# Three tenures: t1 = 5 (began 100), t2 = 9 (began 200), t3 = 12 (began 300, current); a
# receiver that saw no order of t2 judges an order of t1 after t3 began.
T3 = Tenure(token=12, since=300.0, holder="sched-c", history=((5, 100.0), (9, 200.0)))
T3_ALONE = Tenure(token=12, since=300.0, holder="sched-c")

HISTORY_CASES = [
    # (token, stored_at, tenure, stale?)
    pytest.param(5, 250.0, T3, True, id="t1-stored-after-t2-began-judged-in-t3"),
    pytest.param(5, 250.0, T3_ALONE, False, id="without-the-history-the-gap-the-issue-names"),
    pytest.param(5, 200.0, T3, True, id="t1-stored-the-instant-t2-began"),
    pytest.param(5, 150.0, T3, False, id="t1-stored-in-its-own-tenure-read-late"),
    pytest.param(9, 250.0, T3, False, id="t2-stored-in-its-own-tenure-read-late"),
    pytest.param(9, 300.0, T3, True, id="t2-stored-after-t3-began"),
    pytest.param(3, 50.0, T3, False, id="older-than-the-history-stored-before-its-oldest"),
    pytest.param(3, 150.0, Tenure(12, 300.0, "c", ((5, 100.0),)), True, id="older-than-the-history-after-its-oldest"),
    pytest.param(12, 350.0, T3, False, id="the-current-holders-order"),
    pytest.param(5, None, T3, True, id="unknown-store-time"),
    pytest.param(5, 250.0, Tenure(12, 300.0, "c", ((5, 100.0), (7, 180.0))), True, id="a-release-in-the-history"),
]


@pytest.mark.parametrize("token,stored_at,tenure,stale", HISTORY_CASES)
def test_stale_order_with_the_tenure_history(token, stored_at, tenure, stale) -> None:
    assert (stale_order(token, stored_at, 0, tenure) is not None) == stale


def test_the_reason_names_the_earlier_tenure() -> None:
    assert stale_order(5, 250.0, 0, T3) == ("stale fencing token: 5 is below 9, an earlier tenure of the scheduler "
                                           "lease (since 200.000), which began before the order was stored")


def test_a_record_carries_its_tenures_and_drops_an_unreadable_list() -> None:
    record = LeaseRecord("c", 1.5, 0, token=12, since=300.0, tenures=((5, 100.0), (9, 200.0)))
    assert LeaseRecord.from_bytes(record.to_bytes(), 14) == replace(record, revision=14)
    body = json.loads(record.to_bytes())
    body["tenures"] = "garbage"
    assert LeaseRecord.from_bytes(json.dumps(body).encode(), 14) == replace(record, revision=14, tenures=())
    assert b"tenures" not in LeaseRecord("a", 1.5).to_bytes()


def test_an_unknown_start_is_read_as_the_next_known_one() -> None:
    record = LeaseRecord("c", 1.5, 20, token=12, since=300.0, tenures=((5, 0.0), (9, 200.0), (10, 0.0)))
    assert tenure_of(record, 400.0).history == ((5, 200.0), (9, 200.0), (10, 300.0))
    acquisition = LeaseRecord("c", 1.5, 12, tenures=((9, 200.0),))
    assert tenure_of(acquisition, 300.0) == Tenure(12, 300.0, "c", ((9, 200.0),))


async def _takeovers(holders: list[str], *, release: bool):
    """Each holder in turn takes the lease from the one before (who releases it, or dies and is
    waited out); returns the store, the clock and the leases."""
    clock = FakeClock()
    store = FakeLeaseStore(clock)
    leases = []
    for name in holders:
        lease = Lease(store.client(name), "scheduler", name, clock, ttl_s=TTL)
        if leases and release:
            await leases[-1].release()
        elif leases:
            leases[-1].abandon()
        clock.advance(1.0)
        while not await lease.step():  # a standby waits out the silent holder's TTL
            clock.advance(0.5)
        leases.append(lease)
        clock.advance(1.0)
        for _ in range(2):  # renewals carry the history on
            clock.advance(lease.renew_every_s)
            await lease.step()
    return store, clock, leases


@pytest.mark.parametrize("release", [True, False], ids=["released", "waited-out"])
async def test_every_write_carries_the_earlier_tenures_and_receivers_judge_by_them(release) -> None:
    store, clock, (a, b, c) = await _takeovers(["a", "b", "c"], release=release)
    record = store.records["scheduler"]
    tenure = tenure_of(record, store.times[record.revision])
    assert (tenure.token, tenure.since, tenure.holder) == (c.token, c.since, "c")
    tokens = [t for t, _ in tenure.history]
    assert tokens[0] == a.token and b.token in tokens and len(tokens) == (4 if release else 2)  # + 2 releases
    assert dict(tenure.history)[b.token] == b.since and a.since < b.since < c.since
    # a's order stored after b began (receiver saw nothing of b), judged in c's tenure: stale
    between = (b.since + c.since) / 2
    assert stale_order(a.token, between, 0, tenure) is not None
    assert stale_order(a.token, a.since + 0.5, 0, tenure) is None  # stored while a held it
    assert stale_order(b.token, between, 0, tenure) is None        # b's own, read late
    assert stale_order(b.token, c.since, 0, tenure) is not None


async def test_the_history_is_bounded_and_keeps_the_newest() -> None:
    n = TENURE_HISTORY + 5
    store, _, leases = await _takeovers([f"h{i}" for i in range(n)], release=False)
    record = store.records["scheduler"]
    assert len(record.tenures) == TENURE_HISTORY
    assert [t for t, _ in record.tenures] == [x.token for x in leases[-TENURE_HISTORY - 1:-1]]
