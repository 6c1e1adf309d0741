"""``fedsched report`` over a window without data: it names the window asked (UTC) and the audit
log's extent on stderr, prints no invented window, writes nothing on stdout (``-o json``: the
asked window and no reports) and exits 0 like a ``jobs`` filter that matches nothing; a window
with data still reports it. The events are real envelopes made into ``events`` rows by the
audit service's own row function, in a fresh chDB database."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from fedapp.cli import app
from services.audit.service import EVENT_COLUMNS, event_row
from tests.builders import delivery, placement, spec, status_event

T0 = datetime(2023, 3, 1, 12, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def audited(store, chdb_path):
    """A store holding one job's placement, start and end on 2023-03-01 (12:00 to 13:00 UTC);
    the CLI arguments that reach it."""
    job = spec(gpus=1)
    placed = placement("j1", job, "cn-north-1-c1", "cn-north-1", [("a-0", (0,))], at=T0)
    events = [placed, status_event("job.started", placed, T0 + 1, started_at=T0 + 1),
              status_event("job.finished", placed, T0 + 3600, started_at=T0 + 1)]
    rows = [event_row(delivery(e, f"t.x.{i}", i + 1, e.occurred_at.timestamp())) for i, e in enumerate(events)]
    store.insert("events", rows, list(EVENT_COLUMNS))
    return ["report", "--data-dir", str(chdb_path.parent), "--database", store.database]


@pytest.mark.parametrize("window, asked", [
    (["--to", "2020-01-01"], "from the first event to 2020-01-02 00:00:00 UTC"),
    (["--from", "2024-01-01", "--to", "2024-02-01T00:00:00Z"], "from 2024-01-01 00:00:00 UTC to 2024-02-01 00:00:00 UTC"),
    (["--from", "2024-01-01"], "from 2024-01-01 00:00:00 UTC to just after the last event"),
], ids=["ends-before-the-first-event", "between-no-events", "starts-after-the-last-event"])
def test_a_window_without_data_is_named_not_invented(audited, window, asked):
    result = CliRunner().invoke(app, [*audited, *window])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # nothing for scripts, as `jobs` with a filter matching nothing
    assert f"no data in the window {asked} (end exclusive)" in result.stderr
    assert "the audit log holds events from 2023-03-01 12:00:00 UTC to 2023-03-01 13:00:00 UTC" in result.stderr
    assert "buckets of" not in result.output  # the old invented 1-second window's header


def test_a_window_without_data_in_json_is_the_asked_window_and_no_reports(audited):
    result = CliRunner().invoke(app, [*audited, "--to", "2020-01-01T06:00:00+02:00", "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"window": {"from": None, "to": "2020-01-01T04:00:00+00:00"}, "reports": {}}
    assert "no data in the window from the first event to 2020-01-01 04:00:00 UTC" in result.stderr


def test_a_window_with_data_still_reports_it(audited):
    result = CliRunner().invoke(app, [*audited, "--to", "2023-03-02", "--only", "summary", "-o", "json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["window"]["from"] == "2023-03-01T12:00:00+00:00" and list(body["reports"]) == ["summary"]
    assert body["window"]["to"] == "2023-03-03T00:00:00+00:00"  # a date alone as --to: its day included; zone said
    assert body["reports"]["summary"]["rows"]


def test_an_unknown_report_is_refused_even_when_the_window_holds_nothing(audited):
    result = CliRunner().invoke(app, [*audited, "--to", "2020-01-01", "--only", "nosuch"])
    assert result.exit_code == 2 and "unknown report 'nosuch'" in result.stderr
