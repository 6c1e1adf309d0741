"""A scheduler restarted from a checkpoint plus the stream after it holds the book a scheduler
reading the whole stream holds (issue 15 item 3): same jobs, shards, queue, placements,
allocations, tenants' usage, tombstones, retry counts and approval state, for a stream with
submits, placements, starts, finishes, failures, cancellations (queued and running), holds,
releases, priority changes, approval requests and approvals; a corrupt or incompatible
checkpoint is refused (the service reads the whole stream instead)."""

from __future__ import annotations

import zlib
import pytest

from fedsched import snapshots
from fedsched.clock import to_datetime
from fedsched.events import ApprovalDecided, ApprovalRequested, approval_outcome_id, make_event
from fedsched.jobs import PriorityClass
from services.scheduler.service import SchedulerService
from tests.builders import ClusterSpec, SchedulerHarness, nodes

A, B = "cn-north-1-c1", "cn-east-1-c1"


def _book(svc: SchedulerService) -> dict:
    """What the service holds, comparably: the open jobs in full, the ended ones by id and newest
    attempt (whether an ended job is still in memory or a tombstone depends on when it was
    retired: live, or at the first cycle after a full read), caches and timers a restart starts
    again left out."""
    jobs, ended = {}, dict(svc.tombstones)
    for job in svc.jobs.values():
        if job.done:
            ended[job.job_id] = job.attempt
            continue
        jobs[job.job_id] = (job.tenant, job.project, job.spec, job.submitted_at, job.cancel_requested,
                            job.cancelled_sent, job.end_reason,
                            [(s.index, s.state, s.attempt, s.failures, s.losses, sorted(s.avoid), s.cluster, s.region,
                              s.placed, s.attempt_placed, s.started_at, s.progress_s, s.stop_sent, s.outcome)
                             for s in job.shards])
    view = svc.view()
    return {
        "jobs": jobs, "queued": sorted(svc.queued), "active": sorted(svc.active), "stopping": sorted(svc.stopping),
        "cancelling": sorted(svc.cancelling), "counts": dict(svc.counts), "ended": ended, "retries": dict(svc.retries_used),
        "approvals": {k: (v.requests, v.seen, v.granted, v.home_only,
                          (v.pending.approval_id, v.pending.expires_at) if v.pending else None)
                      for k, v in svc.governor.state.items()},
        "started": dict(svc.governor.started),
        "alloc": {name: {node: (dict(a[0]), a[1], a[2]) for node, a in info.alloc.items() if any(a[0].values()) or a[1]}
                  for name, info in svc.clusters.items()},
        "queue": sorted((q.job_id, q.shard, q.attempt, q.spec.priority) for q in svc.queue()),
        "running": sorted((c.name, r.job_id, r.shard, r.attempt, r.started_at) for c in view.clusters for r in c.running),
        "usage": dict(view.tenant_usage), "applied_seq": svc.applied_seq,
    }


def _approval_events(h: SchedulerHarness, job_id: str, n: int, *, approve: bool):
    spec = h.specs[job_id]
    aid = f"ap-{n:020x}"
    now = h.clock.time()
    req = make_event("approval.requested", ApprovalRequested(approval_id=aid, home_region="cn-north-1",
                                                             proposed_region="cn-east-1", proposed_cluster=B,
                                                             expires_at=to_datetime(now + 3600)),
                     producer="scheduler", occurred_at=now, tenant=spec.tenant, project=spec.project, job_id=job_id,
                     actor="scheduler")
    h._event(req, h.subjects.approval(spec.tenant, spec.project))
    if approve:
        ok = make_event("approval.approved", ApprovalDecided(approval_id=aid, proposed_region="cn-east-1"),
                        producer="admission", occurred_at=now + 1, event_id=approval_outcome_id(aid),
                        tenant=spec.tenant, project=spec.project, job_id=job_id, actor="bob")
        h._event(ok, h.subjects.approval(spec.tenant, spec.project))


async def _busy_stream(h: SchedulerHarness, snapshot_at: int) -> bytes:
    """Drive a varied history; returns the checkpoint taken after step ``snapshot_at``."""
    taken = b""
    steps = 0

    async def step():
        nonlocal steps, taken
        await h.cycle()
        h.advance(1.0)
        steps += 1
        if steps == snapshot_at:
            taken = h.svc.snapshot_bytes()

    for i in range(12):
        h.submit(f"j{i}", gpus=2, retry_limit=1)
    h.submit("big", gpus=8, workers=2)
    await step()                                   # placements
    for i in range(6):
        h.report(f"j{i}", "job.started")
    await step()
    h.report("j0", "job.finished")
    h.report("j1", "job.failed", reason="oom")     # retried elsewhere
    h.cancel("j2")                                 # running: stop order, then stopped
    await step()
    h.report("j2", "job.stopped", reason="cancelled")
    for i in range(12, 20):
        h.submit(f"j{i}", gpus=8)                  # more than fits: some wait
    h.hold("j19")
    h.set_priority("j18", PriorityClass.HIGH)
    _approval_events(h, "j17", 1, approve=True)
    _approval_events(h, "j16", 2, approve=False)
    await step()
    h.release("j19")
    h.cancel("j15")                                # queued (or placed): ends
    for i in range(3, 6):
        h.report(f"j{i}", "job.finished")
    await step()
    for i in range(20, 30):
        h.submit(f"j{i}")
    await step()
    for key, placed in list(h.placed.items()):
        job = h.svc.jobs.get(key[0])
        if job is not None and job.shards[key[1]].state.value == "placed" and key[0] not in ("j1",):
            h.report(key[0], "job.started")
    await step()
    for i in range(20, 25):
        if ("j" + str(i), 0) in h.placed:
            h.report(f"j{i}", "job.finished")
    await step()
    return taken


def _restarted(h: SchedulerHarness, data: bytes | None) -> SchedulerService:
    svc = h._service()
    start = svc.restore(data) if data is not None else 1
    for d in h.events:
        if d.stream_sequence >= start:
            svc.handle_event(d)
    for d in sorted(h.inventory.values(), key=lambda d: d.stream_sequence):
        svc.handle_inventory(d)
    return svc


@pytest.mark.parametrize("snapshot_at", [1, 3, 5, 7], ids=["after-placing", "mid", "after-approvals", "at-the-end"])
async def test_checkpoint_plus_tail_equals_a_full_read(snapshot_at):
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=3)),
                          ClusterSpec(B, "cn-east-1", node_list=nodes("b", count=2))),
                         reclaim_after_s=1e9, retain_ended=3, retain_tombstones=100)
    data = await _busy_stream(h, snapshot_at)
    assert snapshots.decode(data, "scheduler", 1).applied_seq < h.events[-1].stream_sequence  # a tail to read
    full = _restarted(h, None)
    assert full.tombstones and full.governor.state and full.queued and full.active  # the history is varied
    restored = _restarted(h, data)
    assert restored.snapshot_seq == snapshots.decode(data, "scheduler", 1).applied_seq
    # a full read leaves to the first cycle what the live service did at once (cancellations read
    # back are carried out, their stop orders sent): compare after one cycle of each
    await full.cycle()
    await restored.cycle()
    assert _book(restored) == _book(full)


async def test_a_corrupt_or_incompatible_checkpoint_is_refused_and_loads_nothing():
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=3)),), reclaim_after_s=1e9)
    h.submit("j1")
    await h.cycle()
    good = h.svc.snapshot_bytes()
    doc = zlib.decompress(good)
    bad_version = zlib.compress(doc.replace(b'"version":1', b'"version":99'))
    malformed = zlib.compress(doc.replace(b'"jobs":[', b'"jobs":[{"id":"x"},'))
    for data in (good[:-10], b"not zlib", bad_version, zlib.compress(doc.replace(b'"scheduler"', b'"admission"'))):
        svc = h._service()
        with pytest.raises(snapshots.SnapshotError):
            svc.restore(data)
        assert not svc.jobs and svc.applied_seq == 0
    svc = h._service()
    with pytest.raises(snapshots.SnapshotError):
        svc.restore(malformed)
    svc._forget_book()  # what load_snapshot does on this error before the full read
    assert not svc.jobs and not svc.queued and svc.applied_seq == 0


async def test_the_highest_fencing_token_seen_survives_a_restart_from_a_checkpoint():
    """Issue 14: a scheduler restarted from a checkpoint still refuses an order below the
    highest scheduler-lease token it had seen (a former active scheduler's late order)."""
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=3)),), reclaim_after_s=1e9)
    h.submit("j1")
    await h.cycle()
    h.svc.highest_token = 7
    svc = h._service()
    svc.restore(h.svc.snapshot_bytes())
    assert svc.highest_token == 7


class _Bucket:
    """A snapshot store (fedsched.snapshots.SnapshotStore's write) that keeps what is written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.written.append(data)


@pytest.mark.parametrize("n", [10, 3000])
async def test_a_checkpoint_walks_no_job_on_the_services_loop(n, monkeypatch):
    """Issue 15 item 3: the loop's share of a checkpoint does not grow with the jobs held -- the
    book is walked and encoded in a forked child; the parent process visits no shard."""
    from services.scheduler import checkpoint

    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=1)),), reclaim_after_s=1e9)
    for i in range(n):
        h.submit(f"q{i}", card_models=("nvidia-a100-80gb",))  # no cluster has it: all stay queued
    await h.cycle()
    visited: list[str] = []
    shard_doc = checkpoint._shard_doc

    def counted(shard):
        visited.append("shard")  # appended in whichever process walks the book
        return shard_doc(shard)

    monkeypatch.setattr(checkpoint, "_shard_doc", counted)
    bucket = _Bucket()
    h.svc._snapshots = bucket
    assert await h.svc.maybe_snapshot(force=True)
    assert visited == []  # the parent (the service's loop) walked nothing
    snap = snapshots.decode(bucket.written[0], "scheduler", 1)
    assert len(snap.state["jobs"]) == n and snap.applied_seq == h.svc.applied_seq == h.svc.snapshot_seq
    assert snap.state == snapshots.decode(h.svc.snapshot_bytes(), "scheduler", 1).state  # the same book
    assert len(visited) == n  # (the walk on the loop, for comparison: one visit per shard)


async def test_the_capture_is_the_book_at_the_fork_not_after():
    """What the loop changes after the checkpoint began is not in it (copy-on-write image)."""
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=1)),), reclaim_after_s=1e9)
    h.submit("before", card_models=("nvidia-a100-80gb",))
    capture = snapshots.ForkedCapture(h.svc.snapshot_bytes)
    h.submit("after", card_models=("nvidia-a100-80gb",))
    snap = snapshots.decode(await capture.result(), "scheduler", 1)
    assert [j["id"] for j in snap.state["jobs"]] == ["before"] and snap.applied_seq < h.svc.applied_seq


class _FailingBucket(_Bucket):
    async def write(self, data: bytes) -> None:
        raise ConnectionError("bucket unreachable")


async def test_a_failed_checkpoint_is_retried_a_period_later_not_at_the_next_chance(monkeypatch):
    """One fork per period while checkpoints fail (admission had forked every second)."""
    h = SchedulerHarness((ClusterSpec(A, node_list=nodes("a", count=1)),), reclaim_after_s=1e9)
    h.submit("q", card_models=("nvidia-a100-80gb",))
    await h.cycle()
    forks = []
    real = snapshots.ForkedCapture
    monkeypatch.setattr(snapshots, "ForkedCapture", lambda build: forks.append(1) or real(build, in_child=False))
    h.svc._snapshots, h.svc.snapshot_every_s, h.svc.snapshot_every_events = _FailingBucket(), 60.0, 1
    assert not await h.svc.maybe_snapshot() and len(forks) == 1
    h.submit("q2", card_models=("nvidia-a100-80gb",))
    assert not await h.svc.maybe_snapshot() and len(forks) == 1  # not retried at once
    h.svc._snapshots = _Bucket()
    h.clock.advance(61)  # a period later
    assert await h.svc.maybe_snapshot() and len(forks) == 2
