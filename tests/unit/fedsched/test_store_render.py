"""Schema as code: one definition renders single-node and cluster DDL."""

import re

import pytest

from fedsched.store import LOCAL_SUFFIX, SHARDING_KEYS, SchemaError, load_migrations, render_sql

TABLES = ("events", "usage", "decisions", "inventory")


def _all(**kwargs) -> list[str]:
    return [s for m in load_migrations() for s in render_sql(m.sql, "fedsched", **kwargs)]


def test_single_node_render():
    (m, *_) = load_migrations()
    stmts = render_sql(m.sql, "fedsched", ttl_days={"events": 400})
    assert any("CREATE TABLE IF NOT EXISTS fedsched.events" in s for s in stmts)
    assert all("{" not in s for s in stmts)
    events = next(s for s in stmts if "fedsched.events" in s)
    assert "ENGINE = ReplacingMergeTree(ingested_at)" in events and "INTERVAL 400 DAY" in events


def test_cluster_render_puts_distributed_tables_over_replicated_ones():
    stmts = _all(cluster="fed")
    assert all("ON CLUSTER fed" in s for s in stmts)
    for table in TABLES:
        local = next(s for s in stmts if s.startswith(f"CREATE TABLE IF NOT EXISTS fedsched.{table}{LOCAL_SUFFIX} "))
        assert ("ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)"
                in local)
        dist = next(s for s in stmts if s.startswith(f"CREATE TABLE IF NOT EXISTS fedsched.{table} "))
        assert f"AS fedsched.{table}{LOCAL_SUFFIX}" in dist
        assert f"ENGINE = Distributed(fed, fedsched, {table}{LOCAL_SUFFIX}, {SHARDING_KEYS[table]})" in dist
        # the Distributed table is created after the table it reads
        assert stmts.index(local) < stmts.index(dist)


def test_cluster_alters_change_columns_on_both_tables_and_settings_on_the_local_one():
    stmts = _all(cluster="fed")
    add = [s for s in stmts if "ADD COLUMN IF NOT EXISTS line" in s]
    assert sorted(re.match(r"ALTER TABLE (\S+)", s).group(1) for s in add) == ["fedsched.usage", "fedsched.usage_local"]
    # Replicated tables deduplicate inserts by themselves; the non-replicated window is single-node only
    assert not [s for s in stmts if "non_replicated_deduplication_window" in s]
    assert len([s for s in _all() if "non_replicated_deduplication_window" in s]) == 4


def test_cluster_render_refuses_statements_it_cannot_place():
    with pytest.raises(SchemaError):
        render_sql("INSERT INTO {db}.events SELECT 1", "fedsched", cluster="fed")


def test_rendered_ddl_parses_in_the_real_engine(store):
    """Both variants are valid ClickHouse SQL (parsed by the engine's own ``formatQuery``)."""
    for stmt in _all() + _all(cluster="fed", ttl_days={"events": 30}):
        formatted = store.query("SELECT formatQuery({q:String})", {"q": stmt}).scalar()
        assert formatted
