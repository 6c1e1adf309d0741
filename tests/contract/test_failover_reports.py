"""The failovers and reconciliation reports over audited events, on every engine.

The events are the real envelopes (scheduler placements and its ``job.stopped`` cluster_lost,
agents' reports) turned into ``events`` rows by the audit service's own row function.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fedapp.reports import data_window, run_reports
from services.audit.service import EVENT_COLUMNS, event_row
from tests.builders import delivery, placement, spec, status_event

A, B, REGION = "cn-north-1-c1", "cn-north-1-c2", "cn-north-1"
T0 = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()


def _rows(events) -> list[list]:
    return [event_row(delivery(e, f"t.x.{i}", i + 1, e.occurred_at.timestamp())) for i, e in enumerate(events)]


def test_a_lost_attempt_is_a_failover_row_and_agents_own_stops_are_reconciliation(engine):
    store = engine.open()
    job = spec(gpus=1, checkpointable=True)
    first = placement("j1", job, A, REGION, [("a-0", (0,))], at=T0)
    lost = status_event("job.stopped", first, T0 + 4000, reason="cluster_lost", started_at=T0 + 1, progress_s=3600)
    lost = lost.model_copy(update={"producer": "scheduler"})
    second = placement("j1", job, B, REGION, [("b-0", (0,))], attempt=2, at=T0 + 4002.5, resume_from_s=3600)
    waiting = placement("j2", job, A, REGION, [("a-0", (1,))], at=T0)  # lost, not placed again yet
    waiting_lost = status_event("job.stopped", waiting, T0 + 4000, reason="cluster_lost", started_at=T0 + 1)
    waiting_lost = waiting_lost.model_copy(update={"producer": "scheduler"})
    orphan = placement("j3", job, A, REGION, [("a-0", (2,))], at=T0)
    events = [first, waiting, orphan, status_event("job.started", first, T0 + 1, started_at=T0 + 1), lost,
              waiting_lost, second,
              status_event("job.stopped", orphan, T0 + 5000, reason="orphaned", started_at=T0 + 1),
              status_event("job.stopped", second, T0 + 5001, reason="preempted", started_at=T0 + 4003)]
    store.insert("events", _rows(events), list(EVENT_COLUMNS))
    query = lambda sql, params: store.query(sql, params)  # noqa: E731
    window = data_window(query, store.database, start=datetime.fromtimestamp(T0, UTC),
                         end=datetime.fromtimestamp(T0, UTC) + timedelta(days=1))
    failovers, reconciliation = run_reports(query, store.database, window, ["failovers", "reconciliation"])
    rows = {r["job_id"]: r for r in failovers.dicts()}
    assert sorted(rows) == ["j1", "j2"]
    j1 = rows["j1"]
    assert (j1["attempt"], j1["lost_on"], j1["moved_to"], j1["next_attempt"], j1["progress_s"], j1["resume_from_s"]) \
        == (1, A, B, 2, 3600.0, 3600.0)
    assert abs(j1["move_s"] - 2.5) < 1e-9
    assert (rows["j2"]["moved_to"], rows["j2"]["move_s"], rows["j2"]["placed_at"]) == ("", None, None)
    assert [(r["cluster"], r["type"], r["reason"], r["actions"]) for r in reconciliation.dicts()] == \
        [(A, "job.stopped", "orphaned", 1)]  # the preemption was the scheduler's order, not the agent's action
