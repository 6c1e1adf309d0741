"""The scheduler lease's rules (:mod:`fedsched.lease`) on a fake compare-and-set store and fake clocks.

Two replicas A and B, TTL 3 s (renewal every 1 s, margin 0.6 s). Each replica has its own clock
(only differences on one replica count) and its own view of the store, so an outage can hit one.
"""

from __future__ import annotations

import pytest

from fedsched.lease import Lease, LeaseRecord
from tests.builders import FakeClock, FakeLeaseStore

TTL = 3.0


def _pair(store: FakeLeaseStore | None = None):
    store = store or FakeLeaseStore()
    clock = FakeClock()  # one clock for both: the test moves time for everyone
    a = Lease(store.client("a"), "scheduler", "a", clock, ttl_s=TTL)
    b = Lease(store.client("b"), "scheduler", "b", clock, ttl_s=TTL)
    return store, clock, a, b


async def _run(clock: FakeClock, leases, seconds: float, tick: float = 0.25) -> list[tuple[float, list[bool]]]:
    """Step every lease every ``tick`` for ``seconds``; the states after each round."""
    out = []
    end = clock.now + seconds
    while clock.now < end:
        clock.advance(tick)
        for lease in leases:
            await lease.step()
        out.append((clock.now, [lease.is_active() for lease in leases]))
    return out


async def test_the_first_replica_acquires_by_create_and_its_token_is_the_revision() -> None:
    store, clock, a, b = _pair()
    assert await a.step() is True
    assert await b.step() is False
    assert a.token == 1 and store.records["scheduler"] == LeaseRecord("a", TTL, 1)
    assert b.token == 0


async def test_renewals_keep_the_token_and_keep_the_standby_out() -> None:
    store, clock, a, b = _pair()
    await a.step()
    history = await _run(clock, [a, b], 5 * TTL)
    assert all(states == [True, False] for _, states in history)
    assert a.token == 1 and store.records["scheduler"].revision > 10  # renewed by CAS many times


async def test_a_silent_holder_is_replaced_after_the_ttl_the_standby_observed() -> None:
    store, clock, a, b = _pair()
    await a.step()
    await b.step()            # b sees a's record now (t0)
    a.abandon()               # a dies: no renewal, no release
    seen_at = clock.now
    history = await _run(clock, [b], 2 * TTL, tick=0.1)
    took_over = next(t for t, (active,) in history if active)
    assert TTL <= took_over - seen_at < TTL + 0.2
    assert b.token > 1        # a newer revision: orders of a are now stale


async def test_the_standby_counts_the_ttl_from_the_last_change_it_saw() -> None:
    store, clock, a, b = _pair()
    await a.step()
    await b.step()
    clock.advance(2.0)
    await a.step()            # a renews (within its validity of 2.4 s); b does not look meanwhile
    a.abandon()
    renewed_at = clock.now
    clock.advance(1.5)        # 3.5 s after b's first sighting, 1.5 s after the renewal
    assert await b.step() is False   # b sees a new revision: its wait starts again
    history = await _run(clock, [b], 2 * TTL, tick=0.1)
    took_over = next(t for t, (active,) in history if active)
    assert took_over - renewed_at >= TTL


async def test_a_renewal_that_loses_the_compare_and_set_loses_the_lease_at_once() -> None:
    store, clock, a, b = _pair()
    await a.step()
    changes = []
    a.on_change.append(changes.append)
    intruder = store.client("x")
    await intruder.update("scheduler", LeaseRecord("x", TTL), store.records["scheduler"].revision)
    clock.advance(a.renew_every_s)
    assert await a.step() is False
    assert changes == [False]


async def test_a_holder_cut_off_from_the_store_stops_before_anyone_else_can_start() -> None:
    store, clock, a, b = _pair()
    await a.step()
    await b.step()
    store.down.add("a")       # a's renewals fail; b still reaches the store
    history = await _run(clock, [a, b], 3 * TTL, tick=0.05)
    assert all(states != [True, True] for _, states in history)  # never two active
    a_end = next(t for t, (ha, _) in history if not ha)
    b_start = next(t for t, (_, hb) in history if hb)
    assert a_end < b_start
    assert b_start - a_end >= a.margin_s - 0.06


async def test_a_released_lease_is_taken_at_the_next_step() -> None:
    store, clock, a, b = _pair()
    await a.step()
    await b.step()
    await a.release()
    assert not a.is_active()
    clock.advance(0.1)
    assert await b.step() is True
    assert b.token > a.token


async def test_a_replica_that_lost_the_lease_can_win_it_back_with_a_newer_token() -> None:
    store, clock, a, b = _pair()
    await a.step()
    first = a.token
    await b.step()
    await b.release()  # no-op: b never held it
    await a.release()
    await b.step()
    await b.release()
    assert await a.step() is True
    assert a.token > b.token > first


@pytest.mark.parametrize("kw", [{"ttl_s": 0}, {"ttl_s": 3, "renew_every_s": 2.5}, {"ttl_s": 3, "margin_s": 3}],
                         ids=["zero ttl", "renewal slower than the validity", "margin as long as the ttl"])
def test_impossible_timings_are_refused(kw) -> None:
    with pytest.raises(ValueError):
        Lease(FakeLeaseStore().client("a"), "scheduler", "a", FakeClock(), **kw)


async def test_a_holder_cut_off_briefly_resumes_with_a_new_token_when_nobody_took_over() -> None:
    store, clock, a, b = _pair()
    await a.step()
    store.down.add("a")
    clock.advance(TTL)              # validity ran out: a stopped
    assert await a.step() is False
    store.down.discard("a")
    clock.advance(0.1)
    assert await a.step() is True   # its record is still the newest: a new tenure at once
    assert a.token > 1


async def test_a_cut_off_holder_does_not_resume_over_a_standby_that_took_over() -> None:
    store, clock, a, b = _pair()
    await a.step()
    await b.step()
    store.down.add("a")
    history = await _run(clock, [b], 2 * TTL, tick=0.1)
    assert history[-1][1] == [True]
    store.down.discard("a")
    assert await a.step() is False and b.is_active()


async def test_a_routine_acquisition_is_info_and_a_takeover_from_a_silent_holder_a_warning(caplog) -> None:
    import logging

    store, clock, a, b = _pair()
    with caplog.at_level(logging.INFO, logger="fedsched.lease"):
        await a.step()
        await b.step()
        a.abandon()
        await _run(clock, [b], 2 * TTL, tick=0.1)
    acquired = [(r.levelno, r.getMessage()) for r in caplog.records if "acquired" in r.getMessage()]
    assert acquired == [(logging.INFO, "lease scheduler: acquired by a (fencing token 1)"),
                        (logging.WARNING, f"lease scheduler: acquired by b (fencing token {b.token}), "
                                          "taking over from a")]
