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
from typing import Callable, Iterable

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.clock import Clock
from fedsched.jobs import JobState
from fedsched.naming import check_known, check_name
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
        known_regions: ``() -> the regions that exist`` (admission's topology or reported
            regions); with the regions of the clusters in ``clusters`` they are what a filter
            may name. None: any well-formed name is taken (an unknown one lists nothing).
    """

    def __init__(self, clusters: ClusterView, view: JobView, clock: Clock, wall: Clock, *,
                 known_regions: Callable[[], Iterable[str]] | None = None) -> None:
        self.clusters = clusters
        self.view = view
        self.clock = clock
        self.wall = wall
        self.known_regions = known_regions

    async def ListClusters(self, request: pb.ListClustersRequest, context) -> pb.ListClustersResponse:
        """Clusters and queues, of the ``regions`` asked for (empty = all). A known region
        without any cluster reporting yet is an empty answer, not an error.

        Raises:
            ValidationError: ``regions[i]``: a malformed region name, or one that names no
                region of the federation (the message lists the known ones).
        """
        regions = frozenset(check_name("region", r, f"regions[{i}]") for i, r in enumerate(request.regions))
        if regions and self.known_regions is not None:
            known = set(self.known_regions()) | {c.region for c in self.clusters.clusters.values()}
            for i, r in enumerate(request.regions):
                check_known("region", r, known, f"regions[{i}]")
        out = pb.ListClustersResponse()
        for row in self.clusters.rows(self.wall.time(), regions):
            out.clusters.append(pb.ClusterSummary(
                region=row.region, zone=row.zone, cluster=row.cluster, backend=row.backend, healthy=row.healthy,
                heartbeat_age_seconds=row.heartbeat_age_s, nodes=row.nodes, nodes_schedulable=row.nodes_schedulable,
                running_jobs=row.running_jobs,
                cards=[pb.CardCapacity(card_model=c.card_model, gpus_total=c.total, gpus_allocated=c.allocated,
                                       gpus_free=c.free) for c in row.cards]))
        out.queues.extend(q for q in queue_rows(self.view, self.clock.time()) if not regions or q.region in regions)
        return out


#: durable consumers whose lag ``fedsched status`` shows, per service (agents: ``agent-<cluster>``)
DURABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "audit": (("EVENTS", "audit-events"), ("INVENTORY", "audit-inventory"), ("DLQ", "audit-dlq")),
    "billing": (("EVENTS", "billing"), ("EVENTS", "billing-transfer")),
}

#: a durable consumer nobody has pulled from for this long (wall seconds) counts as down
IDLE_DOWN_S = 15.0


def _age(value, now: float) -> float | None:
    """Wall seconds from ``value`` (a timezone-aware datetime, as nats-py parses JetStream's
    ``last_active``; None = never) to ``now``."""
    return None if value is None else now - value.timestamp()


class SystemServicer(pb_grpc.SystemServiceServicer):
    """``GetStatus``: each service's state (``ok``, ``degraded``, ``down``), version, detail and
    lag, asked live (no cache):

    * admission: itself (its version is the package version; lag: its job-view follower's
      pending messages);
    * scheduler: its bus status endpoint ``<prefix>.svc.scheduler.status`` (no answer within
      ``timeout_s``: ``down``); lag = the EVENTS stream's last sequence minus the sequence it
      has applied (it follows the whole stream);
    * audit and billing: their durable consumers' info (``num_pending + num_ack_pending``); a
      consumer that does not exist, or that nobody has pulled from for :data:`IDLE_DOWN_S`, is
      ``down``; their versions are not reported (""). Seen: 0 while a pull request of theirs
      waits on the server (``num_waiting``: they are there now), else the age of the consumer's
      last delivery or acknowledgement; a writer pulling with nothing to do reads ``idle, caught
      up`` (lag 0) however long ago its last message came -- billing has work only when jobs
      start or stop -- while one nobody pulls from shows that age and goes ``down``;
    * each agent (``agent/<region>/<cluster>``): its heartbeat age from the capacity view
      (silent longer than the freshness limit: ``down``) and its placements consumer's lag.

    Args:
        bus: the connection (JetStream consumer and stream info, the scheduler's status request).
        clusters: the capacity view (agents' heartbeats).
        wall: wall clock comparable with JetStream times.
        self_status: ``() -> (detail, lag)`` of the admission answering.
        timeout_s: how long to wait for the scheduler and for each JetStream info request.
    """

    def __init__(self, bus, clusters: ClusterView, wall: Clock, self_status: Callable, *, timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.clusters = clusters
        self.wall = wall
        self.self_status = self_status
        self.timeout_s = timeout_s

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        version = package_version()
        detail, lag = await self.self_status()
        out = pb.GetStatusResponse(version=version)
        out.services.append(pb.ServiceStatus(name="admission", state="ok", version=version, detail=detail,
                                             consumer_lag=lag, last_seen_age_seconds=0.0))
        gone = self.clusters.prune(self.wall.time())  # decommissioned: silent beyond gone_after_s
        if gone:
            log.info("status: forgot %d clusters silent for over %g s: %s", len(gone), self.clusters.gone_after_s,
                     ", ".join(gone))
        rest = await asyncio.gather(self._scheduler(), *(self._durables(n, d) for n, d in DURABLES.items()),
                                    *(self._agent(name) for name in sorted(self.clusters.clusters)))
        out.services.extend(rest)
        return out

    async def _scheduler(self) -> pb.ServiceStatus:
        subject = f"{self.bus.prefix}.svc.scheduler.status"
        try:
            reply = await self.bus.nc.request(subject, b"", timeout=self.timeout_s)
            st = json.loads(reply.data)
        except Exception as e:  # noqa: BLE001 - timeout, no responders, a closed connection: all mean down
            return pb.ServiceStatus(name="scheduler", state="down", last_seen_age_seconds=-1,
                                    detail=f"no answer on {subject} within {self.timeout_s:g} s ({type(e).__name__})")
        lag = 0
        try:
            info = await asyncio.wait_for(self.bus.js.stream_info(self.bus.stream_name("EVENTS")), self.timeout_s)
            lag = max(0, int(info.state.last_seq) - int(st.get("applied_seq", 0)))
        except Exception as e:  # noqa: BLE001 - the status itself is still worth showing
            log.info("status: EVENTS stream info: %r", e)
        if st.get("lease_problem"):  # the lease holder refuses to lead: nothing is scheduled
            return pb.ServiceStatus(name="scheduler", state="down", version=str(st.get("version", "")),
                                    detail=f"not scheduling: {st['lease_problem']}", consumer_lag=lag,
                                    last_seen_age_seconds=0.0)
        stale = st.get("stale") or []
        detail = (f"{st.get('cycles', 0)} cycles (last {st.get('last_cycle_ms', 0)} ms), queued {st.get('queued', 0)}, "
                  f"held {st.get('held', 0)}, placed {st.get('placed', 0)}, running {st.get('running', 0)}, "
                  f"{st.get('clusters', 0)} clusters" + (f", stale: {', '.join(stale)}" if stale else ""))
        return pb.ServiceStatus(name="scheduler", state="degraded" if stale else "ok", version=str(st.get("version", "")),
                                detail=detail, consumer_lag=lag, last_seen_age_seconds=0.0)

    async def _consumer(self, stream: str, durable: str):
        """(lag, seconds since last activity or None, pulling) of one durable, or None if it does not exist."""
        import nats.js.errors

        try:
            info = await asyncio.wait_for(self.bus.js.consumer_info(self.bus.stream_name(stream), durable),
                                          self.timeout_s)
        except nats.js.errors.NotFoundError:
            return None
        now = self.wall.time()
        ages = [a for a in (_age(getattr(info.delivered, "last_active", None), now),
                            _age(getattr(info.ack_floor, "last_active", None), now)) if a is not None]
        return (int(info.num_pending or 0) + int(info.num_ack_pending or 0), min(ages) if ages else None,
                bool(info.num_waiting))

    async def _durables(self, name: str, durables: tuple[tuple[str, str], ...]) -> pb.ServiceStatus:
        lag, parts, down, seen = 0, [], [], []
        for stream, durable in durables:
            try:
                got = await self._consumer(stream, durable)
            except Exception as e:  # noqa: BLE001 - JetStream unreachable
                down.append(f"{durable}: no consumer info ({type(e).__name__})")
                continue
            if got is None:
                down.append(f"{durable}: no such durable consumer ({name} never started here)")
                continue
            n, idle, pulling = got
            lag += n
            last = f"last message {idle:.0f} s ago" if idle is not None else "no message yet"
            if pulling:  # a pull waits on the server now: the writer is there, whenever it last got work
                seen.append(0.0)
                parts.append(f"{durable} lag 0, idle, caught up ({last})" if n == 0 else f"{durable} lag {n}")
            else:
                parts.append(f"{durable} lag {n}")
                if idle is not None:
                    seen.append(idle)
            if not pulling and (idle is None or idle > IDLE_DOWN_S):
                down.append(f"{durable}: nobody pulling" + (f" for {idle:.0f} s" if idle is not None else ""))
        state = "down" if down else "ok"
        return pb.ServiceStatus(name=name, state=state, detail="; ".join(down + parts), consumer_lag=lag,
                                last_seen_age_seconds=min(seen) if seen else -1.0)

    async def _agent(self, cluster: str) -> pb.ServiceStatus:
        c = self.clusters.clusters[cluster]
        seen = self.clusters.last_seen(cluster)
        age = self.wall.time() - seen if seen >= 0 else -1.0
        lag = 0
        try:
            got = await self._consumer("EVENTS", f"agent-{cluster}")
            lag = got[0] if got is not None else 0
        except Exception as e:  # noqa: BLE001 - the heartbeat still tells whether it lives
            log.info("status: agent-%s consumer info: %r", cluster, e)
        silent = age < 0 or age > self.clusters.stale_after_s
        detail = (f"silent for {age:.1f} s (limit {self.clusters.stale_after_s:g} s)" if silent
                  else f"heartbeat {age:.1f} s ago")
        return pb.ServiceStatus(name=f"agent/{c.region}/{cluster}", state="down" if silent else "ok",
                                detail=detail, consumer_lag=lag, last_seen_age_seconds=age)
