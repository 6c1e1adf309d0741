"""The cyclic garbage collector's policy for a long-running service process (issue 15).

A service process holds a large heap that lives as long as its jobs do (queued and running
jobs, their specs and placements, the read models) and makes many short-lived objects per
message. CPython's collector (3.11: generations with thresholds ``(700, 10, 10)``) walks every
container that survived a young collection again in each middle collection, and walks the
whole heap in every full one -- started whenever the long-lived heap grew by a quarter. With
100,000 running jobs the e2e bench measured (``bench/e2e_throughput.py --mode processes --jobs
60000``, CPU of the collections from ``gc.callbacks``): 20-48% of each service process's CPU in
collections, single pauses of 0.3-1.4 s of CPU (the agents' process, left at the defaults, spent
13 s of its 33 s in full collections), and loop stalls long enough for the scheduler to lose its
lease.

The policy (:func:`enable_for_process`, installed once by a process's entry point):

* **Freeze the survivors.** After every collection, whatever is still alive is moved to the
  permanent generation (:func:`gc.freeze`): no later collection walks it again. So each
  long-lived container is walked once, by the young collection that found it alive, and the
  heap's size no longer sets the cost or the pause of a collection (the pause is bounded by the
  young threshold: tens of milliseconds). A frozen object still dies by reference count; only
  reference *cycles* that become garbage after they were frozen wait (measured: 370-41,000 such
  objects per 60,000 jobs, against 1.1-2.2 million frozen).
* **Compact when the frozen heap has grown** :data:`COMPACT_GROWTH` fold since the last
  compaction (and past :data:`COMPACT_MIN` objects): unfreeze, one full collection (frees those
  cycles), freeze again. Like CPython's own rule for full collections, the cost is amortised --
  each object is walked again only after the heap it lives in has quadrupled -- but it comes four
  times less often than CPython's 25 % rule, from the event loop (never inside another
  collection), and is logged with its pause.
* **Young threshold** :data:`YOUNG_THRESHOLD` (net allocations of containers between young
  collections): few collections, each walking what is alive at that moment.

Freezing is for a process that runs one federation until it exits: a service that stops in a
process that goes on (a test session, a benchmark that starts a system per policy) would keep
its frozen cycles until the next compaction. So nothing here acts until the process's entry
point called :func:`enable_for_process` (``fedsched up`` / ``service`` / ``replay`` and the
children of ``up --processes``); services only say when their rebuilt state is in place
(:func:`tune_for_service`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger(__name__)

#: Young-generation threshold for a service process (net container allocations between young
#: collections).
YOUNG_THRESHOLD = 50_000

#: Compact (unfreeze + full collection + freeze) once the frozen heap is this many times the
#: size it had after the previous compaction.
COMPACT_GROWTH = 4

#: ... and only once it holds more than this many objects (a small heap's cycles cost little).
COMPACT_MIN = 1_000_000

_enabled = False


class CollectorPolicy:
    """The installed policy's state (see the module docstring); one per process.

    :func:`gc.get_freeze_count` walks the whole permanent generation (78 ms at ~1M objects), so
    the hook never calls it: it adds up an estimate of what each collection froze (the young
    generation's count when the collection began minus what it freed -- an upper bound, since
    frozen objects that die later are not subtracted) and, once the estimate says the frozen
    heap may have grown :data:`COMPACT_GROWTH` fold, asks the loop to count it for real
    (:meth:`check`): compact if so, else start the estimate again from the true count. One walk
    per fourfold estimated growth: its cost is amortised like the compaction's.

    Attributes:
        freezes: times the survivors of a collection were frozen.
        compactions: full collections run by the policy.
        compacted_objects: objects the compactions freed (cyclic garbage that had been frozen).
        last_pause_s: CPU seconds of the newest compaction.
        base: frozen objects right after the newest compaction (or the install, or the newest
            true count that did not call for one).
        estimate: frozen objects now, estimated from ``base`` and the collections since.
    """

    def __init__(self) -> None:
        self.freezes = 0
        self.compactions = 0
        self.compacted_objects = 0
        self.last_pause_s = 0.0
        self.base = 0
        self.estimate = 0
        self._young = 0
        self._check_scheduled = False

    def install(self, young: int) -> None:
        """Collect once, freeze the heap alive now, raise the young threshold to ``young``
        (never lowering a higher one) and freeze the survivors of every later collection."""
        gc.collect()
        gc.freeze()
        self.base = self.estimate = gc.get_freeze_count()
        raise_thresholds((young, 0, 0))
        if self.after_collection not in gc.callbacks:
            gc.callbacks.append(self.after_collection)

    def uninstall(self) -> None:
        """Stop freezing after collections (tests); what is frozen stays frozen."""
        if self.after_collection in gc.callbacks:
            gc.callbacks.remove(self.after_collection)

    def after_collection(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: after a collection, freeze what survived it and add it to the
        estimate; when the estimate says the frozen heap may have grown :data:`COMPACT_GROWTH`
        fold, ask the running event loop (if this thread runs one) for a :meth:`check`. Constant
        time; never raises (a callback's exception would be printed as unraisable)."""
        try:
            if phase == "start":
                self._young = gc.get_count()[0]
                return
            gc.freeze()
            self.freezes += 1
            self.estimate += max(0, self._young - int(info.get("collected", 0)))
            if self._due(self.estimate) and not self._check_scheduled:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return  # a worker thread's collection: the loop thread's next one asks
                self._check_scheduled = True
                loop.call_soon(self.check)
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    def _due(self, frozen: int) -> bool:
        return frozen > COMPACT_MIN and frozen > COMPACT_GROWTH * self.base

    def check(self) -> bool:
        """Count the frozen heap (one walk of it) and compact when it has really grown
        :data:`COMPACT_GROWTH` fold; else restart the estimate from the count. True when it
        compacted."""
        self._check_scheduled = False
        frozen = gc.get_freeze_count()
        if self._due(frozen):
            self.compact()
            return True
        self.base = self.estimate = frozen
        return False

    def compact(self) -> int:
        """Unfreeze, collect everything, freeze again; returns the objects freed."""
        self._check_scheduled = True  # (its own collection asks for no check)
        t0 = time.process_time()
        try:
            gc.unfreeze()
            freed = gc.collect()
            gc.freeze()
            self.base = self.estimate = gc.get_freeze_count()
        finally:
            self._check_scheduled = False
        self.last_pause_s = time.process_time() - t0
        self.compactions += 1
        self.compacted_objects += freed
        log.info("collector: compacted the frozen heap to %d objects (%d freed) in %.2f s of CPU", self.base, freed,
                 self.last_pause_s)
        return freed


#: the process's policy (installed by :func:`enable_for_process`)
policy = CollectorPolicy()


def enable_for_process(young: int = YOUNG_THRESHOLD) -> None:
    """Install the collector policy of a service process (module docstring): called once by
    an entry point whose process runs one federation until it exits."""
    global _enabled
    _enabled = True
    policy.install(young)


def enabled() -> bool:
    """Whether :func:`enable_for_process` was called in this process."""
    return _enabled


def tune_for_service(young: int = YOUNG_THRESHOLD) -> tuple[int, int, int]:
    """A service has rebuilt its state (read the stream, loaded a checkpoint): freeze the heap
    alive now and raise the young threshold to ``young`` (0: only freeze). Nothing unless
    :func:`enable_for_process` was called (see the module docstring).

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
