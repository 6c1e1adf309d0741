"""The report charts' time axis (fedapp/reports/html.py): tick labels are chosen by the span --
round steps, at most six, never the same label twice (a tryout saw "11-30 22:51" three times on a
three-minute chart)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from fedapp.reports.html import line_chart, time_ticks

T0 = datetime(2026, 11, 30, 22, 50, 37)


@pytest.mark.parametrize("span, step, first", [
    (timedelta(seconds=20), timedelta(seconds=5), "22:50:40"),
    (timedelta(minutes=3), timedelta(seconds=30), "22:51:00"),
    (timedelta(minutes=40), timedelta(minutes=10), "11-30 23:00"),
    (timedelta(hours=5), timedelta(hours=1), "11-30 23:00"),
    (timedelta(days=2), timedelta(hours=12), "12-01 00:00"),
    (timedelta(days=20), timedelta(days=7), None),
    (timedelta(days=400), timedelta(days=90), None),
], ids=["20s", "3min", "40min", "5h", "2d", "20d", "400d"])
def test_ticks_are_round_steps_chosen_by_the_span_with_distinct_labels(span, step, first):
    ticks = time_ticks(T0, T0 + span)
    times = [t for t, _ in ticks]
    labels = [label for _, label in ticks]
    assert 2 <= len(ticks) <= 6 and len(set(labels)) == len(labels), labels
    assert all(b - a == step for a, b in zip(times, times[1:]))
    assert T0 <= times[0] and times[-1] <= T0 + span
    if first is not None:
        assert labels[0] == first


def test_aware_times_tick_the_same_and_a_tiny_span_still_has_a_label():
    aware = time_ticks(T0.replace(tzinfo=UTC), T0.replace(tzinfo=UTC) + timedelta(minutes=3))
    assert [label for _, label in aware] == [label for _, label in time_ticks(T0, T0 + timedelta(minutes=3))]
    tiny = time_ticks(T0, T0 + timedelta(milliseconds=300))
    assert [label for _, label in tiny] == ["22:50:37"]


def test_a_three_minute_chart_has_no_repeated_axis_label():
    times = [T0 + timedelta(seconds=10 * i) for i in range(19)]
    svg = line_chart("c", "GPUs", times, {"ads": list(range(19))})
    labels = re.findall(r'text-anchor="middle">([^<]+)</text>', svg)
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
