"""A service process's collector settings (issue 15, :mod:`fedsched.gctune`): the heap alive at
start-up leaves the collections' walks, the young threshold is raised and never lowered."""

from __future__ import annotations

import gc

import pytest

from fedsched import gctune
from fedsched.gctune import tune_for_service


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    """These tests tune this process's collector as an entry point would allow."""
    monkeypatch.setattr(gctune, "_enabled", True)


class _Probe:
    """A tracked object alive when the tuning runs."""


def test_the_start_up_heap_is_frozen_and_the_young_threshold_raised() -> None:
    probe = _Probe()
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        assert tune_for_service(20_000)[0] == 700
        assert gc.get_threshold()[0] == 20_000 and gc.get_threshold()[1:] == before[1:]
        assert gc.is_tracked(probe) and not any(o is probe for o in gc.get_objects())  # out of every walk
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_higher_young_threshold_is_kept() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(50_000, *before[1:])
        tune_for_service(20_000)
        assert gc.get_threshold()[0] == 50_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_frozen_object_still_dies_by_reference_count_and_zero_keeps_the_thresholds() -> None:
    """The scheduler freezes its rebuilt book with ``tune_for_service(0)``: thresholds unchanged,
    the book out of the collections' walks, and what it drops freed as before."""
    import weakref

    before = gc.get_threshold()
    try:
        probe = _Probe()
        gone = weakref.ref(probe)
        assert tune_for_service(0) == before and gc.get_threshold() == before
        assert gc.get_freeze_count() > 0 and not any(o is probe for o in gc.get_objects())
        del probe
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_nothing_is_frozen_unless_the_process_entry_point_allowed_it(monkeypatch) -> None:
    """A service stopped in a process that goes on (a test session, a bench starting a system per
    policy) must stay collectable: without enable_for_process, tune_for_service does nothing."""
    import weakref

    monkeypatch.setattr(gctune, "_enabled", False)
    before = gc.get_threshold()

    class Service:  # a reference cycle, as a service holding its own bound method
        def __init__(self) -> None:
            self.callback = self.run

        def run(self) -> None: ...

    svc = Service()
    gone = weakref.ref(svc)
    assert tune_for_service(20_000) == before and gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    del svc
    gc.collect()
    assert gone() is None


# ---------------------------------------------------------------- the process policy


@pytest.fixture()
def policy(monkeypatch):
    """A fresh :class:`~fedsched.gctune.CollectorPolicy` installed in this process for one test,
    then removed with everything it froze given back to the collector."""
    before = gc.get_threshold()
    p = gctune.CollectorPolicy()
    p.install(50_000)
    try:
        yield p
    finally:
        p.uninstall()
        gc.unfreeze()
        gc.set_threshold(*before)
        gc.collect()


class _Node:
    def __init__(self) -> None:
        self.other = None


def test_the_survivors_of_every_collection_are_frozen_and_never_walked_again(policy) -> None:
    survivor = _Probe()
    assert any(o is survivor for o in gc.get_objects())  # young: the next collection walks it
    gc.collect(0)
    assert policy.freezes >= 1
    assert gc.is_tracked(survivor) and not any(o is survivor for o in gc.get_objects())


def test_garbage_freed_by_reference_count_is_not_held_by_the_freeze(policy) -> None:
    import weakref

    probe = _Probe()
    gc.collect(0)  # frozen now
    gone = weakref.ref(probe)
    del probe
    assert gone() is None


def test_a_frozen_cycle_is_freed_by_the_next_compaction(policy) -> None:
    import weakref

    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gc.collect(0)  # both frozen while alive
    gone = weakref.ref(a)
    del a, b  # a cycle: reference counting cannot free it, and collections no longer see it
    gc.collect()
    assert gone() is not None
    freed = policy.compact()
    assert gone() is None and freed >= 2
    assert policy.compactions == 1 and policy.base == gc.get_freeze_count()


def test_the_loop_compacts_once_the_frozen_heap_has_grown_past_the_factor(policy, monkeypatch) -> None:
    """An estimated growth past COMPACT_GROWTH x the heap at the last compaction (and past
    COMPACT_MIN) asks the running loop for a check -- not inside the collection --, which counts
    the frozen heap and compacts once."""
    import asyncio

    monkeypatch.setattr(gctune, "COMPACT_MIN", 0)

    async def main() -> None:
        policy.base = policy.estimate = 1  # as if the heap had been one object at the last compaction
        keep = [_Probe() for _ in range(100)]
        gc.collect(0)
        assert policy.compactions == 0 and policy._check_scheduled  # asked, not run inside the collection
        await asyncio.sleep(0)
        assert policy.compactions == 1 and not policy._check_scheduled
        gc.collect(0)  # no growth since: no second compaction
        await asyncio.sleep(0)
        assert policy.compactions == 1
        del keep

    asyncio.run(main())


def test_an_estimate_the_true_count_does_not_confirm_restarts_from_the_count(policy, monkeypatch) -> None:
    """Frozen objects that died since are not in the estimate: the check counts, and without
    real growth it only resets the estimate (no compaction)."""
    monkeypatch.setattr(gctune, "COMPACT_MIN", 0)
    true = gc.get_freeze_count()
    policy.base, policy.estimate = true, 10 * true + 10
    assert policy.check() is False and policy.compactions == 0
    assert policy.base == policy.estimate == true


def test_the_hook_never_counts_the_frozen_heap(policy, monkeypatch) -> None:
    """gc.get_freeze_count walks the permanent generation (78 ms at ~1M objects): the hook,
    run after every collection, must not call it."""
    calls = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gctune.gc, "get_freeze_count", lambda: calls.append(1) or real())
    keep = [_Probe() for _ in range(1000)]
    for _ in range(5):
        gc.collect(0)
    assert policy.freezes >= 5 and calls == []
    assert policy.estimate >= policy.base  # what the collections froze was added up
    del keep


def test_enable_for_process_installs_the_policy_once(monkeypatch) -> None:
    before = gc.get_threshold()
    fresh = gctune.CollectorPolicy()
    monkeypatch.setattr(gctune, "policy", fresh)
    try:
        gctune.enable_for_process()
        gctune.enable_for_process()
        assert gc.callbacks.count(fresh.after_collection) == 1
        assert gc.get_threshold()[0] >= gctune.YOUNG_THRESHOLD
    finally:
        fresh.uninstall()
        gc.unfreeze()
        gc.set_threshold(*before)
