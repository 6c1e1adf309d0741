"""Prometheus metrics of every service: the metric families, one registry per service, serving.

Each service owns a :class:`ServiceMetrics` subclass holding its own
:class:`~prometheus_client.CollectorRegistry`, so in the embedded single process (``fedsched
up``) every service still has its own scrape endpoint, exactly as when each runs in its own
container. :func:`serve` exposes a registry with prometheus_client's own HTTP server (the
exposition format is prometheus_client's, never ours).

Units: durations in **seconds** (``*_seconds``), sizes as counts of messages, jobs or attempts;
counters end in ``_total`` on the wire. Labels are low-cardinality only: service, consumer
(durable or follower name), gRPC method and status code, queue, region, cluster, reason code,
job state, table -- never a job id, tenant-supplied text or an error message.

Families (``fedsched_`` prefix; which registry has them):

==========================================================  ==========  ===========================
family                                                      registry    labels
==========================================================  ==========  ===========================
``consumer_lag_messages`` (gauge)                           every       consumer
``dead_letters_total`` (counter)                            every       consumer, reason
``admission_jobs`` (gauge)                                  admission   state
``grpc_server_requests_total`` (counter)                    admission   method, code
``grpc_server_request_duration_seconds`` (histogram)        admission   method
``scheduler_queue_length`` (gauge)                          scheduler   queue
``scheduler_queue_oldest_age_seconds`` (gauge)              scheduler   queue
``scheduler_decisions_per_cycle`` (histogram)               scheduler   outcome
``scheduler_cycle_duration_seconds`` (histogram)            scheduler   --
``scheduler_placements_total`` (counter)                    scheduler   region, cluster
``scheduler_pending_reasons_total`` (counter)               scheduler   reason
``scheduler_heartbeat_age_seconds`` (gauge)                 scheduler   region, cluster
``agent_running_jobs`` (gauge)                              agents      region, cluster
``agent_placements_received_total`` (counter)               agents      region, cluster
``agent_backend_errors_total`` (counter)                    agents      region, cluster, operation
``store_insert_duration_seconds`` (histogram)               audit,      table
                                                            billing
``store_backlog_events`` (gauge)                            audit,      --
                                                            billing
==========================================================  ==========  ===========================

Thread safety: prometheus_client's HTTP server collects in its own thread. Values the services
keep in their event loop are read at scrape time only through callbacks that copy a dict in one
C-level call (``tuple(d.items())``) or read one attribute; everything else is set from the loop
through prometheus_client's own (locked) metric objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as _Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fedsched.errors import UnavailableError
from fedsched.reasons import Verdict

log = logging.getLogger(__name__)

PREFIX = "fedsched"

#: Histogram buckets (seconds) for a scheduling cycle: sub-millisecond to 10 s.
CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Histogram buckets (decisions, a count) for decisions per cycle.
DECISION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
#: Histogram buckets (seconds) for gRPC calls and ClickHouse inserts.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: How often (wall seconds) services sample their durable consumers' lag from JetStream.
LAG_SAMPLE_INTERVAL_S = 5.0

#: Dead-letter reason codes (label ``reason`` of ``fedsched_dead_letters_total``).
DEAD_LETTER_UNDECODABLE = "undecodable"
DEAD_LETTER_HANDLER_FAILED = "handler_failed"

#: Reason code of a pending decision without any failed verdict (e.g. no inventory yet).
NO_REASON = "none"


def _name(short: str) -> str:
    return f"{PREFIX}_{short}"


class CallbackGauge(Collector):
    """A gauge family whose samples a callback returns at scrape time.

    Args:
        name / documentation: family name and help text.
        labels: label names.
        read: ``() -> iterable of (label values tuple, value)``; runs in the scraping thread, so
            it must only copy (e.g. ``tuple(d.items())``), never walk history. Replace it with
            :meth:`watch` (a restarted service hands in its own).
    """

    def __init__(self, name: str, documentation: str, labels: Sequence[str],
                 read: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = list(labels)
        self.read = read

    def watch(self, read: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None) -> None:
        """Read samples from ``read`` from now on (None: no samples)."""
        self.read = read

    def describe(self):
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
        read = self.read
        if read is not None:
            try:
                for values, value in read():
                    family.add_metric(list(values), float(value))
            except Exception:  # noqa: BLE001 - a scrape never breaks the service; logged
                log.exception("metrics: collecting %s failed", self.name)
        yield family


class ServiceMetrics:
    """The metrics every service has (its own registry): consumer lag and dead letters.

    Args:
        service: the service's name (``admission``, ``scheduler``, ``audit``, ``billing``,
            ``agents``), for logs and the runtime's URL list.
        registry: where the families register (default: a new registry of its own).
    """

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.consumer_lag = Gauge(_name("consumer_lag_messages"),
                                  "Messages of a durable consumer not yet acknowledged (pending + in flight), or "
                                  "of a stream follower not yet handled (a count), sampled every few seconds",
                                  ["consumer"], registry=r)
        self.dead_letters = Counter(_name("dead_letters"),
                                    "Messages given up on and sent to the dead-letter subject (a count), by "
                                    "consumer and reason code (undecodable, handler_failed)",
                                    ["consumer", "reason"], registry=r)

    def dead_letter(self, consumer: str, reason: str) -> None:
        """Count one dead letter of ``consumer`` with reason code ``reason`` (see
        :func:`dead_letter_code`); the hook :class:`~fedsched.bus.Bus` calls."""
        self.dead_letters.labels(consumer, reason).inc()

    def observe_lag(self, lags: Mapping[str, int]) -> None:
        """Set the lag (messages) of each durable consumer in ``lags``."""
        for consumer, lag in lags.items():
            self.consumer_lag.labels(consumer).set(lag)

    async def sample_lag(self, sources: Callable[[], Sequence[tuple[str, Callable[[], Awaitable[int]]]]],
                         stop: asyncio.Event, interval_s: float = LAG_SAMPLE_INTERVAL_S) -> None:
        """Every ``interval_s`` wall seconds (first at once) until ``stop`` is set: ask each
        source ``(consumer name, async lag())`` for its lag and set the gauges. A failed sample
        (NATS away) keeps the last value and is retried next time; never raises."""
        while not stop.is_set():
            lags: dict[str, int] = {}
            for consumer, lag in sources():
                try:
                    lags[consumer] = int(await lag())
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - metrics never take a service down
                    log.debug("metrics: lag of %s not sampled: %r", consumer, e)
            self.observe_lag(lags)
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass

    def sample_names(self) -> set[str]:
        """Every sample name this registry exposes (``x_total``, ``x_bucket``, ...), and the family
        names -- what a dashboard query may refer to."""
        names = set()
        for family in self.registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        return names


class AdmissionMetrics(ServiceMetrics):
    """Admission: jobs by state (from its job view) and gRPC calls by method and code."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("admission", registry)
        self.jobs = CallbackGauge(_name("admission_jobs"),
                                  "Jobs in admission's job view by state (a count; submitted and accepted jobs)",
                                  ["state"])
        self.registry.register(self.jobs)
        self.grpc_requests = Counter(_name("grpc_server_requests"),
                                     "gRPC calls handled (a count) by method (Service/Method) and status code",
                                     ["method", "code"], registry=self.registry)
        self.grpc_duration = Histogram(_name("grpc_server_request_duration_seconds"),
                                       "Wall seconds from a gRPC call's arrival to its status (streams: to their "
                                       "end), by method", ["method"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch_jobs(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Read jobs by state from ``counts`` (``state -> jobs``, kept by the job view as it
        folds events; read at scrape time without walking the jobs)."""
        self.jobs.watch(lambda: (((str(getattr(state, "value", state)),), n) for state, n in tuple(counts().items())))

    def observe_call(self, method: str, code: str, seconds: float) -> None:
        """Count one gRPC call of ``method`` ending with ``code`` after ``seconds`` (wall)."""
        self.grpc_requests.labels(method, code).inc()
        self.grpc_duration.labels(method).observe(seconds)

    def interceptor(self) -> "GrpcMetricsInterceptor":
        """A grpc.aio server interceptor counting every call into this registry (put it first:
        it then sees the status the other interceptors set)."""
        return GrpcMetricsInterceptor(self)


def _status_name(code) -> str:
    if code is None:
        return grpc.StatusCode.OK.name
    if isinstance(code, grpc.StatusCode):
        return code.name
    for member in grpc.StatusCode:  # grpc.aio may hand back the integer value
        if member.value[0] == code:
            return member.name
    return grpc.StatusCode.UNKNOWN.name


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that puts the handler of each method it takes (:meth:`takes`) behind
    :meth:`wrap`, built once per registered method and reused while grpc hands back the same
    handler (issue 15: closures and a method handler built per call were ~3% of a submit's CPU).
    Subclasses call ``super().__init__()`` and define :meth:`wrap`."""

    def __init__(self) -> None:
        #: method -> (the handler grpc gave, its wrapper)
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def takes(self, method: str, handler) -> bool:
        """Whether ``handler`` of ``method`` (``/pkg.Service/Method``) is wrapped (default: all)."""
        return True

    def wrap(self, full_method: str, handler):
        """The wrapped handler of ``full_method``."""
        raise NotImplementedError

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self.takes(details.method, handler):
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)  # registered methods only (handler not None)
        return wrapped


class GrpcMetricsInterceptor(WrappingInterceptor):
    """Counts gRPC calls by method and status code and times them (unary and server-streaming
    methods; the method label is ``Service/Method`` of a registered method only, so unknown
    methods cannot grow the label set). The code is the context's status after the call
    (``abort`` sets it), OK when none was set, UNKNOWN for an exception that escaped."""

    def __init__(self, metrics: AdmissionMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    def takes(self, method: str, handler) -> bool:
        return bool(handler.unary_unary or handler.unary_stream)

    def wrap(self, full_method: str, handler):
        """``handler`` of ``full_method`` (``/pkg.Service/Method``), counted and timed."""
        service, method = full_method.lstrip("/").rsplit("/", 1)
        label = f"{service.rsplit('.', 1)[-1]}/{method}"
        observe = self.metrics.observe_call

        def finish(context, t0: float, failed: BaseException | None) -> None:
            code = _context_code(context)
            if code is None and failed is not None and not isinstance(failed, asyncio.CancelledError):
                code = grpc.StatusCode.UNKNOWN
            name = "CANCELLED" if isinstance(failed, asyncio.CancelledError) and code is None else _status_name(code)
            observe(label, name, time.perf_counter() - t0)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                t0, failed = time.perf_counter(), None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    failed = e
                    raise
                finally:
                    finish(context, t0, failed)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            t0, failed = time.perf_counter(), None
            try:
                async for item in inner_stream(request, context):
                    yield item
            except BaseException as e:
                failed = e
                raise
            finally:
                finish(context, t0, failed)

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


def _context_code(context):
    try:
        return context.code()
    except Exception:  # noqa: BLE001 - older grpc.aio contexts have no code()
        return None


class SchedulerMetrics(ServiceMetrics):
    """The scheduler: queues, cycles, placements, pending reasons, clusters' heartbeat age."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("scheduler", registry)
        r = self.registry
        self.queue_length = Gauge(_name("scheduler_queue_length"),
                                  "Shards waiting for a placement (a count) per queue (fast, inference, training, "
                                  "batch), as of the last cycle", ["queue"], registry=r)
        self.queue_oldest_age = Gauge(_name("scheduler_queue_oldest_age_seconds"),
                                      "Business seconds the longest-waiting shard of a queue has waited since its "
                                      "submission (0 when empty), as of the last cycle", ["queue"], registry=r)
        self.decisions = Histogram(_name("scheduler_decisions_per_cycle"),
                                   "Decisions of one scheduling cycle (a count of shards), by outcome (placed, "
                                   "pending)", ["outcome"], buckets=DECISION_BUCKETS, registry=r)
        self.cycle_duration = Histogram(_name("scheduler_cycle_duration_seconds"),
                                        "Wall seconds of a scheduling cycle that ran the decision (load, decide, "
                                        "publish, commit)", buckets=CYCLE_BUCKETS, registry=r)
        self.placements = Counter(_name("scheduler_placements"),
                                  "Placements published and acknowledged by JetStream (a count of attempts), per "
                                  "region and cluster", ["region", "cluster"], registry=r)
        self.pending_reasons = Counter(_name("scheduler_pending_reasons"),
                                       "Pending decisions published (a count; a shard's reason is published when it "
                                       "changes), by the most common filter reason code over the clusters",
                                       ["reason"], registry=r)
        self.heartbeat_age = CallbackGauge(_name("scheduler_heartbeat_age_seconds"),
                                           "Wall seconds since the scheduler last heard from a cluster's agent "
                                           "(heartbeat or inventory, JetStream time)", ["region", "cluster"])
        r.register(self.heartbeat_age)
        self._queues: set[str] = set()

    def observe_queues(self, stats: Mapping[str, tuple[int, float]]) -> None:
        """Set queue length and oldest age (business seconds) from ``queue -> (shards, age)``;
        queues seen before and absent now read 0."""
        for queue in self._queues - set(stats):
            self.queue_length.labels(queue).set(0)
            self.queue_oldest_age.labels(queue).set(0)
        for queue, (n, age) in stats.items():
            self.queue_length.labels(queue).set(n)
            self.queue_oldest_age.labels(queue).set(max(0.0, age))
        self._queues |= set(stats)

    def observe_cycle(self, seconds: float, *, placed: int, pending: int) -> None:
        """One cycle that ran the decision: its wall ``seconds`` and how many shards it placed
        and left pending."""
        self.cycle_duration.observe(seconds)
        self.decisions.labels("placed").observe(placed)
        self.decisions.labels("pending").observe(pending)

    def placed(self, region: str, cluster: str) -> None:
        """Count one acknowledged placement on ``region``/``cluster``."""
        self.placements.labels(region, cluster).inc()

    def pending(self, reason: str) -> None:
        """Count one published pending decision with reason code ``reason``."""
        self.pending_reasons.labels(reason).inc()

    def watch_heartbeats(self, ages: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        """Read ``(region, cluster, age in wall seconds)`` from ``ages`` at scrape time."""
        self.heartbeat_age.watch(lambda: (((region, cluster), age) for region, cluster, age in ages()))


class AgentMetrics(ServiceMetrics):
    """The region agents of one process (labels region and cluster tell them apart)."""

    #: Backend operations counted in ``agent_backend_errors_total`` (label ``operation``).
    OPERATIONS = ("inventory", "launch", "stop", "list", "logs")

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("agents", registry)
        r = self.registry
        self.running = Gauge(_name("agent_running_jobs"),
                             "Attempts the agent runs on its cluster now (a count)", ["region", "cluster"],
                             registry=r)
        self.placements_received = Counter(_name("agent_placements_received"),
                                           "Placements the agent received for its cluster (a count of attempts; "
                                           "redeliveries not counted)", ["region", "cluster"], registry=r)
        self.backend_errors = Counter(_name("agent_backend_errors"),
                                      "Errors from the cluster's backend (a count) by operation (inventory, "
                                      "launch, stop, list, logs)", ["region", "cluster", "operation"], registry=r)
        #: (region, cluster) -> its child of ``placements_received`` (``labels()`` locks and looks
        #: it up by its label values: once per agent, not once per placement)
        self._received: dict[tuple[str, str], Counter] = {}

    def attach(self, region: str, cluster: str, running: Callable[[], int]) -> None:
        """Register one agent: its running-jobs gauge reads ``running()`` at scrape time (an
        ``len()`` of its running set) and its counters start at 0."""
        self.running.labels(region, cluster).set_function(running)
        self.placements_received.labels(region, cluster)
        for op in self.OPERATIONS:
            self.backend_errors.labels(region, cluster, op)

    def received(self, region: str, cluster: str) -> None:
        """Count one placement received."""
        child = self._received.get((region, cluster))
        if child is None:
            child = self._received[(region, cluster)] = self.placements_received.labels(region, cluster)
        child.inc()

    def backend_error(self, region: str, cluster: str, operation: str) -> None:
        """Count one backend error of ``operation`` (one of :data:`OPERATIONS`)."""
        self.backend_errors.labels(region, cluster, operation).inc()


class WriterMetrics(ServiceMetrics):
    """A ClickHouse writer (audit, billing): insert latency per table and its backlog."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(service, registry)
        self.insert_duration = Histogram(_name("store_insert_duration_seconds"),
                                         "Wall seconds of one insert into ClickHouse (new rows of a batch), by table",
                                         ["table"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.backlog = Gauge(_name("store_backlog_events"),
                             "Events delivered by JetStream but not yet written to ClickHouse and acknowledged (a "
                             "count: the writer's durable consumers' lag summed)", registry=self.registry)

    def observe_lag(self, lags: Mapping[str, int]) -> None:
        """Per-consumer lag, and their sum as the writer's backlog."""
        super().observe_lag(lags)
        if lags:
            self.backlog.set(sum(lags.values()))

    def time_insert(self, table: str):
        """A context manager timing one insert into ``table``."""
        return self.insert_duration.labels(table).time()


def dead_letter_code(reason: str) -> str:
    """The countable code of a dead letter's free-text reason: ``handler_failed`` for a handler
    that kept failing (reason starts with ``handler failed``), else ``undecodable``."""
    return DEAD_LETTER_HANDLER_FAILED if reason.startswith("handler failed") else DEAD_LETTER_UNDECODABLE


def pending_reason_code(verdicts: Iterable[Verdict]) -> str:
    """The reason code of a pending decision: the most common failed reason over its clusters'
    verdicts (:class:`~fedsched.reasons.Reason` value; ties: the first seen), :data:`NO_REASON`
    when no cluster failed (no inventory yet)."""
    counts = _Counter(v.reason.value for v in verdicts if not v.passed and v.reason is not None)
    return counts.most_common(1)[0][0] if counts else NO_REASON


@dataclass
class MetricsServer:
    """A running scrape endpoint (prometheus_client's HTTP server in a daemon thread)."""

    httpd: object
    thread: object
    host: str

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.httpd.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0 = a free one).

    Raises:
        UnavailableError: the port cannot be bound (taken, or not allowed).
    """
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise UnavailableError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}); is the port taken "
                               f"(another `fedsched up`?) Pass --metrics-port / FEDSCHED_METRICS_PORT") from e
    return MetricsServer(httpd, thread, host)


#: The services' metrics ports are consecutive in this order (those a process runs).
PORT_ORDER = ("admission", "scheduler", "audit", "billing", "agents")


def metric_ports(base: int, services: Iterable[str]) -> dict[str, int]:
    """Service -> metrics port: consecutive from ``base`` over :data:`PORT_ORDER` restricted to
    ``services``; ``base`` 0 gives every service a free port (0)."""
    wanted = set(services)
    ordered = [s for s in PORT_ORDER if s in wanted]
    return {s: (base + i if base else 0) for i, s in enumerate(ordered)}
