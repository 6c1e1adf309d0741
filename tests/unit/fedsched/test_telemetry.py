"""Trace context of published events (fedsched/telemetry.py): the cause's trace if named, else
the active span's, else a new root trace -- always a valid one."""

from __future__ import annotations

from opentelemetry import trace

from fedsched import telemetry

CAUSE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_named_cause_wins_over_the_active_span():
    with telemetry.root_span("other work"):
        headers = telemetry.event_headers({"traceparent": CAUSE, "x": "1"}, "publish e")
    assert headers["traceparent"] == CAUSE and headers["x"] == "1"


def test_without_a_cause_the_active_span_gives_the_trace():
    with telemetry.root_span("work") as span:
        headers = telemetry.event_headers(None, "publish e")
    assert telemetry.trace_id_of(headers) == format(span.get_span_context().trace_id, "032x")


def test_with_neither_each_event_starts_its_own_valid_root_trace():
    assert not trace.get_current_span().get_span_context().is_valid
    ids = {telemetry.trace_id_of(telemetry.event_headers({}, "publish heartbeat")) for _ in range(5)}
    assert len(ids) == 5 and "" not in ids


def test_a_root_span_ignores_the_active_trace():
    with telemetry.root_span("outer") as outer, telemetry.root_span("inner") as inner:
        assert inner.get_span_context().trace_id != outer.get_span_context().trace_id
        assert inner.get_span_context().is_valid


def test_trace_headers_keep_only_the_trace_context():
    assert telemetry.trace_headers({"traceparent": CAUSE, "tracestate": "a=b", "Nats-Msg-Id": "x"}) == {
        "traceparent": CAUSE, "tracestate": "a=b"}
    assert telemetry.trace_headers(None) == {}
