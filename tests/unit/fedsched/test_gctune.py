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
