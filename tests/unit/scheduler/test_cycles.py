"""Scheduler cycles as tables: events in, clock advances, cycles, decisions out.

Each case drives a real :class:`~services.scheduler.service.SchedulerService` through
:class:`tests.builders.SchedulerHarness` -- a fake publisher (its publishes are read back as the
stream follower would), a fake clock, live clusters heartbeating as the clock advances -- with
no NATS and no sleeps. A step is an input (submit, report, cancel, silence, advance, restart) or a
cycle with the exact decisions (``job.placed``, ``job.stop``, ``job.stopped``, ``job.cancelled``;
pending reasons left out) it must publish.

Clusters: A = cn-north-1-c1 and B = cn-north-1-c2, one node of 8 T4 cards each, in the job's
home region; on equal scores the tie goes to A, so every move to B is the rule under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from fedsched.events import business_event_id
from fedsched.jobs import PriorityClass
from fedsched.pricing import load_price_catalog
from services.billing.usage import compute_line, placement_record
from services.scheduler.states import Outcome, ShardState
from tests.builders import T4, ClusterSpec, Decision, SchedulerHarness, nodes

A, B = "cn-north-1-c1", "cn-north-1-c2"
TWO = (ClusterSpec(A, node_list=nodes("a")), ClusterSpec(B, node_list=nodes("b")))
ONE = (ClusterSpec(A, node_list=nodes("a")),)


def placed(job: str, attempt: int, cluster: str) -> Decision:
    return Decision("job.placed", job, attempt, cluster)


def stop(job: str, attempt: int, cluster: str, reason: str) -> Decision:
    return Decision("job.stop", job, attempt, cluster, reason)


def stopped(job: str, attempt: int, cluster: str, reason: str) -> Decision:
    return Decision("job.stopped", job, attempt, cluster, reason)


def cancelled(job: str, attempt: int) -> Decision:
    return Decision("job.cancelled", job, attempt, "", "cancelled")


# ---------------------------------------------------------------------------- steps

@dataclass
class Submit:
    job: str
    spec: dict[str, Any] = field(default_factory=dict)

    async def __call__(self, h: SchedulerHarness) -> None:
        h.submit(self.job, **self.spec)


@dataclass
class Report:
    job: str
    type: str
    reason: str = ""

    async def __call__(self, h: SchedulerHarness) -> None:
        h.report(self.job, self.type, reason=self.reason)


@dataclass
class Cancel:
    job: str

    async def __call__(self, h: SchedulerHarness) -> None:
        h.cancel(self.job)


@dataclass
class Silence:
    cluster: str

    async def __call__(self, h: SchedulerHarness) -> None:
        h.silence(self.cluster)


@dataclass
class Behind:
    """The cluster's agent says in its heartbeats that it has ``orders`` still to read."""
    cluster: str
    orders: int

    async def __call__(self, h: SchedulerHarness) -> None:
        h.backlog[self.cluster] = self.orders


@dataclass
class Advance:
    seconds: float

    async def __call__(self, h: SchedulerHarness) -> None:
        h.advance(self.seconds)


@dataclass
class Restart:
    async def __call__(self, h: SchedulerHarness) -> None:
        h.restart()


@dataclass
class Cycle:
    expect: list[Decision] = field(default_factory=list)

    async def __call__(self, h: SchedulerHarness) -> None:
        assert await h.cycle() == self.expect


@dataclass
class Check:
    """An assertion on the service's book: ``check(harness)`` must be true."""

    what: str
    check: Callable[[SchedulerHarness], bool]

    async def __call__(self, h: SchedulerHarness) -> None:
        assert self.check(h), self.what


def state(job: str, expected: ShardState, outcome: Outcome = Outcome.NONE) -> Check:
    return Check(f"{job} is {expected} {outcome}",
                 lambda h: (h.shard(job).state, h.shard(job).outcome) == (expected, outcome))


@dataclass
class Case:
    id: str
    clusters: tuple[ClusterSpec, ...]
    steps: list
    settings: dict[str, Any] = field(default_factory=dict)


LOW = dict(gpus=8, priority=PriorityClass.LOW, preemptible=True, estimated_duration_s=7200)
HIGH = dict(gpus=8, priority=PriorityClass.HIGH, estimated_duration_s=600)

CASES = [
    Case("failover: a failed attempt is retried on another cluster within retry_limit", TWO, [
        Submit("j1", dict(gpus=8, retry_limit=1)),
        Cycle([placed("j1", 1, A)]),
        Report("j1", "job.started"),
        Report("j1", "job.failed", "exit 1"),
        Cycle([placed("j1", 2, B)]),  # not A again, although A scores as well and is free
        state("j1", ShardState.PLACED),
    ]),
    Case("failover: a failure beyond retry_limit ends the job", TWO, [
        Submit("j1", dict(gpus=8, retry_limit=1)),
        Cycle([placed("j1", 1, A)]),
        Report("j1", "job.started"),
        Report("j1", "job.failed", "exit 1"),
        Cycle([placed("j1", 2, B)]),
        Report("j1", "job.started"),
        Report("j1", "job.failed", "exit 1"),
        Cycle([]),
        state("j1", ShardState.DONE, Outcome.FAILED),
    ]),
    Case("reclaim: a placement not started within reclaim_after_s is taken back and placed again", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Advance(19.9),
        Cycle([]),  # within reclaim_after_s: left alone
        Advance(0.2),
        Cycle([stop("j1", 1, A, "reclaimed"), placed("j1", 2, B)]),
        Check("the reclaimed cluster is avoided", lambda h: h.shard("j1").avoid == {A}),
    ], dict(reclaim_after_s=20.0)),
    Case("reclaim: an agent alive but behind on its orders keeps its placement until it has read them", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Behind(A, 3),
        Advance(25),
        Cycle([]),  # due, but A has orders to read: not placed twice
        state("j1", ShardState.PLACED),
        Advance(0.5),
        Cycle([]),  # the waiting placement is looked at again only after a while
        Behind(A, 0),
        Advance(1.0),
        Cycle([stop("j1", 1, A, "reclaimed"), placed("j1", 2, B)]),  # read everything, did not start it
    ], dict(reclaim_after_s=20.0)),
    Case("reclaim: an agent behind for ever does not hold a placement past the limit", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Behind(A, 3),
        Advance(199),
        Cycle([]),
        Advance(2),  # 10 x reclaim_after_s (RECLAIM_BACKLOG_LIMIT)
        Cycle([stop("j1", 1, A, "reclaimed"), placed("j1", 2, B)]),
    ], dict(reclaim_after_s=20.0)),
    Case("reclaim: a started placement is never reclaimed", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Report("j1", "job.started"),
        Advance(60),
        Cycle([]),
        state("j1", ShardState.RUNNING),
    ], dict(reclaim_after_s=20.0)),
    Case("cancel: a queued job ends at once", ONE, [
        Submit("j1", dict(gpus=16)),  # fits no cluster: stays queued
        Cycle([]),
        Cancel("j1"),
        Cycle([cancelled("j1", 0)]),
        state("j1", ShardState.DONE, Outcome.CANCELLED),
    ]),
    Case("cancel: a running job is stopped on its agent, cancelled when it reports stopped", ONE, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Report("j1", "job.started"),
        Cancel("j1"),
        Cycle([stop("j1", 1, A, "cancelled")]),
        Cycle([]),  # the stop order is not repeated while the agent stops it
        Report("j1", "job.stopped", "cancelled"),
        Cycle([cancelled("j1", 1)]),
        state("j1", ShardState.DONE, Outcome.CANCELLED),
    ]),
    Case("preemption: a high-priority job preempts a preemptible low one", ONE, [
        Submit("low", LOW),
        Cycle([placed("low", 1, A)]),
        Report("low", "job.started"),
        Advance(1.0),
        Submit("high", HIGH),
        Cycle([stop("low", 1, A, "preempted"), placed("high", 1, A)]),
        state("low", ShardState.STOPPING),
        Report("low", "job.stopped", "preempted"),
        Cycle([]),  # requeued; A is full until the high job ends
        state("low", ShardState.QUEUED),
        Check("the victim keeps no allocation", lambda h: h.shard("low").placed is None),
    ]),
    Case("preemption: a job that is not preemptible is never a victim", ONE, [
        Submit("low", {**LOW, "preemptible": False}),
        Cycle([placed("low", 1, A)]),
        Report("low", "job.started"),
        Submit("high", HIGH),
        Cycle([]),
        state("high", ShardState.QUEUED),
    ]),
    Case("staleness: a silent cluster is excluded from placements", TWO, [
        Silence(A),
        Advance(2.0),
        Cycle([]),
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, B)]),
    ], dict(stale_after_s=1.0)),
    Case("staleness: an unstarted placement on a silent cluster moves (nothing else queued)", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Silence(A),
        Advance(1.0),
        Cycle([]),  # last heartbeat within the limit
        Advance(0.6),
        Cycle([stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"), placed("j1", 2, B)]),
    ], dict(stale_after_s=1.0, reclaim_after_s=20.0)),
    Case("staleness: a running attempt on a silent cluster is declared lost and moves", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Report("j1", "job.started"),
        Silence(A),
        Advance(1.6),
        Cycle([stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"), placed("j1", 2, B)]),
        Report("j1", "job.started"),
        state("j1", ShardState.RUNNING),
    ], dict(stale_after_s=1.0, reclaim_after_s=20.0)),
    Case("staleness: a preempted victim whose cluster falls silent before it reports is ended and requeued", ONE, [
        Submit("low", LOW),
        Cycle([placed("low", 1, A)]),
        Report("low", "job.started"),
        Submit("high", HIGH),
        Cycle([stop("low", 1, A, "preempted"), placed("high", 1, A)]),
        Silence(A),
        Advance(1.6),
        Cycle([stop("high", 1, A, "cluster_lost"), stopped("high", 1, A, "cluster_lost"),
               stopped("low", 1, A, "cluster_lost")]),
        state("low", ShardState.QUEUED),
        state("high", ShardState.QUEUED),
        Check("the victim's end carries its card model (billing prices it)",
              lambda h: [p.event.payload["card_model"] for p in h.publisher.published
                         if p.event.type == "job.stopped" and p.event.job_id == "low"] == [T4]),
    ], dict(stale_after_s=1.0)),
    Case("staleness: a stale cluster heard from again takes placements again", ONE, [
        Silence(A),
        Advance(2.0),
        Submit("j1", dict(gpus=8)),
        Cycle([]),
        Check("A is stale", lambda h: A in h.svc.status()["stale"]),
        Check("A comes back", lambda h: h.silent.discard(A) or True),
        Advance(0.5),
        Cycle([placed("j1", 1, A)]),
    ], dict(stale_after_s=1.0)),
    Case("restart: a reclaimed shard is rebuilt placed elsewhere, still avoiding the cluster", TWO, [
        Submit("j1", dict(gpus=8)),
        Cycle([placed("j1", 1, A)]),
        Advance(20.1),
        Cycle([stop("j1", 1, A, "reclaimed"), placed("j1", 2, B)]),
        Restart(),
        Check("on B, attempt 2, avoiding A", lambda h: (h.shard("j1").state, h.shard("j1").attempt,
                                                        h.shard("j1").cluster, h.shard("j1").avoid)
              == (ShardState.PLACED, 2, B, {A})),
        Cycle([]),
    ], dict(reclaim_after_s=20.0)),
    Case("restart: a preempted victim is rebuilt stopping, then requeued by its agent's report", ONE, [
        Submit("low", LOW),
        Cycle([placed("low", 1, A)]),
        Report("low", "job.started"),
        Submit("high", HIGH),
        Cycle([stop("low", 1, A, "preempted"), placed("high", 1, A)]),
        Restart(),
        state("low", ShardState.STOPPING),
        Report("low", "job.stopped", "preempted"),
        Cycle([]),
        state("low", ShardState.QUEUED),
    ]),
    Case("restart: shards moved off a lost cluster are rebuilt where they were moved", TWO, [
        Submit("j1", dict(gpus=4)),
        Submit("j2", dict(gpus=4)),
        Cycle([placed("j1", 1, A), placed("j2", 1, A)]),
        Report("j2", "job.started"),
        Silence(A),
        Advance(1.6),
        Cycle([stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"),
               stop("j2", 1, A, "cluster_lost"), stopped("j2", 1, A, "cluster_lost"),
               placed("j1", 2, B), placed("j2", 2, B)]),
        Restart(),
        Check("both on B, attempt 2, placed", lambda h: [(h.shard(j).state, h.shard(j).attempt, h.shard(j).cluster)
                                                         for j in ("j1", "j2")] == [(ShardState.PLACED, 2, B)] * 2),
        Cycle([]),  # nothing is placed twice after the restart
    ], dict(stale_after_s=1.0, reclaim_after_s=20.0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_cycle_table(case: Case) -> None:
    h = SchedulerHarness(case.clusters, **case.settings)
    for step in case.steps:
        await step(h)


# ---------------------------------------------------------------------------- issue 13 item 3

async def test_after_a_restart_a_cluster_silent_past_the_limit_gets_no_placement() -> None:
    """Freshness limit 1 s; A silent for 2 s; a new scheduler rebuilds from the streams; an
    8-GPU job that A's last inventory could hold goes to B, not to A."""
    h = SchedulerHarness(TWO, stale_after_s=1.0, reclaim_after_s=20.0)
    h.silence(A)
    h.advance(2.0)
    h.restart()
    h.submit("j1", gpus=8)
    assert await h.cycle() == [placed("j1", 1, B)]  # the view's heartbeat age is A's own
    assert h.svc.status()["stale"] == []  # not judged stale (work moved) within the start-up grace


async def test_after_a_restart_placements_on_a_silent_cluster_move_after_the_grace() -> None:
    """A job runs on A; A goes silent and the scheduler restarts 2 s later (limit 1 s): the
    rebuilt scheduler does not move it before it has had ``stale_after_s`` to hear from A
    (its start-up grace), and moves it once that has passed (within one wake-up)."""
    h = SchedulerHarness(TWO, stale_after_s=1.0, reclaim_after_s=20.0)
    h.submit("j1", gpus=8)
    assert await h.cycle() == [placed("j1", 1, A)]
    h.report("j1", "job.started")
    h.silence(A)
    h.advance(2.0)
    h.restart()
    started = h.clock.time()
    assert await h.cycle() == []  # A's heartbeat is 2 s old, but this scheduler has not waited for it
    out = await h.run_for(3.0)
    moves = [(t, d) for t, d in out if d.job_id == "j1"]
    assert [d for _, d in moves] == [stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"),
                                     placed("j1", 2, B)]
    assert 1.0 < moves[0][0] - started <= 1.0 + 0.1  # the grace plus one (immediate) wake-up


@pytest.mark.parametrize("down_s", [0.6, 6.6], ids=["shorter-than-the-limit", "longer-than-the-limit"])
async def test_after_a_restart_agents_heard_within_the_grace_lose_no_work(down_s) -> None:
    """The tryout: every agent and the scheduler stop (kill -9), all start again ``down_s`` later
    (limit 1 s); the agents' first heartbeats arrive 0.5 s after the scheduler's start: the running
    job and the placed one (started by its agent once back) stay where they are: nothing is
    stopped or reclaimed."""
    h = SchedulerHarness(TWO, stale_after_s=1.0, reclaim_after_s=2.0)
    h.submit("j1", gpus=8)
    h.submit("j2", gpus=8)
    assert sorted(await h.cycle(), key=lambda d: d.job_id) == [placed("j1", 1, A), placed("j2", 1, B)]
    h.report("j1", "job.started")
    h.silence(A)
    h.silence(B)
    h.advance(down_s)
    h.restart()
    assert await h.cycle() == []
    h.advance(0.5)
    h.silent.clear()  # the agents are back: heartbeats from now on
    h._next_beat = h.clock.time()
    out = await h.run_for(1.2)  # j2's agent reads its order meanwhile (within reclaim_after_s of the start)
    h.report("j2", "job.started")
    out += await h.run_for(5.0)
    assert [d for _, d in out] == []
    assert h.svc.status()["stale"] == []
    assert (h.shard("j1").state, h.shard("j1").attempt) == (ShardState.RUNNING, 1)
    assert (h.shard("j2").state, h.shard("j2").attempt) == (ShardState.RUNNING, 1)


@pytest.mark.parametrize("started", [False, True], ids=["placed", "running"])
async def test_with_nothing_queued_a_silent_clusters_placement_moves_within_the_limit_plus_one_cycle(started) -> None:
    """A job placed on A (started or not), A goes silent, nothing else queued: it moves about
    the freshness limit (1 s) after A's last heartbeat -- not after reclaim_after_s (20 s) --
    with the service's own periodic wake-up (no event arrives meanwhile)."""
    h = SchedulerHarness(TWO, stale_after_s=1.0, reclaim_after_s=20.0)
    h.submit("j1", gpus=8)
    assert await h.cycle() == [placed("j1", 1, A)]
    if started:
        h.report("j1", "job.started")
    last_heartbeat = max(d.published_at for (t, c), d in h.inventory.items() if c == A)
    h.silence(A)
    out = await h.run_for(5.0)  # well short of reclaim_after_s
    moves = [(t, d) for t, d in out if d.job_id == "j1"]
    assert [d for _, d in moves] == [stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"),
                                     placed("j1", 2, B)]
    moved_at = moves[0][0]
    assert 1.0 < moved_at - last_heartbeat <= 1.0 + 0.1  # the limit plus one (immediate) cycle


async def test_a_lost_running_attempt_is_billed_up_to_when_it_was_declared_lost() -> None:
    """The ``job.stopped`` published for a lost attempt ends it at the declaration time; billing's
    pure core prices exactly [started, declared] (and nothing for an attempt never started)."""
    h = SchedulerHarness(TWO, stale_after_s=1.0)
    h.submit("j1", gpus=8)
    await h.cycle()
    h.report("j1", "job.started")
    started = h.clock.time()
    h.silence(A)
    h.advance(1.6)
    await h.cycle()
    declared = h.clock.time()
    ended = next(p.event for p in h.publisher.published if p.event.type == "job.stopped")
    assert ended.occurred_at.timestamp() == pytest.approx(declared)
    assert ended.event_id == business_event_id("j1", 1, 0, "ended")  # the id the agent would give it
    placed = next(p.event for p in h.publisher.published if p.event.type == "job.placed")
    line = compute_line(ended, placement_record(placed), load_price_catalog())
    assert line is not None and line.flag == "cluster_lost"
    assert line.gpu_seconds == pytest.approx(8 * (declared - started), abs=0.01)


async def test_an_unacknowledged_move_is_retried_and_the_book_is_unchanged_meanwhile() -> None:
    """JetStream acknowledges nothing for a cycle: the shard stays where it was (nothing is
    placed twice); the next cycle publishes the move again."""
    h = SchedulerHarness(TWO, stale_after_s=1.0)
    h.submit("j1", gpus=8)
    await h.cycle()
    h.silence(A)
    h.advance(1.6)
    h.publisher.refuse = lambda subject, event: True
    assert await h.cycle() == []
    assert [p.event.type for p in h.publisher.refused] == ["job.stop", "job.stopped"]
    assert (h.shard("j1").state, h.shard("j1").cluster) == (ShardState.PLACED, A)
    h.publisher.refuse = None
    assert await h.cycle() == [stop("j1", 1, A, "cluster_lost"), stopped("j1", 1, A, "cluster_lost"),
                               placed("j1", 2, B)]


def test_a_woken_cycle_waits_the_coalescing_delay_and_starts_at_least_an_interval_after_the_last():
    """Issue 15: a cycle starts when something changed (not on a timer), after a short
    coalescing delay that gathers what arrives with it; cycles start at most once per
    ``interval_s`` (measured from the previous start, not after a pause that follows every
    cycle). The delay never exceeds the interval."""

    svc = SchedulerHarness((ClusterSpec("cn-north-1-c1", node_list=nodes("a", count=1)),),
                           interval_s=0.02, coalesce_s=0.003).svc
    assert svc.cycle_delay_s(50.0) == 0.003  # the first cycle: only the coalescing delay
    svc._cycle_started = 100.0
    assert svc.cycle_delay_s(100.005) == pytest.approx(0.015)  # the rest of the interval
    assert svc.cycle_delay_s(100.019) == pytest.approx(0.003)  # never below the coalescing delay
    assert svc.cycle_delay_s(101.0) == 0.003  # idle for long: the change is decided 3 ms later
    svc = SchedulerHarness((ClusterSpec("cn-north-1-c1", node_list=nodes("a", count=1)),),
                           interval_s=0.001, coalesce_s=0.5).svc
    assert svc.coalesce_s == 0.001  # capped by the interval


async def test_a_start_does_not_wake_a_cycle_but_an_end_and_a_window_left_waiting_do():
    """Issue 15: cycles are woken by what can change a decision -- a submission, an attempt that
    ended (room freed), a window that left shards waiting -- not by every placement read back or
    job.started (at 150 jobs/s those woke a cycle each)."""
    h = SchedulerHarness((ClusterSpec("cn-north-1-c1", node_list=nodes("a", count=2)),), reclaim_after_s=1e9,
                         max_jobs_per_cycle=2)
    svc = h.svc
    for i in range(3):
        h.submit(f"j{i}")
    svc._dirty.clear()
    await h.cycle()  # places two of three: the window left one waiting
    assert svc._dirty.is_set()
    svc._dirty.clear()
    await h.cycle()  # places the third (nothing left waiting)
    assert h.shard("j2").state == ShardState.PLACED and not svc._dirty.is_set()
    h.report("j0", "job.started")
    assert not svc._dirty.is_set()  # a start takes no decision further
    h.report("j0", "job.finished")
    assert svc._dirty.is_set()  # room freed
    svc._dirty.clear()
    h.submit("late")
    assert svc._dirty.is_set()
