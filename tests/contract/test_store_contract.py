"""The store's contract, identical on every engine (chDB always; a server when there is one)."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest

from fedsched.errors import UnavailableError
from fedapp.reports import REPORTS, data_window, run_reports
from fedapp.reports.grafana import dashboard, grafana_macros
from fedsched.store import SchemaError, dedup_token, load_migrations

T0 = datetime(2023, 3, 1, 12, 0)


def test_migrations_apply_once_and_are_recorded(engine):
    store = engine.open()
    versions = [m.version for m in load_migrations()]
    assert store.schema_version() == max(versions)
    assert store.migrate() == []  # re-applying is a no-op
    assert store.query(f"SELECT count() FROM {store.database}.schema_migrations").scalar() == len(versions)
    columns = {r[0] for r in store.query(f"SELECT name FROM system.columns WHERE database = {{db:String}} "
                                         f"AND table = 'usage'", {"db": store.database}).rows}
    assert {"line", "transfer_bytes", "flag", "cost", "unit_price"} <= columns


def test_a_newer_schema_is_a_clear_error(engine):
    store = engine.open()
    store.insert("schema_migrations", [[9999, "from_the_future", "x"]], ["version", "name", "checksum"])
    with pytest.raises(SchemaError, match="newer than this fedsched"):
        store.migrate()


def test_an_edited_migration_is_refused(engine):
    store = engine.open()
    store.insert("schema_migrations", [[1, "init", "0000000000000000"]], ["version", "name", "checksum"])
    with pytest.raises(SchemaError, match="changed after it was applied"):
        store.migrate()


def _usage_rows(n: int, offset: int = 0) -> list[list]:
    return [[f"u-{i}", "compute", f"j-{i}", 1, 0, "nlp", "train", "cn-east-1", "cn-east-1a", "cn-east-1-c1",
             "nvidia-t4-16gb", "training", "finished", "", 0, T0, T0 + timedelta(hours=1), 1000, 3600.0, 0,
             Decimal("5.400000"), "v1", Decimal("5.400000") + Decimal(i) / 1_000_000, "CNY"]
            for i in range(offset, offset + n)]


USAGE = ["usage_id", "line", "job_id", "attempt", "shard", "tenant", "project", "region", "zone", "cluster",
         "card_model", "kind", "outcome", "flag", "cross_region", "started_at", "ended_at", "gpu_milli", "gpu_seconds",
         "transfer_bytes", "unit_price", "price_version", "cost", "currency"]


def test_insert_new_writes_each_key_once_and_money_stays_decimal(engine):
    store = engine.open()
    rows = _usage_rows(50)
    assert store.insert_new("usage", rows, USAGE, "usage_id") == 50
    assert store.insert_new("usage", rows[:10] + _usage_rows(5, offset=50) + rows[:3], USAGE, "usage_id") == 5
    got = store.query(f"SELECT count(), uniqExact(usage_id), sum(cost) FROM {store.database}.usage").rows[0]
    expected = sum(r[22] for r in _usage_rows(55))
    assert got == (55, 55, expected) and isinstance(got[2], Decimal)


def test_the_engine_drops_a_retried_insert_with_the_same_token(engine):
    """The second line of defence: an insert repeated after an unknown outcome is deduplicated
    by the engine itself (the token is what insert_new sends)."""
    store = engine.open()
    rows = _usage_rows(20)
    token = dedup_token("usage", {(r[0],) for r in rows})
    store.insert("usage", rows, USAGE, dedup_token=token)
    store.insert("usage", rows, USAGE, dedup_token=token)
    assert store.query(f"SELECT count() FROM {store.database}.usage").scalar() == 20


def test_ttl_is_configurable_for_high_volume_tables(engine):
    store = engine.open()
    assert store.apply_ttl({"events": 30, "decisions": 7}) == ["events", "decisions"]
    assert store.apply_ttl({"events": 30, "decisions": 7}) == []
    full = store.query("SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'events'",
                       {"db": store.database}).scalar()
    assert "toIntervalDay(30)" in full
    assert store.apply_ttl({}) == ["events", "decisions"]


def test_every_saved_report_and_grafana_panel_runs_on_an_empty_database(engine):
    store = engine.open()
    query = lambda sql, params: store.query(sql, params)  # noqa: E731
    window = data_window(query, store.database, start=T0, end=T0 + timedelta(days=1))
    results = run_reports(query, store.database, window)
    assert [r.query.name for r in results] == [q.name for q in REPORTS]
    approvals = next(r for r in results if r.query.name == "approvals")
    assert approvals.rows == []
    for panel in dashboard()["panels"]:
        sql = grafana_macros(panel["targets"][0]["rawSql"], database=store.database,
                             from_ms=1677672000000, to_ms=1677758400000, interval_s=60)
        store.query(sql)


def test_unavailable_then_back_reopens_the_client(engine):
    store = engine.open()
    store.insert_new("usage", _usage_rows(3), USAGE, "usage_id")
    engine.down()
    with pytest.raises(UnavailableError):
        store.query("SELECT 1")
    with pytest.raises(UnavailableError):
        store.insert_new("usage", _usage_rows(3, offset=3), USAGE, "usage_id")
    engine.up()
    assert store.insert_new("usage", _usage_rows(6), USAGE, "usage_id") == 3
    assert store.query(f"SELECT count(), uniqExact(usage_id) FROM {store.database}.usage").rows == [(6, 6)]
