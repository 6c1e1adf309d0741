"""Every time option of the CLI takes what ``jobs --since`` takes (one parser,
:mod:`fedapp.cli.when` around :func:`fedapp.cli.jobs.parse_when`): ISO-8601 with or without a
zone, ages; a date alone as a window's end is the end of that day; out-of-range values are a
typed error (exit 2 with a message), never an OverflowError traceback."""

from __future__ import annotations

import datetime as dt

import pytest
from typer.testing import CliRunner

from fedapp.cli import app
from fedapp.cli.when import TimeOptionError, parse_time

NOW = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)
U = dt.UTC


@pytest.mark.parametrize("text, end_of_day, want", [
    ("2026-11-30T22:55:00Z", False, dt.datetime(2026, 11, 30, 22, 55, tzinfo=U)),
    ("2026-11-30T22:55:00+09:00", False, dt.datetime(2026, 11, 30, 13, 55, tzinfo=U)),
    ("2026-11-30 22:55:00", False, dt.datetime(2026, 11, 30, 22, 55, tzinfo=U)),
    ("2026-11-30T22:55", False, dt.datetime(2026, 11, 30, 22, 55, tzinfo=U)),
    ("2026-11-30", False, dt.datetime(2026, 11, 30, tzinfo=U)),
    ("2026-11-30", True, dt.datetime(2026, 12, 1, tzinfo=U)),
    ("2026-11-30T00:00:00Z", True, dt.datetime(2026, 11, 30, tzinfo=U)),  # a time of day is kept as given
    ("2h", False, NOW - dt.timedelta(hours=2)),
    ("1.5d", True, NOW - dt.timedelta(days=1.5)),  # an age is never moved to the end of a day
], ids=["zulu", "offset", "space", "minutes", "date", "date-as-end", "midnight-as-end", "age", "age-as-end"])
def test_every_form_of_jobs_since_is_a_utc_time(text, end_of_day, want):
    got = parse_time(text, "--from", NOW, end_of_day=end_of_day)
    assert got == want and got.utcoffset() == dt.timedelta(0)


@pytest.mark.parametrize("text", ["99999999d", "1e20s", "infm", "-infm", "60000w"])
def test_huge_ages_are_a_typed_error(text):
    with pytest.raises(TimeOptionError) as e:
        parse_time(text, "--to", NOW)
    assert e.value.flag == "--to" and e.value.text == text


@pytest.mark.parametrize("args", [("--from", "99999999d"), ("--to", "1e20s"), ("--from", "infm")])
def test_report_refuses_huge_ages_with_a_message_not_a_traceback(args):
    result = CliRunner().invoke(app, ["report", *args, "--list"])
    assert result.exit_code == 2, result.output
    assert args[0] in result.output and "accepted:" in result.output
    assert not isinstance(result.exception, OverflowError) and "Traceback" not in result.output


@pytest.mark.parametrize("start, end, code", [
    ("2026-11-30", "2026-11-30", 0),  # that one day
    ("2026-11-30T10:00:00Z", "2026-11-30T20:00:00+09:00", 0),  # 10:00Z -> 11:00Z
    ("2026-11-30T10:00:00Z", "2026-11-30T19:00:00+09:00", 2),  # the same instant: an empty window
    ("2h", "1h", 0),
    ("1h", "2h", 2),
], ids=["one-day", "zones", "same-instant", "ages", "ages-reversed"])
def test_report_windows_in_every_form(start, end, code):
    result = CliRunner().invoke(app, ["report", "--from", start, "--to", end, "--list"])
    assert result.exit_code == code, result.output
    assert ("is not before" in result.output) == (code == 2)


def test_report_still_refuses_a_window_that_ends_before_it_starts():
    result = CliRunner().invoke(app, ["report", "--from", "2023-03-01", "--to", "2023-02-01", "--list"])
    assert result.exit_code == 2 and "is not before" in result.output


def test_a_report_window_may_end_in_the_future_but_not_start_there():
    """``report --from 2026-11-30 --to 2026-12-01`` on 2026-11-30 exited 2 "in the future": the
    end of a window may be later than now, its start may not."""
    now = dt.datetime.now(dt.UTC)
    today, tomorrow = now.date().isoformat(), (now + dt.timedelta(days=1)).date().isoformat()
    later = (now + dt.timedelta(days=30)).date().isoformat()
    result = CliRunner().invoke(app, ["report", "--from", today, "--to", tomorrow, "--list"])
    assert result.exit_code == 0, result.output
    assert parse_time(later, "--to", now, end_of_day=True, future=True) == dt.datetime.fromisoformat(
        later).replace(tzinfo=dt.UTC) + dt.timedelta(days=1)
    result = CliRunner().invoke(app, ["report", "--from", later, "--list"])
    assert result.exit_code == 2 and "--from" in result.output and "in the future" in result.output


def test_jobs_until_may_be_in_the_future_and_since_may_not():
    from fedapp.cli.jobs import WhenError, _time_range, parse_when

    now = dt.datetime(2026, 11, 30, 23, 0, tzinfo=dt.UTC)
    lo, hi = _time_range("2026-11-30", "2026-12-01", now)
    assert (lo, hi) == (dt.datetime(2026, 11, 30, tzinfo=dt.UTC), dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    with pytest.raises(WhenError, match="in the future"):
        parse_when("2026-12-01", "--since", now)
    result = CliRunner().invoke(app, ["jobs", "--since", "2099-01-01"])
    assert result.exit_code == 2 and "in the future" in result.output
