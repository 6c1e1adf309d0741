"""Schema as code: one definition renders single-node and cluster DDL."""

from fedsched.store import load_migrations, render_sql


def test_single_node_render():
    (m, *_) = load_migrations()
    stmts = render_sql(m.sql, "fedsched", ttl_days={"events": 400})
    assert any("CREATE TABLE IF NOT EXISTS fedsched.events" in s for s in stmts)
    assert all("{" not in s for s in stmts)
    events = next(s for s in stmts if "fedsched.events" in s)
    assert "ENGINE = ReplacingMergeTree(ingested_at)" in events and "INTERVAL 400 DAY" in events


def test_cluster_render_is_replicated_on_cluster():
    (m, *_) = load_migrations()
    stmts = render_sql(m.sql, "fedsched", cluster="fed")
    for s in stmts:
        assert "ON CLUSTER fed" in s
        assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)" in s
