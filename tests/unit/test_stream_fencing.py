"""``fedsched.lease.StreamFencing``: fencing tokens judged in stream order, whatever order the
messages are handled in (property: the verdicts equal those of handling in stream order with the
plain "below the highest seen" rule)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from fedsched.lease import StreamFencing


def _in_order(orders: list[tuple[int, int]]) -> dict[int, bool]:
    highest, out = 0, {}
    for seq, token in sorted(orders):
        out[seq] = token < highest
        highest = max(highest, token)
    return out


@given(st.lists(st.integers(1, 6), min_size=1, max_size=30), st.randoms(use_true_random=False))
def test_any_handling_order_gives_the_stream_order_verdicts(tokens: list[int], rnd) -> None:
    orders = list(enumerate(tokens, start=1))      # (stream sequence, token)
    expected = _in_order(orders)
    shuffled = orders[:]
    rnd.shuffle(shuffled)
    fencing = StreamFencing()
    for seq, token in shuffled:
        fencing.stale(token, seq)
    # once every order was handled, each verdict is the stream-order one
    assert {seq: fencing.stale(token, seq) for seq, token in orders} == expected


def test_a_late_order_below_a_preceding_higher_token_is_stale() -> None:
    f = StreamFencing()
    assert not f.stale(6, 40)
    assert not f.stale(1, 30)   # published before token 6 appeared: valid
    assert f.stale(1, 41)       # after it: a former holder's late order
    assert f.highest == 6


def test_memory_is_bounded_by_tenures() -> None:
    f = StreamFencing(keep=3)
    for token in range(1, 11):
        f.stale(token, token * 10)
    assert len(f._first) == 3 and f.highest == 10
    assert f.stale(1, 5) is False and f.stale(1, 1000) is True


# -- tokens issued by no tenure (the tryout: one job.placed with token 2^62 poisoned fencing) ----

class _D:
    """The two fields of a :class:`fedsched.bus.Delivery` that fencing reads."""

    def __init__(self, seq: int, at: float) -> None:
        self.stream_sequence, self.published_at = seq, at


FORGED = 2 ** 62


def test_a_token_above_the_lease_is_refused_and_not_taken_as_highest() -> None:
    from fedsched.lease import Tenure
    tenure = Tenure(41, 1000.0, "sched-a")
    f = StreamFencing()
    reason = f.judge(FORGED, _D(10, 1001.0), tenure)
    assert reason == f"fencing token {FORGED} was issued by no tenure (the lease's current token is 41)"
    assert f.highest == 0
    # the real holder's later orders are carried out
    assert f.judge(41, _D(11, 1002.0), tenure) is None
    assert f.judge(41, _D(12, 1003.0), tenure) is None
    assert f.highest == 41
    # the redelivery check does not record it either
    assert f.stale(FORGED, 13, tenure) is False and f.highest == 41


def test_a_token_equal_to_the_lease_is_issued() -> None:
    from fedsched.lease import Tenure, unissued
    assert unissued(41, Tenure(41, 0.0)) is None
    assert unissued(42, Tenure(41, 0.0)) is not None
    assert unissued(FORGED, None) is None  # no lease read: nothing to judge by


def test_a_restart_reading_the_stream_again_is_not_poisoned() -> None:
    """A receiver that re-reads the stream after a restart (the agent's rebuild) judges the forged
    order with the tenure read then: still refused, still not recorded."""
    from fedsched.lease import Tenure
    tenure = Tenure(41, 1000.0, "sched-a")
    again = StreamFencing()
    assert again.judge(FORGED, _D(10, 1001.0), tenure) is not None
    assert again.judge(41, _D(11, 1002.0), tenure) is None
    assert again.highest == 41
