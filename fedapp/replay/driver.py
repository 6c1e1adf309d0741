"""The replay: a real trace through the whole running federation.

The driver brings the system up (embedded NATS + chDB unless URLs are given), starts one trace
agent per cluster of the topology (default: the trace split into 3 regions x 2 clusters), then
submits every pod as a job through the gRPC API (as the bootstrap admin, whose token the system wrote to ``<data_dir>/admin.token``) at its
creation time on the replay clock, and waits until every job has finished, been rejected, or
is provably unplaceable. The summary is computed by SQL from ClickHouse (:mod:`.report`).

The replay clock (:class:`~fedsched.clock.ReplayClock`) runs at ``speed`` trace-seconds per
wall-second and is *jumped* forward whenever the system is quiescent -- every submitted job is
known to the scheduler, no placement is in flight, no cycle is running, no job is past its end
without having been reported -- to the next moment anything can change: the next arrival or,
while jobs wait, the next completion. Waits therefore measure scheduling, not idle wall time;
``speed`` only scales the system's own latency into trace time.

Only the driver knows true runtimes (it owns the trace); the scheduler sees the noisy user
estimate of the workload overlay.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import heapq
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.bus import Delivery, StreamFollower
from fedapp.cli.text import strict_json
from fedapp.client import aio_channel, resolve_token
from fedsched.clock import ClockState, ReplayClock
from fedsched.clocksync import publish_clock
from fedsched.trust import check_subject
from fedsched.errors import UnavailableError
from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.events import Envelope, EventType, JobPending
from fedapp.replay.report import build_report
from fedapp.replay.workload import TraceJob, trace_jobs
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from services.admission.convert import spec_to_pb
from fedapp.topology import cluster_nodes, default_topology, policy_for_topology
from fedsched.tenancy import bundled_policy_text
from fedsched.topology import Topology
from services.inventory.trace import load_pods

log = logging.getLogger(__name__)

#: Trace second 0 is this instant (UTC); the openb trace covers about 149 days from here.
DEFAULT_EPOCH = datetime(2023, 1, 1, tzinfo=UTC)


@dataclass
class ReplayOptions:
    """A replay's inputs.

    Attributes:
        nodes_csv / pods_csv: trace files (openb format); ``nodes_csv`` is split by the
            default topology when no ``topology`` is given.
        topology: the federation to replay on (:mod:`fedsched.topology`; its trace clusters'
            node lists replace ``nodes_csv``); the first-start policy is the bundled one with
            tenants' home regions moved into it (:func:`fedapp.topology.policy_for_topology`)
            unless ``settings.policy_file`` is set.
        settings: runtime settings (data dir, URLs, prefix).
        limit: replay only the first N pods (by creation time).
        speed: trace-seconds per wall-second between jumps.
        policy: scheduling policy name.
        timeout_s: give up (and report what happened) after this many wall seconds.
        epoch: UTC instant of trace second 0.
        load: arrival compression (see :func:`~fedapp.replay.workload.trace_jobs`).
        on_finished: ``async on_finished(system, report)`` runs after the report is built and
            before the system stops (the services' metrics endpoints still serve then).
    """

    nodes_csv: Path
    pods_csv: Path
    settings: Settings
    limit: int | None = None
    speed: float = 100.0
    policy: str = "federated"
    timeout_s: float = 3600.0
    epoch: datetime = DEFAULT_EPOCH
    load: float = 1.0
    submit_concurrency: int = 64
    topology: Topology | None = None
    on_finished: Callable[[System, dict], Awaitable[None]] | None = None


@dataclass
class Progress:
    """Live counters (for the progress display)."""

    total: int = 0
    submitted: int = 0
    rejected: int = 0
    running: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0  #: ended by the scheduler (e.g. unschedulable_timeout) or a cancel
    unplaceable: int = 0
    trace_now_s: float = 0.0
    trace_end_s: float = 0.0
    jumps: int = 0


@dataclass
class _JobTrack:
    job: TraceJob
    job_id: str = ""
    state: str = "new"      # new, submitted, running, done, rejected
    unplaceable: bool = False
    attempt: int = 0


class ReplayDriver:
    """Runs one replay (see the module docstring)."""

    def __init__(self, options: ReplayOptions, on_progress: Callable[[Progress], None] | None = None) -> None:
        self.o = options
        self.on_progress = on_progress or (lambda p: None)
        self.progress = Progress()
        self.tracks: dict[str, _JobTrack] = {}
        self.by_job_id: dict[str, _JobTrack] = {}
        self.ends: list[tuple[float, str, int]] = []  # (business end, job id, attempt) of running jobs
        self.system: System | None = None
        self.clock: ReplayClock | None = None
        self._early: dict[str, list[Delivery]] = {}  # events that beat the SubmitJob response
        self.skipped = SkippedTypes("replay-driver")  # events of unknown types (newer producers)
        self.timed_out = False  #: the replay stopped at ``timeout_s`` with jobs still open
        self.rejections: Counter[str] = Counter()  #: "STATUS: field" -> rejected submissions
        self._poke = asyncio.Event()  # something happened: check quiescence again

    async def run(self) -> dict:
        """Replay and return the report (see :func:`~fedapp.replay.report.build_report`)."""
        t_wall = time.monotonic()
        topo = self.o.topology if self.o.topology is not None else default_topology(self.o.nodes_csv)
        cache: dict = {}
        split = {c.name: cluster_nodes(topo, c.name, cache) for c in topo.clusters if c.backend == "trace"}
        nodes = [n for part in split.values() for n in part]
        jobs = trace_jobs(load_pods(self.o.pods_csv), self.o.limit, self.o.load, regions=topo.region_names())
        self.progress.total = len(jobs)
        self.progress.trace_end_s = max((j.submit_at_s + j.pod.runtime_s for j in jobs), default=0)
        log.info("replay: %d jobs on %d nodes in %d clusters", len(jobs), len(nodes), sum(1 for v in split.values() if v))
        epoch = self.o.epoch.timestamp()
        self.clock = ReplayClock(ClockState(time.time(), epoch, self.o.speed, 1))
        policy_text = None
        if self.o.topology is not None and self.o.settings.policy_file is None:
            policy_text = policy_for_topology(bundled_policy_text(), topo)
        opts = SystemOptions(settings=self.o.settings, clock=self.clock, policy=self.o.policy, topology=topo,
                             split=split, policy_text=policy_text, agent_tick_s=0.005)
        self.system = System(opts)
        await self.system.start()
        self.system.scheduler.on_cycle.append(self._poke.set)
        for name, url in self.system.metrics_urls.items():
            log.info("replay: %s metrics on %s", name, url)
        try:
            await publish_clock(self.system.setup, self.clock.state)
            await self._wait_for_clusters(len(self.system.agents), {n.card_model for n in nodes if n.card_model})
            follower = StreamFollower(self.system.control, "EVENTS", self._on_event, name="replay-driver",
                                      filter_subjects=[self.system.control.subjects.all("status"),
                                                       self.system.control.subjects.all("decisions")])
            follow_task = asyncio.create_task(follower.run())
            try:
                token = self.system.admin_token or resolve_token(data_dir=self.o.settings.data_dir)
                async with aio_channel(self.system.grpc_target, token) as channel:
                    stub = pb_grpc.JobServiceStub(channel)
                    finished = await self._drive(stub, jobs, epoch, t_wall)
            finally:
                follower.stop()
                follow_task.cancel()
                await asyncio.gather(follow_task, return_exceptions=True)
            policy_version = self.system.scheduler.policy.version
            await self.system.stop_producers()
            await self.system.drain_writers()
            stream_messages = await self.system.stream_messages()
            wall = time.monotonic() - t_wall
            report = await asyncio.to_thread(
                build_report, self.system.sync_store, policy=policy_version, wall_seconds=wall,
                submitted=self.progress.submitted + self.progress.rejected, rejected=self.progress.rejected,
                unplaceable=self.progress.unplaceable, completed=finished, speed=self.o.speed, jumps=self.progress.jumps,
                stream_messages=stream_messages, load=self.o.load)
            report["timed_out"] = self.timed_out
            report["rejected_reasons"] = [{"reason": r, "jobs": n} for r, n in self.rejections.most_common(10)]
            if self.o.on_finished is not None:
                await self.o.on_finished(self.system, report)
            return report
        finally:
            await self.system.stop()

    async def _wait_for_clusters(self, expected: int, models: set[str], timeout_s: float = 60.0) -> None:
        """Until the scheduler knows ``expected`` clusters and admission every card model of the
        node list (a node list without GPUs has none to wait for)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.system.scheduler.clusters) >= expected and self.system.admission.known_models >= models:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"only {len(self.system.scheduler.clusters)} of {expected} clusters reported inventory")

    # ------------------------------------------------------------------ events

    def _on_event(self, d: Delivery) -> None:
        self._poke.set()
        env = d.envelope
        if check_subject(self.system.control.prefix, d.subject, env) is not None:
            return  # an agent speaking for another cluster (the services refuse and audit it)
        track = self.by_job_id.get(env.job_id)
        if track is None:
            self._early.setdefault(env.job_id, []).append(d)
            return
        if track.state in ("done", "rejected"):
            return
        fold = REPLAY_EVENTS.route(env.type, self.skipped)
        if fold is not None:
            fold(self, env, track)

    def _on_pending(self, env: Envelope, track: _JobTrack) -> None:
        p = self.progress
        pend = env.payload_as(JobPending)
        if track.state == "running":
            return
        if track.unplaceable != (not pend.fits_empty):
            track.unplaceable = not pend.fits_empty
            p.unplaceable += 1 if track.unplaceable else -1

    def _on_started(self, env: Envelope, track: _JobTrack) -> None:
        p = self.progress
        if track.unplaceable:
            track.unplaceable = False
            p.unplaceable -= 1
        track.state, track.attempt = "running", env.attempt
        p.running += 1
        heapq.heappush(self.ends, (env.occurred_at.timestamp() + track.job.pod.runtime_s, env.job_id, env.attempt))

    def _on_ended(self, env: Envelope, track: _JobTrack) -> None:
        """An attempt ended: the job is done (finished, failed, cancelled -- each counted once, and
        no longer unplaceable) or requeued by the scheduler (stopped, rejected)."""
        p = self.progress
        if track.state == "done":
            return  # e.g. the scheduler's job.cancelled after the last attempt ended
        if track.state == "running" and env.attempt == track.attempt:
            p.running -= 1
        if env.type in (EventType.JOB_FINISHED, EventType.JOB_FAILED, EventType.JOB_CANCELLED):
            track.state = "done"
            if track.unplaceable:
                track.unplaceable = False
                p.unplaceable -= 1
            if env.type == EventType.JOB_FAILED:
                p.failed += 1
            elif env.type == EventType.JOB_CANCELLED:
                p.cancelled += 1
            else:
                p.finished += 1
        else:
            track.state = "submitted"  # requeued by the scheduler

    # ------------------------------------------------------------------ the loop

    async def _drive(self, stub, jobs: list[TraceJob], epoch: float, t_wall: float) -> int:
        i = 0
        n = len(jobs)
        sem = asyncio.Semaphore(self.o.submit_concurrency)
        pending_submits: set[asyncio.Task] = set()
        last_progress = 0.0
        idle_since = None
        while True:
            now_b = self.clock.time()
            self.progress.trace_now_s = now_b - epoch
            while i < n and epoch + jobs[i].submit_at_s <= now_b:
                job = jobs[i]
                i += 1
                task = asyncio.create_task(self._submit(stub, job, sem))
                pending_submits.add(task)
                task.add_done_callback(pending_submits.discard)
            if time.monotonic() - last_progress > 0.25:
                last_progress = time.monotonic()
                self.on_progress(self.progress)
            if self.system.failed.is_set():
                raise UnavailableError(f"a service crashed during the replay: {self.system.failure!r}")
            if time.monotonic() - t_wall > self.o.timeout_s:
                log.warning("replay: timeout after %.0fs; reporting what happened", self.o.timeout_s)
                self.timed_out = True
                break
            p = self.progress
            if (i >= n and not pending_submits
                    and p.finished + p.failed + p.cancelled + p.rejected + p.unplaceable >= n):
                break  # every job ended, was rejected, or is provably unplaceable
            if pending_submits or not await self._quiescent():
                idle_since = None
                self._poke.clear()
                try:
                    await asyncio.wait_for(self._poke.wait(), timeout=0.005)
                except asyncio.TimeoutError:
                    pass
                continue
            target = epoch + jobs[i].submit_at_s if i < n else None
            sched = self.system.scheduler.status()
            self._drop_ended()
            if sched["queued"] > 0 and self.ends:
                target = self.ends[0][0] if target is None else min(target, self.ends[0][0])
            if sched.get("next_due") is not None:  # a scheduler timer (approval timeout) may change things
                due = sched["next_due"] + 0.001
                target = due if target is None else min(target, due)
            if target is None:
                # nothing will arrive and nothing that ends would unblock anyone
                if not self.ends or sched["queued"] == 0:
                    if idle_since is None:
                        idle_since = time.monotonic()
                    if time.monotonic() - idle_since > 1.0 and not self.ends:
                        break
                    target = self.ends[0][0] if self.ends else None
                if target is None:
                    await asyncio.sleep(0.01)
                    continue
            if target > self.clock.time():
                state = self.clock.jump_to(target)
                self.progress.jumps += 1
                await publish_clock(self.system.setup, state)
            await asyncio.sleep(0)
        if pending_submits:
            await asyncio.gather(*pending_submits, return_exceptions=True)
        self.on_progress(self.progress)
        return sum(1 for t in self.tracks.values() if t.state == "done")

    def _drop_ended(self) -> None:
        while self.ends:
            end, job_id, attempt = self.ends[0]
            track = self.by_job_id.get(job_id)
            if track is not None and track.state == "running" and track.attempt == attempt:
                return
            heapq.heappop(self.ends)

    async def _quiescent(self) -> bool:
        sched = self.system.scheduler
        st = sched.status()
        if st["dirty"] or st.get("busy") or st["placed"] > 0:
            return False
        if sched.applied_seq < await self.system.stream_last_seq("EVENTS"):
            return False
        self._drop_ended()
        if self.ends and self.ends[0][0] <= self.clock.time():
            return False  # an agent has yet to report a job that has ended
        return True

    async def _submit(self, stub, job: TraceJob, sem: asyncio.Semaphore) -> None:
        track = _JobTrack(job)
        self.tracks[job.request_id] = track
        try:
            wire = spec_to_pb(job.spec)
        except (ValueError, TypeError) as e:  # a value the wire format cannot carry (e.g. beyond int64)
            track.state = "rejected"
            self.progress.rejected += 1
            self.rejections["not sendable: a value beyond the wire format"] += 1
            log.warning("replay: %s cannot be sent as a job (%s); counted as rejected", job.pod.name, e)
            return
        async with sem:
            for attempt in range(5):
                try:
                    resp = await stub.SubmitJob(pb.SubmitJobRequest(spec=wire, request_id=job.request_id),
                                                timeout=30)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and attempt < 4:
                        await asyncio.sleep(0.2 * 2 ** attempt)
                        continue
                    track.state = "rejected"
                    self.progress.rejected += 1
                    self.rejections[f"{e.code().name}: {(e.details() or '').split(':')[0]}"] += 1
                    log.info("replay: %s rejected: %s %s", job.pod.name, e.code().name, e.details())
                    return
        track.job_id = resp.job_id
        track.state = "submitted"
        self.by_job_id[resp.job_id] = track
        self.progress.submitted += 1
        for d in self._early.pop(resp.job_id, []):
            self._on_event(d)


def write_report(report: dict, path: Path) -> None:
    """Write the JSON report."""
    Path(path).write_text(strict_json(report, indent=2) + "\n", "utf-8")


#: The replay driver's table (status and decisions subjects): what moves a traced job's progress.
#: Finished, failed and cancelled end the job; stopped and rejected attempts are requeued.
REPLAY_EVENTS: EventTable = EventTable({
    EventType.JOB_PENDING: ReplayDriver._on_pending,
    EventType.JOB_STARTED: ReplayDriver._on_started,
    EventType.JOB_FINISHED: ReplayDriver._on_ended,
    EventType.JOB_FAILED: ReplayDriver._on_ended,
    EventType.JOB_CANCELLED: ReplayDriver._on_ended,
    EventType.JOB_STOPPED: ReplayDriver._on_ended,
    EventType.JOB_REJECTED: ReplayDriver._on_ended,
})
