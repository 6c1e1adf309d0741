"""Holds, releases and priority changes in the scheduler, as tables on the harness (no NATS, no
sleeps): a held job leaves the queue (never decided, no pending reason, not counted as queued)
until released, keeps its submit time for aging, can be cancelled; a hold after the placement has
no effect; a priority change re-orders the queue.

Cluster A: one node of 2 T4 cards; every job asks for 1 card, so two jobs fit at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from fedsched.jobs import PriorityClass
from services.scheduler.states import ShardState
from tests.builders import ClusterSpec, Decision, SchedulerHarness, nodes

A = "cn-north-1-c1"
SMALL = (ClusterSpec(A, node_list=nodes("a", gpus=2)),)


def placed(job: str, attempt: int = 1) -> Decision:
    return Decision("job.placed", job, attempt, A)


@dataclass
class Case:
    id: str
    steps: list[Callable]  # h -> None (inputs) or an awaitable of decisions checked against `expect`
    expect: list[list[Decision]]  # the decisions of each cycle, in order
    check: Callable[[SchedulerHarness], None] = lambda h: None


def submit(job, **kw):
    return lambda h: h.submit(job, **kw)


def hold(job):
    return lambda h: h.hold(job)


def release(job):
    return lambda h: h.release(job)


def priority(job, cls):
    return lambda h: h.set_priority(job, cls)


def after(seconds):
    return lambda h: h.advance(seconds)


def finish(job):
    return lambda h: h.report(job, "job.finished")


def start(job):
    return lambda h: h.report(job, "job.started")


def cancel(job):
    return lambda h: h.cancel(job)


CYCLE = "cycle"


def _held_is_never_decided(h: SchedulerHarness) -> None:
    assert h.shard("j1").state == ShardState.HELD
    assert h.svc.status()["held"] == 1 and h.svc.status()["queued"] == 0
    # no pending reason was ever published for the held job
    assert not [p for p in h.publisher.published if p.event.type == "job.pending" and p.event.job_id == "j1"]


def _released_keeps_submit_time(h: SchedulerHarness) -> None:
    queued = {q.job_id: q for q in h.svc.queue()}
    assert queued["j1"].submitted_at == h.svc.jobs["j1"].submitted_at < queued["j4"].submitted_at


CASES = [
    Case("a held job is never decided while the others are placed",
         [submit("j1"), submit("j2"), submit("j3"), hold("j1"), CYCLE, after(5), CYCLE],
         [[placed("j2"), placed("j3")], []], _held_is_never_decided),
    Case("released, it goes before a later job (its original submit time ages it)",
         [submit("j1"), submit("j2"), submit("j3"), hold("j1"), CYCLE, start("j2"), start("j3"), after(60),
          submit("j4"), release("j1"), finish("j2"), CYCLE],
         [[placed("j2"), placed("j3")], [placed("j1")]]),
    Case("released jobs are queued again with their original submit time",
         [submit("j1"), submit("j2"), submit("j3"), hold("j1"), CYCLE, start("j2"), start("j3"), after(60),
          submit("j4"), release("j1")],
         [[placed("j2"), placed("j3")]], _released_keeps_submit_time),
    Case("a hold after the placement has no effect",
         [submit("j1"), CYCLE, hold("j1"), start("j1")],
         [[placed("j1")]], lambda h: h.shard("j1").state == ShardState.RUNNING or pytest.fail("not running")),
    Case("a held job can be cancelled",
         [submit("j1"), hold("j1"), CYCLE, cancel("j1"), CYCLE],
         [[], [Decision("job.cancelled", "j1", 0, "", "cancelled")]]),
    Case("a priority change re-orders the queue: the low job raised to high goes first",
         [submit("big", gpus=2), CYCLE, submit("normal"), after(1), submit("low", priority=PriorityClass.LOW),
          priority("low", PriorityClass.HIGH), CYCLE, start("big"), finish("big"), CYCLE],
         [[placed("big")], [], [placed("low"), placed("normal")]]),
    Case("without the change the normal job goes first",
         [submit("big", gpus=2), CYCLE, submit("normal"), after(1), submit("low", priority=PriorityClass.LOW),
          CYCLE, start("big"), finish("big"), CYCLE],
         [[placed("big")], [], [placed("normal"), placed("low")]]),
    Case("a priority change after the placement has no effect",
         [submit("j1"), CYCLE, priority("j1", PriorityClass.CRITICAL)],
         [[placed("j1")]], lambda h: h.svc.jobs["j1"].spec.priority == PriorityClass.NORMAL or pytest.fail("changed")),
    Case("a restarted scheduler rebuilds the hold from the stream",
         [submit("j1"), submit("j2"), hold("j1"), lambda h: h.restart(), CYCLE],
         [[placed("j2")]], lambda h: h.shard("j1").state == ShardState.HELD or pytest.fail("not held")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_hold_release_priority(case: Case) -> None:
    h = SchedulerHarness(SMALL)
    cycles = iter(case.expect)
    for step in case.steps:
        if step == CYCLE:
            got = await h.cycle()
            assert got == next(cycles)
        else:
            step(h)
    assert next(cycles, None) is None, "fewer cycles than expected decisions"
    case.check(h)
