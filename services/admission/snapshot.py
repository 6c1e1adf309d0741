"""Admission's restart checkpoint: its read models as a JSON document (:mod:`fedsched.snapshots`).

Kept: the job view (every job in memory -- open ones and the retained ended ones -- as
:func:`~services.admission.ended.record_doc`, the order in which the retained ones ended, the
tombstones, jobs per state, the highest scheduler-lease fencing token seen), the approval
requests, and the spend summed from usage events (the budget fallback while billing has no KV
figure). Derived on restore: the submit-time and
request indexes, the open jobs per tenant. Not kept: inventory (read from its own stream, newest
per cluster), the policy (its own KV), billing's spend figures (their own KV bucket).

The service calls :func:`admission_state` in a forked child (:class:`fedsched.snapshots.ForkedCapture`),
never on its event loop. A checkpoint is written only when every job that left the view before it is in the ended-jobs
bucket (:meth:`services.admission.service.AdmissionService.maybe_snapshot`), so a restart from it
loses no ended job.
"""

from __future__ import annotations

from dataclasses import asdict
from decimal import Decimal
from typing import Any

from fedsched.jobs import TERMINAL_STATES, JobSpec, JobState
from fedsched.snapshots import ModelTable, collector_paused, load_models
from services.admission.approvalview import ApprovalRecord
from services.admission.ended import record_doc, record_from_doc

#: admission's state schema version (a snapshot of another version is not used)
STATE_VERSION = 2


def admission_state(view: Any, approvals: Any, spend: Any) -> dict[str, Any]:
    """The JSON-ready state of admission's job view, approval view and spend book. O(jobs in
    memory + approvals); called between events (never inside a fold)."""
    specs = ModelTable()
    jobs = [record_doc(rec, specs) for rec in view.jobs.values()]
    return {
        "specs": specs.docs,
        "jobs": jobs,
        "ended": list(view.ended),
        "tombstones": list(view.tombstones.items()),
        "by_state": {state.value: n for state, n in view.by_state.items()},
        "approvals": [asdict(a) for a in approvals.by_id.values()],
        "spend_events": [[tenant, month, str(amount)] for (tenant, month), amount in
                         getattr(spend, "from_events", {}).items()],
        # scheduler-lease fencing: a restart from this checkpoint still refuses an order below it
        "highest_token": view.highest_token,
    }


def restore_admission(view: Any, approvals: Any, spend: Any, state: dict[str, Any], applied_seq: int) -> None:
    """Load ``state`` (:func:`admission_state`) into new, empty views; they then reflect the
    stream up to ``applied_seq``.

    Python's cyclic collector is paused meanwhile (:func:`fedsched.snapshots.collector_paused`).

    Raises:
        ValueError: the view already holds jobs; KeyError/TypeError/ValueError for a malformed
            state (the caller empties the views and reads the whole stream).
    """
    with collector_paused():
        _restore_admission(view, approvals, spend, state, applied_seq)


def _restore_admission(view: Any, approvals: Any, spend: Any, state: dict[str, Any], applied_seq: int) -> None:
    """The body of :func:`restore_admission`."""
    if view.jobs or view.applied_seq:
        raise ValueError("restore into a job view that has folded nothing")
    specs = load_models(state["specs"], JobSpec)
    for doc in state["jobs"]:
        rec = record_from_doc(doc, specs)
        view.jobs[rec.job_id] = rec
        view.by_submitted.append((rec.submitted_at, rec.job_id))
        if rec.request_id:
            view.by_request[(rec.submitted_by, rec.spec.tenant, rec.spec.project, rec.request_id)] = rec.job_id
        rec.counted_state = rec.state
        view.adopt_listing(rec)
        if rec.counted_state not in TERMINAL_STATES:
            view.open_by_tenant.setdefault(rec.spec.tenant, set()).add(rec.job_id)
    view.by_submitted.sort()
    view.ended.update((job_id, None) for job_id in state["ended"] if job_id in view.jobs)
    for job_id, attempt in state["tombstones"]:
        view.tombstones[job_id] = attempt
    for name, n in state["by_state"].items():
        view.by_state[JobState(name)] = n
    for a in state["approvals"]:
        rec = ApprovalRecord(**a)
        approvals.by_id[rec.approval_id] = rec
    if hasattr(spend, "from_events"):
        for tenant, month, amount in state["spend_events"]:
            spend.from_events[(tenant, month)] = Decimal(amount)
    view.highest_token = max(view.highest_token, int(state.get("highest_token", 0)))  # absent in older checkpoints
    view.applied_seq = applied_seq
