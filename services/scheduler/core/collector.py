"""Garbage-collector settings for a process that runs scheduling cycles (not used by decide).

One :func:`~.decide.decide` call over a large view allocates hundreds of thousands of container
objects that live until the cycle ends (evaluations, score terms, fits, cache keys). With
CPython's default thresholds ``(700, 10, 10)`` the cyclic collector then runs about 800 young
and 70 middle collections per 10,000-job cycle, and full ones that walk the whole heap (the
500,000 nodes of a 100 x 5,000-node view among it): a quarter of a steady cycle's CPU at that
scale (issue 15; ``bench/core_throughput.py --gc default`` shows it). The cycle's objects are
freed by reference counting, not by the collector, so collecting less often costs no memory
but the (rare) cyclic garbage that waits a little longer.

The scheduler service raises the thresholds at start-up and the benchmark does the same, so the
bench measures what the service runs.
"""

from __future__ import annotations

from fedsched.gctune import raise_thresholds

#: (young, middle, old) thresholds: a young collection every 50,000 net allocations (~14 per
#: 10,000-job steady cycle instead of ~800), a middle one every 20 young, a full one every 100
#: middle ones (CPython also waits for 25% more long-lived objects before a full one)
CYCLE_THRESHOLDS = (50_000, 20, 100)


def raise_gc_thresholds(thresholds: tuple[int, int, int] = CYCLE_THRESHOLDS) -> tuple[int, int, int]:
    """Raise the collector's thresholds to at least ``thresholds`` (each kept if already
    higher, so a process that tuned its own is not made to collect more often; 0 = disabled
    stays disabled).

    Returns:
        The thresholds before the call (to restore them).
    """
    return raise_thresholds(thresholds)
