"""The scheduler's book of queued shards, kept in the order a cycle's window is cut from.

:class:`QueuedBook` is the service's ``queued`` mapping ((job id, shard index) -> (job, shard)),
a ``dict`` that also keeps every entry in a *group* -- (tenant, priority class value, queue name
of :func:`~services.scheduler.core.queues.queue_of`) -- sorted oldest first by
``(submitted_at, QueuedJob.key)``. Inside one group every shard has the same class value and
fast-lane bonus, so its effective priority (:func:`~services.scheduler.core.queues.effective_priority`:
class value + aging + fast-lane bonus) only depends on its age, and does not increase along the
group's order: the shards of one aging step form one contiguous run, found by binary search.

:meth:`QueuedBook.window` cuts the cycle's window from the groups (issue 15: at 30,000 queued
shards, cutting it from the whole queue cost ~60 ms per cycle): the same rule as
``SchedulerService.window`` -- whole effective priority levels from the highest, each tenant of
a level given ``max(1, room // tenants)`` of its oldest shards -- in
O(groups x aging steps x log n + window), not O(queue). Adding or removing a shard costs
O(log n) (a :class:`sortedcontainers.SortedList` per group).

The groups depend on ``fast_lane_s`` (which queue a job is in); a window asked with another
``fast_lane_s`` than the groups were built with regroups the whole book once (a policy change).
"""

from __future__ import annotations

import heapq
from collections import namedtuple
from itertools import islice
from typing import Any, Callable, Iterator

from sortedcontainers import SortedList

from services.scheduler.core.queues import queue_of

#: what :func:`queue_of` reads of a queue entry (its spec), for a shard not yet made a QueuedJob
_SpecOf = namedtuple("_SpecOf", "spec")


def entry_key(job_id: str, shard: int, shards: int) -> str:
    """``QueuedJob.key`` of a shard: ``job_id``, or ``job_id#shard`` for a split job."""
    return f"{job_id}#{shard}" if shards > 1 else job_id


class QueuedBook(dict):
    """``(job id, shard) -> (job, shard)`` of the queued shards, with the window's order index.

    Only ``[key] = value``, ``pop``, ``del`` and ``clear`` change it (what the service uses);
    ``update``, ``setdefault`` and ``popitem`` are refused (they would bypass the index). A job
    whose spec or submit time changes while queued must be set again (``book[key] = entry``).

    Attributes:
        fast_lane_s: the fast-lane limit (s) the groups were built with.
        groups: (tenant, priority class value, queue name) -> SortedList of
            ``(submitted_at, entry key, (job id, shard))``, oldest first.
    """

    def __init__(self, fast_lane_s: float = 600.0) -> None:
        super().__init__()
        self.fast_lane_s = fast_lane_s
        self.groups: dict[tuple[str, int, str], SortedList] = {}
        self._where: dict[tuple[str, int], tuple[tuple[str, int, str], tuple]] = {}

    # -- the mapping ---------------------------------------------------------

    def __setitem__(self, key: tuple[str, int], value: tuple[Any, Any]) -> None:
        self._unindex(key)
        super().__setitem__(key, value)
        self._index(key, value)

    def __delitem__(self, key: tuple[str, int]) -> None:
        super().__delitem__(key)
        self._unindex(key)

    def pop(self, key, *default):
        """``dict.pop``, keeping the index."""
        out = super().pop(key, *default)
        self._unindex(key)
        return out

    def clear(self) -> None:
        """``dict.clear``, with the index."""
        super().clear()
        self.groups.clear()
        self._where.clear()

    def update(self, *args, **kwargs):  # noqa: D102 - refused
        raise TypeError("QueuedBook.update would bypass the order index: set entries one by one")

    def setdefault(self, *args, **kwargs):  # noqa: D102 - refused
        raise TypeError("QueuedBook.setdefault would bypass the order index")

    def popitem(self):  # noqa: D102 - refused
        raise TypeError("QueuedBook.popitem would bypass the order index")

    def _group_of(self, job) -> tuple[str, int, str]:
        spec = job.spec
        return spec.tenant, spec.priority_value, queue_of(_SpecOf(spec), self.fast_lane_s)

    def _index(self, key: tuple[str, int], value: tuple[Any, Any]) -> None:
        job, _ = value
        group = self._group_of(job)
        item = (job.submitted_at, entry_key(job.job_id, key[1], job.spec.shards), key)
        bucket = self.groups.get(group)
        if bucket is None:
            bucket = self.groups[group] = SortedList()
        bucket.add(item)
        self._where[key] = (group, item)

    def _unindex(self, key: tuple[str, int]) -> None:
        where = self._where.pop(key, None)
        if where is None:
            return
        group, item = where
        bucket = self.groups[group]
        bucket.remove(item)
        if not bucket:
            del self.groups[group]

    def regroup(self, fast_lane_s: float) -> None:
        """Rebuild the groups for another fast-lane limit (O(queue); a policy change)."""
        self.fast_lane_s = fast_lane_s
        self.groups.clear()
        self._where.clear()
        for key, value in self.items():
            self._index(key, value)

    def stats(self, now: float, fast_lane_s: float) -> dict[str, tuple[int, float]]:
        """Queue name -> (queued shards, business seconds the oldest has waited at ``now``, at
        least 0): ``services.scheduler.service.queue_stats`` of the whole queue, from the groups
        in O(groups)."""
        if fast_lane_s != self.fast_lane_s:
            self.regroup(fast_lane_s)
        out: dict[str, tuple[int, float]] = {}
        for (_, _, queue), bucket in self.groups.items():
            n, age = out.get(queue, (0, 0.0))
            out[queue] = (n + len(bucket), max(age, now - bucket[0][0]))
        return out

    # -- the window ----------------------------------------------------------

    def window(self, cap: int, now: float, policy, skip: Callable[[Any], bool] = lambda job: False
               ) -> list[tuple[Any, Any]]:
        """The entries one cycle decides: all of them up to ``cap``, else the window rule of the
        module docstring, for the effective priorities at business time ``now`` under ``policy``
        (its aging and fast-lane parameters). ``skip(job)`` leaves an entry out (a job whose
        cancellation is pending). Returns ``(job, shard)`` pairs, by level (highest first),
        then tenant, oldest first.
        """
        if policy.fast_lane_s != self.fast_lane_s:
            self.regroup(policy.fast_lane_s)
        if len(self) <= cap:
            return [v for v in self.values() if not skip(v[0])]
        # level -> tenant -> runs of one group's order (a slice of its SortedList)
        levels: dict[int, dict[str, list[tuple[SortedList, int, int]]]] = {}
        for (tenant, value, queue), bucket in self.groups.items():
            base = value + (policy.fast_lane_bonus if queue == "fast" else 0)
            for level, lo, hi in _aging_runs(bucket, base, now, policy):
                levels.setdefault(level, {}).setdefault(tenant, []).append((bucket, lo, hi))
        out: list[tuple[Any, Any]] = []
        for level in sorted(levels, reverse=True):
            room = cap - len(out)
            if room <= 0:
                break
            tenants = levels[level]
            part = max(1, room // len(tenants))
            for runs in tenants.values():
                taken = 0
                for _, _, key in _oldest(runs):
                    value = dict.__getitem__(self, key)
                    if skip(value[0]):
                        continue
                    out.append(value)
                    taken += 1
                    if taken >= part:
                        break
        return out


def _oldest(runs: list[tuple[SortedList, int, int]]) -> Iterator[tuple]:
    """The items of several sorted runs, oldest first (a lazy merge)."""
    if len(runs) == 1:
        bucket, lo, hi = runs[0]
        return bucket.islice(lo, hi)
    return heapq.merge(*(bucket.islice(lo, hi) for bucket, lo, hi in runs))


def _aging_runs(bucket: SortedList, base: int, now: float, policy) -> Iterator[tuple[int, int, int]]:
    """``(effective priority, lo, hi)`` of the runs of ``bucket`` (one group, oldest first) that
    share an aging step: ``steps(t) = min(aging_max_steps, floor(max(0, now - t) / aging_period_s))``
    as in :func:`~services.scheduler.core.queues.effective_priority`, which does not increase
    along the order, so each run is found by a binary search on that same formula."""
    n = len(bucket)
    if policy.aging_period_s <= 0 or policy.aging_step == 0 or policy.aging_max_steps <= 0:
        yield base, 0, n
        return
    period, most = policy.aging_period_s, policy.aging_max_steps

    def steps(i: int) -> int:
        return min(most, int(max(0.0, now - bucket[i][0]) // period))

    lo = 0
    while lo < n:
        s = steps(lo)
        a, b = lo + 1, n  # first index whose steps < s
        while a < b:
            mid = (a + b) // 2
            if steps(mid) < s:
                b = mid
            else:
                a = mid + 1
        yield base + policy.aging_step * s, lo, a
        lo = a


__all__ = ["QueuedBook", "entry_key"]
