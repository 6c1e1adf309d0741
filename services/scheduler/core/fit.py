"""Gang fitting: can every worker of a job get a node in this cluster, and which nodes?

A :class:`WorkingCluster` is the decide() call's private, mutable copy of one cluster's free
resources, so several placements in one cycle never over-allocate. Fitting is tentative
(:meth:`WorkingCluster.fit`) until :meth:`WorkingCluster.commit`.

Rules:

* all workers of a gang use one card model and all land in this cluster (gang);
* a worker lives on one node; ``g >= 1`` whole GPUs need ``g`` idle cards on that node; a
  fractional worker (``gpu_milli < 1000``) takes that share of one card;
* node choice is best-fit, in the spirit of the FGD paper behind the openb trace (Weng et al.,
  ATC'23): fractional work goes to the partially used card with the least room that still fits,
  before breaking an idle card; whole-GPU work goes to the node with the fewest idle cards that
  still fit; CPU-only work prefers nodes whose cards are all busy (or that have none), so idle
  cards are not stranded without CPU. This keeps whole nodes free for big gangs.

Scale: a full search looks at capacity classes -- the nodes of one card model with identical
free state (:class:`~.snapshot.CapacityClasses`) -- not at nodes: the best class by the rules
above, then its lowest node index, which is the node a node-by-node scan would pick
(``tests/unit/scheduler/test_classes.py`` checks it against that scan and a brute force). A
cluster of 5,000 nodes of a few node types has tens of classes. Pools of at most
``SCAN_NODES_UP_TO`` nodes, and searches limited to a few nodes (``only``), scan nodes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from fedsched.jobs import JobSpec
from services.scheduler.core.snapshot import WHOLE, CapacityClasses, ClusterIndex, ClusterState, pool_of


@dataclass(frozen=True, slots=True)
class Binding:
    """One worker's node: ``node`` index into the cluster's nodes, the devices and shares."""

    worker: int
    node: int
    devices: tuple[int, ...]
    gpu_milli: int
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Fit:
    """A tentative gang placement in one cluster: its card model and per-worker bindings."""

    card_model: str
    bindings: tuple[Binding, ...]


#: pools of at most this many nodes are searched node by node (the classes would not save work)
SCAN_NODES_UP_TO = 64


class _Class:
    """One capacity class of a working cluster: its node indices -- the snapshot's ascending
    tuple (``base``, shared, never copied) less the nodes that left the class this cycle
    (``gone``) plus those that joined it (``joined``, with a heap of them, lazy deletion) -- and
    its lowest index, the node a node-by-node scan meets first: the first of ``base`` not gone or
    the top of the heap, whichever is lower. A node of ``base`` that leaves and comes back is
    counted as joined. Making one is O(1), so a cycle pays only for the nodes it moves.
    ``low`` holds the lowest index while it is known (None after that node left), so most
    looks read it without a search."""

    __slots__ = ("base", "pos", "gone", "joined", "heap", "size", "low")

    def __init__(self, base: tuple[int, ...]) -> None:
        self.base = base
        self.pos = 0  # every node of base[:pos] is gone
        self.gone: set[int] | None = None
        self.joined: set[int] | None = None
        self.heap: list[int] | None = None  # the joined nodes (and some that left since)
        self.size = len(base)
        self.low: int | None = base[0] if base else None

    @property
    def members(self) -> set[int]:
        """The class's node indices now (a new set)."""
        live = set(self.base)
        if self.gone:
            live -= self.gone
        if self.joined:
            live |= self.joined
        return live

    def first(self) -> int:
        """The lowest node index in the class (the class is not empty)."""
        if self.low is not None:
            return self.low
        base, pos, gone = self.base, self.pos, self.gone
        if gone:
            while pos < len(base) and base[pos] in gone:
                pos += 1
            self.pos = pos
        low = base[pos] if pos < len(base) else None
        heap = self.heap
        if heap:
            joined = self.joined
            while heap and heap[0] not in joined:
                heapq.heappop(heap)
            if heap and (low is None or heap[0] < low):
                low = heap[0]
        self.low = low
        return low

    def discard(self, i: int) -> None:
        """Take node ``i`` (a member) out of the class."""
        if i == self.low:
            self.low = None  # (found again when next asked)
        joined = self.joined
        if joined and i in joined:
            joined.remove(i)  # its heap entry goes when it reaches the top
        else:
            if self.gone is None:
                self.gone = set()
            self.gone.add(i)
        self.size -= 1

    def add(self, i: int) -> None:
        """Put node ``i`` (not a member) in the class."""
        if self.joined is None:
            self.joined, self.heap = set(), []
        self.joined.add(i)
        heapq.heappush(self.heap, i)
        self.size += 1
        if self.low is not None and i < self.low:
            self.low = i

    def copy(self) -> "_Class":
        """An independent copy (O(nodes moved this cycle), not O(nodes))."""
        other = _Class.__new__(_Class)
        other.base, other.pos, other.size, other.low = self.base, self.pos, self.size, self.low
        other.gone = set(self.gone) if self.gone else None
        if self.joined:
            other.joined, other.heap = set(self.joined), list(self.heap)
        else:
            other.joined = other.heap = None
        return other


@lru_cache(maxsize=65536)
def _best_card(devices: tuple[int, ...], share: int) -> tuple[tuple, int]:
    """The card of a node with free shares ``devices`` a fractional worker of ``share``
    milli-GPU takes (at least one card has room): partial cards first (least room left), then
    the lowest device -- as (its key: (idle card?, room left, idle cards on the node), device).
    Pure, so memoised (free states repeat across nodes and requests)."""
    idle_count = devices.count(WHOLE)
    best = None
    for d, free in enumerate(devices):
        if free < share:
            continue
        key = (free == WHOLE, free - share, idle_count)
        if best is None or key < best[0]:
            best = (key, d)
    return best


class _Index:
    """A pool's classes whose nodes have some free share of a card -- the only ones a GPU
    worker can use -- by the largest free share on one card (``by_share``) and, for those with
    idle cards, by the number of idle cards (``by_idle``); and those with nothing free on their
    cards (``busy``: all cards busy, or none), kept in step with the pool's classes (private)."""

    __slots__ = ("by_share", "by_idle", "busy")

    def __init__(self, classes: dict[tuple, _Class]) -> None:
        self.by_share: dict[int, dict[tuple, _Class]] = {}
        self.by_idle: dict[int, dict[tuple, _Class]] = {}
        self.busy: dict[tuple, _Class] = {}
        for sig, cls in classes.items():
            self.add(sig, cls)

    def add(self, sig: tuple, cls: _Class) -> None:
        """Index a new class."""
        devices = sig[0]
        share = max(devices) if devices else 0
        if share > 0:
            self.by_share.setdefault(share, {})[sig] = cls
            idle = devices.count(WHOLE)
            if idle:
                self.by_idle.setdefault(idle, {})[sig] = cls
        if sum(devices) == 0:
            self.busy[sig] = cls

    def remove(self, sig: tuple) -> None:
        """Forget a class that emptied."""
        devices = sig[0]
        share = max(devices) if devices else 0
        if share > 0:
            _pop(self.by_share, share, sig)
            idle = devices.count(WHOLE)
            if idle:
                _pop(self.by_idle, idle, sig)
        if sum(devices) == 0:
            del self.busy[sig]


def _pop(buckets: dict[int, dict], key: int, sig: tuple) -> None:
    bucket = buckets[key]
    del bucket[sig]
    if not bucket:
        del buckets[key]


def _count(stats: list, devices: tuple[int, ...], k: int) -> None:
    """Add ``k`` nodes (negative: remove) with free cards ``devices`` to a pool's statistics."""
    stats[0] += sum(devices) * k
    idle = devices.count(WHOLE)
    stats[1] += idle * k
    for hist, value in ((stats[2], idle), (stats[3], max(devices) if devices else 0)):
        left = hist.get(value, 0) + k
        if left:
            hist[value] = left
        else:
            del hist[value]


class WorkingCluster:
    """Mutable free-resource copy of a :class:`ClusterState` (private to one decide() call).

    Free state is kept twice, in step: per node (``gpu_free``, ``cpu_free``, ``mem_free``,
    what scorers and the ``only`` searches read) and as capacity classes per pool (card model;
    ``""`` for nodes without cards): nodes with identical free state form one class
    (:class:`~.snapshot.CapacityClasses`). Full searches, per-model summaries and totals read
    the classes, so their cost grows with the number of distinct node states, not of nodes.
    Classes of a pool are made from the snapshot's the first time the pool is needed (O(classes):
    they share its node tuples, :class:`_Class`).

    Args:
        cluster: the snapshot to copy.
        empty: start from capacity (as if nothing ran) -- for "could it ever fit" checks.
        index: the cluster's index (default: ``cluster.idx()``).
    """

    __slots__ = ("state", "gpu_free", "cpu_free", "mem_free", "by_model", "cpu_order", "_stats", "_summaries",
                 "_totals", "scan_nodes_up_to", "_pending", "_pool", "_source", "_classes", "_index", "_shared",
                 "_nodes_shared",
                 "changes", "returns")

    def __init__(self, cluster: ClusterState, *, empty: bool = False, index: ClusterIndex | None = None) -> None:
        self.state = cluster
        index = index or cluster.idx()
        if empty:
            source = index.empty if index.empty is not None else CapacityClasses.build(cluster.nodes, index.pool,
                                                                                      empty=True)
        else:
            source = cluster.capacity_classes()
        # Copy-on-write: the per-node sequences are the snapshot's (tuples, O(1)) until the first
        # change (:meth:`_take` makes them lists), and each node's free-card tuple is shared
        # until that node changes. A working cluster that never allocates (an "empty" one, for
        # "could it ever fit", or one no job lands on) never copies them.
        self.gpu_free = source.gpu_free
        self.cpu_free = source.cpu_free
        self.mem_free = source.mem_free
        self.by_model = index.by_model
        self.cpu_order = index.healthy
        self._pool = index.pool if len(index.pool) == len(cluster.nodes) else tuple(pool_of(n) for n in cluster.nodes)
        self._source = source.pools
        self._classes: dict[str, dict[tuple, _Class]] = {}
        #: pool -> the classes of ``_classes[pool]`` with some free share of a card, in step
        self._index: dict[str, _Index] = {}
        #: pools whose classes (the dict and its classes) another working cluster shares since
        #: a :meth:`clone`: copied before they change (copy-on-write)
        self._shared: set[str] = set()
        #: the per-node sequences (``gpu_free``, ``cpu_free``, ``mem_free``) are the snapshot's,
        #: or shared with a clone (or its original) since a :meth:`clone`: copied to lists
        #: before the first change
        self._nodes_shared = True
        # pool -> [free milli-GPU, idle cards, {idle cards on a node: nodes}, {largest free share on a
        # node: nodes}, capacity milli-GPU], kept by _take once the pool's classes exist
        self._stats: dict[str, list] = {}
        #: pool -> its :meth:`summary`, until the pool's next allocation change (many request
        #: shapes check one changed cluster)
        self._summaries: dict[str, tuple[int, int, int]] = {}
        #: pool -> its :meth:`totals`, until the pool's next allocation change (a bound reads
        #: every candidate model's, most of them unchanged)
        self._totals: dict[str, tuple[int, int]] = {}
        #: pools of at most this many nodes are searched node by node (same result, less work)
        self.scan_nodes_up_to = SCAN_NODES_UP_TO
        #: pool -> allocation changes so far (:meth:`commit`, :meth:`release`, work released or
        #: held; not a fit's tentative steps): what reads only that pool -- a fit on its card
        #: model, the pool's figures -- holds while its count stands
        self.changes: dict[str, int] = {}
        #: times capacity was given back (:meth:`release`, work released): a request that did
        #: not fit, or surely could not, stays so while this count stands
        self.returns = 0
        #: pool -> node -> its signature in the pool's classes: nodes changed since the classes
        #: were last brought up to date (done when they are next read; a what-if that releases
        #: work and searches a few nodes by hand never pays for them)
        self._pending: dict[str, dict[int, tuple]] = {}

    def classes(self, pool: str) -> dict[tuple, _Class]:
        """The capacity classes of ``pool`` now: signature ``(gpu_free, cpu_free, mem_free)`` ->
        class (made from the snapshot's on first use)."""
        got = self._classes.get(pool)
        if got is None:
            got = self._classes[pool] = {sig: _Class(ids) for sig, ids in self._source.get(pool, {}).items()}
            self._index[pool] = _Index(got)
            stats = self._stats[pool] = [0, 0, {}, {}, 0]
            for (devices, _, _), cls in got.items():
                k = cls.size
                _count(stats, devices, k)
                stats[4] += len(devices) * WHOLE * k
        pending = self._pending.get(pool)
        if pending:
            if pool in self._shared:  # shared with a clone (or its original): copy before changing
                got = self._classes[pool] = {sig: c.copy() for sig, c in got.items()}
                self._index[pool] = _Index(got)
                self._shared.discard(pool)
            self._flush(pool, got, pending)
        return got

    def gpu_index(self, pool: str) -> _Index:
        """The classes of ``pool`` now whose nodes have some free share of a card (the only
        ones a GPU worker can use), by largest share and by idle cards (:class:`_Index`)."""
        self.classes(pool)
        return self._index[pool]

    def _flush(self, pool: str, classes: dict[tuple, _Class], pending: dict[int, tuple]) -> None:
        """Move the nodes changed since the last look to their classes now (statistics too)."""
        stats = self._stats[pool]
        index = self._index[pool]
        gpu, cpu, mem = self.gpu_free, self.cpu_free, self.mem_free
        for i, old in pending.items():
            new = (gpu[i], cpu[i], mem[i])
            if new == old:
                continue
            if new[0] != old[0]:
                _count(stats, old[0], -1)
                _count(stats, new[0], 1)
            cls = classes[old]
            cls.discard(i)
            if not cls.size:
                del classes[old]
                index.remove(old)
            dest = classes.get(new)
            if dest is None:
                dest = classes[new] = _Class((i,))
                index.add(new, dest)
            else:
                dest.add(i)
        pending.clear()

    def _stats_of(self, pool: str) -> list:
        self.classes(pool)  # up to date
        return self._stats[pool]

    def summary(self, model: str) -> tuple[int, int, int]:
        """(largest free share on one card, most idle cards on one node, idle cards in all) for
        ``model``. Used to reject quickly; O(distinct values), kept as nodes change.
        """
        got = self._summaries.get(model)
        if got is not None:
            return got
        if model not in self.by_model:
            return (0, 0, 0)
        stats = self._stats_of(model)
        got = self._summaries[model] = (max(stats[3]) if stats[3] else 0, max(stats[2]) if stats[2] else 0, stats[1])
        return got

    # ------------------------------------------------------------------ queries

    def totals(self, model: str) -> tuple[int, int]:
        """(free, capacity) milli-GPUs of one card model on healthy nodes (kept as nodes change)."""
        got = self._totals.get(model)
        if got is not None:
            return got
        if model not in self.by_model:
            return (0, 0)
        stats = self._stats_of(model)
        got = self._totals[model] = (stats[0], stats[4])
        return got

    def free_milli(self, model: str | None = None) -> int:
        """Free milli-GPUs (of one card model, or all)."""
        return sum(self.totals(m)[0] for m in ([model] if model else self.by_model))

    def capacity_milli(self, model: str | None = None) -> int:
        """Milli-GPU capacity (of one card model, or all) on healthy nodes."""
        return sum(self.totals(m)[1] for m in ([model] if model else self.by_model))

    def whole_free(self, model: str | None = None) -> int:
        """Idle cards (of one card model, or all)."""
        models = [model] if model else list(self.by_model)
        return sum(self.summary(m)[2] for m in models)

    # ------------------------------------------------------------------ fitting

    def could_fit(self, spec: JobSpec, models: list[str]) -> bool:
        """A cheap necessary condition for :meth:`fit` (cached per-model summaries only): False
        means it surely does not fit; True means it may."""
        return self.could_fit_on(spec, models) is not None

    def could_fit_on(self, spec: JobSpec, models: list[str]) -> str | None:
        """:meth:`could_fit` with its witness: the first of ``models`` whose pool's summary
        admits the GPU shape (``""`` for CPU-only work, which always may), None if none does.
        The answer stays "may" while that pool is unchanged (:attr:`changes`) and "surely not"
        while nothing is given back (:attr:`returns`)."""
        if spec.gpus_per_worker == 0:
            return ""
        whole = spec.gpus_per_worker > 1 or spec.gpu_milli == WHOLE
        for model in models:
            if model not in self.by_model:
                continue
            max_dev, max_idle, total_idle = self.summary(model)
            if whole:
                if max_idle >= spec.gpus_per_worker and total_idle >= spec.gpus_per_worker * spec.workers:
                    return model
            elif max_dev >= spec.gpu_milli:
                return model
        return None

    def fit(self, spec: JobSpec, models: list[str], only: set[int] | None = None) -> Fit | None:
        """Try each card model in ``models`` (in order) for the whole gang; None if none fits.

        Args:
            spec: the job (per-worker resources, gang size).
            models: candidate card models present in this cluster, preferred first; ignored for
                CPU-only jobs.
            only: look at these node indices alone. The caller's promise: no other node can
                hold a worker (e.g. a single-worker job did not fit, then only these nodes got
                resources back), so the result is the one a full search would give. Without
                it the search runs over capacity classes.
        """
        pool = self._pool
        if spec.gpus_per_worker == 0:
            if only is not None:  # healthy nodes among ``only``, in index order (as cpu_order)
                return self._fit_model(spec, "", sorted(i for i in only if pool[i] is not None))
            return self._fit_model(spec, "", None)
        for model in models:
            nodes = self.by_model.get(model)
            if nodes and only is not None:  # the model's nodes among ``only``, in index order
                nodes = sorted(i for i in only if pool[i] == model)
            if not nodes:
                continue
            if only is not None:  # a few nodes: scanning them beats the whole-cluster summary
                fit = self._fit_model(spec, model, nodes)
                if fit is not None:
                    return fit
                continue
            max_dev, max_idle, total_idle = self.summary(model)
            if spec.gpus_per_worker > 1 or spec.gpu_milli == WHOLE:
                if max_idle < spec.gpus_per_worker or total_idle < spec.gpus_per_worker * spec.workers:
                    continue
            elif max_dev < spec.gpu_milli:
                continue
            fit = self._fit_model(spec, model, None)
            if fit is not None:
                return fit
        return None

    def _fit_model(self, spec: JobSpec, model: str, nodes: list[int] | None) -> Fit | None:
        """Fit the gang worker by worker on ``nodes`` (None: every node of the pool, searched by
        capacity class), taking each worker's share before placing the next; tentative."""
        if nodes is None:  # a small pool: scanning its nodes is cheaper than its classes (same result)
            pool = self.cpu_order if not model else self.by_model.get(model, ())
            if len(pool) <= self.scan_nodes_up_to:
                nodes = pool
        if spec.workers == 1:  # nothing to take tentatively: no later worker reads this one's share
            b = self._fit_worker(spec, 0, nodes) if nodes is not None else self._fit_worker_classes(spec, 0, model)
            return None if b is None else Fit(model, (b,))
        taken: list[Binding] = []
        for w in range(spec.workers):
            b = self._fit_worker(spec, w, nodes) if nodes is not None else self._fit_worker_classes(spec, w, model)
            if b is None:
                for t in taken:
                    self._release(t)
                return None
            self._take(b)
            taken.append(b)
        for t in taken:  # tentative: give back until commit
            self._release(t)
        return Fit(model, tuple(taken))

    def _fit_worker(self, spec: JobSpec, worker: int, nodes: list[int]) -> Binding | None:
        cpu, mem = spec.cpu_milli, spec.memory_mib
        g = spec.gpus_per_worker
        gpu_free, cpu_free, mem_free = self.gpu_free, self.cpu_free, self.mem_free
        best: tuple | None = None
        if g == 0:
            for i in nodes:
                if cpu_free[i] < cpu or mem_free[i] < mem:
                    continue
                key = (sum(gpu_free[i]), cpu_free[i] - cpu)
                if best is None or key < best[0]:
                    best = (key, i, ())
                    if key[0] == 0:
                        break  # all its cards busy (or none): the ideal home for CPU-only work
            return None if best is None else Binding(worker, best[1], (), 0, cpu, mem)
        if g == 1 and spec.gpu_milli < WHOLE:
            m = spec.gpu_milli
            for i in nodes:
                devices = gpu_free[i]
                if max(devices) < m or cpu_free[i] < cpu or mem_free[i] < mem:
                    continue
                idle_count = devices.count(WHOLE)
                for d, free in enumerate(devices):
                    if free < m:
                        continue
                    # partial cards first (least room left), then the node with fewest idle cards
                    key = (free == WHOLE, free - m, idle_count)
                    if best is None or key < best[0]:
                        best = (key, i, (d,))
                if best is not None and not best[0][0] and best[0][1] == 0:
                    break  # a partial card it fills exactly: cannot do better
            return None if best is None else Binding(worker, best[1], best[2], m, cpu, mem)
        for i in nodes:
            devices = gpu_free[i]
            idle = devices.count(WHOLE)
            if idle < g or cpu_free[i] < cpu or mem_free[i] < mem:
                continue
            if best is None or idle - g < best[0]:
                best = (idle - g, i)
                if idle == g:
                    break  # fills the node's idle cards exactly: best fit
        if best is None:
            return None
        i = best[1]
        devices = tuple(d for d, free in enumerate(gpu_free[i]) if free == WHOLE)[:g]
        return Binding(worker, i, devices, WHOLE, cpu, mem)

    def _fit_worker_classes(self, spec: JobSpec, worker: int, model: str) -> Binding | None:
        """:meth:`_fit_worker` over every node of ``model``'s pool (all pools for CPU-only work),
        one look per capacity class: the same rules and the same tie-break (lowest node index
        among equally good nodes, then the lowest device), so the same node."""
        cpu, mem = spec.cpu_milli, spec.memory_mib
        g = spec.gpus_per_worker
        if g == 0:
            # the lowest node with all cards busy (or none): the ideal home, taken first; else
            # the node with the least free on its cards, then the least CPU left, then the lowest
            zero = None
            indexes = [self.gpu_index(pool) for pool in self._source]
            for index in indexes:
                for (_, cf, mf), cls in index.busy.items():
                    if cf >= cpu and mf >= mem:
                        i = cls.first()
                        if zero is None or i < zero:
                            zero = i
            if zero is not None:
                return Binding(worker, zero, (), 0, cpu, mem)
            best = None
            for pool in self._source:
                for (devices, cf, mf), cls in self.classes(pool).items():
                    if cf < cpu or mf < mem:
                        continue
                    used = sum(devices)  # (not 0: no busy class fits)
                    if best is None or (used, cf - cpu) <= best[:2]:  # else it cannot win
                        key = (used, cf - cpu, cls.first())
                        if best is None or key < best:
                            best = key
            return None if best is None else Binding(worker, best[2], (), 0, cpu, mem)
        index = self.gpu_index(model)  # (a class without a free share cannot take a GPU worker)
        if g == 1 and spec.gpu_milli < WHOLE:
            m = spec.gpu_milli
            exact = None  # (node, device): lowest node with a partial card it fills exactly
            best = None  # ((idle card?, room left, idle cards on the node), node, device)
            for share, classes in index.by_share.items():
                if share < m:
                    continue  # no card of these nodes has room
                for (devices, cf, mf), cls in classes.items():
                    if cf < cpu or mf < mem:
                        continue
                    key, d = _best_card(devices, m)
                    if not key[0] and key[1] == 0:
                        i = cls.first()
                        if exact is None or i < exact[0]:
                            exact = (i, d)
                    elif exact is None and (best is None or key <= best[0]):  # else it cannot win
                        cand = (key, cls.first(), d)
                        if best is None or cand < best:
                            best = cand
            if exact is not None:
                return Binding(worker, exact[0], (exact[1],), m, cpu, mem)
            return None if best is None else Binding(worker, best[1], (best[2],), m, cpu, mem)
        best = None  # (idle cards left over, node, its free cards)
        for idle in sorted(index.by_idle):  # fewest idle cards first: the first that fits wins
            if idle < g:
                continue
            for (devices, cf, mf), cls in index.by_idle[idle].items():
                if cf < cpu or mf < mem:
                    continue
                i = cls.first()
                if best is None or i < best[1]:
                    best = (idle - g, i, devices)
            if best is not None:
                break
        if best is None:
            return None
        _, i, free = best
        devices = tuple(d for d, f in enumerate(free) if f == WHOLE)[:g]
        return Binding(worker, i, devices, WHOLE, cpu, mem)

    def _take(self, b: Binding, sign: int = 1) -> None:
        if self._nodes_shared:  # copy-on-write (:meth:`clone`)
            self.gpu_free, self.cpu_free, self.mem_free = list(self.gpu_free), list(self.cpu_free), list(self.mem_free)
            self._nodes_shared = False
        i = b.node
        pool = self._pool[i] if i < len(self._pool) else None
        gpu_free, cpu_free, mem_free = self.gpu_free, self.cpu_free, self.mem_free
        old = (gpu_free[i], cpu_free[i], mem_free[i])
        if b.devices:
            free = list(old[0])
            share = sign * b.gpu_milli
            for d in b.devices:
                free[d] -= share
            gpu_free[i] = tuple(free)
        cpu_free[i] = old[1] - sign * b.cpu_milli
        mem_free[i] = old[2] - sign * b.memory_mib
        if pool is not None:  # its class changes when the classes are next read (_flush)
            self._summaries.pop(pool, None)
            self._totals.pop(pool, None)
            pending = self._pending.get(pool)
            if pending is None:
                pending = self._pending[pool] = {}
            if i not in pending:
                pending[i] = old

    def _release(self, b: Binding) -> None:
        self._take(b, -1)

    def clone(self) -> "WorkingCluster":
        """An independent copy (for what-ifs: preemption, estimated start)."""
        other = WorkingCluster.__new__(WorkingCluster)
        other.state = self.state
        # per-node lists and classes are shared until either side changes them (copy-on-write:
        # :meth:`_take`, :meth:`classes`)
        other.gpu_free, other.cpu_free, other.mem_free = self.gpu_free, self.cpu_free, self.mem_free
        self._nodes_shared = other._nodes_shared = True
        other.by_model = self.by_model
        other.cpu_order = self.cpu_order
        other._pool = self._pool
        other._source = self._source
        other._classes = dict(self._classes)
        other._index = dict(self._index)
        self._shared.update(self._classes)
        other._shared = set(self._classes)
        other.scan_nodes_up_to = self.scan_nodes_up_to
        other._pending = {p: dict(d) for p, d in self._pending.items() if d}
        other._stats = {p: [st[0], st[1], dict(st[2]), dict(st[3]), st[4]] for p, st in self._stats.items()}
        other._summaries = dict(self._summaries)
        other.changes = dict(self.changes)
        other.returns = self.returns
        other._totals = dict(self._totals)
        return other

    def release_work(self, work, sign: int = -1) -> None:
        """Give back what a :class:`~.snapshot.RunningWork` holds (it is evicted or ends);
        ``sign=+1`` takes it instead (see :meth:`hold_work`)."""
        for node, devices, milli, cpu, mem in work.bindings:
            self._take(Binding(0, node, devices, milli, cpu, mem), sign)
            self._changed(node)
        if sign < 0:
            self.returns += 1

    def hold_work(self, work) -> None:
        """Allocate what a :class:`~.snapshot.RunningWork` holds (replaying a placement)."""
        self.release_work(work, +1)

    def commit(self, fit: Fit) -> None:
        """Allocate a fit returned by :meth:`fit` (on this same working copy)."""
        for b in fit.bindings:
            self._take(b)
            self._changed(b.node)

    def release(self, fit: Fit) -> None:
        """Undo :meth:`commit` (used by preemption what-ifs)."""
        for b in fit.bindings:
            self._release(b)
            self._changed(b.node)
        self.returns += 1

    def _changed(self, node: int) -> None:
        """Count an allocation change of ``node``'s pool (:attr:`changes`)."""
        pool = self._pool[node] if node < len(self._pool) else None
        if pool is not None:
            self.changes[pool] = self.changes.get(pool, 0) + 1
