"""The collector thresholds a scheduling process runs with (services/scheduler/core/collector.py)."""

import gc

import pytest

from services.scheduler.core.collector import CYCLE_THRESHOLDS, raise_gc_thresholds


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.parametrize("start, expected", [
    ((700, 10, 10), CYCLE_THRESHOLDS),  # CPython's default: raised
    ((100_000, 5, 1000), (100_000, 20, 1000)),  # higher ones are kept, lower ones raised
    ((0, 10, 10), (0, 20, 100)),  # a disabled collector stays disabled
], ids=["default", "keeps-higher", "keeps-disabled"])
def test_thresholds_are_raised_never_lowered(thresholds, start, expected):
    gc.set_threshold(*start)
    assert raise_gc_thresholds() == start
    assert gc.get_threshold() == expected
