"""Cyclic garbage collector settings for a long-running service process (issue 15).

A service process holds a large heap that lives as long as it does (modules, pydantic schemas,
the chDB client, decoded envelopes shared between readers) and makes many short-lived objects
per message. With CPython's defaults (young threshold 700) the collector runs a young
collection every 700 allocations and, as survivors pile up, full collections that walk the
whole heap: in the store process (audit + billing) those took ~0.5 s each, several times per
5,000 jobs (``bench/store_cpu.py``: 2.6 s of collections for 4,000 jobs at 300/s).

:func:`tune_for_service` collects once, then moves everything alive at start-up to the permanent generation
(:func:`gc.freeze`: collections never walk it again) and raises the young threshold, never
lowering one already higher (an embedded sibling service may have set its own). Cycles are
still collected, only less often.

Freezing is for a process that runs one federation until it exits: a frozen object is never
examined by the collector again, so a service that stops in a process that goes on (a test
session, a benchmark that starts a system per policy) would stay in memory through its reference
cycles. So :func:`tune_for_service` does nothing until the process's entry point called
:func:`enable_for_process` (``fedsched up`` / ``service`` / ``replay`` and the children of ``up
--processes``); services only ask for it.
"""

from __future__ import annotations

import gc

#: Young-generation threshold for a service process (allocations between young collections).
YOUNG_THRESHOLD = 20_000

_enabled = False


def enable_for_process() -> None:
    """Let services of this process tune the collector (:func:`tune_for_service`): called once
    by an entry point whose process runs one federation until it exits."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    """Whether :func:`enable_for_process` was called in this process."""
    return _enabled


def tune_for_service(young: int = YOUNG_THRESHOLD) -> tuple[int, int, int]:
    """Freeze the heap alive now and raise the young threshold to ``young`` (0: only freeze);
    nothing unless :func:`enable_for_process` was called (see the module docstring).

    Returns:
        The thresholds before the call (to restore them, e.g. in a test).
    """
    if not _enabled:
        return gc.get_threshold()
    gc.collect()  # garbage now is not frozen with the live heap
    gc.freeze()
    return raise_thresholds((young, 0, 0))


def raise_thresholds(thresholds: tuple[int, int, int]) -> tuple[int, int, int]:
    """Raise the collector's (young, middle, old) thresholds to at least ``thresholds``: each is
    kept if already higher (a process that tuned its own, or an embedded sibling service, is not
    made to collect more often), a 0 in ``thresholds`` keeps the current value, and a current 0
    (collection disabled) stays 0.

    Returns:
        The thresholds before the call (to restore them).
    """
    before = gc.get_threshold()
    after = tuple(old if old == 0 or old >= new else new for old, new in zip(before, thresholds))
    gc.set_threshold(*after)
    return before
