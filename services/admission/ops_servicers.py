"""The operators' read-only services: ``ClusterService`` (capacity at a glance, ``fedsched
clusters``) and ``SystemService`` (each service's health, version and lag, ``fedsched status``).

Authorisation: any authenticated principal may call them (the gateway interceptor has already
refused a missing or unknown token). Capacity and service health say nothing about any
tenant's jobs beyond counts per region and kind, which every submitter needs to choose where
to submit (as ``sinfo`` shows every partition to every user).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import Clock
from fedsched.jobs import JobState
from fedsched.naming import check_name
from fedsched.version import package_version
from services.admission.clusterview import ClusterView
from services.admission.jobview import JobView

log = logging.getLogger(__name__)

#: job states that count as waiting in a queue (``QueueSummary.queued``)
WAITING = frozenset({JobState.QUEUED, JobState.AWAITING_APPROVAL, JobState.HELD})


def queue_rows(view: JobView, now: float) -> list[pb.QueueSummary]:
    """Waiting jobs per (home region, kind) with the oldest wait (business seconds since
    submission), from the open jobs of the job view only (never the whole history)."""
    counts: dict[tuple[str, str], list[float]] = {}  # (region, kind) -> [count, oldest submitted_at]
    for ids in view.open_by_tenant.values():
        for job_id in ids:
            rec = view.jobs.get(job_id)
            if rec is None or rec.state not in WAITING:
                continue
            key = (rec.spec.home_region, rec.spec.kind.value)
            c = counts.setdefault(key, [0, rec.submitted_at])
            c[0] += 1
            c[1] = min(c[1], rec.submitted_at)
    return [pb.QueueSummary(region=r, kind=k, queued=int(n), oldest_wait_seconds=max(0.0, now - oldest))
            for (r, k), (n, oldest) in sorted(counts.items())]


class ClusterServicer(pb_grpc.ClusterServiceServicer):
    """``ListClusters``: every cluster from the agents' latest inventory and heartbeats
    (:class:`~services.admission.clusterview.ClusterView`), and the queues from the job view.

    Args:
        clusters: the capacity view (kept current by admission's inventory follower).
        view: the job view (queue lengths).
        clock: business clock (queue waits).
        wall: wall clock comparable with JetStream storage times (heartbeat ages).
    """

    def __init__(self, clusters: ClusterView, view: JobView, clock: Clock, wall: Clock) -> None:
        self.clusters = clusters
        self.view = view
        self.clock = clock
        self.wall = wall

    async def ListClusters(self, request: pb.ListClustersRequest, context) -> pb.ListClustersResponse:
        """Raises ValidationError (``regions[i]``) for a malformed region name."""
        regions = frozenset(check_name("region", r, f"regions[{i}]") for i, r in enumerate(request.regions))
        out = pb.ListClustersResponse()
        for row in self.clusters.rows(self.wall.time(), regions):
            out.clusters.append(pb.ClusterSummary(
                region=row.region, zone=row.zone, cluster=row.cluster, healthy=row.healthy,
                heartbeat_age_seconds=row.heartbeat_age_s, nodes=row.nodes, nodes_schedulable=row.nodes_schedulable,
                running_jobs=row.running_jobs,
                cards=[pb.CardCapacity(card_model=c.card_model, gpus_total=c.total, gpus_allocated=c.allocated,
                                       gpus_free=c.free) for c in row.cards]))
        out.queues.extend(q for q in queue_rows(self.view, self.clock.time()) if not regions or q.region in regions)
        return out
