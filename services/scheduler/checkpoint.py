"""The scheduler's restart checkpoint: its book as a JSON document (:mod:`fedsched.snapshots`).

What is kept is what the events stream would rebuild: every job in memory (live, and the
retained ended ones) with its shards (state, attempt, failures, losses, clusters avoided, the
current and latest placement, start, progress, outcome), the cancellations in progress, the
tombstones of ended jobs, the retries used per tenant and month, and the approval book (the
governor's per-job state and running starts), and each waiting shard's last published pending
reason (so the first cycle after a restart does not publish every queued job's reason again, as
a full read must). What is not kept: unplaceable timers (they start again after a restart), the
reclamation heap and the view's indexes (derived from the shards on restore), the inventory (read
from its own stream, newest per cluster), refused messages not yet dead-lettered.

The service calls :func:`scheduler_state` in a forked child (:class:`fedsched.snapshots.ForkedCapture`),
never on its event loop: the walk is O(jobs in memory). :func:`scheduler_state` /
:func:`restore_scheduler` are the two directions;
``tests/unit/scheduler/test_checkpoint.py`` checks that a snapshot plus the stream after it gives
the book a full read gives.
"""

from __future__ import annotations

import heapq
from typing import Any

import orjson

from fedsched.events import JobPlaced
from fedsched.jobs import JobSpec
from fedsched.snapshots import ModelTable, collector_paused, load_models
from services.scheduler.approvals import JobApprovals, PendingApproval
from services.scheduler.states import Outcome, ShardState

#: the scheduler's state schema version (a snapshot of another version is not used)
STATE_VERSION = 1

_STATES = {s.value: s for s in ShardState}  # (a dict lookup: Enum(value) costs a call per shard)
_OUTCOMES = {o.value: o for o in Outcome}


def _placed_doc(p: JobPlaced | None) -> orjson.Fragment | None:
    """A placement's payload as the JSON text pydantic writes (``model_dump_json``), embedded as
    is by :func:`fedsched.snapshots.encode`: 5x faster than building its dict
    (``model_dump(mode="json")``: 1.9 s against 0.35 s for 20,000 placements of the bench, the
    same bytes once encoded; most of a busy scheduler's checkpoint walk, issue 15)."""
    return orjson.Fragment(p.model_dump_json(exclude_defaults=True)) if p is not None else None


def _shard_doc(shard: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"i": shard.index, "s": shard.state.value}
    if shard.attempt:
        doc.update(a=shard.attempt, c=shard.cluster, r=shard.region, w=shard.placed_wall,
                   ap=_placed_doc(shard.attempt_placed), p=shard.placed is not None,
                   st=shard.started_at, ss=shard.stop_sent)
        if shard.placed is not None and shard.placed is not shard.attempt_placed:
            doc["pd"] = _placed_doc(shard.placed)
    for key, value in (("f", shard.failures), ("l", shard.losses), ("pr", shard.progress_s),
                       ("o", shard.outcome.value)):
        if value:
            doc[key] = value
    if shard.avoid:
        doc["av"] = sorted(shard.avoid)
    if shard.pending_reason:
        doc["why"] = shard.pending_reason
    return doc


def scheduler_state(svc: Any) -> dict[str, Any]:
    """The JSON-ready state of a :class:`~services.scheduler.service.SchedulerService` (module
    docstring). O(jobs in memory); called between events (never inside a fold)."""
    jobs = []
    specs = ModelTable()
    for job in svc.jobs.values():
        doc: dict[str, Any] = {"id": job.job_id, "t": job.tenant, "p": job.project, "at": job.submitted_at,
                               "spec": specs.ref(job.spec),
                               "sh": [_shard_doc(s) for s in job.shards]}
        if job.headers:
            doc["h"] = job.headers
        if job.cancel_requested:
            doc.update(cr=True, cs=job.cancelled_sent, er=job.end_reason)
        jobs.append(doc)
    gov = svc.governor
    return {
        "specs": specs.docs,
        "jobs": jobs,
        "cancelling": list(svc.cancelling),
        "ended": list(svc._ended),
        "tombstones": list(svc.tombstones.items()),
        "counts": {state.value: n for state, n in svc.counts.items()},
        "retries": [[tenant, month, n] for (tenant, month), n in svc.retries_used.items()],
        "approvals": {job_id: {"n": st.requests, "seen": sorted(st.seen), "granted": sorted(st.granted),
                               "home": st.home_only,
                               "pending": None if st.pending is None else
                               [st.pending.approval_id, st.pending.region, st.pending.cluster, st.pending.expires_at]}
                      for job_id, st in gov.state.items()},
        "started": gov.started,
        # scheduler-lease fencing: a restart from this checkpoint still refuses an order below it
        "highest_token": svc.highest_token,
    }


def restore_scheduler(svc: Any, state: dict[str, Any], applied_seq: int, job_cls: type, shard_cls: type) -> None:
    """Load ``state`` (:func:`scheduler_state`) into a new service that has folded nothing yet;
    it then reflects the stream up to ``applied_seq``. ``job_cls`` / ``shard_cls`` are the
    service's ``JobEntry`` / ``ShardEntry`` (passed in: this module does not import the service).

    Python's cyclic collector is paused meanwhile (:func:`fedsched.snapshots.collector_paused`).

    Raises:
        ValueError: the service already holds jobs; KeyError/TypeError/ValueError for a malformed
            state (the caller falls back to the full read with a new service).

    """
    with collector_paused():
        _restore_scheduler(svc, state, applied_seq, job_cls, shard_cls)


def _restore_scheduler(svc: Any, state: dict[str, Any], applied_seq: int, job_cls: type, shard_cls: type) -> None:
    """The body of :func:`restore_scheduler`."""
    if svc.jobs or svc.applied_seq:
        raise ValueError("restore into a scheduler that has folded nothing")
    specs = load_models(state["specs"], JobSpec)
    for doc in state["jobs"]:
        job = job_cls(doc["id"], doc["t"], doc["p"], specs[doc["spec"]], doc["at"],
                       headers=dict(doc.get("h", {})), cancel_requested=doc.get("cr", False),
                       cancelled_sent=doc.get("cs", False), end_reason=doc.get("er", ""))
        for sd in doc["sh"]:
            shard = shard_cls(sd["i"], _STATES[sd["s"]], sd.get("a", 0), sd.get("f", 0), sd.get("l", 0),
                               set(sd.get("av", ())), sd.get("c", ""), sd.get("r", ""))
            if shard.attempt:
                ap = sd.get("ap")
                shard.attempt_placed = JobPlaced.model_validate(ap) if ap is not None else None
                if sd.get("p"):
                    pd = sd.get("pd")
                    shard.placed = JobPlaced.model_validate(pd) if pd is not None else shard.attempt_placed
                shard.placed_wall, shard.started_at, shard.stop_sent = sd["w"], sd.get("st"), sd.get("ss", False)
            shard.progress_s = sd.get("pr", 0.0)
            shard.pending_reason = sd.get("why", "")
            shard.outcome = _OUTCOMES[sd.get("o", "")]
            job.shards.append(shard)
        svc.jobs[job.job_id] = job
        for shard in job.shards:
            key = (job.job_id, shard.index)
            if shard.state == ShardState.QUEUED:
                svc.queued[key] = (job, shard)
            elif shard.state in (ShardState.PLACED, ShardState.RUNNING):
                svc.active[key] = (job, shard)
                if shard.state == ShardState.PLACED and shard.placed is not None:
                    svc._due_seq += 1
                    svc._unstarted_due.append((shard.placed_wall, svc._due_seq, key, shard.attempt))
            elif shard.state == ShardState.STOPPING:
                svc.stopping[key] = (job, shard)
            svc._track(job, shard)
    heapq.heapify(svc._unstarted_due)
    svc.cancelling = {job_id: svc.jobs[job_id] for job_id in state["cancelling"] if job_id in svc.jobs}
    svc._ended.update((job_id, None) for job_id in state["ended"] if job_id in svc.jobs)
    svc.tombstones.update((job_id, attempt) for job_id, attempt in state["tombstones"])
    for name, n in state["counts"].items():
        svc.counts[ShardState(name)] = n
    svc.retries_used = {(tenant, month): n for tenant, month, n in state["retries"]}
    gov = svc.governor
    for job_id, st in state["approvals"].items():
        pending = st["pending"]
        gov.state[job_id] = JobApprovals(st["n"], set(st["seen"]),
                                         PendingApproval(*pending) if pending is not None else None,
                                         set(st["granted"]), st["home"])
    gov.started = {job_id: float(t) for job_id, t in state["started"].items()}
    svc.highest_token = max(svc.highest_token, int(state.get("highest_token", 0)))  # absent in older checkpoints
    gov.index_pending()
    svc.applied_seq = applied_seq
    svc._dirty.set()
