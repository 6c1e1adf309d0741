"""End to end: a 300-pod slice of the real trace through the whole system, checked from ClickHouse."""

import json

import pytest

from fedapp.replay.driver import ReplayDriver, ReplayOptions
from fedsched.settings import Settings
from tests.builders import unique

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def replayed(nats_server, chdb_path, trace_nodes_m, trace_pods_m, tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("replay"), nats_url=nats_server.url,
                        subject_prefix=unique("r"), clickhouse_path=chdb_path, clickhouse_database=unique("db"),
                        grpc_address="127.0.0.1:0", heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    driver = ReplayDriver(ReplayOptions(nodes_csv=trace_nodes_m, pods_csv=trace_pods_m, settings=settings, limit=300,
                                        timeout_s=300))
    report = await driver.run()
    from fedsched.store import open_store
    store = open_store(chdb_path=chdb_path, database=settings.clickhouse_database)
    return report, store, driver


@pytest.fixture(scope="module")
def trace_nodes_m():
    from tests.builders import DATA
    return DATA / "openb_node_list_gpu_node.csv"


@pytest.fixture(scope="module")
def trace_pods_m():
    from tests.builders import DATA
    return DATA / "openb_pod_list_gpuspec33.csv"


async def test_every_job_is_accounted_for_exactly_once(replayed):
    report, store, _ = replayed
    jobs = report["jobs"]
    assert jobs["submitted"] == 300
    assert jobs["placed"] + jobs["rejected"] + jobs["pending"] == jobs["submitted"]
    assert jobs["finished"] + jobs["failed"] + jobs["rejected"] + jobs["unplaceable"] >= 300 - jobs["pending"] + \
        jobs["unplaceable"] - jobs["pending"]
    db = store.database
    dup = store.query(f"""SELECT count() FROM (SELECT job_id FROM {db}.events WHERE type = 'job.submitted'
                          GROUP BY job_id HAVING count() > 1)""").scalar()
    assert dup == 0
    ended = store.query(f"""SELECT uniqExact(job_id) FROM {db}.events
                            WHERE type IN ('job.finished', 'job.failed')""").scalar()
    assert ended == jobs["finished"] + jobs["failed"]


async def test_no_cluster_ever_exceeds_its_gpus(replayed):
    report, store, _ = replayed
    check = report["capacity_check"]
    assert check["over_allocated"] == {}
    assert check["peak_milli"] and all(v > 0 for v in check["peak_milli"].values())


async def test_no_card_is_ever_over_shared(replayed):
    """Per node and card, from the placed bindings and the start/end events in ClickHouse."""
    _, store, _ = replayed
    db = store.database
    worst = store.query(f"""
        WITH b AS (
            SELECT job_id, attempt, cluster, JSONExtractString(w, 'node') AS node, arrayJoin(
                       JSONExtract(w, 'gpu_indices', 'Array(Int64)')) AS card, JSONExtractInt(w, 'gpu_milli') AS milli
            FROM {db}.events ARRAY JOIN JSONExtractArrayRaw(payload, 'bindings') AS w
            WHERE type = 'job.placed'),
        t AS (
            SELECT job_id, attempt, minIf(occurred_at, type = 'job.started') AS s,
                   maxIf(occurred_at, type IN ('job.finished', 'job.failed', 'job.stopped')) AS e
            FROM {db}.events WHERE type IN ('job.started', 'job.finished', 'job.failed', 'job.stopped')
            GROUP BY job_id, attempt HAVING countIf(type = 'job.started') > 0),
        d AS (
            SELECT cluster, node, card, t.s AS at, 1 AS is_start, milli AS delta FROM b INNER JOIN t USING (job_id, attempt)
            UNION ALL
            SELECT cluster, node, card, t.e AS at, 0 AS is_start, -milli AS delta FROM b INNER JOIN t USING (job_id, attempt))
        SELECT max(used) FROM (
            SELECT sum(delta) OVER (PARTITION BY cluster, node, card ORDER BY at, is_start
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS used FROM d)""").scalar()
    assert 0 < worst <= 1000


async def test_card_model_constraints_hold(replayed):
    _, store, _ = replayed
    db = store.database
    rows = store.query(f"""
        SELECT s.job_id, JSONExtract(s.payload, 'spec', 'card_models', 'Array(String)') AS allowed,
               JSONExtractString(r.payload, 'card_model') AS used
        FROM {db}.events AS s INNER JOIN {db}.events AS r ON s.job_id = r.job_id
        WHERE s.type = 'job.submitted' AND r.type = 'job.started'""").rows
    assert rows
    constrained = [(j, a, u) for j, a, u in rows if a]
    assert constrained, "the slice should contain card-model-constrained jobs"
    assert all(u in a for _, a, u in constrained)


async def test_audit_holds_exactly_the_events_published(replayed):
    report, store, driver = replayed
    published = report["replay"]["stream_messages"]
    assert report["audit_events"] == published
    ids = store.query(f"SELECT count(), uniqExact(event_id) FROM {store.database}.events").rows[0]
    assert ids[0] == ids[1]


async def test_one_trace_spans_grpc_admission_scheduler_agent_and_audit(replayed):
    _, store, _ = replayed
    rows = store.query(f"""
        SELECT job_id, uniqExact(trace_id), countIf(trace_id = ''), groupUniqArray(producer)
        FROM {store.database}.events
        WHERE type IN ('job.submitted', 'job.placed', 'job.started', 'job.finished', 'job.failed')
        GROUP BY job_id""").rows
    assert len(rows) == 300
    for job_id, traces, empty, producers in rows:
        assert traces == 1 and empty == 0, job_id
    assert {"admission", "scheduler"} <= set(rows[0][3]) and any(p.startswith("agent/") for p in rows[0][3])


async def test_waits_usage_and_cost_are_consistent(replayed):
    report, store, _ = replayed
    assert report["wait_seconds"]["count"] == report["jobs"]["started"]
    assert 0 <= report["wait_seconds"]["p50"] <= report["wait_seconds"]["p95"]
    db = store.database
    ended = store.query(f"""SELECT count() FROM {db}.events WHERE type IN ('job.finished', 'job.failed', 'job.stopped')
                            AND JSONExtractString(payload, 'started_at') != ''""").scalar()
    assert report["usage_rows"] == ended
    assert float(report["cost_total"]) > 0
    json.dumps(report)  # the report is JSON-serialisable


async def test_a_trace_without_gpu_columns_with_odd_pods_replays(nats_server, chdb_path, tmp_path):
    """Other traces: a node list without ``gpu``/``model`` columns, pods without GPU columns, a
    repeated pod name, and pods no valid job can express -- every row is accounted for."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib\n" + "".join(f"node-{i},96000,393216\n" for i in range(24)))
    pods = tmp_path / "pods.csv"
    pods.write_text("name,creation_time,deletion_time,cpu_milli,memory_mib\n"
                    "p1,0,600,4000,8192\n"
                    "p1,10,400,2000,4096\n"              # same name: kept as p1-dup2
                    "p2,20,900,1000,1024\n"
                    "huge,30,100,999999999999,1024\n"    # more CPU than any worker may ask: rejected
                    "forever,40,3000000000,1000,1024\n"  # a runtime no estimate may claim: rejected
                    "P_Upper Name,50,200,,\n")             # any name; no resources given: one core
    settings = Settings(data_dir=tmp_path / "d", nats_url=nats_server.url, subject_prefix=unique("r"),
                        clickhouse_path=chdb_path, clickhouse_database=unique("db"), grpc_address="127.0.0.1:0",
                        heartbeat_interval_s=0.5, schedule_interval_s=0.002)
    report = await ReplayDriver(ReplayOptions(nodes_csv=nodes, pods_csv=pods, settings=settings, speed=1000,
                                              timeout_s=120)).run()
    jobs = report["jobs"]
    assert report["timed_out"] is False
    assert jobs["submitted"] == 6 and jobs["rejected"] == 2, jobs
    assert jobs["finished"] == 4 and jobs["pending"] == 0, jobs
