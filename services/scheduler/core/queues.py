"""Queues, priority, aging and dominant-resource fair share: the order jobs are considered in.

* **Queues** (:func:`queue_of`): ``fast`` for jobs whose estimated duration is at most
  ``policy.fast_lane_s``; otherwise by kind -- ``inference``, ``training`` (training and
  fine-tune) and ``batch`` (batch, evaluation, experiment). Queue names are recorded with every
  decision.
* **Effective priority** (:func:`effective_priority`)::

      class value (critical 1000, high 100, normal 50, low 10, best_effort 0)
      + aging_step  * min(aging_max_steps, floor(waited / aging_period_s))
      + fast_lane_bonus if the job is in the fast lane

  so a long-waiting job climbs at most ``aging_max_steps`` steps (nothing starves, nothing
  jumps a whole class at once), and short jobs pass long ones of the same class.
* **Fair share** (DRF, Ghodsi et al., NSDI'11): among jobs of equal effective priority, the job
  of the tenant with the lowest *dominant share* goes first, where a tenant's dominant share is
  ``max(gpu_t / GPU, cpu_t / CPU, mem_t / MEM)`` over the federation's healthy capacity; shares
  are updated as the cycle places jobs (progressive filling), see :class:`FairOrder`.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from typing import Iterable, Iterator

from fedsched.jobs import JobKind
from services.scheduler.core.snapshot import WHOLE, QueuedJob, Usage, View

TRAINING_KINDS = frozenset({JobKind.TRAINING, JobKind.FINE_TUNE})


def queue_of(job: QueuedJob, fast_lane_s: float) -> str:
    """The queue a job waits in: ``fast``, ``inference``, ``training`` or ``batch``."""
    est = job.spec.estimated_duration_s
    if est is not None and est <= fast_lane_s:
        return "fast"
    if job.spec.kind == JobKind.INFERENCE:
        return "inference"
    if job.spec.kind in TRAINING_KINDS:
        return "training"
    return "batch"


def effective_priority(job: QueuedJob, now: float, policy) -> int:
    """Class value + aging + fast-lane bonus (formula in the module docstring)."""
    waited = max(0.0, now - job.submitted_at)
    steps = min(policy.aging_max_steps, int(waited // policy.aging_period_s)) if policy.aging_period_s > 0 else 0
    bonus = policy.fast_lane_bonus if queue_of(job, policy.fast_lane_s) == "fast" else 0
    return job.spec.priority_value + policy.aging_step * steps + bonus


def capacity(view: View) -> tuple[int, int, int]:
    """Healthy capacity of the federation: (milli-GPU, milli-CPU, MiB), each at least 1."""
    gpu = cpu = mem = 0
    for c in view.clusters:
        if c.index is not None and len(c.index.pool) == len(c.nodes):  # kept with the index: O(clusters)
            g, p, m = c.index.capacity
            gpu, cpu, mem = gpu + g, cpu + p, mem + m
            continue
        for n in c.nodes:
            if n.healthy:
                gpu += len(n.gpu_free) * WHOLE
                cpu += n.cpu_milli
                mem += n.memory_mib
    return max(gpu, 1), max(cpu, 1), max(mem, 1)


def dominant_share(usage: Usage, total: tuple[int, int, int]) -> float:
    """DRF dominant share of ``usage`` against ``total`` capacity."""
    return max(usage.gpu_milli / total[0], usage.cpu_milli / total[1], usage.memory_mib / total[2])


_NOTHING = Usage()  #: a tenant that holds nothing


class FairOrder:
    """Iterates a queue in priority order, DRF among tenants within one priority level.

    Call :meth:`placed` after placing a job so its tenant's share grows before the next pick.

    Args:
        jobs: the queue.
        view: the snapshot (``now``, tenant usage, capacity).
        policy: aging and fast-lane parameters.
    """

    def __init__(self, jobs: Iterable[QueuedJob], view: View, policy) -> None:
        self.total = capacity(view)
        self.usage: dict[str, Usage] = dict(view.tenant_usage)
        self._shares: dict[str, float] = {}  # tenant -> dominant share of its usage now
        levels: dict[int, dict[str, deque[QueuedJob]]] = defaultdict(lambda: defaultdict(deque))
        for job in sorted(jobs, key=lambda j: (j.submitted_at, j.key)):
            levels[effective_priority(job, view.now, policy)][job.spec.tenant].append(job)
        self._levels = sorted(levels.items(), key=lambda kv: -kv[0])
        self.priority_of: dict[str, int] = {}
        for level, tenants in self._levels:
            for q in tenants.values():
                for job in q:
                    self.priority_of[job.key] = level

    def share(self, tenant: str) -> float:
        """The tenant's current dominant share (kept until its next :meth:`placed`)."""
        got = self._shares.get(tenant)
        if got is None:
            got = self._shares[tenant] = dominant_share(self.usage.get(tenant, _NOTHING), self.total)
        return got

    def placed(self, job: QueuedJob) -> None:
        """Account a placement to its tenant (progressive filling)."""
        s = job.spec
        self.usage[s.tenant] = self.usage.get(s.tenant, _NOTHING).plus(
            s.total_gpu_milli, s.cpu_milli * s.workers, s.memory_mib * s.workers)
        self._shares.pop(s.tenant, None)

    def __iter__(self) -> Iterator[QueuedJob]:
        for _, tenants in self._levels:
            heap = [(self.share(t), t) for t in tenants]
            heapq.heapify(heap)
            while heap:
                share, tenant = heapq.heappop(heap)
                current = self.share(tenant)
                if not math.isclose(share, current):
                    heapq.heappush(heap, (current, tenant))  # it grew since: re-rank
                    continue
                q = tenants[tenant]
                yield q.popleft()
                if q:
                    heapq.heappush(heap, (self.share(tenant), tenant))
