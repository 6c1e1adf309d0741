"""Admission's read model of capacity: every cluster's latest inventory and heartbeat
(``ClusterService.ListClusters``, ``fedsched clusters``; the agents' heartbeat ages for
``SystemService.GetStatus``).

Folded from ``P_INVENTORY`` by admission's ``admission-inventory`` follower, which starts with
the newest message of each subject (one snapshot and one heartbeat per cluster, never the
history) and then follows. Ages are judged from the time JetStream stored a message (the
delivery's ``published_at``, wall seconds) against a wall clock, as the scheduler judges
freshness, so a restarted admission sees a silent cluster as silent.

What the numbers mean (units: whole cards; a card partly taken by a shared job counts as
allocated):

* ``gpus_total`` / ``gpus_allocated`` / ``gpus_free`` per card model: from the nodes of the
  cluster's latest snapshot (an agent publishes one every few heartbeats and at once when
  capacity or health changes), so allocations lag by at most the snapshot period;
* ``running_jobs``: from the newest of the latest heartbeat and the latest snapshot;
* ``healthy``: heard from within ``stale_after_s`` (the scheduler's freshness limit), not in
  maintenance, and at least one healthy schedulable node.

Per-call work is O(clusters x nodes of the latest snapshots); nothing grows with history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsched.bus import Delivery
from fedsched.events import EventType, Heartbeat, InventorySnapshot


@dataclass(frozen=True)
class CardCount:
    """GPUs of one card model in one cluster, in whole cards."""

    card_model: str
    total: int
    allocated: int
    free: int


@dataclass(frozen=True)
class ClusterRow:
    """One cluster as ``fedsched clusters`` shows it.

    Attributes:
        heartbeat_age_s: wall seconds since its newest heartbeat or snapshot was stored
            (< 0 = never heard from).
        cards: per card model, sorted by name; CPU-only nodes are left out.
        nodes / nodes_schedulable: nodes in the latest snapshot, and those healthy and not
            cordoned/drained.
    """

    region: str
    zone: str
    cluster: str
    healthy: bool
    heartbeat_age_s: float
    cards: tuple[CardCount, ...]
    nodes: int
    nodes_schedulable: int
    running_jobs: int
    maintenance: bool = False
    backend: str = ""  #: trace, kubernetes, slurm ("" = an agent that does not say)


@dataclass
class _Cluster:
    region: str
    zone: str
    snapshot: InventorySnapshot | None = None
    snapshot_at: float = -1.0      # wall seconds the latest snapshot was stored
    heartbeat: Heartbeat | None = None
    heartbeat_at: float = -1.0
    producer: str = ""


@dataclass
class ClusterView:
    """Latest snapshot and heartbeat per cluster (see the module docstring).

    Args:
        stale_after_s: wall seconds after which a silent cluster is reported unhealthy (the
            scheduler's ``stale_after_s``, :class:`~fedsched.settings.Settings`).
        gone_after_s: wall seconds after which a silent cluster is taken as decommissioned and
            forgotten (:meth:`prune`; ``cluster_gone_after_s`` in the settings, default 1 h):
            not listed, not reported down by ``fedsched status``; a message from it brings it
            back.
    """

    stale_after_s: float = 10.0
    clusters: dict[str, _Cluster] = field(default_factory=dict)
    gone_after_s: float = 3600.0

    def prune(self, now_wall: float) -> list[str]:
        """Forget every cluster silent for longer than :attr:`gone_after_s` (wall seconds);
        the names forgotten, sorted. O(clusters)."""
        gone = sorted(name for name, c in self.clusters.items()
                      if now_wall - max(c.snapshot_at, c.heartbeat_at) > self.gone_after_s)
        for name in gone:
            del self.clusters[name]
        return gone

    def apply(self, d: Delivery, now_wall: float) -> None:
        """Fold one inventory-stream delivery (snapshot or heartbeat; other types are ignored).

        ``now_wall`` stands in for the storage time of a delivery without JetStream metadata.
        An older message than the one held (redelivery) changes nothing.
        """
        env = d.envelope
        if not env.cluster:
            return
        at = d.published_at if d.published_at is not None else now_wall
        c = self.clusters.get(env.cluster)
        if c is None:
            c = self.clusters[env.cluster] = _Cluster(env.region, env.zone)
        c.region, c.zone = env.region or c.region, env.zone or c.zone
        c.producer = env.producer
        if env.type == EventType.INVENTORY_SNAPSHOT and at >= c.snapshot_at:
            c.snapshot, c.snapshot_at = env.payload_as(InventorySnapshot), at
        elif env.type == EventType.INVENTORY_HEARTBEAT and at >= c.heartbeat_at:
            c.heartbeat, c.heartbeat_at = env.payload_as(Heartbeat), at

    def last_seen(self, cluster: str) -> float:
        """Wall seconds when ``cluster`` was last heard from (-1 = never)."""
        c = self.clusters.get(cluster)
        return max(c.snapshot_at, c.heartbeat_at) if c is not None else -1.0

    def rows(self, now_wall: float, regions: frozenset[str] = frozenset()) -> list[ClusterRow]:
        """Every cluster (of ``regions``; empty = all) not gone (:meth:`prune`), sorted by
        region then cluster."""
        self.prune(now_wall)
        out = []
        for name, c in self.clusters.items():
            if regions and c.region not in regions:
                continue
            out.append(self._row(name, c, now_wall))
        return sorted(out, key=lambda r: (r.region, r.cluster))

    def _row(self, name: str, c: _Cluster, now_wall: float) -> ClusterRow:
        seen = max(c.snapshot_at, c.heartbeat_at)
        age = now_wall - seen if seen >= 0 else -1.0
        snap = c.snapshot
        cards: dict[str, list[int]] = {}  # model -> [total, allocated]
        nodes = schedulable = 0
        for n in snap.nodes if snap is not None else ():
            nodes += 1
            usable = n.healthy and not n.unschedulable
            schedulable += usable
            if not n.card_model or n.gpus <= 0:
                continue
            count = cards.setdefault(n.card_model, [0, 0])
            count[0] += n.gpus
            free = list(n.gpu_free_milli)[:n.gpus]
            free += [1000] * (n.gpus - len(free))  # a node that does not say is free
            count[1] += sum(1 for f in free if f < 1000)
        running = (snap.running_jobs or len(snap.running)) if snap is not None else 0  # (older agents listed them)
        if c.heartbeat is not None and c.heartbeat_at >= c.snapshot_at:
            running = c.heartbeat.running_jobs
        maintenance = bool(snap and snap.maintenance)
        healthy = 0 <= age <= self.stale_after_s and not maintenance and schedulable > 0
        return ClusterRow(region=c.region, zone=c.zone, cluster=name, healthy=healthy, heartbeat_age_s=age,
                          cards=tuple(CardCount(m, t, a, t - a) for m, (t, a) in sorted(cards.items())),
                          nodes=nodes, nodes_schedulable=schedulable, running_jobs=running, maintenance=maintenance,
                          backend=snap.backend if snap is not None else "")
