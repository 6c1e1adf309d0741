"""Ad-hoc SQL (``fedsched sql`` / ``report``) on a reader: nothing reaches the host's files,
programs or network, and a query past its memory or time limit fails alone while the writers
go on (issue 14, item 3). Identical on every engine."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest

from fedsched.bus import Delivery
from fedsched.errors import ValidationError
from fedsched.events import Envelope
from fedapp.reports import REPORTS, data_window, run_reports
from fedapp.reports.grafana import dashboard, grafana_macros
from fedsched.store import ReadLimits
from services.audit.service import EVENT_COLUMNS, event_row

T0 = datetime(2023, 3, 1, 12, 0)

REFUSED = [
    pytest.param("SELECT file('/etc/passwd')", "file() reads a file of the host", id="file-scalar"),
    pytest.param("SELECT length(file('/etc/passwd')) > 0", "file() reads a file of the host", id="file-nested"),
    pytest.param("SELECT arrayMap(p -> file(p), ['/etc/passwd'])", "file() reads a file", id="file-in-lambda"),
    pytest.param("SELECT COLUMNS('p') APPLY file FROM (SELECT '/etc/passwd' AS p)", "file() reads a file",
                 id="file-apply"),
    pytest.param("SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file()", id="file-table"),
    pytest.param("SELECT * FROM url('http://127.0.0.1:9/x', 'LineAsString')", "table function url()", id="url"),
    pytest.param("SELECT * FROM s3('http://127.0.0.1:9/bucket/x', 'LineAsString')", "table function s3()", id="s3"),
    pytest.param("SELECT * FROM executable('id', 'LineAsString', 'x String')", "table function executable()",
                 id="executable"),
    pytest.param("SELECT * FROM remote('127.0.0.1:9', system.one)", "table function remote()", id="remote"),
    pytest.param("SELECT * FROM sqlite('/etc/passwd', 't')", "table function sqlite()", id="sqlite"),
    pytest.param("SELECT * FROM (SELECT 1) AS a JOIN url('http://127.0.0.1:9/x', 'CSV', 'n UInt8') AS b ON 1",
                 "table function url()", id="url-in-join"),
    pytest.param("SELECT aiGenerate('hello')", "network AI provider", id="ai"),
    pytest.param("SELECT addressToSymbol(toUInt64(1))", "binary", id="introspection"),
    pytest.param("SELECT 1 INTO OUTFILE '{out}'", "INTO OUTFILE", id="into-outfile"),
    pytest.param("SELECT 1; DROP TABLE {db}.usage", "Multi-statements are not allowed", id="multi-statement"),
    pytest.param("DROP TABLE {db}.usage", "not Drop", id="drop"),
    pytest.param("INSERT INTO {db}.events (event_id) SELECT 'forged'", "not Insert", id="insert"),
    pytest.param("SET readonly = 0", "not Set", id="set"),
    pytest.param("SELECT 1 SETTINGS readonly = 0", "readonly mode", id="settings-clause"),
    pytest.param("SELECT 1 SETTINGS max_memory_usage = 0", "readonly mode", id="lift-memory-limit"),
    pytest.param("SYSTEM FLUSH LOGS", "not System", id="system"),
    pytest.param("INSERT INTO {db}.events (event_id) VALUES ('forged')", "not INSERT", id="insert-values"),
    pytest.param("DESCRIBE TABLE {db}.events", "not Describe", id="describe"),
]


@pytest.mark.parametrize("sql, says", REFUSED)
def test_a_reader_refuses_what_reaches_the_host_or_writes(engine, tmp_path, sql, says):
    store = engine.open()
    out = tmp_path / "out.txt"
    with pytest.raises(ValidationError) as e:
        store.reader().query(sql.format(db=store.database, out=out))
    assert e.value.field == "sql" and says in str(e.value), str(e.value)
    assert "root:" not in str(e.value)  # no file content in the message either
    assert not out.exists()
    assert store.query(f"EXISTS TABLE {store.database}.usage").scalar() == 1
    assert store.query(f"SELECT count() FROM {store.database}.events").scalar() == 0


def test_a_reader_runs_reads_reports_and_panels(engine):
    store = engine.open()
    reader = store.reader()
    assert reader.query(f"SELECT count() FROM {store.database}.events WHERE occurred_at >= {{t:DateTime64(3)}} "
                        f"-- a comment", {"t": T0}).scalar() == 0
    assert "events" in {r[0] for r in reader.query(f"SHOW TABLES FROM {store.database}").rows}
    assert reader.query("SELECT sum(number) FROM numbers(10)").scalar() == 45
    assert reader.query("EXPLAIN SELECT 1").rows
    assert reader.query("SELECT 'file(''/etc/passwd'')' AS text").scalar() == "file('/etc/passwd')"
    query = lambda sql, params: reader.query(sql, params)  # noqa: E731
    window = data_window(query, store.database, start=T0, end=T0 + timedelta(days=1))
    assert [r.query.name for r in run_reports(query, store.database, window)] == [q.name for q in REPORTS]
    for panel in dashboard()["panels"]:
        reader.query(grafana_macros(panel["targets"][0]["rawSql"], database=store.database,
                                    from_ms=1677672000000, to_ms=1677758400000, interval_s=60))


def _audit_row(n: int) -> list:
    env = Envelope(event_id=f"{n:032x}", type="job.submitted", occurred_at=datetime(2023, 3, 1, tzinfo=timezone.utc),
                   producer="test", tenant="nlp", project="train", job_id=f"j-{n}")
    return event_row(Delivery(envelope=env, subject="t.jobs.submitted.nlp.train", headers={}, stream_sequence=n,
                              deliveries=1))


def test_a_query_past_the_memory_limit_fails_alone_and_the_writer_goes_on(engine):
    store = engine.open()
    reader = store.reader()  # the default limits
    failed: list[Exception] = []

    def exhaust() -> None:
        try:
            reader.query("SELECT groupArray(randomString(1000)) FROM numbers(1e9)")
        except Exception as e:  # noqa: BLE001 - inspected below
            failed.append(e)

    worker = threading.Thread(target=exhaust)
    worker.start()
    written = sum(store.insert_new("events", [_audit_row(i)], EVENT_COLUMNS, "event_id") for i in range(20))
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert written == 20
    assert len(failed) == 1 and isinstance(failed[0], ValidationError), failed
    assert "max_memory_usage" in str(failed[0]) and "MEMORY_LIMIT_EXCEEDED" in str(failed[0])
    assert store.insert_new("events", [_audit_row(99)], EVENT_COLUMNS, "event_id") == 1  # afterwards too
    assert store.query(f"SELECT count() FROM {store.database}.events").scalar() == 21
    assert reader.query(f"SELECT count() FROM {store.database}.events").scalar() == 21  # the reader still answers
    assert store.query("SELECT getSetting('readonly')").scalar() == 0  # the writer's session is not read-only


def test_a_query_past_the_time_limit_fails_with_the_limit_named(engine):
    store = engine.open()
    reader = store.reader(ReadLimits(max_execution_s=1))
    with pytest.raises(ValidationError, match=r"time limit \(max_execution_time, 1 s\)"):
        reader.query("SELECT count() FROM numbers(1e13) WHERE sipHash64(number) = 0")
    assert store.insert_new("events", [_audit_row(1)], EVENT_COLUMNS, "event_id") == 1
