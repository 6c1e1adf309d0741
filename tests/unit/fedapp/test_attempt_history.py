"""`fedsched explain`'s attempt history and the jobs table's attempts column (pure, on GetJob messages)."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from fedapp.cli.jobs import _attempts_cell, attempt_history
from fedsched.api.v1 import jobs_pb2 as pb


def _at(minute: int) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(datetime(2026, 1, 1, 12, minute, tzinfo=UTC))
    return ts


def _attempt(n: int, cluster: str, outcome: str, reason: str = "", *, shard: int = 0, ended: int | None = None):
    a = pb.Attempt(attempt=n, cluster=cluster, outcome=outcome, reason=reason, shard=shard)
    if ended is not None:
        a.ended_at.CopyFrom(_at(ended))
    return a


def test_a_lost_attempt_reads_as_a_failover_to_the_next_attempts_cluster() -> None:
    job = pb.Job(job_id="j1", attempts=[_attempt(1, "c1", "lost", "cluster_lost", ended=5), _attempt(2, "c2", "running")])
    assert attempt_history(job) == [
        "failover: attempt 1 lost on c1 at 2026-01-01 12:05:00 (cluster_lost); moved to c2 as attempt 2 (running)"]
    assert _attempts_cell(job) == "lost, running"


def test_agent_stops_no_order_explains_are_reconciliation_others_keep_their_outcome() -> None:
    job = pb.Job(job_id="j1", attempts=[
        _attempt(1, "c1", "stopped", "superseded by attempt 2", ended=1),
        _attempt(2, "c2", "preempted", "preempted for j9", ended=2),
        _attempt(3, "c2", "succeeded", ended=3),
        _attempt(1, "c3", "lost", "cluster_lost", shard=1, ended=4)])
    assert attempt_history(job) == [
        "reconciled: shard 0 attempt 1 on c1 stopped by its agent at 2026-01-01 12:01:00 (superseded by attempt 2); "
        "moved to c2 as attempt 2 (preempted)",
        "preempted: shard 0 attempt 2 on c2 at 2026-01-01 12:02:00 (preempted for j9); moved to c2 as attempt 3 "
        "(succeeded)",
        "failover: shard 1 attempt 1 lost on c3 at 2026-01-01 12:04:00 (cluster_lost); no later attempt"]


def test_one_attempt_that_ran_to_its_end_has_no_story() -> None:
    assert attempt_history(pb.Job(job_id="j1", attempts=[_attempt(1, "c1", "succeeded", ended=9)])) == []
    assert _attempts_cell(pb.Job(job_id="j1")) == "-"
