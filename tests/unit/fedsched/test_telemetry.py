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


def test_child_headers_continue_the_parents_trace_with_a_new_span():
    parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "tracestate": "k=v"}
    child = telemetry.child_headers(parent, "scheduler.place", job_id="j1")
    version, trace_id, span_id, flags = child["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "ab" * 16, "01")
    assert len(span_id) == 16 and span_id != "cd" * 8 and span_id != "0" * 16
    assert child["tracestate"] == "k=v"
    other = telemetry.child_headers(parent, "scheduler.place")
    assert other["traceparent"].split("-")[2] != span_id  # a new span each time


def test_child_headers_without_a_parent_start_a_new_trace():
    for carrier in (None, {}, {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}):
        child = telemetry.child_headers(carrier, "scheduler.place")
        trace_id = telemetry.trace_id_of(child)
        assert trace_id and trace_id != "0" * 32 and "tracestate" not in child


def test_child_span_without_export_continues_the_carriers_trace_as_the_current_span():
    assert not telemetry._exporting  # (the unit tests install no exporter)
    with telemetry.child_span({"traceparent": CAUSE, "tracestate": "k=v"}, "agent.job.placed", job_id="j1"):
        assert telemetry.current_trace_id() == CAUSE.split("-")[1]
        inner = telemetry.inject_headers()
        event = telemetry.event_headers(None, "publish e")  # what an event published inside carries
    version, trace_id, span_id, flags = inner["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CAUSE.split("-")[1], "01") and span_id != CAUSE.split("-")[2]
    assert inner.get("tracestate") == "k=v" and event["traceparent"] == inner["traceparent"]
    assert telemetry.current_trace_id() == ""  # the block's span is current only inside it


def test_child_span_without_a_valid_parent_starts_a_new_sampled_trace():
    seen = set()
    for carrier in (None, {}, {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}):
        with telemetry.child_span(carrier, "agent.job.placed"):
            headers = telemetry.inject_headers()
        _, trace_id, _, flags = headers["traceparent"].split("-")
        assert trace_id != "0" * 32 and flags == "01"
        seen.add(trace_id)
    assert len(seen) == 4
