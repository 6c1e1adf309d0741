"""Dispatch tables: every consumer knows the event types it must, and skips unknown ones with a count."""

from datetime import UTC, datetime
from enum import StrEnum

import pytest

from fedsched.dispatch import EventTable, SkippedTypes
from fedsched.events import (APPROVAL_OUTCOMES, JOB_STATUSES, TERMINAL_STATUSES, Envelope, EventType, JobStatus,
                             JobSubmitted, make_event)
from fedsched.jobs import JobSpec
from fedapp.replay.driver import REPLAY_EVENTS
from services.admission.approvalview import APPROVAL_VIEW_EVENTS
from services.admission.jobview import JOB_VIEW_EVENTS, JobView
from services.admission.service import ADMISSION_EVENTS, INVENTORY_EVENTS as ADMISSION_INVENTORY
from services.audit.service import DECISION_ROWS
from services.billing.usage import BILLING_EVENTS
from services.inventory.agent import PLACEMENT_EVENTS, REBUILD_EVENTS
from services.scheduler.approvals import GOVERNOR_EVENTS
from services.scheduler.service import EVENTS as SCHEDULER_EVENTS, INVENTORY as SCHEDULER_INVENTORY

INVENTORY_TYPES = frozenset({EventType.INVENTORY_SNAPSHOT, EventType.INVENTORY_HEARTBEAT})
APPROVAL_TYPES = frozenset({EventType.APPROVAL_REQUESTED, *APPROVAL_OUTCOMES})


def required(terminal: frozenset) -> dict[str, tuple[EventTable, frozenset]]:
    """Per consumer: its table and the types it must handle or knowingly ignore, given the set of
    terminal job statuses (a parameter so a test can add one that the enum does not have)."""
    attempts = frozenset({EventType.JOB_STARTED, *terminal})
    every = frozenset(EventType) | terminal
    return {
        # follows the whole EVENTS stream: must have decided about every type on it
        "scheduler-events": (SCHEDULER_EVENTS, every - INVENTORY_TYPES),
        "scheduler-inventory": (SCHEDULER_INVENTORY, INVENTORY_TYPES),
        "scheduler-governor": (GOVERNOR_EVENTS, attempts | APPROVAL_TYPES),
        # follows jobs, placements, decisions, status, governance and usage
        "admission-job-view": (JOB_VIEW_EVENTS, every - INVENTORY_TYPES - {EventType.BUS_DEAD_LETTER,
                                                                            EventType.SECURITY_REJECTED_MESSAGE}),
        "admission-routes": (ADMISSION_EVENTS, APPROVAL_TYPES | {EventType.USAGE_RECORDED}),
        "admission-approval-view": (APPROVAL_VIEW_EVENTS, APPROVAL_TYPES),
        "admission-inventory": (ADMISSION_INVENTORY, INVENTORY_TYPES),
        "agent-placements": (PLACEMENT_EVENTS, frozenset({EventType.JOB_PLACED, EventType.JOB_STOP})),
        # both read the status subjects, where agents also publish their reconcile records
        "agent-rebuild": (REBUILD_EVENTS, attempts | {EventType.JOB_PLACED, EventType.JOB_STOP,
                                                      EventType.AGENT_RECONCILED}),
        "billing": (BILLING_EVENTS, attempts | {EventType.JOB_PLACED, EventType.JOB_STOP, EventType.AGENT_RECONCILED}),
        "audit-decisions": (DECISION_ROWS, frozenset({EventType.JOB_PLACED, EventType.JOB_PENDING})),
        "replay-driver": (REPLAY_EVENTS, attempts | {EventType.JOB_PENDING}),
    }


#: The consumers that must know every terminal status (issue 9: the job view, the agent and
#: billing, and everything else that follows attempts).
FOLLOW_ATTEMPTS = ("scheduler-events", "scheduler-governor", "admission-job-view", "agent-rebuild", "billing",
                   "replay-driver")


@pytest.mark.parametrize("consumer", sorted(required(TERMINAL_STATUSES)))
def test_every_consumer_handles_or_ignores_the_types_it_must(consumer):
    table, must = required(TERMINAL_STATUSES)[consumer]
    assert table.uncovered(must) == frozenset(), f"{consumer} has no handler for {sorted(table.uncovered(must))}"


@pytest.mark.parametrize("consumer", ["scheduler-events", "admission-job-view"])
def test_every_attempt_status_has_its_own_handler_in_the_scheduler_and_the_job_view(consumer):
    """Handled, not merely ignored: each status moves the shard (the scheduler's table replaced
    an if/elif chain over these types)."""
    table, _ = required(TERMINAL_STATUSES)[consumer]
    assert JOB_STATUSES - set(table.handlers) == set()
    assert len({id(table.handlers[t]) for t in JOB_STATUSES}) == len(JOB_STATUSES)


class _Newer(StrEnum):
    """Stands for a terminal status added to EventType later (the real enum is not edited)."""

    JOB_EXPIRED = "job.expired"


def test_a_new_terminal_status_without_handlers_fails_the_coverage_check():
    patched = required(TERMINAL_STATUSES | {_Newer.JOB_EXPIRED})
    for consumer in FOLLOW_ATTEMPTS:
        table, must = patched[consumer]
        assert table.uncovered(must) == {_Newer.JOB_EXPIRED}, consumer


def test_a_type_both_handled_and_ignored_is_refused():
    with pytest.raises(ValueError, match="both handled and ignored"):
        EventTable({EventType.JOB_STARTED: print}, ignores=frozenset({EventType.JOB_STARTED}))


def test_route_counts_unknown_types_only():
    table = EventTable({EventType.JOB_STARTED: "h"}, ignores=frozenset({EventType.JOB_FAILED}))
    skipped = SkippedTypes("t")
    assert table.route("job.started", skipped) == "h"
    assert table.route("job.failed", skipped) is None  # known, ignored on purpose: not counted
    assert table.route("job.finished", skipped) is None  # known, not this consumer's business: not counted
    assert table.route("job.future_thing", skipped) is None
    assert table.route("job.future_thing", skipped) is None
    assert table.route("job.future_thing") is None  # no counter given: not counted
    assert skipped.as_dict() == {"job.future_thing": 2} and skipped.total == 2


def _unknown(job_id: str) -> Envelope:
    return Envelope(event_id="f" * 32, type="job.future_thing", occurred_at=datetime(2023, 1, 1, tzinfo=UTC),
                    producer="scheduler/v2", job_id=job_id, payload={"anything": 1})


def test_the_job_view_skips_and_counts_an_unknown_type_and_still_folds_the_rest():
    view = JobView()
    spec = JobSpec(tenant="search", project="train", home_region="cn-north-1")
    view.apply(make_event(EventType.JOB_SUBMITTED, JobSubmitted(spec=spec), producer="admission",
                          occurred_at=1_700_000_000.0, job_id="j-1", tenant="search", project="train"))
    before = view.jobs["j-1"].version
    view.apply(_unknown("j-1"))
    assert view.jobs["j-1"].version == before
    assert view.skipped.as_dict() == {"job.future_thing": 1}
    view.apply(make_event(EventType.JOB_CANCELLED, JobStatus(reason="cancelled"), producer="scheduler",
                          occurred_at=1_700_000_001.0, job_id="j-1"))
    assert view.jobs["j-1"].cancelled and view.jobs["j-1"].version == before + 1

