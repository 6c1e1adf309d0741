"""End to end: a small replay through the embedded system with every service's metrics served;
each endpoint is scraped over HTTP, parsed with prometheus_client's parser, and every metric
family is found with a value that agrees with what happened (the replay's report and the audit
log in ClickHouse)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedsched.settings import Settings
from tests.builders import unique

pytestmark = pytest.mark.e2e

SERVICES = ("admission", "scheduler", "audit", "billing", "agents")


class Scrape:
    """One endpoint's samples: ``name -> [(labels, value)]``."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for f in self.families.values():
            for s in f.samples:
                self.samples[s.name].append((s.labels, s.value))

    def total(self, name: str, **labels: str) -> float:
        return sum(v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items()))

    def values(self, name: str, key: str) -> dict[str, float]:
        return {lab[key]: v for lab, v in self.samples.get(name, ())}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


async def scrape_until(url: str, done, timeout_s: float = 20.0) -> Scrape:
    """Scrape ``url`` until ``done(scrape)`` holds (the lag is sampled every 5 s) or the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = Scrape(await asyncio.to_thread(_get, url))
        if done(s) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
async def scraped(nats_server, chdb_path, tmp_path_factory):
    from tests.builders import DATA

    settings = Settings(data_dir=tmp_path_factory.mktemp("metrics"), nats_url=nats_server.url,
                        subject_prefix=unique("m"), clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5, schedule_interval_s=0.002,
                        metrics_port=0)
    out: dict = {}

    async def on_finished(system, report) -> None:
        out["urls"] = dict(system.metrics_urls)
        out["clusters"] = sorted(a.cluster.name for a in system.agents)
        db = system.sync_store.database
        out["placed_events"] = int(system.sync_store.query(
            f"SELECT count() FROM {db}.events WHERE type = 'job.placed'").scalar())
        out["pending_events"] = int(system.sync_store.query(
            f"SELECT count() FROM {db}.events WHERE type = 'job.pending'").scalar())
        writers_drained = lambda s: s.total("fedsched_store_backlog_events") == 0 and s.samples.get(  # noqa: E731
            "fedsched_store_backlog_events")
        lag_sampled = lambda s: bool(s.values("fedsched_consumer_lag_messages", "consumer"))  # noqa: E731
        out["scrapes"] = {
            name: await scrape_until(url, writers_drained if name in ("audit", "billing") else
                                     lag_sampled if name in ("admission", "scheduler") else lambda s: True)
            for name, url in system.metrics_urls.items()}

    driver = ReplayDriver(ReplayOptions(nodes_csv=DATA / "openb_node_list_gpu_node.csv",
                                        pods_csv=DATA / "openb_pod_list_gpuspec33.csv", settings=settings, limit=60,
                                        timeout_s=300, on_finished=on_finished))
    report = await driver.run()
    return report, out


async def test_every_service_serves_its_own_endpoint(scraped):
    _, out = scraped
    assert set(out["urls"]) == set(SERVICES)
    assert len(set(out["urls"].values())) == len(SERVICES)  # one port each
    for name, s in out["scrapes"].items():
        assert "fedsched_dead_letters" in s.families, name
        assert "fedsched_consumer_lag_messages" in s.families, name
        assert s.total("fedsched_dead_letters_total") == 0, name
    # admission and the scheduler read the streams through followers: their lag has samples too
    # (a tryout found only HELP/TYPE lines there)
    for name, followers in (("admission", {"admission-jobs", "admission-inventory"}),
                            ("scheduler", {"scheduler-events", "scheduler-inventory"})):
        lags = out["scrapes"][name].values("fedsched_consumer_lag_messages", "consumer")
        assert set(lags) == followers and all(v >= 0 for v in lags.values()), (name, lags)


async def test_admission_jobs_by_state_and_grpc_calls(scraped):
    report, out = scraped
    s = out["scrapes"]["admission"]
    jobs = report["jobs"]
    accepted = jobs["submitted"] - jobs["rejected"]
    assert accepted > 0
    assert s.total("fedsched_admission_jobs") == accepted
    states = s.values("fedsched_admission_jobs", "state")
    assert states["succeeded"] + states["failed"] + states["cancelled"] == accepted  # the replay waited for all
    assert states["succeeded"] == jobs["finished"] and states["failed"] == jobs["failed"]
    assert s.total("fedsched_grpc_server_requests_total", method="JobService/SubmitJob", code="OK") == accepted
    assert s.total("fedsched_grpc_server_requests_total", method="JobService/SubmitJob") >= jobs["submitted"]
    assert s.total("fedsched_grpc_server_request_duration_seconds_count", method="JobService/SubmitJob") >= \
        jobs["submitted"]


async def test_scheduler_placements_cycles_queues_and_heartbeats(scraped):
    report, out = scraped
    s = out["scrapes"]["scheduler"]
    placements = s.total("fedsched_scheduler_placements_total")
    assert placements == out["placed_events"] >= report["jobs"]["placed"] > 0
    assert set(s.values("fedsched_scheduler_placements_total", "cluster")) <= set(out["clusters"])
    assert s.total("fedsched_scheduler_cycle_duration_seconds_count") > 0
    assert 0 < s.total("fedsched_scheduler_cycle_duration_seconds_sum") < 60
    assert s.total("fedsched_scheduler_decisions_per_cycle_sum", outcome="placed") == placements
    assert s.total("fedsched_scheduler_pending_reasons_total") <= out["pending_events"]
    assert "fedsched_scheduler_queue_length" in s.families
    assert s.total("fedsched_scheduler_queue_length") == 0  # nothing waits at the end
    ages = s.values("fedsched_scheduler_heartbeat_age_seconds", "cluster")
    assert sorted(ages) == out["clusters"]
    assert all(0 <= age < 60 for age in ages.values()), ages


async def test_agents_received_every_placement_and_run_nothing_at_the_end(scraped):
    _, out = scraped
    s = out["scrapes"]["agents"]
    assert s.total("fedsched_agent_placements_received_total") == out["scrapes"]["scheduler"].total(
        "fedsched_scheduler_placements_total")
    assert sorted(s.values("fedsched_agent_running_jobs", "cluster")) == out["clusters"]
    assert s.total("fedsched_agent_running_jobs") == 0
    assert s.total("fedsched_agent_backend_errors_total") == 0
    lags = s.values("fedsched_consumer_lag_messages", "consumer")
    assert sorted(lags) == sorted(f"agent-{c}" for c in out["clusters"])
    assert all(v >= 0 for v in lags.values())


@pytest.mark.parametrize("service,tables,consumers", [
    ("audit", {"events", "decisions", "inventory"}, {"audit-events", "audit-inventory", "audit-dlq"}),
    ("billing", {"usage"}, {"billing", "billing-transfer"}),
], ids=["audit", "billing"])
async def test_writers_insert_latency_and_backlog(scraped, service, tables, consumers):
    _, out = scraped
    s = out["scrapes"][service]
    counts = s.values("fedsched_store_insert_duration_seconds_count", "table")
    assert set(counts) == tables and all(n > 0 for n in counts.values())
    assert s.total("fedsched_store_insert_duration_seconds_sum") > 0
    assert s.samples["fedsched_store_backlog_events"] and s.total("fedsched_store_backlog_events") == 0
    lags = s.values("fedsched_consumer_lag_messages", "consumer")
    assert set(lags) == consumers and all(v == 0 for v in lags.values())


def test_up_prints_one_metrics_url_per_service_and_each_serves(tmp_path):
    """`fedsched up --metrics-port 0` (free ports) prints a URL per service; each answers with
    its own families; Ctrl-C stops them."""
    import os
    import signal
    import subprocess
    import sys

    from fedsched.natsd import free_port

    env = dict(os.environ, FEDSCHED_NATS_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fedapp.cli", "up", "--data-dir", str(tmp_path), "--grpc-address",
                             f"127.0.0.1:{free_port()}", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    urls: dict[str, str] = {}
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(urls) < len(SERVICES):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.strip().startswith("metrics "):
                name, url = line.strip().removeprefix("metrics ").split(": ", 1)
                urls[name] = url
        assert set(urls) == set(SERVICES), "".join(lines)
        own = {"admission": "fedsched_admission_jobs", "scheduler": "fedsched_scheduler_placements",
               "audit": "fedsched_store_insert_duration_seconds", "billing": "fedsched_store_backlog_events",
               "agents": "fedsched_agent_running_jobs"}
        for name, url in urls.items():
            families = {f.name for f in text_string_to_metric_families(_get(url))}
            assert own[name] in families, (name, sorted(families))
            others = {f for n, f in own.items() if n not in (name, "audit", "billing")} - {own[name]}
            assert not families & others, (name, families & others)  # its own registry only
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for url in urls.values():
        with pytest.raises(OSError):
            _get(url)
