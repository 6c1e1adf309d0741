"""The metrics library: reason codes, ports, callback gauges, lag sampling, the gRPC interceptor
(on a real grpc.aio server) and serving over HTTP (parsed with prometheus_client's parser)."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from fedsched.errors import UnavailableError
from fedsched.metrics import (NO_REASON, AdmissionMetrics, AgentMetrics, SchedulerMetrics, ServiceMetrics, WriterMetrics,
                              dead_letter_code, metric_ports, pending_reason_code, serve)
from fedsched.reasons import PASS, Reason, fail


@pytest.mark.parametrize("verdicts,code", [
    ([], NO_REASON),
    ([PASS, PASS], NO_REASON),
    ([fail(Reason.CARD_MODEL), fail(Reason.INSUFFICIENT), fail(Reason.INSUFFICIENT)], "insufficient_free_resources"),
    ([fail(Reason.QUOTA), PASS], "quota_exceeded"),
    ([fail(Reason.STALE), fail(Reason.CARD_MODEL)], "inventory_stale"),  # a tie: the first seen
], ids=["no-clusters", "all-passed", "most-common", "one-failed", "tie-first-seen"])
def test_pending_reason_code_is_the_most_common_failed_reason(verdicts, code):
    assert pending_reason_code(verdicts) == code


@pytest.mark.parametrize("reason,code", [
    ("handler failed: ValueError('x')", "handler_failed"),
    ("payload does not validate: field tenant", "undecodable"),
    ("", "undecodable"),
], ids=["handler", "decode", "empty"])
def test_dead_letter_reason_codes(reason, code):
    assert dead_letter_code(reason) == code


@pytest.mark.parametrize("base,services,ports", [
    (9464, ("audit", "billing", "scheduler", "agents", "admission"),
     {"admission": 9464, "scheduler": 9465, "audit": 9466, "billing": 9467, "agents": 9468}),
    (9464, ("audit", "billing", "scheduler", "admission"),
     {"admission": 9464, "scheduler": 9465, "audit": 9466, "billing": 9467}),
    (9100, ("agents",), {"agents": 9100}),
    (0, ("scheduler", "audit"), {"scheduler": 0, "audit": 0}),
], ids=["up", "up-no-agents", "one-service", "free-ports"])
def test_metric_ports_are_consecutive_in_a_fixed_order(base, services, ports):
    assert metric_ports(base, services) == ports


def test_each_service_has_its_own_registry_with_the_common_families():
    a, b = SchedulerMetrics(), SchedulerMetrics()
    a.placed("cn-north-1", "c1")
    assert a.registry.get_sample_value("fedsched_scheduler_placements_total", {"region": "cn-north-1", "cluster": "c1"}) == 1
    assert b.registry.get_sample_value("fedsched_scheduler_placements_total", {"region": "cn-north-1", "cluster": "c1"}) is None
    for m in (AdmissionMetrics(), SchedulerMetrics(), AgentMetrics(), WriterMetrics("audit"), WriterMetrics("billing")):
        names = m.sample_names()
        assert {"fedsched_consumer_lag_messages", "fedsched_dead_letters_total"} <= names, m.service


def test_jobs_by_state_are_read_from_the_counts_at_scrape_time():
    m = AdmissionMetrics()
    counts = {"queued": 2, "running": 1}
    m.watch_jobs(lambda: counts)
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "queued"}) == 2
    counts["queued"] = 0
    counts["running"] = 3
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "queued"}) == 0
    assert m.registry.get_sample_value("fedsched_admission_jobs", {"state": "running"}) == 3


def test_a_failing_callback_does_not_break_the_scrape():
    m = SchedulerMetrics()
    m.watch_heartbeats(lambda: 1 / 0)
    m.placed("r", "c")
    assert m.registry.get_sample_value("fedsched_scheduler_placements_total", {"region": "r", "cluster": "c"}) == 1


def test_queues_absent_now_read_zero():
    m = SchedulerMetrics()
    m.observe_queues({"training": (3, 120.0), "fast": (1, 5.0)})
    m.observe_queues({"fast": (2, 7.5)})
    get = m.registry.get_sample_value
    assert get("fedsched_scheduler_queue_length", {"queue": "training"}) == 0
    assert get("fedsched_scheduler_queue_oldest_age_seconds", {"queue": "training"}) == 0
    assert get("fedsched_scheduler_queue_length", {"queue": "fast"}) == 2
    assert get("fedsched_scheduler_queue_oldest_age_seconds", {"queue": "fast"}) == 7.5


async def test_lag_sampling_sets_each_consumer_and_the_writer_backlog():
    m = WriterMetrics("audit")
    stop = asyncio.Event()
    calls = []

    async def lag_events() -> int:
        calls.append("events")
        return 7

    async def lag_dlq() -> int:
        stop.set()  # one round only
        return 2

    async def broken() -> int:
        raise ConnectionError("nats away")

    await asyncio.wait_for(m.sample_lag(lambda: [("audit-events", lag_events), ("audit-dlq", lag_dlq),
                                                 ("audit-inventory", broken)], stop, interval_s=60), 5)
    get = m.registry.get_sample_value
    assert calls == ["events"]
    assert get("fedsched_consumer_lag_messages", {"consumer": "audit-events"}) == 7
    assert get("fedsched_consumer_lag_messages", {"consumer": "audit-dlq"}) == 2
    assert get("fedsched_consumer_lag_messages", {"consumer": "audit-inventory"}) is None  # not sampled
    assert get("fedsched_store_backlog_events") == 9


def test_served_registry_parses_and_a_taken_port_is_unavailable():
    m = AgentMetrics()
    m.attach("cn-north-1", "c1", lambda: 4)
    m.received("cn-north-1", "c1")
    m.backend_error("cn-north-1", "c1", "launch")
    m.dead_letter("agent-c1", "undecodable")
    server = serve(m.registry, "127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(server.url, timeout=5).read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        labels = (("cluster", "c1"), ("region", "cn-north-1"))
        assert samples[("fedsched_agent_running_jobs", labels)] == 4
        assert samples[("fedsched_agent_placements_received_total", labels)] == 1
        assert samples[("fedsched_agent_backend_errors_total", (("cluster", "c1"), ("operation", "launch"), ("region", "cn-north-1")))] == 1
        assert samples[("fedsched_agent_backend_errors_total", (("cluster", "c1"), ("operation", "stop"), ("region", "cn-north-1")))] == 0
        assert samples[("fedsched_dead_letters_total", (("consumer", "agent-c1"), ("reason", "undecodable")))] == 1
        with pytest.raises(UnavailableError, match="metrics"):
            serve(m.registry, "127.0.0.1", server.port)
    finally:
        server.close()


async def test_grpc_interceptor_counts_calls_by_method_and_code():
    m = AdmissionMetrics()
    server = grpc.aio.server(interceptors=[m.interceptor()])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("known", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(3):
                await stub.Check(health_pb2.HealthCheckRequest(service="known"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(service="unknown"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError):  # an unregistered method: no new label value
                await ch.unary_unary("/no.Such/Method")(b"")
    finally:
        await server.stop(None)
    get = m.registry.get_sample_value
    assert get("fedsched_grpc_server_requests_total", {"method": "Health/Check", "code": "OK"}) == 3
    assert get("fedsched_grpc_server_requests_total", {"method": "Health/Check", "code": "NOT_FOUND"}) == 1
    assert get("fedsched_grpc_server_request_duration_seconds_count", {"method": "Health/Check"}) == 4
    methods = {s.labels.get("method") for f in m.registry.collect() for s in f.samples if "method" in s.labels}
    assert methods == {"Health/Check"}


def test_sample_names_cover_histogram_and_counter_series():
    names = ServiceMetrics("x").sample_names() | SchedulerMetrics().sample_names()
    assert {"fedsched_scheduler_cycle_duration_seconds_bucket", "fedsched_scheduler_cycle_duration_seconds_count",
            "fedsched_scheduler_placements_total", "fedsched_dead_letters_total"} <= names


def test_metrics_port_comes_from_the_environment_and_is_off_by_default(monkeypatch):
    from fedsched.settings import Settings

    monkeypatch.delenv("FEDSCHED_METRICS_PORT", raising=False)
    assert Settings().metrics_port is None
    monkeypatch.setenv("FEDSCHED_METRICS_PORT", "9500")
    monkeypatch.setenv("FEDSCHED_METRICS_HOST", "0.0.0.0")
    s = Settings()
    assert (s.metrics_port, s.metrics_host) == (9500, "0.0.0.0")
    monkeypatch.setenv("FEDSCHED_METRICS_PORT", "70000")
    with pytest.raises(ValueError):
        Settings()
