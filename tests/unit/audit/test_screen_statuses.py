"""Audit judges an agent's status against the placements (issue 14): stored as itself only when
that attempt of that shard was placed on the reporting cluster; otherwise a
``security.rejected_message`` of the agent -- but only once every message before it has been
written (a placement handed back after an outage may still come). Fakes of our own seams: the
store answers the placements query, the bus stands in for the events consumer's progress."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from fedsched.errors import UnavailableError
from fedsched.events import EventType, JobStatus, Subjects, make_event
from fedsched.store import QueryResult
from services.audit.service import AuditService
from tests.builders import delivery

SUBJECTS = Subjects("t")
R, C1, C2 = "cn-east-1", "cn-east-1-c1", "cn-east-1-c2"


class _Store:
    """The placements query: ``rows`` (job_id, attempt, shard, region, cluster)."""

    def __init__(self, rows):
        self.rows = rows
        self.store = SimpleNamespace(database="db")
        self.asked: list[list[str]] = []

    async def query(self, sql, params):
        self.asked.append(params["jobs"])
        return QueryResult(("job_id", "attempt", "shard", "region", "cluster"), list(self.rows))


def _audit(rows, ack_floor: int) -> AuditService:
    async def consumer_info(stream, durable):
        return SimpleNamespace(ack_floor=SimpleNamespace(stream_seq=ack_floor))
    bus = SimpleNamespace(prefix="t", subjects=SUBJECTS, stream_name=lambda s: f"T_{s}",
                          js=SimpleNamespace(consumer_info=consumer_info))
    return AuditService(bus, _Store(rows), tenure=None)


def _finished(job: str, cluster: str, seq: int):
    env = make_event("job.finished", JobStatus(), producer=f"agent/{cluster}", occurred_at=1.7e9, region=R,
                     cluster=cluster, tenant="nlp", project="train", job_id=job, attempt=1)
    return delivery(env, SUBJECTS.status(R, cluster), seq, 1.7e9)


@pytest.mark.parametrize("job,cluster,stored", [
    pytest.param("j-1", C1, True, id="placed-there"),
    pytest.param("j-1", C2, False, id="placed-elsewhere"),
    pytest.param("j-9", C2, False, id="never-placed"),
])
async def test_a_status_is_stored_as_itself_only_when_placed_on_its_cluster(job, cluster, stored) -> None:
    audit = _audit([("j-1", 1, 0, R, C1)], ack_floor=9)
    (out,) = await audit.screen_statuses([_finished(job, cluster, 10)])
    assert (out.envelope.type == EventType.JOB_FINISHED) == stored
    if not stored:
        assert out.envelope.type == EventType.SECURITY_REJECTED_MESSAGE and out.envelope.job_id == ""
        assert out.envelope.payload["job_id"] == job and out.envelope.payload["event_type"] == "job.finished"


async def test_a_never_placed_status_waits_while_earlier_messages_are_outstanding() -> None:
    """Messages 5..9 were handed back (not written): the placement may be among them."""
    audit = _audit([], ack_floor=4)
    with pytest.raises(UnavailableError, match="waiting for the messages before"):
        await audit.screen_statuses([_finished("j-1", C1, 10)])
    # the same batch once they are written: refused
    audit = _audit([], ack_floor=9)
    (out,) = await audit.screen_statuses([_finished("j-1", C1, 10)])
    assert out.envelope.type == EventType.SECURITY_REJECTED_MESSAGE


async def test_earlier_messages_in_the_same_batch_count_as_written() -> None:
    """Floor 7, message 8 in this batch: nothing before the status (9) is outstanding."""
    audit = _audit([], ack_floor=7)
    other = replace(_finished("j-2", C1, 8), subject=SUBJECTS.decisions("nlp", "train"))  # not a status
    (_, out) = await audit.screen_statuses([other, _finished("j-1", C1, 9)])
    assert out.envelope.type == EventType.SECURITY_REJECTED_MESSAGE


async def test_a_second_end_of_an_attempt_is_refused() -> None:
    """The tryout: j-1's attempt 1 finished; its agent then sends another job.finished (another
    time) and a job.failed for it: both refused as already ended; the first end, redelivered,
    is stored as itself again."""
    audit = _audit([("j-1", 1, 0, R, C1)], ack_floor=9)
    first = _finished("j-1", C1, 10)
    (out,) = await audit.screen_statuses([first])
    assert out.envelope.type == EventType.JOB_FINISHED
    again = make_event("job.finished", JobStatus(), producer=f"agent/{C1}", occurred_at=1.7e9 + 60, region=R,
                       cluster=C1, tenant="nlp", project="train", job_id="j-1", attempt=1)
    failed = make_event("job.failed", JobStatus(), producer=f"agent/{C1}", occurred_at=1.7e9 + 90, region=R,
                        cluster=C1, tenant="nlp", project="train", job_id="j-1", attempt=1)
    outs = await audit.screen_statuses([delivery(again, SUBJECTS.status(R, C1), 11, 1.7e9),
                                        delivery(failed, SUBJECTS.status(R, C1), 12, 1.7e9), first])
    assert [o.envelope.type for o in outs] == ["security.rejected_message", "security.rejected_message",
                                               EventType.JOB_FINISHED]
    assert all("attempt already ended at" in o.envelope.payload.get("reason", "") for o in outs[:2])
