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
