"""Tracing: OpenTelemetry SDK spans, W3C ``traceparent`` in gRPC metadata and NATS headers.

One trace spans gRPC -> admission -> scheduler -> agent -> audit: admission continues the
caller's context (gRPC metadata), every publish injects the current context into the NATS
headers, and every consumer starts its span as a child of the context it extracts. The audit
log stores the trace id of each event, so a trace can be found from SQL.

Spans are always recorded (so ids exist and propagate); exporting them is chosen by
``Settings.otel_exporter``: ``none`` (default), ``console`` or ``otlp``.

Every event on the bus carries a trace (:meth:`fedsched.bus.Bus.publish`): the trace of its
cause when the publisher names one (the ``traceparent`` of the event or call it follows from),
else the active span's, else a new root trace (:func:`root_span`: periodic inventory snapshots,
heartbeats, a first-start bootstrap). Without an SDK provider (a library use, a test) a root
span still gets random valid ids, so the rule holds in every process.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

log = logging.getLogger(__name__)

#: the W3C trace-context headers (what carries a trace from one message or call to the next)
TRACE_HEADERS = ("traceparent", "tracestate")
_IDS = RandomIdGenerator()

_configured = False
_exporting = False  # a span processor exports spans (otel_exporter console/otlp)


def setup_tracing(exporter: str = "none", service_name: str = "fedsched") -> None:
    """Install the SDK tracer provider once per process.

    Args:
        exporter: ``none``, ``console`` or ``otlp`` (OTLP/gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT``).

    Raises:
        RuntimeError: ``otlp`` asked for but ``opentelemetry-exporter-otlp-proto-grpc`` missing.
    """
    global _configured, _exporting
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise RuntimeError("otel_exporter=otlp needs `pip install fedsched[otlp]`") from e
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    _exporting = exporter != "none"


def tracer(name: str) -> trace.Tracer:
    """A tracer for component ``name`` (e.g. ``fedsched.scheduler``)."""
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``headers`` with the current trace context (``traceparent``) added."""
    headers = dict(headers or {})
    inject(headers)
    return headers


def context_from(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """The trace context carried by NATS headers or gRPC metadata (empty context if none)."""
    if carrier is None:
        return otel_context.Context()
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}
    return extract(carrier)


def trace_id_of(carrier: Mapping[str, str] | None) -> str:
    """32-hex trace id of the ``traceparent`` in ``carrier``, or "" if none/invalid."""
    if not carrier:
        return ""
    value = carrier.get("traceparent", "")
    parts = value.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1]
    return ""


def current_trace_id() -> str:
    """32-hex id of the active span's trace, or "" outside a span."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def trace_headers(carrier: Mapping[str, str] | None) -> dict[str, str]:
    """Only the trace context (``traceparent``, ``tracestate``) of NATS headers or metadata, to
    hand on to the events a message causes."""
    return {k: v for k, v in (carrier or {}).items() if k in TRACE_HEADERS}


@contextmanager
def root_span(name: str, **attributes: str) -> Iterator[trace.Span]:
    """Make a new root span current: a new trace, whatever span is active (for work no traced
    event or call caused: heartbeats, snapshots, a bootstrap).

    With the SDK provider installed (:func:`setup_tracing`) it is a recorded span; without one
    it is a non-recording span with random valid ids, so its ``traceparent`` still propagates.
    """
    span = trace.get_tracer("fedsched").start_span(name, context=otel_context.Context(), attributes=attributes)
    if not span.get_span_context().is_valid:
        span = trace.NonRecordingSpan(trace.SpanContext(_IDS.generate_trace_id(), _IDS.generate_span_id(),
                                                        is_remote=False,
                                                        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
    with trace.use_span(span, end_on_exit=True):
        yield span


def child_headers(carrier: Mapping[str, str] | None, name: str, **attributes: str) -> dict[str, str]:
    """Trace headers (``traceparent``, ``tracestate``) for work caused by ``carrier``'s trace
    context: a child span named ``name`` of it, or a new root when ``carrier`` has none.

    When spans are exported (:func:`setup_tracing` with ``console``/``otlp``) the span is a
    recorded one with ``attributes``. Otherwise no span is recorded, so only its context is
    made: the parent's trace id and flags with a new random span id (W3C trace context) --
    what a recorded span would propagate, without the SDK's per-span cost (per placement in a
    scheduling cycle).
    """
    if _exporting:
        with trace.get_tracer("fedsched").start_as_current_span(name, context=context_from(carrier),
                                                               attributes=attributes):
            return inject_headers()
    parent = carrier.get("traceparent", "") if carrier else ""
    parts = parent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32 and len(parts[3]) == 2:
        trace_id, flags = parts[1], parts[3]
    else:
        trace_id, flags = format(_IDS.generate_trace_id(), "032x"), "01"
    out = {"traceparent": f"00-{trace_id}-{_IDS.generate_span_id():016x}-{flags}"}
    state = carrier.get("tracestate") if carrier and trace_id == (parts[1] if len(parts) == 4 else "") else None
    if state:
        out["tracestate"] = state
    return out


@contextmanager
def child_span(carrier: Mapping[str, str] | None, name: str, tracer_: trace.Tracer | None = None,
               **attributes: str) -> Iterator[trace.Span]:
    """Make a child of ``carrier``'s trace context (NATS headers; a new root trace when it has
    none) the current span while the block runs: what a consumer does per message it handles.

    When spans are exported (:func:`setup_tracing` with ``console``/``otlp``) it is a recorded
    span of ``tracer_`` named ``name`` with ``attributes``. Otherwise nothing would ever read the
    span but its ids, so only those are made (as :func:`child_headers` does): a non-recording span
    with the parent's trace id and flags and a new random span id -- what the events published
    inside the block carry as their parent is the same, without the SDK's per-span cost (issue
    15: ~8% of the agents' CPU, one span per placement).
    """
    if _exporting:
        with (tracer_ or trace.get_tracer("fedsched")).start_as_current_span(
                name, context=context_from(carrier), attributes=attributes) as span:
            yield span
        return
    parent = carrier.get("traceparent", "") if carrier else ""
    parts = parent.split("-")
    try:
        trace_id = int(parts[1], 16) if len(parts) == 4 and len(parts[1]) == 32 else 0
        flags = int(parts[3], 16) if trace_id else trace.TraceFlags.SAMPLED
    except ValueError:
        trace_id, flags = 0, trace.TraceFlags.SAMPLED
    if not trace_id:
        trace_id = _IDS.generate_trace_id()
    state = carrier.get("tracestate") if carrier and parent else None
    span = trace.NonRecordingSpan(trace.SpanContext(
        trace_id, _IDS.generate_span_id(), is_remote=False, trace_flags=trace.TraceFlags(flags),
        trace_state=trace.TraceState.from_header([state]) if state else None))
    with trace.use_span(span, end_on_exit=False):
        yield span


def event_headers(extra: Mapping[str, str] | None, name: str) -> dict[str, str]:
    """Headers for publishing an event: ``extra`` with a trace context, in this order:

    1. a ``traceparent`` already in ``extra`` -- the cause the publisher names;
    2. the active span's context;
    3. a new root span named ``name`` (:func:`root_span`).

    So every event carries a trace id (the audit log stores it).
    """
    headers = dict(extra or {})
    if trace_id_of(headers):
        return headers
    headers = inject_headers(headers)
    if not trace_id_of(headers):
        with root_span(name):
            headers = inject_headers(headers)
    return headers
